"""The step-time model of ``hf-hybrid-ep plan``: every term against a hand computation for the two
reference runs (Qwen3-30B-A3B on 2 × 8 H100, Mixtral-8x7B on 2 × 4), the CLI output, bad inputs, and
``--calibrate``."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
from transformers import MixtralConfig

from hf_hybrid_ep import HybridEPConfigError
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.planning.planner import ModelCounts, count_parameters, load_config
from hf_hybrid_ep.planning.step_time import calibrate_compute, compare, predict_step_time

PEAK = 989e12  # H100 SXM dense bf16, FLOP/s
NVLINK, NIC = 450e9, 50e9  # bytes/s per GPU: NVLink 4 one way; one 400 Gbit/s NIC per GPU
TOKENS = 4 * 2**20  # 4 Mi tokens per step = 1024 sequences of 4096 (the rough estimates read "4 M" as 4,000,000: see below)
SEQ = 4096
QWEN_TOPO = "gpus_per_node=8,nvlink_gbps=450,network_gbps=50"
MIXTRAL_TOPO = "gpus_per_node=4,nvlink_gbps=450,network_gbps=50"
CALIBRATION_SLACK_S = 2.0  # beyond --calibrate-seconds (a deadline the user sets), for a loaded machine


@functools.cache
def counts(model: str) -> ModelCounts:
    return count_parameters(load_config(model))


def _qwen() -> dict:
    """Qwen3-30B-A3B from its shipped config.json, parameters counted by hand."""
    H, L, E, k, I, V, heads, head_dim, kv = 2048, 48, 128, 8, 768, 151936, 32, 128, 4  # noqa: E741
    attention = H * heads * head_dim + 2 * H * kv * head_dim + heads * head_dim * H + 2 * head_dim  # q, k, v, o, q/k norm
    dense = 2 * V * H + L * (attention + 2 * H + H * E) + H  # embeddings + lm_head, layers (+ norms, router), final norm
    return {"H": H, "L": L, "E": E, "k": k, "I": I, "lookup": V * H, "d_attn": heads * head_dim,
            "dense": dense, "experts": L * E * 3 * H * I}


def _mixtral() -> dict:
    H, L, E, k, I, V, heads, kv = 4096, 32, 8, 2, 14336, 32000, 32, 8  # noqa: E741
    head_dim = H // heads
    attention = 2 * H * heads * head_dim + 2 * H * kv * head_dim
    dense = 2 * V * H + L * (attention + 2 * H + H * E) + H
    return {"H": H, "L": L, "E": E, "k": k, "I": I, "lookup": V * H, "d_attn": heads * head_dim,
            "dense": dense, "experts": L * E * 3 * H * I}


def _hand(c: dict, dp: int, ep: int, gpus_per_node: int, efficiency: float) -> dict:
    """Every term for dp × ep (2 nodes, bf16 AdamW, no sharding, no checkpointing, micro-batch 1 × 4096)."""
    world = dp * ep
    T = TOKENS // world
    flops = 6 * (c["dense"] - c["lookup"] + c["k"] / c["E"] * c["experts"]) + 12 * c["L"] * SEQ * c["d_attn"]
    compute = T * flops / (PEAK * efficiency)
    micro_batches = T // SEQ
    routed = c["k"] * T * c["H"] * 2 * c["L"] * 4  # bf16 rows, 4 exchanges per layer
    on_node = min(ep, gpus_per_node)  # ranks of the EP group on one node
    a2a_intra = routed * (on_node - 1) / ep
    a2a_inter = routed * (ep - on_node) / ep
    a2a = max(a2a_intra / NVLINK, a2a_inter / NIC)
    D = 2 * c["dense"]  # dense gradient bytes: all-reduce over 2 nodes, gpus_per_node ranks on each
    dense_intra = 2 * (gpus_per_node - 1) / gpus_per_node * D
    dense_inter = 2 * (2 - 1) / 2 * D / gpus_per_node
    X = 2 * c["experts"] / ep  # this rank's expert gradient bytes; its EDP group has one rank per node
    expert_inter = 2 * (dp - 1) / dp * X if dp > 1 else 0.0
    reduce = dense_intra / NVLINK + (dense_inter + expert_inter) / NIC
    window = compute * 2 / 3 / micro_batches  # backward of the last micro-batch
    optimizer = (c["dense"] + c["experts"] / ep) * (2 * (2 + 12) + 2) / 3350e9
    # the unfused per-pair gathers (dispatcher "torch"): per token and layer k·(15h + 40) + 3h bytes read and
    # written, h = H · 2 (docs/planner.md), at the same 3350 GB/s
    h = c["H"] * 2
    gathers = T * c["L"] * (c["k"] * (15 * h + 40) + 3 * h) / 3350e9
    step = compute + gathers + a2a + max(0.0, reduce - window) + optimizer
    return {"T": T, "flops": flops, "compute": compute, "forward": compute / 3, "a2a_intra": a2a_intra,
            "a2a_inter": a2a_inter, "a2a": a2a, "dense_intra": dense_intra, "dense_inter": dense_inter,
            "expert_inter": expert_inter, "reduce": reduce, "window": window, "hidden": min(reduce, window),
            "optimizer": optimizer, "gathers": gathers, "step": step, "samples_per_s": TOKENS / SEQ / step, "cross_a2a_s": a2a_inter / NIC}


REFERENCES = {
    # model, topology, GPUs per node, (hybrid dp, ep), pure EP ep, rough estimates: T*, T/T*, r_x at 100 %, at 40 %
    "fine-grained": ("Qwen/Qwen3-30B-A3B", QWEN_TOPO, 8, (2, 8), 16, _qwen, (2.3e3, 110, 3.2, 1.3)),
    "coarse": ("mistralai/Mixtral-8x7B-v0.1", MIXTRAL_TOPO, 4, (2, 4), 8, _mixtral, (21.5e3, 23, 0.26, 0.10)),
}


@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.parametrize("efficiency", [1.0, 0.4])
def test_reference_runs_match_a_hand_computation(name: str, efficiency: float) -> None:
    model, topo, gpn, (dp, ep_h), ep_pure, spec, estimates = REFERENCES[name]
    c, m = spec(), counts(model)
    assert (m.dense_params, m.expert_params, m.embedding_lookup_params) == (c["dense"], c["experts"], c["lookup"])
    assert (m.hidden, m.num_experts, m.top_k, m.expert_width, m.qk_dim, m.v_dim) == (
        c["H"], c["E"], c["k"], c["I"], c["d_attn"], c["d_attn"])
    approx = functools.partial(pytest.approx, rel=1e-9, abs=1e-12)
    steps = {}
    for dp_, ep_ in ((dp, ep_h), (1, ep_pure)):
        h = _hand(c, dp_, ep_, gpn, efficiency)
        s = predict_step_time(m, dp_, ep_, topo, tokens_per_step=TOKENS, micro_batch=1, seq_len=SEQ,
                              device_flops=PEAK, efficiency=efficiency)
        steps[dp_] = s
        assert (s.tokens_per_rank, s.micro_batches, s.samples_per_step) == (h["T"], h["T"] // SEQ, TOKENS // SEQ)
        assert s.flops_per_token == approx(h["flops"]) and s.recompute_s == 0
        assert (s.compute_s, s.forward_s, s.backward_s) == (approx(h["compute"]), approx(h["forward"]),
                                                            approx(2 * h["forward"]))
        assert s.a2a_bytes == {"intra_node": approx(h["a2a_intra"]), "inter_node": approx(h["a2a_inter"]),
                               "cross_rack": 0}
        assert (s.a2a_s, s.a2a_exposed_s) == (approx(h["a2a"]), approx(h["a2a"]))
        assert s.dense_grad_bytes == {"intra_node": approx(h["dense_intra"]), "inter_node": approx(h["dense_inter"]),
                                      "cross_rack": 0}
        assert s.expert_grad_bytes == {"intra_node": 0, "inter_node": approx(h["expert_inter"]), "cross_rack": 0}
        assert (s.grad_reduce_s, s.grad_hide_window_s, s.grad_reduce_hidden_s) == (
            approx(h["reduce"]), approx(h["window"]), approx(h["hidden"]))
        assert s.grad_reduce_exposed_s == approx(h["reduce"] - h["hidden"])
        assert (s.zero1_gather_s, s.fsdp_gather_s) == (0, 0)
        assert s.dispatcher == "torch" and s.exchange_memory_s == approx(h["gathers"])
        assert (s.optimizer_s, s.step_s, s.samples_per_s) == (approx(h["optimizer"]), approx(h["step"]),
                                                              approx(h["samples_per_s"]))
    result = compare(steps[dp], steps[1])
    # The crossover's closed form, term by term: T* = (E/ep_h) · 3I · b_g · 2(d−1)/d ÷ (4 · k · b_a · f_x), d = dp, f_x = 1/2
    t_star = (c["E"] / ep_h) * 3 * c["I"] * 2 * (2 * (dp - 1) / dp) / (4 * c["k"] * 2 * 0.5)
    T = TOKENS // ep_pure
    pure = _hand(c, 1, ep_pure, gpn, efficiency)
    r_x = pure["cross_a2a_s"] / pure["compute"]
    assert (result["T"], result["T_star"], result["T_over_T_star"]) == (T, approx(t_star), approx(T / t_star))
    assert result["r_x"] == approx(r_x)
    assert result["ratio"] == approx(pure["step"] / _hand(c, dp, ep_h, gpn, efficiency)["step"])  # samples/s
    # Against rough estimates by hand (±30 %). They differ from these verified values in two ways:
    # * they take 4 M as 4,000,000 tokens (T/T* = 108.5 and 23.3); this test uses 4 Mi = 2^22 (a whole
    #   number of 4096-token sequences on every rank), so T/T* is 113.8 (fine-grained) and 24.4 (coarse);
    # * its r_x counts 6 · active parameters only. This model drops the input-embedding lookup (no FLOPs)
    #   and adds attention scores and values (12 · L · S · d_attn per token, S = 4096): for Qwen3-30B-A3B
    #   9.66 GFLOP/token on top of 18.25, so r_x = 2.23 at 100 % and 0.89 at 40 % instead of ≈ 3.2 and 1.3
    #   (outside ±30 %); without attention it is 3.41 / 1.36 (3.09 / 1.24 with the lookup counted as the
    #   estimates do). Mixtral: r_x = 0.250 / 0.100 (0.271 / 0.108 without attention), inside ±30 % either way.
    # Predicted hybrid / pure EP samples/s (both layouts as if they fit, no sharding, the unfused per-pair
    # gathers: 1.89 s per step at fine-grained, 1.35 s at coarse, the same in both layouts): fine-grained 2.04 at
    # 100 %, 1.56 at 40 %; coarse 1.19 and 1.08.
    est_t_star, est_over, est_r100, est_r40 = estimates
    assert result["T_star"] == pytest.approx(est_t_star, rel=0.3)
    assert result["T_over_T_star"] == pytest.approx(est_over, rel=0.3)
    matmul_only = pure["cross_a2a_s"] / (T * steps[1].matmul_flops_per_token / (PEAK * efficiency))
    assert matmul_only == pytest.approx(est_r100 if efficiency == 1 else est_r40, rel=0.3)
    verified = {("fine-grained", 1.0): (2.229, 2.043), ("fine-grained", 0.4): (0.8916, 1.561),
                ("coarse", 1.0): (0.2501, 1.187), ("coarse", 0.4): (0.1000, 1.0805)}[name, efficiency]
    assert (result["r_x"], result["ratio"]) == (pytest.approx(verified[0], rel=1e-3), pytest.approx(verified[1], rel=1e-3))


def test_checkpointing_and_zero1_terms() -> None:
    """Qwen3 dp 2 × ep 8 with activation checkpointing and ZeRO-1: the recompute, 6 exchanges, halved
    gradient reduction (reduce-scatter), the parameter all-gathers and the optimizer shard."""
    c, m = _qwen(), counts("Qwen/Qwen3-30B-A3B")
    s = predict_step_time(m, 2, 8, QWEN_TOPO, tokens_per_step=TOKENS, seq_len=SEQ, activation_checkpointing=True,
                          device_flops=PEAK, efficiency=0.4, optimizer_sharding="zero1")
    plain = _hand(c, 2, 8, 8, 0.4)
    approx = functools.partial(pytest.approx, rel=1e-9, abs=1e-12)
    assert s.recompute_s == approx(plain["compute"] / 3) and s.compute_s == approx(plain["compute"] * 4 / 3)
    assert s.a2a_bytes["intra_node"] == approx(plain["a2a_intra"] * 6 / 4)
    assert s.dense_grad_bytes["intra_node"] == approx(plain["dense_intra"] / 2)
    assert s.expert_grad_bytes["inter_node"] == approx(plain["expert_inter"] / 2)
    assert s.zero1_dense_gather_bytes == s.dense_grad_bytes and s.zero1_expert_gather_bytes == s.expert_grad_bytes
    gather = (plain["dense_intra"] / NVLINK + (plain["dense_inter"] + plain["expert_inter"]) / NIC) / 2
    assert s.zero1_gather_s == approx(gather)
    assert s.grad_hide_window_s == approx((2 / 3 + 1 / 3) * plain["compute"] / (TOKENS // 16 // SEQ))
    assert s.optimizer_params == math.ceil(c["dense"] / 16) + c["experts"] // 8 // 2
    # the gathers' forward runs twice with checkpointing: k·(5h + 16) + h bytes forward, k·(10h + 24) + 2h backward
    k, h = c["k"], c["H"] * 2
    gathers = (TOKENS // 16) * c["L"] * (2 * (k * (5 * h + 16) + h) + k * (10 * h + 24) + 2 * h) / 3350e9
    assert s.exchange_memory_s == approx(gathers)
    assert s.step_s == approx(s.compute_s + gathers + s.a2a_s + s.grad_reduce_exposed_s + gather + s.optimizer_s)
    # FSDP2: the dense weights are gathered for forward and backward of each of the 64 micro-batches
    f = predict_step_time(m, 2, 8, QWEN_TOPO, tokens_per_step=TOKENS, seq_len=SEQ, device_flops=PEAK,
                          dense_sharding="fsdp")
    assert f.fsdp_gather_bytes["inter_node"] == approx(2 * 64 * plain["dense_inter"] / 2)
    assert f.dense_grad_bytes["inter_node"] == approx(plain["dense_inter"] / 2)


def test_tiny_model_on_an_emulated_two_node_fabric() -> None:
    """The function works for a tiny config and a slow link (the benchmark's use): 2 nodes of 2 ranks, 1 Gbit/s."""
    tiny = count_parameters(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2, tie_word_embeddings=False))
    topo = "gpus_per_node=2,nvlink_gbps=5,network_gbps=0.125"
    s = predict_step_time(tiny, 1, 4, topo, tokens_per_step=4 * 2 * 256, micro_batch=2, seq_len=256,
                          device_flops=50e9, efficiency=1.0, memory_gbps=10, recipe="fp32-adamw")
    routed = 2 * 512 * 64 * 4 * 2 * 4  # k · T · H · fp32 · layers · exchanges
    assert s.a2a_bytes == {"intra_node": routed / 4, "inter_node": routed / 2, "cross_rack": 0}
    assert s.a2a_s == pytest.approx(routed / 2 / 0.125e9, rel=1e-12) and s.micro_batches == 1
    assert s.samples_per_s == pytest.approx(8 / s.step_s, rel=1e-12)


# the reference runs' T* and hybrid / pure-EP ratio are defined for the dispatcher that sends one row per
# (token, expert): --dispatcher torch (the default, auto, models the hierarchical one where EP spans nodes)
PLAN = ["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "16", "--gpu-memory-gib", "80", "--topology", QWEN_TOPO,
        "--tokens-per-step", str(TOKENS), "--device-tflops", "989", "--efficiency", "0.4", "--optimizer-sharding", "zero1",
        "--dispatcher", "torch"]


def test_plan_prints_step_time_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(PLAN + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    layouts = {(p["dp"], p["ep"]): p for p in result["layouts"]}
    m = counts("Qwen/Qwen3-30B-A3B")
    for (dp, ep), p in layouts.items():
        ckpt = not p["fits"] and p["fits_with_checkpointing"]
        expected = predict_step_time(m, dp, ep, QWEN_TOPO, tokens_per_step=TOKENS, seq_len=SEQ, device_flops=PEAK,
                                     efficiency=0.4, optimizer_sharding="zero1", activation_checkpointing=ckpt)
        assert p["step_time"]["step_s"] == pytest.approx(expected.step_s, rel=1e-12)
        for key in ("compute_s", "forward_s", "backward_s", "a2a_s_by_level", "grad_reduce_hidden_s",
                    "grad_reduce_exposed_s", "zero1_gather_s", "optimizer_s", "samples_per_s", "tokens_per_s"):
            assert key in p["step_time"]
    fitting = [p for p in result["layouts"] if p["fits_with_checkpointing"]]
    best = min(fitting, key=lambda p: p["step_time"]["step_s"])
    assert result["recommended"]["dp"] == best["dp"] and result["recommended"]["ep"] == best["ep"]
    assert result["step_time_model"]["links"]["source"] == "topology spec"
    assert result["step_time_model"]["sources"] == {"device_flops": "given", "efficiency": "given",
                                                    "memory_gbps": "default"}
    cmp = result["hybrid_vs_pure_ep"]
    hybrid = layouts[(cmp["hybrid"]["dp"], cmp["hybrid"]["ep"])]
    assert cmp["pure_ep"]["ep"] == 16 and cmp["hybrid"]["dp"] > 1 and cmp["hybrid"]["ep"] > 1
    assert cmp["ratio"] == pytest.approx(hybrid["step_time"]["samples_per_s"] /
                                         layouts[(1, 16)]["step_time"]["samples_per_s"], rel=1e-12)
    assert cmp["T_star"] == pytest.approx(2304, rel=1e-9) and cmp["T"] == 262144

    assert cli(PLAN) == 0
    text = capsys.readouterr().out
    assert "| step s | samples/s |" in text
    assert "efficiency 0.4" in text and "links from the topology spec (intra-node 450, inter-node 50" in text
    assert f"{cmp['ratio']:.3g} × samples/s predicted" in text and "T/T* = 113.8" in text
    assert f"r_x = {cmp['r_x']:.3g}" in text and "recommended: dp " in text


@pytest.mark.parametrize("flags, names", [
    (["--tokens-per-step", "1000000"], ["--tokens-per-step 1000000", "16 × 1 × 4096 = 65536"]),
    (["--tokens-per-step", "0"], ["--tokens-per-step 0"]),
    (["--efficiency", "0"], ["--efficiency", "got 0.0"]),
    (["--efficiency", "1.5"], ["--efficiency", "got 1.5"]),
    (["--device-tflops", "-1"], ["--device-tflops", "got -1.0"]),
    (["--memory-gbps", "0"], ["--memory-gbps", "got 0.0"]),
    (["--calibrate", "--efficiency", "0.5"], ["--calibrate", "--efficiency 0.5"]),
    (["--calibrate", "--calibrate-seconds", "60"], ["--calibrate-seconds", "got 60.0"]),
])
def test_bad_step_time_flags_are_refused_before_work(flags: list[str], names: list[str],
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_hybrid_ep.planning.planner as planner
    import hf_hybrid_ep.planning.step_time as step_time

    work: list[str] = []  # refused before the model is looked up (the plan) or anything is measured
    monkeypatch.setattr(planner, "plan", lambda *a, **k: work.append("plan"))
    monkeypatch.setattr(step_time, "calibrate_compute", lambda *a, **k: work.append("calibrate"))
    argv = ["plan", "--model", "no/such-model", "--gpus", "16", "--gpu-memory-gib", "80"] + flags
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-hybrid-ep plan: error: ") and "Traceback" not in err
    for name in names:
        assert name in err, (name, err)
    assert work == []


def test_bad_step_time_arguments_name_the_value() -> None:
    m = counts("mistralai/Mixtral-8x7B-v0.1")
    good = {"tokens_per_step": 8 * 4096, "seq_len": 4096}
    for bad, name in [({"tokens_per_step": 8 * 4096 + 1}, "tokens_per_step=32769"), ({"efficiency": 0.0}, "efficiency"),
                      ({"device_flops": float("nan")}, "device FLOP/s"), ({"memory_gbps": -3.0}, "-3.0"),
                      ({"optimizer_sharding": "zero3"}, "'zero3'"), ({"dispatcher": "hierarchical"}, "'hierarchical'")]:
        with pytest.raises(HybridEPConfigError, match=name):
            predict_step_time(m, 2, 4, MIXTRAL_TOPO, **{**good, **bad})
    with pytest.raises(HybridEPConfigError, match="ep=3"):
        predict_step_time(m, 1, 3, None, tokens_per_step=3 * 4096, seq_len=4096)


def test_calibrate_is_short_and_says_links_come_from_the_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --calibrate-seconds is a deadline the user sets: the calibration stops at it. Measured 0.88-1.01 s for a 1 s
    # budget at a load average of 20 on 2 cores; a budget ignored runs passes of n = 2048 (tens of seconds each)
    c = calibrate_compute(budget_s=1.0)
    assert c.seconds <= 1.0 + CALIBRATION_SLACK_S and c.flops_per_s > 0 and c.repeats >= 1
    model = tmp_path / "config.json"
    model.write_text(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2).to_json_string())
    assert cli(["plan", "--model", str(model), "--gpus", "4", "--gpu-memory-gib", "1", "--seq-len", "64",
                "--topology", "gpus_per_node=2", "--calibrate", "--calibrate-seconds", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    model_ = result["step_time_model"]
    assert model_["sources"]["device_flops"] == "calibrated" and model_["efficiency"] == 1.0
    assert model_["device_flops"] == model_["calibration"]["flops_per_s"] > 0
    assert model_["calibration"]["seconds"] <= 1.0 + CALIBRATION_SLACK_S
    assert model_["calibration"]["links"] == "from the topology spec, not measured: not inside a launched world"
    from hf_hybrid_ep.planning.planner import format_plan

    assert "measured on this machine (--calibrate" in format_plan(result)
    assert "links from the topology spec, not measured: not inside a launched world (intra-node 300" in \
        format_plan(result)


def test_deduplicated_dispatcher_terms_match_a_hand_computation(capsys: pytest.CaptureFixture[str]) -> None:
    # Qwen3-30B-A3B, pure EP 16 over 2 nodes of 8: a node holds 64 of the 128 experts, a rank 8, so a token's 8
    # experts miss a node with probability C(64, 8)/C(128, 8) and a rank with C(120, 8)/C(128, 8); one row per
    # token and other node across, one per token and rank (but the relay's own) inside, instead of one per pair
    m = counts("Qwen/Qwen3-30B-A3B")
    T, H, L, k, b = TOKENS // 16, m.hidden, m.moe_layers, m.top_k, 2
    node = 1 - math.comb(64, 8) / math.comb(128, 8)
    rank = 1 - math.comb(120, 8) / math.comb(128, 8)
    row = L * (4 * H * b + k * ((b + 2) + b))  # activations in 4 exchanges; weights and keys, weight gradients
    s = predict_step_time(m, 1, 16, QWEN_TOPO, tokens_per_step=TOKENS, seq_len=SEQ, device_flops=PEAK,
                          efficiency=0.4, dispatcher="dedup")
    assert s.dispatcher == "dedup"
    assert s.a2a_bytes["inter_node"] == pytest.approx(node * T * row, rel=1e-12)
    assert s.a2a_bytes["intra_node"] == pytest.approx(rank * T * row * (16 - 2), rel=1e-12)
    assert s.a2a_s == pytest.approx(s.a2a_bytes["intra_node"] / NVLINK + s.a2a_bytes["inter_node"] / NIC, rel=1e-12)
    plain = predict_step_time(m, 1, 16, QWEN_TOPO, tokens_per_step=TOKENS, seq_len=SEQ, device_flops=PEAK,
                              efficiency=0.4)
    assert plain.dispatcher == "torch" and plain.a2a_bytes["inter_node"] == pytest.approx(k * T * H * b * L * 4 / 2)
    assert s.a2a_bytes["inter_node"] / plain.a2a_bytes["inter_node"] == pytest.approx(0.25, abs=0.002)
    # EP 8 inside a node with 16 experts per rank and top-8: one row per token and other rank
    runs = {d: predict_step_time(m, 2, 8, QWEN_TOPO, tokens_per_step=TOKENS, seq_len=SEQ, dispatcher=d)
            for d in ("triton", "dedup", "auto")}
    one_rank = 1 - math.comb(112, 8) / math.comb(128, 8)
    assert runs["dedup"].a2a_bytes["inter_node"] == 0
    assert runs["dedup"].a2a_bytes["intra_node"] == pytest.approx(one_rank * (TOKENS // 16) * row * 7, rel=1e-12)
    # auto models the faster of the two: the deduplicated rows save a third of the NVLink bytes, but their gathers
    # move 10x the fused kernels' bytes in memory (docs/planner.md)
    assert runs["dedup"].a2a_s < runs["triton"].a2a_s
    assert runs["dedup"].exchange_memory_s > 10 * runs["triton"].exchange_memory_s
    assert runs["auto"].dispatcher == "triton" and runs["auto"].step_s == runs["triton"].step_s < runs["dedup"].step_s
    # pure EP 16 over two nodes of 100 Gbit/s NICs: the cross-node saving outweighs the gathers
    slow = "gpus_per_node=8,nvlink_gbps=450,network_gbps=12.5"
    across = {d: predict_step_time(m, 1, 16, slow, tokens_per_step=TOKENS, seq_len=SEQ, dispatcher=d)
              for d in ("triton", "dedup", "auto")}
    assert across["auto"].dispatcher == "dedup" and across["auto"].step_s == across["dedup"].step_s
    assert across["dedup"].step_s < across["triton"].step_s
    assert cli(PLAN[:-2] + ["--json"]) == 0  # plan's default, auto, mirrors the engine on CUDA
    layouts = {(q["dp"], q["ep"]): q["step_time"] for q in json.loads(capsys.readouterr().out)["layouts"]}
    assert {layout: t["dispatcher"] for layout, t in layouts.items()} == dict.fromkeys(layouts, "triton")
    at_slow = [slow if arg == QWEN_TOPO else arg for arg in PLAN[:-2]]
    assert cli(at_slow + ["--json"]) == 0
    layouts = {(q["dp"], q["ep"]): q["step_time"] for q in json.loads(capsys.readouterr().out)["layouts"]}
    assert layouts[(1, 16)]["dispatcher"] == "dedup" and layouts[(2, 8)]["dispatcher"] == "triton"
    assert cli(at_slow) == 0
    assert "one row per token and destination node and rank for 1 × 16" in capsys.readouterr().out
