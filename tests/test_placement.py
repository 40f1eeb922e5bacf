"""Load-aware placement: valid tables, exact predicted loads, and the place command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_hybrid_ep import HybridEPConfigError
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.dispatch import PlacementTable
from hf_hybrid_ep.parallel.topology import Topology, ep_group_span
from hf_hybrid_ep.planning.placement import (
    RoutingStats,
    balanced_placement,
    coactivation_placement,
    eplb_placement,
    expected_traffic,
    hierarchical_placement,
    imbalance,
    rank_loads,
    trace_traffic,
)


def test_rank_loads_split_replicated_experts_evenly():
    table = PlacementTable.from_rows(4, [[0, 1, 2], [3, 0, 2]])
    assert rank_loads([100, 10, 20, 30], table) == [50 + 10 + 10, 30 + 50 + 10]
    assert imbalance([70.0, 90.0]) == 90 / 80


@pytest.mark.parametrize(("ep", "replicas"), [(2, 0), (2, 2), (4, 0), (4, 4), (4, 12)])
def test_placements_are_valid(ep, replicas):
    loads = [500, 80, 70, 60, 50, 40, 30, 20]
    table = balanced_placement(loads, ep, replicas)
    slots = [len(row) for row in table.rows]
    assert slots == [(8 + replicas) // ep] * ep  # capacity respected, equal on every rank
    assert sum(slots) == 8 + replicas  # replicas counted
    assert all(table.holders(e) for e in range(8))  # every expert placed
    assert all(len(set(row)) == len(row) for row in table.rows)  # no expert twice on a rank
    assert len(table.holders(0)) == max(len(table.holders(e)) for e in range(8))  # the hot one first


def test_replicas_lower_the_predicted_imbalance_of_a_hot_expert():
    loads = [500, 80, 70, 60, 50, 40, 30, 20]
    contiguous = imbalance(rank_loads(loads, PlacementTable.contiguous(8, 4)))
    plain = imbalance(rank_loads(loads, balanced_placement(loads, 4)))
    replicated = imbalance(rank_loads(loads, balanced_placement(loads, 4, replicas=4)))
    assert replicated < plain <= contiguous


def test_bad_requests():
    with pytest.raises(HybridEPConfigError, match="do not divide over ep_degree=4"):
        balanced_placement([1.0] * 8, 4, replicas=1)


def _assert_valid(table: PlacementTable, num_experts: int, ep: int, replicas: int) -> None:
    slots = [len(row) for row in table.rows]
    assert slots == [(num_experts + replicas) // ep] * ep  # capacity respected, equal on every rank
    assert sum(slots) == num_experts + replicas  # replicas counted
    assert all(table.holders(e) for e in range(num_experts))  # every expert placed
    assert all(len(set(row)) == len(row) for row in table.rows)  # no expert twice on a rank


def _planted(num_experts=16, groups=4, tokens=4000, k=2, seed=0):
    """Tokens that pick their k experts inside one of ``groups`` planted groups {g, g+G, g+2G, ...}."""
    rng = np.random.default_rng(seed)
    members = [list(range(g, num_experts, groups)) for g in range(groups)]
    index = np.array([rng.choice(members[rng.integers(groups)], k, replace=False) for _ in range(tokens)])
    return [index], RoutingStats.from_indices([index], num_experts)


@pytest.mark.parametrize("replicas", [0, 8])
@pytest.mark.parametrize("method", ["hierarchical", "coactivation", "eplb"])
def test_every_algorithm_gives_valid_placements(method, replicas):
    _, stats = _planted()
    topo = Topology.parse("racks=2,nodes_per_rack=2,gpus_per_node=2")
    if method == "hierarchical":
        table = hierarchical_placement(stats.loads, 8, topo, replicas)
    elif method == "coactivation":
        table = coactivation_placement(stats, 8, topo, replicas)
    else:
        table = eplb_placement(stats.loads, 8, num_nodes=4, replicas=replicas)
    _assert_valid(table, 16, 8, replicas)
    if replicas:
        hottest = int(np.argmax(stats.loads))
        assert len(table.holders(hottest)) >= 2


# Hand-checked traffic: 4 experts, top-2, 4 EP ranks, 2 GPUs per node (2 nodes), one expert per rank.
# Tokens: t1 = {0, 1}, t2 = {0, 2}, t3 = {2, 3}; each token starts on each rank with probability 1/4.
HAND = [np.array([[0, 1], [0, 2], [2, 3]])]


def test_traffic_is_exact_on_a_hand_checked_case():
    stats = RoutingStats.from_indices(HAND, 4)
    assert stats.loads.tolist() == [2, 1, 2, 1] and stats.top_k == 2
    assert stats.coactivation[0, 1] == stats.coactivation[0, 2] == stats.coactivation[2, 3] == 1
    topo = "gpus_per_node=2"
    contiguous = PlacementTable.contiguous(4, 4)  # node 0 = {0, 1}, node 1 = {2, 3}
    t = expected_traffic(stats, contiguous, topo)
    # pair traffic: each of the 6 assignments stays local w.p. 1/4, goes to the node's other rank
    # w.p. 1/4 and to the other node w.p. 1/2
    assert (t["assignments"], t["local"], t["intra_node"], t["inter_node"], t["cross_rack"]) == (6, 1.5, 1.5, 3, 0)
    # node-deduplicated: t1 touches node 0 only → 1 send from the half of the sources on node 1: 0.5;
    # t2 touches both nodes → 1 send from every source: 1; t3 touches node 1 only: 0.5. Total 2.
    assert t["cross_node"] == 2.0 and trace_traffic(HAND, contiguous, topo)["cross_node"] == 2.0
    # co-locating 0 with 2 instead (node 0 = {0, 2}): t1 → 1, t2 → 0.5, t3 → 1. Total 2.5.
    mixed = PlacementTable.from_rows(4, [[0], [2], [1], [3]])
    assert expected_traffic(stats, mixed, topo)["cross_node"] == 2.5
    assert trace_traffic(HAND, mixed, topo)["cross_node"] == 2.5
    # replicas: expert 0 on ranks 0 and 2 (both nodes). t2 from rank 1 reaches 0 locally in node 0 and 2 on
    # node 1 → 1 send; from rank 3: 0 on rank 2 (w.p. 1) and 2 on rank 3 → 0 sends... worked out per source:
    # rank 0: t1 {0 local, 1 on rank 1} → 0; t2 {0 local, 2 on node 1} → 1; t3 → 1.           = 2
    # rank 1: t1 {0: rank 0 or 2 w.p. 1/2 each; 1 local node} → 0.5; t2 → 0.5·1 + 0.5·1 = 1; t3 → 1 = 2.5
    # rank 2: t1 {0 local, 1 on node 0} → 1; t2 {0 local, 2 on rank 3} → 0; t3 → 0.               = 1
    # rank 3: t1 {0: rank 0 w.p. 1/2 or rank 2; 1 on node 0} → 1; t2 → 0.5; t3 → 0.              = 1.5
    # mean over sources: (2 + 2.5 + 1 + 1.5) / 4 = 1.75
    replicated = PlacementTable.from_rows(4, [[0], [1], [2, 0], [3]])
    assert trace_traffic(HAND, replicated, topo)["cross_node"] == 1.75
    assert expected_traffic(stats, replicated, topo)["cross_node"] == 1.75  # exact for top-2


def test_cross_rack_traffic_on_a_hand_checked_case():
    # 8 ranks, 1 GPU per node, 2 nodes per rack (4 racks of ranks {0,1}, {2,3}, {4,5}, {6,7}), 8 experts.
    index = [np.array([[0, 1], [0, 7]])]
    stats = RoutingStats.from_indices(index, 8)
    t = expected_traffic(stats, PlacementTable.contiguous(8, 8), "gpus_per_node=1,nodes_per_rack=2")
    # {0,1} is one rack: sources outside rack 0 (6 of 8) send once → 0.75; {0,7} spans racks 0 and 3:
    # sources in those racks send 1, the others 2 → (4·1 + 4·2)/8 = 1.5. Total 2.25.
    assert t["cross_rack_dedup"] == 2.25 == trace_traffic(index, PlacementTable.contiguous(8, 8),
                                                          "gpus_per_node=1,nodes_per_rack=2")["cross_rack_dedup"]
    # pair traffic: 4 assignments, local 1/8, the rack's other rank 1/8, 6/8 cross-rack
    assert (t["local"], t["inter_node"], t["cross_rack"]) == (0.5, 0.5, 3.0)


def test_top3_uses_a_lower_bound_and_traces_are_exact():
    index = [np.array([[0, 1, 2]])]  # one token; 3 experts on node 0 of 2 (2 ranks per node)
    stats = RoutingStats.from_indices(index, 4)
    table = PlacementTable.contiguous(4, 4)
    # trace: node 0 ({0, 1}) and node 1 ({2}) are touched; a source on either node sends once → 1
    assert trace_traffic(index, table, "gpus_per_node=2")["cross_node"] == 1.0
    # pairwise estimate: (1 − 1/2)·(3 assignments − 1 co-located pair (0, 1)) = 1 (exact here), and
    # never above the exact value in general
    assert expected_traffic(stats, table, "gpus_per_node=2")["cross_node"] <= 1.0


def test_coactivation_placement_recovers_planted_groups():
    indices, stats = _planted()
    topo = "gpus_per_node=2"  # 8 ranks → 4 nodes of 2 ranks, 4 planted groups of 4 experts
    optimum = 0.75 * (stats.loads.sum() - 4000)  # (1 − 1/M)·(Σ N − co-located pairs); every pair is in-group
    contiguous = expected_traffic(stats, PlacementTable.contiguous(16, 8), topo)["cross_node"]
    placed = coactivation_placement(stats, 8, topo, tolerance=0.1)
    got = trace_traffic(indices, placed, topo)["cross_node"]
    assert got == pytest.approx(optimum) and got < 0.6 * contiguous
    assert max(rank_loads(stats.loads, placed)) <= 1.1 * stats.loads.sum() / 8 + 1e-9  # balance bound


def test_eplb_baseline_on_a_hand_checked_case():
    # 4 experts, 2 nodes × 2 GPUs, 4 replicas (8 slots, 2 per GPU): each expert is a group; heaviest first
    # onto the lighter node → node 0 = {0 (100), 3 (10)}, node 1 = {1 (40), 2 (30)}. Each node's 2 extra
    # slots go to the largest load per copy, at most one copy per GPU: node 0: 0 (100 → 50/copy), then 3
    # (0 is at 2 copies = 2 GPUs); node 1: 1, then 2. Every GPU of a node then holds both of its experts.
    table = eplb_placement([100, 40, 30, 10], 4, num_nodes=2, replicas=4)
    assert sorted(map(sorted, table.rows[:2])) == [[0, 3], [0, 3]]
    assert sorted(map(sorted, table.rows[2:])) == [[1, 2], [1, 2]]


def test_topology_and_ep_groups():
    topo = Topology.parse("racks=2,nodes_per_rack=2,gpus_per_node=4,inter_node=ethernet,rack_gbps=5")
    assert (topo.total_gpus, topo.network_gbps, topo.nvlink_gbps, topo.rack_gbps) == (16, 12.5, 300.0, 5.0)
    assert [topo.level(0, r) for r in (0, 3, 4, 8)] == ["local", "intra_node", "inter_node", "cross_rack"]
    assert ep_group_span(16, 4, topo).kind == "intra_node"  # EP groups inside a node
    span = ep_group_span(16, 8, topo)  # ep > gpus_per_node: two whole nodes of one rack
    assert (span.kind, span.nodes_per_group, span.racks_per_group, span.edp_crosses_nodes) == (
        "hierarchical", 2, 1, True)
    assert ep_group_span(16, 16, topo).kind == "cross_rack"
    with pytest.raises(HybridEPConfigError, match="ep_degree=3 does not divide gpus_per_node=4"):
        ep_group_span(12, 3, "gpus_per_node=4")
    with pytest.raises(HybridEPConfigError, match="not a multiple of it"):
        ep_group_span(24, 6, "gpus_per_node=4")
    with pytest.raises(HybridEPConfigError, match="differs from the topology"):
        ep_group_span(8, 4, topo)
    with pytest.raises(HybridEPConfigError, match="unknown topology key"):
        Topology.parse("gpu=4")


def _stats_file(path, coactivation=True):
    layer = {"tokens_per_expert": [0] * 8}
    _, stats = _planted(num_experts=8, groups=2, tokens=2000, seed=1)
    layer["tokens_per_expert"] = [int(x) for x in stats.loads]
    if coactivation:
        layer["coactivation"] = stats.coactivation.astype(int).tolist()
    path.write_text("\n".join(json.dumps({"step": s, "layers": {"model.layers.0.mlp.experts": layer}})
                              for s in (5, 10)))
    return path


def test_place_command(tmp_path, capsys):
    stats = _stats_file(tmp_path / "expert_load.jsonl")
    out = tmp_path / "placement.json"
    # 4 EP ranks over 2 nodes: the planted groups {0,2,4,6} and {1,3,5,7} can each live on one node
    assert cli(["place", "--stats", str(stats), "--topology", "gpus_per_node=2", "--ep-degree", "4",
                "--tolerance", "0.1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "contiguous" in printed and "less than contiguous" in printed and "method coactivation" in printed
    result = json.loads(out.read_text())
    table = PlacementTable.from_rows(8, result["placement"]["model.layers.0.mlp.experts"])
    _assert_valid(table, 8, 4, 0)
    # 2 records × 2000 tokens, every token inside one group: (1 − 1/2)·(8000 assignments − 4000 co-located pairs)
    for fitted in ("per_layer", "one_table"):  # one layer: its own table is the one table
        assert result[fitted]["traffic"]["cross_node"] == pytest.approx(0.5 * (8000 - 4000))
    assert result["contiguous"]["traffic"]["cross_node"] > 0
    assert {frozenset(table.rows[0] + table.rows[1]), frozenset(table.rows[2] + table.rows[3])} == {
        frozenset({0, 2, 4, 6}), frozenset({1, 3, 5, 7})}
    layer = result["layers"]["model.layers.0.mlp.experts"]
    assert set(layer) == {"imbalance_contiguous", "imbalance_one_table", "imbalance_per_layer"}


def test_place_command_fits_a_table_per_layer(tmp_path, capsys):
    """Three layers with hot pairs {0,1}, {0,2}, {1,2}: one table per layer balances each; no shared table of
    2 ranks can split all three pairs, so some layer has both its hot experts on one rank."""
    stats = tmp_path / "expert_load.jsonl"
    hot = {f"model.layers.{i}.mlp.experts": {"tokens_per_expert": [400 if e in pair else 10 for e in range(8)]}
           for i, pair in enumerate([(0, 1), (0, 2), (1, 2)])}
    stats.write_text("\n".join(json.dumps({"step": s, "layers": hot}) for s in (5, 10)))
    out = tmp_path / "placement.json"
    assert cli(["place", "--stats", str(stats), "--ep-degree", "2", "--out", str(out)]) == 0
    assert "worst single layer" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["placement"]) == set(hot)
    for name, layer in result["layers"].items():
        table = PlacementTable.from_rows(8, result["placement"][name])
        loads = hot[name]["tokens_per_expert"]
        assert layer["imbalance_per_layer"] == pytest.approx(imbalance(rank_loads(loads, table)))
        assert layer["imbalance_per_layer"] == pytest.approx(1.0)  # 410 + 10·3 on each rank
    assert result["per_layer"]["worst_layer_imbalance"] == pytest.approx(1.0)
    assert max(layer["imbalance_one_table"] for layer in result["layers"].values()) > 1.5  # (800+30)/(440)
    one = tmp_path / "one.json"
    assert cli(["place", "--stats", str(stats), "--ep-degree", "2", "--one-table", "--out", str(one)]) == 0
    rows = json.loads(one.read_text())["placement"]
    assert PlacementTable.from_rows(8, rows).ep_degree == 2  # one table, as before


def test_place_command_with_replicas_and_no_coactivation(tmp_path, capsys):
    stats = tmp_path / "expert_load.jsonl"
    layer = {"tokens_per_expert": [500, 80, 70, 60, 50, 40, 30, 20]}
    stats.write_text("\n".join(json.dumps({"step": s, "layers": {"model.layers.0.mlp.experts": layer}}) for s in (5, 10)))
    out = tmp_path / "placement.json"
    assert cli(["place", "--stats", str(stats), "--ep-degree", "4", "--replicas", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["method"] == "hierarchical"
    assert result["per_layer"]["imbalance"] < result["contiguous"]["imbalance"]
    assert PlacementTable.from_rows(8, result["placement"]["model.layers.0.mlp.experts"]).slots_per_rank == 3
    assert "contiguous" in capsys.readouterr().out
