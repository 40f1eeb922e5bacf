"""Frozen weights kept in memory in their checkpoint form, dequantized one expert group (or row tile) at a time.

A holder is an ``nn.Module`` whose buffers are the checkpoint's tensors as shipped (never ``Parameter``\\ s: a
frozen base gets no gradient and no optimizer state):

* :class:`BlockFP8Weight`: ``data`` float8 ``[..., R, C]`` and ``scale_inv`` ``[..., ceil(R/bm), ceil(C/bn)]``
  (float32, bfloat16, float16 or e8m0), one scale per ``bm × bn`` block, edge blocks clipped; the weight in the
  model's layout is ``data`` itself (a dense linear's ``[out, in]``, fused experts' ``[E, out, in]``);
* :class:`MXFP4Weight`: GPT-OSS's ``blocks`` uint8 ``[E, N, G, 16]`` and e8m0 ``scales`` ``[E, N, G]``, which
  are ``[E, 32·G, N]`` in the model's layout (``[E, in, out]``, the experts' ``is_transposed`` storage).

``shape`` and ``dtype`` are those of the dequantized weight, what the model sees; ``nbytes`` the bytes held.
Dequantizing goes through :mod:`hf_hybrid_ep.quant.formats` and rounds once to ``dtype``, so a group equals
the same experts of the checkpoint dequantized by :class:`hf_hybrid_ep.checkpoint.dequantize.Dequantizer`
bit for bit. ``module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` change what the weight dequantizes to and
leave the stored tensors as they are (casting float32 scales would change the weight's values).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import CheckpointError
from . import formats
from .formats import (
    E8M0_DTYPES,
    FP8_SCALE_DTYPES,
    FP8_WEIGHT_DTYPES,
    MXFP4_GROUP,
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_scale_grid,
)

DEQUANTIZE_CHUNK = 1 << 20  # values dequantized at once on the way to a narrower dtype (a 4 MiB float32 chunk)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class QuantizedWeight(nn.Module):
    """A frozen weight held quantized (see the module docstring): the common part of the formats.

    Subclasses register their buffers, set ``shape`` (the dequantized weight's, in the model's layout) and define
    their stored rows and their float32 product (:meth:`_float32`).
    """

    shape: torch.Size
    method: str

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        super().__init__()
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise CheckpointError(f"{name}: a quantized weight dequantizes to a float dtype of 16 bits or more, "
                                  f"got {_dtype_name(dtype)}")
        self.dtype, self.name = dtype, name

    @property
    def device(self) -> torch.device:
        return next(iter(self._buffers.values())).device

    @property
    def num_experts(self) -> int:
        """Leading groups :meth:`dequantize_experts` takes: the experts of a 3-D weight, 1 for a 2-D one."""
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def nbytes(self) -> int:
        """Bytes held: the quantized values and their scales."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def dequantized_nbytes(self, experts: int | None = None, dtype: torch.dtype | None = None) -> int:
        """Bytes of ``experts`` experts (all when ``None``) dequantized to ``dtype`` (default :attr:`dtype`)."""
        per_expert = math.prod(self.shape) // self.num_experts
        count = self.num_experts if experts is None else experts
        return per_expert * count * (dtype or self.dtype).itemsize

    def workspace_nbytes(self, experts: int = 1, dtype: torch.dtype | None = None) -> int:
        """The most bytes :meth:`dequantize_experts` of ``experts`` experts to ``dtype`` has alive at once (what a
        projection adds to its inputs and outputs at its peak): to float32 the product and its lookup and scale
        temporaries; to a narrower dtype the rounded experts and one chunk's float32 product and temporaries."""
        dtype = dtype or self.dtype
        if dtype == torch.float32:
            return self.dequantized_nbytes(experts, torch.float32) + self._temporaries_nbytes(experts, self._rows)
        chunk = min(self._chunk_rows(), self._rows)
        chunk_nbytes = chunk * self._row_values * 4 + self._temporaries_nbytes(1, chunk)
        return self.dequantized_nbytes(experts, dtype) + chunk_nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight ``shape``, in ``dtype`` (default :attr:`dtype`)."""
        out = self.dequantize_experts(0, self.num_experts, dtype)
        return out if len(self.shape) == 3 else out[0]

    def dequantize_experts(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Experts ``start:stop`` in the model's layout, ``[stop − start, *shape[1:]]`` (a 2-D weight: ``0:1``
        gives ``[1, *shape]``), in ``dtype`` (default :attr:`dtype`); nothing else is dequantized. To a dtype
        narrower than float32, :data:`DEQUANTIZE_CHUNK` values at a time are dequantized and rounded into the
        result, so no float32 copy of the experts is made."""
        if not 0 <= start < stop <= self.num_experts:
            raise IndexError(f"{self.name}: experts {start}:{stop} of {self.num_experts}")
        dtype = dtype or self.dtype
        if dtype == torch.float32:
            return self._float32(slice(start, stop), slice(None))
        out = torch.empty(stop - start, self._rows, self._row_values, dtype=dtype, device=self.device)
        step = self._chunk_rows()
        for i, expert in enumerate(range(start, stop)):
            for row in range(0, self._rows, step):
                rows = slice(row, min(row + step, self._rows))
                out[i, rows] = self._stored_layout(self._float32(slice(expert, expert + 1), rows))[0]
        return self._model_layout(out)

    def _chunk_rows(self) -> int:
        """Stored rows dequantized at once on the way to a narrower dtype: about :data:`DEQUANTIZE_CHUNK` values."""
        return max(1, DEQUANTIZE_CHUNK // self._row_values)

    # what a format defines: its stored rows (``_rows`` of ``_row_values`` values an expert), the float32 product
    # of experts × rows, and the layout it returns it in
    _rows: int
    _row_values: int

    def _float32(self, experts: slice, rows: slice) -> torch.Tensor:
        """Float32 ``[k, ...]`` of stored rows ``rows`` of experts ``experts``, in the model's layout."""
        raise NotImplementedError

    def _temporaries_nbytes(self, experts: int, rows: int) -> int:
        """The most bytes :meth:`_float32` of ``rows`` stored rows of ``experts`` experts holds besides its result."""
        raise NotImplementedError

    def _stored_layout(self, t: torch.Tensor) -> torch.Tensor:
        """``[k, rows, row_values]`` of a result of :meth:`_float32` (a view)."""
        return t

    def _model_layout(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_stored_layout`."""
        return t

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """``module.to(...)`` and the like: the buffers move to the device ``fn`` gives a float tensor and keep
        their dtypes; :attr:`dtype` becomes the dtype ``fn`` gives it."""
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        for key, buf in self._buffers.items():
            moved = torch.empty_like(buf, device=probe.device) if buf.is_meta else buf.to(probe.device)
            self._buffers[key] = moved
        self.dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        return f"{self.method}, shape={tuple(self.shape)}, dtype={_dtype_name(self.dtype)}, nbytes={self.nbytes}"


class BlockFP8Weight(QuantizedWeight):
    """A block-FP8 weight: ``data`` float8 ``[..., R, C]`` (2-D, or 3-D fused experts), ``scale_inv``
    ``[..., ceil(R/bm), ceil(C/bn)]`` with ``block = (bm, bn)`` (``weight_block_size``).

    Args:
        data, scale_inv: the checkpoint's tensors (kept as given: same dtype, same storage).
        block: rows × columns of ``data`` one scale covers.
        dtype: what the weight dequantizes to (the model's dtype).
        name: the checkpoint key of ``data``, for messages.

    Raises:
        CheckpointError: naming ``name``, for a dtype or a scale grid that does not fit.
    """

    method = "fp8"

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 dtype: torch.dtype = torch.bfloat16, name: str = "weight") -> None:
        super().__init__(dtype, name)
        if data.dtype not in FP8_WEIGHT_DTYPES or data.dim() not in (2, 3):
            raise CheckpointError(f"{name}: {_dtype_name(data.dtype)} {tuple(data.shape)}; a block-FP8 weight is "
                                  "float8_e4m3fn or float8_e5m2 with 2 dimensions (or 3: fused experts)")
        if scale_inv.dtype not in FP8_SCALE_DTYPES:
            raise CheckpointError(f"{name}: scales in {_dtype_name(scale_inv.dtype)}; block-FP8 scales are float32, "
                                  "bfloat16, float16 or e8m0 (float8_e8m0fnu or uint8)")
        grid = fp8_scale_grid(tuple(data.shape), block)
        if tuple(scale_inv.shape) != grid:
            raise CheckpointError(f"{name}: scale grid {tuple(scale_inv.shape)} does not fit the weight "
                                  f"{tuple(data.shape)} in blocks of {block[0]}×{block[1]}, which needs {grid}")
        self.block = (int(block[0]), int(block[1]))
        self.register_buffer("data", data)
        self.register_buffer("scale_inv", scale_inv)
        self.shape = data.shape

    @property
    def _rows(self) -> int:
        return self.shape[-2]

    @property
    def _row_values(self) -> int:
        return self.shape[-1]

    def _chunk_rows(self) -> int:
        """Whole blocks of rows: a chunk's rows own their scale rows."""
        bm = self.block[0]
        return max(1, DEQUANTIZE_CHUNK // (self._row_values * bm)) * bm

    def _float32(self, experts: slice, rows: slice) -> torch.Tensor:
        data, scale = (self.data, self.scale_inv) if self.data.dim() == 3 else (self.data[None], self.scale_inv[None])
        start, stop, _ = rows.indices(self._rows)
        bm = self.block[0]
        return dequantize_fp8(data[experts, start:stop], scale[experts, start // bm : math.ceil(stop / bm)],
                              self.block)

    def _temporaries_nbytes(self, experts: int, rows: int) -> int:
        grid_rows, grid_cols = math.ceil(rows / self.block[0]), self.scale_inv.shape[-1]
        lookup = 4 * min(experts * rows * self._row_values, formats.DECODE_CHUNK)  # an int32 index a byte
        scales = 4 * grid_rows * grid_cols * 4 + grid_rows * self.block[0] * grid_cols * 4  # e8m0 decoding, per row
        return lookup + experts * scales

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D weight, ``[stop − start, C]`` in ``dtype`` (default :attr:`dtype`):
        a tile of a dense layer. ``start`` is a multiple of the block's rows (a tile owns whole scale rows)."""
        bm = self.block[0]
        if self.data.dim() != 2 or not 0 <= start < stop <= self._rows or start % bm:
            raise IndexError(f"{self.name}: rows {start}:{stop} of a {tuple(self.shape)} weight; tiles of a 2-D "
                             f"weight start at a multiple of {bm}")
        return self._float32(slice(0, 1), slice(start, stop))[0].to(dtype or self.dtype)


class MXFP4Weight(QuantizedWeight):
    """GPT-OSS's MXFP4 experts: ``blocks`` uint8 ``[E, N, G, 16]`` and e8m0 ``scales`` uint8 ``[E, N, G]``, in
    the model's layout ``[E, 32·G, N]`` (``[E, in, out]``).

    Args:
        blocks, scales: the checkpoint's ``*_blocks`` and ``*_scales`` (kept as given).
        dtype: what the weight dequantizes to (the model's dtype).
        name: the checkpoint key of the dequantized tensor, for messages.

    Raises:
        CheckpointError: naming ``name``, for shapes or dtypes that do not fit.
    """

    method = "mxfp4"

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                 name: str = "weight") -> None:
        super().__init__(dtype, name)
        half = MXFP4_GROUP // 2
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != half:
            raise CheckpointError(f"{name}: blocks {_dtype_name(blocks.dtype)} {tuple(blocks.shape)}; mxfp4 expert "
                                  f"blocks are uint8 [experts, rows, groups, {half}]")
        if scales.dtype not in E8M0_DTYPES or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise CheckpointError(f"{name}: scales {_dtype_name(scales.dtype)} {tuple(scales.shape)} do not fit the "
                                  f"blocks {tuple(blocks.shape)}: mxfp4 scales are e8m0 {tuple(blocks.shape[:-1])}")
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        experts, rows, groups, _ = blocks.shape
        self.shape = torch.Size((experts, groups * MXFP4_GROUP, rows))

    @property
    def _rows(self) -> int:
        return self.blocks.shape[1]

    @property
    def _row_values(self) -> int:
        return self.blocks.shape[2] * MXFP4_GROUP

    def _float32(self, experts: slice, rows: slice) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[experts, rows], self.scales[experts, rows])

    def _temporaries_nbytes(self, experts: int, rows: int) -> int:
        lookup = 4 * min(experts * rows * self._row_values // 2, formats.DECODE_CHUNK)  # an int32 index a byte
        return lookup + experts * 4 * rows * self.blocks.shape[2] * 4  # and the e8m0 decoding of the scales

    def _stored_layout(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(-2, -1)

    def _model_layout(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(-2, -1)
