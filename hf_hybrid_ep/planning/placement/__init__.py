"""Expert placement from routing statistics: load-balanced, hierarchical, co-activation-aware.

A placement is a :class:`~hf_hybrid_ep.dispatch.PlacementTable` (rows = EP ranks of one EP group, one
table for every MoE layer, as ``HybridEPConfig(placement=...)`` takes it). EP rank ``r`` of a group
sits on node ``r // g`` of the group (``g = min(ep, gpus_per_node)`` consecutive ranks per node, see
:mod:`hf_hybrid_ep.parallel.topology`), and that node in rack ``node // nodes_per_rack``.

Statistics (:class:`RoutingStats`): per expert ``N_e`` (routed assignments, ``tokens_per_expert`` of
``expert_load.jsonl``) and per expert pair ``C_ab`` (tokens that chose both a and b, the
``coactivation`` matrix written with ``coactivation_stats=True``), summed over layers and records.

Traffic model (:func:`expected_traffic`), in token sends per direction (dispatch; combine mirrors
it; multiply by ``hidden × bytes per element`` for bytes):

* tokens originate on the EP ranks of the group with equal probability, and each rank's tokens
  choose experts with the same statistics;
* a (token, expert e) assignment from source rank s stays on s when s holds a replica of e, else it
  goes to one of e's ``R_e`` replicas with probability ``1/R_e`` (the dispatcher's rule; the choices of
  a token's k experts are modelled as independent);
* **pair traffic** — what the per-pair dispatchers (``"torch"``, ``"triton"``) move: every assignment whose destination
  is another rank is one send, classified by the link it crosses (intra-node, inter-node in a rack,
  cross-rack);
* **node-deduplicated traffic** — what the deduplicated dispatcher (``"dedup"``, DeepEP-style: one copy per
  destination node, forwarded inside the node over NVLink) sends across nodes: a token sends one copy to each
  *node* other than its own that holds at least one of its experts (``cross_node``), and one copy to
  each other *rack* holding one (``cross_rack``). From pair statistics, the number of distinct
  nodes of a token is computed as ``Σ_e x_e − Σ_{a<b} x_a x_b [same node]`` (x: chosen experts),
  which is exact for top-1 and top-2 routing and a lower bound (Bonferroni) for k > 2;
  :func:`trace_traffic` computes it exactly from recorded top-k indices for any k.

Without replicas the expected node-deduplicated traffic is ``(1 − 1/M)·(Σ_e N_e − Σ_{a<b same node}
C_ab)`` for M nodes (``(1 − 1/Q)·(…same rack…)`` for Q racks): minimizing it is balanced graph
partitioning of the co-activation graph. Placement algorithms:

* :func:`balanced_placement` — (2a, one level) replicate the hottest experts (each replica takes an
  equal share of the expert's tokens), pack the copies onto ranks greedily, heaviest first, onto the
  least-loaded rank with a free slot; every rank gets the same number of slots;
* :func:`hierarchical_placement` — (2a) the same packing level by level: copies → racks → nodes →
  ranks, balancing each level's load;
* :func:`coactivation_placement` — (2b) start from the hierarchical packing and swap expert copies
  between nodes while that lowers the bandwidth-weighted traffic ``D_node/network_gbps +
  D_rack/rack_gbps`` and the re-packed per-rank load stays within ``max(start, (1 + tolerance)·mean)``
  (Kernighan–Lin style, best swap first);
* :func:`eplb_placement` — the EPLB baseline (deepseek-ai/EPLB's published policy, re-implemented
  from its description): expert groups packed onto nodes, replicas added inside each node to the
  expert with the largest per-copy load, copies packed onto the node's GPUs.

Modules: :mod:`.stats` (statistics), :mod:`.packing` (2a), :mod:`.coactivation` (2b), :mod:`.eplb`,
:mod:`.traffic` (the model above). A new policy: docs/architecture.md, "Where to add …".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...dispatch.table import PlacementTable
from ...errors import HybridEPConfigError
from ...parallel.topology import Topology
from .coactivation import coactivation_placement
from .eplb import eplb_placement
from .packing import balanced_placement, hierarchical_placement, imbalance, rank_loads
from .stats import RoutingStats, read_placement_file
from .traffic import expected_traffic, rank_levels, sum_traffic, trace_traffic


def fit_placement(stats: RoutingStats, ep_degree: int, topology: Topology | str | None = None, replicas: int = 0,
                  tolerance: float = 0.05) -> tuple[PlacementTable, str]:
    """The placement ``place`` fits to ``stats`` and its method: co-activation-aware when the statistics
    carry co-activation counts, else the hierarchical load-balanced packing."""
    if stats.coactivation is not None:
        return coactivation_placement(stats, ep_degree, topology, replicas, tolerance), "coactivation"
    return hierarchical_placement(stats.loads, ep_degree, topology, replicas), "hierarchical"


def place_report(stats: RoutingStats | Sequence[float], ep_degree: int, replicas: int = 0,
                 topology: Topology | str | None = None, tolerance: float = 0.05) -> dict:
    """Predicted per-rank imbalance and traffic of the contiguous placement and of the new one
    (:func:`fit_placement`)."""
    if not isinstance(stats, RoutingStats):
        stats = RoutingStats(np.asarray(stats, dtype=float), None, 1)
    topo = Topology.of(topology)
    before = PlacementTable.contiguous(stats.num_experts, ep_degree)
    after, method = fit_placement(stats, ep_degree, topo, replicas, tolerance)
    result = {"ep_degree": ep_degree, "replicas": replicas, "topology": topo.describe(), "method": method}
    for name, table in (("contiguous", before), ("placed", after)):
        result[name] = {"imbalance": imbalance(rank_loads(stats.loads, table)),
                        "traffic": expected_traffic(stats, table, topo)}
    result["imbalance_contiguous"] = result["contiguous"]["imbalance"]
    result["imbalance_balanced"] = result["placed"]["imbalance"]
    result["placement"] = [list(row) for row in after.rows]
    return result


def place_layers(records: Sequence[Mapping], ep_degree: int, replicas: int = 0, topology: Topology | str | None = None,
                 tolerance: float = 0.05, per_layer: bool = True) -> dict:
    """Fit placements to ``expert_load.jsonl`` records: one table per MoE layer (``per_layer``) or one
    table for all, and report both against contiguous.

    Returns the :func:`place_report` of the layers' summed statistics (keys ``contiguous`` and
    ``one_table``: rank imbalance of the summed loads and traffic), ``per_layer`` (the same for the
    per-layer tables: loads and traffic summed over layers), ``layers`` (per layer: rank imbalance
    under contiguous, the one table and its own table) and ``placement``: ``{layer: rows}`` when
    ``per_layer``, else the one table's rows.
    """
    topo = Topology.of(topology)
    names = list(records[0]["layers"]) if records else []
    summed = RoutingStats.from_records(records)
    result = place_report(summed, ep_degree, replicas, topo, tolerance)
    result["one_table"] = result.pop("placed")
    one = PlacementTable.from_rows(summed.num_experts, result["placement"])
    contiguous = PlacementTable.contiguous(summed.num_experts, ep_degree)
    layers, tables, traffic = {}, {}, []
    rank_sum = np.zeros(ep_degree)
    for name in names:
        stats = RoutingStats.from_records(records, [name])
        own, _ = fit_placement(stats, ep_degree, topo, replicas, tolerance)
        tables[name] = own
        loads = rank_loads(stats.loads, own)
        rank_sum += loads
        traffic.append(expected_traffic(stats, own, topo))
        layers[name] = {"imbalance_contiguous": imbalance(rank_loads(stats.loads, contiguous)),
                        "imbalance_one_table": imbalance(rank_loads(stats.loads, one)),
                        "imbalance_per_layer": imbalance(loads)}
    result["per_layer"] = {"imbalance": imbalance(rank_sum), "traffic": sum_traffic(traffic),
                           "worst_layer_imbalance": max(v["imbalance_per_layer"] for v in layers.values())}
    result["layers"] = layers
    result["placement"] = {n: [list(r) for r in t.rows] for n, t in tables.items()} if per_layer else [
        list(r) for r in one.rows]
    del result["imbalance_contiguous"], result["imbalance_balanced"]
    return result


def align_rows(new: PlacementTable, old: PlacementTable, topology: Topology | str | None = None) -> PlacementTable:
    """``new`` with its rows permuted so that as many experts as possible stay where ``old`` has them.

    Permutes only what the placement's cost cannot see: ranks inside a node, and whole nodes inside a
    rack (every rank of a node has the same links). Greedy: the (new row, old rank) pair sharing the
    most experts first. Used by online rebalancing to move fewer bytes for the same table.
    """
    if new.ep_degree != old.ep_degree:
        raise HybridEPConfigError(f"tables over {new.ep_degree} and {old.ep_degree} EP ranks cannot be aligned")
    node, rack = rank_levels(new.ep_degree, topology)
    rows = [list(r) for r in new.rows]

    def overlap(a: Sequence[int], b: Sequence[int]) -> int:
        return len(set(a) & set(b))

    def greedy(items: list[int], slots: list[int], score) -> dict[int, int]:
        pairs = sorted((-score(i, s), i, s) for i in items for s in slots)
        taken_i, taken_s, out = set(), set(), {}
        for _, i, s in pairs:
            if i not in taken_i and s not in taken_s:
                out[i] = s
                taken_i.add(i)
                taken_s.add(s)
        return out

    nodes = sorted(set(node.tolist()))
    members = {n: [r for r in range(new.ep_degree) if node[r] == n] for n in nodes}
    placed: dict[int, list[int]] = {}
    for q in sorted(set(rack.tolist())):  # nodes within a rack: by the experts their ranks share
        in_rack = [n for n in nodes if rack[members[n][0]] == q]
        if len({len(members[n]) for n in in_rack}) > 1:  # unequal nodes: leave them where they are
            mapping = {n: n for n in in_rack}
        else:
            mapping = greedy(in_rack, in_rack, lambda a, b: overlap(
                [e for r in members[a] for e in rows[r]], [e for r in members[b] for e in old.rows[r]]))
        for a, b in mapping.items():  # node a's rows go to node b's ranks, then ranks within node b
            ranks = greedy(members[a], members[b], lambda r, s: overlap(rows[r], old.rows[s]))
            for r, s in ranks.items():
                placed[s] = rows[r]
    return PlacementTable.from_rows(new.num_experts, [placed[r] for r in range(new.ep_degree)])


__all__ = [
    "RoutingStats",
    "align_rows",
    "balanced_placement",
    "coactivation_placement",
    "eplb_placement",
    "expected_traffic",
    "fit_placement",
    "hierarchical_placement",
    "imbalance",
    "place_layers",
    "place_report",
    "rank_loads",
    "read_placement_file",
    "trace_traffic",
]
