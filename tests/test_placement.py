"""Load-aware placement: valid tables, exact predicted loads, and the place command."""

from __future__ import annotations

import json

import pytest

from hf_hybrid_ep import HybridEPConfigError
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.dispatch import PlacementTable
from hf_hybrid_ep.placement import balanced_placement, imbalance, rank_loads


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


def test_place_command(tmp_path, capsys):
    stats = tmp_path / "expert_load.jsonl"
    layer = {"tokens_per_expert": [500, 80, 70, 60, 50, 40, 30, 20]}
    stats.write_text("\n".join(json.dumps({"step": s, "layers": {"model.layers.0.mlp.experts": layer}}) for s in (5, 10)))
    out = tmp_path / "placement.json"
    assert cli(["place", "--stats", str(stats), "--ep-degree", "4", "--replicas", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["layers"]["model.layers.0.mlp.experts"]
    assert result["imbalance_balanced"] < result["imbalance_contiguous"]
    assert PlacementTable.from_rows(8, result["placement"]).slots_per_rank == 3
    assert "contiguous" in capsys.readouterr().out
