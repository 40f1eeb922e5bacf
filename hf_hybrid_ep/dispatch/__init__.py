"""Token dispatchers: one contract (:mod:`hf_hybrid_ep.dispatch.protocol`), several backends, chosen once.

A backend is selected by name (``"torch"``, ``"triton"``, ``"hierarchical"``) or by ``"auto"`` (the best
one for the device and the EP group's place in the topology). A requested backend that is missing is an
error, never a silent fallback. Adding a backend: docs/architecture.md, "Where to add …".
"""

from __future__ import annotations

from ..errors import HybridEPConfigError
from ..parallel.topology import ranks_per_node
from .hierarchical import HierarchicalDispatcher, NodeGroups, node_groups
from .protocol import CombineInFlight, Dispatcher, DispatchPlan, LocalPairs, Received, SideChannel
from .stats import CommStats, PhaseCounters
from .table import PlacementTable
from .torch_backend import TorchDispatcher, TorchPlan
from .triton_backend import TritonDispatcher, triton_unavailable_reason

BACKENDS = {"torch": TorchDispatcher, "triton": TritonDispatcher, "hierarchical": HierarchicalDispatcher}


def ep_nodes(mesh) -> int:
    """Nodes one EP group spans (1 when it fits in a node).

    Raises:
        HybridEPConfigError: when the EP group spans nodes without filling whole nodes.
    """
    per_node = ranks_per_node(mesh.topology, mesh.world_size)
    if mesh.ep_degree <= per_node:
        return 1
    if mesh.ep_degree % per_node:
        raise HybridEPConfigError(f"ep_degree={mesh.ep_degree} spans nodes of {per_node} ranks but is not a multiple "
                                  f"of {per_node}: an EP group must span whole nodes")
    return mesh.ep_degree // per_node


def resolve_backend(name: str, device_type: str = "cpu", nodes: int = 1) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen; raise, with the reason, for a requested
    backend that cannot run here.

    ``"auto"``: ``hierarchical`` when an EP group spans ``nodes > 1`` nodes (each token crosses to a node
    once), else Triton on CUDA when importable, else torch. ``"hierarchical"`` inside one node is the
    torch path (there is nothing to deduplicate).
    """
    if name not in (*BACKENDS, "auto"):
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
    return resolve_backend(name, mesh.device_type, ep_nodes(mesh) if name in ("auto", "hierarchical") else 1)


def make_dispatcher(name: str, table: PlacementTable, mesh, stats: CommStats, *, count_slots: int | None = None,
                    control_ints: int = 0) -> Dispatcher:
    """The dispatcher ``name`` resolves to for one layer of ``mesh`` (its EP rank and group); ``count_slots`` /
    ``control_ints`` as :class:`TorchDispatcher` takes them."""
    backend, _ = choose_backend(name, mesh)
    sizes = {"count_slots": count_slots, "control_ints": control_ints}
    if backend == "hierarchical":
        groups = node_groups(mesh, ranks_per_node(mesh.topology, mesh.world_size))
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
    "ep_nodes",
    "make_dispatcher",
    "resolve_backend",
    "triton_unavailable_reason",
]
