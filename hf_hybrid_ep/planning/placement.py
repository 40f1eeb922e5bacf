"""Expert placement from routing statistics: load-balanced, hierarchical, co-activation-aware.

A placement is a :class:`~hf_hybrid_ep.dispatch.PlacementTable` (rows = EP ranks of one EP group, one
table for every MoE layer, as ``HybridEPConfig(placement=...)`` takes it). EP rank ``r`` of a group
sits on node ``r // g`` of the group (``g = min(ep, gpus_per_node)`` consecutive ranks per node, see
:mod:`hf_hybrid_ep.topology`), and that node in rack ``node // nodes_per_rack``.

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
* **pair traffic** — what the all-to-all dispatcher moves today: every assignment whose destination
  is another rank is one send, classified by the link it crosses (intra-node, inter-node in a rack,
  cross-rack);
* **node-deduplicated traffic** — what a hierarchical dispatcher (DeepEP-style: one copy per
  destination node, forwarded inside the node over NVLink) moves: a token sends one copy to each
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
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..dispatch import PlacementTable
from ..errors import HybridEPConfigError
from ..parallel.topology import Topology


@dataclass
class RoutingStats:
    """Routing statistics of one or several MoE layers (summed).

    Attributes:
        loads: ``[E]`` routed assignments per expert.
        coactivation: ``[E, E]`` symmetric pair counts (zero diagonal), or ``None`` when not recorded.
        top_k: experts per token (``Σ loads / k`` tokens).
    """

    loads: np.ndarray
    coactivation: np.ndarray | None
    top_k: int
    layers: int = 1

    @property
    def num_experts(self) -> int:
        return len(self.loads)

    @classmethod
    def from_records(cls, records: Sequence[Mapping], layers: Sequence[str] | None = None) -> RoutingStats:
        """Sum ``expert_load.jsonl`` records over ``layers`` (all by default) and steps.

        Raises:
            HybridEPConfigError: for malformed records (:func:`hf_hybrid_ep.metrics.check_records`), naming
                the record, layer and key, or a layer the first record lacks.
        """
        from ..metrics import check_records

        if isinstance(records, str | bytes | Mapping) or not isinstance(records, Sequence):
            raise HybridEPConfigError(f"expert-load records must be a list of records, got {type(records).__name__}")
        names = list(layers) if layers is not None else None
        E = check_records(records, layers=names)
        names = names if names is not None else list(records[0]["layers"])
        missing = [n for n in names if n not in records[0]["layers"]]
        if missing or not names:
            raise HybridEPConfigError(f"expert-load records have no layer {missing[0]!r}" if missing
                                      else "no MoE layer selected from the expert-load records")
        loads = np.zeros(E)
        coact = np.zeros((E, E))
        has_coact = True
        pairs = 0.0
        for record in records:
            for name in names:
                layer = record["layers"].get(name)
                if layer is None:
                    continue
                loads += np.asarray(layer["tokens_per_expert"], dtype=float)
                if "coactivation" in layer:
                    coact += np.asarray(layer["coactivation"], dtype=float)
                else:
                    has_coact = False
        if has_coact:
            pairs = coact.sum() / 2
        # Σ_e N_e = T·k and Σ_{a<b} C_ab = T·k(k−1)/2 (no drops): k − 1 = 2·pairs / assignments
        top_k = int(round(2 * pairs / loads.sum())) + 1 if has_coact and loads.sum() > 0 else 1
        return cls(loads, coact if has_coact else None, top_k, len(names))

    @classmethod
    def from_indices(cls, indices: Sequence[np.ndarray], num_experts: int) -> RoutingStats:
        """From recorded top-k indices, one ``[T, k]`` int array per layer (``-1``: dropped)."""
        loads = np.zeros(num_experts)
        coact = np.zeros((num_experts, num_experts))
        k = 1
        for index in indices:
            index = np.asarray(index).reshape(len(index), -1)
            k = index.shape[1]
            kept = index[index >= 0]
            loads += np.bincount(kept, minlength=num_experts)
            for i in range(k):
                for j in range(i + 1, k):
                    a, b = index[:, i], index[:, j]
                    ok = (a >= 0) & (b >= 0) & (a != b)
                    np.add.at(coact, (a[ok], b[ok]), 1)
                    np.add.at(coact, (b[ok], a[ok]), 1)
        return cls(loads, coact, k, len(indices))


def read_placement_file(path: str | os.PathLike[str]) -> list[list[int]] | dict[str, list[list[int]]]:
    """The placement in ``placement.json`` (its ``placement`` key, as ``place`` writes it: per layer, a
    mapping from experts module name to table, or one table) or a file holding a bare JSON table.

    Raises:
        HybridEPConfigError: naming the file (and the bad value) when it is missing, a directory, not
            UTF-8 JSON, or holds no table (a list of lists of integer expert ids; ``true`` is not an id)
            or mapping of layer names to tables.
    """
    name = str(path)
    path = Path(path)
    if path.is_dir():
        raise HybridEPConfigError(f"placement file {name!r} is a directory; give the placement.json inside it")
    if not path.is_file():
        raise HybridEPConfigError(f"placement file {name!r} does not exist")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise HybridEPConfigError(f"placement file {name!r} is not UTF-8 JSON text (undecodable byte at "
                                  f"offset {err.start}); is it a binary file?") from err
    except json.JSONDecodeError as err:
        raise HybridEPConfigError(f"placement file {name!r} is not JSON: {err}") from err
    except OSError as err:
        raise HybridEPConfigError(f"placement file {name!r} cannot be read: {err.strerror}") from err
    placement = data.get("placement") if isinstance(data, dict) else data
    if isinstance(placement, dict) and placement:
        return {layer: _table_rows(rows, f"placement file {name!r}, layer {layer!r}")
                for layer, rows in placement.items()}
    return _table_rows(placement, f"placement file {name!r}")


def _table_rows(rows: object, where: str) -> list[list[int]]:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise HybridEPConfigError(f"{where} holds no table (a non-empty list of lists of expert ids, or an "
                                  "object with such a 'placement' key, or one per layer)")
    for r, row in enumerate(rows):
        for e in row:
            if isinstance(e, bool) or not isinstance(e, int):
                raise HybridEPConfigError(f"{where}: row {r} = {json.dumps(row)} holds {json.dumps(e)}, not an "
                                          "integer expert id")
    return rows


# ---------------------------------------------------------------------------------------------- loads


def rank_loads(loads: Sequence[float], table: PlacementTable) -> list[float]:
    """Expected tokens per EP rank when each expert's tokens are split evenly over its replicas."""
    per_rank = [0.0] * table.ep_degree
    for e, load in enumerate(loads):
        holders = table.holders(e)
        for r in holders:
            per_rank[r] += load / len(holders)
    return per_rank


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 is perfectly balanced)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _replica_counts(loads: Sequence[float], replicas: int, limit: int) -> list[int]:
    """Give each extra copy to the expert with the largest per-copy load (at most ``limit`` copies)."""
    copies = [1] * len(loads)
    for _ in range(replicas):
        open_experts = [e for e in range(len(loads)) if copies[e] < limit]
        hottest = max(open_experts, key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


def _check_slots(num_experts: int, ep_degree: int, replicas: int) -> int:
    slots_total = num_experts + replicas
    if replicas < 0:
        raise HybridEPConfigError(f"replicas={replicas} must be ≥ 0")
    if slots_total % ep_degree:
        raise HybridEPConfigError(
            f"{num_experts} experts + {replicas} replicas = {slots_total} slots do not divide over ep_degree={ep_degree}"
        )
    if replicas > num_experts * (ep_degree - 1):
        raise HybridEPConfigError(f"{replicas} replicas exceed what {ep_degree} ranks can hold distinctly")
    return slots_total // ep_degree


def balanced_placement(loads: Sequence[float], ep_degree: int, replicas: int = 0) -> PlacementTable:
    """Pack experts (plus ``replicas`` extra copies of the hottest ones) onto ``ep_degree`` ranks.

    Every rank gets ``(E + replicas) / ep_degree`` slots; a replica never lands on a rank that already
    holds the same expert.
    """
    return hierarchical_placement(loads, ep_degree, None, replicas)


def _group_sizes(ep_degree: int, topology: Topology | None) -> list[int]:
    """Fan-out per level from the EP group down to ranks: ``[racks, nodes per rack, ranks per node]``
    (levels of fan-out 1 dropped)."""
    if topology is None:
        return [ep_degree]
    g = min(ep_degree, topology.gpus_per_node)
    nodes = max(1, ep_degree // g)
    per_rack = min(nodes, topology.nodes_per_rack) if topology.nodes_per_rack else nodes
    sizes = [nodes // per_rack, per_rack, g]
    return [s for s in sizes if s > 1] or [1]


def _pack_level(items: list[tuple[float, int]], groups: int, slots: int, same_limit: int,
                order: str) -> list[list[tuple[float, int]]] | None:
    """Greedy longest-processing-time packing of (load, expert) copies into ``groups`` bins of ``slots``
    items each, at most ``same_limit`` copies of one expert per bin."""
    copies: dict[int, int] = {}
    for _, e in items:
        copies[e] = copies.get(e, 0) + 1
    if order == "load":
        items = sorted(items, key=lambda x: (-x[0], x[1]))
    else:  # multi-copy experts first: they have the fewest places to go
        items = sorted(items, key=lambda x: (-copies[x[1]], -x[0], x[1]))
    bins: list[list[tuple[float, int]]] = [[] for _ in range(groups)]
    weight = [0.0] * groups
    for load, e in items:
        candidates = [b for b in range(groups) if len(bins[b]) < slots
                      and sum(1 for _, x in bins[b] if x == e) < same_limit]
        if not candidates:
            return None
        b = min(candidates, key=lambda b: (weight[b], b))
        bins[b].append((load, e))
        weight[b] += load
    return bins


def _pack(items: list[tuple[float, int]], sizes: list[int], order: str) -> list[list[int]] | None:
    """Pack copies down the levels ``sizes``; returns one list of experts per rank (level-major)."""
    if len(sizes) == 1 and sizes[0] == 1:
        return [[e for _, e in items]]
    groups, below = sizes[0], int(np.prod(sizes[1:])) if len(sizes) > 1 else 1
    bins = _pack_level(items, groups, len(items) // groups, below, order)
    if bins is None:
        return None
    if len(sizes) == 1:
        return [[e for _, e in b] for b in bins]
    rows: list[list[int]] = []
    for b in bins:
        sub = _pack(b, sizes[1:], order)
        if sub is None:
            return None
        rows.extend(sub)
    return rows


def _polish(rows: list[list[int]], per_copy: Sequence[float], groups: Sequence[int] | None = None,
            max_iters: int = 1000) -> list[list[int]]:
    """Swap copies between the most loaded rank and another (of the same group when ``groups`` is
    given) while the maximum rank load drops; rows keep their sizes and distinct experts."""
    rows = [list(r) for r in rows]
    load = [sum(per_copy[e] for e in r) for r in rows]
    for _ in range(max_iters):
        top = max(range(len(rows)), key=lambda r: load[r])
        best = None
        for r in range(len(rows)):
            if r == top or (groups is not None and groups[r] != groups[top]):
                continue
            for i, a in enumerate(rows[top]):
                for j, b in enumerate(rows[r]):
                    d = per_copy[a] - per_copy[b]
                    if d <= 0 or a in rows[r] or b in rows[top]:
                        continue
                    peak = max(load[top] - d, load[r] + d)
                    if peak < load[top] - 1e-9 * max(1.0, load[top]) and (best is None or peak < best[0]):
                        best = (peak, r, i, j, d)
        if best is None:
            break
        _, r, i, j, d = best
        rows[top][i], rows[r][j] = rows[r][j], rows[top][i]
        load[top] -= d
        load[r] += d
    return rows


def hierarchical_placement(loads: Sequence[float], ep_degree: int, topology: Topology | str | None = None,
                           replicas: int = 0) -> PlacementTable:
    """Load-balanced packing level by level (racks → nodes → ranks) with ``replicas`` extra copies of
    the hottest experts; every rank gets ``(E + replicas) / ep_degree`` slots and distinct experts.
    The packing is then polished by swapping copies between the most loaded rank and another while
    that lowers the maximum rank load.

    ``topology=None`` packs directly onto ranks (one level)."""
    num_experts = len(loads)
    _check_slots(num_experts, ep_degree, replicas)
    topo = None if topology is None else Topology.of(topology)
    sizes = _group_sizes(ep_degree, topo)
    copies = _replica_counts(loads, replicas, ep_degree)
    items = [(loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])]
    best, best_value = None, float("inf")
    per_copy = [loads[e] / copies[e] for e in range(num_experts)]
    for order in ("load", "copies"):
        rows = _pack(items, sizes, order)
        if rows is None:
            continue
        rows = _polish(rows, per_copy)
        table = PlacementTable.from_rows(num_experts, rows)
        value = imbalance(rank_loads(loads, table))
        if value < best_value - 1e-12:
            best, best_value = table, value
    if best is None:
        raise HybridEPConfigError("could not place the replicas on distinct ranks; try fewer replicas")
    return best


# ---------------------------------------------------------------------------------------------- EPLB


def eplb_placement(loads: Sequence[float], ep_degree: int, num_nodes: int = 1, replicas: int = 0,
                   num_groups: int | None = None) -> PlacementTable:
    """The EPLB baseline (hierarchical policy when ``num_groups % num_nodes == 0``, global otherwise).

    1. ``num_groups`` groups of consecutive experts are packed onto ``num_nodes`` nodes, heaviest group
       first onto the lightest node with a free place (equal group count per node);
    2. each node's ``(E + replicas) / num_nodes`` physical slots are filled by adding replicas, one at a
       time, to the node's expert with the largest load per copy;
    3. the node's copies are packed onto its GPUs the same way (equal count per GPU). One deviation:
       two copies of one expert never share a GPU (a placement table row lists an expert once).
    """
    E = len(loads)
    per_rank = _check_slots(E, ep_degree, replicas)
    num_groups = E if num_groups is None else num_groups
    if ep_degree % num_nodes or E % num_groups or num_groups % num_nodes or (E + replicas) % num_nodes:
        num_nodes, num_groups = 1, 1  # EPLB's global policy
    gpus_per_node = ep_degree // num_nodes
    size = E // num_groups
    group_load = [(sum(loads[g * size : (g + 1) * size]), g) for g in range(num_groups)]
    node_groups: list[list[int]] = [[] for _ in range(num_nodes)]
    node_load = [0.0] * num_nodes
    for load, g in sorted(group_load, key=lambda x: (-x[0], x[1])):
        node = min((n for n in range(num_nodes) if len(node_groups[n]) < num_groups // num_nodes),
                   key=lambda n: (node_load[n], n))
        node_groups[node].append(g)
        node_load[node] += load
    rows: list[list[int]] = []
    for n in range(num_nodes):
        experts = sorted(e for g in node_groups[n] for e in range(g * size, (g + 1) * size))
        slots = (E + replicas) // num_nodes
        local = [loads[e] for e in experts]
        counts = _replica_counts(local, slots - len(experts), gpus_per_node)
        items = sorted(((local[i] / counts[i], experts[i]) for i in range(len(experts)) for _ in range(counts[i])),
                       key=lambda x: (-x[0], x[1]))
        bins = _pack_level(items, gpus_per_node, per_rank, 1, "load")
        if bins is None:
            raise HybridEPConfigError("EPLB: could not place the replicas on distinct GPUs")
        rows.extend([[e for _, e in b] for b in bins])
    return PlacementTable.from_rows(E, rows)


# ---------------------------------------------------------------------------------------------- traffic


def _levels(ep_degree: int, topology: Topology | str | None) -> tuple[np.ndarray, np.ndarray]:
    """Node and rack of every EP rank of one EP group (ranks ``0 … ep−1``)."""
    topo = Topology.of(topology)
    ranks = np.arange(ep_degree)
    return (np.array([topo.node_of(int(r)) for r in ranks]), np.array([topo.rack_of(int(r)) for r in ranks]))


def _destination_probs(table: PlacementTable) -> np.ndarray:
    """``P[s, e, r]``: probability that an assignment of expert e from EP rank s goes to rank r."""
    ep, E = table.ep_degree, table.num_experts
    P = np.zeros((ep, E, ep))
    for e in range(E):
        holders = table.holders(e)
        for s in range(ep):
            if s in holders:
                P[s, e, s] = 1.0
            else:
                P[s, e, holders] = 1.0 / len(holders)
    return P


def _group_probs(P: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Sum ``P[s, e, r]`` over the ranks r of each node (or rack): ``[ep, E, groups]``."""
    out = np.zeros((*P.shape[:2], int(of.max()) + 1))
    for r, g in enumerate(of):
        out[:, :, g] += P[:, :, r]
    return out


def expected_traffic(stats: RoutingStats, table: PlacementTable, topology: Topology | str | None) -> dict[str, float]:
    """Expected token sends per direction under the traffic model of this module.

    Returns ``assignments`` (Σ N_e), pair traffic by link level (``local``, ``intra_node``,
    ``inter_node``, ``cross_rack``), and, when co-activation counts are present, the node-deduplicated
    ``cross_node`` and ``cross_rack_dedup`` sends (``None`` otherwise).
    """
    if table.num_experts != stats.num_experts:
        raise HybridEPConfigError(f"placement has {table.num_experts} experts, the statistics {stats.num_experts}")
    ep = table.ep_degree
    node, rack = _levels(ep, topology)
    P = _destination_probs(table)
    N = stats.loads
    per_dest = np.einsum("e,ser->sr", N, P) / ep  # [src, dest] expected sends
    level = np.where(np.arange(ep)[:, None] == np.arange(ep)[None, :], 0,
                     np.where(node[:, None] == node[None, :], 1, np.where(rack[:, None] == rack[None, :], 2, 3)))
    out = {"assignments": float(N.sum())}
    for i, name in enumerate(("local", "intra_node", "inter_node", "cross_rack")):
        out[name] = float(per_dest[level == i].sum())
    out["cross_node"] = out["cross_rack_dedup"] = None
    if stats.coactivation is not None:
        C = stats.coactivation
        for key, of in (("cross_node", node), ("cross_rack_dedup", rack)):
            q = _group_probs(P, of)  # [src, E, groups]
            total = 0.0
            for s in range(ep):
                remote = np.arange(q.shape[2]) != of[s]
                qs = q[s][:, remote]  # [E, remote groups]
                total += float(N @ qs.sum(1) - 0.5 * np.einsum("ag,ab,bg->", qs, C, qs))
            out[key] = total / ep
    return out


def trace_traffic(indices: Sequence[np.ndarray], table: PlacementTable, topology: Topology | str | None,
                  sources: Sequence[int] | None = None) -> dict[str, float]:
    """Exact expected node- and rack-deduplicated sends of recorded top-k indices (one ``[T, k]`` array
    per layer, ``-1`` for dropped), for any k: a token from source s touches node n with probability
    ``1 − Π_j (1 − q[s, e_j, n])`` (replica choices independent).

    ``sources``: the EP rank that sent each array (one per array); by default every token is equally
    likely to come from each EP rank. With the sources and a table without replicas the result is the
    exact count the hierarchical dispatcher sends (its cross-node rows in one direction)."""
    ep = table.ep_degree
    node, rack = _levels(ep, topology)
    P = _destination_probs(table)
    if sources is not None and len(sources) != len(indices):
        raise HybridEPConfigError(f"trace_traffic: {len(sources)} sources for {len(indices)} index arrays")
    out = {"cross_node": 0.0, "cross_rack_dedup": 0.0, "tokens": 0}
    for key, of in (("cross_node", node), ("cross_rack_dedup", rack)):
        q = _group_probs(P, of)
        q = np.concatenate([q, np.zeros((ep, 1, q.shape[2]))], axis=1)  # row E: a dropped choice
        for i, index in enumerate(indices):
            index = np.asarray(index).reshape(len(index), -1)
            index = np.where(index >= 0, index, table.num_experts)
            senders = range(ep) if sources is None else [int(sources[i])]
            for s in senders:
                touched = 1.0 - np.prod(1.0 - q[s][index], axis=1)  # [T, groups]
                remote = np.arange(q.shape[2]) != of[s]
                out[key] += float(touched[:, remote].sum()) / len(senders)
    out["tokens"] = int(sum(len(i) for i in indices))
    return out


# ---------------------------------------------------------------------------------------------- co-activation


def coactivation_placement(stats: RoutingStats, ep_degree: int, topology: Topology | str | None,
                           replicas: int = 0, tolerance: float = 0.05, max_swaps: int | None = None) -> PlacementTable:
    """Co-activation-aware placement: from two starts — the hierarchical packing and a greedy
    co-activation clustering (repaired to the balance bound) — swap expert copies between nodes while
    that keeps more co-activation weight inside nodes and racks and every rank's load within
    ``max(hierarchical maximum, (1 + tolerance)·mean)``; return the candidate (hierarchical start
    included) with the lowest exact expected ``D_node/network_gbps + D_rack/rack_gbps``.

    During the search copies of a replicated expert are scored as if a token picked each copy with
    probability ``1/R_e``; the final choice uses :func:`expected_traffic` (the dispatcher's rule).
    """
    if stats.coactivation is None:
        raise HybridEPConfigError("co-activation-aware placement needs co-activation counts "
                                  "(train with coactivation_stats=True)")
    topo = Topology.of(topology)
    start = hierarchical_placement(stats.loads, ep_degree, topo, replicas)
    node_of_rank, rack_of_rank = _levels(ep_degree, topo)
    M, Q = int(node_of_rank.max()) + 1, int(rack_of_rank.max()) + 1
    if M == 1:
        return start  # one node: every placement moves the same bytes across nodes (none)
    g = ep_degree // M
    nodes_per_rack = M // Q
    loads, C = stats.loads, stats.coactivation
    copies_of = [len(start.holders(e)) for e in range(stats.num_experts)]
    # one item per copy: its expert and node
    expert = np.array([e for row in start.rows for e in row])
    node = np.array([node_of_rank[r] for r, row in enumerate(start.rows) for _ in row])
    R = np.array(copies_of, dtype=float)
    W = C[np.ix_(expert, expert)] / np.outer(R[expert], R[expert])  # copy graph
    np.fill_diagonal(W, 0.0)
    W[expert[:, None] == expert[None, :]] = 0.0
    alpha = (1 - 1 / M) / topo.network_gbps
    beta = (1 - 1 / Q) / topo.rack_gbps if Q > 1 else 0.0
    item_load = loads[expert] / R[expert]
    per_copy = [float(loads[e] / copies_of[e]) for e in range(stats.num_experts)]
    mean_rank = loads.sum() / ep_degree
    bound = max(max(rank_loads(loads, start)), (1 + tolerance) * mean_rank) * (1 + 1e-12)
    slots = len(start.rows[0])

    packed_cache: dict[tuple[int, ...], tuple[float, list[list[int]]] | None] = {}

    def pack_node(members: np.ndarray) -> tuple[float, list[list[int]]] | None:
        """The node's copies packed onto its g ranks: (peak rank load, rows), or None if infeasible
        (memoized: the search asks for the same member sets again and again)."""
        key = tuple(int(i) for i in members)
        if key not in packed_cache:
            packed_cache[key] = _pack_node(members)
        return packed_cache[key]

    def _pack_node(members: np.ndarray) -> tuple[float, list[list[int]]] | None:
        items = [(float(item_load[i]), int(expert[i])) for i in members]
        best = None
        for order in ("load", "copies"):
            bins = _pack_level(items, g, slots, 1, order)
            if bins is not None:
                rows = _polish([[e for _, e in b] for b in bins], per_copy)
                peak = max(sum(per_copy[e] for e in r) for r in rows)
                if best is None or peak < best[0]:
                    best = (peak, rows)
        return best

    def repack(members: np.ndarray) -> list[list[int]] | None:
        packed = pack_node(members)
        return None if packed is None or packed[0] > bound else packed[1]

    def refine(node: np.ndarray) -> dict[int, list[list[int]]] | None:
        if not repair(node):
            return None
        rows_by_node = {n: repack(np.flatnonzero(node == n)) for n in range(M)}
        limit = max_swaps if max_swaps is not None else 4 * len(expert)
        threshold = 1e-9 * alpha * max(1.0, float(W.max()))
        for _ in range(limit):
            gain = alpha * _swap_gain(W, node, M) + beta * _swap_gain(W, node // nodes_per_rack, Q)
            valid = (node[:, None] != node[None, :]) & (expert[:, None] != expert[None, :])
            gain = np.where(valid, gain, -np.inf)
            moved = False
            for flat in np.argsort(-gain, axis=None)[:64]:
                i, j = divmod(int(flat), len(expert))
                if not gain[i, j] > threshold:
                    break
                a, b = node[i], node[j]
                node[i], node[j] = b, a
                new_a = repack(np.flatnonzero(node == a))
                new_b = repack(np.flatnonzero(node == b)) if new_a is not None else None
                if new_a is None or new_b is None:
                    node[i], node[j] = a, b
                    continue
                rows_by_node[a], rows_by_node[b] = new_a, new_b
                moved = True
                break
            if not moved:
                break
        return rows_by_node

    def repair(node: np.ndarray) -> bool:
        """Swap copies out of nodes whose ranks exceed the bound (best co-activation gain first)."""
        for _ in range(4 * len(expert)):
            over = [n for n in range(M) if repack(np.flatnonzero(node == n)) is None]
            if not over:
                return True
            gain = alpha * _swap_gain(W, node, M) + beta * _swap_gain(W, node // nodes_per_rack, Q)
            bad = np.isin(node, over)
            lighter = item_load[:, None] - item_load[None, :]  # i leaves an over-full node, j enters it
            node_load = np.bincount(node, weights=item_load, minlength=M)
            valid = (bad[:, None] & (node[:, None] != node[None, :]) & (expert[:, None] != expert[None, :])
                     & (lighter > 0) & (node_load[node][None, :] + lighter <= g * bound))
            gain = np.where(valid, gain, -np.inf)
            fixed = False
            for flat in np.argsort(-gain, axis=None)[:64]:
                i, j = divmod(int(flat), len(expert))
                if gain[i, j] == -np.inf:
                    break
                a, b = node[i], node[j]
                before = pack_node(np.flatnonzero(node == a))
                node[i], node[j] = b, a
                pa, pb = pack_node(np.flatnonzero(node == a)), pack_node(np.flatnonzero(node == b))
                if pa is not None and pb is not None and pb[0] <= bound and (
                        before is None or pa[0] < before[0]):
                    fixed = True
                    break
                node[i], node[j] = a, b
            if not fixed:
                return False
        return False

    starts = [node, _greedy_clusters(W, item_load, expert, M, g * slots, g, g * bound)]
    results = [r for r in (refine(n.copy()) for n in starts if n is not None) if r is not None]
    candidates = [start] + [PlacementTable.from_rows(stats.num_experts, [row for n in range(M) for row in rows_by_node[n]])
                            for rows_by_node in results]

    def cost(table: PlacementTable) -> float:  # the exact model (replicas' local hits included)
        t = expected_traffic(stats, table, topo)
        return t["cross_node"] / topo.network_gbps + t["cross_rack_dedup"] / topo.rack_gbps

    return min(candidates, key=cost)


def _greedy_clusters(W: np.ndarray, load: np.ndarray, expert: np.ndarray, groups: int, size: int, same_limit: int,
                     cap: float) -> np.ndarray | None:
    """A co-activation-first start: fill each group in turn, seeded with the heaviest free copy, with
    the free copy most co-activated with the group's members (ties: heavier first), keeping the
    group's load ≤ ``cap`` and at most ``same_limit`` copies of one expert."""
    group = np.full(len(expert), -1)
    for n in range(groups):
        members: list[int] = []
        total = 0.0
        while len(members) < size:
            free = [i for i in np.flatnonzero(group < 0)
                    if total + load[i] <= cap and sum(expert[m] == expert[i] for m in members) < same_limit]
            if not free:
                free = [i for i in np.flatnonzero(group < 0)
                        if sum(expert[m] == expert[i] for m in members) < same_limit]
                if not free:
                    return None
            if members:
                affinity = W[np.ix_(free, members)].sum(axis=1)
                pick = free[max(range(len(free)), key=lambda x: (affinity[x], load[free[x]], -free[x]))]
            else:
                pick = free[max(range(len(free)), key=lambda x: (load[free[x]], -free[x]))]
            group[pick] = n
            members.append(pick)
            total += load[pick]
    return group


def _swap_gain(W: np.ndarray, group: np.ndarray, groups: int) -> np.ndarray:
    """``G[i, j]``: increase of the co-activation weight inside groups when copies i and j (in
    different groups) swap groups: ``W_i→g(j) + W_j→g(i) − W_i→g(i) − W_j→g(j) − 2·W_ij`` (0 when
    they are in the same group)."""
    towards = W @ np.eye(groups)[group]  # [S, groups]: weight of each copy towards each group
    X = towards[:, group]  # X[i, j] = weight of i towards j's group
    d = np.diag(X)
    gain = X + X.T - d[:, None] - d[None, :] - 2 * W
    return np.where(group[:, None] != group[None, :], gain, 0.0)


# ---------------------------------------------------------------------------------------------- report


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


def _sum_traffic(parts: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    return {k: None if any(p[k] is None for p in parts) else float(sum(p[k] for p in parts)) for k in parts[0]}


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
    result["per_layer"] = {"imbalance": imbalance(rank_sum), "traffic": _sum_traffic(traffic),
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
    node, rack = _levels(new.ep_degree, topology)
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
