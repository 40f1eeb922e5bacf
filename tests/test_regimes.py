"""The benchmark regimes (`benchmarks/training/regimes.py`): their shapes hit the reference runs' T/T*, the bench's
T* agrees with the step-time model's, and the committed regime results validate the step-time model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.training import regimes as rg
from hf_hybrid_ep.planning.planner import count_parameters
from hf_hybrid_ep.planning.step_time import compare

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"


def _counts(regime):
    return count_parameters(rg.qwen3_moe_config(regime.model))


@pytest.mark.parametrize("name", sorted(rg.REGIMES))
def test_shapes_hit_the_target_t_over_t_star(name):
    regime = rg.REGIMES[name]
    shapes = rg.t_over_t_star(regime)
    assert abs(shapes["T_over_T_star"] / regime.target_t_over_t_star - 1) <= 0.25, shapes
    # the bench's closed form is the step-time model's crossover for the same two layouts on two nodes of two ranks
    counts = _counts(regime)
    cal = {"flops_per_s": 1e10, "intra_gbps": 5.0, "exchange_overhead_s": 0.0}
    fabric = {"kind": "two-node", "ranks_per_node": 2, "measured_gbit": 1.0}
    hybrid, pure = (rg.predict({"engine": "hybrid", "dp": dp, "ep": ep}, counts, regime, cal, fabric, 10.0)
                    for dp, ep in ((2, 2), (1, 4)))
    assert compare(hybrid, pure)["T_star"] == pytest.approx(shapes["T_star"], rel=1e-12)


def test_link_rate_for_a_target_r_x():
    # 100 MB per rank per step crossing, 2 ranks per node, 4 s of compute, r_x 0.5 → 200 MB in 2 s: 0.8 Gbit/s
    assert rg.link_gbit_for(0.5, 100e6, 2, 4.0) == pytest.approx(0.8)


def test_memory_budget_rule():
    regime = rg.REGIMES["toy"]
    budget = rg.memory_budget(_counts(regime), regime)
    assert budget["budget_bytes"] == int(1.5 * budget["planner_hybrid_bytes"] + 128 * 2**20)


def _committed():
    found = sorted(RESULTS.glob("bench_training_regime_*.json"))
    assert {p.stem.rsplit("_", 1)[-1] for p in found} >= {"fine-grained", "coarse", "toy"}, found
    return [json.loads(p.read_text()) for p in found]


# Where the model misses (docs/benchmarks.md, "Training in the regimes of real clusters"; the committed runs were
# timed while other jobs shared the 2 cores). Stable across repeats: pure DP's end-of-step wait for the gradient
# all-reduce (fine-grained +26%, coarse +161%) and the deduplicated exchange's own work at dp2×ep2 in coarse (+48%):
# the model prices its gathers as bytes at the machine's copy rate, which accounts for a small part of it on these
# cores (fine-grained +26% → +24%, now inside the 25% band by a point). Moved with the machine's load: ZeRO-1
# (-29%, -34%), FSDP2 + ZeRO-1 (fine-grained +54%; toy +36%) and ZeRO-1 at the toy model's size (+27%). A fixed model
# that hits one of them, or misses another run, fails here until the docs say so.
DP2EP2, DEDUP, ZERO1, FSDP = ("two-node/hybrid-dp2-ep2", "two-node/hybrid-dp2-ep2-dedup",
                              "two-node/hybrid-dp2-ep2-zero1", "two-node/hybrid-dp2-ep2-fsdp-zero1")
KNOWN_MISSES = {"fine-grained": {"two-node/dp4", ZERO1, FSDP}, "coarse": {"two-node/dp4", DEDUP, ZERO1},
                "toy": {ZERO1, FSDP}}
KNOWN_ORDER_MISSES = {
    "fine-grained": {(DP2EP2, ZERO1), ("two-node/ep4", FSDP)},
    "coarse": {("two-node/dp4", ZERO1), (DP2EP2, ZERO1), ("two-node/ep4", DEDUP), (DEDUP, FSDP)},
    "toy": set()}


@pytest.mark.parametrize("report", _committed(), ids=lambda r: r["regime"]["name"])
def test_step_time_model_predicts_the_committed_runs(report):
    """The current step-time model, calibrated on the regime's one calibration run only, predicts every other
    run of this library within 25% and orders every pair more than 15% apart as measured — except the misses
    the docs record."""
    name = report["regime"]["name"]
    evaluated = rg.evaluate(report)
    validation = evaluated["validation"]
    assert len(validation["rows"]) >= 4, validation  # every layout of ours that ran, none skipped
    misses = {r["run"] for r in validation["rows"] if not r["within_tolerance"]}
    assert misses == KNOWN_MISSES[name], [(r["run"], round(r["error"], 3)) for r in validation["rows"]]
    wrong = {tuple(p["pair"]) for p in validation["pairs"] if not p["order_ok"]}
    assert wrong == KNOWN_ORDER_MISSES[name], wrong
    assert evaluated["achieved"]["T_over_T_star_within_25pct"] and evaluated["achieved"]["r_x_within_25pct"]
    # the committed file records what this code computes (no figure edited by hand)
    assert report["regime"]["validation"]["max_abs_error"] == pytest.approx(validation["max_abs_error"], rel=1e-9)
