"""Debugging aids: the replica consistency check and fp16 overflow agreement across ranks."""

from __future__ import annotations

import dist_cases as cases
import pytest


@pytest.mark.slow
def test_replicas_are_identical_after_training(pools):
    assert [r["message"] for r in pools(4).run(cases.replica_check, None, 0)] == [""] * 4


def test_divergent_dense_parameter_is_named(pools):
    results = pools(4).run(cases.replica_check, "model.norm.weight", 3)
    for r in results:
        assert "dense parameter model.norm.weight differs between rank 0 and rank(s) [3]" in r["message"], r


def test_divergent_expert_replica_is_named(pools):
    # (dp, ep) = (2, 2): rank 3 holds experts 2-3, replicated on rank 1 (its EDP group is {1, 3})
    results = pools(4).run(cases.replica_check, "model.layers.0.mlp.experts.down_proj", 3)
    for r in results:
        assert "expert parameter model.layers.0.mlp.experts.down_proj[expert 2] differs between rank 1 and" \
            " rank(s) [3]" in r["message"], r


@pytest.mark.slow
def test_fp16_overflow_in_one_ranks_experts_skips_everywhere(pools):
    agreed = pools(2).run(cases.fp16_overflow_agreement, True)
    assert [r["skipped"] for r in agreed] == [True, True]
    assert [r["changed"] for r in agreed] == [False, False]
    assert agreed[0]["scale"] == agreed[1]["scale"] == 512.0
    # without the agreement the ranks disagree: the failure mode the helper exists for
    alone = pools(2).run(cases.fp16_overflow_agreement, False)
    assert [r["changed"] for r in alone] == [False, True]
