"""Find host tensors that a training step would copy to the device, on a machine without one.

On a GPU, a tensor the library creates without naming a device (``torch.zeros(n)``, ``torch.tensor(list)``)
lives in host memory; reading it in device compute costs a host→device copy (``.to(device)``, ``copy_``, an
index or an operand). On the CPU every tensor is a host tensor and ``.to(device)`` dispatches nothing, so
:class:`HostCopies` (a ``TorchFunctionMode``) keeps the distinction itself:

* *host tensors*: made by a factory called from ``hf_hybrid_ep``'s code without a ``device`` (or with
  ``device="cpu"``), results of ``.cpu()``, and results of ops whose tensor inputs are all host tensors;
* every other tensor is on "the device" (parameters, inputs, everything torch and transformers make, and
  what the library makes with ``device=...``).

With :attr:`HostCopies.phase` set (a step is running), it records every place in the library that moves a
host tensor to the device — ``.to(device)`` / ``.cuda()`` (the result is a new device tensor, as on a GPU),
``device_tensor.copy_(host)``, ``torch.tensor(data, device=...)`` from Python data, ``new_tensor`` — or mixes
a host tensor of one or more dimensions with a device tensor in one op (a 0-dim host tensor is a scalar
argument on CUDA, no copy). Each finding is keyed by the library line that made the call.

It cannot see host tensors made by code outside the package, nor a tensor created with an explicit
``device=`` that evaluates to the host on a GPU; it is a check on the library's own placement.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

import hf_hybrid_ep

LIBRARY = str(Path(hf_hybrid_ep.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())

FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
             torch.randperm, torch.empty_strided, torch.tril_indices, torch.triu_indices, torch.from_numpy}
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
TO_HOST = {torch.Tensor.cpu}


def _caller() -> tuple[str, bool]:
    """``("file:line", in the library)`` of the first frame outside torch and this file."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == HERE):
        frame = frame.f_back
    if frame is None:
        return "?", False
    path = frame.f_code.co_filename
    inside = path.startswith(LIBRARY)
    short = path[len(LIBRARY) + 1 :] if inside else path
    return f"{short}:{frame.f_lineno}", inside


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _names_host(device) -> bool:
    """Only the literal ``"cpu"`` names the host: ``torch.device("cpu")`` here is what ``param.device`` or the
    mesh's device evaluate to, the device on a GPU."""
    return isinstance(device, str) and device == "cpu"


def _device_target(args, kwargs) -> bool | None:
    """For ``Tensor.to(*args, **kwargs)``: ``True`` if it names a device (or a device tensor: see the caller),
    ``False`` for dtype only, ``None`` when the target is a tensor (its device decides)."""
    if "device" in kwargs:
        return not _names_host(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return None
        if isinstance(a, (torch.device, int, str)) and not isinstance(a, bool):
            return not _names_host(a)
    return False


class HostCopies(TorchFunctionMode):
    """Records, per library line, the host→device copies made while :attr:`phase` is set (see the module).

    Attributes:
        phase: the label findings are filed under (``None``: only host tensors are tracked, e.g. during
            ``parallelize``).
        found: ``{phase: {"file:line": what}}``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.host = WeakIdKeyDictionary()
        self.phase: str | None = None
        self.found: dict[str, dict[str, str]] = defaultdict(dict)

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def _flag(self, what: str) -> None:
        if self.phase is None:
            return
        site, inside = _caller()
        if inside:
            self.found[self.phase].setdefault(site, what)

    def _tag(self, out) -> None:
        for t in _outputs(out):
            self.host[t] = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            return self._factory(func, args, kwargs)
        if func in TO_DEVICE:
            return self._to(func, args, kwargs)
        if func in TO_HOST:
            out = func(*args, **kwargs)
            if not self.is_host(args[0]):
                out = out.clone()  # on a GPU, a new host tensor
            self._tag(out)
            return out
        tensors = _tensors(args, kwargs)
        hosts = [t for t in tensors if self.is_host(t)]
        if func is torch.Tensor.copy_ and hosts and self.is_host(args[1]) and not self.is_host(args[0]):
            self._flag(f"copy_ of a host tensor {tuple(args[1].shape)} into a device tensor")
        elif func is torch.Tensor.new_tensor and not self.is_host(args[0]):
            self._flag("new_tensor from host data")
        elif hosts and len(hosts) < len(tensors) and any(t.dim() >= 1 for t in hosts):
            shapes = [tuple(t.shape) for t in hosts if t.dim() >= 1]
            self._flag(f"{getattr(func, '__name__', func)} reads host tensor(s) {shapes} with device tensors")
        out = func(*args, **kwargs)
        if hosts and len(hosts) == len(tensors):
            self._tag(out)
        return out

    def _factory(self, func, args, kwargs):
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if device is None or _names_host(device):
            if _caller()[1]:
                self._tag(out)
        elif func in FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            self._flag(f"{func.__name__}(Python data, device=...)")
        return out

    def _to(self, func, args, kwargs):
        source = args[0]
        target = True if func is torch.Tensor.cuda else _device_target(args, kwargs)
        if target is None:
            other = next(a for a in args[1:] if isinstance(a, torch.Tensor))
            target = not self.is_host(other)
        out = func(*args, **kwargs)
        if not self.is_host(source):
            return out
        if target:
            self._flag(f".to(device) of a host tensor {tuple(source.shape)}")
            return out.clone() if out is source else out  # on a GPU, a new device tensor
        self._tag(out)
        return out
