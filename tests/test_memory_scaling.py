"""Memory scaling: ZeRO-1 optimizer-state sharding and FSDP2 dense sharding equal the unsharded
single-process reference, and the measured per-rank bytes equal the planner's formula exactly."""

from __future__ import annotations

import json

import dist_cases as cases
import parity
import pytest

from hf_hybrid_ep import HybridEPConfig, HybridEPConfigError
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.memory import measure

LAYOUTS_4 = [(4, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("layout", LAYOUTS_4, ids=str)
def test_zero1_equals_the_unsharded_reference(pools, layout):
    # 3 AdamW steps, accumulation 2, clipping by the global norm, vs one process on the global batch.
    parity.assert_faithful(pools(4).run(cases.train_parity, "mixtral", *layout, 4, optimizer_sharding="zero1"))


def test_zero1_with_biased_transposed_experts(pools):
    parity.assert_faithful(pools(4).run(cases.train_parity, "gpt_oss", 2, 2, 4, optimizer_sharding="zero1"))


def test_zero1_with_expert_replicas(pools):
    # Replicated experts form buckets held by several EP ranks: sharded over all their holders.
    placement = [[0, 1, 2], [2, 3, 0]]
    parity.assert_faithful(pools(2).run(cases.train_parity, "qwen3_moe", 1, 2, 4, placement=placement,
                                  optimizer_sharding="zero1"))


@pytest.mark.parametrize("layout", LAYOUTS_4, ids=str)
def test_fsdp_dense_equals_the_unsharded_reference(pools, layout):
    parity.assert_faithful(pools(4).run(cases.train_parity, "mixtral", *layout, 4, dense_sharding="fsdp"))


def test_fsdp_dense_with_zero1_experts(pools):
    parity.assert_faithful(pools(4).run(cases.train_parity, "qwen3_moe", 2, 2, 4, optimizer_sharding="zero1",
                                  dense_sharding="fsdp"))


MODES = [("none", "replicate"), ("zero1", "replicate"), ("none", "fsdp"), ("zero1", "fsdp")]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(m))
def test_measured_bytes_equal_the_planner(pools, mode):
    # vocab 131: FSDP's dim-0 chunks of the embeddings are unequal, so the per-rank formula is exercised.
    results = pools(4).run(measure, "qwen3_moe", 4, 2, 2, *mode, vocab_size=131)
    unsharded = pools(4).run(measure, "qwen3_moe", 4, 2, 2, "none", "replicate", vocab_size=131)
    for r, base in zip(results, unsharded, strict=True):
        assert r["optimizer_state_measured"]
        measured = {k: r[k] for k in ("weight_bytes", "grad_bytes", "optimizer_bytes")}
        assert measured == r["planned"], (r["rank"], measured, r["planned"])
        assert r["grad_bytes_after_backward"] == r["grad_bytes"]
        if mode[0] == "zero1":
            assert r["optimizer_bytes"] < base["optimizer_bytes"] / 2
        if mode[1] == "fsdp":
            assert r["weight_bytes"] < base["weight_bytes"]
    if mode[1] == "fsdp":
        assert len({r["weight_bytes"] for r in results}) > 1, "unequal dim-0 chunks expected with vocab 131"


def test_plan_takes_the_sharding_flags(capsys):
    args = ["plan", "--model", "mistralai/Mixtral-8x7B-v0.1", "--gpus", "16", "--gpu-memory-gib", "80", "--json"]
    assert cli(args) == 0
    plain = {(p["dp"], p["ep"]): p for p in json.loads(capsys.readouterr().out)["layouts"]}
    assert cli([*args, "--optimizer-sharding", "zero1", "--dense-sharding", "fsdp"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert (sharded["optimizer_sharding"], sharded["dense_sharding"]) == ("zero1", "fsdp")
    for p in sharded["layouts"]:
        base = plain[(p["dp"], p["ep"])]
        assert p["weight_bytes"] < base["weight_bytes"]
        assert p["optimizer_bytes"] < base["optimizer_bytes"]
    assert sharded["recommended"] is not None and all(not p["fits"] and not p["fits_with_checkpointing"]
                                                       for p in plain.values())


def test_bad_sharding_values_are_refused():
    with pytest.raises(HybridEPConfigError, match="optimizer_sharding='zero3'"):
        HybridEPConfig(optimizer_sharding="zero3")
    with pytest.raises(HybridEPConfigError, match="dense_sharding='tp'"):
        HybridEPConfig(dense_sharding="tp")


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_trainer_resumes_across_optimizer_sharding_and_layouts(pools, tmp_path):
    from safetensors.torch import load_file

    pool = pools(4)
    plain = pool.run(cases.trainer_run, 2, 2, str(tmp_path / "none"), 6, 3)
    sharded = pool.run(cases.trainer_run, 2, 2, str(tmp_path / "zero1"), 6, 3, optimizer_sharding="zero1")
    for p, z in zip(plain, sharded, strict=True):
        assert z["optimizer_class"] == "ShardedAdamW"
        assert _rel(z["losses"], p["losses"]) <= cases.REL_TOL, (z["losses"], p["losses"])
        assert z["memory"]["hybrid_ep_optimizer_bytes"] < p["memory"]["hybrid_ep_optimizer_bytes"] / 2
        assert z["memory"]["hybrid_ep_weight_bytes"] == p["memory"]["hybrid_ep_weight_bytes"]
    # The sharded run saved the same (unsharded, global-expert-id keyed) state as the plain run.
    a = load_file(tmp_path / "none" / "checkpoint-3" / "optimizer.safetensors")
    b = load_file(tmp_path / "zero1" / "checkpoint-3" / "optimizer.safetensors")
    assert a.keys() == b.keys() and any(k.endswith("::exp_avg_sq") for k in a)
    for key in a:
        assert (a[key] - b[key]).norm() <= cases.REL_TOL * a[key].norm() + 1e-12, key
    full = plain[0]["losses"]
    for source, sharding, (dp, ep) in [("zero1", "none", (4, 1)), ("none", "zero1", (1, 4))]:
        checkpoint = str(tmp_path / source / "checkpoint-3")
        out = str(tmp_path / f"resume-{source}-{sharding}-{ep}")
        for r in pool.run(cases.trainer_run, dp, ep, out, 6, None, checkpoint, optimizer_sharding=sharding):
            assert _rel(r["losses"][-3:], full[-3:]) <= cases.REL_TOL, (source, sharding, ep, r["losses"], full)


def test_accelerate_loop_with_zero1_resumes_unsharded(pools, tmp_path):
    pool = pools(4)
    plain = pool.run(cases.accelerate_loop, 2, 2, str(tmp_path / "plain"), 4)[0]["losses"]
    sharded = pool.run(cases.accelerate_loop, 2, 2, str(tmp_path / "state"), 4, 2, optimizer_sharding="zero1")
    for r in sharded:
        assert _rel(r["losses"], plain) <= cases.REL_TOL, (r["losses"], plain)
    for r in pool.run(cases.accelerate_loop, 4, 1, str(tmp_path / "state"), 4, 2, True):
        assert _rel(r["losses"], plain[4:]) <= cases.REL_TOL, (r["losses"], plain)


def test_fsdp_is_refused_where_ddp_wraps_the_model(pools, tmp_path):
    for r in pools(2).run(cases.fsdp_under_accelerate):
        assert "dense_sharding='fsdp'" in r["message"], r


def test_zero1_with_hot_expert_shadowing(pools):
    # Shadow gradients return to their owners in the reducer's pre-reduce hook, before the reduce-scatter.
    results = pools(4).run(cases.train_parity, "gpt_oss", 2, 2, 4, optimizer_sharding="zero1",
                           shadow_capacity=2, skew=([0, 2], 4.0), seq=32)
    parity.assert_faithful(results)
    assert all(sum(s["rows_local"] for s in r["shadow_steps"]) > 0 for r in results), results
