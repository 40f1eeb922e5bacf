"""The expert path side by side: this library's EP path vs transformers' grouped_mm and eager.

CPU (always): one process. (1) A tiny-but-not-trivial Qwen3-MoE layer stack; forward + backward time of
our EP path (world of one: the exchange is the identity, the permute/combine glue and the grouped GEMM
run), transformers' ``grouped_mm`` and ``eager`` experts implementations — as ratios in one run.
(2) One MoE block (router + experts) alone at the shape of ``bench_training``'s model, forward and
forward + backward, the same paths and our deduplicated exchange (one row per token and rank; at world 1 a
local copy and the fan-out to the experts).
CUDA (when a GPU is present): permute and unpermute-combine GB/s of the Triton kernels and of the
torch path for T = 16k tokens, H = 4096, k = 8, E = 64, against a measured device-to-device copy
(median of per-call ``torch.cuda.Event`` timings, :mod:`benchmarks.common.kernels`).

    python -m benchmarks.bench_dispatch --json bench_dispatch.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import hf_hybrid_ep as hep
from benchmarks.common.kernels import copy_seconds, cuda_seconds, routed_batch


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_comparison(repeat: int) -> dict:
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 512, (4, 128))
    variants = {}
    for impl in ("grouped_mm", "eager"):
        m = copy.deepcopy(base)
        m.set_experts_implementation(impl)
        variants[f"transformers {impl}"] = m
    ours = hep.parallelize(copy.deepcopy(base), hep.HybridEPConfig(dispatcher="torch"))
    variants["hf_hybrid_ep EP path (torch dispatcher)"] = ours

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
        return run

    rounds = {name: [] for name in variants}
    for _ in range(repeat):  # interleaved, so drift hits every variant alike
        for name, model in variants.items():
            rounds[name].append(_time(step(model), 1))
    medians = {name: statistics.median(ts) for name, ts in rounds.items()}
    base_t = medians["transformers grouped_mm"]
    return {name: {"seconds": t, "ratio_vs_grouped_mm": t / base_t} for name, t in medians.items()}


def cpu_layer_comparison(repeat: int, tokens: int = 512, hidden: int = 512, experts: int = 16, width: int = 512,
                         top_k: int = 2) -> dict:
    """One MoE block (router + experts) alone, at the shape of ``bench_training``'s model: forward, and
    forward + backward (input and weight gradients), per expert path. Same weights, same input."""
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
                            moe_intermediate_size=width, num_hidden_layers=1, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=hidden // 8, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    x = torch.randn(1, tokens, hidden)
    blocks = {}
    for impl in ("grouped_mm", "eager"):
        m = copy.deepcopy(base)
        m.set_experts_implementation(impl)
        blocks[f"transformers {impl}"] = m.model.layers[0].mlp
    for dispatcher in ("torch", "dedup"):  # "auto" runs "torch" at world 1 (nothing to deduplicate across)
        ours = hep.parallelize(copy.deepcopy(base), hep.HybridEPConfig(dispatcher=dispatcher))
        blocks[f"hf_hybrid_ep EP path ({dispatcher} dispatcher)"] = ours.model.layers[0].mlp

    def fwd(block):
        def run():
            with torch.no_grad():
                block(x)
        return run

    def fwd_bwd(block):
        def run():
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out = block(xi)
            out = out[0] if isinstance(out, tuple) else out
            out.square().mean().backward()
        return run

    report = {"shape": {"tokens": tokens, "hidden": hidden, "experts": experts, "expert_width": width, "top_k": top_k}}
    for label, make in (("forward", fwd), ("forward_backward", fwd_bwd)):
        rounds = {name: [] for name in blocks}
        for _ in range(repeat):
            for name, block in blocks.items():
                rounds[name].append(_time(make(block), 1))
        medians = {name: statistics.median(ts) for name, ts in rounds.items()}
        base_t = medians["transformers grouped_mm"]
        report[label] = {name: {"seconds": t, "ratio_vs_grouped_mm": t / base_t} for name, t in medians.items()}
    return report


def cuda_bandwidth() -> dict:
    from hf_hybrid_ep.dispatch.triton_kernels import fused_permute, fused_unpermute_combine

    tokens, hidden, k, experts = 16384, 4096, 8, 64
    b = routed_batch(tokens, hidden, k, experts, "cuda", torch.bfloat16)
    x, order, inverse, y = b["x"], b["order"], b["position"], b["rows"]
    weights = b["weights"].float()
    rows = tokens * k
    moved = rows * hidden * 2 * 2  # read + write of the routed rows, bf16
    results = {
        "copy": copy_seconds(rows * hidden, torch.bfloat16),
        "permute_triton": cuda_seconds(lambda: fused_permute(x, order, rows, k)),
        "permute_torch": cuda_seconds(lambda: x[order // k]),
        "combine_triton": cuda_seconds(lambda: fused_unpermute_combine(y, weights, order, tokens)),
        "combine_torch": cuda_seconds(lambda: (y[inverse] * weights.reshape(-1, 1)).view(tokens, k, hidden).sum(1)),
    }
    return {name: {"seconds": t, "GB_per_s": moved / t / 1e9} for name, t in results.items()} | {
        "device": torch.cuda.get_device_name(), "shape": {"T": tokens, "H": hidden, "k": k, "E": experts}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_dispatch.json")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    load_at_start = os.getloadavg()  # the machine is shared: the load around the run, as the training benches
    report = {"cpu": cpu_comparison(args.repeat), "cpu_layer": cpu_layer_comparison(args.repeat)}
    report["load_avg"] = {"start": load_at_start, "end": os.getloadavg()}
    if torch.cuda.is_available():
        report["cuda"] = cuda_bandwidth()
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print("| expert path (fwd + bwd, CPU) | median s | vs transformers grouped_mm |")
    print("|---|---|---|")
    for name, r in report["cpu"].items():
        print(f"| {name} | {r['seconds']:.4f} | {r['ratio_vs_grouped_mm']:.2f} |")
    layer = report["cpu_layer"]
    print(f"\none MoE block alone, {layer['shape']}:")
    print("| expert path (one MoE block, CPU) | forward s | vs grouped_mm | forward + backward s | vs grouped_mm |")
    print("|---|---|---|---|---|")
    for name in layer["forward"]:
        f, fb = layer["forward"][name], layer["forward_backward"][name]
        print(f"| {name} | {f['seconds']:.4f} | {f['ratio_vs_grouped_mm']:.2f} | {fb['seconds']:.4f} | "
              f"{fb['ratio_vs_grouped_mm']:.2f} |")
    if "cuda" in report:
        print(f"\n{report['cuda']['device']}: " + ", ".join(
            f"{k} {v['GB_per_s']:.0f} GB/s" for k, v in report["cuda"].items() if isinstance(v, dict) and "GB_per_s" in v))


if __name__ == "__main__":
    main()
