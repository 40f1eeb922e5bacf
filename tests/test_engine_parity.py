"""The engine is faithful: hybrid EP training equals one process training the full model.

Real gloo process groups in real processes (one pool per world size, reused across cases); tiny
real transformers models; the reference is the unsharded model trained on the global batch.
"""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest

FAMILIES = parity.FAMILIES
# (world, (dp, ep), experts): world 3 uses an expert count divisible by 3.
LAYOUTS = [
    (4, (4, 1), 4), (4, (2, 2), 4), (4, (1, 4), 4),
    (3, (3, 1), 6), (3, (1, 3), 6),
    (2, (2, 1), 4), (2, (1, 2), 4),
]


@pytest.mark.parametrize(("world", "layout", "experts"), LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", FAMILIES)
def test_training_parity(pools, family, world, layout, experts):
    dp, ep = layout
    parity.assert_faithful(pools(world).run(cases.train_parity, family, dp, ep, experts))


def test_frozen_parameters_are_left_alone(pools):
    # ERNIE-4.5 keeps a frozen correction bias (gate.moe_statics) in parameters().
    results = pools(2).run(cases.train_parity, "ernie4_5_moe", 1, 2, 4)
    parity.assert_faithful(results)
    for r in results:
        assert any("moe_statics" in name for name in r["frozen"]), r["frozen"]
        assert r["frozen_with_grad"] == []


@pytest.mark.parametrize(
    "placement",
    [[[3, 0], [1, 2]], [[0, 1, 2], [2, 3, 0]]],
    ids=["permutation", "replicas"],
)
def test_non_contiguous_placement(pools, placement):
    parity.assert_faithful(pools(2).run(cases.train_parity, "qwen3_moe", 1, 2, 4, placement=placement))


def test_non_contiguous_placement_with_dp(pools):
    placement = [[3, 0], [1, 2]]
    parity.assert_faithful(pools(4).run(cases.train_parity, "mixtral", 2, 2, 4, placement=placement))


def test_all_tokens_to_one_expert(pools):
    results = pools(4).run(cases.one_hot_expert_training, "mixtral", 4, 4)
    received = [r["rows_received"] for r in results]
    busy = max(range(4), key=received.__getitem__)  # ties in top-1 pick one expert; which is up to topk
    assert received[busy] > 0 and received.count(0) == 3, received
    for rank, r in enumerate(results):
        assert r["none_grads"] == 0
        assert r["violations"] == [], r
        if rank != busy:
            assert r["zero_slots"] > 0


def test_parameter_bytes_per_rank(pools):
    for r in pools(4).run(cases.parameter_bytes, "qwen3_moe", 2, 2, 4):
        assert r["dense"] == r["full_dense"]
        assert r["held"] == r["full_dense"] + r["full_experts"] // 2


@pytest.mark.parametrize(("dp", "backward"), [(1, False), (2, True)], ids=["1x4-no_grad-forward", "2x2-backward"])
def test_nan_in_router_input_raises_on_every_rank(pools, dp, backward):
    # Under no_grad the forward raises; with gradients the forward completes (NaN loss) and backward
    # raises on every rank after all gradient buckets completed (no clipping, nothing else in between).
    results = pools(4).run(cases.nan_in_router_input, "qwen3_moe", 2, dp, backward)
    for r in results:
        assert r["alive"] and r["clean_loss_finite"], r
        assert r["where"] == ("forward returned" if backward else ""), r
        assert "model.layers.0.mlp.experts" in r["message"], r
        assert "non-finite values (NaN/inf)" in r["message"] and "rank(s) [2]" in r["message"], r


def test_layout_not_dividing_experts_is_refused_before_work(pools):
    for r in pools(2).run(cases.bad_layout_refused, "mixtral", 3, 2):
        assert "num_experts=3 is not divisible by ep_degree=2" in r["message"], r
        assert r["untouched"]


def test_generate_and_save_pretrained_keep_working(pools, tmp_path):
    results = pools(4).run(cases.save_generate_reload, "mixtral", 2, 2, 4, str(tmp_path / "ckpt"))
    for r in results:
        assert r["generate_equal"]
        assert r["reload_rel"] <= cases.REL_TOL, r
        assert r["config_experts"] == 4  # .config still describes the full model


def test_composes_with_torch_ddp(pools):
    # The Accelerate path: DDP reduces dense weights, the engine's hooks reduce only the experts.
    for r in pools(4).run(cases.ddp_composition, "qwen3_moe", 2, 2, 4):
        assert r["violations"] == [], r
        assert r["dense_bytes"] == 0


def test_rank_dependent_control_flow_is_reported_not_hung(pools):
    for r in pools(2).run(cases.modality_mismatch, "ernie4_5_vl_moe"):
        assert "ranks reached different MoE layers" in r["message"], r


def test_gradient_checkpointing_recomputes_the_exchange(pools):
    parity.assert_faithful(pools(2).run(cases.train_parity, "mixtral", 1, 2, 4, gradient_checkpointing=True))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bf16_forward(pools, family):
    # DeepSeek-V3 and GPT-OSS pass fp32 routing weights with bf16 hidden states; the per-pair combine must
    # weight and sum in the same dtypes as transformers. Bound: the parity criterion's safety factor times
    # the measured bf16 spread of equally correct single-process computations (this rank's sequences
    # alone; the experts through batched_mm). The deduplicated exchange rounds its partial sums once more
    # (tests/test_dedup_dispatch.py::test_bf16_forward).
    import torch

    for r in pools(2).run(cases.forward_parity, family, 4, torch.bfloat16, "torch"):
        assert r["rel"] <= parity.SAFETY * r["spread"], r


@pytest.mark.parametrize(("family", "overlap_degree", "dispatcher"),
                         [("qwen3_moe", 1, "torch"), ("gpt_oss", 2, "torch"), ("qwen3_moe", 1, "dedup"),
                          ("gpt_oss", 2, "dedup")])
def test_autocast_over_fp32_weights_exchanges_and_computes_in_bf16(pools, family, overlap_degree, dispatcher):
    # The usual --bf16 run: fp32 weights under torch.autocast. Rows travel in bf16 (2·H bytes, in every
    # exchange of forward and backward; the deduplicated rows carry their k fp32 routing weights and int16
    # keys too, and the weights' gradients back), the experts' grouped GEMMs run in bf16, gradients land in
    # the fp32 parameters, and every gradient is within the safety factor times the measured bf16 round-off
    # of the fp32 reference (the same model under autocast in one process, every expert GEMM in bf16).
    for r in pools(2).run(cases.autocast_parity, family, 2, 4, overlap_degree=overlap_degree, dispatcher=dispatcher):
        assert r["gemm_dtypes"] == ["bfloat16"], r["gemm_dtypes"]
        rows, k = 2 * r["hidden"], r["top_k"]
        want = dict.fromkeys(("dispatch", "combine", "dispatch_backward", "combine_backward"), [rows])
        if dispatcher == "dedup":  # the routing weights in the router's dtype: bf16 (Qwen3) or fp32 (GPT-OSS)
            weight = (r["row_bytes"]["dispatch_backward"][0] - rows) // k
            assert weight in (2, 4), r["row_bytes"]
            want.update(dispatch=[rows + k * (weight + 2)], dispatch_backward=[rows + k * weight])
        assert r["row_bytes"] == want, r["row_bytes"]
        assert r["grad_dtypes"] == ["torch.float32"]
        loss, loss_spread = r["loss"]
        assert loss <= max(parity.SAFETY * loss_spread, parity.REL_TOL), r["loss"]
        assert [t for t in r["tensors"] if not t[1] <= t[2]] == [], r["tensors"]


def test_inf_norm_clipping(pools):
    for r in pools(2).run(cases.inf_norm, "olmoe", 2, 4):
        assert r["rel"] <= cases.REL_TOL, r


def test_generate_with_different_lengths_per_rank(pools):
    results = pools(2).run(cases.generate_uneven, [2, 5])
    assert [r["length"] for r in results] == [6, 9]
    assert all(r["equal"] for r in results)


@pytest.mark.parametrize("degree", [2, 3])
def test_overlapped_chunks_equal_the_plain_path(pools, degree):
    for r in pools(2).run(cases.overlap_equivalence, "qwen2_moe", 2, degree):
        assert r["logits_rel"] <= 1e-6 and r["grad_rel"] <= 1e-6, r


def test_shared_expert_overlap_is_bit_identical(pools):
    for r in pools(2).run(cases.shared_overlap_equivalence, "deepseek_v3"):
        assert r["equal"] and r["after"] == [True], r
        assert r["calls"][0] == r["calls"][1], r  # computed once per forward, just earlier
    for r in pools(2).run(cases.shared_overlap_equivalence, "qwen2_moe"):  # shared expert runs first
        assert r["equal"] and r["after"] == [False, False] and r["calls"][0] == r["calls"][1], r


@pytest.mark.parametrize(("layout", "capacity"), [((1, 4), 1), ((2, 2), 2)], ids=["1x4", "2x2"])
def test_hot_expert_shadowing_is_faithful(pools, layout, capacity):
    # Experts 0 and 2 draw nearly every token (router bias +4); after the first step each rank shadows
    # the hot experts it does not own (the cost model's choice), computes its own tokens for them
    # locally and returns the gradients to the owners before the expert reduction.
    dp, ep = layout
    results = pools(4).run(cases.train_parity, "gpt_oss", dp, ep, 4, shadow_capacity=capacity,
                           skew=([0, 2], 4.0), seq=32)
    parity.assert_faithful(results)
    for rank, r in enumerate(results):
        first, *later = r["shadow_steps"]
        assert first["rows_local"] == 0 and first["shadows_held"] == 0, (rank, first)  # nothing known yet
        for step in later:
            assert 1 <= step["shadows_held"] <= capacity * 2, (rank, step)  # 2 layers
            assert step["rows_local"] > 0 and step["net_bytes_saved"] > 0, (rank, step)
            assert step["weight_bytes_received"] > 0 and step["grad_bytes_sent"] > 0, (rank, step)
            assert step["remote_rows_sent"] < first["remote_rows_sent"], (rank, step, first)
