"""Token dispatchers: one contract (:mod:`hf_hybrid_ep.dispatch.protocol`), several backends, chosen once.

A backend is selected by name (``"torch"`` and ``"triton"``: one row per (token, expert) pair; ``"dedup"``: one
row per token and destination) or by ``"auto"`` (the one predicted faster here, links and memory together:
:func:`resolve_backend`, :mod:`hf_hybrid_ep.dispatch.cost`). A requested backend that is missing is an error, never a silent fallback. Adding a
backend: docs/architecture.md, "Where to add …".
"""

from __future__ import annotations

from ..config import DISPATCHER_BACKENDS
from ..errors import HybridEPConfigError
from ..parallel.topology import Topology
from .cost import MEMORY_GBPS, ExchangeShape, cheaper_exchange
from .dedup import DedupDispatcher, DedupGroups, dedup_groups
from .protocol import CombineInFlight, Dispatcher, DispatchPlan, LocalPairs, Received, SideChannel
from .stats import CommStats, PhaseCounters
from .table import PlacementTable
from .torch_backend import TorchDispatcher, TorchPlan
from .triton_backend import TritonDispatcher, triton_unavailable_reason

# Every backend by its name (the choices of HybridEPConfig.dispatcher are config.DISPATCHER_BACKENDS: these and "auto").
BACKENDS = {cls.name: cls for cls in (TorchDispatcher, TritonDispatcher, DedupDispatcher)}


def resolve_backend(name: str, device_type: str = "cpu", shape: ExchangeShape | None = None,
                    topology: Topology | None = None) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen; raise, with the reason, for a requested
    backend that cannot run here.

    ``"auto"`` prices both exchanges for ``shape`` (one MoE layer on one rank; ``None`` or an EP group of one
    rank: nothing crosses ranks, the per-pair exchange) with :func:`hf_hybrid_ep.dispatch.cost.cheaper_exchange`:
    the bytes on the links at ``topology``'s bandwidths (default :class:`Topology`'s) and the bytes the gathers
    move at :data:`hf_hybrid_ep.dispatch.cost.MEMORY_GBPS` of ``device_type``, and picks the faster — the per-pair
    exchange with the Triton kernels on CUDA when importable (they serve the per-pair layout only), else without,
    or the deduplicated one. The reason names both predicted times.
    """
    if name not in DISPATCHER_BACKENDS:
        raise HybridEPConfigError(f"dispatcher backend {name!r} is not available; available: "
                                  f"{list(DISPATCHER_BACKENDS)}")
    if name == "auto":
        return _auto(device_type, shape, topology or Topology())
    if name == "triton":
        reason = triton_unavailable_reason(device_type)
        if reason is not None:
            raise HybridEPConfigError(f"dispatcher='triton' cannot run: {reason}")
    return name, "requested"


def _auto(device_type: str, shape: ExchangeShape | None, topology: Topology) -> tuple[str, str]:
    triton = device_type == "cuda" and triton_unavailable_reason(device_type) is None
    per_pair = "triton" if triton else "torch"
    kernels = ("with the Triton kernels" if triton else "no CUDA" if device_type != "cuda" else
               "Triton not importable")
    if shape is None or shape.ep == 1:
        return per_pair, f"auto: one rank per EP group: nothing crosses ranks; the per-pair exchange ({kernels})"
    memory = MEMORY_GBPS.get(device_type, MEMORY_GBPS["cuda"])
    backend, times = cheaper_exchange(shape, per_pair, topology, memory)

    def said(name: str) -> str:
        t = times[name]
        return f"{name} {t['total_s'] * 1e6:.3g} µs (links {t['link_s'] * 1e6:.3g}, memory {t['memory_s'] * 1e6:.3g})"

    chosen = "the deduplicated exchange" if backend == "dedup" else f"the per-pair exchange ({kernels})"
    return backend, (f"auto: predicted per token and MoE layer over a training step {said(per_pair)} vs "
                     f"{said('dedup')}, links {topology.nvlink_gbps:g} / {topology.network_gbps:g} / "
                     f"{topology.rack_gbps:g} GB/s (intra-node / inter-node / cross-rack), memory {memory:g} GB/s "
                     f"({device_type}); {chosen}")


def choose_backend(name: str, mesh, top_k: int = 1, slots_per_rank: int = 1, hidden: int = 4096,
                   act_bytes: int = 2) -> tuple[str, str]:
    """:func:`resolve_backend` for a mesh (its EP degree, the nodes and racks its EP groups span and its
    topology's links count only for ``auto``) and a model (its routers' ``top_k``, the placement's slots per rank,
    its hidden size and activation bytes)."""
    if name != "auto":
        return resolve_backend(name, mesh.device_type)
    ep = mesh.ep_degree
    topology = mesh.topology or Topology()
    shape = ExchangeShape(slots_per_rank * ep, top_k, ep, ep // mesh.ep_nodes, min(ep, topology.gpus_per_rack or ep),
                          hidden, act_bytes)
    return resolve_backend(name, mesh.device_type, shape, topology)


def make_dispatcher(name: str, table: PlacementTable, mesh, stats: CommStats, *, count_slots: int | None = None,
                    control_ints: int = 0) -> Dispatcher:
    """The dispatcher of backend ``name`` (a concrete one, as :func:`choose_backend` returns) for one layer of
    ``mesh`` (its EP rank and group); ``count_slots`` / ``control_ints`` as :class:`TorchDispatcher` takes them."""
    sizes = {"count_slots": count_slots, "control_ints": control_ints}
    if name == "dedup":
        return DedupDispatcher(table, mesh.ep_rank, mesh.ep_group, stats, dedup_groups(mesh), **sizes)
    if name not in BACKENDS:
        raise HybridEPConfigError(f"make_dispatcher takes a concrete backend ({sorted(BACKENDS)}), not {name!r}")
    return BACKENDS[name](table, mesh.ep_rank, mesh.ep_group, stats, **sizes)


__all__ = [
    "BACKENDS",
    "CombineInFlight",
    "CommStats",
    "Dispatcher",
    "DispatchPlan",
    "DedupDispatcher",
    "DedupGroups",
    "ExchangeShape",
    "LocalPairs",
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
