"""The per-model state hf_hybrid_ep attaches to a model, and the one way to read it back.

:func:`hf_hybrid_ep.parallelize` attaches a :class:`HybridEPState` (``attach``); every module that needs
the mesh, the EP layers or the gradient reducer of a model reads it with :func:`state_of`, like
accelerate's ``add_hook_to_module`` / ``module._hf_hook``. Offloaded inference
(:func:`hf_hybrid_ep.offload`) attaches its layers the same way under its own name. This module imports
no other part of the package at run time, so anything may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .errors import HybridEPConfigError

if TYPE_CHECKING:
    from .config import HybridEPConfig
    from .inference.offload import OffloadedExperts
    from .moe.layer import ShardedExperts
    from .moe.rebalance import Rebalancer
    from .moe.shadow import ShadowManager
    from .parallel.agreement import InputAgreement
    from .parallel.grads import GradientReducer
    from .parallel.mesh import HybridMesh

_TRAINING = "_hybrid_ep"
_OFFLOAD = "_hybrid_ep_offload"


@dataclass
class HybridEPState:
    """What ``parallelize`` attaches to a model: its layout, its EP layers and their helpers."""

    config: HybridEPConfig
    mesh: HybridMesh
    layers: list[ShardedExperts]
    reducer: GradientReducer
    optimizer_steps: int = 0
    shadows: ShadowManager | None = None  # hot-expert shadowing (config.shadow_experts)
    rebalancer: Rebalancer | None = None  # online rebalancing (config.rebalance_*)
    agreement: InputAgreement | None = None  # bad inputs / layer mismatches seen in the counts exchanges

    def expert_parameter_names(self, model: nn.Module) -> list[str]:
        """Qualified names of this rank's expert parameters (e.g. for DDP's ignore list)."""
        ids = {id(p) for layer in self.layers for p in layer.expert_parameters()}
        return [n for n, p in model.named_parameters() if id(p) in ids]


def attach(model: nn.Module, state: HybridEPState) -> None:
    """Attach ``state`` to ``model``.

    Raises:
        HybridEPConfigError: when the model already carries hybrid-EP state.
    """
    if is_parallelized(model):
        raise HybridEPConfigError(f"{type(model).__name__} is already parallelized")
    setattr(model, _TRAINING, state)


def is_parallelized(model: nn.Module) -> bool:
    """Whether :func:`hf_hybrid_ep.parallelize` prepared ``model``."""
    return getattr(model, _TRAINING, None) is not None


def state_of(model: nn.Module) -> HybridEPState:
    """The state :func:`hf_hybrid_ep.parallelize` attached to ``model``.

    Raises:
        ValueError: for a model that was not parallelized.
    """
    return _read(model, _TRAINING, "hf_hybrid_ep.parallelize")


def detach(model: nn.Module) -> HybridEPState | None:
    """Remove and return the attached state (``None`` when there is none)."""
    return model.__dict__.pop(_TRAINING, None)


def attach_offload(model: nn.Module, layers: list[OffloadedExperts]) -> None:
    """Attach the offloaded expert layers of :func:`hf_hybrid_ep.offload` to ``model``."""
    setattr(model, _OFFLOAD, layers)


def offload_state_of(model: nn.Module) -> list[OffloadedExperts]:
    """The offloaded expert layers attached by :func:`hf_hybrid_ep.offload`.

    Raises:
        HybridEPConfigError: for a model that was not offloaded.
    """
    return _read(model, _OFFLOAD, "hf_hybrid_ep.offload", HybridEPConfigError)


def _read(model: nn.Module, attribute: str, prepared_by: str, error: type[Exception] = ValueError) -> Any:
    state = getattr(model, attribute, None)
    if state is None:
        raise error(f"{type(model).__name__} was not prepared with {prepared_by}")
    return state


__all__ = ["HybridEPState", "attach", "attach_offload", "detach", "is_parallelized", "offload_state_of", "state_of"]
