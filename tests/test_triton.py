"""Triton kernels and the "triton" dispatcher on CPU, under the Triton interpreter (fp32/fp16, tiny shapes)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
pytest.importorskip("triton")

import dist_cases as cases  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

import hf_hybrid_ep as hep  # noqa: E402


def _routing(tokens: int, k: int, experts: int, drop: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, experts - 1, (tokens, k), generator=g)  # the last expert stays empty
    if drop and tokens:
        index[0, -1] = -1
    flat = index.reshape(-1)
    key = torch.where(flat >= 0, flat, experts)
    _, order = torch.sort(key, stable=True)
    return index, order, int((flat >= 0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "drop"), [(9, 1, False), (9, 2, True), (5, 3, True), (0, 2, False)])
def test_kernels_equal_the_torch_path(dtype, tokens, k, drop):
    from hf_hybrid_ep.dispatch.triton_kernels import fused_permute, fused_unpermute_combine

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, 40, generator=g).to(dtype).requires_grad_()
    index, order, n = _routing(tokens, k, 4, drop, 2)
    rows = fused_permute(hidden, order, n, k)
    ref_rows = hidden[order[:n] // k]
    assert torch.equal(rows, ref_rows)
    y = torch.randn(n, 40, generator=g).to(dtype).requires_grad_()
    w = torch.rand(tokens, k, generator=g).requires_grad_()
    out = fused_unpermute_combine(y, w, order, tokens)
    back = torch.cat([y, y.new_zeros(tokens * k - n, 40)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(tokens * k)
    ref = (back[inverse] * w.reshape(-1, 1)).view(tokens, k, 40).sum(1)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert out.dtype == ref.dtype and torch.allclose(out, ref, rtol=tol, atol=tol)
    grad = torch.randn(tokens, 40, generator=g).to(out.dtype)
    got = torch.autograd.grad((out * grad).sum() + (rows.float() * 1.5).sum(), (y, w, hidden), allow_unused=True)
    want = torch.autograd.grad((ref * grad).sum() + (ref_rows.float() * 1.5).sum(), (y, w, hidden), allow_unused=True)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_implementation_equals_eager(family):
    grads = {}
    for impl in ("eager", "hybrid_ep_triton"):
        torch.manual_seed(0)
        model = build_tiny_model(family, num_experts=4)
        model.set_experts_implementation(impl)
        ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads[impl] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (logits_a, ga), (logits_b, gb) = grads["eager"], grads["hybrid_ep_triton"]
    assert torch.allclose(logits_a, logits_b, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and any("router" in n or "gate.weight" in n for n in ga)  # routing weights' gradient
    for name in ga:
        assert cases._rel(gb[name], ga[name]) <= 1e-5, name


@pytest.mark.parametrize(
    ("family", "alignment", "placement"),
    [("mixtral", 1, None), ("gpt_oss", 8, None), ("qwen3_moe", 4, [[0, 1, 2], [3, 0]])],
    ids=["mixtral", "gpt_oss-aligned", "qwen3_moe-replicas-aligned"],
)
def test_triton_dispatcher_trains_like_one_process(pools, family, alignment, placement):
    results = pools(2).run(cases.train_parity, family, 1, 2, 4, dispatcher="triton", steps=2,
                           expert_alignment=alignment, placement=placement)
    for r in results:
        assert r["max_loss_rel"] <= cases.REL_TOL and r["max_grad_rel_step0"] <= cases.REL_TOL, r
        assert r["violations"] == [], r


def test_regroup_plan_rank_major_to_expert_major_with_padding():
    from hf_hybrid_ep.dispatch import CommStats, DispatchHandle, PlacementTable, TritonDispatcher

    dispatcher = TritonDispatcher(PlacementTable.contiguous(4, 2), 0, None, CommStats(), alignment=4)
    # received from rank 0: 2 rows for slot 0, 1 for slot 1; from rank 1: 3 for slot 0, 0 for slot 1
    handle = DispatchHandle(torch.arange(0), 0, [0, 0], [3, 3], 0, 1, recv_counts=torch.tensor([2, 1, 3, 0]),
                            recv_counts_host=[2, 1, 3, 0])
    index, destination, sizes, sizes_host = dispatcher.regroup_plan(handle, 2)
    assert sizes_host == [8, 4]
    assert sizes.tolist() == [8, 4]  # 5 rows -> 8, 1 row -> 4
    assert index.tolist() == [0, 1, 3, 4, 5, -1, -1, -1, 2, -1, -1, -1]
    assert destination.tolist() == [0, 1, 8, 2, 3, 4]


def test_requested_backend_that_cannot_run_names_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    with pytest.raises(hep.HybridEPConfigError, match="dispatcher='triton' cannot run: no CUDA device"):
        hep.parallelize(model, hep.HybridEPConfig(dispatcher="triton"))


@pytest.mark.slow
def test_triton_dispatcher_with_hot_expert_shadows(pools):
    # Shadow rows skip the Triton regroup (they run on the module's own experts implementation) and join
    # the returned rows before the fused unpermute-combine.
    results = pools(2).run(cases.train_parity, "gpt_oss", 1, 2, 4, dispatcher="triton", steps=2, expert_alignment=8,
                           shadow_capacity=1, skew=([0, 2], 4.0), seq=32)
    for r in results:
        assert r["max_loss_rel"] <= cases.REL_TOL and r["max_grad_rel_step0"] <= cases.REL_TOL, r
        assert r["violations"] == [], r
        assert r["shadow_steps"][1]["rows_local"] > 0, r["shadow_steps"]
