"""The hierarchical dispatcher on the two-node fabric, side by side with the plain all-to-all.

    python -m benchmarks.bench_hierarchical --json benchmarks/results/bench_hierarchical.json

1. **Training run** (flat fabric, 4 ranks, pure EP 4, the plain dispatcher): the wide demo model (tiny
   Qwen3-MoE: 32 experts top-4, 4 layers, hidden 64) from random weights on the demo corpus for
   ``--train-steps`` steps (AdamW 3e-3, 8 × 64 tokens per rank and step); every step's top-k indices of
   every rank recorded; the trained model saved.
2. **Co-activation placement** per layer, fitted (``placement.fit_placement``, EP 4 over
   ``gpus_per_node=2``, no replicas) on the second half of the training run's routing. The predicted fall
   of the node-deduplicated cross-node sends against contiguous is ``trace_traffic`` on that routing.
3. **Two-node fabric** (2 network namespaces × 2 ranks, the veth between them shaped to
   ``--inter-node-gbit``; ``benchmarks.training.fabric.TwoNodeFabric``): pure EP 4 spanning both nodes, from the trained
   model, on the demo corpus, plain vs hierarchical dispatcher × contiguous vs co-activation placement.
   Per run: samples/s (median step), the cross-node all-to-all payload per step (the collective meter
   reads every exchange's split sizes), the dispatcher's own cross-node rows by phase, the rows
   ``trace_traffic`` predicts for the routing each rank sent in the timed steps (exact without replicas),
   and the bytes counted on the veth (which also carry the dense-gradient all-reduce and TCP framing).

Needs root for the namespaces (as ``bench_training``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common.demo import demo_blocks
from benchmarks.training.fabric import FlatFabric, TwoNodeFabric
from benchmarks.training.launch import run_layout
from benchmarks.training.report import machine_info
from benchmarks.training.runs import ModelArgs, RunSpec, StepArgs
from benchmarks.training.session import clean_start, scratch_checkpoint

WORLD = 4
TOPOLOGY = "gpus_per_node=2"
WIDE = ModelArgs(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_experts=32, moe_intermediate_size=32,
                 num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2)


def _corpus(path: Path, seq_len: int) -> None:
    """The demo corpus, tokenized by the demo tokenizer and packed into blocks of ``seq_len`` tokens."""
    blocks = demo_blocks(seq_len, path.parent / "tokenizer")
    if blocks.max() >= WIDE.vocab_size:
        raise SystemExit(f"the demo tokenizer's ids reach {blocks.max()}, beyond the model's vocabulary {WIDE.vocab_size}")
    np.savez(path, blocks=blocks)


def _traces(run: dict) -> list[dict[str, np.ndarray]]:
    """Per rank (EP rank = rank: pure EP), per layer: the ``[steps · tokens, k]`` indices of the timed steps."""
    return [dict(np.load(f)) for f in run["routing"]["trace_files"]]


def fit_coactivation(traces: list[dict[str, np.ndarray]], num_experts: int) -> dict:
    """Per layer, the co-activation placement fitted on the second half of every rank's routing, and the
    node-deduplicated cross-node rows ``trace_traffic`` predicts there for it and for contiguous."""
    from hf_hybrid_ep.dispatch import PlacementTable
    from hf_hybrid_ep.planning.placement import RoutingStats, fit_placement, trace_traffic

    contiguous = PlacementTable.contiguous(num_experts, WORLD)
    placement, predicted = {}, {"contiguous": 0.0, "coactivation": 0.0}
    for name in traces[0]:
        halves = [t[name][len(t[name]) // 2 :] for t in traces]
        table, method = fit_placement(RoutingStats.from_indices(halves, num_experts), WORLD, TOPOLOGY)
        assert method == "coactivation", method
        placement[name] = [list(r) for r in table.rows]
        for key, t in (("contiguous", contiguous), ("coactivation", table)):
            predicted[key] += trace_traffic(halves, t, TOPOLOGY, sources=list(range(WORLD)))["cross_node"]
    return {"placement": placement, "fit_sample_cross_node_rows": predicted,
            "predicted_ratio": predicted["coactivation"] / predicted["contiguous"]}


def summarize(run: dict) -> dict:
    """The figures of one two-node run that the comparison needs."""
    from hf_hybrid_ep.dispatch.stats import INTER_PHASES as inter

    phases = run["phases_per_step_all_ranks"]
    hierarchical = run["config"]["dispatcher"] == "hierarchical"
    predicted_rows = run["routing"]["predicted_cross_node_rows_per_step"]
    out = {
        "name": run["name"], "link_gbit": run.get("link_gbit"), "samples_per_s": run["samples_per_s"],
        "step_s": run["step_s"],
        "cross_node_a2a_bytes_per_step": run["a2a_inter_node_bytes_per_step"] * WORLD,  # the meter: mean per rank
        "veth_bytes_per_step": run["inter_node_bytes_per_step"],
        "exposed_comm_fraction": run["exposed_comm_fraction"],
        "predicted_node_rows_per_step": predicted_rows,
    }
    if hierarchical:
        rows = {p: phases[p]["remote_rows_sent"] for p in inter}
        width = {p: phases[p]["remote_bytes_sent"] / max(1, phases[p]["remote_rows_sent"]) for p in inter}
        out |= {"node_rows_per_step": rows, "row_bytes": width,
                # the prediction in bytes: the predicted rows at each exchange's row width (activations, plus the
                # routing weights and keys in the dispatch, the weights' gradients in its backward)
                "predicted_cross_node_bytes_per_step": predicted_rows * sum(width.values()),
                "rows_vs_predicted": rows["dispatch_inter"] / predicted_rows}
        out["bytes_vs_predicted"] = out["cross_node_a2a_bytes_per_step"] / out["predicted_cross_node_bytes_per_step"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("bench_hierarchical.json"))
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of every two-node run (after 2 warm-up)")
    parser.add_argument("--batch-per-rank", type=int, default=8, help="sequences of 64 tokens per rank and step")
    parser.add_argument("--inter-node-gbit", default="1.0,0.25", help="link rates of the two-node fabric, Gbit/s "
                        "(comma-separated; the co-activation placement runs at the first)")
    parser.add_argument("--inter-node-latency-ms", type=float, default=0.5)
    args = parser.parse_args(argv)
    started = time.monotonic()
    clean_start()
    report: dict = {"model": dataclasses.asdict(WIDE), "topology": TOPOLOGY, "machine": machine_info(),
                    "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    with scratch_checkpoint(WIDE) as (workdir, init):
        work = Path(workdir)
        data, trained = work / "data.npz", str(work / "trained")
        _corpus(data, 64)
        step = StepArgs(batch_per_rank=args.batch_per_rank, seq_len=64, warmup=1, steps=args.train_steps, lr=3e-3,
                           data=str(data), record_routing=True, save_to=trained)
        train = RunSpec("train-ep4", "hybrid", 1, WORLD, {"dispatcher": "torch", "topology": TOPOLOGY}, mem_limit=False)
        with FlatFabric(WORLD) as flat:
            report["fabrics"] = {"flat": flat.info}
            run = run_layout(train, flat, init, step, WORLD, str(work))
        if not run["feasible"]:
            raise SystemExit(f"training run failed: {run.get('error')}\n{run.get('traceback_tail')}")
        report["training"] = {"steps": args.train_steps, "step_s": run["step_s"], "samples_per_s": run["samples_per_s"]}
        fitted = fit_coactivation(_traces(run), WIDE.num_experts)
        report["coactivation"] = fitted
        print(f"[{time.monotonic() - started:5.0f}s] trained {args.train_steps} steps; co-activation placement: "
              f"predicted cross-node rows {fitted['predicted_ratio']:.3f}x contiguous on the fit sample", flush=True)
        step = dataclasses.replace(step, warmup=2, steps=args.steps, save_to=None)
        placements = {"contiguous": "contiguous", "coactivation": fitted["placement"]}

        def run(fabric, dispatcher: str, placement_name: str) -> None:
            spec = RunSpec(f"{fabric.name}-ep4-{dispatcher}-{placement_name}", "hybrid", 1, WORLD,
                              {"dispatcher": dispatcher, "topology": TOPOLOGY, "placement": placements[placement_name]})
            rec = run_layout(spec, fabric, trained, step, WORLD, str(work))
            if not rec["feasible"]:
                raise SystemExit(f"{spec.name} failed: {rec.get('error')}\n{rec.get('traceback_tail')}")
            rec["link_gbit"] = getattr(fabric, "gbit", None)
            report["runs"].append(rec)
            print(f"[{time.monotonic() - started:5.0f}s] {spec.name:38s} {rec['samples_per_s']:7.2f} samples/s, "
                  f"cross-node a2a {rec['a2a_inter_node_bytes_per_step'] * WORLD / 2**20:7.3f} MiB/step", flush=True)

        with FlatFabric(WORLD) as flat:  # the dispatchers' own cost, no link limit
            for dispatcher in ("torch", "hierarchical"):
                run(flat, dispatcher, "contiguous")
        for i, gbit in enumerate(float(g) for g in args.inter_node_gbit.split(",")):
            with TwoNodeFabric(WORLD, gbit, args.inter_node_latency_ms) as fabric:
                report["fabrics"][f"two-node {gbit:g} Gbit/s"] = fabric.info
                for placement_name in placements if i == 0 else ["contiguous"]:
                    for dispatcher in ("torch", "hierarchical"):
                        run(fabric, dispatcher, placement_name)
    report["summary"] = [summarize(r) for r in report["runs"]]
    report["comparison"] = compare(report["summary"], report["coactivation"]["predicted_ratio"])
    report["elapsed_s"] = time.monotonic() - started
    for r in report["runs"]:  # the trace files were in the removed work directory
        r["routing"].pop("trace_files", None)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["comparison"], indent=1))
    return 0


def compare(summary: list[dict], predicted_ratio: float) -> dict:
    """Ratios side by side per fabric, and the hierarchical dispatcher's goals as measured: cross-node bytes
    <= 0.75x the plain all-to-all's, samples/s >= 1.15x, bytes within 5% of ``trace_traffic``'s prediction."""
    by = {s["name"]: s for s in summary}
    out: dict = {"flat": {"samples_per_s_hier_over_plain": by["flat-ep4-hierarchical-contiguous"]["samples_per_s"]
                          / by["flat-ep4-torch-contiguous"]["samples_per_s"]}}
    flat_plain_s = by["flat-ep4-torch-contiguous"]["step_s"]
    rates = sorted({s["link_gbit"] for s in summary if s["link_gbit"] is not None}, reverse=True)
    for gbit in rates:
        for placement in ("contiguous", "coactivation"):
            plain = next((s for s in summary if s["link_gbit"] == gbit and s["name"].endswith(f"torch-{placement}")), None)
            hier = next((s for s in summary if s["link_gbit"] == gbit
                         and s["name"].endswith(f"hierarchical-{placement}")), None)
            if plain is None or hier is None:
                continue
            out[f"two-node {gbit:g} Gbit/s, {placement}"] = {
                "cross_node_bytes_hier_over_plain": hier["cross_node_a2a_bytes_per_step"]
                / plain["cross_node_a2a_bytes_per_step"],
                "samples_per_s_hier_over_plain": hier["samples_per_s"] / plain["samples_per_s"],
                "hier_bytes_vs_prediction": hier["bytes_vs_predicted"],
                "hier_rows_vs_prediction": hier["rows_vs_predicted"],
                # pure EP's cross-node exchange time at the link rate over the flat fabric's step time
                "r_x_plain": plain["cross_node_a2a_bytes_per_step"] / WORLD / (gbit * 1e9 / 8 / (WORLD // 2))
                / flat_plain_s,
            }
    first = f"two-node {rates[0]:g} Gbit/s"
    hc = next(s for s in summary if s["link_gbit"] == rates[0] and s["name"].endswith("hierarchical-contiguous"))
    hx = next(s for s in summary if s["link_gbit"] == rates[0] and s["name"].endswith("hierarchical-coactivation"))
    out["coactivation_vs_contiguous_hier_bytes"] = {
        "measured": hx["cross_node_a2a_bytes_per_step"] / hc["cross_node_a2a_bytes_per_step"],
        "predicted_on_the_fit_sample": predicted_ratio,
        "predicted_on_the_measured_routing": hx["predicted_node_rows_per_step"] / hc["predicted_node_rows_per_step"]}
    pairs = [v for k, v in out.items() if k.startswith("two-node")]
    speed = {k: v["samples_per_s_hier_over_plain"] for k, v in out.items() if k.startswith("two-node")}
    out["goals"] = {
        "bytes <= 0.75x plain (top-4)": {"measured": out[f"{first}, contiguous"]["cross_node_bytes_hier_over_plain"],
                                         "met": out[f"{first}, contiguous"]["cross_node_bytes_hier_over_plain"] <= 0.75},
        "samples/s >= 1.15x plain": {"measured": speed, "met": {k: v >= 1.15 for k, v in speed.items()}},
        "bytes within 5% of trace_traffic": {"measured": [v["hier_bytes_vs_prediction"] for v in pairs],
                                             "met": all(abs(v["hier_bytes_vs_prediction"] - 1) <= 0.05 for v in pairs)},
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
