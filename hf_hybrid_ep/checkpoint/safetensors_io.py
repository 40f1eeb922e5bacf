"""Streaming safetensors I/O: headers without data, and a writer that never holds a whole file.

The safetensors library writes a file from a complete in-memory dict. To convert checkpoints larger
than memory, :class:`StreamingSafetensorsWriter` lays out the header first (names, dtypes, shapes
and offsets are known up front) and then writes each tensor's bytes at its offset as it arrives.
The files it writes are ordinary safetensors files (checked by reading them back with ``safe_open``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
_MAX_HEADER = 100 * 2**20
# Test hook: called with the name of each write point of a save (tests/test_crash_safety.py).
_write_point: Callable[[str], None] | None = None


def write_point(name: str) -> None:
    """Mark one write point of a save (a file open or close, an fsync, a rename, the index write)."""
    if _write_point is not None:
        _write_point(name)


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor, known without reading its data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """Tensor specs and ``__metadata__`` of a safetensors file, reading only its header.

    Raises:
        CheckpointError: naming the file when it is missing, truncated or not safetensors.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file {str(path)!r}")
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{str(path)!r} is truncated: no safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{str(path)!r} is truncated or not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{str(path)!r} has a corrupt safetensors header: {err}") from err
    metadata = header.pop("__metadata__", {}) or {}
    specs, end = {}, 0
    for name, info in header.items():
        if info.get("dtype") not in ST_TO_DTYPE:
            raise CheckpointError(f"{str(path)!r}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        spec = TensorSpec(name, ST_TO_DTYPE[info["dtype"]], tuple(info["shape"]))
        begin, stop = info["data_offsets"]
        if stop - begin != spec.nbytes:
            raise CheckpointError(f"{str(path)!r}: tensor {name!r} has inconsistent offsets")
        end = max(end, stop)
        specs[name] = spec
    if 8 + n + end > size:
        raise CheckpointError(
            f"{str(path)!r} is truncated: its header describes {8 + n + end} bytes, the file has {size}"
        )
    return specs, metadata


def nonfinite_count(t: torch.Tensor) -> int:
    """How many elements of ``t`` are NaN or inf (0 for integer tensors; float8 and other 1-byte types are
    widened to check)."""
    if not t.is_floating_point():
        return 0
    return int((~torch.isfinite(t.float() if t.element_size() == 1 else t)).sum())


def set_metadata(path: str | os.PathLike[str], metadata: Mapping[str, str]) -> None:
    """Replace the header metadata of safetensors file ``path`` (a file another library wrote), its tensors'
    bytes copied unchanged, through a temporary name."""
    import shutil

    path = Path(path)
    read_header(path)  # a complete, well-formed file
    tmp = path.with_name(f".{path.name}.tmp")
    with path.open("rb") as src:
        (n,) = struct.unpack("<Q", src.read(8))
        header = json.loads(src.read(n))
        header["__metadata__"] = dict(metadata)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        write_point(f"open {path.name}")
        with tmp.open("wb") as dst:
            dst.write(struct.pack("<Q", len(blob)) + blob)
            shutil.copyfileobj(src, dst, 16 * 2**20)
    write_point(f"close {path.name}")
    tmp.replace(path)


def sha256_file(path: str | os.PathLike[str], chunk: int = 16 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, in any order, without holding the file in memory."""

    def __init__(
        self, path: str | os.PathLike[str], specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self.specs = {s.name: s for s in sorted(specs, key=lambda s: s.name)}
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        self._offsets: dict[str, int] = {}
        for name, spec in self.specs.items():
            header[name] = {"dtype": DTYPE_TO_ST[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
            self._offsets[name] = offset
            offset += spec.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._data_start = 8 + len(blob)
        self._written: set[str] = set()
        self._rows: dict[str, int] = {}
        write_point(f"open {self.path.name}")
        self._file = self.path.open("wb")
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._file.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor, row: int = 0) -> None:
        """Write tensor ``name`` whole, or rows ``row, row + 1, ...`` of its leading dimension (a tensor
        written in parts is complete when every row is)."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{name!r} is not a tensor of {self.path.name}")
        whole = tuple(tensor.shape) == spec.shape and row == 0
        fits = bool(spec.shape) and tuple(tensor.shape[1:]) == spec.shape[1:] and 0 <= row <= spec.shape[0] - len(tensor)
        if tensor.dtype != spec.dtype or not (whole or fits):
            raise ValueError(
                f"{name!r}: expected {spec.dtype} {spec.shape}, got {tensor.dtype} {tuple(tensor.shape)} at row {row}"
            )
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else 0
        self._file.seek(self._data_start + self._offsets[name] + row * row_bytes)
        self._file.write(data.data)
        self._rows[name] = self._rows.get(name, 0) + (len(tensor) if spec.shape else 1)
        if self._rows[name] >= (spec.shape[0] if spec.shape else 1):
            self._written.add(name)

    def close(self) -> None:
        self._file.close()
        write_point(f"close {self.path.name}")
        missing = sorted(set(self.specs) - self._written)
        if missing:
            raise CheckpointError(f"{self.path.name}: tensors never written: {missing[:5]}")

    def abort(self) -> None:
        self._file.close()


class TensorFiles:
    """Tensors by key from a checkpoint's safetensors files, each file opened once and kept open until
    :meth:`close` (a context manager: memory-mapped pages a read touched are released on close).

    Args:
        weight_map: key → file name.
        path_of: file name → the path to open (and check) it at.
    """

    def __init__(self, weight_map: Mapping[str, str], path_of: Callable[[str], Path]) -> None:
        self.weight_map, self.path_of = weight_map, path_of
        self._handles: dict[str, object] = {}

    def _handle(self, key: str):
        from safetensors import safe_open

        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = safe_open(self.path_of(name), framework="pt")
        return self._handles[name]

    def spec(self, key: str) -> TensorSpec:
        sl = self._handle(key).get_slice(key)
        return TensorSpec(key, ST_TO_DTYPE[sl.get_dtype()], tuple(sl.get_shape()))

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``key``, or rows ``rows`` of its leading dimension."""
        if rows is None:
            return self._handle(key).get_tensor(key)
        return self._handle(key).get_slice(key)[rows]

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
