"""Token dispatchers: one interface, several backends, chosen once.

A backend is selected by name (``"torch"``) or by ``"auto"`` (the best one available). A requested
backend that is missing is an error, never a silent fallback.
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import HybridEPConfigError
from .stats import CommStats, PhaseCounters
from .table import PlacementTable
from .torch_backend import DispatchHandle, TorchDispatcher

BACKENDS = {"torch": TorchDispatcher}


def resolve_backend(name: str) -> str:
    """Map ``"auto"`` to a concrete backend; raise for an unknown one."""
    if name == "auto":
        return "torch"
    if name not in BACKENDS:
        raise HybridEPConfigError(f"dispatcher backend {name!r} is not available; available: {sorted(BACKENDS)}")
    return name


def make_dispatcher(
    name: str, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats
) -> TorchDispatcher:
    return BACKENDS[resolve_backend(name)](table, ep_rank, ep_group, stats)


__all__ = [
    "BACKENDS",
    "CommStats",
    "DispatchHandle",
    "PhaseCounters",
    "PlacementTable",
    "TorchDispatcher",
    "make_dispatcher",
    "resolve_backend",
]
