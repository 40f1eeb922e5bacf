"""The start-up summary: one message on rank 0 saying how a run is laid out — dp × ep over how many ranks and
nodes, the dispatcher chosen and why, the experts each rank holds, and where training starts from.

It is logged at WARNING, the level the default settings show (Python's and transformers' default verbosity is
warning; transformers' example scripts log their per-process set-up line at WARNING for the same reason), once per
model: by ``HybridEP(Trainer).train()`` when it starts, where transformers' verbosity decides (``--log_level``,
``TRANSFORMERS_VERBOSITY``: ``error`` hides it), and otherwise on the library's logger ``hf_hybrid_ep`` at the
model's first training forward (``logging.getLogger("hf_hybrid_ep").setLevel(logging.ERROR)`` hides it).
"""

from __future__ import annotations

import logging

from torch import nn

from .state import state_of

logger = logging.getLogger("hf_hybrid_ep")


def startup_summary(model: nn.Module, start: str | None = None) -> str:
    """The summary of a parallelized ``model``; ``start``: where training starts from (``None``: the weights'
    source when :func:`hf_hybrid_ep.from_pretrained` read them, else left out)."""
    state = state_of(model)
    mesh, layers = state.mesh, state.layers
    per_node = mesh.ranks_per_node
    nodes = max(1, mesh.world_size // per_node)
    span = f" ({mesh.ep_span.kind})" if mesh.ep_span is not None else ""
    lines = [f"hybrid EP: {mesh.world_size} rank(s) = dp {mesh.dp_degree} × ep {mesh.ep_degree} on {nodes} node(s) "
             f"of {per_node} rank(s); an EP group spans {mesh.ep_nodes} node(s){span}",
             f"  dispatcher {state.dispatcher_choice}"]
    if layers:
        lines.append(f"  {len(layers)} MoE layer(s) of {layers[0].num_experts} experts, {layers[0].table.slots_per_rank} "
                     f"expert slot(s) per rank; optimizer sharding {state.config.optimizer_sharding}, dense weights "
                     f"{state.config.dense_sharding}")
    start = start if start is not None else (f"weights from {state.weights_from}" if state.weights_from else None)
    if start is not None:
        lines.append(f"  {start}")
    return "\n".join(lines)


def log_startup_summary(model: nn.Module, start: str | None = None, *, shown: bool = True) -> None:
    """Log :func:`startup_summary` on rank 0 at WARNING, once per model (``shown=False``: mark it logged without
    logging it, as when the Trainer's verbosity hides warnings)."""
    state = state_of(model)
    if state.summary_logged:
        return
    state.summary_logged = True
    if shown and state.mesh.rank == 0:
        logger.warning(startup_summary(model, start))
