"""The replica check of a parallelized model: every replicated tensor bit-identical across its replicas
(:func:`hf_hybrid_ep.parallel.consistency.verify_replicas` on the model's dense parameters and expert slots)."""

from __future__ import annotations

from torch import nn

from ..parallel.consistency import verify_replicas
from .optimizers import wait_for_parameters
from .state import state_of


def verify_model_replicas(model: nn.Module) -> None:
    """Raise :class:`~hf_hybrid_ep.errors.ReplicaDivergenceError` on every rank if any replicated parameter of
    ``model`` differs between its replicas, naming the first and the ranks. Collective: call on every rank."""
    state = state_of(model)
    wait_for_parameters(model)
    expert_ids = {id(h.param) for h in state.reducer.holdings}
    dense = [(n, p) for n, p in model.named_parameters() if id(p) not in expert_ids]
    names = {id(p): n for n, p in model.named_parameters()}
    verify_replicas(state.mesh, dense, state.reducer.holder_groups, names)
