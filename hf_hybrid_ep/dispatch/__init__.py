"""Token dispatchers: one contract (:mod:`hf_hybrid_ep.dispatch.protocol`), several backends, chosen once.

A backend is selected by name (``"torch"``, ``"triton"``, ``"hierarchical"``) or by ``"auto"`` (the best
one for the device and the EP group's place in the topology). A requested backend that is missing is an
error, never a silent fallback. Adding a backend: docs/architecture.md, "Where to add …".
"""

from __future__ import annotations

from ..config import DISPATCHER_BACKENDS
from ..errors import HybridEPConfigError
from .hierarchical import HierarchicalDispatcher, NodeGroups, node_groups
from .protocol import CombineInFlight, Dispatcher, DispatchPlan, LocalPairs, Received, SideChannel
from .stats import CommStats, PhaseCounters
from .table import PlacementTable
from .torch_backend import TorchDispatcher, TorchPlan
from .triton_backend import TritonDispatcher, triton_unavailable_reason

# Every backend by its name (the choices of HybridEPConfig.dispatcher are config.DISPATCHER_BACKENDS: these and "auto").
BACKENDS = {cls.name: cls for cls in (TorchDispatcher, TritonDispatcher, HierarchicalDispatcher)}


def resolve_backend(name: str, device_type: str = "cpu", nodes: int = 1) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen; raise, with the reason, for a requested
    backend that cannot run here.

    ``"auto"``: ``hierarchical`` when an EP group spans ``nodes > 1`` nodes (each token crosses to a node
    once), else Triton on CUDA when importable, else torch. ``"hierarchical"`` inside one node is the
    torch path (there is nothing to deduplicate).
    """
    if name not in DISPATCHER_BACKENDS:
        raise HybridEPConfigError(f"dispatcher backend {name!r} is not available; available: {sorted(BACKENDS)}")
    if name in ("auto", "hierarchical") and nodes > 1:
        why = "requested" if name == "hierarchical" else "auto"
        return "hierarchical", (f"{why}: the EP group spans {nodes} nodes, so each token is sent once per "
                                "destination node and forwarded inside it")
    if name == "hierarchical":
        return "torch", "hierarchical requested, but the EP group lies inside one node: the plain all-to-all"
    if name == "auto":
        if device_type == "cuda" and triton_unavailable_reason(device_type) is None:
            return "triton", "auto: CUDA with Triton importable"
        return "torch", "auto: the EP group lies inside one node" + ("" if device_type == "cuda" else ", no CUDA")
    if name == "triton":
        reason = triton_unavailable_reason(device_type)
        if reason is not None:
            raise HybridEPConfigError(f"dispatcher='triton' cannot run: {reason}")
    return name, "requested"


def choose_backend(name: str, mesh) -> tuple[str, str]:
    """:func:`resolve_backend` for a mesh (the nodes its EP groups span count only for ``auto`` and
    ``hierarchical``)."""
    return resolve_backend(name, mesh.device_type, mesh.ep_nodes if name in ("auto", "hierarchical") else 1)


def make_dispatcher(name: str, table: PlacementTable, mesh, stats: CommStats, *, count_slots: int | None = None,
                    control_ints: int = 0) -> Dispatcher:
    """The dispatcher ``name`` resolves to for one layer of ``mesh`` (its EP rank and group); ``count_slots`` /
    ``control_ints`` as :class:`TorchDispatcher` takes them."""
    backend, _ = choose_backend(name, mesh)
    sizes = {"count_slots": count_slots, "control_ints": control_ints}
    if backend == "hierarchical":
        groups = node_groups(mesh)
        return HierarchicalDispatcher(table, mesh.ep_rank, mesh.ep_group, stats, groups, **sizes)
    return BACKENDS[backend](table, mesh.ep_rank, mesh.ep_group, stats, **sizes)


__all__ = [
    "BACKENDS",
    "CombineInFlight",
    "CommStats",
    "Dispatcher",
    "DispatchPlan",
    "HierarchicalDispatcher",
    "LocalPairs",
    "NodeGroups",
    "PhaseCounters",
    "PlacementTable",
    "Received",
    "SideChannel",
    "TorchDispatcher",
    "TorchPlan",
    "TritonDispatcher",
    "choose_backend",
    "make_dispatcher",
    "resolve_backend",
    "triton_unavailable_reason",
]
