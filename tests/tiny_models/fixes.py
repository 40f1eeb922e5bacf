"""Per-family fixes: where the generic shrinking of :mod:`tiny_models.shrinking` is not enough.

Config fixes (hybrid layer patterns, MoE layer placement, opt-in MoE blocks, M-RoPE fallbacks, ...) are
registered with :func:`_fix` in :data:`_FIXES` and applied, in registration order, to the override dict
before the config is constructed. :data:`_ALL_EXPERTS_INPUTS` holds the extra inputs that make every
experts module of a family run (ERNIE-4.5-VL's modality ids).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PretrainedConfig

from .discovery import _fields
from .shrinking import _scaled_mrope, _Shrink, _tiny_head_dim

# --------------------------------------------------------------------------------------------------------------------
# config fixes (applied to the override dict, before the config is constructed)
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
# inputs that exercise every experts module
# --------------------------------------------------------------------------------------------------------------------


def _second_half_vision(input_ids: torch.Tensor) -> dict[str, Any]:
    token_types = torch.zeros_like(input_ids)
    token_types[:, input_ids.shape[1] // 2 :] = 1
    return {"moe_mm_token_type_ids": token_types}


_ALL_EXPERTS_INPUTS: dict[str, Callable[[torch.Tensor], dict[str, Any]]] = {
    "ernie4_5_vl_moe": _second_half_vision,
}
