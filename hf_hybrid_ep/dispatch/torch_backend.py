"""The reference dispatcher: counts and tokens exchanged with ``all_to_all_single`` (gloo and NCCL).

One MoE layer costs one counts exchange (which also carries every rank's input flags and layer id, see
:mod:`hf_hybrid_ep.parallel.agreement`) and the token exchanges, all inside the EP group, and one device→host
read (the counts). Everything else is computed on the device with sizes known on the host: no
``bincount``, no ``repeat_interleave`` without ``output_size``, no boolean indexing.

The glue around the exchange is three gathers whose backward passes are gathers too (no scatter-add):
tokens → send order, received rows (grouped by source rank, then slot) → expert-major order for the
grouped GEMM and back, and the combine ``out[t] = Σ_j w[t, j] · y[pos(t, j)]`` as one gather and one
batched product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from .alltoall import AsyncExchange, PendingExchange, all_to_all, all_to_all_async
from .stats import CommStats
from .table import PlacementTable

CONTROL_INTS = 2  # (input flags, layer id), appended to every rank's counts message


def host_ints(t: torch.Tensor) -> list[int]:
    """The dispatcher's one device→host read per layer: the exchanged counts (and control integers)."""
    return t.tolist()


@dataclass
class DispatchHandle(PendingExchange):
    """What :meth:`TorchDispatcher.combine` needs to undo a dispatch; ``wait()`` completes the token
    exchange of an asynchronous ``send(..., async_op=True)``.

    Attributes:
        order: ``[T*k]`` permutation that sorted the sender's (token, k) pairs by (EP rank, slot);
            pairs kept for local shadows come next, dropped pairs (expert id -1) last (neither is sent).
        num_sent: pairs actually sent.
        send_splits / recv_splits: rows sent to / received from each EP rank in the dispatch.
        num_tokens / top_k: the sender's ``T`` and ``k``.
        local_slot: ``[M]`` local slot of each received row.
        recv_counts: ``[ep * slots]`` rows received per (source rank, local slot), on the device, and
            ``recv_counts_host`` the same on the host.
        num_shadow / shadow_slot: pairs kept on this rank for its shadows of remote experts (hot-expert
            shadowing); in ``order`` they come after the sent pairs and before the dropped ones.
        peer_control: ``(flags, layer id)`` of every EP rank, from the counts exchange.
        work: the pending exchange of an asynchronous send.
    """

    order: torch.Tensor
    num_sent: int
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    top_k: int
    local_slot: torch.Tensor | None = None
    recv_counts: torch.Tensor | None = None
    recv_counts_host: list[int] = field(default_factory=list)
    num_shadow: int = 0
    shadow_slot: torch.Tensor | None = None
    peer_control: list[tuple[int, int]] = field(default_factory=list)
    _position: torch.Tensor | None = None

    @property
    def num_dropped(self) -> int:
        return self.order.numel() - self.num_sent - self.num_shadow

    @property
    def position(self) -> torch.Tensor:
        """``[T*k]`` inverse of ``order``: the row each (token, k) pair occupies."""
        if self._position is None:
            self._position = torch.empty_like(self.order)
            self._position[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return self._position



class _GatherTokens(torch.autograd.Function):
    """``rows[i] = hidden[order[i] // k]`` for the first ``n`` pairs; the backward sums each token's rows
    with one gather and one batched product (pairs not among the ``n`` contribute nothing)."""

    @staticmethod
    def forward(ctx, hidden, order, n, top_k):  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.n, ctx.top_k, ctx.tokens = n, top_k, hidden.shape[0]
        return hidden.index_select(0, order[:n] // top_k)

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        n, k, tokens = ctx.n, ctx.top_k, ctx.tokens
        if n == 0:
            return grad_rows.new_zeros((tokens, grad_rows.shape[1])), None, None, None
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        live = (position < n).to(grad_rows.dtype).view(tokens, 1, k)
        picked = grad_rows.index_select(0, position.clamp(max=n - 1)).view(tokens, k, -1)
        return torch.bmm(live, picked).squeeze(1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """``out = src[index]`` for a permutation ``index``; the backward is the gather by ``inverse``."""

    @staticmethod
    def forward(ctx, src, index, inverse):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _WeightedGather(torch.autograd.Function):
    """``out[t] = Σ_j w[t, j] · rows[position[t*k + j]]``; a pair whose position is past the last row
    (``position ≥ rows.shape[0]``: dropped, or routed elsewhere) contributes zero.

    Forward: one gather and one batched product. Backward: ``grad_rows[p] = w(pair p) · grad_out[t(p)]``
    (a gather, every row belongs to exactly one pair, ``order[p]``) and, when the weights need it,
    ``grad_w[t, j] = ⟨grad_out[t], rows[position[t, j]]⟩`` (the gather recomputed, one batched product).
    """

    @staticmethod
    def _picked(rows, position, tokens, k, dtype):
        if rows.shape[0] < position.numel():  # pairs without a row read a zero row
            rows = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])
            position = position.clamp(max=rows.shape[0] - 1)
        return rows.index_select(0, position).view(tokens, k, *rows.shape[1:]).to(dtype)

    @staticmethod
    def forward(ctx, rows, weights, position, order):  # type: ignore[override]
        tokens, k = weights.shape
        dtype = torch.promote_types(rows.dtype, weights.dtype)
        picked = _WeightedGather._picked(rows, position, tokens, k, dtype)
        ctx.save_for_backward(rows, weights, position, order)
        return torch.bmm(weights.to(dtype).unsqueeze(1), picked).squeeze(1)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        rows, weights, position, order = ctx.saved_tensors
        tokens, k = weights.shape
        grad_rows = grad_w = None
        if ctx.needs_input_grad[0]:
            pairs = order[: rows.shape[0]]
            per_pair = grad_out.index_select(0, pairs // k) * weights.reshape(-1, 1)[pairs].to(grad_out.dtype)
            grad_rows = per_pair.to(rows.dtype)
        if ctx.needs_input_grad[1]:
            picked = _WeightedGather._picked(rows, position, tokens, k, grad_out.dtype)
            grad_w = torch.bmm(picked, grad_out.unsqueeze(2)).view(tokens, k).to(weights.dtype)
        return grad_rows, grad_w, None, None


class PairRoutes(NamedTuple):
    """Where the ``[T·k]`` (token, k) pairs go: expert ids, which are valid, destination EP rank and local
    slot, and which are kept for a local shadow."""

    flat: torch.Tensor
    valid: torch.Tensor
    rank: torch.Tensor
    slot: torch.Tensor
    shadow: torch.Tensor


def span_ids(num_tokens: int, spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """``[T]`` the index of the token span each token falls in (spans cover ``0..T`` in order)."""
    chunk = torch.zeros(num_tokens, dtype=torch.long, device=device)
    for c, (a, _) in enumerate(spans[1:], start=1):
        chunk[a:] = c
    return chunk


def weighted_gather(rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """``[T, H]``: ``Σ_j weights[t, j] · rows[row of pair (t, j)]`` for the pairs of ``handle`` that have a
    row (the first ``rows.shape[0]`` of ``handle.order``); the others contribute zero. Differentiable in both."""
    return _WeightedGather.apply(rows, weights, handle.position, handle.order)


class TorchDispatcher:
    """Token exchange within one EP group through a :class:`PlacementTable`.

    ``dispatch`` sends every routed (token, k) pair to the EP rank holding its expert and returns
    the rows this rank must compute, grouped by source rank and, within a source, by local slot.
    ``combine`` sends the expert outputs back and forms ``sum_k w[t,k] * y[t,k]``.

    Args:
        control_width: integers per EP rank in the counts message, the same for every layer of the model
            (the largest ``slots_per_rank`` plus :data:`CONTROL_INTS`), so that ranks that reached
            different layers still exchange equal-sized messages and see the difference.
    """

    name = "torch"

    def __init__(
        self, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats,
        control_width: int | None = None,
    ) -> None:
        self.table = table
        self.ep_rank = ep_rank
        # an EP group of one rank (pure DP) exchanges nothing: every exchange is a local copy, no collective
        self.ep_group = ep_group if ep_group is not None and dist.get_world_size(ep_group) > 1 else None
        self.stats = stats
        self.alignment = 1
        self.width = max(control_width or 0, table.slots_per_rank + CONTROL_INTS)

    def dispatch(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, shadow_slot_of: torch.Tensor | None = None,
        control: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send rows to their experts.

        Args:
            hidden: ``[T, H]`` token activations.
            top_k_index: ``[T, k]`` global expert ids; -1 marks a dropped assignment (never sent).
            shadow_slot_of: ``[E]`` int64, this rank's shadow slot of each expert (-1: none); pairs for a
                shadowed expert stay here (see :meth:`shadow_rows`) and are not sent.
            control: ``[2]`` int64 ``(flags, layer id)`` sent to every EP rank with the counts.

        Returns:
            ``(rows [M, H], local_slot [M] int64, handle)`` where ``M`` rows arrived for this rank's slots.
        """
        handle = self.plan(top_k_index, shadow_slot_of, control)
        return self.send(hidden, handle), handle.local_slot, handle

    def plan(self, top_k_index: torch.Tensor, shadow_slot_of: torch.Tensor | None = None,
             control: torch.Tensor | None = None) -> DispatchHandle:
        """:meth:`plan_chunks` for one chunk."""
        return self.plan_chunks(top_k_index, [(0, top_k_index.shape[0])], shadow_slot_of, control)[0]

    def _route(self, top_k_index: torch.Tensor, shadow_slot_of: torch.Tensor | None) -> PairRoutes:
        """Destination (EP rank, slot) of every ``[T·k]`` pair; ids outside [0, E) are flagged by the caller
        and routed as expert 0, with ``valid`` false."""
        flat = top_k_index.reshape(-1).long()
        valid = (flat >= 0) & (flat < self.table.num_experts)
        safe = torch.where(valid, flat, torch.zeros_like(flat))
        rank, slot = self.table.route(safe, self.ep_rank)
        shadow = torch.zeros_like(valid) if shadow_slot_of is None else valid & (shadow_slot_of[safe] >= 0)
        return PairRoutes(flat, valid, rank, slot, shadow)

    def plan_chunks(self, top_k_index: torch.Tensor, spans: list[tuple[int, int]],
                    shadow_slot_of: torch.Tensor | None = None,
                    control: torch.Tensor | None = None) -> list[DispatchHandle]:
        """Sort the (token, k) pairs of every token span by destination and exchange all their per-slot
        counts in one message (one collective, one host read).

        Sort keys within a span: ``rank * slots + slot`` for sent pairs, then ``ep * slots`` for pairs kept
        for a local shadow (``shadow_slot_of``), then ``ep * slots + 1`` for dropped pairs; spans are
        sorted one after the other.
        """
        num_tokens, top_k = top_k_index.shape
        ep, slots = self.table.ep_degree, self.table.slots_per_rank
        bins = ep * slots + 2
        device = top_k_index.device
        route = self._route(top_k_index, shadow_slot_of)
        flat = route.flat
        key = torch.where(route.valid, route.rank * slots + route.slot, ep * slots + 1)
        if shadow_slot_of is not None:
            key = torch.where(route.shadow, ep * slots, key)
        if len(spans) > 1:  # spans sort one after the other
            key = key + span_ids(num_tokens, spans, device).repeat_interleave(top_k) * bins
        _, order = torch.sort(key, stable=True)
        counts = torch.zeros(len(spans) * bins, dtype=torch.long, device=device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        counts = counts.view(len(spans), bins)
        message = torch.zeros(ep, self.width + (len(spans) - 1) * slots, dtype=torch.long, device=device)
        for c in range(len(spans)):
            message[:, c * slots : (c + 1) * slots] = counts[c, : ep * slots].view(ep, slots)
        if control is not None:
            message[:, -CONTROL_INTS:] = control.to(device)
        received = torch.empty_like(message)
        if self.ep_group is None:
            received.copy_(message)
        else:
            dist.all_to_all_single(received, message, group=self.ep_group)
        host = host_ints(torch.cat([counts.reshape(-1), received.reshape(-1)]))
        counts_host, recv_host = host[: counts.numel()], host[counts.numel() :]
        width = message.shape[1]
        peer_control = [tuple(recv_host[r * width + width - CONTROL_INTS : (r + 1) * width]) for r in range(ep)]
        handles, pair_start = [], 0
        slot_ids = torch.arange(slots, device=device).repeat(ep)
        for c, (a, b) in enumerate(spans):
            sent_host = counts_host[c * bins : c * bins + ep * slots]
            recv_counts_host = [recv_host[r * width + c * slots + s] for r in range(ep) for s in range(slots)]
            send_splits = [sum(sent_host[r * slots : (r + 1) * slots]) for r in range(ep)]
            recv_splits = [sum(recv_counts_host[r * slots : (r + 1) * slots]) for r in range(ep)]
            num_shadow = counts_host[c * bins + ep * slots]
            recv_counts = received[:, c * slots : (c + 1) * slots].reshape(-1)
            local_slot = torch.repeat_interleave(slot_ids, recv_counts, output_size=sum(recv_splits))
            pairs = (b - a) * top_k
            span_order = order[pair_start : pair_start + pairs] - a * top_k
            pair_start += pairs
            num_sent = sum(send_splits)
            shadow_slot = None
            if num_shadow:
                shadow_slot = shadow_slot_of[flat[span_order[num_sent : num_sent + num_shadow] + a * top_k]]
            handles.append(DispatchHandle(
                span_order, num_sent, send_splits, recv_splits, b - a, top_k, local_slot, recv_counts,
                recv_counts_host, num_shadow=num_shadow, shadow_slot=shadow_slot, peer_control=peer_control,
            ))
        return handles

    def shadow_rows(self, hidden: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``[num_shadow, H]`` rows of the pairs kept for local shadows, in ``handle.shadow_slot`` order."""
        start = handle.num_sent
        return hidden[handle.order[start : start + handle.num_shadow] // handle.top_k]

    def send(self, hidden: torch.Tensor, handle: DispatchHandle, async_op: bool = False,
             top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The token exchange of a planned dispatch. With ``async_op`` the returned rows are valid only
        after ``handle.wait()`` (the exchange overlaps whatever runs in between). ``top_k_weights`` is for
        backends that weight before the return exchange (hierarchical); this one weights in ``combine``."""
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
            ``[T, H]`` = ``sum_k top_k_weights[t, k] * y[t, k]``.
        """
        pending = PendingExchange() if overlap_with is not None else None
        back = self.send_back(expert_out, handle, pending)
        if pending is not None:
            overlap_with()
            pending.wait()
        return self.finish_combine(back, top_k_weights, handle, shadow_out)

    def send_async(self, hidden: torch.Tensor, handle: DispatchHandle,
                   top_k_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, AsyncExchange]:
        """The token exchange, asynchronous in forward and backward (``exchange.wait(rows)`` before use)."""
        return all_to_all_async(self._permute(hidden, handle.order, handle.num_sent, handle.top_k), handle.send_splits,
                                handle.recv_splits, self.ep_group, stats=self.stats, phase="dispatch",
                                self_index=self.ep_rank)

    def send_back_async(self, expert_out: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, AsyncExchange]:
        """The return exchange, asynchronous in forward and backward (``exchange.wait(back)`` before use)."""
        return all_to_all_async(expert_out, handle.recv_splits, handle.send_splits, self.ep_group, stats=self.stats,
                                phase="combine", self_index=self.ep_rank)

    def send_back(self, expert_out: torch.Tensor, handle: DispatchHandle, pending=None) -> torch.Tensor:
        """The return exchange (asynchronous when ``pending`` is given; valid after ``pending.wait()``)."""
        return all_to_all(expert_out, handle.recv_splits, handle.send_splits, self.ep_group, stats=self.stats,
                          phase="combine", self_index=self.ep_rank, pending=pending)

    def finish_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, handle: DispatchHandle,
                       shadow_out: torch.Tensor | None = None) -> torch.Tensor:
        if shadow_out is not None:
            back = torch.cat([back, shadow_out.to(back.dtype)])
        return self._unpermute_combine(back, top_k_weights, handle)

    # ------------------------------------------------------------------ experts
    def regroup_plan(self, handle: DispatchHandle, local_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                               list[int]]:
        """Where each received row goes in expert-major order, each local slot's group padded to
        ``alignment`` rows; on the device, with sizes from the host counts (no synchronisation).

        Returns ``(index [P], destination [M], sizes [local_slots], sizes_host)``: ``index[j]`` is the
        received row placed at padded position j (-1: padding), ``destination[i]`` the padded position of
        row i, ``sizes`` the padded group sizes.
        """
        ep, slots = len(handle.recv_splits), self.table.slots_per_rank  # ep: the ranks rows came from
        host = handle.recv_counts_host
        per_slot = [sum(host[r * slots + s] for r in range(ep)) for s in range(local_slots)]
        sizes_host = [(n + self.alignment - 1) // self.alignment * self.alignment for n in per_slot]
        received, padded_total = sum(handle.recv_splits), sum(sizes_host)
        device = handle.recv_counts.device
        counts = handle.recv_counts.view(ep, slots)[:, :local_slots]
        sizes = (counts.sum(0) + self.alignment - 1) // self.alignment * self.alignment
        slot_start = torch.cumsum(sizes, 0) - sizes
        within = torch.cumsum(counts, 0) - counts  # rows from earlier source ranks in the same slot
        rank_major_start = (torch.cumsum(handle.recv_counts, 0) - handle.recv_counts).view(ep, slots)[:, :local_slots]
        delta = (slot_start.unsqueeze(0) + within - rank_major_start).reshape(-1)
        arange = torch.arange(received, device=device)
        destination = arange + torch.repeat_interleave(delta, counts.reshape(-1), output_size=received)
        index = torch.full((padded_total,), -1, dtype=torch.long, device=device)
        index[destination] = arange
        return index, destination, sizes, sizes_host

    def grouped(self, module) -> bool:
        """Whether this rank's experts run as transformers' grouped GEMM called directly on expert-major rows
        (the module's experts implementation is ``grouped_mm``); otherwise the module's own forward runs."""
        return getattr(getattr(module, "config", None), "_experts_implementation", None) == "grouped_mm"

    def run_experts(self, module, local_forward, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """This rank's experts on the received rows (rank-major order), unit weights: the sender applies the
        routing weights. With ``grouped_mm``, one regroup to expert-major order, the grouped GEMMs,
        one regroup back; otherwise the module's own experts implementation (which groups rows itself)."""
        if not self.grouped(module):
            unit = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return local_forward(module, rows, handle.local_slot.unsqueeze(1), unit)
        if self.table.ep_degree == 1 and self.alignment == 1:  # one source: the rows are expert-major already
            return grouped_experts(module, rows, handle.recv_counts[: module.num_experts])
        index, destination, sizes, _ = self.regroup_plan(handle, module.num_experts)
        grouped = self._gather_rows(rows, index, destination)
        out = grouped_experts(module, grouped, sizes)
        return self._gather_rows(out, destination, index)

    def _gather_rows(self, src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``src[index]`` for the permutation ``index`` (``inverse`` its inverse); alignment 1 has no padding."""
        return _PermuteRows.apply(src, index, inverse)

    # The two passes over the activations around the exchange; the Triton backend fuses each.
    def _permute(self, hidden: torch.Tensor, order: torch.Tensor, num_sent: int, top_k: int) -> torch.Tensor:
        """``[num_sent, H]`` rows in send order: ``hidden[order[i] // top_k]``."""
        return _GatherTokens.apply(hidden, order, num_sent, top_k)

    def _unpermute_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        exact = torch.promote_types(back.dtype, top_k_weights.dtype) in (torch.float32, torch.float64)
        if exact and handle.num_dropped == 0 and back.shape[0] > 0:
            return weighted_gather(back, top_k_weights, handle)
        # low precision: round the products, then their sum, in the promoted dtype, as transformers does
        if handle.num_dropped:  # dropped pairs contribute zero: their rows sort last
            back = torch.cat([back, back.new_zeros((handle.num_dropped, back.shape[1]))])
        per_pair = back[handle.position] * top_k_weights.reshape(-1, 1)
        return per_pair.view(handle.num_tokens, handle.top_k, -1).sum(dim=1)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes matrix products in on ``t``'s device, when autocast is on there and
    ``t`` is a wider float (fp32 weights or activations under ``autocast(dtype=torch.bfloat16)``); else ``None``."""
    device_type = t.device.type
    if not (t.is_floating_point() and torch.is_autocast_enabled(device_type)):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if torch.finfo(dtype).bits < torch.finfo(t.dtype).bits else None


def grouped_experts(module, rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """transformers' grouped GEMM path of a fused experts module on expert-major ``rows`` whose local
    slot ``s`` owns ``sizes[s]`` consecutive rows (honouring the gate / bias / transposed / post-norm flags).

    Under ``torch.autocast`` with wider weights the GEMMs run in autocast's dtype, as ``F.linear`` does there:
    transformers' ``_grouped_linear`` casts its input to the weight dtype and is not autocast-aware, which
    would run them in fp32 (and on ATen's per-group fallback). Gradients reach the fp32 weights through the cast."""
    from transformers.integrations.moe import _grouped_linear

    compute = autocast_dtype(module.down_proj)

    def weight(t: torch.Tensor) -> torch.Tensor:
        return t if compute is None else t.to(compute)

    rows = weight(rows)
    local_slots = module.num_experts
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    expert_of_row = None
    if module.has_bias:
        expert_of_row = torch.repeat_interleave(torch.arange(local_slots, device=rows.device), sizes,
                                                output_size=rows.shape[0])
    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    out = _grouped_linear(rows, weight(up), offsets, bias=None if up_bias is None else weight(up_bias[expert_of_row]),
                          is_transposed=module.is_transposed)
    out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
    down_bias = weight(module.down_proj_bias[expert_of_row]) if module.has_bias else None
    out = _grouped_linear(out, weight(module.down_proj), offsets, bias=down_bias, is_transposed=module.is_transposed)
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    return out
