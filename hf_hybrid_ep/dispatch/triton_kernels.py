"""Fused permute and unpermute-combine kernels (Triton), with their backward passes.

Permute gathers the routed ``(token, k)`` rows into destination order in one pass; unpermute-combine
forms ``out[t] = sum_j w[t, j] * y[pos(t, j)]`` in one pass. Both backward passes are gathers too
(each token has exactly k positions), so nothing uses atomics and results are deterministic.

Offsets: every row index that is multiplied by a width is 64-bit (program ids cast with ``.to(tl.int64)``,
indices loaded from the int64 index tensors cast too), so ``row * hidden`` cannot wrap once a tensor holds
2**31 elements or more (``tests/test_triton.py`` checks the source: the interpreter cannot reach that size).

Import this module only where the kernels can run: a CUDA device, or the CPU interpreter
(``TRITON_INTERPRET=1`` set before import; test in fp32/fp16 there, its bf16 arithmetic is broken).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gathers import inverse_permutation

BLOCK_H = 128


@triton.jit
def _permute_kernel(src, dst, order, top_k, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < hidden
    token = tl.load(order + row).to(tl.int64) // top_k
    values = tl.load(src + token * hidden + col, mask=mask)
    tl.store(dst + row * hidden + col, values, mask=mask)


@triton.jit
def _gather_sum_kernel(grad_rows, grad_tokens, position, num_rows, top_k, hidden, BLOCK: tl.constexpr):
    """grad_tokens[t] = sum_j grad_rows[position[t*k + j]] (positions >= num_rows were dropped)."""
    token = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        pos = tl.load(position + token * top_k + j).to(tl.int64)
        live = col < tl.where(pos < num_rows, hidden, 0)  # all-false for a dropped pair
        values = tl.load(grad_rows + pos * hidden + col, mask=live, other=0.0)
        acc += values.to(tl.float32)
    tl.store(grad_tokens + token * hidden + col, acc.to(grad_tokens.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(rows, weights, position, out, num_rows, top_k, hidden, BLOCK: tl.constexpr):
    """out[t] = sum_j weights[t, j] * rows[position[t*k + j]] (dropped positions contribute zero)."""
    token = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        pos = tl.load(position + token * top_k + j).to(tl.int64)
        live = col < tl.where(pos < num_rows, hidden, 0)
        w = tl.load(weights + token * top_k + j).to(tl.float32)
        values = tl.load(rows + pos * hidden + col, mask=live, other=0.0).to(tl.float32)
        acc += w * values
    tl.store(out + token * hidden + col, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(grad_out, rows, weights, position, grad_rows, grad_weights, num_rows, top_k, hidden,
                             BLOCK: tl.constexpr):
    """For pair (t, j) at row p: grad_rows[p] = w[t,j] * grad_out[t]; grad_w[t,j] = <grad_out[t], rows[p]>."""
    pair = tl.program_id(0).to(tl.int64)
    token = pair // top_k
    pos = tl.load(position + pair).to(tl.int64)
    limit = tl.where(pos < num_rows, hidden, 0)
    w = tl.load(weights + pair).to(tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        col = start + tl.arange(0, BLOCK)
        mask = col < hidden
        live = col < limit
        g = tl.load(grad_out + token * hidden + col, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(rows + pos * hidden + col, mask=live, other=0.0).to(tl.float32)
        tl.store(grad_rows + pos * hidden + col, (w * g).to(grad_rows.dtype.element_ty), mask=live)
        dot += g * y
    tl.store(grad_weights + pair, tl.sum(dot, axis=0).to(grad_weights.dtype.element_ty))


@triton.jit
def _gather_kernel(src, dst, index, hidden, BLOCK: tl.constexpr):
    """dst[row] = src[index[row]], or zeros where index[row] < 0 (padding)."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    source = tl.load(index + row).to(tl.int64)
    live = col < tl.where(source >= 0, hidden, 0)
    values = tl.load(src + source * hidden + col, mask=live, other=0.0)
    tl.store(dst + row * hidden + col, values, mask=col < hidden)


def _grid(rows: int, hidden: int) -> tuple[int, int]:
    return (rows, triton.cdiv(hidden, BLOCK_H))


class FusedPermute(torch.autograd.Function):
    """``rows[i] = hidden[order[i] // k]`` for the first ``num_rows`` entries of ``order``."""

    @staticmethod
    def forward(ctx, hidden, order, num_rows, top_k):  # type: ignore[override]
        hidden = hidden.contiguous()
        tokens, width = hidden.shape
        rows = hidden.new_empty((num_rows, width))
        if num_rows:
            _permute_kernel[_grid(num_rows, width)](hidden, rows, order, top_k, width, BLOCK=BLOCK_H)
        ctx.save_for_backward(order)
        ctx.shape, ctx.num_rows, ctx.top_k = hidden.shape, num_rows, top_k
        return rows

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        tokens, width = ctx.shape
        grad = grad_rows.new_empty((tokens, width))
        if tokens:
            _gather_sum_kernel[_grid(tokens, width)](
                grad_rows.contiguous(), grad, inverse_permutation(order), ctx.num_rows, ctx.top_k, width, BLOCK=BLOCK_H
            )
        return grad, None, None, None


class FusedUnpermuteCombine(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * rows[position(t, j)]``; rows past ``num_rows`` are dropped pairs."""

    @staticmethod
    def forward(ctx, rows, weights, order, num_tokens):  # type: ignore[override]
        rows, weights = rows.contiguous(), weights.contiguous()
        top_k = weights.shape[1]
        width = rows.shape[1]
        out_dtype = torch.promote_types(rows.dtype, weights.dtype)
        out = rows.new_empty((num_tokens, width), dtype=out_dtype)
        position = inverse_permutation(order)
        if num_tokens:
            _combine_kernel[_grid(num_tokens, width)](
                rows, weights, position, out, rows.shape[0], top_k, width, BLOCK=BLOCK_H
            )
        ctx.save_for_backward(rows, weights, position)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        rows, weights, position = ctx.saved_tensors
        top_k, width = weights.shape[1], rows.shape[1]
        grad_rows = torch.zeros_like(rows)
        grad_weights = torch.empty_like(weights)
        if weights.numel():
            _combine_backward_kernel[(weights.numel(),)](
                grad_out.contiguous(), rows, weights, position, grad_rows, grad_weights, rows.shape[0], top_k, width,
                BLOCK=BLOCK_H,
            )
        return grad_rows, grad_weights, None, None


def _gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = src.new_empty((index.numel(), src.shape[1]))
    if index.numel():
        _gather_kernel[_grid(index.numel(), src.shape[1])](src, out, index, src.shape[1], BLOCK=BLOCK_H)
    return out


class FusedGatherRows(torch.autograd.Function):
    """``out[j] = src[index[j]]`` (zeros where ``index[j] < 0``); every source row is used at most once, so
    the backward is the gather by ``inverse`` (``inverse[i]``: where source row ``i`` went, -1: nowhere)."""

    @staticmethod
    def forward(ctx, src, index, inverse):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return _gather(src.contiguous(), index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return _gather(grad.contiguous(), inverse), None, None


def fused_gather_rows(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return FusedGatherRows.apply(src, index, inverse)


def fused_permute(hidden: torch.Tensor, order: torch.Tensor, num_rows: int, top_k: int) -> torch.Tensor:
    return FusedPermute.apply(hidden, order, num_rows, top_k)


def fused_unpermute_combine(rows: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return FusedUnpermuteCombine.apply(rows, weights, order, num_tokens)
