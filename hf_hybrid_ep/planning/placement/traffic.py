"""Expected and traced token traffic of a placement per link class: one row per (token, expert) pair, or one
per token and destination node / rank (the deduplicated dispatcher's rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...dispatch.table import PlacementTable
from ...errors import HybridEPConfigError
from ...parallel.topology import Topology
from .stats import RoutingStats


def rank_levels(ep_degree: int, topology: Topology | str | None) -> tuple[np.ndarray, np.ndarray]:
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
    node, rack = rank_levels(ep, topology)
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
    """Exact expected deduplicated sends of recorded top-k indices (one ``[T, k]`` array per layer, ``-1`` for
    dropped), for any k: a token from source s touches node n with probability ``1 − Π_j (1 − q[s, e_j, n])``
    (replica choices independent), and a rank likewise.

    Returns ``cross_node`` (rows to other nodes), ``cross_rack_dedup`` (to other racks), ``rank_rows`` (rows
    inside the destination nodes to a rank whose local index differs from the source's: the deduplicated
    dispatcher's relays forward one row per (token, rank), the one with the source's local index keeps
    its own) and ``pairs_remote`` (one row per pair to another rank: the per-pair exchange), in one
    direction, and ``tokens``.

    ``sources``: the EP rank that sent each array (one per array); by default every token is equally
    likely to come from each EP rank. With the sources and a table without replicas the result is the
    exact count the deduplicated dispatcher sends."""
    ep = table.ep_degree
    node, rack = rank_levels(ep, topology)
    P = _destination_probs(table)
    if sources is not None and len(sources) != len(indices):
        raise HybridEPConfigError(f"trace_traffic: {len(sources)} sources for {len(indices)} index arrays")
    out = {"cross_node": 0.0, "cross_rack_dedup": 0.0, "rank_rows": 0.0, "pairs_remote": 0.0, "tokens": 0}
    first_of_node = {int(n): int(np.flatnonzero(node == n)[0]) for n in np.unique(node)}
    local = np.arange(ep) - np.array([first_of_node[int(n)] for n in node])
    ranks = np.arange(ep)
    # (key, group of each rank, which groups count as remote from source s)
    levels = (("cross_node", node, lambda s: np.unique(node) != node[s]),
              ("cross_rack_dedup", rack, lambda s: np.unique(rack) != rack[s]),
              ("rank_rows", ranks, lambda s: local != local[s]))
    for key, of, remote_from in levels:
        q = _group_probs(P, of)
        q = np.concatenate([q, np.zeros((ep, 1, q.shape[2]))], axis=1)  # row E: a dropped choice
        for i, index in enumerate(indices):
            index = np.asarray(index).reshape(len(index), -1)
            index = np.where(index >= 0, index, table.num_experts)
            senders = range(ep) if sources is None else [int(sources[i])]
            for s in senders:
                touched = 1.0 - np.prod(1.0 - q[s][index], axis=1)  # [T, groups]
                out[key] += float(touched[:, remote_from(s)].sum()) / len(senders)
                if key == "cross_node":  # one row per pair to another rank
                    pairs = np.concatenate([P[s], np.zeros((1, ep))])[index].sum(1)  # [T, ep]
                    out["pairs_remote"] += float(pairs[:, np.arange(ep) != s].sum()) / len(senders)
    out["tokens"] = int(sum(len(i) for i in indices))
    return out


def sum_traffic(parts: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """The per-level sums of several traffic reports (a level is ``None`` when one part does not know it)."""
    return {k: None if any(p[k] is None for p in parts) else float(sum(p[k] for p in parts)) for k in parts[0]}
