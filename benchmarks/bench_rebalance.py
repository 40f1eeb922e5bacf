"""Online rebalancing, measured: real training at world 4, and its routing replayed at simulated EP 8.

    python -m benchmarks.bench_rebalance --model demo --steps 80 --every 10 --json bench_rebalance_demo.json
    python -m benchmarks.bench_rebalance --model wide --steps 80 --every 10 --json bench_rebalance_wide.json

1. **Real training** (``torchrun``, 4 processes, one EP group of 4 over two emulated nodes
   ``gpus_per_node=2``): the demo model (tiny Qwen3-MoE, 8 experts top-2, 2 layers) or its wide variant
   (32 experts top-4, 4 layers; ``bench_placement --init-wide``) on the demo corpus, AdamW, the same
   seed and batches twice in one launch: a static run (contiguous) and an online run
   (``rebalance_every``, ``rebalance_replicas=4``); co-activation statistics on in both. Every step's top-k
   indices of every rank are recorded. Reported: the losses of both runs (they must agree to round-off),
   wall time of each, every rebalance's bytes and seconds, the per-step worst-layer rank imbalance at
   EP 4 under the table in force.
2. **Replay at simulated EP 8** over ``racks=2,nodes_per_rack=2,gpus_per_node=2`` with r = 8 replicas
   (the online run's traces): per step and layer, the rank imbalance (expected tokens per rank, an
   expert's tokens split over its replicas) and the node-deduplicated cross-node sends per token
   (:func:`hf_hybrid_ep.planning.placement.trace_traffic`), for contiguous / one static table / a static table
   per layer (both fitted on the first half of the run) / online (re-fitted every ``--every`` steps on
   the steps since the last rebalance, by the library's own :func:`hf_hybrid_ep.moe.rebalance.refit`), and
   an in-sample floor (a balance-only table fitted on each step's own loads: what no placement decided
   before the step can beat; it measures the sampling noise of one step's tokens). Figures are over
   the second half of the run.
3. **Cost**: rebalance seconds / online wall time, and the break-even interval: the steps after which
   the expert compute saved by the lower imbalance (the experts' share of a step's FLOPs × the relative
   drop of the slowest rank's load) repays one rebalance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.demo import ROOT, demo_blocks, demo_config

SIM_TOPOLOGY = "racks=2,nodes_per_rack=2,gpus_per_node=2"
REAL_TOPOLOGY = "gpus_per_node=2"
WORLD = 4


# ---------------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """One rank of the real runs (under torchrun): static, then online, same seed and batches."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_hybrid_ep as hep

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = np.load(args.data)["blocks"]
    per_rank = args.batch
    out: dict = {}
    for mode in ("static", "online"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(demo_config(wide=args.model == "wide"))
        model.train()
        online = mode == "online"
        config = hep.HybridEPConfig(dp_degree=1, ep_degree=world, topology=REAL_TOPOLOGY,
                                    rebalance_every=args.every if online else None,
                                    rebalance_replicas=world if online else 0,
                                    coactivation_stats=not args.balance_only)
        hep.parallelize(model, config)
        opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=3e-3)
        traces: dict[str, list] = {}
        for layer in hep.state_of(model).layers:
            original, name = layer.load.count, layer.name

            def count(index, dropped=0, _original=original, _name=name, _traces=traces):
                if torch.is_grad_enabled():
                    _traces.setdefault(_name, []).append(index.detach().reshape(-1, index.shape[-1]).clone())
                _original(index, dropped)

            layer.load.count = count
        losses, tables = [], []
        dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            lo = (step * world + rank) * per_rank
            ids = torch.tensor(blocks[lo % (len(blocks) - per_rank) :][:per_rank], dtype=torch.long)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            hep.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            tables.append({layer.name: [list(r) for r in layer.table.rows] for layer in hep.state_of(model).layers})
            hep.after_optimizer_step(model)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        seconds = time.perf_counter() - start
        rebalancer = hep.state_of(model).rebalancer
        gathered: list = [None] * world
        mine = {name: [t.numpy() for t in parts] for name, parts in traces.items()}
        dist.all_gather_object(gathered, mine)
        out[mode] = {
            "losses": losses, "seconds": seconds, "tables": tables,
            "events": [] if rebalancer is None else [
                {"step": e.step, "seconds": e.seconds, "fit_seconds": e.fit_seconds, "bytes_sent": e.bytes_sent,
                 "moved": e.moved,
                 "imbalance_before": e.imbalance_before, "imbalance_after": e.imbalance_after}
                for e in rebalancer.events],
        }
        if rank == 0:
            # per step and layer: the indices of every rank, concatenated in rank order
            steps = {name: [np.concatenate([g[name][s] for g in gathered]) for s in range(args.steps)]
                     for name in mine}
            np.savez_compressed(Path(args.out) / f"traces_{mode}.npz",
                                **{f"{name}|{s}": a for name, parts in steps.items() for s, a in enumerate(parts)})
        if online:  # every rank's bytes: the payload is per rank
            sent: list = [None] * world
            dist.all_gather_object(sent, [e.bytes_sent for e in rebalancer.events])
            out[mode]["bytes_sent_per_rank"] = sent
    if rank == 0:
        (Path(args.out) / "real.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- replay


def _load_traces(path: Path) -> dict[str, list[np.ndarray]]:
    data = np.load(path)
    out: dict[str, dict[int, np.ndarray]] = {}
    for key in data.files:
        name, step = key.rsplit("|", 1)
        out.setdefault(name, {})[int(step)] = data[key]
    return {name: [parts[s] for s in sorted(parts)] for name, parts in out.items()}


def _stats(indices: list[np.ndarray], num_experts: int, balance_only: bool = False):
    from hf_hybrid_ep.planning.placement import RoutingStats

    stats = RoutingStats.from_indices(indices, num_experts)
    if balance_only:  # what the library fits without co-activation statistics
        stats.coactivation = None
    return stats


def _per_step(traces: dict[str, list[np.ndarray]], tables_at, num_experts: int, topology: str) -> dict:
    """Per step: the worst layer's rank imbalance and cross-node dedup sends per token (summed over layers)."""
    from hf_hybrid_ep.planning.placement import imbalance, rank_loads, trace_traffic

    steps = len(next(iter(traces.values())))
    worst, cross = [], []
    for s in range(steps):
        imb, sends = [], 0.0
        for name, parts in traces.items():
            table = tables_at(name, s)
            index = parts[s]
            loads = np.bincount(index[index >= 0], minlength=num_experts)
            imb.append(imbalance(rank_loads(loads, table)))
            t = trace_traffic([index], table, topology)
            sends += t["cross_node"] / max(1, t["tokens"])
        worst.append(max(imb))
        cross.append(sends)
    return {"worst_layer_imbalance": worst, "cross_node_per_token": cross}


def replay(traces: dict[str, list[np.ndarray]], num_experts: int, top_k: int, every: int, ep: int,
           topology: str, replicas: int, tolerance: float = 0.05, balance_only: bool = False) -> dict[str, dict]:
    from hf_hybrid_ep.dispatch import PlacementTable
    from hf_hybrid_ep.moe.rebalance import refit
    from hf_hybrid_ep.planning.placement import fit_placement, hierarchical_placement

    names = list(traces)
    steps = len(traces[names[0]])
    half = steps // 2
    contiguous = PlacementTable.contiguous(num_experts, ep)
    summed = _stats([p for name in names for p in traces[name][:half]], num_experts, balance_only)
    one, _ = fit_placement(summed, ep, topology, replicas, tolerance)
    per_layer = {name: fit_placement(_stats(traces[name][:half], num_experts, balance_only), ep, topology, replicas,
                                     tolerance)[0]
                 for name in names}
    online: dict[str, list] = {name: [] for name in names}  # the table in force at each step
    current = {name: contiguous for name in names}
    since = 0
    for s in range(steps):
        for name in names:
            online[name].append(current[name])
        if (s + 1) % every == 0:  # after step s + 1, on the steps since the last rebalance
            for name in names:
                window = traces[name][since : s + 1]
                st = _stats(window, num_experts, balance_only)
                current[name] = refit(st.loads, st.coactivation, top_k, current[name], ep, topology, replicas,
                                      tolerance)
            since = s + 1
    # the floor of per-step imbalance: a balance-only table fitted on that very step (in-sample, unattainable)
    oracle = {name: [hierarchical_placement(np.bincount(p[p >= 0], minlength=num_experts) + 1e-9, ep, topology,
                                            replicas) for p in traces[name]] for name in names}
    methods = {
        "contiguous": lambda name, s: contiguous,
        "one static table": lambda name, s: one,
        "static per layer": lambda name, s: per_layer[name],
        "online": lambda name, s: online[name][s],
        "in-sample floor": lambda name, s: oracle[name][s],
    }
    out = {}
    for label, at in methods.items():
        series = _per_step(traces, at, num_experts, topology)
        second = slice(half, steps)
        out[label] = {**series,
                      "second_half_worst_imbalance_mean": float(np.mean(series["worst_layer_imbalance"][second])),
                      "second_half_worst_imbalance_max": float(np.max(series["worst_layer_imbalance"][second])),
                      "second_half_cross_node_per_token": float(np.mean(series["cross_node_per_token"][second]))}
    base = out["contiguous"]["second_half_cross_node_per_token"]
    for v in out.values():
        v["cross_node_vs_contiguous"] = v["second_half_cross_node_per_token"] / base if base else float("nan")
    return out


def _expert_flop_share(config) -> float:
    """Experts' share of a forward's matmul FLOPs per token (attention projections, experts, LM head)."""
    H, width, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = H * d * (heads + 2 * kv) + heads * d * H
    experts = k * 3 * H * width
    router = H * config.num_experts
    layers = config.num_hidden_layers
    return layers * experts / (layers * (attention + experts + router) + H * config.vocab_size)


def _parser() -> argparse.ArgumentParser:
    """The command line (``--worker``, ``--data`` and ``--out`` are set by the launch for the ranks)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("demo", "wide"), default="demo")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=10, help="rebalance every this many optimizer steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per rank and step")
    parser.add_argument("--balance-only", action="store_true", help="no co-activation statistics: the fits are "
                        "the hierarchical load-balanced packing alone (cheaper; not traffic-aware)")
    parser.add_argument("--json", type=Path, required=False)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser


def _run_real(args: argparse.Namespace) -> tuple[Path, float]:
    """The demo corpus in blocks of 64 tokens, then the static and online runs under torchrun (``WORLD``
    processes). → (their directory: ``real.json``, ``traces_static.npz``, ``traces_online.npz``; the
    ``time.time()`` at launch)."""
    work = Path(tempfile.mkdtemp(prefix="bench_rebalance_"))
    np.savez(work / "data.npz", blocks=demo_blocks(64, work / "tokenizer"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
           "-m", "benchmarks.bench_rebalance",
           "--worker", "--model", args.model, "--steps", str(args.steps), "--every", str(args.every),
           "--batch", str(args.batch), "--data", str(work / "data.npz"), "--out", str(work),
           *(["--balance-only"] if args.balance_only else [])]
    started = time.time()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # ``benchmarks`` in every rank
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    return work, started


def _real_figures(real: dict, static_traces, online_traces, config, steps: int) -> dict:
    """The real runs at EP 4: loss agreement, wall seconds, every rebalance's seconds and bytes, the worst-layer
    imbalance per step under the table in force (and its second-half mean), and the break-even interval (steps)."""
    E = config.num_experts
    real_static = _per_step(static_traces, lambda n, s: _table(real["static"]["tables"][s][n], E), E, REAL_TOPOLOGY)
    real_online = _per_step(online_traces, lambda n, s: _table(real["online"]["tables"][s][n], E), E, REAL_TOPOLOGY)
    half = steps // 2
    losses_rel = max(abs(a - b) / abs(b) for a, b in zip(real["online"]["losses"], real["static"]["losses"],
                                                         strict=True))
    events = real["online"]["events"]
    moved = [e for e in events if e["moved"]]
    rebalance_s = sum(e["seconds"] for e in events)
    share = _expert_flop_share(config)
    imb_before = float(np.mean([max(e["imbalance_before"].values()) for e in moved])) if moved else float("nan")
    imb_after = float(np.mean([max(e["imbalance_after"].values()) for e in moved])) if moved else float("nan")
    step_s = real["static"]["seconds"] / steps
    saved_per_step = step_s * share * (1 - imb_after / imb_before) if moved else 0.0
    per_rebalance = rebalance_s / max(1, len(events))
    return {
        "losses_max_rel_diff": losses_rel,
        "seconds_static": real["static"]["seconds"], "seconds_online": real["online"]["seconds"],
        "rebalances": len(events), "rebalances_moved": len(moved),
        "rebalance_seconds_total": rebalance_s, "rebalance_seconds_each": [e["seconds"] for e in events],
        "fit_seconds_total": sum(e["fit_seconds"] for e in events),
        "rebalance_share_of_online_time": rebalance_s / real["online"]["seconds"],
        "bytes_sent_per_rank": real["online"]["bytes_sent_per_rank"],
        "ep4_second_half_worst_imbalance_mean": {
            "contiguous (static run)": float(np.mean(real_static["worst_layer_imbalance"][half:])),
            "online": float(np.mean(real_online["worst_layer_imbalance"][half:]))},
        "ep4_worst_imbalance_per_step": {"static": real_static["worst_layer_imbalance"],
                                         "online": real_online["worst_layer_imbalance"]},
        "expert_flop_share": share,
        "break_even_steps": per_rebalance / saved_per_step if saved_per_step > 0 else None,
        "events": events,
    }


def main(argv: list[str] | None = None) -> int:
    """One rank (``--worker``), or the whole benchmark: the real runs, their figures, the replay at EP 8."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.steps < 2 or args.every < 1:
        parser.error(f"--steps {args.steps} must be ≥ 2 and --every {args.every} ≥ 1")
    work, started = _run_real(args)
    real = json.loads((work / "real.json").read_text())
    config = demo_config(wide=args.model == "wide")
    E, k = config.num_experts, config.num_experts_per_tok
    traces = _load_traces(work / "traces_online.npz")
    result = {
        "model": args.model, "steps": args.steps, "every": args.every, "world": WORLD,
        "balance_only": args.balance_only,
        "experts": E, "top_k": k, "layers": config.num_hidden_layers,
        "real": _real_figures(real, _load_traces(work / "traces_static.npz"), traces, config, args.steps),
        "replay_ep8": replay(traces, E, k, args.every, 8, SIM_TOPOLOGY, 8, balance_only=args.balance_only),
        "wall_s": time.time() - started,
    }
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0

def _table(rows, E):
    from hf_hybrid_ep.dispatch import PlacementTable

    return PlacementTable.from_rows(E, rows)


def _print(r: dict) -> None:
    real = r["real"]
    print(f"{r['model']}: {r['experts']} experts top-{r['top_k']}, {r['layers']} layers; {r['steps']} steps, "
          f"rebalance every {r['every']}; wall {r['wall_s']:.0f} s")
    print(f"  real world 4: losses online vs static max rel diff {real['losses_max_rel_diff']:.2e}; "
          f"{real['seconds_static']:.1f} s static, {real['seconds_online']:.1f} s online; {real['rebalances']} "
          f"rebalances ({real['rebalances_moved']} moved), {real['rebalance_seconds_total']:.3f} s = "
          f"{100 * real['rebalance_share_of_online_time']:.2f}% of the online run (fitting "
          f"{real['fit_seconds_total']:.3f} s); break-even "
          f"{real['break_even_steps']} steps")
    for label, v in real["ep4_second_half_worst_imbalance_mean"].items():
        print(f"  EP 4 {label}: worst-layer imbalance, second half mean {v:.3f}")
    print("  replay at simulated EP 8, r = 8 (second half): worst-layer imbalance mean / max; cross-node dedup "
          "sends per token (vs contiguous)")
    for label, v in r["replay_ep8"].items():
        print(f"    {label:18s} {v['second_half_worst_imbalance_mean']:.3f} / {v['second_half_worst_imbalance_max']:.3f};"
              f" {v['second_half_cross_node_per_token']:.3f} ({v['cross_node_vs_contiguous']:.2f}×)")


if __name__ == "__main__":
    sys.exit(main())
