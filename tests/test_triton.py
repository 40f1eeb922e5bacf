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
from hf_hybrid_ep.dispatch import Received, SideChannel  # noqa: E402
from hf_hybrid_ep.moe.experts import regroup_index  # noqa: E402


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


def _received() -> Received:
    # received from rank 0: 2 rows for slot 0, 1 for slot 1; from rank 1: 3 for slot 0, 0 for slot 1
    return Received(2, 2, torch.tensor([2, 1, 3, 0]), [2, 1, 3, 0])


def test_regroup_index_source_major_to_expert_major_with_padding():
    index, destination, sizes, sizes_host = regroup_index(_received(), 2, alignment=4)
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


# ---------------------------------------------------------------------------------------------- 64-bit offsets

WIDTHS = {"hidden"}  # kernel arguments that are row widths: a row index times one is an element offset


def _wide_names(fn) -> set[str]:
    """Names a kernel binds to a 64-bit value: ``x.to(tl.int64)`` or arithmetic on one (Triton promotes)."""
    import ast

    wide: set[str] = set()
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name)]
    changed = True
    while changed:
        changed = False
        for a in assigns:
            if a.targets[0].id not in wide and _is_wide(a.value, wide):
                wide.add(a.targets[0].id)
                changed = True
    return wide


def _is_wide(node, wide: set[str]) -> bool:
    import ast

    if isinstance(node, ast.Name):
        return node.id in wide
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        return bool(node.args) and ast.unparse(node.args[0]) == "tl.int64"
    if isinstance(node, ast.BinOp):
        return _is_wide(node.left, wide) or _is_wide(node.right, wide)
    return False


def _narrow_offsets(source: str) -> tuple[list[str], dict[str, int]]:
    """Every ``index * width`` product of the ``@triton.jit`` kernels in ``source`` whose index is not 64-bit,
    and how many such products each kernel has."""
    import ast

    narrow, checked = [], {}
    for fn in ast.parse(source).body:
        if not (isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list)):
            continue
        wide = _wide_names(fn)
        checked[fn.name] = 0
        for node in ast.walk(fn):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                continue
            for width, index in ((node.right, node.left), (node.left, node.right)):
                if isinstance(width, ast.Name) and width.id in WIDTHS:
                    checked[fn.name] += 1
                    if not _is_wide(index, wide):
                        narrow.append(f"{fn.name}: {ast.unparse(node)}")
    return narrow, checked


def test_every_row_offset_is_64_bit():
    # rows × hidden reaches 2**31 at real sizes (a rank receiving 4× its share of 32k tokens × k 8 at H 8192):
    # with 32-bit program ids the offset wraps and the kernel reads and writes the wrong rows, silently.
    import inspect

    from hf_hybrid_ep.dispatch import triton_kernels

    narrow, checked = _narrow_offsets(inspect.getsource(triton_kernels))
    assert narrow == []
    assert len(checked) == 5 and all(n >= 1 for n in checked.values()), checked
    # the check does catch a 32-bit index (the form a kernel takes without the casts)
    bad = "@triton.jit\ndef k(src, dst, hidden):\n    row = tl.program_id(0)\n    tl.store(dst + row * hidden, 0)\n"
    assert _narrow_offsets(bad)[0] == ["k: row * hidden"]


def _dispatchers(experts: int, ep: int):
    from hf_hybrid_ep.dispatch import CommStats, PlacementTable, TorchDispatcher, TritonDispatcher

    table = PlacementTable.contiguous(experts, ep)
    return TorchDispatcher(table, 0, None, CommStats()), TritonDispatcher(table, 0, None, CommStats())


def _input_grads(outputs: list, inputs: list, grad: torch.Tensor) -> list:
    return list(torch.autograd.grad(sum((o * g).sum() for o, g in zip(outputs, grad, strict=True)), inputs))


def test_masked_paths_equal_the_torch_dispatcher():
    # EP rank 0 of 2: pairs for rank 1's experts (remote), for expert 4 held here as a shadow, dropped ones
    # (-1); 200 columns: two column blocks, the second partial.
    torch.manual_seed(0)
    tokens, k, experts, width = 12, 2, 6, 200
    torch_path, triton_path = _dispatchers(experts, 2)
    index = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    index[::4, -1] = -1
    shadow_slot_of = torch.full((experts,), -1, dtype=torch.long)
    shadow_slot_of[4] = 0
    (plan,) = torch_path.plan(index, SideChannel(local_slot_of=shadow_slot_of))
    assert plan.num_sent and plan.num_local and plan.num_dropped and plan.send_splits[1]
    hidden = torch.randn(tokens, width, requires_grad=True)
    back = torch.randn(plan.num_sent, width, requires_grad=True)
    shadow_out = torch.randn(plan.num_local, width, requires_grad=True)
    weights = torch.rand(tokens, k, requires_grad=True)
    results = []
    for d in (torch_path, triton_path):
        rows = d._permute(hidden, plan.order, plan.num_sent, k)
        out = d._finish_combine(back, weights, plan, shadow_out)
        g = (torch.ones_like(rows), torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append([rows, out, *_input_grads([rows, out], [hidden, back, shadow_out, weights], g)])
    for got, want in zip(results[1], results[0], strict=True):
        assert cases._rel(got, want) <= 1e-6


def test_fused_gather_rows_padding_equals_indexing():
    # The regroup to expert-major order with groups padded to 4 rows: padding positions (-1) read zeros.
    from hf_hybrid_ep.dispatch.triton_kernels import fused_gather_rows

    index, destination, _, _ = regroup_index(_received(), 2, alignment=4)
    rows = torch.randn(6, 200, requires_grad=True)
    padded = torch.cat([rows, rows.new_zeros(1, 200)])
    want = padded[torch.where(index >= 0, index, rows.shape[0])]
    got = fused_gather_rows(rows, index, destination)
    assert torch.equal(got, want)
    g = torch.randn_like(want)
    assert torch.equal(*(torch.autograd.grad((t * g).sum(), rows)[0] for t in (got, want)))
