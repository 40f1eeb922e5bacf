"""Differentiable uneven all-to-all over a process group (``all_to_all_single``; gloo and NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.watchdog import label, launched, wait, watched
from .stats import CommStats


class PendingExchange:
    """Holds the handle of an asynchronous exchange; ``wait()`` completes it (a no-op when none)."""

    work = None
    what = "all_to_all"
    group = None

    def wait(self) -> None:
        if self.work is not None:
            wait(self.work, self.what, self.group)
            self.work = None


def exchange_name(phase: str, layer: str | None = None) -> str:
    """``"all_to_all (dispatch) of model.layers.1.mlp.experts"``: what the watchdog names (the layer whose forward
    runs now unless given)."""
    return f"all_to_all ({phase}) of {layer if layer is not None else label()}"


def _exchange(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None,
    pending=None, what: str = "all_to_all",
) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if group is None:  # a group of one: the exchange is the identity
        out.copy_(x)
        return out
    if pending is not None:
        pending.work = launched(dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group,
                                                       async_op=True), what, group)
        pending.what, pending.group = what, group
        return out
    with watched(what, group):
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, stats, phase, self_index, pending):  # type: ignore[override]
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ctx.stats, ctx.phase, ctx.self_index = stats, phase, self_index
        ctx.layer = label()
        if stats is not None:
            stats.record(phase, send_splits, recv_splits, self_index, x[0:1].numel() * x.element_size())
        return _exchange(x, send_splits, recv_splits, group, pending, exchange_name(phase))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        stats = ctx.stats
        if stats is not None:
            row_bytes = grad[0:1].numel() * grad.element_size()
            stats.record(ctx.phase + "_backward", ctx.recv_splits, ctx.send_splits, ctx.self_index, row_bytes)
        grad_x = _exchange(grad.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group,
                           what=exchange_name(ctx.phase + ", backward", ctx.layer))
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
            its handle stored there; the result is valid only after ``pending.wait()``.

    Returns:
        ``[sum(recv_splits), ...]``, rows ordered by source rank. Gradients flow back by the reverse exchange.
    """
    return _AllToAll.apply(x, send_splits, recv_splits, group, stats, phase, self_index, pending)


class AsyncExchange:
    """An exchange split in two autograd nodes, so that both directions overlap computation.

    Forward: :func:`all_to_all_async` launches the exchange and returns the (not yet filled) output; the
    caller computes something else, then :meth:`wait` completes it. Backward runs the two nodes in reverse:
    the gradient of :meth:`wait` *launches* the reverse exchange, and the gradient of the launch waits for
    it. The autograd engine runs ready nodes latest-created first, so when several exchanges are waited
    for after the work they overlap (the chunked layer waits for its return exchanges after the last
    chunk's experts), every reverse exchange is launched before the first of them is waited for, and the
    experts' backward of one chunk runs while the others are in flight.
    """

    def __init__(self, send_splits: list[int], recv_splits: list[int], group, stats, phase: str, self_index: int):
        self.send_splits, self.recv_splits, self.group = send_splits, recv_splits, group
        self.stats, self.phase, self.self_index = stats, phase, self_index
        self.layer = label()
        self.work = None  # forward exchange in flight
        self.backward_work = None  # reverse exchange in flight, from ``backward_in`` into ``backward_out``
        self.backward_in: torch.Tensor | None = None
        self.backward_out: torch.Tensor | None = None

    def wait(self, out: torch.Tensor) -> torch.Tensor:
        """Complete the forward exchange; returns ``out`` (now valid), differentiably."""
        return _WaitExchange.apply(out, self)


class _LaunchExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        e = exchange
        if e.stats is not None:
            e.stats.record(e.phase, e.send_splits, e.recv_splits, e.self_index, x[0:1].numel() * x.element_size())
        out = x.new_empty((sum(e.recv_splits), *x.shape[1:]))
        if e.group is None:
            out.copy_(x)
        else:
            e.work = launched(dist.all_to_all_single(out, x.contiguous(), e.recv_splits, e.send_splits, group=e.group,
                                                     async_op=True), exchange_name(e.phase, e.layer), e.group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        e = ctx.exchange  # the gradient of the wait launched the reverse exchange into ``e.backward_out``
        if e.backward_work is not None:
            wait(e.backward_work, exchange_name(e.phase + ", backward", e.layer), e.group)
        back, e.backward_work, e.backward_out, e.backward_in = e.backward_out, None, None, None
        return back, None


class _WaitExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, exchange):  # type: ignore[override]
        if exchange.work is not None:
            wait(exchange.work, exchange_name(exchange.phase, exchange.layer), exchange.group)
            exchange.work = None
        ctx.exchange = exchange
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        e = ctx.exchange
        if e.stats is not None:
            e.stats.record(e.phase + "_backward", e.recv_splits, e.send_splits, e.self_index,
                           grad[0:1].numel() * grad.element_size())
        back = grad.new_empty((sum(e.send_splits), *grad.shape[1:]))
        e.backward_in, e.backward_out = grad.contiguous(), back  # alive until the launch's gradient waits
        if e.group is None:
            back.copy_(grad)
        else:
            e.backward_work = launched(dist.all_to_all_single(back, e.backward_in, e.send_splits, e.recv_splits,
                                                              group=e.group, async_op=True),
                                       exchange_name(e.phase + ", backward", e.layer), e.group)
        return grad, None  # passed through: the launch's gradient returns the exchanged rows


def all_to_all_async(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None, *,
    stats: CommStats | None = None, phase: str = "dispatch", self_index: int = 0,
) -> tuple[torch.Tensor, AsyncExchange]:
    """Launch :func:`all_to_all` asynchronously in both directions; ``exchange.wait(out)`` before using ``out``."""
    exchange = AsyncExchange(send_splits, recv_splits, group, stats, phase, self_index)
    return _LaunchExchange.apply(x, exchange), exchange
