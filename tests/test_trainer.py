"""The stock Trainer loop on hybrid EP equals a single-process Trainer, and resumes at any EP degree."""

from __future__ import annotations

import dist_cases as cases
import pytest
import trainer_cases as tc

from hf_hybrid_ep.metrics import read_jsonl, write_report


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_trainer_matches_single_process(pools, tmp_path):
    want = tc.reference_losses(str(tmp_path / "ref"), world=4)
    results = pools(4).run(cases.trainer_run, 2, 2, str(tmp_path / "hybrid"))
    for r in results:
        assert r["wrapped"] == "DistributedDataParallel"
        assert r["dense_bytes"] == 0, "DDP reduces the dense weights; the engine must not reduce them again"
        assert _rel(r["losses"], want) <= cases.REL_TOL, (r["losses"], want)
    assert len(want) == 6


@pytest.mark.slow
def test_resume_at_the_same_or_another_ep_degree(pools, tmp_path):
    pool = pools(4)
    full = pool.run(cases.trainer_run, 2, 2, str(tmp_path / "run"), 6, 3)[0]["losses"]
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "model.safetensors.index.json").is_file()
    assert (checkpoint / "optimizer.safetensors").is_file() and (checkpoint / "scheduler.pt").is_file()
    from hf_hybrid_ep.checkpoint import read_index

    assert read_index(checkpoint).hybrid_ep.ep_degree == 2
    for dp, ep in [(2, 2), (4, 1), (1, 4)]:
        resumed = pool.run(cases.trainer_run, dp, ep, str(tmp_path / f"resume-{ep}"), 6, None, str(checkpoint))
        for r in resumed:
            assert _rel(r["losses"][-3:], full[-3:]) <= cases.REL_TOL, (ep, r["losses"], full)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_sharding", ["none", "zero1"])
def test_a_checkpoint_saved_after_rebalances_resumes_at_another_ep_degree(pools, tmp_path, optimizer_sharding):
    """Rebalances with replicas after every step; the step-3 checkpoint holds the tables and the optimizer
    state of that layout; resumed (without rebalancing) at dp 2 × ep 2 and dp 4 × ep 1, the last steps equal
    the run that went on rebalancing."""
    pool = pools(4)
    run = tmp_path / "run"
    full = pool.run(cases.trainer_run, 2, 2, str(run), 6, 3, optimizer_sharding=optimizer_sharding,
                    rebalance_every=1, rebalance_replicas=2)[0]["losses"]
    from hf_hybrid_ep.checkpoint import read_index

    meta = read_index(run / "checkpoint-3").hybrid_ep
    assert meta.placement != [[0, 1], [2, 3]] and len(meta.layer_rows("model.layers.0.mlp.experts")[0]) == 3
    for dp, ep in [(2, 2), (4, 1)]:
        for r in pool.run(cases.trainer_run, dp, ep, str(tmp_path / f"resume-{ep}"), 6, None, str(run / "checkpoint-3"),
                          optimizer_sharding=optimizer_sharding):
            assert _rel(r["losses"][-3:], full[-3:]) <= cases.REL_TOL, (ep, r["losses"], full)


def test_saved_checkpoint_loads_in_vanilla_transformers(pools, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    pools(2).run(cases.trainer_run, 1, 2, str(tmp_path / "run"), 2, 2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2")
    assert torch.isfinite(model(input_ids=torch.randint(3, 100, (1, 8))).logits).all()


def test_gradient_checkpointing_matches_single_process(pools, tmp_path):
    want = tc.reference_losses(str(tmp_path / "ref"), world=4, max_steps=3)
    results = pools(4).run(cases.trainer_run, 2, 2, str(tmp_path / "gc"), 3, gradient_checkpointing=True)
    for r in results:
        assert _rel(r["losses"], want) <= cases.REL_TOL, (r["losses"], want)


def test_bf16_autocast_with_the_replica_check(pools, tmp_path):
    results = pools(2).run(cases.trainer_run, 1, 2, str(tmp_path / "bf16"), 4, verify_sync_steps=2, bf16=True)
    for r in results:
        assert len(r["losses"]) == 4 and all(x == x and x < 10 for x in r["losses"]), r


def test_evaluation_on_an_uneven_split(pools, tmp_path):
    # 7 sequences over 2 ranks × batch 2: Accelerate pads the last batch with repeated samples so every
    # rank runs the same number of forward passes (the EP exchange needs all of them). The padding
    # makes the last batch's mean loss differ from a single process's, exactly as for plain DDP, so
    # the reference here is the plain (DDP) Trainer on the unsharded model; an even split matches the
    # single-process evaluation.
    pool = pools(2)
    plain = pool.run(cases.trainer_eval, 1, 2, str(tmp_path / "ddp"), 7, False)[0]["eval_loss"]
    for r in pool.run(cases.trainer_eval, 1, 2, str(tmp_path / "eval"), 7):
        assert abs(r["eval_loss"] - plain) / plain <= cases.REL_TOL, (r, plain)
    single = tc.reference_eval_loss(str(tmp_path / "ref"), 8)
    for r in pool.run(cases.trainer_eval, 1, 2, str(tmp_path / "even"), 8):
        assert abs(r["eval_loss"] - single) / single <= cases.REL_TOL, (r, single)


def test_accelerate_save_state_load_state_at_another_ep_degree(pools, tmp_path):
    pool = pools(4)
    full = pool.run(cases.accelerate_loop, 2, 2, str(tmp_path / "state"), 4, 2)
    assert all(r["dense_bytes"] == 0 for r in full), "DDP reduces dense gradients, not the engine"
    assert (tmp_path / "state" / "model" / "model.safetensors.index.json").is_file()
    for dp, ep in [(2, 2), (4, 1), (1, 4)]:
        resumed = pool.run(cases.accelerate_loop, dp, ep, str(tmp_path / "state"), 4, 2, True)
        for r in resumed:
            assert _rel(r["losses"], full[0]["losses"][4:]) <= cases.REL_TOL, (ep, r["losses"], full[0]["losses"])


def test_trainer_refreshes_hot_expert_shadows(pools, tmp_path):
    pool = pools(2)
    plain = pool.run(cases.trainer_shadow_run, str(tmp_path / "plain"), False)
    shadowed = pool.run(cases.trainer_shadow_run, str(tmp_path / "shadowed"), True)
    for a, b in zip(plain, shadowed, strict=True):
        assert a["shadows_held"] == 0 and a["rows_local"] == 0
        # refreshed after each of the 4 optimizer steps (2 layers, capacity 1; the last refresh goes unused)
        assert b["shadows_held"] == 2 * 4 and b["rows_local"] > 0, b
        assert _rel(b["losses"], a["losses"]) <= cases.REL_TOL, (a["losses"], b["losses"])
    # online rebalancing through the Trainer's optimizer (Accelerate's wrapper), shadows decided after each
    # move; hot experts 0 and 1 share EP rank 0 of the contiguous table, so the first rebalance splits them
    plain = pool.run(cases.trainer_shadow_run, str(tmp_path / "plain01"), False, hot=(0, 1))
    moved = pool.run(cases.trainer_shadow_run, str(tmp_path / "moved"), True, rebalance=True, hot=(0, 1))
    for a, c in zip(plain, moved, strict=True):
        assert c["rebalances"] and c["shadows_held"] > 0, c
        assert _rel(c["losses"], a["losses"]) <= cases.REL_TOL, (a["losses"], c["losses"])
    # the load report: the placement at every record, and each rebalance's imbalance before and after
    records = read_jsonl(tmp_path / "moved" / "expert_load.jsonl")
    layer = "model.layers.0.mlp.experts"
    assert records[0]["layers"][layer]["placement"] != [[0, 1], [2, 3]]  # the first record follows a move
    events = [e for r in records for e in r.get("rebalances", [])]
    assert [e["step"] for e in events] == [1, 2, 3, 4], events
    first = events[0]
    assert first["moved"] and first["imbalance_after"][layer] < first["imbalance_before"][layer], first
    written = {p.name for p in write_report(tmp_path / "moved" / "expert_load.jsonl", tmp_path / "report")}
    assert {"placement_over_time.png", "rebalance_imbalance.png", "summary.txt"} <= written, written
    assert "rebalances" in (tmp_path / "report" / "summary.txt").read_text()


def test_ddp_looks_for_unused_parameters_only_where_some_can_be_unused():
    from tiny_models import build_tiny_model

    from hf_hybrid_ep.integrations.trainer import may_leave_parameters_unused

    assert may_leave_parameters_unused(build_tiny_model("qwen3_moe", num_experts=4)) is None
    vl = build_tiny_model("ernie4_5_vl_moe", num_experts=4, num_layers=3)  # text and vision experts per block
    assert "several experts modules" in (may_leave_parameters_unused(vl) or ""), may_leave_parameters_unused(vl)


@pytest.mark.slow
def test_resume_from_the_latest_complete_checkpoint_logs_each_step_once(pools, tmp_path):
    """``resume_from_checkpoint="latest"`` after a run that saved checkpoint-2 and checkpoint-4, with checkpoint-4
    missing a file (incomplete): it resumes from checkpoint-2, its losses equal the first run's, and
    expert_load.jsonl holds every step once (a fresh start without any checkpoint: the recovery drill's first
    attempt, tests/test_fault_drills.py)."""
    from hf_hybrid_ep.model_io.resume import latest_checkpoint

    pool, run = pools(2), tmp_path / "run"
    first = pool.run(cases.trainer_run, 1, 2, str(run), 4, 2)[0]["losses"]
    assert latest_checkpoint(run).name == "checkpoint-4"
    resumed = pool.run(cases.trainer_resume_latest, str(run), 4, "scheduler.pt")
    for r in resumed:
        assert len(r["losses"]) == 4 and _rel(r["losses"][2:], first[2:]) <= cases.REL_TOL, (r["losses"], first)
    assert [rec["step"] for rec in read_jsonl(run / "expert_load.jsonl")] == [1, 2, 3, 4]
    assert latest_checkpoint(run).name == "checkpoint-4"  # written again, complete


def test_the_ranks_must_read_different_data(pools):
    same = pools(2).run(cases.distinct_inputs, True)
    assert all("ranks [0, 1] received the same first batch" in r["message"] for r in same), same
    assert all("use_cpu=True" in r["message"] for r in same)
    assert all(r["message"] == "" for r in pools(2).run(cases.distinct_inputs, False))


def test_evaluation_at_a_smaller_ep_degree_inside_training(pools, tmp_path):
    """dp 2 × ep 2, evaluating after steps 1 and 2 at ep 1 (every rank holds all 4 experts, batch 4): the same
    evaluation losses as at the training layout, the same training loss after, the training layout back."""
    pool = pools(4)
    plain = pool.run(cases.trainer_eval_layout, str(tmp_path / "plain"), None)
    small = pool.run(cases.trainer_eval_layout, str(tmp_path / "small"), 1)
    for a, b in zip(plain, small, strict=True):
        assert len(b["eval_losses"]) == 2 and _rel(b["eval_losses"], a["eval_losses"]) <= cases.REL_TOL, (a, b)
        assert _rel(b["losses"], a["losses"]) <= cases.REL_TOL, (a["losses"], b["losses"])
        assert b["layout"] == a["layout"] and all(ep == 2 and shape[0] == 2 for ep, _, shape in b["layout"]), b
    for r in pool.run(cases.eval_layout_refusals):
        assert "ep_degree=3 must divide the training EP degree 4" in r["messages"][0], r
        assert "evaluation at ep_degree=1 needs" in r["messages"][1] and "beyond the budget given" in r["messages"][1]
        assert r["unchanged"] and [s[0] for s in r["inside"]] == [4, 4] and r["logits_rel"] <= cases.REL_TOL, r
