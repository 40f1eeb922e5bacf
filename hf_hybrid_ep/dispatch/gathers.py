"""The differentiable gathers around a token exchange; each backward is a gather too (no scatter-add).

* :class:`GatherTokens`: tokens → rows in send order (``rows[i] = hidden[order[i] // k]``);
* :func:`weighted_gather`: the combine ``out[t] = Σ_j w[t, j] · rows[position(t, j)]`` as one gather and one
  batched product.
"""

from __future__ import annotations

import torch


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``position`` with ``position[order[i]] = i``: where each entry of a permutation went (int64, same device)."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return position


class GatherTokens(torch.autograd.Function):
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
        position = inverse_permutation(order)
        live = (position < n).to(grad_rows.dtype).view(tokens, 1, k)
        picked = grad_rows.index_select(0, position.clamp(max=n - 1)).view(tokens, k, -1)
        return torch.bmm(live, picked).squeeze(1), None, None, None


class WeightedGather(torch.autograd.Function):
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
        picked = WeightedGather._picked(rows, position, tokens, k, dtype)
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
            picked = WeightedGather._picked(rows, position, tokens, k, grad_out.dtype)
            grad_w = torch.bmm(picked, grad_out.unsqueeze(2)).view(tokens, k).to(weights.dtype)
        return grad_rows, grad_w, None, None


def weighted_gather(rows: torch.Tensor, weights: torch.Tensor, position: torch.Tensor,
                    order: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: ``Σ_j weights[t, j] · rows[position[t·k + j]]`` for the pairs that have a row (the first
    ``rows.shape[0]`` of ``order``, ``position`` its inverse); the others contribute zero. Differentiable in
    ``rows`` and ``weights``."""
    return WeightedGather.apply(rows, weights, position, order)
