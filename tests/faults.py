"""Faults injected into a hybrid-EP run, to show that the parity criterion (tests/parity.py) catches real
defects. Each is applied inside the worker for one case and undone when the block exits.

* ``edp_allreduce_identity``: the expert-gradient all-reduce of the EDP group of EP rank 0 does nothing
  (identity) on all of that group's members;
* ``dense_over_ep_group``: dense gradients are averaged over the EP group instead of the world;
* ``expert_grads_scaled``: every expert gradient contribution is scaled by ``1 + 1e-3``;
* ``shadow_grads_not_returned``: hot-expert shadows expire without returning their gradients to the owners;
* ``routing_weights_twice``: the combine multiplies the expert outputs by the routing weights squared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import hf_hybrid_ep as hep

FAULTS = ("edp_allreduce_identity", "dense_over_ep_group", "expert_grads_scaled", "shadow_grads_not_returned",
          "routing_weights_twice")


class _Done:
    """The handle of a collective that was skipped."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def injected(fault: str | None, model: torch.nn.Module) -> Iterator[None]:
    """Apply ``fault`` (one of :data:`FAULTS`, or ``None`` for none) to the parallelized ``model``."""
    if fault is None:
        yield
        return
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
    state = hep.state_of(model)
    undo: list = []
    try:
        getattr(_Inject, fault)(state, undo)
        yield
    finally:
        for fn in reversed(undo):
            fn()


class _Inject:
    @staticmethod
    def edp_allreduce_identity(state, undo: list) -> None:
        mesh = state.mesh
        if mesh.ep_rank != 0 or mesh.edp_group is None:
            return
        target, real = mesh.edp_group, dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if group is target:
                return _Done() if async_op else None
            return real(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = all_reduce
        undo.append(lambda: setattr(dist, "all_reduce", real))

    @staticmethod
    def dense_over_ep_group(state, undo: list) -> None:
        reducer, mesh = state.reducer, state.mesh
        saved = reducer.dense_group, reducer.dense_group_size
        reducer.dense_group, reducer.dense_group_size = mesh.ep_group, mesh.ep_degree
        undo.append(lambda: setattr(reducer, "dense_group", saved[0]) or setattr(reducer, "dense_group_size", saved[1]))

    @staticmethod
    def expert_grads_scaled(state, undo: list) -> None:
        for layer in state.layers:
            for p in layer.expert_parameters():
                handle = p.register_hook(lambda g: g * (1 + 1e-3))
                undo.append(handle.remove)

    @staticmethod
    def shadow_grads_not_returned(state, undo: list) -> None:
        shadows = state.shadows
        if shadows is None:
            raise ValueError("shadow_grads_not_returned needs hot-expert shadowing on")

        def expire_only() -> None:
            for layer in shadows.layers:
                if layer.shadows is not None:
                    layer.shadows.active = False

        shadows.return_gradients = expire_only  # what the backward sequence calls, this case only
        undo.append(lambda: delattr(shadows, "return_gradients"))

    @staticmethod
    def routing_weights_twice(state, undo: list) -> None:
        # the weights reach the per-pair exchange in its combine, the deduplicated one in its dispatch
        for layer in state.layers:
            dispatcher = layer.dispatcher
            real_dispatch, real_combine = dispatcher.dispatch, dispatcher.combine

            def dispatch(hidden, plan, top_k_weights, _real=real_dispatch):
                return _real(hidden, plan, top_k_weights * top_k_weights)

            def combine(expert_out, top_k_weights, plan, *args, _real=real_combine, **kwargs):
                return _real(expert_out, top_k_weights * top_k_weights, plan, *args, **kwargs)

            dispatcher.dispatch, dispatcher.combine = dispatch, combine
            undo.append(lambda d=dispatcher: delattr(d, "dispatch") or delattr(d, "combine"))
