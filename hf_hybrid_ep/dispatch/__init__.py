"""Token dispatchers: one contract (:mod:`hf_hybrid_ep.dispatch.protocol`), several backends, chosen once.

A backend is selected by name (``"torch"`` and ``"triton"``: one row per (token, expert) pair; ``"dedup"``: one
row per token and destination) or by ``"auto"`` (the one that sends fewer bytes here, see
:func:`resolve_backend`). A requested backend that is missing is an error, never a silent fallback. Adding a
backend: docs/architecture.md, "Where to add …".
"""

from __future__ import annotations

from ..config import DISPATCHER_BACKENDS, auto_deduplicates
from ..errors import HybridEPConfigError
from .dedup import DedupDispatcher, DedupGroups, dedup_groups
from .protocol import CombineInFlight, Dispatcher, DispatchPlan, LocalPairs, Received, SideChannel
from .stats import CommStats, PhaseCounters
from .table import PlacementTable
from .torch_backend import TorchDispatcher, TorchPlan
from .triton_backend import TritonDispatcher, triton_unavailable_reason

# Every backend by its name (the choices of HybridEPConfig.dispatcher are config.DISPATCHER_BACKENDS: these and "auto").
BACKENDS = {cls.name: cls for cls in (TorchDispatcher, TritonDispatcher, DedupDispatcher)}


def resolve_backend(name: str, device_type: str = "cpu", *, ep_degree: int = 1, nodes: int = 1, top_k: int = 1,
                    slots_per_rank: int = 1) -> tuple[str, str]:
    """The concrete backend for ``name`` and why it was chosen; raise, with the reason, for a requested
    backend that cannot run here.

    ``"auto"`` picks ``dedup`` when an EP group spans ``nodes > 1`` nodes, and on CUDA also where a token can
    have several of its ``top_k`` experts on one rank (``top_k ≥ 2`` and ``slots_per_rank ≥ 2``): there it sends
    fewer bytes than one row per pair. Inside one node on the CPU it keeps the per-pair exchange: over gloo on
    loopback the bytes saved cost less than the packing and fan-out (measured at 0.55–0.80× the per-pair
    exchange's samples/s, docs/benchmarks.md). Otherwise the per-pair exchange, with the Triton kernels on CUDA
    when importable (they serve the per-pair layout only).
    """
    if name not in DISPATCHER_BACKENDS:
        raise HybridEPConfigError(f"dispatcher backend {name!r} is not available; available: "
                                  f"{list(DISPATCHER_BACKENDS)}")
    if name == "auto":
        return _auto(device_type, ep_degree, nodes, top_k, slots_per_rank)
    if name == "triton":
        reason = triton_unavailable_reason(device_type)
        if reason is not None:
            raise HybridEPConfigError(f"dispatcher='triton' cannot run: {reason}")
    return name, "requested"


def _auto(device_type: str, ep_degree: int, nodes: int, top_k: int, slots_per_rank: int) -> tuple[str, str]:
    triton = device_type == "cuda" and triton_unavailable_reason(device_type) is None
    per_pair = ("triton", "CUDA with Triton importable") if triton else ("torch", "no CUDA" if device_type != "cuda"
                                                                         else "Triton not importable")
    if auto_deduplicates(device_type, ep_degree, nodes, top_k, slots_per_rank):
        why = (f"the EP group spans {nodes} nodes, so each token crosses to a node once and to a rank once"
               if nodes > 1 else
               f"top-k {top_k} with {slots_per_rank} experts per rank, so a token's pairs on one rank travel as one row")
        return "dedup", f"auto: {why}" + (" (the Triton kernels serve the per-pair exchange only)" if triton else "")
    if ep_degree == 1:
        reason = "one rank per EP group: nothing crosses ranks"
    elif top_k >= 2 and slots_per_rank >= 2:
        reason = ("one node on the CPU: the deduplicated exchange's packing and fan-out cost more than the bytes "
                  "it saves over loopback (dispatcher='dedup' to compare)")
    else:
        reason = f"top-k {top_k} with {slots_per_rank} expert(s) per rank: no token has two pairs on one rank"
    return per_pair[0], f"auto: {reason}; the per-pair exchange ({per_pair[1]})"


def choose_backend(name: str, mesh, top_k: int = 1, slots_per_rank: int = 1) -> tuple[str, str]:
    """:func:`resolve_backend` for a mesh (its EP degree and the nodes its EP groups span count only for
    ``auto``) and a model (its routers' ``top_k``, the placement's slots per rank)."""
    nodes = mesh.ep_nodes if name == "auto" else 1
    return resolve_backend(name, mesh.device_type, ep_degree=mesh.ep_degree, nodes=nodes, top_k=top_k,
                           slots_per_rank=slots_per_rank)


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
