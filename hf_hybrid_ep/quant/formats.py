"""The arithmetic of the Hub's quantized weight formats: block-FP8 and MXFP4 values to floats, model-free.

* block-FP8 (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8): a weight ``[..., R, C]`` in float8 beside its scales
  ``[..., ceil(R/bm), ceil(C/bn)]`` (float32, bfloat16, float16, or e8m0 exponents); element (r, c) is
  ``float32(w[r, c]) × float32(s[r // bm, c // bn])``, one float32 product (DeepSeek's ``weight_dequant``),
  the last block row and column clipped where R or C is not a multiple of the block.
* MXFP4 (GPT-OSS): ``blocks [E, N, G, 16]`` (uint8, two e2m1 values a byte, low nibble first: 32 values a
  group) and e8m0 ``scales [E, N, G]`` (the group's scale is ``2^(s − 127)``) are ``[E, 32·G, N]``, the
  value ``float32(e2m1) × 2^(s − 127)`` (exact), transposed to the model's layout (transformers'
  ``convert_moe_packed_tensors``).

Both return float32; a caller rounds once to its dtype. Checkpoint conversion and loading
(:mod:`hf_hybrid_ep.checkpoint.dequantize`) and the kept-quantized weights (:mod:`hf_hybrid_ep.quant.weights`)
dequantize through these functions alone, so their tensors are equal bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch

FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu, torch.uint8)
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)  # e8m0 exponents, as stored
MXFP4_GROUP = 32  # e2m1 values one e8m0 scale covers
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


DECODE_CHUNK = 1 << 20  # bytes decoded per lookup: bounds the int32 index built for it (4 MiB)


def decode(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` for uint8 ``codes`` and a 1-D integer ``table`` of 256 bit patterns (each code's value,
    or values, as stored): ``[codes.numel()]`` in ``table``'s dtype, looked up :data:`DECODE_CHUNK` bytes at a
    time. A lookup copies bits (no arithmetic) and is several times faster on CPU than torch's float8 cast."""
    flat = codes.reshape(-1)
    out = torch.empty(flat.numel(), dtype=table.dtype, device=table.device)
    for start in range(0, flat.numel(), DECODE_CHUNK):
        stop = min(start + DECODE_CHUNK, flat.numel())
        torch.index_select(table, 0, flat[start:stop].to(torch.int32), out=out[start:stop])
    return out


def e8m0_to_float32(exponents: torch.Tensor) -> torch.Tensor:
    """``2^(e − 127)`` of e8m0 bytes (uint8 or float8_e8m0fnu) as float32, built from its bits (exact;
    ``e = 0`` is the subnormal 2^-127, ``e = 255`` gives inf, like transformers' ``ldexp``)."""
    e = exponents.view(torch.uint8).to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def scales_float32(scale: torch.Tensor) -> torch.Tensor:
    """Block-FP8 scales as float32: e8m0 bytes through :func:`e8m0_to_float32`, floats widened (exact)."""
    if scale.dtype in E8M0_DTYPES:
        return e8m0_to_float32(scale)
    return scale.to(torch.float32)


def fp8_scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid ``[..., ceil(R/bm), ceil(C/bn)]`` of a block-FP8 weight of ``shape [..., R, C]``."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight [..., R, C]`` (float8) times its block's scale ``scale [..., ceil(R/bm), ceil(C/bn)]``, in
    float32 (one product per element, edge blocks clipped). Returns float32 ``[..., R, C]``."""
    bm, bn = block
    rows, cols = weight.shape[-2:]
    out = decode(_fp8_values(weight.dtype, weight.device), weight.view(torch.uint8))
    out = out.view(torch.float32).view(weight.shape)
    per_row = scales_float32(scale).repeat_interleave(bm, dim=-2)[..., :rows, :]  # [..., R, ceil(C/bn)]
    full, rest = divmod(cols, bn)
    out[..., : full * bn].unflatten(-1, (full, bn)).mul_(per_row[..., :full, None])
    if rest:
        out[..., full * bn :].mul_(per_row[..., full:])
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks [E, N, G, 16]`` and e8m0 ``scales [E, N, G]`` as float32 ``[E, 32·G, N]`` (the model's
    layout: transformers' ``convert_moe_packed_tensors``, transpose included)."""
    experts, rows, groups, half = blocks.shape
    values = decode(_byte_pairs(blocks.device), blocks).view(torch.float32).reshape(experts, rows, groups, 2 * half)
    values.mul_(e8m0_to_float32(scales)[..., None])
    return values.reshape(experts, rows, groups * 2 * half).transpose(1, 2)


@functools.cache
def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256]`` int32 on ``device``: the float32 bits of each float8 ``dtype`` code's value (torch's cast)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return codes.to(torch.float32).view(torch.int32).to(device)


@functools.cache
def _byte_pairs(device: torch.device) -> torch.Tensor:
    """``[256]`` int64 on ``device``: byte -> the float32 bits of (e2m1 value of its low nibble, of its high
    nibble), the low nibble's first in memory, so one lookup decodes both values of a byte."""
    pairs = [[FP4_E2M1_VALUES[b & 0x0F], FP4_E2M1_VALUES[b >> 4]] for b in range(256)]
    return torch.tensor(pairs, dtype=torch.float32).view(torch.int64).reshape(256).to(device)
