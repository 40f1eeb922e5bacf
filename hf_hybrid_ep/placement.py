"""Load-aware expert placement with hot-expert replicas (EPLB-style), producing placement tables.

Given per-expert loads (from ``expert_load.jsonl``), ``balanced_placement`` replicates the hottest
experts (each replica takes an equal share of its expert's tokens), then packs the replicas onto
EP ranks greedily — heaviest first, onto the least-loaded rank with a free slot — so that every rank
holds the same number of slots. The result is a :class:`~hf_hybrid_ep.dispatch.PlacementTable`
(rows = EP ranks), which ``HybridEPConfig(placement=table_rows)`` and the dispatcher honour.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import HybridEPConfigError
from .dispatch import PlacementTable


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


def balanced_placement(loads: Sequence[float], ep_degree: int, replicas: int = 0) -> PlacementTable:
    """Pack experts (plus ``replicas`` extra copies of the hottest ones) onto ``ep_degree`` ranks.

    Every rank gets ``(E + replicas) / ep_degree`` slots; a replica never lands on a rank that already
    holds the same expert.
    """
    num_experts = len(loads)
    slots_total = num_experts + replicas
    if slots_total % ep_degree:
        raise HybridEPConfigError(
            f"{num_experts} experts + {replicas} replicas = {slots_total} slots do not divide over ep_degree={ep_degree}"
        )
    if replicas > num_experts * (ep_degree - 1):
        raise HybridEPConfigError(f"{replicas} replicas exceed what {ep_degree} ranks can hold distinctly")
    copies = [1] * num_experts
    for _ in range(replicas):  # each extra copy goes to the expert with the largest per-copy load
        open_experts = [e for e in range(num_experts) if copies[e] < ep_degree]
        hottest = max(open_experts, key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    copies_list = [(loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])]
    orders = [
        sorted(copies_list, key=lambda x: (-x[0], x[1])),  # longest-processing-time first
        sorted(copies_list, key=lambda x: (-copies[x[1]], -x[0], x[1])),  # multi-copy experts first
    ]
    best, best_imbalance = None, float("inf")
    for items in orders:
        rows = _pack(items, ep_degree, slots_total // ep_degree)
        if rows is None:
            continue
        table = PlacementTable.from_rows(num_experts, rows)
        value = imbalance(rank_loads(loads, table))
        if value < best_imbalance:
            best, best_imbalance = table, value
    if best is None:
        raise HybridEPConfigError("could not place the replicas on distinct ranks; try fewer replicas")
    return best


def _pack(items: list[tuple[float, int]], ep_degree: int, per_rank_slots: int) -> list[list[int]] | None:
    """Greedy: each copy onto the least-loaded rank with a free slot that does not hold its expert."""
    rows: list[list[int]] = [[] for _ in range(ep_degree)]
    weight = [0.0] * ep_degree
    for load, e in items:
        candidates = [r for r in range(ep_degree) if len(rows[r]) < per_rank_slots and e not in rows[r]]
        if not candidates:
            return None
        r = min(candidates, key=lambda r: (weight[r], r))
        rows[r].append(e)
        weight[r] += load
    return rows


def place_report(loads: Sequence[float], ep_degree: int, replicas: int = 0) -> dict:
    """Predicted per-rank imbalance of the contiguous placement and of the balanced one."""
    before = PlacementTable.contiguous(len(loads), ep_degree)
    after = balanced_placement(loads, ep_degree, replicas)
    return {
        "ep_degree": ep_degree,
        "replicas": replicas,
        "imbalance_contiguous": imbalance(rank_loads(loads, before)),
        "imbalance_balanced": imbalance(rank_loads(loads, after)),
        "placement": [list(row) for row in after.rows],
    }
