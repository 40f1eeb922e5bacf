"""No step poisons the model: an optimizer step whose global gradient norm is NaN or inf is skipped on every rank.

The global gradient norm (:func:`hf_hybrid_ep.clip_grad_norm_`, which the Trainer always calls; in a loop of your
own ``clip_grad_norm_(model, float("inf"))`` measures it without clipping) is the same number on every rank, so
every rank takes the same decision without another collective; a step that comes without one is not checked (the
optimizer step never issues a collective of its own: ranks that disagree on whether to step, as an fp16 loss
scaler without agreement makes them, must not hang there). One process-wide optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
applies it: before any optimizer that holds a parallelized model's parameters steps — whichever optimizer the
user built — the gradients it would read are dropped when the step is skipped, so it changes nothing (no moment,
no weight decay, no step count). A skip is counted (``state_of(model).skipped``) and logged on rank 0 with the
layers whose gradients were non-finite and the ranks that saw them; ``on_nonfinite_grad="stop"``, or
``max_consecutive_skips`` skips in a row, end the run with :class:`~hf_hybrid_ep.errors.NonFiniteGradientError`
on every rank, naming them.

The same hook finds the optimizer that holds a model's experts, for online rebalancing (:func:`holds_experts`,
:func:`rebalancing_optimizer`).
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import HybridEPConfigError, NonFiniteGradientError
from ..moe.rebalance import unwrap_optimizer
from ..parallel.mesh import local_tensor
from ..parallel.zero import ShardedOptimizer
from .state import HybridEPState, state_of

logger = logging.getLogger("hf_hybrid_ep")

_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every parallelized model of this process
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> weak references to its models
_HOOK: list = []


def watch_optimizers(model: nn.Module) -> None:
    """Check every optimizer step of ``model``'s parameters from now on (``parallelize`` calls this)."""
    _MODELS.add(model)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _holds(optimizer: torch.optim.Optimizer, state: HybridEPState, params: list[nn.Parameter]) -> bool:
    """Whether ``optimizer`` steps any of ``params`` (a ZeRO-1 optimizer: whether it shards this model)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.hybrid_sharding.reducer is state.reducer
    ids = {id(p) for p in params}
    return any(id(p) in ids for group in optimizer.param_groups for p in group["params"])


def holds_experts(optimizer, state: HybridEPState) -> bool:
    """Whether ``optimizer`` (or the optimizer inside a wrapper) steps the model's expert parameters."""
    experts = [p for layer in state.layers for p in layer.expert_parameters()]
    return _holds(unwrap_optimizer(optimizer), state, experts)


def _models_of(optimizer: torch.optim.Optimizer) -> list[nn.Module]:
    refs = _HELD.get(optimizer)
    if refs is None:
        refs = [weakref.ref(m) for m in list(_MODELS)
                if _holds(optimizer, state_of(m), list(state_of(m).reducer.parameters()))]
        _HELD[optimizer] = refs
    return [m for m in (r() for r in refs) if m is not None]


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for model in _models_of(optimizer):
        state = state_of(model)
        rebalancer = state.rebalancer
        if rebalancer is not None and rebalancer.optimizer is not optimizer and holds_experts(optimizer, state):
            rebalancer.optimizer = optimizer  # the optimizer that holds the experts: their state moves with them
        if not step_allowed(model):
            _drop_gradients(optimizer)


def _drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """No gradient for the optimizer to read: its step updates nothing."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    for p in getattr(optimizer, "hybrid_model_params", ()):  # ZeRO-1: its step re-attaches the views from these
        p.grad = None


def record_norm(model: nn.Module, norm: torch.Tensor | float) -> None:
    """The global gradient norm of the current gradients (clipping and the Trainer's log compute it); kept as
    given, read on the host once, when the optimizer step is decided."""
    state_of(model).skipped.norm = norm


def new_gradients(model: nn.Module) -> None:
    """Gradients are about to change (a differentiated forward, an optimizer step done): decide anew."""
    skipped = state_of(model).skipped
    skipped.norm = skipped.allowed = None


def step_allowed(model: nn.Module) -> bool:
    """Whether this step's optimizer steps may run: the global gradient norm computed since the gradients changed
    is finite (``True`` when none was computed). Collective on the skip path only (naming the layers), which every
    rank takes together.

    Raises:
        NonFiniteGradientError: on every rank, with ``on_nonfinite_grad="stop"`` or after
            ``max_consecutive_skips`` skips in a row.
    """
    state = state_of(model)
    skipped = state.skipped
    if skipped.allowed is None:
        if skipped.norm is None:
            return True
        norm = float(skipped.norm)
        skipped.allowed = math.isfinite(norm)
        if skipped.allowed:
            skipped.consecutive = 0
        else:
            _skip(model, state, norm)
    return skipped.allowed


def _skip(model: nn.Module, state: HybridEPState, norm: float) -> None:
    skipped, config = state.skipped, state.config
    skipped.total += 1
    skipped.consecutive += 1
    where = nonfinite_layers(model)
    message = (f"optimizer step {state.optimizer_steps + 1}: the global gradient norm is {norm}; non-finite "
               f"gradients in {where}")
    if config.on_nonfinite_grad == "stop":
        raise NonFiniteGradientError(f"{message}; the run stops (on_nonfinite_grad='stop')")
    if skipped.consecutive >= config.max_consecutive_skips:
        raise NonFiniteGradientError(
            f"{message}; {skipped.consecutive} optimizer steps in a row were skipped, so the run stops "
            f"(max_consecutive_skips={config.max_consecutive_skips}): lower the learning rate or warm it up, clip "
            "gradients, check the data, or resume from an earlier checkpoint")
    logged = (f"{message}; the step was skipped on every rank ({skipped.total} skipped in this run, "
              f"{skipped.consecutive} in a row; the run stops after {config.max_consecutive_skips})")
    if state.mesh.rank == 0:
        logger.warning(logged)


def nonfinite_layers(model: nn.Module, shown: int = 8) -> str:
    """``"model.layers.1.mlp.experts (ranks [0, 2]), ..."``: the modules with a non-finite gradient on some rank.
    Collective over the model's world."""
    state = state_of(model)
    mine = []
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all()):
            module = name.rpartition(".")[0] or name
            if module not in mine:
                mine.append(module)
    everyone = state.mesh.gather_objects(mine, "all_gather of the layers with non-finite gradients")
    ranks: dict[str, list[int]] = {}
    for rank, modules in enumerate(everyone):
        for module in modules:
            ranks.setdefault(module, []).append(rank)
    if not ranks:
        return "no gradient (the norm itself overflowed)"
    parts = [f"{module} (rank(s) {r})" for module, r in list(ranks.items())[:shown]]
    more = len(ranks) - shown
    return ", ".join(parts) + (f" and {more} more module(s)" if more > 0 else "")


def rebalancing_optimizer(state: HybridEPState, optimizer=None):
    """The optimizer whose expert state a rebalance moves: ``optimizer`` when given, else the one registered by
    :func:`hf_hybrid_ep.make_optimizer` or found stepping the experts. ``None`` when no expert trains.

    Raises:
        HybridEPConfigError: before any expert moves, when no optimizer holding the experts is known, or the
            given one does not hold them (their optimizer state would stay behind: training would go wrong).
    """
    optimizer = optimizer if optimizer is not None else state.rebalancer.optimizer
    trainable = any(p.requires_grad for layer in state.layers for p in layer.expert_parameters())
    if not trainable:
        return optimizer
    fix = ("build the optimizer with hf_hybrid_ep.make_optimizer(model, torch.optim.AdamW, model.parameters(), ...) "
           "or pass it: hf_hybrid_ep.after_optimizer_step(model, optimizer)")
    if optimizer is None:
        raise HybridEPConfigError("online rebalancing moves each expert with its optimizer state, but no optimizer "
                                  f"holding the expert parameters has stepped: {fix}")
    if not holds_experts(optimizer, state):
        raise HybridEPConfigError(f"online rebalancing: the optimizer {type(unwrap_optimizer(optimizer)).__name__} "
                                  f"does not hold the model's expert parameters (built before parallelize, or for "
                                  f"another model?): {fix}")
    return optimizer
