"""Import paths of the flat layout before the regroup (0.1), kept working with a ``DeprecationWarning``.

``import hf_hybrid_ep.placement`` returns the very module ``hf_hybrid_ep.planning.placement`` (so
``monkeypatch.setattr`` through the old path patches the code that runs); a module that was split
(``hf_hybrid_ep.experts``) is a read-only view of the names of its successors. See
docs/architecture.md for the layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

MOVED: dict[str, tuple[str, ...]] = {
    "hf_hybrid_ep.agreement": ("hf_hybrid_ep.parallel.agreement",),
    "hf_hybrid_ep.amp": ("hf_hybrid_ep.parallel.amp",),
    "hf_hybrid_ep.buckets": ("hf_hybrid_ep.parallel.buckets",),
    "hf_hybrid_ep.cache": ("hf_hybrid_ep.inference.offload",),
    "hf_hybrid_ep.consistency": ("hf_hybrid_ep.parallel.consistency",),
    "hf_hybrid_ep.experts": ("hf_hybrid_ep.moe.discovery", "hf_hybrid_ep.moe.layer"),
    "hf_hybrid_ep.freeze": ("hf_hybrid_ep.moe.freeze",),
    "hf_hybrid_ep.grads": ("hf_hybrid_ep.parallel.grads",),
    "hf_hybrid_ep.mesh": ("hf_hybrid_ep.parallel.mesh",),
    "hf_hybrid_ep.nn": ("hf_hybrid_ep.moe.standalone",),
    "hf_hybrid_ep.placement": ("hf_hybrid_ep.planning.placement",),
    "hf_hybrid_ep.planner": ("hf_hybrid_ep.planning.planner",),
    "hf_hybrid_ep.rebalance": ("hf_hybrid_ep.moe.rebalance",),
    "hf_hybrid_ep.routing": ("hf_hybrid_ep.moe.routing",),
    "hf_hybrid_ep.shadow": ("hf_hybrid_ep.moe.shadow",),
    "hf_hybrid_ep.step_time": ("hf_hybrid_ep.planning.step_time",),
    "hf_hybrid_ep.topology": ("hf_hybrid_ep.parallel.topology",),
    "hf_hybrid_ep.zero": ("hf_hybrid_ep.parallel.zero",),
}


class _SplitModule(types.ModuleType):
    """The union of the names of several modules (the first that has a name wins)."""

    def __init__(self, name: str, successors: tuple[types.ModuleType, ...]) -> None:
        super().__init__(name, f"Moved to {', '.join(m.__name__ for m in successors)}.")
        self._successors = successors

    def __getattr__(self, attr: str):
        for module in self._successors:
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for m in self._successors for n in dir(m)})


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {' and '.join(targets)}; the old path will be removed in 0.3",
                      DeprecationWarning, stacklevel=2)
        modules = tuple(importlib.import_module(t) for t in targets)
        return modules[0] if len(modules) == 1 else _SplitModule(spec.name, modules)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader())


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def moved_attribute(name: str) -> types.ModuleType:
    """``hf_hybrid_ep.<name>`` as an attribute for a 0.1 submodule (``hep.cache.SafetensorsStore``)."""
    full = f"hf_hybrid_ep.{name}"
    if full not in MOVED:
        raise AttributeError(f"module 'hf_hybrid_ep' has no attribute {name!r}")
    return importlib.import_module(full)
