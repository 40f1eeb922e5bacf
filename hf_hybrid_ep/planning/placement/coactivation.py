"""Co-activation-aware placement: a Kernighan–Lin style search over node assignments of expert copies.
"""

from __future__ import annotations

import numpy as np

from ...dispatch.table import PlacementTable
from ...errors import HybridEPConfigError
from ...parallel.topology import Topology
from .packing import hierarchical_placement, pack_level, polish, rank_loads
from .stats import RoutingStats
from .traffic import expected_traffic, rank_levels


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
    node_of_rank, rack_of_rank = rank_levels(ep_degree, topo)
    if int(node_of_rank.max()) + 1 == 1:
        return start  # one node: every placement moves the same bytes across nodes (none)
    search = CoactivationSearch(stats, start, topo, node_of_rank, rack_of_rank, tolerance, max_swaps)
    return search.run()


class CoactivationSearch:
    """The search of :func:`coactivation_placement` over the node of every expert copy.

    Items are the copies of the start table (``expert[i]``, ``node[i]``); ``W`` is the copy graph
    (co-activation counts split over the copies of both experts); a node assignment is feasible when
    the node's copies pack onto its ``g`` ranks with every rank's load within ``bound``.
    """

    def __init__(self, stats: RoutingStats, start: PlacementTable, topo: Topology, node_of_rank: np.ndarray,
                 rack_of_rank: np.ndarray, tolerance: float, max_swaps: int | None) -> None:
        self.stats, self.start, self.topo, self.max_swaps = stats, start, topo, max_swaps
        ep_degree = start.ep_degree
        self.M, self.Q = int(node_of_rank.max()) + 1, int(rack_of_rank.max()) + 1
        self.g = ep_degree // self.M
        self.nodes_per_rack = self.M // self.Q
        loads, C = stats.loads, stats.coactivation
        copies_of = [len(start.holders(e)) for e in range(stats.num_experts)]
        self.expert = np.array([e for row in start.rows for e in row])
        self.node = np.array([node_of_rank[r] for r, row in enumerate(start.rows) for _ in row])
        R = np.array(copies_of, dtype=float)
        W = C[np.ix_(self.expert, self.expert)] / np.outer(R[self.expert], R[self.expert])
        np.fill_diagonal(W, 0.0)
        W[self.expert[:, None] == self.expert[None, :]] = 0.0
        self.W = W
        self.alpha = (1 - 1 / self.M) / topo.network_gbps
        self.beta = (1 - 1 / self.Q) / topo.rack_gbps if self.Q > 1 else 0.0
        self.item_load = loads[self.expert] / R[self.expert]
        self.per_copy = [float(loads[e] / copies_of[e]) for e in range(stats.num_experts)]
        mean_rank = loads.sum() / ep_degree
        self.bound = max(max(rank_loads(loads, start)), (1 + tolerance) * mean_rank) * (1 + 1e-12)
        self.slots = len(start.rows[0])
        self._packed: dict[tuple[int, ...], tuple[float, list[list[int]]] | None] = {}

    def run(self) -> PlacementTable:
        """The best of the start and the refined starts, by the exact expected traffic."""
        M, g = self.M, self.g
        starts = [self.node, _greedy_clusters(self.W, self.item_load, self.expert, M, g * self.slots, g, g * self.bound)]
        results = [r for r in (self.refine(n.copy()) for n in starts if n is not None) if r is not None]
        candidates = [self.start] + [
            PlacementTable.from_rows(self.stats.num_experts, [row for n in range(M) for row in rows_by_node[n]])
            for rows_by_node in results]
        return min(candidates, key=self.cost)

    def cost(self, table: PlacementTable) -> float:
        """Expected seconds per token send over the slow links (replicas' local hits included)."""
        t = expected_traffic(self.stats, table, self.topo)
        return t["cross_node"] / self.topo.network_gbps + t["cross_rack_dedup"] / self.topo.rack_gbps

    def pack_node(self, members: np.ndarray) -> tuple[float, list[list[int]]] | None:
        """The node's copies packed onto its g ranks: (peak rank load, rows), or None if infeasible
        (memoized: the search asks for the same member sets again and again)."""
        key = tuple(int(i) for i in members)
        if key not in self._packed:
            self._packed[key] = self._pack_node(members)
        return self._packed[key]

    def _pack_node(self, members: np.ndarray) -> tuple[float, list[list[int]]] | None:
        items = [(float(self.item_load[i]), int(self.expert[i])) for i in members]
        best = None
        for order in ("load", "copies"):
            bins = pack_level(items, self.g, self.slots, 1, order)
            if bins is not None:
                rows = polish([[e for _, e in b] for b in bins], self.per_copy)
                peak = max(sum(self.per_copy[e] for e in r) for r in rows)
                if best is None or peak < best[0]:
                    best = (peak, rows)
        return best

    def repack(self, members: np.ndarray) -> list[list[int]] | None:
        packed = self.pack_node(members)
        return None if packed is None or packed[0] > self.bound else packed[1]

    def _gain(self, node: np.ndarray) -> np.ndarray:
        """``[n, n]`` traffic saved by swapping the nodes of copies i and j."""
        return (self.alpha * _swap_gain(self.W, node, self.M)
                + self.beta * _swap_gain(self.W, node // self.nodes_per_rack, self.Q))

    def refine(self, node: np.ndarray) -> dict[int, list[list[int]]] | None:
        """Best-gain swaps between nodes while one keeps both nodes feasible; the rows per node."""
        if not self.repair(node):
            return None
        expert = self.expert
        rows_by_node = {n: self.repack(np.flatnonzero(node == n)) for n in range(self.M)}
        limit = self.max_swaps if self.max_swaps is not None else 4 * len(expert)
        threshold = 1e-9 * self.alpha * max(1.0, float(self.W.max()))
        for _ in range(limit):
            valid = (node[:, None] != node[None, :]) & (expert[:, None] != expert[None, :])
            gain = np.where(valid, self._gain(node), -np.inf)
            moved = False
            for flat in np.argsort(-gain, axis=None)[:64]:
                i, j = divmod(int(flat), len(expert))
                if not gain[i, j] > threshold:
                    break
                a, b = node[i], node[j]
                node[i], node[j] = b, a
                new_a = self.repack(np.flatnonzero(node == a))
                new_b = self.repack(np.flatnonzero(node == b)) if new_a is not None else None
                if new_a is None or new_b is None:
                    node[i], node[j] = a, b
                    continue
                rows_by_node[a], rows_by_node[b] = new_a, new_b
                moved = True
                break
            if not moved:
                break
        return rows_by_node

    def repair(self, node: np.ndarray) -> bool:
        """Swap copies out of nodes whose ranks exceed the bound (best co-activation gain first)."""
        expert, item_load, M = self.expert, self.item_load, self.M
        for _ in range(4 * len(expert)):
            over = [n for n in range(M) if self.repack(np.flatnonzero(node == n)) is None]
            if not over:
                return True
            bad = np.isin(node, over)
            lighter = item_load[:, None] - item_load[None, :]  # i leaves an over-full node, j enters it
            node_load = np.bincount(node, weights=item_load, minlength=M)
            valid = (bad[:, None] & (node[:, None] != node[None, :]) & (expert[:, None] != expert[None, :])
                     & (lighter > 0) & (node_load[node][None, :] + lighter <= self.g * self.bound))
            gain = np.where(valid, self._gain(node), -np.inf)
            if not self._first_fixing_swap(node, gain):
                return False
        return False

    def _first_fixing_swap(self, node: np.ndarray, gain: np.ndarray) -> bool:
        """Apply the best-gain swap that leaves the entered node feasible and lowers the peak of the
        node left; False (nothing changed) when none of the 64 best does."""
        for flat in np.argsort(-gain, axis=None)[:64]:
            i, j = divmod(int(flat), len(self.expert))
            if gain[i, j] == -np.inf:
                break
            a, b = node[i], node[j]
            before = self.pack_node(np.flatnonzero(node == a))
            node[i], node[j] = b, a
            pa, pb = self.pack_node(np.flatnonzero(node == a)), self.pack_node(np.flatnonzero(node == b))
            if pa is not None and pb is not None and pb[0] <= self.bound and (before is None or pa[0] < before[0]):
                return True
            node[i], node[j] = a, b
        return False


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
