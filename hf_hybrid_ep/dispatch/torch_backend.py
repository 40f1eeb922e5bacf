"""The reference dispatcher: counts and tokens exchanged with ``all_to_all_single`` (gloo and NCCL)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .alltoall import PendingExchange, all_to_all
from .stats import CommStats
from .table import PlacementTable


@dataclass
class DispatchHandle:
    """What :meth:`TorchDispatcher.combine` needs to undo a dispatch.

    Attributes:
        order: ``[T*k]`` permutation that sorted the sender's (token, k) pairs by (EP rank, slot);
            dropped pairs (expert id -1) sort last and are not sent.
        num_sent: pairs actually sent (``T*k`` minus dropped ones).
        send_splits / recv_splits: rows sent to / received from each EP rank in the dispatch.
        num_tokens / top_k: the sender's ``T`` and ``k``.
        local_slot: ``[M]`` local slot of each received row.
        num_shadow / shadow_slot: pairs kept on this rank for its shadows of remote experts (hot-expert
            shadowing); in ``order`` they come after the sent pairs and before the dropped ones.
        work: the pending exchange of an asynchronous send.
    """

    order: torch.Tensor
    num_sent: int
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    top_k: int
    local_slot: torch.Tensor | None = None
    recv_counts: torch.Tensor | None = None  # [ep * slots] rows received per (source rank, local slot)
    work: object | None = None
    num_shadow: int = 0  # pairs computed on this rank's shadows (they follow the sent pairs in ``order``)
    shadow_slot: torch.Tensor | None = None  # [num_shadow] shadow slot of each of those pairs

    def wait(self) -> None:
        """Complete an asynchronous token exchange started by ``send(..., async_op=True)``."""
        if self.work is not None:
            self.work.wait()
            self.work = None


class TorchDispatcher:
    """Token exchange within one EP group through a :class:`PlacementTable`.

    ``dispatch`` sends every routed (token, k) pair to the EP rank holding its expert and returns
    the rows this rank must compute, grouped by source rank and, within a source, by local slot.
    ``combine`` sends the expert outputs back and forms ``sum_k w[t,k] * y[t,k]``.
    """

    name = "torch"

    def __init__(
        self, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats
    ) -> None:
        self.table = table
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.stats = stats

    def dispatch(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, shadow_slot_of: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send rows to their experts.

        Args:
            hidden: ``[T, H]`` token activations.
            top_k_index: ``[T, k]`` global expert ids; -1 marks a dropped assignment (never sent).
            shadow_slot_of: ``[E]`` int64, this rank's shadow slot of each expert (-1: none); pairs for a
                shadowed expert stay here (see :meth:`shadow_rows`) and are not sent.

        Returns:
            ``(rows [M, H], local_slot [M] int64, handle)`` where ``M`` rows arrived for this rank's slots.
        """
        handle = self.plan(top_k_index, shadow_slot_of)
        return self.send(hidden, handle), handle.local_slot, handle

    def plan(self, top_k_index: torch.Tensor, shadow_slot_of: torch.Tensor | None = None) -> DispatchHandle:
        """Sort the (token, k) pairs by destination and exchange the per-slot counts (a small collective).

        Sort keys: ``rank * slots + slot`` for sent pairs, then ``ep * slots`` for pairs kept for a local
        shadow (``shadow_slot_of``), then ``ep * slots + 1`` for dropped pairs.
        """
        num_tokens, top_k = top_k_index.shape
        ep, slots = self.table.ep_degree, self.table.slots_per_rank
        flat = top_k_index.reshape(-1).long()
        dest_rank, dest_slot = self.table.route(flat.clamp_min(0), self.ep_rank)
        key = torch.where(flat >= 0, dest_rank * slots + dest_slot, ep * slots + 1)
        if shadow_slot_of is not None:
            shadowed = (flat >= 0) & (shadow_slot_of[flat.clamp_min(0)] >= 0)
            key = torch.where(shadowed, ep * slots, key)
        key_sorted, order = torch.sort(key, stable=True)
        counts = torch.bincount(key_sorted, minlength=ep * slots + 2)
        send_counts = counts[: ep * slots]
        recv_counts = torch.empty_like(send_counts)
        if self.ep_group is None:
            recv_counts.copy_(send_counts)
        else:
            dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        splits = torch.cat([send_counts.view(ep, slots).sum(1), recv_counts.view(ep, slots).sum(1),
                            counts[ep * slots : ep * slots + 1]]).tolist()
        send_splits, recv_splits, num_shadow = splits[:ep], splits[ep : 2 * ep], splits[2 * ep]
        slot_ids = torch.arange(slots, device=top_k_index.device).repeat(ep)
        local_slot = torch.repeat_interleave(slot_ids, recv_counts)
        num_sent = sum(send_splits)
        shadow_slot = None
        if num_shadow:
            shadow_slot = shadow_slot_of[flat[order[num_sent : num_sent + num_shadow]]]
        return DispatchHandle(
            order, num_sent, send_splits, recv_splits, num_tokens, top_k, local_slot, recv_counts,
            num_shadow=num_shadow, shadow_slot=shadow_slot,
        )

    def shadow_rows(self, hidden: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``[num_shadow, H]`` rows of the pairs kept for local shadows, in ``handle.shadow_slot`` order."""
        start = handle.num_sent
        return hidden[handle.order[start : start + handle.num_shadow] // handle.top_k]

    def send(self, hidden: torch.Tensor, handle: DispatchHandle, async_op: bool = False) -> torch.Tensor:
        """The token exchange of a planned dispatch. With ``async_op`` the returned rows are valid only
        after ``handle.wait()`` (the exchange overlaps whatever runs in between)."""
        return all_to_all(
            self._permute(hidden, handle.order, handle.num_sent, handle.top_k),
            handle.send_splits,
            handle.recv_splits,
            self.ep_group,
            stats=self.stats,
            phase="dispatch",
            self_index=self.ep_rank,
            pending=handle if async_op else None,
        )

    def combine(
        self,
        expert_out: torch.Tensor,
        top_k_weights: torch.Tensor,
        handle: DispatchHandle,
        overlap_with: Callable[[], None] | None = None,
        shadow_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return expert outputs to their tokens and weight them.

        Args:
            expert_out: ``[M, H]`` outputs, in the order ``dispatch`` returned the rows.
            top_k_weights: ``[T, k]`` routing weights of the sender.

            overlap_with: work to run while the return exchange is in flight (e.g. the shared expert).
            shadow_out: ``[num_shadow, H]`` outputs of this rank's shadows on :meth:`shadow_rows`.

        Returns:
            ``[T, H]`` = ``sum_k top_k_weights[t, k] * y[t, k]`` (summed in k order, like transformers).
        """
        pending = PendingExchange() if overlap_with is not None else None
        back = all_to_all(
            expert_out,
            handle.recv_splits,
            handle.send_splits,
            self.ep_group,
            stats=self.stats,
            phase="combine",
            self_index=self.ep_rank,
            pending=pending,
        )
        if pending is not None:
            overlap_with()
            pending.wait()
        if shadow_out is not None:
            back = torch.cat([back, shadow_out.to(back.dtype)])
        return self._unpermute_combine(back, top_k_weights, handle)

    def run_experts(self, module, local_forward, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """This rank's experts on the received rows (rank-major order), unit weights: transformers' own
        experts implementation, which groups the rows by expert itself."""
        unit = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return local_forward(module, rows, handle.local_slot.unsqueeze(1), unit)

    # The two passes over the activations around the exchange; the Triton backend fuses each.
    def _permute(self, hidden: torch.Tensor, order: torch.Tensor, num_sent: int, top_k: int) -> torch.Tensor:
        """``[num_sent, H]`` rows in send order: ``hidden[order[i] // top_k]``."""
        return hidden[order[:num_sent] // top_k]

    def _unpermute_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        dropped = handle.order.numel() - back.shape[0]
        if dropped:  # dropped pairs contribute zero: their rows sort last
            back = torch.cat([back, back.new_zeros((dropped, back.shape[1]))])
        inverse = torch.empty_like(handle.order)
        inverse[handle.order] = torch.arange(handle.order.numel(), device=handle.order.device)
        per_pair = back[inverse] * top_k_weights.reshape(-1, 1)
        return per_pair.view(handle.num_tokens, handle.top_k, -1).sum(dim=1)
