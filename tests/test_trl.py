"""TRL's trainers on hybrid EP: ``HybridEP(SFTTrainer)``, ``HybridEP(DPOTrainer)`` and ``HybridEP(GRPOTrainer)``
at world 4 (dp 2 × ep 2 and dp 1 × ep 4) against the same TRL trainer in one process on the global batch, by the
parity criterion, with the model's own router aux loss on and formed over the global batch.

Real gloo process groups (the shared pool of 4 ranks), a tiny Qwen3-MoE built from its config, TRL 1.16 itself
as the reference.
"""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest

LAYOUTS = [(2, 2), (1, 4)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(kind, **opts)`` → the path of the single-process run's record (trained once per module)."""
    import trl_cases as tc

    made: dict[str, str] = {}

    def record(kind: str, **opts) -> str:
        key = f"{kind}-{sorted(opts.items())}"
        if key not in made:
            work = tmp_path_factory.mktemp(kind)
            made[key] = str(work / "reference.pt")
            tc.reference(kind, str(work / "run"), 4, cases.trl.PER_RANK, made[key], **opts)
        return made[key]

    return record


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"dp{v[0]}xep{v[1]}")
@pytest.mark.parametrize("opts", [{"completion_only": True}, {"completion_only": False, "packing": True, "lora": True}],
                         ids=["completion-only-full", "packed-lora"])
def test_sft_parity(pools, reference, tmp_path, layout, opts):
    # two AdamW steps of two accumulated micro-batches with clipping: prompt-completion data with the loss on the
    # completions, all weights trained; packed text (padding-free rows) with LoRA on attention and the experts
    record = reference("sft", **opts)
    results = pools(4).run(cases.trl_parity, "sft", *layout, str(tmp_path / "run"), record, **opts)
    parity.assert_faithful(results)
    _assert_metrics(results, ("aux_loss",))  # the model's own aux loss, over the global batch
    if layout == (2, 2) and not opts.get("lora"):  # the per-rank aux loss is another loss: the check sees it
        local = pools(4).run(cases.trl_parity, "sft", *layout, str(tmp_path / "local"), record, **opts,
                             aux_loss_scope="local")
        parity.record(local)
        assert all({"loss", "step0_grads"} <= set(parity.failed_checks(r)) for r in local), local[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_checkpoint_resumes_at_another_ep_degree(pools, tmp_path, lora):
    # HybridEP(SFTTrainer) checkpoints after every step (expert-sharded weights or PEFT's adapter directory, and the
    # optimizer state by expert id); resumed from step 1 at dp1×ep4, step 2 has the uninterrupted dp2×ep2 run's loss
    pool = pools(4)
    full = pool.run(cases.trl_resume, "sft", 2, 2, str(tmp_path / "run"), lora=lora)[0]["loss"]
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert (checkpoint / ("adapter_model.safetensors" if lora else "model.safetensors.index.json")).is_file()
    for r in pool.run(cases.trl_resume, "sft", 1, 4, str(tmp_path / "resume"), str(checkpoint), lora=lora):
        # the first entry is the checkpoint's own log history
        assert len(r["loss"]) == 2 and abs(r["loss"][1] - full[1]) <= parity.REL_TOL * full[1], (r, full)


def test_sft_lora_evaluates_at_a_smaller_ep_degree(pools, tmp_path):
    # HybridEP(SFTTrainer)(peft_config=..., eval_ep_degree=1) at dp2xep2, expert adapters non-zero: evaluating after
    # each step with every expert and its adapter factors on every rank gives the training layout's evaluation loss,
    # and training goes on as the run that never evaluated (same losses, same weights after, every slot parameter
    # back at 2 slots); the memory check counts every slot parameter the smaller layout adds
    pool = pools(4)
    plain = pool.run(cases.sft_lora_eval_layout, str(tmp_path / "plain"), None, False)
    small = pool.run(cases.sft_lora_eval_layout, str(tmp_path / "small"), 1, True)
    for a, b in zip(plain, small, strict=True):
        assert b["losses"] == a["losses"] and b["eval_after_training_layout"] == a["eval_after"], (a, b)
        assert len(b["eval_losses"]) == 2 and b["eval_losses"][-1] == b["eval_after"], b
        assert abs(b["eval_after"] - a["eval_after"]) <= parity.REL_TOL * a["eval_after"], (a, b)
        assert b["extra_bytes"] == b["held_extra"], b  # the memory check counts the adapter factors too
        assert b["layout"] == a["layout"] and all(ep == 2 and len(shapes) == 6 and {s[0] for s in shapes} == {2}
                                                  for ep, shapes in b["layout"]), b


def _assert_metrics(results: list[dict], keys: tuple[str, ...]) -> None:
    """The trainer's own logged metrics (gathered over the ranks by TRL) equal the single process's."""
    for r in results:
        for key in keys:
            assert r["metric_rels"][key] <= parity.REL_TOL, (key, r["metric_rels"], r["logged"])


def _assert_rewards(results: list[dict]) -> None:
    """DPO's implicit rewards ``β·(log π − log π_ref)`` are differences of sequence log-probabilities: their
    round-off is the log-probabilities' (``REL_TOL`` of them), not a fraction of the small difference."""
    import trl_cases as tc

    for r in results:
        mine, ref = r["logged"], r["reference_logged"]
        scale = max(abs(v) for key in ("logps/chosen", "logps/rejected") for v in ref[key])
        for key, terms in (("rewards/chosen", 2), ("rewards/rejected", 2), ("rewards/margins", 4)):
            diff = max(abs(a - b) for a, b in zip(mine[key], ref[key], strict=True))
            assert diff <= terms * parity.REL_TOL * tc.DPO_BETA * scale, (key, diff, mine[key], ref[key])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"dp{v[0]}xep{v[1]}")
@pytest.mark.parametrize("opts", [{"lora": True}, {"full_reference": True}], ids=["lora", "full-reference"])
def test_dpo_parity(pools, reference, tmp_path, layout, opts):
    # LoRA: the reference is the adapter-disabled policy (TRL's own choice with peft_config); full: a reference
    # model parallelized like the policy (experts sharded, no gradients). Loss, rewards and margins as one process.
    record = reference("dpo", **opts)
    results = pools(4).run(cases.trl_parity, "dpo", *layout, str(tmp_path / "run"), record, **opts)
    parity.assert_faithful(results)
    _assert_metrics(results, ("logps/chosen", "logps/rejected", "aux_loss"))
    _assert_rewards(results)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"dp{v[0]}xep{v[1]}")
def test_grpo_generates_under_ep_and_equals_one_process_on_its_completions(pools, tmp_path, layout):
    # transformers generation under EP, end to end: completions end at different steps on different ranks and the
    # ranks that are done keep stepping. The single process replays the same completions (TRL's rollout_func):
    # rewards, loss, gradients and updates as one process.
    import trl_cases as tc

    pool = pools(4)
    runs = pool.run(cases.grpo_generate, *layout, str(tmp_path / "run"))
    calls = len(runs[0]["completions"])
    global_batches = [[ids for r in runs for ids in r["completions"][call]] for call in range(calls)]
    assert any(len(set(lengths)) > 1 for lengths in zip(*runs[0]["longest_per_rank"], strict=True)), runs[0]
    record = str(tmp_path / "reference.pt")
    tc.reference("grpo", str(tmp_path / "reference"), 4, cases.trl.PER_RANK, record, completions=global_batches)
    results = pool.run(cases.grpo_compare, record)
    parity.assert_faithful(results)
    _assert_metrics(results, ("reward", "reward_std"))


def _single_process_model(**config):
    import trl_cases as tc

    import hf_hybrid_ep as hep

    return hep.parallelize(tc.model(), hep.HybridEPConfig(**config))


@pytest.mark.parametrize(("kind", "config", "args", "message"), [
    ("sft", {"aux_loss_coef": 0.01}, {}, r"aux_loss_coef / z_loss_coef .*SFTTrainer does not use"),
    ("grpo", {}, {"use_vllm": True}, r"use_vllm=True.*cannot sync from sharded experts"),
    ("grpo", {}, {"use_transformers_continuous_batching": True}, r"continuous batching .*\(synced_gpus\)"),
], ids=["engine-aux-loss", "vllm", "continuous-batching"])
def test_what_the_engine_cannot_follow_is_refused_before_the_trainer_is_built(tmp_path, kind, config, args, message):
    import trl_cases as tc

    import hf_hybrid_ep as hep
    from hf_hybrid_ep.integrations import HybridEP

    kwargs = tc.trainer_kwargs(kind, str(tmp_path), 4)  # GRPO's generation batch: a multiple of its group size
    for key, value in args.items():
        setattr(kwargs["args"], key, value)
    with pytest.raises(hep.HybridEPConfigError, match=message):
        HybridEP(tc.trainer_class(kind))(model=_single_process_model(**config), **kwargs)


def test_dpo_given_a_peft_model_without_a_reference_is_refused(tmp_path):
    # DPOTrainer adds a "ref" copy of the adapter after parallelize, which the engine's expert layout lacks
    import trl_cases as tc
    from peft import get_peft_model

    import hf_hybrid_ep as hep
    from hf_hybrid_ep.integrations import HybridEP

    model = hep.parallelize(get_peft_model(tc.model(), tc.peft_config()), hep.HybridEPConfig())
    with pytest.raises(hep.HybridEPConfigError, match=r"no ref_model adds a 'ref' copy of the adapter"):
        HybridEP(tc.trainer_class("dpo"))(model=model, **tc.trainer_kwargs("dpo", str(tmp_path), 2))


def test_hybrid_ep_makes_one_class_per_trainer_class():
    import trl
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    assert HybridEP(trl.SFTTrainer) is HybridEP(trl.SFTTrainer)
    assert HybridEP(trl.SFTTrainer).__mro__[1:3] == (HybridEP(trl.SFTTrainer).__mro__[1], trl.SFTTrainer)
    with pytest.raises(TypeError, match="already a hybrid-EP trainer"):
        HybridEP(HybridEP(Trainer))
    with pytest.raises(TypeError, match="transformers.Trainer or a subclass"):
        HybridEP(dict)


def test_grpo_routing_replay(pools, tmp_path):
    # routing_replay=True: the experts chosen while generating are replayed in the scoring and training forwards
    # (every logged step replayed some). Two iterations over each generation batch: the second trains weights one
    # update away from the sampling ones, where the router alone would move a share of the replayed choices.
    results = pools(4).run(cases.grpo_routing_replay, 2, 2, str(tmp_path), 2)
    for r in results:
        assert len(r["changed"]) == 2 and all(c is not None for c in r["changed"]), r
    assert max(r["changed"][1] for r in results) > 0.1, results


def test_routing_replay_is_for_grpo(tmp_path):
    import trl_cases as tc

    import hf_hybrid_ep as hep
    from hf_hybrid_ep.integrations import HybridEP

    with pytest.raises(hep.HybridEPConfigError, match="routing_replay=True .* is not a GRPOTrainer"):
        HybridEP(tc.trainer_class("sft"))(model=_single_process_model(), routing_replay=True,
                                          **tc.trainer_kwargs("sft", str(tmp_path), 2))


def test_take_over_draws_the_adapters_on_the_device_of_the_model(tmp_path):
    # HybridEP(TRL trainer)(peft_config=...) draws PEFT's adapters afresh after the trainer's construction: every
    # factor on the device of the parameters it adapts. The model stands on the meta device (in place of an
    # accelerator on this CPU-only host): a factor made on the CPU would show.
    import types

    import trl_cases as tc
    from peft import get_peft_model

    from hf_hybrid_ep.integrations.trl import take_over

    model = get_peft_model(_single_process_model(), tc.peft_config())  # what the trainer's construction does
    model.to("meta")
    take_over(types.SimpleNamespace(model=model, args=types.SimpleNamespace(seed=0)))
    lora = {name: p.device.type for name, p in model.named_parameters() if "lora_" in name}
    assert any("experts" in name for name in lora) and any("q_proj" in name for name in lora), sorted(lora)
    assert set(lora.values()) == {"meta"}, {name: d for name, d in lora.items() if d != "meta"}
