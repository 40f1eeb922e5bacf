"""The EPLB baseline (deepseek-ai/EPLB's published policy, re-implemented from its description).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...dispatch.table import PlacementTable
from ...errors import HybridEPConfigError
from .packing import check_slots, pack_level, replica_counts


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
    per_rank = check_slots(E, ep_degree, replicas)
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
        counts = replica_counts(local, slots - len(experts), gpus_per_node)
        items = sorted(((local[i] / counts[i], experts[i]) for i in range(len(experts)) for _ in range(counts[i])),
                       key=lambda x: (-x[0], x[1]))
        bins = pack_level(items, gpus_per_node, per_rank, 1, "load")
        if bins is None:
            raise HybridEPConfigError("EPLB: could not place the replicas on distinct GPUs")
        rows.extend([[e for _, e in b] for b in bins])
    return PlacementTable.from_rows(E, rows)
