"""Expert placement: traffic versus the contiguous placement, imbalance versus an EPLB-style baseline.

Two sources of routing:

* **trained** (the figure that counts): a run of ``scripts/train.py`` with ``coactivation_stats`` on
  (``HF_HYBRID_EP_COACTIVATION_STATS=true``). Placements are fitted on its ``expert_load.jsonl``
  (loads and co-activation counts recorded during training, from ``--fit-from-step`` on) and
  evaluated on top-k traces recorded from its final checkpoint (the trained router) over the demo
  corpus: traffic is computed exactly from the traces (:func:`hf_hybrid_ep.planning.placement.trace_traffic`).
* **synthetic** (a sanity check): tokens choose their k experts inside planted groups of experts; fitted
  on one sample, evaluated on another.

For each topology (an EP group of ``ep`` ranks) and method — contiguous, EPLB (hierarchical policy,
re-implemented from its description), ours hierarchical load-balanced packing, ours co-activation-aware
— it reports node-deduplicated cross-node and cross-rack sends per token, pair sends crossing nodes
per token, and per-rank load imbalance (max/mean; over all layers summed, and the worst layer).

    HF_HYBRID_EP_COACTIVATION_STATS=true ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 \\
        accelerate launch --multi_gpu --num_processes 2 scripts/train.py --output_dir runs/placement_demo \\
        --max_steps 80 --save_steps 80 ...   # the demo's other flags (see docs/benchmarks.md)
    python -m benchmarks.bench_placement --run runs/placement_demo --json placement_results.json

``--init-wide DIR`` writes a randomly initialised wider variant of the demo model (32 experts, top-4,
4 layers) to train the same way with ``--model_name_or_path DIR --tokenizer_name <demo run>/tokenizer``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.demo import demo_config
from hf_hybrid_ep.dispatch import PlacementTable
from hf_hybrid_ep.metrics import read_jsonl
from hf_hybrid_ep.parallel.topology import Topology
from hf_hybrid_ep.planning.placement import (
    RoutingStats,
    coactivation_placement,
    eplb_placement,
    hierarchical_placement,
    imbalance,
    rank_loads,
    trace_traffic,
)


def record_traces(checkpoint: Path, tokenizer_dir: Path, block_size: int = 64, max_blocks: int = 512,
                  batch: int = 32) -> dict[str, list[np.ndarray]]:
    """Top-k indices ``[T, k]`` per MoE layer of the trained model over the demo corpus (one process)."""
    from transformers import AutoTokenizer

    import hf_hybrid_ep as hep
    from scripts.train import demo_corpus, pack

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    blocks = pack(demo_corpus(), tokenizer, block_size, "text")["input_ids"][:max_blocks]
    model = hep.from_pretrained(checkpoint)
    traces: dict[str, list[np.ndarray]] = {}
    for layer in hep.state_of(model).layers:
        original, name = layer.load.count, layer.name

        def count(index, dropped=0, _original=original, _name=name):
            traces.setdefault(_name, []).append(index.detach().reshape(-1, index.shape[-1]).cpu().numpy().copy())
            _original(index, dropped)

        layer.load.count = count
    with torch.no_grad():
        for i in range(0, len(blocks), batch):
            model(input_ids=torch.tensor(blocks[i : i + batch]))
    return {name: [np.concatenate(parts)] for name, parts in traces.items()}


def evaluate(name: str, table: PlacementTable, traces: dict[str, list[np.ndarray]], topo: Topology,
             fit: RoutingStats) -> dict:
    """Exact trace traffic (summed over layers, per token) and load imbalance of one table."""
    layers = list(traces)
    all_indices = [traces[n][0] for n in layers]
    t = trace_traffic(all_indices, table, topo)
    tokens = t["tokens"]
    pair = 0.0
    per_layer = []
    ep = table.ep_degree
    node = np.array([topo.node_of(r) for r in range(ep)])
    for n in layers:
        stats = RoutingStats.from_indices(traces[n], table.num_experts)
        per_layer.append(imbalance(rank_loads(stats.loads, table)))
        # pair sends crossing nodes: each assignment from a uniform source rank to its destination rank
        for e, load in enumerate(stats.loads):
            holders = table.holders(e)
            for s in range(ep):
                dest = [s] if s in holders else holders
                pair += load / ep * sum(node[d] != node[s] for d in dest) / len(dest)
    total = RoutingStats.from_indices(all_indices, table.num_experts)
    return {"method": name, "cross_node_per_token": t["cross_node"] / tokens,
            "cross_rack_per_token": t["cross_rack_dedup"] / tokens, "pair_cross_node_per_token": pair / tokens,
            "imbalance": imbalance(rank_loads(total.loads, table)), "imbalance_worst_layer": max(per_layer),
            "imbalance_fit": imbalance(rank_loads(fit.loads, table)),
            "rows": [list(r) for r in table.rows]}


def compare(fit: RoutingStats, traces: dict[str, list[np.ndarray]], ep: int, topo: Topology, replicas: int,
            tolerance: float) -> list[dict]:
    nodes = max(1, ep // min(ep, topo.gpus_per_node))
    tables = {
        "contiguous": PlacementTable.contiguous(fit.num_experts, ep),
        f"EPLB (r={replicas})": eplb_placement(fit.loads, ep, nodes, replicas),
        f"ours hierarchical (r={replicas})": hierarchical_placement(fit.loads, ep, topo, replicas),
        "ours co-activation (r=0)": coactivation_placement(fit, ep, topo, 0, tolerance),
        f"ours co-activation (r={replicas})": coactivation_placement(fit, ep, topo, replicas, tolerance),
    }
    return [evaluate(name, table, traces, topo, fit) for name, table in tables.items()]


def print_rows(title: str, rows: list[dict]) -> None:
    base = rows[0]
    print(f"\n{title}")
    print("| method | cross-node sends/token (dedup) | cross-rack sends/token (dedup) | pair sends crossing nodes/token "
          "| imbalance max/mean: evaluated (all layers; worst layer) | fitted |")
    print("|---|---|---|---|---|---|")
    def rel(r: dict, key: str) -> str:
        return f" ({100 * (r[key] / base[key] - 1):+.0f}%)" if base[key] else ""

    for r in rows:
        print(f"| {r['method']} | {r['cross_node_per_token']:.3f}{rel(r, 'cross_node_per_token')} | "
              f"{r['cross_rack_per_token']:.3f}{rel(r, 'cross_rack_per_token')} | "
              f"{r['pair_cross_node_per_token']:.3f}{rel(r, 'pair_cross_node_per_token')} | "
              f"{r['imbalance']:.3f}; {r['imbalance_worst_layer']:.3f} | {r['imbalance_fit']:.3f} |")


def synthetic(num_experts: int, k: int, groups: int, tokens: int, seed: int, layers: int = 2) -> dict[str, list[np.ndarray]]:
    """Planted co-activation: each token picks a group, then k distinct experts of it (Zipf-skewed);
    group g = experts {g, g + G, g + 2G, ...} so the contiguous placement splits every group."""
    rng = np.random.default_rng(seed)
    members = [np.arange(g, num_experts, groups) for g in range(groups)]
    out = {}
    for layer in range(layers):
        weights = 1.0 / np.arange(1, len(members[0]) + 1) ** 0.7
        index = np.stack([rng.choice(np.roll(members[g], layer), k, replace=False, p=weights / weights.sum())
                          for g in rng.integers(groups, size=tokens)])
        out[f"layer{layer}"] = [index]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=None, help="output_dir of a scripts/train.py run with "
                        "coactivation_stats on (expert_load.jsonl, checkpoint-*, tokenizer/)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: RUN/tokenizer, else the checkpoint's")
    parser.add_argument("--fit-from-step", type=int, default=0, help="fit on load records from this step on")
    parser.add_argument("--replicas", type=int, default=None, help="extra copies (default: one per EP rank)")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--init-wide", type=Path, default=None, help="write the wide demo variant here and exit")
    args = parser.parse_args(argv)
    if args.init_wide is not None:
        from transformers import AutoModelForCausalLM

        config = demo_config(wide=True)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(args.init_wide)
        print(f"wrote {args.init_wide}")
        return 0
    results: dict = {}
    topologies = [(4, "gpus_per_node=2"), (8, "gpus_per_node=2"), (8, "racks=2,nodes_per_rack=2,gpus_per_node=2")]

    if args.run is not None:
        records = [r for r in read_jsonl(args.run / "expert_load.jsonl") if r["step"] >= args.fit_from_step]
        fit = RoutingStats.from_records(records)
        checkpoint = max(args.run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        tokenizer = args.tokenizer or (args.run / "tokenizer" if (args.run / "tokenizer").is_dir() else checkpoint)
        traces = record_traces(checkpoint, tokenizer)
        print(f"trained: fitted on {len(records)} load records (steps {records[0]['step']}–{records[-1]['step']}), "
              f"{fit.layers} layers, {fit.num_experts} experts, top-{fit.top_k}; evaluated on "
              f"{len(next(iter(traces.values()))[0])} tokens × {len(traces)} layers routed by {checkpoint}")
        for ep, spec in topologies:
            if fit.num_experts % ep:
                continue
            topo = Topology.parse(spec)
            replicas = args.replicas if args.replicas is not None else ep
            rows = compare(fit, traces, ep, topo, replicas, args.tolerance)
            print_rows(f"trained, ep {ep}, {spec}", rows)
            results[f"trained ep{ep} {spec}"] = rows

    for E, k, G in ((16, 2, 4), (32, 4, 8)):
        fit_traces = synthetic(E, k, G, 4000, seed=1)
        fit = RoutingStats.from_indices([v[0] for v in fit_traces.values()], E)
        fit.layers = len(fit_traces)
        test = synthetic(E, k, G, 4000, seed=2)
        for ep, spec in topologies[1:]:
            topo = Topology.parse(spec)
            rows = compare(fit, test, ep, topo, args.replicas if args.replicas is not None else ep, args.tolerance)
            print_rows(f"synthetic: {E} experts, top-{k}, {G} planted groups; ep {ep}, {spec}", rows)
            results[f"synthetic E{E} k{k} ep{ep} {spec}"] = rows
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
