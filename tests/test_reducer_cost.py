"""The reducer's work per gradient hook does not grow with the model: a backward costs O(parameters).

Counted in executed library lines (:mod:`work_counting`), not timed: from 2 to 8 decoder layers the parameters
grow 3.6×, and the lines per parameter of a backward, of its reduction and of a forward must stay level. A hook
that passes over every parameter makes them grow with the parameter count (measured at dp 2 × ep 2: such a
reducer runs 93 → 153 reduction lines per parameter; this one 41 → 35).
"""

from __future__ import annotations

import dist_cases as cases
import pytest

SHALLOW, DEEP = 2, 8
GROWTH = 1.15  # lines per parameter may grow this much from SHALLOW to DEEP (fixed per-step work thins out)


@pytest.mark.parametrize("layout", [(2, 1), (2, 2)], ids=["dp2xep1", "dp2xep2"])  # dp2xep2: experts over EDP pairs
def test_work_per_parameter_is_independent_of_depth(pools, layout):
    for r in pools(layout[0] * layout[1]).run(cases.reducer_work, "qwen3_moe", *layout, [SHALLOW, DEEP]):
        shallow, deep = r[SHALLOW], r[DEEP]
        assert deep["parameters"] > 3 * shallow["parameters"], r
        for key in ("reduction_lines", "backward_lines", "forward_lines"):
            per_shallow, per_deep = (d[key] / d["parameters"] for d in (shallow, deep))
            assert per_deep <= GROWTH * per_shallow, (key, per_shallow, per_deep, r)


def test_buckets_follow_the_trainable_set_between_steps(pools):
    # The check is once per differentiated forward, not per hook: a parameter frozen after parallelize gets
    # no gradient and no bucket, one trained again is hooked and reduced during backward, and a ZeRO-1
    # optimizer refuses the change.
    for r in pools(2).run(cases.trainable_set_changes, 2, 1):
        assert max(r["grad_rel"]) <= cases.REL_TOL, r
        assert r["frozen_with_grad"] == [[], [], []], r
        assert all(n > 0 for n in r["launched_in_backward"]), r
        assert "trainable parameters changed after the ZeRO-1 optimizer was built" in r["zero1_refusal"], r
