"""Tiny, randomly initialised transformers models for every ``@use_experts_implementation`` family.

Nothing is downloaded: configurations are built from the config classes' defaults, shrunk generically
(hidden size, heads, layers, vocabulary, experts, ...) and then fixed up per family where the generic
rules are not enough (hybrid layer patterns, MoE layer placement, multimodal composites, ...).

For multimodal composites only the text decoder (the part holding the decorated experts module) is built,
so :func:`tiny_config` returns the text sub-config for those families.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DECORATED_MODEL_TYPES",
    "SkipModel",
    "build_tiny_model",
    "experts_modules",
    "tiny_config",
    "tiny_inputs",
    "tiny_model_class",
]

_MODELS_DIR = Path(transformers.__file__).parent / "models"
_DECORATOR = "@use_experts_implementation"


def _discover_decorated_model_types() -> list[str]:
    """Scan ``transformers/models/*/modeling_*.py`` for the experts decorator and return the directory names."""
    found: set[str] = set()
    for path in _MODELS_DIR.glob("*/modeling_*.py"):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if _DECORATOR in text:
            found.add(path.parent.name)
    return sorted(found)


DECORATED_MODEL_TYPES: list[str] = _discover_decorated_model_types()


class SkipModel(Exception):
    """Raised (with a one-line reason) when a model type cannot be built tiny and offline."""


# --------------------------------------------------------------------------------------------------------------------
# attribute name tables
# --------------------------------------------------------------------------------------------------------------------

_EXPERT_COUNT_NAMES = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
    "n_experts",
)
_TOP_K_NAMES = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_k",
    "moe_topk",
    "top_k_experts",
    "experts_per_token",
    "num_selected_experts",
    "moe_top_k",
    "top_k",
)
_ZERO_FLOAT_NAMES = ("router_jitter_noise", "input_jitter_noise", "jitter_noise")
_FALSE_NAMES = ("output_router_logits",)
_DENSE_VALUES = ("dense", "mlp", "dense_mlp")
_MOE_VALUES = ("sparse", "moe", "expert", "experts")


# --------------------------------------------------------------------------------------------------------------------
# config class resolution
# --------------------------------------------------------------------------------------------------------------------


def _check_model_type(model_type: str) -> None:
    if model_type not in DECORATED_MODEL_TYPES:
        raise ValueError(f"{model_type!r} is not a model type using {_DECORATOR} (see DECORATED_MODEL_TYPES)")


def _import_family_module(model_type: str, prefix: str) -> list[Any]:
    """Import every ``<prefix>_*.py`` module of a model directory."""
    modules = []
    for path in sorted((_MODELS_DIR / model_type).glob(f"{prefix}_*.py")):
        modules.append(importlib.import_module(f"transformers.models.{model_type}.{path.stem}"))
    return modules


@functools.cache
def _top_config_class(model_type: str) -> type[PretrainedConfig]:
    """The top-level config class of a model directory (the composite one for multimodal families)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    classes: list[type[PretrainedConfig]] = []
    for module in _import_family_module(model_type, "configuration"):
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, PretrainedConfig)
                and obj.__module__ == module.__name__
            ):
                classes.append(obj)
    if not classes:
        raise SkipModel(f"{model_type}: no configuration class found")
    # the composite is the class that is nobody's sub-config
    nested = {c for cls in classes for c in getattr(cls, "sub_configs", {}).values()}
    top = [c for c in classes if c not in nested]
    return (top or classes)[0]


def _fields(config_cls: type[PretrainedConfig]) -> set[str]:
    if dataclasses.is_dataclass(config_cls):
        return {f.name for f in dataclasses.fields(config_cls)}
    return set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}


def _resolve(default: PretrainedConfig, name: str) -> str | None:
    """Canonical attribute name for ``name`` on a config (following ``attribute_map``), or None if absent."""
    fields = _fields(type(default))
    if name in fields:
        return name
    mapped = getattr(type(default), "attribute_map", {}).get(name)
    if mapped is not None and mapped in fields:
        return mapped
    return None


def _experts_count_attr(default: PretrainedConfig) -> str | None:
    for name in _EXPERT_COUNT_NAMES:
        resolved = _resolve(default, name)
        if resolved is not None:
            return resolved
    return None


def _sub_config_names(config: PretrainedConfig) -> list[str]:
    names = [
        n
        for n in getattr(config, "sub_configs", {})
        if isinstance(getattr(config, n, None), PretrainedConfig)
    ]

    def rank(name: str) -> tuple[int, str]:
        if "text" in name:
            return (0, name)
        if "thinker" in name:
            return (1, name)
        if "talker" in name:
            return (3, name)
        return (2, name)

    return sorted(names, key=rank)


def _find_experts_path(config: PretrainedConfig) -> list[str] | None:
    """Path of sub-config attribute names from ``config`` to the config that owns the experts (depth first)."""
    if _experts_count_attr(config) is not None and not _sub_config_names(config):
        return []
    for name in _sub_config_names(config):
        sub_path = _find_experts_path(getattr(config, name))
        if sub_path is not None:
            return [name, *sub_path]
    if _experts_count_attr(config) is not None:
        return []
    return None


def _default_config(config_cls: type[PretrainedConfig]) -> PretrainedConfig:
    """Default instance whose (possibly per-layer) attributes can all be read globally."""
    default = config_cls()
    if hasattr(default, "allow_global_per_layer_attribute_access"):
        default.allow_global_per_layer_attribute_access = True
    return default


@functools.cache
def _experts_config_class(model_type: str) -> type[PretrainedConfig]:
    """Config class of the (text) model that holds the decorated experts."""
    top_cls = _top_config_class(model_type)
    try:
        top = _default_config(top_cls)
    except Exception as exc:  # pragma: no cover - depends on transformers version
        raise SkipModel(f"{model_type}: default {top_cls.__name__}() fails: {exc}") from exc
    path = _find_experts_path(top)
    if path is None:
        raise SkipModel(f"{model_type}: no config in {top_cls.__name__} defines a number of experts")
    config = top
    for name in path:
        config = getattr(config, name)
    return type(config)


# --------------------------------------------------------------------------------------------------------------------
# generic shrinking
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Shrink:
    """Parameters of one tiny-config request."""

    model_type: str
    num_experts: int
    top_k: int
    num_layers: int
    hidden: int
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 32
    vocab: int = 128
    max_positions: int = 256


def _rebuild_layer_list(values: list[Any], n: int, first_dense: int) -> list[Any]:
    """Shrink a per-layer list to ``n`` entries keeping every distinct kind (MoE kinds after ``first_dense`` dense)."""
    lowered = [str(v).lower() for v in values]
    is_mlp_list = any(v in _DENSE_VALUES or v in _MOE_VALUES for v in lowered)
    if is_mlp_list:
        moe: list[Any] = []
        for v, low in zip(values, lowered, strict=True):
            if low not in _DENSE_VALUES and v not in moe:
                moe.append(v)
        if not moe:
            return list(values[:n])
        n_dense = min(first_dense, n - 1) if lowered[0] in _DENSE_VALUES else 0
        n_moe = n - n_dense
        tail = moe[-n_moe:] if len(moe) >= n_moe else [moe[0]] * (n_moe - len(moe)) + moe
        return [values[0]] * n_dense + tail
    distinct: list[Any] = []
    for v in values:
        if v not in distinct:
            distinct.append(v)
    # the first layer keeps its kind (e.g. a "full" indexer that later "shared" layers reuse), then every other kind;
    # a single layer must not be a linear-attention / SSM / conv mixer (forwards read lengths off attention caches)
    if n == 1:
        attention = [v for v in distinct if not any(k in str(v).lower() for k in ("linear", "mamba", "conv"))]
        return [(attention or distinct)[0]]
    if len(distinct) >= n:
        return distinct[:n]
    return [distinct[0]] * (n - len(distinct)) + distinct


def _generic_overrides(default: PretrainedConfig, s: _Shrink) -> dict[str, Any]:
    """Keyword overrides that shrink ``default`` (only attributes that the config class defines)."""
    fields = _fields(type(default))
    stored = vars(default)  # plain storage: no per-layer-attribute access warnings
    values = {name: stored[name] if name in stored else getattr(default, name, None) for name in fields}
    o: dict[str, Any] = {}

    def put(name: str, value: Any, *, when_none: bool = True) -> None:
        resolved = _resolve(default, name)
        if resolved is None:
            return
        if not when_none and not values.get(resolved):
            return  # None or 0 usually means "derived" or "disabled": keep it
        o[resolved] = value

    put("hidden_size", s.hidden)
    put("d_model", s.hidden, when_none=False)
    for name in fields:
        if name.endswith("intermediate_size") and (
            values[name] is not None or name == "moe_intermediate_size"
        ):
            if isinstance(values[name], int) or values[name] is None:
                o[name] = s.intermediate
            elif isinstance(values[name], (list, tuple)) and all(isinstance(v, int) for v in values[name]):
                o[name] = [s.intermediate] * len(values[name])  # e.g. [text, vision] expert widths
    put("num_hidden_layers", s.num_layers)
    put("num_attention_heads", s.heads)
    put("num_key_value_heads", s.kv_heads, when_none=False)
    if _resolve(default, "head_dim") and values.get(_resolve(default, "head_dim")) != 0:
        put("head_dim", s.head_dim)  # 0 means "derived" (e.g. from the RoPE dim of latent attention)
    put("vocab_size", s.vocab)
    if not _has_yarn_original_length(values.get("rope_parameters")):
        # (YaRN checks max_position_embeddings against original_max_position_embeddings * factor)
        put("max_position_embeddings", s.max_positions, when_none=False)

    # experts
    count = _experts_count_attr(default)
    if count is not None:
        o[count] = s.num_experts
    for name in _TOP_K_NAMES:
        resolved = _resolve(default, name)
        if resolved is not None and resolved != count:
            o[resolved] = s.top_k
            break
    groups = _resolve(default, "n_group") or _resolve(default, "num_expert_group")
    if groups is not None and (values.get(groups) or 0) > 1:
        # group-limited routing: topk_group=1 group must still hold >= max(2, top_k) experts
        o[groups] = 2 if s.num_experts % 2 == 0 and s.num_experts // 2 >= max(2, s.top_k) else 1
        if _resolve(default, "topk_group"):
            o[_resolve(default, "topk_group")] = 1
    for name in ("first_k_dense_replace", "num_dense_layers"):
        if _resolve(default, name) and values.get(_resolve(default, name)):
            o[_resolve(default, name)] = 1 if s.num_layers >= 2 else 0
    if values.get("mlp_only_layers"):
        o["mlp_only_layers"] = [0] if 0 in values["mlp_only_layers"] and s.num_layers >= 2 else []
    put("decoder_sparse_step", 1, when_none=False)
    start = values.get("moe_layer_start_index")
    if isinstance(start, int) and start >= s.num_layers:
        o["moe_layer_start_index"] = s.num_layers - 1
    end = values.get("moe_layer_end_index")
    if isinstance(end, int) and end >= s.num_layers:
        o["moe_layer_end_index"] = s.num_layers - 1
    for name in _ZERO_FLOAT_NAMES:
        put(name, 0.0)
    for name in _FALSE_NAMES:
        put(name, False)
    for name in fields:
        is_dropout = "dropout" in name or name.endswith("pdrop")
        if is_dropout and isinstance(values[name], (int, float)) and not isinstance(values[name], bool):
            o[name] = 0.0

    # multi-head latent attention and other attention dims
    put("kv_lora_rank", 16, when_none=False)
    put("q_lora_rank", 32, when_none=False)
    put("qk_rope_head_dim", 8, when_none=False)
    put("qk_nope_head_dim", 8, when_none=False)
    put("v_head_dim", 16, when_none=False)
    put("index_head_dim", 16, when_none=False)
    put("index_n_heads", 2, when_none=False)
    put("linear_num_key_heads", 2, when_none=False)
    put("linear_num_value_heads", 4, when_none=False)
    put("linear_key_head_dim", 16, when_none=False)
    put("linear_value_head_dim", 16, when_none=False)
    put("linear_num_heads", 4, when_none=False)
    put("linear_head_dim", 16, when_none=False)
    put("swa_num_attention_heads", s.heads, when_none=False)
    put("swa_num_key_value_heads", s.kv_heads, when_none=False)
    put("swa_head_dim", s.head_dim, when_none=False)
    put("o_lora_rank", 16, when_none=False)
    put("o_groups", 2, when_none=False)
    if isinstance(values.get("num_attention_heads_per_layer"), list):
        o["num_attention_heads_per_layer"] = [s.heads] * s.num_layers

    # Mamba / SSM mixers: expand * hidden == heads * head_dim
    expand = values.get("mamba_expand") or 2
    put("mamba_d_state", 16, when_none=False)
    put("ssm_state_size", 16, when_none=False)
    put("mamba_d_head", 16, when_none=False)
    put("mamba_head_dim", 16, when_none=False)
    put("mamba_n_heads", expand * s.hidden // 16, when_none=False)
    put("mamba_num_heads", expand * s.hidden // 16, when_none=False)
    if isinstance(values.get("mamba_dt_rank"), int):
        o["mamba_dt_rank"] = max(1, s.hidden // 16)
    if _resolve(default, "kv_lora_rank") and _resolve(default, "num_key_value_heads"):
        # multi-head latent attention has no grouped-query attention
        o[_resolve(default, "num_key_value_heads")] = s.heads

    # special token ids must fit the tiny vocabulary
    for name, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        current = values.get(name)
        if current is not None:
            o[name] = [value] if isinstance(current, list) else value

    # per-layer lists
    old_layers = values.get("num_hidden_layers")
    first_dense = o.get("first_k_dense_replace", o.get("num_dense_layers", 1))
    for name, value in values.items():
        if name in o:
            continue
        if isinstance(value, list) and old_layers and len(value) == old_layers and old_layers != s.num_layers:
            o[name] = _rebuild_layer_list(value, s.num_layers, first_dense)

    # heterogeneous (per-layer) configs: keep the tiny model homogeneous
    if vars(default).get("per_layer_config"):
        o["per_layer_config"] = {}

    # rope: M-RoPE sections must add up to head_dim // 2
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        partial = rope.get("partial_rotary_factor", vars(default).get("partial_rotary_factor") or 1.0)
        o["rope_parameters"] = _scaled_mrope(rope, int(_tiny_head_dim(o, s) * partial))
    # a None shared-experts count would make the shared-expert width None * moe_intermediate_size (dots1)
    for name in ("n_shared_experts", "num_shared_experts"):
        if name in fields and values.get(name) is None and "moe_intermediate_size" in fields:
            o[name] = 1
    return o


def _has_yarn_original_length(rope: Any) -> bool:
    """Whether a (possibly per-layer-type) rope dict pins ``original_max_position_embeddings``."""
    if not isinstance(rope, dict):
        return False
    if "original_max_position_embeddings" in rope:
        return True
    return any(_has_yarn_original_length(v) for v in rope.values() if isinstance(v, dict))


def _tiny_head_dim(o: dict[str, Any], s: _Shrink) -> int:
    """The attention head size the tiny model will use (explicit ``head_dim`` or hidden // heads)."""
    return int(o.get("head_dim") or s.hidden // s.heads)


def _scaled_mrope(rope: dict[str, Any], rotary_dim: int, sections: list[int] | None = None) -> dict[str, Any]:
    """Scale ``mrope_section`` so that it adds up to ``rotary_dim // 2``."""
    rope = dict(rope)
    sections = list(sections if sections is not None else rope["mrope_section"])
    half = rotary_dim // 2
    total = sum(sections)
    exact = [v * half / total for v in sections]
    scaled = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: scaled[i] - exact[i])
    for i in by_remainder[: half - sum(scaled)]:
        scaled[i] += 1
    rope["mrope_section"] = scaled
    return rope


# --------------------------------------------------------------------------------------------------------------------
# per-family fixes (applied to the override dict, before the config is constructed)
# --------------------------------------------------------------------------------------------------------------------

_Fix = Callable[[dict[str, Any], PretrainedConfig, _Shrink], None]
_FIXES: dict[str, list[_Fix]] = {}


def _fix(*model_types: str) -> Callable[[_Fix], _Fix]:
    """Register ``fn(overrides, default_config, shrink)`` as a fix-up for ``model_types``."""

    def register(fn: _Fix) -> _Fix:
        for model_type in model_types:
            _FIXES.setdefault(model_type, []).append(fn)
        return fn

    return register


@_fix("unlimited_ocr")
def _no_gqa(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """This text decoder's eager attention has no key/value head repetition."""
    o["num_key_value_heads"] = s.heads


@_fix("deepseek_ocr2")
def _deepseek_ocr2(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """No GQA in the eager attention; ``mlp_layer_types`` defaults to None but the decoder indexes it."""
    o["num_key_value_heads"] = s.heads
    o["mlp_layer_types"] = _leading_dense(s.num_layers, "dense", "sparse")


@_fix("gemma4", "diffusion_gemma")
def _gemma4(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """The MoE block is opt-in; the per-layer-input embeddings are sized separately."""
    if "enable_moe_block" in _fields(type(default)):
        o["enable_moe_block"] = True
    for name in ("vocab_size_per_layer_input",):
        if name in _fields(type(default)):
            o[name] = s.vocab
    for name in ("hidden_size_per_layer_input",):
        if name in _fields(type(default)):
            o[name] = 16


@_fix("qwen4_exp")
def _qwen4_exp(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """Indexed-attention layers need the (all-None by default) QSA indexer settings."""
    o.update(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=s.head_dim,
        indexer_budget=4,
        indexer_compress_ratio=2,
        hc_lowrank=8,
    )


@_fix("zaya")
def _zaya(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """ZAYA validates ``num_experts_per_tok == 1``: ``top_k`` is ignored."""
    o["num_experts_per_tok"] = 1
    o["router_hidden_size"] = 16


@_fix("lfm2_moe")
def _lfm2_moe(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """``layer_types`` defaults to None but the decoder indexes it; conv layers first, attention last."""
    o["layer_types"] = ["conv"] * (s.num_layers - 1) + ["full_attention"]


@_fix("muse_spark")
def _muse_spark(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """Experts run in their own width (``moe_hidden_size``), projected from/to ``hidden_size``."""
    o["moe_hidden_size"] = s.hidden


@_fix("nemotron_h")
def _nemotron_h(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """Each "layer" is one mixer block (mamba / attention / mlp / moe); end with a MoE block."""
    kinds = ["full_attention", "linear_attention", "moe", "mlp"]
    o.pop("num_hidden_layers", None)
    # at least one attention block: the forward reads the sequence length off an attention cache
    o["layers_block_type"] = [kinds[i % len(kinds)] for i in range(max(1, s.num_layers - 1))] + ["moe"]


@_fix("granitemoehybrid")
def _granitemoehybrid(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """The default is mamba-only, which the forward rejects (it reads the sequence length off an attention cache)."""
    o["layer_types"] = ["linear_attention"] * (s.num_layers - 1) + ["full_attention"]


@_fix("jamba")
def _jamba(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """Layer kinds come from periods/offsets: last layer attention, every layer MoE."""
    o["attn_layer_period"] = s.num_layers
    o["attn_layer_offset"] = s.num_layers - 1
    o["expert_layer_period"] = 1
    o["expert_layer_offset"] = 0


_MROPE_FALLBACK = {"ernie4_5_vl_moe": [22, 22, 20], "glm4v_moe": [8, 12, 12]}


@_fix(*_MROPE_FALLBACK)
def _mrope_fallback(o: dict[str, Any], default: PretrainedConfig, s: _Shrink) -> None:
    """The rotary embedding falls back to a full-size ``mrope_section`` when the config does not set one."""
    rope = dict(default.rope_parameters or {})
    partial = rope.get("partial_rotary_factor", 1.0)
    sections = rope.get("mrope_section", _MROPE_FALLBACK[s.model_type])
    rope = _scaled_mrope(rope, int(_tiny_head_dim(o, s) * partial), sections)
    if s.model_type == "ernie4_5_vl_moe":
        # ERNIE interleaves the height and width sections: they must stay equal
        half = sum(rope["mrope_section"])
        hw = max(1, round(half * (sections[0] + sections[1]) / sum(sections) / 2))
        rope["mrope_section"] = [hw, hw, half - 2 * hw]
    o["rope_parameters"] = rope


def _leading_dense(n: int, dense: Any, moe: Any, n_dense: int = 1) -> list[Any]:
    """``n_dense`` dense layers (at most ``n - 1``) followed by MoE layers."""
    k = max(0, min(n_dense, n - 1))
    return [dense] * k + [moe] * (n - k)


# --------------------------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------------------------


def tiny_config(
    model_type: str,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    num_layers: int = 2,
    hidden: int = 64,
    seed: int | None = None,
) -> PretrainedConfig:
    """Build a tiny config for ``model_type`` (a directory name in ``transformers.models``).

    For multimodal composites this is the text sub-config (the one whose model holds the experts), i.e. always the
    config that :func:`build_tiny_model` instantiates. ``seed`` is accepted for API symmetry; building a config is
    deterministic. ZAYA only supports one expert per token, so ``top_k`` is ignored (forced to 1) for ``zaya``.
    """
    del seed
    _check_model_type(model_type)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > num_experts={num_experts}")
    config_cls = _experts_config_class(model_type)
    default = _default_config(config_cls)
    shrink = _Shrink(model_type, num_experts, top_k, num_layers, hidden)
    overrides = _generic_overrides(default, shrink)
    for fix in _FIXES.get(model_type, []):
        fix(overrides, default, shrink)
    try:
        config = config_cls(**overrides)
    except Exception as exc:
        raise RuntimeError(f"{model_type}: {config_cls.__name__}(**{overrides}) failed: {exc}") from exc
    return config


def tiny_model_class(model_type: str) -> type[PreTrainedModel]:
    """The model class :func:`build_tiny_model` uses: causal LM if there is one, else the (text) base model."""
    _check_model_type(model_type)
    config_cls = _experts_config_class(model_type)
    candidates: list[type[PreTrainedModel]] = []
    for module in _import_family_module(model_type, "modeling"):
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, PreTrainedModel)
                and obj.__module__ == module.__name__
                and obj.config_class is config_cls
                and not obj.__name__.endswith("PreTrainedModel")
            ):
                candidates.append(obj)

    def rank(cls: type[PreTrainedModel]) -> tuple[int, str]:
        name = cls.__name__
        if name.endswith("ForCausalLM"):
            return (0, name)
        if name.endswith("TextModel"):
            return (1, name)
        if name.endswith("Model"):
            return (2, name)
        return (3, name)

    candidates = [c for c in candidates if rank(c)[0] < 3]
    if not candidates:
        raise SkipModel(f"{model_type}: no causal-LM / base model class for {config_cls.__name__}")
    return sorted(candidates, key=rank)[0]


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every ``@use_experts_implementation`` experts module in ``model``."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "_is_expert_parallel") and hasattr(module, "is_transposed")
    ]


def _check_experts(model_type: str, model: torch.nn.Module, num_experts: int) -> None:
    found = experts_modules(model)
    if not found:
        raise SkipModel(f"{model_type}: the tiny model contains no decorated experts module")
    for name, module in found:
        params = dict(module.named_parameters(recurse=False))
        if not any(p.dim() == 3 for p in params.values()):
            raise SkipModel(f"{model_type}: experts module {name} has no 3-D parameters")
        # 3-D weights and 2-D biases are all per expert
        bad = {k: tuple(p.shape) for k, p in params.items() if p.dim() >= 2 and p.shape[0] != num_experts}
        if bad:
            raise SkipModel(f"{model_type}: experts module {name} does not hold {num_experts} experts: {bad}")


def build_tiny_model(model_type: str, **kw: Any) -> torch.nn.Module:
    """Build a tiny fp32 model (eager attention, eval mode) for ``model_type``.

    Keyword arguments are those of :func:`tiny_config`. The weights are initialised from the global torch RNG (or
    from ``seed`` when given), so two builds after the same ``torch.manual_seed`` are identical.
    """
    seed = kw.get("seed")
    config = tiny_config(model_type, **kw)
    num_experts = getattr(config, _experts_count_attr(config) or "num_experts")
    model_cls = tiny_model_class(model_type)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    except ImportError as exc:  # a kernel / optional package the family insists on
        raise SkipModel(
            f"{model_type}: {model_cls.__name__} needs a package that is not installed: {exc}"
        ) from exc
    model = model.float().eval()
    _check_experts(model_type, model, num_experts)
    return model


def _is_causal_lm(model: torch.nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM")


def tiny_inputs(
    model: torch.nn.Module,
    batch: int,
    seq: int,
    generator: torch.Generator,
    *,
    exercise_all_experts: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs)`` running a plain text forward (``labels`` for causal LMs).

    Token ids are drawn from ``[3, vocab_size)`` with ``generator`` (ids 0-2 are the tiny pad/bos/eos ids).
    With ``exercise_all_experts=True``, families whose layers hold several experts modules selected by token
    modality (ERNIE-4.5-VL: text and vision experts) also get modality ids that route the second half of every
    sequence to the non-text experts, so that every experts module runs forward and backward.
    """
    config = model.config
    vocab = int(config.vocab_size)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if exercise_all_experts:
        extra = _ALL_EXPERTS_INPUTS.get(_model_type_of(model))
        if extra is not None:
            inputs.update(extra(input_ids))
    if _is_causal_lm(model):
        inputs["labels"] = input_ids.clone()
    return inputs


def _model_type_of(model: torch.nn.Module) -> str:
    module = type(model).__module__
    match = re.match(r"transformers\.models\.([^.]+)\.", module)
    return match.group(1) if match else ""


def _second_half_vision(input_ids: torch.Tensor) -> dict[str, Any]:
    token_types = torch.zeros_like(input_ids)
    token_types[:, input_ids.shape[1] // 2 :] = 1
    return {"moe_mm_token_type_ids": token_types}


_ALL_EXPERTS_INPUTS: dict[str, Callable[[torch.Tensor], dict[str, Any]]] = {
    "ernie4_5_vl_moe": _second_half_vision,
}
