"""The differentiable gathers around a token exchange; each backward is a gather too (no scatter-add).

* :class:`GatherTokens`: tokens → rows in send order (``rows[i] = hidden[order[i] // k]``);
* :func:`weighted_gather`: the combine ``out[t] = Σ_j w[t, j] · rows[position(t, j)]`` as gathers and batched
  products.

Every gather that picks ``k`` rows per output row (the combine, the backward of :class:`GatherTokens`, the
routing-weight gradients) runs over output rows in chunks, so that the picked rows it holds at once never
exceed ``chunk_bytes`` (default :data:`CHUNK_BYTES`) beside its inputs and outputs: at top-k 8 the picked
rows of a whole call are k times its output.
"""

from __future__ import annotations

import math

import torch

CHUNK_BYTES = 64 * 2**20  # the most bytes of picked rows one gather holds at once (per call, so per layer)


def row_chunks(count: int, unit_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[(a, b), …]`` covering ``0..count`` in order, each ``(b − a) · unit_bytes ≤ chunk_bytes`` (at least one
    unit)."""
    step = max(1, chunk_bytes // max(1, unit_bytes))
    return [(a, min(count, a + step)) for a in range(0, count, step)]


def row_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of one row of ``t`` (its first dimension indexes rows) in ``dtype`` (default its own)."""
    return math.prod(t.shape[1:]) * (dtype or t.dtype).itemsize


def picked_rows(rows: torch.Tensor, position: torch.Tensor, dtype: torch.dtype, zero_missing: bool) -> torch.Tensor:
    """``[n, H]`` ``rows[position]`` in ``dtype``; a position past the last row (a pair without a row) reads a
    zero row when ``zero_missing``, else the last row (for a caller that weights it 0)."""
    count = rows.shape[0]
    if count == 0:
        return rows.new_zeros((position.numel(), *rows.shape[1:]), dtype=dtype)
    picked = rows.index_select(0, position.clamp(max=count - 1))
    if zero_missing:
        picked.masked_fill_((position >= count).view(-1, *([1] * (rows.dim() - 1))), 0)
    return picked.to(dtype)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``position`` with ``position[order[i]] = i``: where each entry of a permutation went (int64, same device)."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return position


class GatherTokens(torch.autograd.Function):
    """``rows[i] = hidden[order[i] // k]`` for the first ``n`` pairs; the backward sums each token's rows
    with gathers and batched products, ``chunk_bytes`` of picked rows at a time (pairs not among the ``n``
    contribute nothing)."""

    @staticmethod
    def forward(ctx, hidden, order, n, top_k, chunk_bytes=CHUNK_BYTES):  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.n, ctx.top_k, ctx.tokens, ctx.chunk_bytes = n, top_k, hidden.shape[0], chunk_bytes
        return hidden.index_select(0, order[:n] // top_k)

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        n, k, tokens = ctx.n, ctx.top_k, ctx.tokens
        grad = grad_rows.new_zeros((tokens, grad_rows.shape[1])) if n == 0 else grad_rows.new_empty(
            (tokens, grad_rows.shape[1]))
        if n:
            position = inverse_permutation(order)
            live = (position < n).to(grad_rows.dtype).view(tokens, 1, k)
            for a, b in row_chunks(tokens, k * row_bytes(grad_rows), ctx.chunk_bytes):
                picked = picked_rows(grad_rows, position[a * k : b * k], grad_rows.dtype, zero_missing=False)
                torch.bmm(live[a:b], picked.view(b - a, k, -1), out=grad[a:b].unsqueeze(1))
        return grad, None, None, None, None


class WeightedGather(torch.autograd.Function):
    """``out[t] = Σ_j w[t, j] · rows[position[t*k + j]]``; a pair whose position is past the last row
    (``position ≥ rows.shape[0]``: dropped, or routed elsewhere) contributes zero.

    Forward: gathers and batched products over chunks of output rows. Backward: ``grad_rows[p] = w(pair p) ·
    grad_out[t(p)]`` (a gather, every row belongs to exactly one pair, ``order[p]``) and, when the weights need
    it, ``grad_w[t, j] = ⟨grad_out[t], rows[position[t, j]]⟩`` (the gathers recomputed, batched products).
    """

    @staticmethod
    def forward(ctx, rows, weights, position, order, chunk_bytes):  # type: ignore[override]
        tokens, k = weights.shape
        dtype = torch.promote_types(rows.dtype, weights.dtype)
        out = rows.new_empty((tokens, *rows.shape[1:]), dtype=dtype)
        missing = rows.shape[0] < position.numel()
        for a, b in row_chunks(tokens, k * row_bytes(rows, dtype), chunk_bytes):
            picked = picked_rows(rows, position[a * k : b * k], dtype, zero_missing=missing)
            torch.bmm(weights[a:b].to(dtype).unsqueeze(1), picked.view(b - a, k, -1), out=out[a:b].unsqueeze(1))
        ctx.save_for_backward(rows, weights, position, order)
        ctx.chunk_bytes = chunk_bytes
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        rows, weights, position, order = ctx.saved_tensors
        tokens, k = weights.shape
        grad_rows = grad_w = None
        if ctx.needs_input_grad[0]:
            pairs = order[: rows.shape[0]]
            grad_rows = grad_out.index_select(0, pairs // k)
            grad_rows = grad_rows.mul_(weights.reshape(-1, 1)[pairs].to(grad_out.dtype)).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.new_empty((tokens, k))
            for a, b in row_chunks(tokens, k * row_bytes(grad_out), ctx.chunk_bytes):
                picked = picked_rows(rows, position[a * k : b * k], grad_out.dtype, zero_missing=False)
                torch.bmm(picked.view(b - a, k, -1), grad_out[a:b].unsqueeze(2), out=grad_w[a:b].unsqueeze(2))
            if rows.shape[0] < position.numel():  # pairs without a row: no gradient
                grad_w = torch.where(position.view(tokens, k) < rows.shape[0], grad_w, grad_w.new_zeros(()))
            grad_w = grad_w.to(weights.dtype)
        return grad_rows, grad_w, None, None, None


def weighted_gather(rows: torch.Tensor, weights: torch.Tensor, position: torch.Tensor, order: torch.Tensor,
                    chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``[T, H]``: ``Σ_j weights[t, j] · rows[position[t·k + j]]`` for the pairs that have a row (the first
    ``rows.shape[0]`` of ``order``, ``position`` its inverse); the others contribute zero. Differentiable in
    ``rows`` and ``weights``; at most ``chunk_bytes`` of picked rows at once."""
    return WeightedGather.apply(rows, weights, position, order, chunk_bytes)
