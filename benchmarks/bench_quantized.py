"""Frozen experts kept quantized against the same experts dequantized, with the same LoRA, on one MoE block.

One fused experts module of transformers (GPT-OSS's for MXFP4: ``[E, H, 2I]`` interleaved gate/up with biases;
DeepSeek-V3's for block-FP8 with 128 × 128 blocks: ``[E, 2I, H]``), its expert-major rows (``rows_per_expert``
each on average, sizes drawn from a multinomial), forward and backward through :class:`ExpertCompute`'s
grouped path with LoRA rank ``--r`` on both projections (``LoRAExpertCompute``, PEFT's factors). Two bases under
the same adapters:

* ``dequantized``: the experts' weights as the dequantized checkpoint holds them (frozen parameters);
* ``quantized``: the checkpoint's tensors kept as shipped (:mod:`hf_hybrid_ep.quant`), each projection's experts
  dequantized one group at a time in the forward and again in the backward (:func:`grouped_linear`).

The outputs and the gradients (rows, adapter factors) are compared first; then interleaved rounds give the
step-time ratio quantized / dequantized (the median of the rounds' ratios: the two runs of a round are adjacent,
so load drifts hit them alike), the dequantization's share of the quantized step (the same dequantizations timed
alone: every expert of both projections, twice) and the bytes each base holds.
The quantized values are random codes and scales: the timing does not depend on them.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_quantized --json benchmarks/results/bench_quantized.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

from hf_hybrid_ep.moe.experts import ExpertCompute
from hf_hybrid_ep.moe.lora import LoRAExpertCompute
from hf_hybrid_ep.quant.linear import grouped_linear
from hf_hybrid_ep.quant.weights import BlockFP8Weight, MXFP4Weight, QuantizedWeight

PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantizedExpertCompute(ExpertCompute):
    """:class:`ExpertCompute` whose projections read frozen quantized weights (``quantized``: by parameter name)
    through :func:`grouped_linear`; the module's own weight parameters are never read."""

    def __init__(self, module: nn.Module, quantized: dict[str, QuantizedWeight] | None = None, *,
                 alignment: int = 1, fused: bool = False) -> None:
        super().__init__(module, alignment=alignment, fused=fused)
        self.quantized = quantized or {}

    def linear(self, x: torch.Tensor, projection: str, offsets: torch.Tensor, expert_of_row: torch.Tensor | None,
               compute: torch.dtype | None) -> torch.Tensor:
        module, weight = self.module, self.quantized[f"{projection}_proj"]
        bias = getattr(module, f"{projection}_proj_bias")[expert_of_row] if module.has_bias else None
        if compute is not None and bias is not None:
            bias = bias.to(compute)
        return grouped_linear(x, weight, offsets, bias, is_transposed=module.is_transposed,
                              dtype=compute or weight.dtype)


class QuantizedLoRAExpertCompute(LoRAExpertCompute, QuantizedExpertCompute):
    """LoRA (:class:`LoRAExpertCompute`) over a kept-quantized base (:class:`QuantizedExpertCompute`)."""

    def __init__(self, module: nn.Module, wrappers: dict[str, nn.Module],
                 quantized: dict[str, QuantizedWeight]) -> None:
        super().__init__(module, wrappers)
        self.quantized = quantized


def stand_in(parameter: nn.Parameter) -> nn.Parameter:
    """A frozen parameter of ``parameter``'s shape and dtype holding one NaN (a zero-stride view): what the
    module keeps where its weight is held quantized; any product that read it would be NaN."""
    return nn.Parameter(torch.full((), float("nan"), dtype=parameter.dtype).expand(parameter.shape),
                        requires_grad=False)


def experts_module(fmt: str, experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> nn.Module:
    """A transformers fused experts module, random weights: GPT-OSS's (``mxfp4``) or DeepSeek-V3's (``fp8``)."""
    if fmt == "mxfp4":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

        config = GptOssConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as cls

        config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=intermediate, n_routed_experts=experts)
    config._experts_implementation = "grouped_mm"
    module = cls(config).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.requires_grad_(False)


def random_quantized(fmt: str, module: nn.Module, block: tuple[int, int], generator: torch.Generator
                     ) -> dict[str, QuantizedWeight]:
    """Random checkpoint tensors of ``module``'s weights in ``fmt`` (codes and scales), as holders."""
    out: dict[str, QuantizedWeight] = {}
    for name in PROJECTIONS:
        p = getattr(module, name)
        if fmt == "mxfp4":  # model layout [E, in, out] from blocks [E, out, in/32, 16]
            experts, width, rows = p.shape
            blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), dtype=torch.uint8, generator=generator)
            scales = torch.randint(118, 123, (experts, rows, width // 32), dtype=torch.uint8, generator=generator)
            out[name] = MXFP4Weight(blocks, scales, p.dtype, name)
        else:
            experts, rows, cols = p.shape
            data = torch.randn(p.shape, generator=generator).to(torch.float8_e4m3fn)
            grid = (experts, -(-rows // block[0]), -(-cols // block[1]))
            scale = torch.rand(grid, generator=generator) * 0.01 + 0.005
            out[name] = BlockFP8Weight(data, scale, block, p.dtype, name)
    return out


def lora_wrappers(module: nn.Module, r: int, generator: torch.Generator) -> dict[str, nn.Module]:
    """PEFT's LoRA on both projections of ``module`` (``lora_B`` non-zero: a trained adapter), its factors
    slot-major for all the module's experts, as the engine shards them."""
    from peft import LoraConfig, get_peft_model

    from hf_hybrid_ep.moe.lora import check_expert_adapters, expert_wrappers, shard_expert_adapters

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = module

    peft = get_peft_model(Block(), LoraConfig(r=r, lora_alpha=2 * r, target_parameters=[
        f"experts.{p}" for p in PROJECTIONS]))
    name = next(n for n, m in peft.named_modules() if m is module)
    wrappers = expert_wrappers(peft, name, module)
    check_expert_adapters(name, module, wrappers)
    shard_expert_adapters(module, wrappers, list(range(module.num_experts)), module.num_experts)
    with torch.no_grad():
        for wrapper in wrappers.values():
            for linear in wrapper.lora_B.values():
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.02)
    return wrappers


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _step(compute: ExpertCompute, rows: torch.Tensor, sizes: torch.Tensor, grad: torch.Tensor,
          factors: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    for p in factors:
        p.grad = None
    x = rows.detach().requires_grad_()
    out = compute.grouped_forward(x, sizes)
    out.backward(grad)
    return out.detach(), x.grad, [p.grad for p in factors]


def _dequantize_all(quantized: dict[str, QuantizedWeight], group: int) -> None:
    """What one quantized step dequantizes: every expert of both projections, in the forward and the backward."""
    for _ in range(2):
        for weight in quantized.values():
            for start in range(0, weight.num_experts, group):
                weight.dequantize_experts(start, min(start + group, weight.num_experts))


def _setup(fmt: str, args: argparse.Namespace, rows_per_expert: int) -> dict:
    """Both computes over the same adapters, their rows, and the bytes each base holds."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    dense = experts_module(fmt, args.experts, args.hidden, args.intermediate, dtype)
    quantized = random_quantized(fmt, dense, (128, 128), g)
    with torch.no_grad():
        for name, weight in quantized.items():
            getattr(dense, name).copy_(weight.dequantize())
    wrappers = lora_wrappers(dense, args.r, g)
    kept = experts_module(fmt, args.experts, args.hidden, args.intermediate, dtype)
    kept.load_state_dict({k: v for k, v in dense.state_dict().items() if k not in PROJECTIONS}, strict=False)
    for name in PROJECTIONS:
        setattr(kept, name, stand_in(getattr(kept, name)))
    counts = torch.multinomial(torch.ones(args.experts), args.experts * rows_per_expert, replacement=True,
                               generator=g).bincount(minlength=args.experts)
    rows = torch.randn(int(counts.sum()), args.hidden, generator=g, dtype=dtype)
    return {"computes": {"dequantized": LoRAExpertCompute(dense, wrappers),
                         "quantized": QuantizedLoRAExpertCompute(kept, wrappers, quantized)},
            "quantized": quantized, "rows": rows, "sizes": counts, "grad": torch.randn_like(rows),
            "factors": LoRAExpertCompute(dense, wrappers).adapter_parameters(),
            "bytes": {"dequantized": sum(getattr(dense, n).nbytes for n in PROJECTIONS),
                      "quantized": sum(w.nbytes for w in quantized.values()),
                      "bf16": sum(getattr(dense, n).numel() * 2 for n in PROJECTIONS)}}


def run_case(fmt: str, args: argparse.Namespace, rows_per_expert: int) -> dict:
    """One format at one number of rows per expert: parity first, then interleaved timed rounds."""
    case = _setup(fmt, args, rows_per_expert)
    inputs = (case["rows"], case["sizes"], case["grad"], case["factors"])
    (out_d, gx_d, gf_d), (out_q, gx_q, gf_q) = (_step(c, *inputs) for c in case["computes"].values())
    parity = {"output_rel": _rel(out_q, out_d), "row_grad_rel": _rel(gx_q, gx_d),
              "max_factor_grad_rel": max(_rel(a, b) for a, b in zip(gf_q, gf_d, strict=True))}
    times: dict[str, list[float]] = {"dequantized": [], "quantized": [], "dequantize_only": []}
    for _ in range(args.rounds):
        for name, compute in case["computes"].items():
            start = time.perf_counter()
            for _ in range(args.iters):
                _step(compute, *inputs)
            times[name].append((time.perf_counter() - start) / args.iters)
        start = time.perf_counter()
        for _ in range(args.iters):
            _dequantize_all(case["quantized"], 1)
        times["dequantize_only"].append((time.perf_counter() - start) / args.iters)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    paired = [q / d for q, d in zip(times["quantized"], times["dequantized"], strict=True)]
    return {"format": fmt, "rows_per_expert": rows_per_expert, "rows": int(case["sizes"].sum()), **parity,
            "ms": ms, "ratio_quantized_vs_dequantized": statistics.median(paired),
            "ratio_range": [min(paired), max(paired)],
            "dequantize_share_of_quantized": ms["dequantize_only"] / ms["quantized"], "bytes": case["bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["mxfp4", "fp8"], choices=["mxfp4", "fp8"])
    parser.add_argument("--experts", type=int, default=8, help="this rank's experts in the block")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512, help="each expert's width")
    parser.add_argument("--rows-per-expert", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=1, help="forward+backward passes per round")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = [run_case(fmt, args, n) for fmt in args.formats for n in args.rows_per_expert]
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "cases": cases,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
              "load_average": os.getloadavg()}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
