"""Shrinking: the generic keyword overrides that turn a family's default config into a tiny one.

:func:`_generic_overrides` shrinks hidden size, heads, layers, vocabulary, experts, latent-attention and
Mamba dimensions, per-layer lists and M-RoPE sections, touching only attributes the config class
defines. It runs as named steps in a fixed order (later steps may overwrite earlier ones, and the
per-layer lists only fill names no earlier step set). Per-family fixes applied after it live in
:mod:`tiny_models.fixes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from transformers import PretrainedConfig

from .discovery import _experts_count_attr, _fields, _resolve

# --------------------------------------------------------------------------------------------------------------------
# attribute name tables
# --------------------------------------------------------------------------------------------------------------------

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


@dataclasses.dataclass
class _Overrides:
    """The override dict ``o`` being built for ``default``, with the config class's fields and stored values."""

    default: PretrainedConfig
    fields: set[str]
    values: dict[str, Any]
    o: dict[str, Any]

    @classmethod
    def of(cls, default: PretrainedConfig) -> _Overrides:
        fields = _fields(type(default))
        stored = vars(default)  # plain storage: no per-layer-attribute access warnings
        values = {name: stored[name] if name in stored else getattr(default, name, None) for name in fields}
        return cls(default, fields, values, {})

    def put(self, name: str, value: Any, *, when_none: bool = True) -> None:
        resolved = _resolve(self.default, name)
        if resolved is None:
            return
        if not when_none and not self.values.get(resolved):
            return  # None or 0 usually means "derived" or "disabled": keep it
        self.o[resolved] = value


def _shrink_sizes(ov: _Overrides, s: _Shrink) -> None:
    """Hidden and intermediate widths, layers, heads, head size, vocabulary and positions."""
    default, fields, values, o, put = ov.default, ov.fields, ov.values, ov.o, ov.put
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


def _shrink_experts(ov: _Overrides, s: _Shrink) -> None:
    """Expert count and top-k, expert groups, dense/MoE layer placement, jitter, router logits, dropout."""
    default, fields, values, o, put = ov.default, ov.fields, ov.values, ov.o, ov.put
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


def _shrink_attention(ov: _Overrides, s: _Shrink) -> None:
    """Multi-head latent attention and other attention dims."""
    values, o, put = ov.values, ov.o, ov.put
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


def _shrink_mamba(ov: _Overrides, s: _Shrink) -> None:
    """Mamba / SSM mixers: expand * hidden == heads * head_dim."""
    values, o, put = ov.values, ov.o, ov.put
    expand = values.get("mamba_expand") or 2
    put("mamba_d_state", 16, when_none=False)
    put("ssm_state_size", 16, when_none=False)
    put("mamba_d_head", 16, when_none=False)
    put("mamba_head_dim", 16, when_none=False)
    put("mamba_n_heads", expand * s.hidden // 16, when_none=False)
    put("mamba_num_heads", expand * s.hidden // 16, when_none=False)
    if isinstance(values.get("mamba_dt_rank"), int):
        o["mamba_dt_rank"] = max(1, s.hidden // 16)


def _latent_attention_heads(ov: _Overrides, s: _Shrink) -> None:
    """Multi-head latent attention has no grouped-query attention."""
    if _resolve(ov.default, "kv_lora_rank") and _resolve(ov.default, "num_key_value_heads"):
        ov.o[_resolve(ov.default, "num_key_value_heads")] = s.heads


def _fit_token_ids(ov: _Overrides, s: _Shrink) -> None:
    """Special token ids must fit the tiny vocabulary."""
    for name, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        current = ov.values.get(name)
        if current is not None:
            ov.o[name] = [value] if isinstance(current, list) else value


def _shrink_layer_lists(ov: _Overrides, s: _Shrink) -> None:
    """Per-layer lists not set by an earlier step; heterogeneous (per-layer) configs made homogeneous."""
    default, values, o = ov.default, ov.values, ov.o
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


def _fit_rope_and_shared_experts(ov: _Overrides, s: _Shrink) -> None:
    """M-RoPE sections that add up to head_dim // 2, and a shared-experts count where None would break."""
    default, fields, values, o = ov.default, ov.fields, ov.values, ov.o
    # rope: M-RoPE sections must add up to head_dim // 2
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        partial = rope.get("partial_rotary_factor", vars(default).get("partial_rotary_factor") or 1.0)
        o["rope_parameters"] = _scaled_mrope(rope, int(_tiny_head_dim(o, s) * partial))
    # a None shared-experts count would make the shared-expert width None * moe_intermediate_size (dots1)
    for name in ("n_shared_experts", "num_shared_experts"):
        if name in fields and values.get(name) is None and "moe_intermediate_size" in fields:
            o[name] = 1


_STEPS: tuple[Callable[[_Overrides, _Shrink], None], ...] = (
    _shrink_sizes,
    _shrink_experts,
    _shrink_attention,
    _shrink_mamba,
    _latent_attention_heads,
    _fit_token_ids,
    _shrink_layer_lists,
    _fit_rope_and_shared_experts,
)


def _generic_overrides(default: PretrainedConfig, s: _Shrink) -> dict[str, Any]:
    """Keyword overrides that shrink ``default`` (only attributes that the config class defines)."""
    ov = _Overrides.of(default)
    for step in _STEPS:
        step(ov, s)
    return ov.o


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
