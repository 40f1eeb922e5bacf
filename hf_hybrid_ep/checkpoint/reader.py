"""Reading a checkpoint's tensors by key, each file checked against the manifest when first opened."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .dequantize import Dequantizer
from .format import INDEX_NAME, safe_member
from .manifest import CheckpointVerifier
from .safetensors_io import TensorFiles, read_header


class CheckpointReader(TensorFiles):
    """The tensors of a checkpoint directory ``root`` (``weight_map``: key → file): opens each needed file once,
    checked first by ``verifier``; reads whole tensors or row subsets of fused tensors, dequantized where the
    checkpoint is quantized (only the rows asked for). ``fetch(name)``, if given, returns the local path of file
    ``name`` (downloading it)."""

    def __init__(self, root: Path, weight_map: dict[str, str], fetch: Callable[[str], Path] | None = None,
                 verifier: CheckpointVerifier | None = None, dequantizer: Dequantizer | None = None) -> None:
        super().__init__(weight_map, self._path)
        self.root, self.fetch, self.verifier = root, fetch, verifier
        self.dequantizer = dequantizer or Dequantizer(None, weight_map)

    def _path(self, name: str) -> Path:
        member = safe_member(self.root, name, INDEX_NAME)
        path = self.fetch(name) if self.fetch is not None else member
        _, metadata = read_header(path)  # a clear error for a missing or truncated file
        if self.verifier is not None:
            self.verifier.check(name, path, metadata)
        return path

    def tensor(self, key: str) -> torch.Tensor:
        return self.dequantizer.read(self, key)

    def rows(self, key: str, rows: list[int]) -> torch.Tensor:
        if rows == list(range(rows[0], rows[-1] + 1)):
            return self.dequantizer.read(self, key, slice(rows[0], rows[-1] + 1))
        return torch.cat([self.dequantizer.read(self, key, slice(r, r + 1)) for r in rows])
