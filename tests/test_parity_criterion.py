"""The parity criterion (tests/parity.py) is derived, not lucky, and it still catches real defects.

Each fault of tests/faults.py is injected into one hybrid run inside the workers; the run must complete
and fail through a reported check, never an exception, hang or timeout. Which checks caught it is
recorded (with HEP_PARITY_FIGURES=path, as JSON lines).
"""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest
import torch

# fault → (family, (dp, ep), extra train_parity options)
FAULT_CASES = {
    "edp_allreduce_identity": ("mixtral", (2, 2), {}),
    "dense_over_ep_group": ("mixtral", (2, 2), {}),
    "expert_grads_scaled": ("qwen3_moe", (2, 2), {}),
    "shadow_grads_not_returned": ("gpt_oss", (2, 2), {"shadow_capacity": 2, "skew": ([0, 2], 4.0), "seq": 32}),
    "routing_weights_twice": ("qwen3_moe", (2, 2), {}),
}


@pytest.mark.parametrize("fault", list(FAULT_CASES))
def test_every_injected_fault_is_caught(pools, fault):
    family, (dp, ep), options = FAULT_CASES[fault]
    results = pools(4).run(cases.train_parity, family, dp, ep, 4, fault=fault, **options)  # completes: no exception
    row = parity.record(results)
    caught = row["failed"]
    assert caught, f"{fault} was not caught: {row}"
    assert set(caught) <= set(parity.CHECKS)
    if fault == "shadow_grads_not_returned":  # the shadows were really in use, so the fault had effect
        assert all(len(r["shadow_steps"]) >= 2 for r in results), results
        assert all(step["rows_local"] > 0 for r in results for step in r["shadow_steps"][1:])


def test_the_same_cases_pass_without_the_fault(pools):
    # The control for the test above: every fault case's configuration is faithful as such.
    for fault, (family, (dp, ep), options) in FAULT_CASES.items():
        if fault in ("expert_grads_scaled", "routing_weights_twice"):  # same configuration as another case
            continue
        parity.assert_faithful(pools(4).run(cases.train_parity, family, dp, ep, 4, **options))


def test_the_rule_names_zero_initialised_tensors_before_anything_runs():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.bias.zero_()
    assert parity.zero_initialised(model) == {"bias"}


def test_measured_bound_is_the_safety_factor_times_the_spread():
    ref = torch.ones(100) * 1e-3
    near = ref * (1 + 2.5e-5)
    far = ref * (1 + 4e-5)
    spread_of = lambda names: dict.fromkeys(names, 1e-5)  # noqa: E731
    ok = parity.compare_params([("b", near, ref)], {"b"}, spread_of, step_budget=6e-3)
    bad = parity.compare_params([("b", far, ref)], {"b"}, spread_of, step_budget=6e-3)
    strict = parity.compare_params([("w", near, ref)], {"b"}, spread_of, step_budget=6e-3)
    assert ok["violations"] == [] and ok["measured_bounds"][0]["bound"] == pytest.approx(parity.SAFETY * 1e-5)
    assert [n for n, _ in bad["violations"]] == ["b"]
    assert [n for n, _ in strict["violations"]] == ["w"]  # not named by the rule: the strong bound applies
    # the bound as a fraction of the distance Adam can move an element in the run
    assert ok["measured_bounds"][0]["bound_fraction"] == pytest.approx(3e-5 * 1e-3 / 6e-3)
