"""Load-balanced packing of expert copies onto ranks: one level (:func:`balanced_placement`) or level by
level over racks, nodes and ranks (:func:`hierarchical_placement`), and the load measures they use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...dispatch.table import PlacementTable
from ...errors import HybridEPConfigError
from ...parallel.topology import Topology


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


def replica_counts(loads: Sequence[float], replicas: int, limit: int) -> list[int]:
    """Give each extra copy to the expert with the largest per-copy load (at most ``limit`` copies)."""
    copies = [1] * len(loads)
    for _ in range(replicas):
        open_experts = [e for e in range(len(loads)) if copies[e] < limit]
        hottest = max(open_experts, key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


def check_slots(num_experts: int, ep_degree: int, replicas: int) -> int:
    """The slots per EP rank of ``num_experts`` experts plus ``replicas`` extra copies over ``ep_degree`` ranks.

    Raises:
        HybridEPConfigError: naming the values, for negative ``replicas``, slots that do not divide over the
            ranks, or more replicas than the ranks can hold distinctly.
    """
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


def pack_level(items: list[tuple[float, int]], groups: int, slots: int, same_limit: int,
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
    bins = pack_level(items, groups, len(items) // groups, below, order)
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


def polish(rows: list[list[int]], per_copy: Sequence[float], groups: Sequence[int] | None = None,
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
    check_slots(num_experts, ep_degree, replicas)
    topo = None if topology is None else Topology.of(topology)
    sizes = _group_sizes(ep_degree, topo)
    copies = replica_counts(loads, replicas, ep_degree)
    items = [(loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])]
    best, best_value = None, float("inf")
    per_copy = [loads[e] / copies[e] for e in range(num_experts)]
    for order in ("load", "copies"):
        rows = _pack(items, sizes, order)
        if rows is None:
            continue
        rows = polish(rows, per_copy)
        table = PlacementTable.from_rows(num_experts, rows)
        value = imbalance(rank_loads(loads, table))
        if value < best_value - 1e-12:
            best, best_value = table, value
    if best is None:
        raise HybridEPConfigError("could not place the replicas on distinct ranks; try fewer replicas")
    return best
