"""Frozen weights kept quantized (hf_hybrid_ep.quant): equal to the checkpoint's dequantization, computed just in
time one expert group at a time, and wrapped by PEFT unchanged.

References: the checkpoint path (``checkpoint.dequantize.Dequantizer`` over real safetensors files), the block- and
byte-wise references of tests/quantized_fixtures.py, transformers' dense grouped GEMM (``_grouped_linear``, what
``ExpertCompute.linear`` calls) and ``ExpertCompute`` / ``LoRAExpertCompute`` over the dequantized weights, and PEFT's
LoRA over plain ``nn.Linear``\\ s holding the dequantized weights. Tiny DeepSeek-V3 (block-FP8, ``kv_a_proj_with_mqa``
28 × 64 and ``kv_b_proj`` 96 × 20: clipped edge blocks at 16 × 16) and GPT-OSS (MXFP4 experts) from their configs.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from quantized_fixtures import (
    SCALE_DTYPES,
    build,
    quantize_fp8,
    quantize_mxfp4,
    reference_fp8,
    reference_mxfp4,
)
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.integrations.moe import _grouped_linear

from benchmarks.bench_quantized import (
    QuantizedExpertCompute,
    QuantizedLoRAExpertCompute,
    lora_wrappers,
    stand_in,
)
from hf_hybrid_ep.checkpoint.dequantize import Dequantizer, Quantization
from hf_hybrid_ep.checkpoint.safetensors_io import TensorFiles
from hf_hybrid_ep.errors import CheckpointError, HybridEPConfigError
from hf_hybrid_ep.moe.experts import ExpertCompute
from hf_hybrid_ep.moe.lora import LoRAExpertCompute
from hf_hybrid_ep.quant import formats as formats_module
from hf_hybrid_ep.quant import weights as weights_module
from hf_hybrid_ep.quant.linear import FP8Linear, grouped_linear
from hf_hybrid_ep.quant.weights import BlockFP8Weight, MXFP4Weight

E4M3 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN payloads and the sign of zero compared too)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _fp8_experts(shape, block, scale_dtype, seed=0):
    """Per-expert block-FP8 quantization of a random ``[E, R, C]``, stacked: ``(data, scale_inv)``."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    pairs = [quantize_fp8(e, block, E4M3, scale_dtype) for e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _files(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return TensorFiles({k: "model.safetensors" for k in tensors}, lambda name: tmp_path / name)


@pytest.mark.parametrize("chunk", [None, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_fp8_experts_and_row_tiles_equal_the_checkpoint_dequantization_bit_for_bit(tmp_path, scale_dtype, dtype,
                                                                                   chunk, monkeypatch):
    """576 rows and 200 columns in 128 × 128 blocks (DeepSeek-V3's ``kv_a_proj_with_mqa``: 4.5 blocks): each
    expert, a group of experts, the whole tensor and tiles of rows equal the checkpoint path and the reference,
    also dequantized in chunks of one block row (``chunk``: values dequantized at once on the way to bfloat16)."""
    if chunk is not None:
        monkeypatch.setattr(weights_module, "DEQUANTIZE_CHUNK", chunk)
    block = (128, 128)
    data, scale = _fp8_experts((3, 576, 200), block, scale_dtype)
    dense_q, dense_s = quantize_fp8(torch.randn(576, 200), block, torch.float8_e5m2, scale_dtype)
    tensors = {"experts.w": data, "experts.w_scale_inv": scale, "proj.weight": dense_q,
               "proj.weight_scale_inv": dense_s}
    dequantizer = Dequantizer(Quantization("fp8", block), tensors, dtype)
    with _files(tmp_path, tensors) as raw:
        held = BlockFP8Weight(raw.read("experts.w"), raw.read("experts.w_scale_inv"), block, dtype, "experts.w")
        for start, stop in ((0, 1), (1, 2), (2, 3), (1, 3)):
            want = dequantizer.read(raw, "experts.w", slice(start, stop))
            assert _same_bits(held.dequantize_experts(start, stop), want), (start, stop)
        assert _same_bits(held.dequantize(), dequantizer.read(raw, "experts.w"))
        for e in range(3):
            assert _same_bits(held.dequantize_experts(e, e + 1)[0], reference_fp8(data[e], scale[e], block, dtype))
        dense = BlockFP8Weight(raw.read("proj.weight"), raw.read("proj.weight_scale_inv"), block, dtype)
        full = dequantizer.read(raw, "proj.weight")
        assert _same_bits(dense.dequantize(), full)
        assert _same_bits(full, reference_fp8(dense_q, dense_s, block, dtype))
        for start, stop in ((0, 128), (128, 576), (512, 576), (256, 300)):
            assert _same_bits(dense.dequantize_rows(start, stop), full[start:stop]), (start, stop)
        with pytest.raises(IndexError, match="multiple of 128"):
            dense.dequantize_rows(100, 200)


@pytest.mark.parametrize("chunk", [None, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_experts_equal_the_checkpoint_dequantization_bit_for_bit(tmp_path, dtype, chunk, monkeypatch):
    """GPT-OSS's layout: blocks ``[E, N, G, 16]`` become ``[E, 32·G, N]``; every byte value and e8m0 exponents
    far from 127 appear; also dequantized four rows at a time (``chunk``)."""
    if chunk is not None:
        monkeypatch.setattr(weights_module, "DEQUANTIZE_CHUNK", chunk)
    blocks, scales = quantize_mxfp4(torch.randn(4, 64, 48, generator=torch.Generator().manual_seed(1)))
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales[0, 0, 0], scales[1, 0, 0] = 0, 190
    tensors = {"experts.gate_up_proj_blocks": blocks, "experts.gate_up_proj_scales": scales}
    dequantizer = Dequantizer(Quantization("mxfp4"), tensors, dtype)
    with _files(tmp_path, tensors) as raw:
        held = MXFP4Weight(raw.read("experts.gate_up_proj_blocks"), raw.read("experts.gate_up_proj_scales"), dtype)
        assert tuple(held.shape) == (4, 64, 48)
        for start, stop in ((0, 1), (3, 4), (1, 3), (0, 4)):
            want = dequantizer.read(raw, "experts.gate_up_proj", slice(start, stop))
            assert _same_bits(held.dequantize_experts(start, stop), want), (start, stop)
        assert _same_bits(held.dequantize(), reference_mxfp4(blocks, scales, dtype))


def test_holders_keep_the_checkpoint_tensors_as_frozen_buffers():
    data, scale = _fp8_experts((2, 40, 24), (16, 16), torch.float32)
    held = BlockFP8Weight(data, scale, (16, 16), torch.bfloat16, "mlp.experts.gate_up_proj")
    assert list(held.parameters()) == [] and set(dict(held.named_buffers())) == {"data", "scale_inv"}
    assert held.data.data_ptr() == data.data_ptr() and held.scale_inv.data_ptr() == scale.data_ptr()
    assert held.nbytes == 2 * 40 * 24 + 2 * 3 * 2 * 4 and held.dequantized_nbytes() == 2 * 40 * 24 * 2
    before = held.dequantize(torch.float32)
    held.to(torch.float16)  # what the model's dtype changes: the dequantized dtype, never the stored tensors
    assert held.dtype == torch.float16 and held.data.dtype == E4M3 and held.scale_inv.dtype == torch.float32
    assert _same_bits(held.dequantize(torch.float32), before) and held.dequantize().dtype == torch.float16
    blocks, scales = quantize_mxfp4(torch.randn(2, 32, 24))
    mx = MXFP4Weight(blocks, scales, torch.bfloat16, "mlp.experts.down_proj")
    assert tuple(mx.shape) == (2, 32, 24) and mx.nbytes == 2 * 24 * 16 + 2 * 24 and list(mx.parameters()) == []
    bad = [(lambda: BlockFP8Weight(data, scale[:, :2], (16, 16), name="mlp.experts.gate_up_proj"), "scale grid"),
           (lambda: BlockFP8Weight(data.float(), scale, (16, 16), name="mlp.experts.gate_up_proj"), "float32"),
           (lambda: BlockFP8Weight(data, scale.to(torch.int32), (16, 16), name="mlp.experts.gate_up_proj"), "int32"),
           (lambda: BlockFP8Weight(data, scale, (16, 16), torch.int8, name="mlp.experts.gate_up_proj"), "int8"),
           (lambda: MXFP4Weight(blocks, scales[:, :3], name="mlp.experts.gate_up_proj"), "do not fit")]
    for make, message in bad:
        with pytest.raises(CheckpointError, match=f"mlp.experts.gate_up_proj.*{message}"):
            make()


def _holder(fmt: str, dtype: torch.dtype, experts: int = 4, out_features: int = 48):
    """fp8: ``[E, out, 32]`` (not transposed, 16 × 24 blocks: columns clipped); mxfp4: ``[E, 64, out]``
    (``[E, in, out]``, transposed)."""
    if fmt == "fp8":
        data, scale = _fp8_experts((experts, out_features, 32), (16, 24), torch.float32, seed=2)
        return BlockFP8Weight(data, scale, (16, 24), dtype), False
    w = torch.randn(experts, 64, out_features, generator=torch.Generator().manual_seed(2))
    return MXFP4Weight(*quantize_mxfp4(w), dtype), True


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_grouped_linear_equals_the_dense_grouped_gemm(fmt, dtype, group):
    """Rows, row gradients and bias gradients of the quantized projection against transformers' grouped GEMM on
    the dequantized weight (an expert without rows included); the weight gets no gradient."""
    held, transposed = _holder(fmt, dtype)
    in_features, out_features = (held.shape[1], held.shape[2]) if transposed else (held.shape[2], held.shape[1])
    sizes = torch.tensor([5, 0, 9, 3])
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(torch.arange(4), sizes)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, in_features, generator=g).to(dtype)
    bias = torch.randn(4, out_features, generator=g).to(dtype)
    grad = torch.randn(17, out_features, generator=g).to(dtype)
    results = []
    for quantized in (True, False):
        xi, bi = x.clone().requires_grad_(), bias.clone().requires_grad_()
        if quantized:
            out = grouped_linear(xi, held, offsets, bi[expert_of_row], is_transposed=transposed,
                                 experts_per_group=group)
        else:
            out = _grouped_linear(xi, held.dequantize(), offsets, bi[expert_of_row], is_transposed=transposed)
        out.backward(grad)
        results.append((out.detach(), xi.grad, bi.grad))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **tol)
    assert list(held.parameters()) == []


def test_grouped_linear_refuses_rows_that_do_not_fit():
    held, _ = _holder("fp8", torch.float32)
    x = torch.randn(6, 32)
    cases = [(x.double(), [2, 2, 4, 6], "float64"), (x[:, :16], [2, 2, 4, 6], r"need \[P, 32\]"),
             (x, [2, 2, 4], "of 4 experts"), (x, [2, 1, 4, 6], "non-decreasing"), (x, [2, 2, 4, 7], "row 7 of 6")]
    for rows, offsets, message in cases:
        with pytest.raises(ValueError, match=message):
            grouped_linear(rows, held, offsets)


def _experts_case(family: str):
    """A tiny model's experts module, its weights quantized: the module with the dequantized weights, the
    module with stand-ins where the weights are held quantized, and the holders."""
    model = build(family, kv_lora_rank=20) if family == "deepseek_v3" else build(family)
    module = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    quantized = {}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(module, name).detach()
        if family == "gpt_oss":
            quantized[name] = MXFP4Weight(*quantize_mxfp4(p), torch.float32, name)
        else:  # 24 × 24 blocks: the last block row and column clipped
            pairs = [quantize_fp8(e, (24, 24), E4M3, torch.float32) for e in p]
            data, scale = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
            quantized[name] = BlockFP8Weight(data, scale, (24, 24), torch.float32, name)
        with torch.no_grad():
            getattr(module, name).copy_(quantized[name].dequantize())
    module.requires_grad_(False)
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        if hasattr(module, name):
            getattr(module, name).requires_grad_(True)
    kept = copy.deepcopy(module)
    for name in quantized:
        setattr(kept, name, stand_in(getattr(kept, name)))
    return module, kept, quantized


def _grouped_step(compute, x, sizes, grad, params):
    for p in params:
        p.grad = None
    xi = x.clone().requires_grad_()
    out = compute.grouped_forward(xi, sizes)
    out.backward(grad)
    return [out.detach(), xi.grad, *[p.grad.clone() for p in params]]


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_expert_compute_over_quantized_weights_equals_the_dequantized_experts(family):
    """``ExpertCompute.grouped_forward`` (GPT-OSS: ``[E, H, 2I]`` interleaved gate/up, clamped SwiGLU, biases;
    DeepSeek-V3: ``[E, 2I, H]``) with its projections on the kept-quantized weights, with and without LoRA, equals
    the same compute on the dequantized weights: outputs, row gradients, bias and adapter-factor gradients."""
    module, kept, quantized = _experts_case(family)
    g = torch.Generator().manual_seed(4)
    sizes = torch.tensor([6, 0, 11, 4][: module.num_experts])
    x = torch.randn(int(sizes.sum()), module.gate_up_proj.shape[1 if module.is_transposed else 2], generator=g)
    grad = torch.randn(x.shape, generator=g)
    biases = [p for n, p in module.named_parameters() if n.endswith("_bias")]
    kept_biases = [p for n, p in kept.named_parameters() if n.endswith("_bias")]
    want = _grouped_step(ExpertCompute(module), x, sizes, grad, biases)
    got = _grouped_step(QuantizedExpertCompute(kept, quantized), x, sizes, grad, kept_biases)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    wrappers = lora_wrappers(module, 4, g)
    factors = LoRAExpertCompute(module, wrappers).adapter_parameters()
    want = _grouped_step(LoRAExpertCompute(module, wrappers), x, sizes, grad, factors)
    got = _grouped_step(QuantizedLoRAExpertCompute(kept, wrappers, quantized), x, sizes, grad, factors)
    assert len(factors) == 4 and all(f.abs().sum() > 0 for f in got[2:])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_the_quantized_benchmark_compares_equal_steps(fmt):
    import argparse

    from benchmarks.bench_quantized import run_case

    args = argparse.Namespace(experts=2, hidden=64, intermediate=64, r=2, dtype="float32", rounds=1, iters=1)
    case = run_case(fmt, args, rows_per_expert=8)
    assert max(case["output_rel"], case["row_grad_rel"], case["max_factor_grad_rel"]) < 1e-6  # 0 on this CPU
    assert case["bytes"]["quantized"] < case["bytes"]["bf16"] < case["bytes"]["dequantized"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors allocated under the mode and still alive, and their peak (storages counted once; views
    and outputs sharing an input's storage are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in inputs and key not in self._alive:
                self._alive.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.live -= size


def _projection(fmt: str, dtype: torch.dtype, out_features: int = 48):
    """A larger layer (8 experts) and its rows: ``(holder, transposed, x, offsets, grad)``."""
    held, transposed = _holder(fmt, dtype, 8, out_features)
    in_features, out_features = (held.shape[1], held.shape[2]) if transposed else (held.shape[2], held.shape[1])
    offsets = torch.cumsum(torch.tensor([3, 7, 0, 5, 2, 6, 4, 1]), 0).to(torch.int32)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(28, in_features, generator=g).to(dtype).requires_grad_()
    return held, transposed, x, offsets, torch.randn(28, out_features, generator=g).to(dtype)


def _extra_peak(held, transposed, x, offsets, grad, group) -> int:
    """Peak bytes a forward + backward of the quantized projection allocates beyond its output and row gradient."""
    held.dequantize_experts(0, 1)  # the lookup tables are made once per device (kept: 1 KiB, 2 KiB)
    x.grad = None
    with LiveBytes() as quantized:
        out = grouped_linear(x, held, offsets, is_transposed=transposed, experts_per_group=group)
        out.backward(grad)
    return quantized.peak - out.nbytes - x.grad.nbytes


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_a_forward_and_backward_hold_at_most_one_group_dequantized(fmt, group, monkeypatch):
    """Beyond its output and the row gradient, a forward + backward of the quantized projection allocates at most
    one group's dequantization at a time (``workspace_nbytes``: ``group`` experts in bfloat16, one chunk's float32
    product and its lookup and scale temporaries), far below the layer dequantized; the dense path, measured the
    same way, holds the whole layer. With small chunks (as real experts are large against the 4 MiB chunk) the
    extra is within 25 % of the group's dequantized weight."""
    held, transposed, x, offsets, grad = _projection(fmt, torch.bfloat16)
    extra, bound = _extra_peak(held, transposed, x, offsets, grad, group), held.workspace_nbytes(group)
    assert held.dequantized_nbytes(group) <= extra <= bound < held.dequantized_nbytes(8, torch.float32)
    produced = x.grad.nbytes + grad.nbytes
    x.grad = None
    with LiveBytes() as dense:
        out = _grouped_linear(x, held.dequantize(), offsets, is_transposed=transposed)
        out.backward(grad)
    assert dense.peak - produced > bound and dense.peak - produced >= held.dequantized_nbytes()
    monkeypatch.setattr(weights_module, "DEQUANTIZE_CHUNK", 256)
    monkeypatch.setattr(formats_module, "DECODE_CHUNK", 128)
    tall = _projection(fmt, torch.bfloat16, out_features=256)
    extra = _extra_peak(*tall, group)
    assert extra <= tall[0].workspace_nbytes(group) <= 1.25 * tall[0].dequantized_nbytes(group)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_nothing_dequantized_is_saved_for_the_backward(fmt):
    held, transposed, x, offsets, _ = _projection(fmt, torch.float32)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        grouped_linear(x, held, offsets, is_transposed=transposed)
        assert saved == []
        _grouped_linear(x, held.dequantize(), offsets, is_transposed=transposed)
    assert sum(saved) >= held.dequantized_nbytes()  # the dense path keeps the whole layer for its backward


ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
DENSE_FP8 = (*ATTENTION, "gate_proj", "up_proj", "down_proj")  # every nn.Linear but lm_head


def _deepseek_fp8(block=(16, 16)):
    """A tiny DeepSeek-V3 with its dense linears as block-FP8 ``FP8Linear``\\ s (scale dtypes rotating), and the
    same model with ``nn.Linear``\\ s holding the reference dequantization."""
    model = build("deepseek_v3", kv_lora_rank=20)
    reference = copy.deepcopy(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.endswith(DENSE_FP8)]
    for i, (name, linear) in enumerate(linears):
        q, s = quantize_fp8(linear.weight.detach(), block, E4M3, SCALE_DTYPES[i % len(SCALE_DTYPES)])
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, FP8Linear.from_checkpoint(q, s, block, linear.bias,
                                                                               torch.float32, name + ".weight"))
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(reference_fp8(q, s, block, torch.float32))
    return model, reference


def _lora(model, **kwargs):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, **kwargs))


def test_peft_lora_over_fp8_linears_equals_lora_over_the_dequantized_linears():
    """PEFT 0.21.2 wraps ``FP8Linear`` as any ``nn.Linear`` (``lora.Linear``, adapters in fp32 like the base's
    dequantized dtype); with the same adapters the losses, logits and adapter gradients equal LoRA over the
    dequantized model's ``nn.Linear``\\ s, clipped edge blocks (kv_a_proj_with_mqa, kv_b_proj) included."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from peft.tuners.lora import Linear as LoraLinear

    model, reference = _deepseek_fp8()
    ours, theirs = _lora(model, init_lora_weights=False), _lora(reference, init_lora_weights=False)
    set_peft_model_state_dict(ours, get_peft_model_state_dict(theirs))
    wrapped = [m for n, m in ours.named_modules() if n.endswith(tuple(ATTENTION))]
    assert wrapped and all(isinstance(m, LoraLinear) and isinstance(m.base_layer, FP8Linear) for m in wrapped)
    assert all(m.lora_A["default"].weight.dtype == torch.float32 for m in wrapped)
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        n for n, p in theirs.named_parameters() if p.requires_grad}
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    outs = [m(input_ids=ids, labels=ids) for m in (ours, theirs)]
    for out in outs:
        out.loss.backward()
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-5, atol=1e-6)
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (ours, theirs)]
    assert grads[0].keys() == grads[1].keys() and all(g.abs().sum() > 0 for g in grads[0].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_merging_or_reading_a_kept_quantized_weight_is_refused():
    """PEFT's merge (safe or not), DoRA and a replaced weight are refused naming ``keep_quantized=False``; nothing
    is changed by the attempt."""
    model, _ = _deepseek_fp8()
    peft = _lora(model, init_lora_weights=False)
    ids = torch.arange(10)[None]
    before = peft(input_ids=ids).logits.detach()
    buffers = {n: b.clone() for n, b in peft.named_buffers() if ".quantized." in n}
    for merge in (peft.merge_adapter, lambda: peft.merge_and_unload(safe_merge=True)):
        with pytest.raises(HybridEPConfigError, match=r"\.weight is kept quantized.*keep_quantized=False"):
            merge()
    assert buffers and not any(getattr(m, "merged_adapters", []) for m in peft.modules())
    assert all(torch.equal(b.view(torch.uint8), buffers[n].view(torch.uint8))
               for n, b in peft.named_buffers() if n in buffers)
    torch.testing.assert_close(peft(input_ids=ids).logits, before, rtol=0, atol=0)
    with pytest.raises(HybridEPConfigError, match="keep_quantized=False"):
        _lora(_deepseek_fp8()[0], use_dora=True)
    linear = next(m for m in model.modules() if isinstance(m, FP8Linear))
    with pytest.raises(HybridEPConfigError, match="keep_quantized=False"):
        linear.weight = torch.zeros(linear.out_features, linear.in_features)
    with pytest.raises(HybridEPConfigError, match="no values to read"):
        linear.weight.sum()


def test_fp8_linear_state_dict_dtype_and_autocast():
    """The state dict is the checkpoint's (``weight`` float8, ``weight_scale_inv``, ``bias``) and loads back;
    ``.to(bfloat16)`` keeps the stored tensors and computes in bfloat16 like ``nn.Linear`` over the bfloat16
    dequantization; under CPU autocast it computes as ``F.linear`` does over the fp32 dequantization."""
    g = torch.Generator().manual_seed(7)
    q, s = quantize_fp8(torch.randn(40, 24, generator=g), (16, 16), E4M3, torch.float32)
    bias = torch.randn(40, generator=g)
    linear = FP8Linear.from_checkpoint(q, s, (16, 16), bias, torch.float32, "proj.weight")
    state = linear.state_dict()
    assert set(state) == {"weight", "weight_scale_inv", "bias"} and state["weight"].data_ptr() == q.data_ptr()
    fresh = FP8Linear.from_checkpoint(torch.zeros_like(q), torch.ones_like(s), (16, 16), torch.zeros(40))
    fresh.load_state_dict(state)
    x = torch.randn(3, 5, 24, generator=g)
    torch.testing.assert_close(fresh.float()(x), linear(x), rtol=0, atol=0)
    meta = FP8Linear(BlockFP8Weight(torch.empty(40, 24, dtype=E4M3, device="meta"), torch.empty(3, 2, device="meta"),
                                    (16, 16), torch.float32), nn.Parameter(torch.empty(40, device="meta")))
    assert meta.weight.is_meta
    meta.load_state_dict(state, assign=True)  # a model built on the meta device takes the checkpoint's tensors
    assert meta.quantized.data.data_ptr() == q.data_ptr() and not meta.weight.is_meta
    torch.testing.assert_close(meta(x), linear(x), rtol=0, atol=0)
    plain = nn.Linear(24, 40)
    with torch.no_grad():
        plain.weight.copy_(reference_fp8(q, s, (16, 16), torch.float32))
        plain.bias.copy_(bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = linear(x), plain(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    linear.to(torch.bfloat16)
    assert linear.quantized.scale_inv.dtype == torch.float32 and linear.weight.dtype == torch.bfloat16
    plain.to(torch.bfloat16)
    assert _same_bits(linear.quantized.dequantize(), reference_fp8(q, s, (16, 16), torch.bfloat16))
    assert _same_bits(linear.dequantized().weight.detach(), plain.weight.detach())
    torch.testing.assert_close(linear(x.bfloat16()), plain(x.bfloat16()), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="proj.weight: input torch.float32"):
        linear(x)
