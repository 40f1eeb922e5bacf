"""Rank-local loading in real processes: only dense tensors and this rank's experts are read."""

from __future__ import annotations

import dist_cases as cases
import pytest
from checkpoint_fixtures import FAMILIES, save_source

import hf_hybrid_ep as hep


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"rl-{request.param}")
    src = save_source(request.param, root / "src")
    ep4 = hep.convert_checkpoint(src, root / "ep4", ep_degree=4, progress=False)
    return src, ep4


def _check(results, sabotage=False):
    for r in results:
        assert r["mismatched"] == [], r
        assert r["finite"] and r["logits_rel"] <= cases.REL_TOL, r
        if sabotage:
            assert r["deleted"] + r["poisoned"] > 0, r


def test_load_at_another_ep_degree_equals_single_process(pools, checkpoints):
    src, ep4 = checkpoints
    # saved for ep 4, loaded at dp 2 × ep 2
    _check(pools(4).run(cases.rank_local_load, str(ep4), 2, 2, str(src)))


def test_each_rank_reads_only_its_own_experts(pools, checkpoints, tmp_path):
    src, _ = checkpoints
    ep2 = hep.convert_checkpoint(src, tmp_path / "ep2", ep_degree=2, progress=False)
    results = pools(2).run(cases.rank_local_load, str(ep2), 1, 2, str(src), sabotage=True)
    _check(results, sabotage=True)
    # half the experts per rank
    assert results[0]["expert_bytes"] == results[1]["expert_bytes"] > 0


def test_plain_checkpoint_loads_rank_locally(pools, checkpoints):
    src, _ = checkpoints
    _check(pools(2).run(cases.rank_local_load, str(src), 1, 2, str(src)))


def test_a_rank_that_cannot_load_stops_every_rank(pools, tmp_path):
    src = save_source("mixtral", tmp_path / "src")
    ep2 = hep.convert_checkpoint(src, tmp_path / "ep2", ep_degree=2, progress=False)
    results = pools(2).run(cases.load_with_a_missing_file, str(ep2), 1)
    assert all(r["alive"] for r in results)
    assert "missing checkpoint file" in results[1]["message"] and "rank001-of-002" in results[1]["message"]
    assert results[0]["message"] == results[1]["message"] and "(on rank(s) [1]; every rank stops)" in results[0]["message"]


def test_a_checkpoint_of_another_model_is_refused_with_one_message_on_every_rank(pools, tmp_path):
    results = pools(2).run(cases.resume_another_model, str(tmp_path / "ckpt"))
    assert results[0]["message"] == results[1]["message"], results
    assert "is a checkpoint of another model (" in results[0]["message"], results
    assert "experts: 4 in the checkpoint, 8 in the model" in results[0]["message"], results
    assert "(on rank(s) [0, 1]; every rank stops)" in results[0]["message"]
