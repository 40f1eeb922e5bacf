"""What a parallelized model moved: the dispatchers' and the gradient reducer's counters."""

from __future__ import annotations

from torch import nn

from .state import state_of

GRADIENT_REDUCTION = "gradient_reduction"  # the reducer's entry of comm_stats; the others are MoE layers


def comm_stats(model: nn.Module) -> dict[str, dict]:
    """Per-layer dispatcher counters and the reducer's all-reduced bytes under ``"gradient_reduction"``
    (this rank, since last reset)."""
    state = state_of(model)
    out: dict[str, dict] = {layer.name: layer.stats.as_dict() for layer in state.layers}
    r = state.reducer.stats
    out[GRADIENT_REDUCTION] = {"reductions": r.reductions, "dense_bytes": r.dense_bytes, "expert_bytes": r.expert_bytes,
                                 "buckets_launched_in_backward": r.buckets_launched_in_backward,
                                 "buckets_launched_at_end": r.buckets_launched_at_end,
                                 "ready_to_end_s": r.ready_to_end_s}
    return out


def layer_counters(stats: dict[str, dict]) -> list[dict]:
    """The per-MoE-layer dispatcher counters of a :func:`comm_stats` result, in layer order."""
    return [v for k, v in stats.items() if k != GRADIENT_REDUCTION]


def reset_comm_stats(model: nn.Module) -> None:
    state = state_of(model)
    for layer in state.layers:
        layer.stats.reset()
    state.reducer.stats.reset()
