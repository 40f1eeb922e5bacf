"""The per-step runtime of a parallelized model, around what the user's loop does.

* before a forward that will be differentiated: the buckets follow a changed set of trainable parameters,
  and the gradient buffers are attached (autograd then accumulates in place);
* after a forward under ``no_grad`` (evaluation, ``generate``): the ranks agree on the forward's inputs;
* a backward: :class:`~hf_hybrid_ep.engine.backward.BackwardSequence`;
* after ``optimizer.step()``: :func:`after_optimizer_step`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..moe.load import reduce_step_loads
from .nonfinite import new_gradients, rebalancing_optimizer
from .optimizers import wait_for_parameters
from .state import state_of
from .summary import log_startup_summary


def before_forward(model: nn.Module, args) -> None:
    """Before a forward that will be differentiated (whose gradients the next optimizer step's non-finite
    check decides on anew): buckets and hooks follow a changed set of trainable parameters, and the gradient
    buffers are attached; the first one logs the start-up summary unless the Trainer has
    (:mod:`hf_hybrid_ep.engine.summary`)."""
    if torch.is_grad_enabled():
        state = state_of(model)
        if not state.summary_logged:
            log_startup_summary(model)
        state.backward.follow_trainable()
        state.reducer.attach_grads()
        new_gradients(model)


def after_forward(model: nn.Module, args, output) -> None:
    """Under ``no_grad`` (evaluation, ``generate``) no backward follows: the ranks agree on the forward's
    inputs here (:mod:`hf_hybrid_ep.parallel.agreement`). A world of one has nobody to agree with: at once."""
    state = state_of(model)
    if not torch.is_grad_enabled() or state.mesh.world_group is None:
        state.agreement.agree_now()


def after_optimizer_step(model: nn.Module, optimizer=None) -> None:
    """Call once after every optimizer step (the Trainer integration does): reduces the step's expert
    loads over the world, applies aux-loss-free bias updates and device-load estimates, and feeds the
    load metrics; with online rebalancing on (``rebalance_every`` / ``rebalance_when_imbalance_over``),
    moves experts and their state of ``optimizer`` (default: the one :func:`hf_hybrid_ep.make_optimizer`
    built, or the one found stepping the experts; refused before any move when there is none) when a rebalance
    is due; with ``shadow_experts`` on, decides the next step's shadows from this step's routing counts and
    fetches their fresh weights (so call it after ``optimizer.step()``). Collective: call on every rank."""
    state = state_of(model)
    state.optimizer_steps += 1
    new_gradients(model)
    counts = None
    if state.shadows is not None:
        wait_for_parameters(model)  # the shadows' weights are read from the updated parameters
        counts = state.shadows.step_counts()  # before reduce_step_loads resets the step's counters
    loads, on_device = reduce_step_loads(state.layers, state.mesh, state.optimizer_steps)  # world totals of the step
    if state.rebalancer is not None:
        state.rebalancer.record({layer.name: t for layer, t in zip(state.layers, loads, strict=True)})
    for layer, totals in zip(state.layers, on_device, strict=True):
        if layer.controls is not None:
            layer.controls.after_step(totals[: layer.num_experts].to(layer.controls.ep_rank_of_expert.device),
                                      state.config)
    if state.rebalancer is not None and state.rebalancer.due(state.optimizer_steps) is not None:
        optimizer = rebalancing_optimizer(state, optimizer)
    if state.rebalancer is not None and state.rebalancer.after_step(state.optimizer_steps, optimizer) is not None:
        state.backward.watch(state.reducer.parameters())  # parameters a changed slot count replaced
    if state.shadows is not None:
        state.shadows.refresh(counts)
