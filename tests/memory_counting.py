"""Count what the gathers around a token exchange cost in memory: bytes each ATen op reads and writes, and the
largest tensor created.

:class:`MemoryTrafficCounter` is a ``TorchDispatchMode`` that adds up, per op, the bytes it actually reads and
writes: a gather (``index_select``, ``index``, ``gather``) reads the rows it picks and its index, not its
whole source; an in-place scatter (``index_add_``, ``index_copy_``, ``index_fill_``, ``scatter_add_``) reads and
writes the rows it touches; ``copy_`` reads its source and writes as much; a fill writes its output; ``empty``
and views (outputs that share an input's storage) move nothing; every other op reads its inputs (a broadcast
input once: its distinct elements) and writes its outputs (an ``out=`` tensor is an output). Collectives
(``c10d``) are the link's bytes, counted by :class:`~hf_hybrid_ep.dispatch.stats.CommStats`, not here.

:class:`LargestTensor` records the largest storage an op creates inside it: a temporary that grows with the
work of a call shows there.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GATHERS = {"index_select", "index", "gather", "embedding"}
SCATTERS = {"index_add", "index_add_", "index_copy", "index_copy_", "scatter_add", "scatter_add_", "index_put",
            "index_put_"}
FILLS = {"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "full", "full_like", "new_full", "fill_", "zero_",
         "arange", "scalar_tensor", "lift_fresh"}
EMPTY = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor view reaches: broadcast (stride-0) dimensions count once."""
    count = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            count *= size
    return count * t.element_size() if t.numel() else 0


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def op_bytes(name: str, args, kwargs, out) -> tuple[int, int]:
    """``(read, written)`` bytes of one ATen op (rules in the module docstring)."""
    inputs = _tensors((args, {key: value for key, value in kwargs.items() if key != "out"}))
    outputs = _tensors(out)
    if name in EMPTY:
        return 0, 0
    if name in FILLS:
        return 0, sum(distinct_bytes(t) for t in outputs[:1])
    if outputs and inputs and name not in SCATTERS and not name.endswith("_") and all(
            t.numel() == 0 or any(_storage(t) == _storage(i) for i in inputs) for t in outputs):
        return 0, 0  # a view: nothing moves
    if name in GATHERS:
        picked = sum(distinct_bytes(t) for t in outputs)
        index = sum(distinct_bytes(t) for t in inputs[1:] if not t.is_floating_point())
        return picked + index, picked
    if name in SCATTERS:  # (self, dim, index, source) or index_put (self, indices, values)
        source, index = inputs[-1], sum(distinct_bytes(t) for t in inputs[1:-1])
        touched = distinct_bytes(source)
        return 2 * touched + index if "add" in name or "put" in name else touched + index, touched
    if name == "copy_":
        return distinct_bytes(inputs[1]), distinct_bytes(inputs[1])
    if name == "index_fill_":
        row = distinct_bytes(inputs[0]) // max(1, inputs[0].shape[args[1]])
        return distinct_bytes(inputs[1]), row * inputs[1].numel()
    return sum(distinct_bytes(t) for t in inputs), sum(distinct_bytes(t) for t in outputs)


class MemoryTrafficCounter(TorchDispatchMode):
    """``read`` and ``written`` bytes of the ATen ops run inside the mode, and both per op (``by_op``)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = self.written = 0
        self.by_op: Counter = Counter()

    @property
    def total(self) -> int:
        return self.read + self.written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "c10d":
            name = func._overloadpacket.__name__
            read, written = op_bytes(name, args, kwargs, out)
            self.read += read
            self.written += written
            self.by_op[name] += read + written
        return out


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest storage an ATen op created inside the mode (``largest``) and which op (``op``);
    an op's output that shares an input's storage (a view, an in-place op) created none."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known = {_storage(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if _storage(t) not in known and t.untyped_storage().nbytes() > self.largest:
                self.largest, self.op = t.untyped_storage().nbytes(), func._overloadpacket.__name__
        return out
