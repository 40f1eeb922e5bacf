"""Which ranks hold which expert slots: the plain data the gradient reducer works from.

Every rank walks every layer and expert of the placement tables (global knowledge), so that the holder sets,
and the process groups made for them, come out in the same order everywhere; each rank keeps the homes of
its own slots.
"""

from __future__ import annotations

from ..parallel.grads import ExpertHolding
from ..parallel.mesh import HybridMesh
from .layer import ShardedExperts


def expert_holdings(layers: list[ShardedExperts], mesh: HybridMesh) -> tuple[list[tuple[int, ...]], list[ExpertHolding]]:
    """``(holder sets, holdings)``: every exact set of world ranks holding some expert (its EDP replicas and
    placement replicas), sorted; and this rank's expert parameters, each with the holder set of every local
    slot (slots in global expert order within a set)."""
    holders_of: dict[tuple[int, int], tuple[int, ...]] = {}
    for li, layer in enumerate(layers):
        for e in range(layer.num_experts):
            ranks = sorted(mesh.global_rank(d, r) for d in range(mesh.dp_degree) for r in layer.table.holders(e))
            holders_of[(li, e)] = tuple(ranks)
    holdings = []
    for li, layer in enumerate(layers):
        local = layer.local_experts
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for s in sorted(range(len(local)), key=lambda s: local[s]):
            by_ranks.setdefault(holders_of[(li, local[s])], []).append(s)
        for p in layer.slot_parameters():
            holdings.append(ExpertHolding(p, list(by_ranks.items()), list(local)))
    return sorted(set(holders_of.values())), holdings
