"""LoRA with PEFT under hybrid EP: adapters on dense modules replicated, adapters on the routed experts sharded
with them, base weights frozen; faithful to one process running PEFT's own code path; saved, loaded, merged
and pushed as ordinary PEFT adapters.

Real gloo process groups (the shared worker pools), tiny real transformers models, PEFT 0.21.2 itself as the
reference.
"""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest

LORA_FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]
# every dp × ep layout of world 4, and world 3 (six experts)
LORA_LAYOUTS = [(4, (4, 1), 4), (4, (2, 2), 4), (4, (1, 4), 4), (3, (3, 1), 6), (3, (1, 3), 6)]


@pytest.mark.parametrize(("world", "layout", "experts"), LORA_LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_lora_training_parity(pools, family, world, layout, experts):
    # Three AdamW steps of two accumulated micro-batches with clipping, on dense and expert adapters, equal
    # PEFT's ParamWrapper path in one process on the global batch: losses, global norm, every adapter gradient
    # and parameter. Base weights get no gradient, no bucket and no optimizer state.
    dp, ep = layout
    results = pools(world).run(cases.lora_parity, family, dp, ep, experts)
    parity.assert_faithful(results)
    for r in results:
        assert r["optimizer_state_only_adapters"] and r["base_grads"] == [], r
        assert r["expert_bucket_elements"] > 0


def test_lora_parity_with_per_layer_tables_and_replicas(pools):
    placement = {"model.layers.0.mlp.experts": [[0, 1, 2], [2, 3, 0]], "model.layers.1.mlp.experts": [[3, 0], [1, 2]]}
    parity.assert_faithful(pools(4).run(cases.lora_parity, "qwen3_moe", 2, 2, 4, placement=placement))


def test_lora_parity_with_zero1(pools):
    # the adapters' optimizer state sharded over the world (dense) and the EDP groups (experts)
    parity.assert_faithful(pools(4).run(cases.lora_parity, "gpt_oss", 2, 2, 4, optimizer_sharding="zero1"))


def test_disabled_and_switched_adapters_follow_peft(pools):
    # disable_adapter() (DPO's and GRPO's reference forward) and a second adapter on the same targets made
    # active by set_adapter (TRL's "ref" adapter), against PEFT in one process.
    for r in pools(2).run(cases.lora_forward, "gpt_oss", 2, 4):
        assert max(r["default"], r["disabled"], r["second"]) <= parity.REL_TOL, r
        assert r["second_differs"] > 1e-3, r  # the second adapter really changes the output


def test_save_pretrained_is_an_ordinary_peft_adapter_and_merges_under_ep(pools, tmp_path):
    # Every rank calls save_pretrained; vanilla PeftModel.from_pretrained loads the directory in one process
    # (PEFT's full-E layout) with the parallelized model's logits. merge_and_unload under EP gives a
    # parallelized model that saves an expert-sharded hybrid-EP checkpoint, loaded back vanilla and rank-locally.
    for family in ("qwen3_moe", "gpt_oss"):
        for r in pools(2).run(cases.lora_save_merge, family, 1, 2, 4, str(tmp_path / family)):
            assert r["shapes"]["base_model.model.model.layers.0.mlp.experts.lora_A.weight"][0] == 4 * 4, r["shapes"]
            assert r["shapes"]["base_model.model.model.layers.0.mlp.experts.lora_B.weight"][1] == 4 * 4, r["shapes"]
            for key in ("saved", "merged", "merged_vanilla_load", "merged_rank_local_load"):
                assert r[key] <= parity.REL_TOL, (family, key, r[key])
            assert not r["merged_type"].startswith("Peft") and r["full_state_dict_equal"]


def test_rank_local_loading_of_an_adapter_and_fresh_adapters(pools, tmp_path):
    # adapter=PATH: each rank's copy has every other rank's expert rows/columns NaN, so correct logits prove it
    # read only its own. peft_config=...: fresh adapters change nothing yet, their dense adapters agree on every
    # rank, and the expert adapters are drawn per expert: the same at dp 1 × ep 2 and dp 2 × ep 1.
    from safetensors.torch import load_file

    for dp, ep in ((1, 2), (2, 1)):
        for r in pools(2).run(cases.lora_from_pretrained, "qwen3_moe", dp, ep, 4, str(tmp_path / f"{dp}x{ep}")):
            assert r["adapter"] <= parity.REL_TOL and r["fresh_is_base"] <= parity.REL_TOL, r
            assert r["trainable_loaded"] == 0 and r["trainable_fresh"] > 0, r
    a = load_file(tmp_path / "1x2" / "fresh-1x2" / "adapter_model.safetensors")
    b = load_file(tmp_path / "2x1" / "fresh-2x1" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert any(k.endswith("experts.lora_A.weight") and a[k].abs().sum() > 0 for k in a)


def test_an_adapter_from_the_hub_loads_rank_locally(pools, tmp_path):
    # real HTTP to the loopback Hub stub: the adapter's two files fetched by every rank, logits as PEFT's
    import torch
    from hub_stub import HubStub
    from tiny_models import build_tiny_model

    torch.manual_seed(0)
    build_tiny_model("qwen3_moe", num_experts=4).save_pretrained(tmp_path / "base")
    _, ref = cases.lora_pair("qwen3_moe", 4)
    ref.save_pretrained(tmp_path / "adapter")
    hub = HubStub()
    try:
        hub.served["org/tiny-lora"] = {p.name: p.read_bytes() for p in (tmp_path / "adapter").iterdir()}
        results = pools(2).run(cases.lora_hub_adapter, hub.url, "org/tiny-lora", str(tmp_path / "cache"),
                               str(tmp_path / "base"), 2)
    finally:
        hub.close()
    assert all(r["logits_rel"] <= parity.REL_TOL for r in results), results
    assert sorted(set(hub.requested)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_the_trainer_refuses_lora_on_the_experts_alone(pools, tmp_path):
    for r in pools(2).run(cases.trainer_refuses_expert_only_lora, str(tmp_path)):
        assert "nothing dense is trained" in r["message"] and "target_modules" in r["message"], r


@pytest.mark.slow
def test_trainer_trains_a_peft_model_and_resumes_at_another_ep_degree(pools, tmp_path):
    # HybridEP(Trainer) on a parallelized PeftModel equals the stock Trainer on the same PeftModel in one process;
    # its checkpoints hold only the adapters (PEFT's files) and their optimizer state, and resume at another EP
    # degree with the losses of the uninterrupted run.
    import trainer_cases as tc

    want = tc.reference_lora_losses(str(tmp_path / "ref"), 2, cases.lora_config(tc.MODEL_TYPE))
    pool = pools(2)
    full = pool.run(cases.trainer_lora_run, 1, 2, str(tmp_path / "run"), 6, 3)
    for r in full:
        assert max(abs(a - b) / b for a, b in zip(r["losses"], want, strict=True)) <= parity.REL_TOL, (r, want)
        assert r["optimizer_names"] and all(".lora_" in n for n in r["optimizer_names"]), r
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors"} <= {p.name for p in checkpoint.iterdir()}
    assert not list(checkpoint.glob("model*.safetensors"))
    for r in pool.run(cases.trainer_lora_run, 2, 1, str(tmp_path / "resume"), 6, None, str(checkpoint)):
        assert max(abs(a - b) / b for a, b in zip(r["losses"][-3:], full[0]["losses"][-3:], strict=True)) <= parity.REL_TOL


def _peft_model(**kwargs):
    import torch
    from peft import get_peft_model
    from tiny_models import build_tiny_model

    torch.manual_seed(0)
    return get_peft_model(build_tiny_model("qwen3_moe", num_experts=4), cases.lora_config("qwen3_moe", **kwargs))


@pytest.mark.parametrize(("setting", "message"), [
    ({"rebalance_every": 1}, r"online rebalancing .* not their LoRA adapters"),
    ({"shadow_experts": True}, r"shadow_experts copies expert weights .* not their LoRA adapters"),
    ({"dense_sharding": "fsdp"}, r"dense_sharding='fsdp' is not supported for PEFT models"),
], ids=["rebalancing", "shadowing", "fsdp"])
def test_settings_the_expert_adapters_cannot_follow_are_refused(setting, message):
    import hf_hybrid_ep as hep

    model = _peft_model()
    before = {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(hep.HybridEPConfigError, match=message):
        hep.parallelize(model, hep.HybridEPConfig(**setting))
    assert {n: p.shape for n, p in model.named_parameters()} == before  # nothing was changed


@pytest.mark.parametrize("variant", ["dropout", "dora", "bias", "bias_parameter"])
def test_expert_adapters_the_engine_cannot_compute_are_refused(variant):
    # PEFT refuses these on experts itself at get_peft_model; a wrapper changed afterwards is refused by name.
    import torch
    from peft import get_peft_model
    from tiny_models import build_tiny_model

    import hf_hybrid_ep as hep

    if variant == "bias_parameter":
        torch.manual_seed(0)
        model = get_peft_model(build_tiny_model("gpt_oss", num_experts=4),
                               cases.lora_config("gpt_oss", target_parameters=["mlp.experts.gate_up_proj_bias"]))
        message = r"LoRA on .*layers.0.mlp.experts.*gate_up_proj_bias: only the experts' weight matrices"
    else:
        model = _peft_model()
        wrapper = model.base_model.model.model.layers[0].mlp.experts
        if variant == "dropout":
            wrapper.lora_dropout["default"] = torch.nn.Dropout(0.1)
        elif variant == "dora":
            wrapper.use_dora["default"] = True
        else:
            wrapper.lora_B["default"].bias = torch.nn.Parameter(torch.zeros(64))
        message = {"dropout": "has lora_dropout", "dora": r"LoRA variant \(DoRA\)", "bias": "has lora_bias"}[variant]
    with pytest.raises(hep.HybridEPConfigError, match=message):
        hep.parallelize(model)


def test_an_adapter_added_after_parallelize_is_refused_at_its_first_forward():
    import torch

    import hf_hybrid_ep as hep

    model = _peft_model()
    hep.parallelize(model)
    model.add_adapter("late", cases.lora_config("qwen3_moe"))
    model.set_adapter("late")
    with pytest.raises(hep.HybridEPConfigError, match="'late' on .* was added after parallelize"):
        model(input_ids=torch.tensor([[3, 4, 5]]))


def test_the_peft_section_and_the_flags_make_the_lora_config(tmp_path):
    from hf_hybrid_ep import HybridEPConfigError
    from hf_hybrid_ep.integrations import HybridEPPlugin

    path = tmp_path / "ep.yaml"
    path.write_text("hybrid_ep:\n  ep_degree: 2\n  peft: {r: 8, lora_alpha: 16, target_parameters: []}\n")
    config = HybridEPPlugin.from_sources(path).lora_config({"r": 4, "lora_alpha": None})
    assert (config.r, config.lora_alpha, config.task_type) == (4, 16, "CAUSAL_LM")
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"} and not config.target_parameters
    assert HybridEPPlugin().lora_config({"r": None}) is None  # no LoRA asked for
    with pytest.raises(HybridEPConfigError, match="lora_rank"):
        HybridEPPlugin(peft={"lora_rank": 4}).lora_config()
    path.write_text("hybrid_ep:\n  peft: 8\n")
    with pytest.raises(HybridEPConfigError, match="key 'peft' must be a mapping"):
        HybridEPPlugin.from_sources(path)


@pytest.mark.parametrize("optimizer_sharding", ["none", "zero1"])
def test_measured_lora_bytes_equal_the_planner(pools, optimizer_sharding):
    # plan --lora-r: frozen bases hold weights only; gradients and optimizer state (and their ZeRO-1 shards)
    # are the adapters' — as a parallelized PeftModel measures them after one AdamW step.
    from hf_hybrid_ep.memory import measure

    for r in pools(4).run(measure, "qwen3_moe", 4, 2, 2, optimizer_sharding, "replicate", lora_r=4):
        measured = {k: r[k] for k in ("weight_bytes", "grad_bytes", "optimizer_bytes")}
        assert r["optimizer_state_measured"] and measured == r["planned"], (r["rank"], measured, r["planned"])
        assert 0 < r["grad_bytes"] < r["weight_bytes"] / 10


def test_plan_with_lora_counts_only_the_adapters_as_trained():
    from hf_hybrid_ep.planning.planner import plan

    full = plan("Qwen/Qwen3-30B-A3B", 16, 80, "gpus_per_node=8")
    lora = plan("Qwen/Qwen3-30B-A3B", 16, 80, "gpus_per_node=8", lora_r=16)
    m = lora["model"]
    assert m["lora_r"] == 16 and m["adapter_dense_params"] > 0 and m["adapter_expert_params"] > 0
    for a, b in zip(lora["layouts"], full["layouts"], strict=True):
        experts = m["adapter_expert_params"] // a["ep"]
        assert a["params_per_gpu"] == b["params_per_gpu"] + m["adapter_dense_params"] + experts
        assert a["grad_bytes"] == 2 * (m["adapter_dense_params"] + experts)  # bf16 gradients of the adapters only
        assert a["optimizer_bytes"] == 12 * (m["adapter_dense_params"] + experts)
        assert a["allreduce_bytes_per_step"] < b["allreduce_bytes_per_step"] / 10


def test_the_lora_benchmark_compares_equal_outputs_and_gradients():
    # bench_lora --block's path (one round at the training benchmark's shape), so it cannot rot: our block and
    # PEFT's give the same output and adapter gradients before anything is timed.
    from benchmarks.bench_lora import block_benchmark

    report = block_benchmark(r=4, rounds=1, iters=1)
    assert report["output_rel"] <= parity.REL_TOL and report["max_grad_rel"] <= parity.REL_TOL, report
    assert set(report["ms"]) == {"peft", "hybrid_ep", "no_adapter"}
