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
from .triton_backend import TritonDispatcher, register_experts_implementation, triton_unavailable_reason

BACKENDS = {"torch": TorchDispatcher, "triton": TritonDispatcher}


def resolve_backend(name: str, device_type: str = "cpu") -> str:
    """Map ``"auto"`` to a concrete backend (Triton on CUDA when importable, else torch); raise, with
    the reason, for a requested backend that cannot run here."""
    if name == "auto":
        return "triton" if device_type == "cuda" and triton_unavailable_reason(device_type) is None else "torch"
    if name not in BACKENDS:
        raise HybridEPConfigError(f"dispatcher backend {name!r} is not available; available: {sorted(BACKENDS)}")
    if name == "triton":
        reason = triton_unavailable_reason(device_type)
        if reason is not None:
            raise HybridEPConfigError(f"dispatcher='triton' cannot run: {reason}")
    return name


def make_dispatcher(
    name: str, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats,
    device_type: str = "cpu", alignment: int = 1, control_width: int | None = None,
) -> TorchDispatcher:
    backend = resolve_backend(name, device_type)
    if backend == "triton":
        return TritonDispatcher(table, ep_rank, ep_group, stats, control_width, alignment=alignment)
    return TorchDispatcher(table, ep_rank, ep_group, stats, control_width)


__all__ = [
    "BACKENDS",
    "CommStats",
    "DispatchHandle",
    "PhaseCounters",
    "PlacementTable",
    "TorchDispatcher",
    "TritonDispatcher",
    "make_dispatcher",
    "register_experts_implementation",
    "resolve_backend",
]
