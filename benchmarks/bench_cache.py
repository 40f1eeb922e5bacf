"""Expert-cache policies on recorded routing traces: hit rate and bytes moved, Belady as the bound.

Records, during sampled decoding (one prompt at a time), which experts each MoE layer uses at every
step (one trace per layer and prompt), replays the traces through every policy at several capacities, and plots hit rate against
capacity.

    python -m benchmarks.bench_cache --model runs/demo/checkpoint-30 --out bench_cache   # a trained model
    python -m benchmarks.bench_cache --out bench_cache                                  # the demo config

``--prefetch-capacity N`` also decodes the same prompts offloaded (N resident experts per layer, experts
memory-mapped from a checkpoint written to the output directory) with and without prefetch, and reports
the prediction's recall and the hit rates.

Hot-expert shadowing in training (bytes crossing ranks per step with and without ``shadow_experts``, on a
skewed workload: a tiny GPT-OSS whose router bias makes two experts draw most tokens)::

    torchrun --standalone --nproc_per_node 4 -m benchmarks.bench_cache --shadow --out bench_cache_shadow
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, GptOssConfig

import hf_hybrid_ep as hep
from benchmarks.common.demo import DEMO_ASSETS
from hf_hybrid_ep.inference.policies import POLICIES, replay
from hf_hybrid_ep.moe.discovery import find_experts_modules
from hf_hybrid_ep.moe.router_rules import find_router


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


def prefetch_report(model, prompts: torch.Tensor, new_tokens: int, capacity: int, store: Path) -> dict:
    """Offloaded sampled decoding from a memory-mapped checkpoint, without and with prefetch: hit rate
    and (with prefetch) the recall and precision of the next-layer prediction, per layer."""
    if not store.exists():
        model.save_pretrained(store)
    report = {}
    for prefetch in (False, True):
        offloaded = copy.deepcopy(model)
        hep.offload(offloaded, capacity=capacity, policy="lru", store=store, prefetch=prefetch)
        for i, prompt in enumerate(prompts):
            torch.manual_seed(i)
            with torch.no_grad():
                offloaded.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=True, top_k=0, temperature=1.0)
        report["prefetch" if prefetch else "plain"] = hep.cache_stats(offloaded)
    return report


# ---------------------------------------------------------------------------------------------- shadowing


def _skewed_gpt_oss(num_experts: int, hot: list[int], skew: float):
    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=num_experts, num_experts_per_tok=2,
                          vocab_size=512, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for name, module in find_experts_modules(model):
        with torch.no_grad():
            find_router(model, name, module.num_experts)[1].bias[hot] += skew
    return model


def shadow_bench(args) -> None:
    """Train a few AdamW steps twice (shadow_experts off, on) on every rank; report bytes crossing ranks."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hot = [0, args.experts // 2]
    runs = {}
    for cache in (False, True):
        model = _skewed_gpt_oss(args.experts, hot, args.skew)
        config = hep.HybridEPConfig(ep_degree=world, dp_degree=1, shadow_experts=cache,
                                    shadow_capacity=args.shadow_capacity)
        hep.parallelize(model, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps = []
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(3, 512, (args.batch, args.seq), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            hep.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            hep.after_optimizer_step(model)  # with the cache: decides the next step's shadows and fetches them
            stats = hep.comm_stats(model)
            layers = hep.layer_counters(stats)
            tokens = sum(v[p]["remote_bytes_sent"] for v in layers
                         for p in ("dispatch", "combine", "dispatch_backward", "combine_backward"))
            shadow = [sum(v["shadow"][k] for v in layers) for k in
                      ("weight_bytes_sent", "grad_bytes_sent", "control_bytes", "rows_local", "shadows_held")]
            rows = sum(v["dispatch"]["remote_rows_sent"] for v in layers)
            figures = torch.tensor([tokens, *shadow, rows, loss.item() * 1e6], dtype=torch.float64)
            dist.all_reduce(figures)
            steps.append(figures.tolist())
            hep.reset_comm_stats(model)
        runs["on" if cache else "off"] = steps
    if rank == 0:
        print(f"world {world} (1 × {world}), {args.experts} experts, router bias +{args.skew} on experts {hot}, "
              f"{args.batch}×{args.seq} tokens per rank, top-2, {args.steps} AdamW steps; bytes summed over ranks")
        print("| step | crossing, cache off | crossing, cache on (tokens + weights + grads + masks) | saved | "
              "rows kept local | shadows held | loss off / on |")
        print("|---|---|---|---|---|---|---|")
        table = []
        for step, (off, on) in enumerate(zip(runs["off"], runs["on"], strict=True)):
            crossing_off = off[0]
            crossing_on = on[0] + on[1] + on[2] + on[3]
            table.append({"step": step, "bytes_off": crossing_off, "bytes_on": crossing_on,
                          "token_bytes_on": on[0], "weight_bytes": on[1], "grad_bytes": on[2], "control_bytes": on[3],
                          "rows_local": on[4], "shadows_held": on[5], "remote_rows_off": off[6],
                          "remote_rows_on": on[6], "loss_off": off[7] / 1e6 / world, "loss_on": on[7] / 1e6 / world})
            print(f"| {step} | {crossing_off / 1024:.1f} KiB | {crossing_on / 1024:.1f} KiB ({on[0] / 1024:.1f} + "
                  f"{on[1] / 1024:.1f} + {on[2] / 1024:.1f} + {on[3] / 1024:.2f}) | "
                  f"{(crossing_off - crossing_on) / 1024:.1f} KiB | {int(on[4])} | {int(on[5])} | "
                  f"{off[7] / 1e6 / world:.5f} / {on[7] / 1e6 / world:.5f} |")
        print("(a step's window: its token exchanges, its shadows' gradient return, and the refresh after its "
              "optimizer step that fetches the next step's shadows)")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_shadow.json").write_text(json.dumps({"world": world, "experts": args.experts, "hot": hot,
                                                           "skew": args.skew, "steps": table}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    """The command line: trace replay (default), ``--prefetch-capacity``, or ``--shadow`` (under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo config, random init)")
    parser.add_argument("--out", default="bench_cache")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefetch-capacity", type=int, default=0, help="also measure prefetch recall (0: off)")
    parser.add_argument("--shadow", action="store_true", help="shadowing in training (run under torchrun)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--skew", type=float, default=3.0)
    parser.add_argument("--shadow-capacity", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    return parser


def _policy_sweep(traces: dict[str, list[list[int]]], capacities: list[int], expert_bytes: int) -> dict:
    """Every policy × capacity (resident experts per layer) over all traces: ``{policy: {capacity: {"hit_rate",
    "bytes_moved"}}}`` (bytes moved = experts loaded × ``expert_bytes``)."""
    results = {policy: {} for policy in POLICIES}
    for policy in POLICIES:
        for capacity in capacities:
            hits = misses = moved = 0
            for trace in traces.values():
                stats = replay(trace, capacity, policy, expert_bytes)
                hits, misses, moved = hits + stats.hits, misses + stats.misses, moved + stats.bytes_loaded
            results[policy][capacity] = {"hit_rate": hits / max(1, hits + misses), "bytes_moved": moved}
    return results


def _hit_rate_chart(results: dict, capacities: list[int], title: str, path: Path) -> None:
    """Hit rate against capacity, one line per policy, saved at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for policy in POLICIES:
        ax.plot(capacities, [results[policy][c]["hit_rate"] for c in capacities], marker="o", label=policy)
    ax.set_xlabel("resident experts per layer")
    ax.set_ylabel("hit rate")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _print_prefetch(report: dict, capacity: int) -> None:
    """The per-layer table of ``prefetch_report``: hit rates without and with prefetch, its recall and precision."""
    print(f"offloaded sampled decoding, {capacity} resident experts per layer, lru, "
          "experts memory-mapped from safetensors:")
    print("| layer | hit rate, plain | hit rate, prefetch | prefetch recall | prefetch precision |")
    print("|---|---|---|---|---|")
    for name in report["plain"]:
        plain, pre = report["plain"][name], report["prefetch"][name]
        recall = f"{pre['prefetch_recall']:.3f}" if pre["used"] else "— (first layer)"
        precision = f"{pre['prefetch_precision']:.3f}" if pre["used"] else "—"
        print(f"| {name} | {plain['hit_rate']:.3f} | {pre['hit_rate']:.3f} | {recall} | {precision} |")


def main() -> None:
    """Trace replay (and prefetch) in one process, or the shadowing benchmark under torchrun."""
    args = _parser().parse_args()
    if args.shadow:
        shadow_bench(args)
        return
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise SystemExit("trace replay runs in one process; use --shadow under torchrun")
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_ASSETS))
    model.eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.prompts, 8), generator=torch.Generator().manual_seed(0))
    traces = record_traces(model, prompts, args.new_tokens)
    _, experts = next((n, m) for n, m in find_experts_modules(model))
    num_experts = experts.num_experts
    expert_bytes = sum(p[0].numel() * p[0].element_size() for p in experts.parameters(recurse=False))
    capacities = sorted({c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if c <= num_experts} | {num_experts})
    working_set = max(len(step) for trace in traces.values() for step in trace)
    capacities = [c for c in capacities if c >= working_set] or [num_experts]
    results = _policy_sweep(traces, capacities, expert_bytes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cache.json").write_text(json.dumps({
        "model": args.model or "demo config (random init)", "num_experts": num_experts,
        "layers": len(traces), "steps": len(next(iter(traces.values()))), "working_set_max": working_set,
        "results": results}, indent=1))
    _hit_rate_chart(results, capacities, f"{num_experts} experts, {len(traces)} layer×prompt traces, decoding",
                    out / "hit_rate.png")
    print(f"{len(traces)} traces (layers × prompts) × {len(next(iter(traces.values())))} decoding steps, {num_experts} experts, "
          f"largest working set per step {working_set}")
    print("| capacity | " + " | ".join(POLICIES) + " |")
    print("|---" * (len(POLICIES) + 1) + "|")
    for c in capacities:
        print(f"| {c} | " + " | ".join(f"{results[p][c]['hit_rate']:.3f}" for p in POLICIES) + " |")
    print(f"wrote {out / 'bench_cache.json'} and {out / 'hit_rate.png'}")
    if args.prefetch_capacity:
        store = Path(args.model) if args.model else out / "store"  # a hybrid-EP checkpoint's expert files
        report = prefetch_report(model, prompts, args.new_tokens, args.prefetch_capacity, store)
        (out / "bench_prefetch.json").write_text(json.dumps(report, indent=1))
        _print_prefetch(report, args.prefetch_capacity)

if __name__ == "__main__":
    main()
