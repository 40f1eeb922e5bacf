"""The reference dispatcher: counts and tokens exchanged with ``all_to_all_single`` (gloo and NCCL).

One plan costs one counts exchange over the EP group (which also carries every rank's
:attr:`~hf_hybrid_ep.dispatch.protocol.SideChannel.control` integers) and one device→host read (the counts).
Everything else is computed on the device with sizes known on the host: no ``bincount``, no
``repeat_interleave`` without ``output_size``, no boolean indexing. The gathers around the exchange are in
:mod:`hf_hybrid_ep.dispatch.gathers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..parallel.watchdog import watched
from .alltoall import AsyncExchange, PendingExchange, all_to_all, all_to_all_async, exchange_name
from .gathers import GatherTokens, inverse_permutation, weighted_gather
from .protocol import DispatchPlan, LocalPairs, Received, SideChannel
from .stats import CommStats
from .table import PlacementTable


def host_ints(t: torch.Tensor) -> list[int]:
    """The dispatcher's one device→host read per plan: the exchanged counts (and control integers)."""
    return t.tolist()


@dataclass
class TorchPlan(DispatchPlan):
    """A :class:`~hf_hybrid_ep.dispatch.protocol.DispatchPlan` of the plain all-to-all.

    Attributes:
        order: ``[T·k]`` permutation that sorted the sender's (token, k) pairs by (EP rank, slot); the pairs
            kept local (:attr:`local`) come next, dropped pairs (expert id -1) last (neither is sent).
        num_sent: pairs actually sent.
        send_splits / recv_splits: rows sent to / received from each EP rank in the dispatch.
    """

    order: torch.Tensor | None = None
    num_sent: int = 0
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    _position: torch.Tensor | None = None

    @property
    def num_local(self) -> int:
        return 0 if self.local is None else len(self.local)

    @property
    def num_dropped(self) -> int:
        return self.order.numel() - self.num_sent - self.num_local

    @property
    def position(self) -> torch.Tensor:
        """``[T·k]`` inverse of ``order``: the row each (token, k) pair occupies."""
        if self._position is None:
            self._position = inverse_permutation(self.order)
        return self._position


def send_order_plan(order: torch.Tensor, send_splits: list[int], num_tokens: int, top_k: int) -> TorchPlan:
    """A plan over rows already in their order, only for gathers (nothing received, nothing local): the
    deduplicated dispatcher's fan-out."""
    nothing = Received(0, 0, order.new_zeros(0), [])
    return TorchPlan(num_tokens, top_k, nothing, order=order, num_sent=sum(send_splits), send_splits=send_splits,
                     recv_splits=[])


class PairRoutes(NamedTuple):
    """Where the ``[T·k]`` (token, k) pairs go: expert ids, which are valid, destination EP rank and local
    slot, and which are kept local."""

    flat: torch.Tensor
    valid: torch.Tensor
    rank: torch.Tensor
    slot: torch.Tensor
    local: torch.Tensor


def span_ids(num_tokens: int, spans: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """``[T]`` the index of the token span each token falls in (spans cover ``0..T`` in order)."""
    chunk = torch.zeros(num_tokens, dtype=torch.long, device=device)
    for c, (a, _) in enumerate(spans[1:], start=1):
        chunk[a:] = c
    return chunk


class _CombineInFlight:
    """A combine whose return exchange is in flight (:meth:`TorchDispatcher.combine_async`)."""

    def __init__(self, dispatcher: TorchDispatcher, back: torch.Tensor, exchange: AsyncExchange,
                 plan: DispatchPlan) -> None:
        self.dispatcher, self.back, self.exchange, self.plan = dispatcher, back, exchange, plan

    def wait(self, top_k_weights: torch.Tensor, local_out: torch.Tensor | None = None) -> torch.Tensor:
        back = self.exchange.wait(self.back)
        return self.dispatcher._finish_combine(back, top_k_weights, self.plan, local_out)


class TorchDispatcher:
    """Token exchange within one EP group through a :class:`PlacementTable`
    (:class:`~hf_hybrid_ep.dispatch.protocol.Dispatcher`).

    ``dispatch`` sends every routed (token, k) pair to the EP rank holding its expert; this rank receives
    rows grouped by source rank and, within a source, by local slot. ``combine`` sends the experts' outputs
    back and forms ``Σ_k w[t,k] · y[t,k]``.

    Args:
        count_slots: slots per EP rank in the counts message, the same for every layer of the model (the
            largest ``slots_per_rank``; default this table's), so that ranks that reached different layers
            still exchange equal-sized messages and see the difference in the control integers.
        control_ints: integers of :attr:`SideChannel.control` per rank in every counts message.
    """

    name = "torch"

    def __init__(
        self, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats, *,
        count_slots: int | None = None, control_ints: int = 0,
    ) -> None:
        self.table = table
        self.ep_rank = ep_rank
        # an EP group of one rank (pure DP) exchanges nothing: every exchange is a local copy, no collective
        self.ep_group = ep_group if ep_group is not None and dist.get_world_size(ep_group) > 1 else None
        self.stats = stats
        self.count_slots = max(count_slots or 0, table.slots_per_rank)
        self.control_ints = control_ints

    # ------------------------------------------------------------------ plan
    def _route(self, top_k_index: torch.Tensor, local_slot_of: torch.Tensor | None) -> PairRoutes:
        """Destination (EP rank, slot) of every ``[T·k]`` pair; ids outside [0, E) are flagged by the caller
        and routed as expert 0, with ``valid`` false."""
        flat = top_k_index.reshape(-1).long()
        valid = (flat >= 0) & (flat < self.table.num_experts)
        safe = torch.where(valid, flat, torch.zeros_like(flat))
        rank, slot = self.table.route(safe, self.ep_rank)
        local = torch.zeros_like(valid) if local_slot_of is None else valid & (local_slot_of[safe] >= 0)
        return PairRoutes(flat, valid, rank, slot, local)

    def _message(self, rows: int, extra_columns: int, side: SideChannel, device: torch.device) -> torch.Tensor:
        """A zeroed counts message ``[rows, count_slots + extra_columns + control_ints]`` with the control
        integers in its last columns."""
        message = torch.zeros(rows, self.count_slots + extra_columns + self.control_ints, dtype=torch.long,
                              device=device)
        if side.control is not None and self.control_ints:
            message[:, -self.control_ints :] = side.control.to(device)
        return message

    def _peer_control(self, recv_host: list[int], width: int) -> list[tuple[int, ...]]:
        c = self.control_ints
        return [tuple(recv_host[r * width + width - c : (r + 1) * width]) for r in range(self.table.ep_degree)]

    def plan(self, top_k_index: torch.Tensor, side: SideChannel | None = None,
             spans: Sequence[tuple[int, int]] | None = None) -> list[TorchPlan]:
        """Sort the (token, k) pairs of every token span by destination and exchange all their per-slot
        counts in one message (one collective, one host read).

        Sort keys within a span: ``rank * slots + slot`` for sent pairs, then ``ep * slots`` for pairs kept
        local (:attr:`SideChannel.local_slot_of`), then ``ep * slots + 1`` for dropped pairs; spans are sorted
        one after the other.
        """
        side = side or SideChannel()
        spans = list(spans) if spans is not None else [(0, top_k_index.shape[0])]
        num_tokens, top_k = top_k_index.shape
        ep, slots = self.table.ep_degree, self.table.slots_per_rank
        bins = ep * slots + 2
        device = top_k_index.device
        route = self._route(top_k_index, side.local_slot_of)
        key = torch.where(route.valid, route.rank * slots + route.slot, ep * slots + 1)
        if side.local_slot_of is not None:
            key = torch.where(route.local, ep * slots, key)
        if len(spans) > 1:  # spans sort one after the other
            key = key + span_ids(num_tokens, spans, device).repeat_interleave(top_k) * bins
        _, order = torch.sort(key, stable=True)
        counts = torch.zeros(len(spans) * bins, dtype=torch.long, device=device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        counts = counts.view(len(spans), bins)
        message = self._message(ep, (len(spans) - 1) * slots, side, device)
        for c in range(len(spans)):
            message[:, c * slots : (c + 1) * slots] = counts[c, : ep * slots].view(ep, slots)
        received = torch.empty_like(message)
        if self.ep_group is None:
            received.copy_(message)
            host = host_ints(torch.cat([counts.reshape(-1), received.reshape(-1)]))
        else:  # the read waits for the exchange under NCCL: inside the section too
            with watched(exchange_name("counts"), self.ep_group):
                dist.all_to_all_single(received, message, group=self.ep_group)
                host = host_ints(torch.cat([counts.reshape(-1), received.reshape(-1)]))
        counts_host, recv_host = host[: counts.numel()], host[counts.numel() :]
        width = message.shape[1]
        peer_control = self._peer_control(recv_host, width)
        plans, pair_start = [], 0
        for c, (a, b) in enumerate(spans):
            sent_host = counts_host[c * bins : c * bins + ep * slots]
            recv_counts_host = [recv_host[r * width + c * slots + s] for r in range(ep) for s in range(slots)]
            pairs = (b - a) * top_k
            span_order = order[pair_start : pair_start + pairs] - a * top_k
            pair_start += pairs
            send_splits = [sum(sent_host[r * slots : (r + 1) * slots]) for r in range(ep)]
            num_sent, num_local = sum(send_splits), counts_host[c * bins + ep * slots]
            local = None
            if num_local:
                kept = span_order[num_sent : num_sent + num_local]
                local = LocalPairs(kept // top_k, side.local_slot_of[route.flat[kept + a * top_k]])
            plans.append(TorchPlan(
                b - a, top_k, Received(ep, slots, received[:, c * slots : (c + 1) * slots].reshape(-1),
                                       recv_counts_host),
                local=local, peer_control=peer_control, order=span_order, num_sent=num_sent,
                send_splits=send_splits,
                recv_splits=[sum(recv_counts_host[r * slots : (r + 1) * slots]) for r in range(ep)],
            ))
        return plans

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, hidden: torch.Tensor, plan: TorchPlan, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The token exchange of a planned dispatch (this backend weights in :meth:`combine`)."""
        return all_to_all(self._permute(hidden, plan.order, plan.num_sent, plan.top_k), plan.send_splits,
                          plan.recv_splits, self.ep_group, stats=self.stats, phase="dispatch",
                          self_index=self.ep_rank)

    def dispatch_async(self, hidden: torch.Tensor, plan: TorchPlan,
                       top_k_weights: torch.Tensor) -> tuple[torch.Tensor, AsyncExchange]:
        """The token exchange, asynchronous in forward and backward (``exchange.wait(rows)`` before use)."""
        return all_to_all_async(self._permute(hidden, plan.order, plan.num_sent, plan.top_k), plan.send_splits,
                                plan.recv_splits, self.ep_group, stats=self.stats, phase="dispatch",
                                self_index=self.ep_rank)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, top_k_weights: torch.Tensor, plan: TorchPlan, *,
                local_out: torch.Tensor | None = None,
                overlap_with: Callable[[], None] | None = None) -> torch.Tensor:
        """Return the experts' outputs to their tokens and weight them: ``[T, H]`` =
        ``Σ_k top_k_weights[t, k] · y[t, k]``; ``overlap_with`` runs while the return exchange is in flight."""
        pending = PendingExchange() if overlap_with is not None else None
        back = self._send_back(expert_out, plan, pending)
        if pending is not None:
            overlap_with()
            pending.wait()
        return self._finish_combine(back, top_k_weights, plan, local_out)

    def combine_async(self, expert_out: torch.Tensor, plan: TorchPlan) -> _CombineInFlight:
        """The return exchange, asynchronous in forward and backward; ``.wait(top_k_weights, local_out)``."""
        return _CombineInFlight(self, *self._send_back_async(expert_out, plan), plan)

    def _send_back(self, expert_out: torch.Tensor, plan: TorchPlan, pending=None) -> torch.Tensor:
        """The return exchange (asynchronous when ``pending`` is given; valid after ``pending.wait()``)."""
        return all_to_all(expert_out, plan.recv_splits, plan.send_splits, self.ep_group, stats=self.stats,
                          phase="combine", self_index=self.ep_rank, pending=pending)

    def _send_back_async(self, expert_out: torch.Tensor, plan: TorchPlan) -> tuple[torch.Tensor, AsyncExchange]:
        return all_to_all_async(expert_out, plan.recv_splits, plan.send_splits, self.ep_group, stats=self.stats,
                                phase="combine", self_index=self.ep_rank)

    def _finish_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, plan: TorchPlan,
                        local_out: torch.Tensor | None) -> torch.Tensor:
        if local_out is not None:
            back = torch.cat([back, local_out.to(back.dtype)])
        return self._unpermute_combine(back, top_k_weights, plan)

    # The two passes over the activations around the exchange; the Triton backend fuses each.
    def _permute(self, hidden: torch.Tensor, order: torch.Tensor, num_sent: int, top_k: int) -> torch.Tensor:
        """``[num_sent, H]`` rows in send order: ``hidden[order[i] // top_k]``."""
        return GatherTokens.apply(hidden, order, num_sent, top_k)

    def _unpermute_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, plan: TorchPlan) -> torch.Tensor:
        exact = torch.promote_types(back.dtype, top_k_weights.dtype) in (torch.float32, torch.float64)
        if exact and plan.num_dropped == 0 and back.shape[0] > 0:
            return weighted_gather(back, top_k_weights, plan.position, plan.order)
        # low precision: round the products, then their sum, in the promoted dtype, as transformers does
        if plan.num_dropped:  # dropped pairs contribute zero: their rows sort last
            back = torch.cat([back, back.new_zeros((plan.num_dropped, back.shape[1]))])
        per_pair = back[plan.position] * top_k_weights.reshape(-1, 1)
        return per_pair.view(plan.num_tokens, plan.top_k, -1).sum(dim=1)
