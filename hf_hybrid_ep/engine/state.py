"""The per-model state :func:`hf_hybrid_ep.parallelize` attaches to a model, and the one way to read it back.

:func:`~hf_hybrid_ep.engine.setup.parallelize` attaches a :class:`HybridEPState` (``attach``); the
orchestration, checkpoint and integration code reads it with :func:`state_of`, like accelerate's
``add_hook_to_module`` / ``module._hf_hook``. Nothing below the orchestration layer reads it: the layers
under it (``parallel/``, ``dispatch/``, ``moe/``) receive the objects they work on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import HybridEPConfigError

if TYPE_CHECKING:
    from ..config import HybridEPConfig
    from ..moe.layer import ShardedExperts
    from ..moe.rebalance import Rebalancer
    from ..moe.shadow import ShadowManager
    from ..parallel.agreement import InputAgreement
    from ..parallel.grads import GradientReducer
    from ..parallel.mesh import HybridMesh
    from .backward import BackwardSequence

_ATTRIBUTE = "_hybrid_ep"


@dataclass
class SkippedSteps:
    """Optimizer steps skipped for a non-finite global gradient norm (:mod:`hf_hybrid_ep.engine.nonfinite`)."""

    total: int = 0
    consecutive: int = 0
    norm: torch.Tensor | float | None = None  # the global norm of the current gradients, once computed
    allowed: bool | None = None  # this step's decision, once taken (shared by every optimizer of the model)


@dataclass
class HybridEPState:
    """What ``parallelize`` attaches to a model: its layout, its EP layers and their helpers."""

    config: HybridEPConfig
    mesh: HybridMesh
    layers: list[ShardedExperts]
    reducer: GradientReducer
    backward: BackwardSequence
    agreement: InputAgreement
    optimizer_steps: int = 0
    shadows: ShadowManager | None = None  # hot-expert shadowing (config.shadow_experts)
    rebalancer: Rebalancer | None = None  # online rebalancing (config.rebalance_*)
    skipped: SkippedSteps = field(default_factory=SkippedSteps)
    dispatcher_choice: str = ""  # the backend asked for, the one chosen and why (the start-up summary says it)
    weights_from: str | None = None  # the checkpoint or Hub id from_pretrained read
    summary_logged: bool = False  # the start-up summary (:mod:`hf_hybrid_ep.engine.summary`) was logged

    def expert_parameter_names(self, model: nn.Module) -> list[str]:
        """Qualified names of this rank's expert parameters and their adapters' factors (e.g. for DDP's ignore
        list)."""
        ids = {id(p) for layer in self.layers for p in layer.slot_parameters()}
        return [n for n, p in model.named_parameters() if id(p) in ids]


def attach(model: nn.Module, state: HybridEPState, replace: bool = False) -> None:
    """Attach ``state`` to ``model`` (``replace``: in place of the state it carries).

    Raises:
        HybridEPConfigError: when the model already carries hybrid-EP state and ``replace`` is false.
    """
    if carries_state(model) and not replace:
        raise HybridEPConfigError(f"{type(model).__name__} is already parallelized")
    setattr(model, _ATTRIBUTE, state)


def is_parallelized(model: nn.Module) -> bool:
    """Whether :func:`hf_hybrid_ep.parallelize` prepared ``model``."""
    return getattr(model, _ATTRIBUTE, None) is not None


def carries_state(model: nn.Module) -> bool:
    """Whether ``model`` itself carries hybrid-EP state (not a module it forwards attribute look-ups to, as a
    ``PeftModel`` does to the model it wraps)."""
    return vars(model).get(_ATTRIBUTE) is not None


def state_of(model: nn.Module) -> HybridEPState:
    """The state :func:`hf_hybrid_ep.parallelize` attached to ``model``.

    Raises:
        ValueError: for a model that was not parallelized.
    """
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not prepared with hf_hybrid_ep.parallelize")
    return state


__all__ = ["HybridEPState", "SkippedSteps", "attach", "is_parallelized", "state_of"]
