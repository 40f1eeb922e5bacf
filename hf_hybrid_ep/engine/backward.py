"""What happens in one gradient-reducing backward, in order: :class:`BackwardSequence`.

A post-accumulate-grad hook on every reduced parameter tells the sequence a gradient is ready. At the first
one of a reducing backward, :meth:`BackwardSequence.start` runs; every ready gradient may launch its bucket;
the autograd engine's end-of-backward callback runs :meth:`BackwardSequence.finish`. Those two methods are
the whole story of a backward, step by step; the objects they call (the reducer, the input agreement, the
hot-expert shadows) do one job each and call nobody back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.autograd import Variable

from ..moe.shadow import ShadowManager
from ..parallel.agreement import InputAgreement
from ..parallel.grads import GradientReducer
from ..parallel.mesh import is_dtensor


class BackwardSequence:
    """The per-backward sequence of one parallelized model.

    Args:
        reducer: the model's gradient reducer.
        agreement: the cross-rank input agreement (``None``: none).
        shadows: hot-expert shadowing (``None``: off).

    Attributes:
        enabled: reduce in backward (``False`` inside :func:`hf_hybrid_ep.no_sync`).
        gradient_sync: reduce only when it returns ``True`` (the Accelerate integration sets it to
            ``accelerator.sync_gradients``); ``None``: always.
    """

    def __init__(self, reducer: GradientReducer, agreement: InputAgreement | None = None,
                 shadows: ShadowManager | None = None) -> None:
        self.reducer, self.agreement, self.shadows = reducer, agreement, shadows
        self.enabled = True
        self.gradient_sync: Callable[[], bool] | None = None
        self._running = False
        # the parameters hooked and their hooks' handles (the parameters held so that their ids cannot be reused
        # by new ones while they are listed)
        self._watched: dict[int, tuple[nn.Parameter, object]] = {}
        self.watch(reducer.parameters())

    def watch(self, params: Iterable[nn.Parameter]) -> None:
        """Hook ``params`` (the reducer's parameters) that are trainable and not hooked yet — new ones after
        online rebalancing replaced some, or after ``requires_grad`` changed — and unhook the others."""
        watched = {}
        for p in params:
            if not p.requires_grad or is_dtensor(p):  # FSDP2 reduces its own
                continue
            held = self._watched.pop(id(p), None)
            if held is None or held[0] is not p:
                held = (p, p.register_post_accumulate_grad_hook(self._on_gradient))
            watched[id(p)] = held
        for _, handle in self._watched.values():
            handle.remove()
        self._watched = watched

    def follow_trainable(self) -> None:
        """Before a differentiated forward (and before a ZeRO-1 optimizer shards the buckets): if the set of
        trainable parameters changed, the reducer rebuilds its buckets and the hooks follow. One read of every
        parameter's ``requires_grad``; the hooks themselves check nothing."""
        if self.reducer.trainable_changed():
            self.watch(self.reducer.parameters())

    def reducing(self) -> bool:
        """Whether this backward reduces gradients."""
        return (self.enabled and self.reducer.mesh.world_size > 1
                and (self.gradient_sync is None or self.gradient_sync()))

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.reducing():
            return
        if not self._running:
            self.start()
        self.reducer.mark_ready(param)

    def start(self) -> None:
        """At the first gradient of a reducing backward, before any bucket launches."""
        self._running = True
        Variable._execution_engine.queue_callback(self.finish)
        if self.agreement is not None:
            self.agreement.launch()  # 1. the input agreement starts (asynchronous)
        shadows_out = self.shadows is not None and self.shadows.returns_pending()
        self.reducer.begin(hold_experts=shadows_out)  # 2. buckets armed; expert buckets wait for the shadows

    @torch.no_grad()
    def finish(self) -> None:
        """At the end of backward (the autograd engine's callback), in this order."""
        self._running = False
        self.reducer.gradients_complete()  # 3. every trainable parameter has a gradient
        if self.shadows is not None:
            self.shadows.return_gradients()  # 4. shadow gradients added to their owners' before experts reduce
        self.reducer.launch_remaining()  # 5. the buckets not launched during backward
        self.reducer.wait_all()  # 6. every reduction done and divided; ZeRO-1 views point at the shards
        if self.agreement is not None:
            self.agreement.finish()  # 7. raise on every rank if any rank saw bad inputs


@contextlib.contextmanager
def suspended(sequence: BackwardSequence) -> Iterator[None]:
    """Skip gradient reduction inside the block; reduce on the next backward outside it."""
    previous = sequence.enabled
    sequence.enabled = False
    try:
        yield
    finally:
        sequence.enabled = previous
