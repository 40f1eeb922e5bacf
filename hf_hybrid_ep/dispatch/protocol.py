"""The dispatcher contract: plan, dispatch, combine (and their asynchronous forms), nothing else.

A dispatcher moves token rows between the ranks of one EP group through a placement table. It never sees
the model: what the experts compute on the rows it delivers is :mod:`hf_hybrid_ep.moe.experts`' business,
and what the control integers of its counts exchange mean is its caller's
(:mod:`hf_hybrid_ep.parallel.agreement`). One MoE layer's exchange, from the layer's side::

    plan = dispatcher.plan(top_k_index, side)[0]          # one counts exchange, one host read
    rows = dispatcher.dispatch(hidden, plan, top_k_weights) # [M, H] rows for this rank's experts
    out = experts(rows, plan.received)                      # the caller's experts, any computation
    y = dispatcher.combine(out, top_k_weights, plan, local_out=...)   # [T, H]

Every backend in :data:`hf_hybrid_ep.dispatch.BACKENDS` implements :class:`Dispatcher`
(``tests/test_architecture.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .alltoall import AsyncExchange


@dataclass(frozen=True)
class SideChannel:
    """What a plan carries besides the routing, typed.

    Attributes:
        control: ``[C]`` int64 sent to every EP rank with the counts (``C`` is the dispatcher's
            ``control_ints``); every rank's vector comes back as :attr:`DispatchPlan.peer_control`.
        local_slot_of: ``[E]`` int64, the slot of this rank's local copy of each expert (``-1``: none). The
            pairs routed to such an expert are computed here on this rank's own tokens and never sent
            (:attr:`DispatchPlan.local`).
    """

    control: torch.Tensor | None = None
    local_slot_of: torch.Tensor | None = None


@dataclass
class Received:
    """The rows a dispatch delivers to this rank's experts: grouped by source (the ranks that send to this
    one), then by local slot.

    Attributes:
        sources / slots: sources and the slot stride of the counts (the table's slots per rank).
        counts: ``[sources · slots]`` int64 rows per (source, slot), on the device; ``counts_host`` the same
            on the host (read with the plan's one host read).
    """

    sources: int
    slots: int
    counts: torch.Tensor
    counts_host: list[int]

    @property
    def num_rows(self) -> int:
        return sum(self.counts_host)

    def slot_of_rows(self) -> torch.Tensor:
        """``[M]`` the local slot of every received row (on the device, no host synchronisation)."""
        ids = torch.arange(self.slots, device=self.counts.device).repeat(self.sources)
        return torch.repeat_interleave(ids, self.counts, output_size=self.num_rows)


@dataclass
class LocalPairs:
    """The pairs of :attr:`SideChannel.local_slot_of` experts, kept on this rank: ``tokens [n]`` (rows of the
    dispatched ``hidden``) and ``slots [n]`` (local-copy slots), in the order :meth:`Dispatcher.combine`
    expects their outputs."""

    tokens: torch.Tensor
    slots: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass
class DispatchPlan:
    """One token span's plan: what :meth:`Dispatcher.dispatch` and :meth:`Dispatcher.combine` need, and what
    the caller reads from it. Backends extend it with their own routing state.

    Attributes:
        num_tokens / top_k: the sender's ``T`` and ``k``.
        received: the rows this rank's experts will compute (:class:`Received`).
        local: pairs computed here on local copies (``None``: none).
        peer_control: every EP rank's :attr:`SideChannel.control` vector, by EP rank.
    """

    num_tokens: int
    top_k: int
    received: Received
    local: LocalPairs | None = None
    peer_control: list[tuple[int, ...]] = field(default_factory=list)


@runtime_checkable
class CombineInFlight(Protocol):
    """A combine whose return exchange is in flight; :meth:`wait` completes it."""

    def wait(self, top_k_weights: torch.Tensor, local_out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, H]``: the combined outputs (as :meth:`Dispatcher.combine`)."""
        ...


@runtime_checkable
class Dispatcher(Protocol):
    """Token exchange within one EP group (see the module docstring)."""

    name: str

    def plan(self, top_k_index: torch.Tensor, side: SideChannel | None = None,
             spans: Sequence[tuple[int, int]] | None = None) -> list[DispatchPlan]:
        """Plan the exchange of the ``[T, k]`` pairs (global expert ids, ``-1``: dropped, never sent) of each
        token span (default: one span of all ``T`` tokens), with one counts exchange over the EP group and one
        host read for all spans."""
        ...

    def dispatch(self, hidden: torch.Tensor, plan: DispatchPlan, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``[M, H]`` rows for this rank's experts (:attr:`DispatchPlan.received` order) from ``hidden [T, H]``.
        Differentiable: the backward returns the rows' gradients to their tokens."""
        ...

    def dispatch_async(self, hidden: torch.Tensor, plan: DispatchPlan,
                       top_k_weights: torch.Tensor) -> tuple[torch.Tensor, AsyncExchange]:
        """:meth:`dispatch`, its exchange asynchronous in forward and backward: use ``exchange.wait(rows)``."""
        ...

    def combine(self, expert_out: torch.Tensor, top_k_weights: torch.Tensor, plan: DispatchPlan, *,
                local_out: torch.Tensor | None = None,
                overlap_with: Callable[[], None] | None = None) -> torch.Tensor:
        """``[T, H]`` = ``Σ_j top_k_weights[t, j] · y(t, j)`` from the experts' outputs ``[M, H]`` (in the
        order :meth:`dispatch` delivered the rows) and ``local_out`` (``[n, H]``, the outputs of
        :attr:`DispatchPlan.local`); ``overlap_with`` runs while the return exchange is in flight."""
        ...

    def combine_async(self, expert_out: torch.Tensor, plan: DispatchPlan) -> CombineInFlight:
        """Start :meth:`combine`'s return exchange, asynchronous in forward and backward."""
        ...
