"""Expert-cache policies on recorded routing traces: hit rate and bytes moved, Belady as the bound.

Records, during sampled decoding (one prompt at a time), which experts each MoE layer uses at every
step (one trace per layer and prompt), replays the traces through every policy at several capacities, and plots hit rate against
capacity.

    python benchmarks/bench_cache.py --model runs/demo/checkpoint-30 --out bench_cache   # a trained model
    python benchmarks/bench_cache.py --out bench_cache                                  # the demo config
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_hybrid_ep.cache import POLICIES, replay
from hf_hybrid_ep.experts import find_experts_modules

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "scripts" / "demo_assets"


def record_traces(model, prompts: torch.Tensor, new_tokens: int) -> dict[str, list[list[int]]]:
    """One trace per (layer, prompt): the experts used at each sampled decoding step (batch of one)."""
    traces: dict[str, list[list[int]]] = {}
    for i, prompt in enumerate(prompts):
        torch.manual_seed(i)
        for name, trace in _record(model, prompt[None], new_tokens).items():
            traces[f"{name}#prompt{i}"] = trace
    return traces


def _record(model, prompts: torch.Tensor, new_tokens: int) -> dict[str, list[list[int]]]:
    traces: dict[str, list[list[int]]] = {}
    hooks = []
    for name, module in find_experts_modules(model):
        traces[name] = []

        def hook(mod, args, name=name):
            traces[name].append(sorted(set(args[1].reshape(-1).tolist())))

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=True, top_k=0, temperature=1.0)
    for h in hooks:
        h.remove()
    return {name: trace[1:] for name, trace in traces.items()}  # drop the prompt's prefill step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo config, random init)")
    parser.add_argument("--out", default="bench_cache")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_CONFIG))
    model.eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.prompts, 8), generator=torch.Generator().manual_seed(0))
    traces = record_traces(model, prompts, args.new_tokens)
    name, experts = next((n, m) for n, m in find_experts_modules(model))
    num_experts = experts.num_experts
    expert_bytes = sum(p[0].numel() * p[0].element_size() for p in experts.parameters(recurse=False))
    capacities = sorted({c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if c <= num_experts} | {num_experts})
    working_set = max(len(step) for trace in traces.values() for step in trace)
    capacities = [c for c in capacities if c >= working_set] or [num_experts]
    results = {policy: {} for policy in POLICIES}
    for policy in POLICIES:
        for capacity in capacities:
            hits = misses = moved = 0
            for trace in traces.values():
                stats = replay(trace, capacity, policy, expert_bytes)
                hits, misses, moved = hits + stats.hits, misses + stats.misses, moved + stats.bytes_loaded
            results[policy][capacity] = {"hit_rate": hits / max(1, hits + misses), "bytes_moved": moved}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cache.json").write_text(json.dumps({
        "model": args.model or "demo config (random init)", "num_experts": num_experts,
        "layers": len(traces), "steps": len(next(iter(traces.values()))), "working_set_max": working_set,
        "results": results}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for policy in POLICIES:
        ax.plot(capacities, [results[policy][c]["hit_rate"] for c in capacities], marker="o", label=policy)
    ax.set_xlabel("resident experts per layer")
    ax.set_ylabel("hit rate")
    ax.set_title(f"{num_experts} experts, {len(traces)} layer×prompt traces, decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=120)
    print(f"{len(traces)} traces (layers × prompts) × {len(next(iter(traces.values())))} decoding steps, {num_experts} experts, "
          f"largest working set per step {working_set}")
    print("| capacity | " + " | ".join(POLICIES) + " |")
    print("|---" * (len(POLICIES) + 1) + "|")
    for c in capacities:
        print(f"| {c} | " + " | ".join(f"{results[p][c]['hit_rate']:.3f}" for p in POLICIES) + " |")
    print(f"wrote {out / 'bench_cache.json'} and {out / 'hit_rate.png'}")


if __name__ == "__main__":
    main()
