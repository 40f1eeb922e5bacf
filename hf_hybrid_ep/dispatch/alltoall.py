"""Differentiable uneven all-to-all over a process group (``all_to_all_single``; gloo and NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .stats import CommStats


class PendingExchange:
    """Holds the handle of an asynchronous exchange; ``wait()`` completes it (a no-op when none)."""

    work = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


def _exchange(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None,
    pending=None,
) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if group is None:  # a group of one: the exchange is the identity
        out.copy_(x)
        return out
    work = dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group,
                                  async_op=pending is not None)
    if pending is not None:
        pending.work = work
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, stats, phase, self_index, pending):  # type: ignore[override]
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ctx.stats, ctx.phase, ctx.self_index = stats, phase, self_index
        if stats is not None:
            stats.record(phase, send_splits, recv_splits, self_index, x[0:1].numel() * x.element_size())
        return _exchange(x, send_splits, recv_splits, group, pending)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        stats = ctx.stats
        if stats is not None:
            row_bytes = grad[0:1].numel() * grad.element_size()
            stats.record(ctx.phase + "_backward", ctx.recv_splits, ctx.send_splits, ctx.self_index, row_bytes)
        grad_x = _exchange(grad.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group)
        return grad_x, None, None, None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None,
    *,
    stats: CommStats | None = None,
    phase: str = "dispatch",
    self_index: int = 0,
    pending=None,
) -> torch.Tensor:
    """Send ``send_splits[j]`` leading rows of ``x`` (in order) to group rank ``j``; receive ``recv_splits``.

    Args:
        x: ``[sum(send_splits), ...]``.
        send_splits / recv_splits: row counts per group rank (host ints).
        group: the process group, or ``None`` for a group of one.
        stats: counters to record into (forward as ``phase``, backward as ``phase + "_backward"``).
        self_index: this rank's index in ``group`` (its rows are not counted as remote traffic).
        pending: an object with a ``work`` attribute: the forward exchange is started asynchronously and
            its handle stored there; the result is valid only after ``pending.work.wait()``.

    Returns:
        ``[sum(recv_splits), ...]``, rows ordered by source rank. Gradients flow back by the reverse exchange.
    """
    return _AllToAll.apply(x, send_splits, recv_splits, group, stats, phase, self_index, pending)
