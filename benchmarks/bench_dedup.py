"""The deduplicated exchange side by side with the per-pair one, on the flat and the two-node fabric.

    python -m benchmarks.bench_dedup --json benchmarks/results/bench_dedup.json

1. **Training run** (flat fabric, 4 ranks, pure EP 4, per-pair exchange): the wide demo model (tiny
   Qwen3-MoE: 32 experts top-4, 4 layers, hidden 64) from random weights on the demo corpus for
   ``--train-steps`` steps (AdamW 3e-3, 8 × 64 tokens per rank and step); every step's top-k indices of
   every rank recorded; the trained model saved.
2. **Co-activation placement** per layer, fitted (``placement.fit_placement``, EP 4 over
   ``gpus_per_node=2``, no replicas) on the second half of the training run's routing.
3. **Timed runs** of pure EP 4 from the trained model on the demo corpus, per-pair (``dispatcher="torch"``:
   one row per (token, expert) pair) against deduplicated (``"dedup"``: one row per token and destination
   rank, across nodes one per token and node first), each fabric defining the nodes: the **flat** fabric
   (one node of 4 ranks on loopback: the rank level alone, no link limit) and the **two-node** fabric (2
   network namespaces × 2 ranks, the veth between them shaped to each ``--inter-node-gbit``;
   ``benchmarks.training.fabric.TwoNodeFabric``), contiguous placement, and at the first rate the
   co-activation placement too. Per run: samples/s (median step), the token-exchange payload per step
   across and inside the nodes (the collective meter reads every exchange's split sizes: activations,
   and the deduplicated rows' routing weights and keys), the dispatcher's own rows by phase, the rows
   ``trace_traffic`` predicts for the routing each rank sent in the timed steps (``cross_node`` and
   ``rank_rows`` for the deduplicated exchange, ``pairs_remote`` for the per-pair one; exact without
   replicas) and their bytes at the exchanges' row widths (:func:`row_bytes`), the exposed communication.

Needs root for the namespaces (as ``bench_training``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
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
TOPOLOGY = "gpus_per_node=2"  # the two-node fabric's nodes, for which the co-activation placement is fitted
WIDE = ModelArgs(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_experts=32, moe_intermediate_size=32,
                 num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2)
DISPATCHERS = ("torch", "dedup")  # per-pair, deduplicated
KEY_BYTES = 2  # the deduplicated rows' slot keys are int16 at these shapes (ranks of a node × slots < 2**15)
TOLERANCE = 0.05  # measured rows and bytes against trace_traffic's


def row_bytes(hidden: int, top_k: int, dedup: bool, value_bytes: int = 4) -> int:
    """Bytes one row sends over its four exchanges (dispatch, combine and both backward exchanges):
    ``hidden`` activations each; a deduplicated row also carries its ``top_k`` routing weights and keys in
    the dispatch and the weights' gradients in the dispatch's backward (the combine carries none)."""
    metadata = top_k * (value_bytes + KEY_BYTES) + top_k * value_bytes if dedup else 0
    return 4 * hidden * value_bytes + metadata


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
    cross-node node rows ``trace_traffic`` predicts there for it and for contiguous."""
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


def _ratio(measured: float, predicted: float) -> float:
    return 1.0 if measured == predicted == 0 else (measured / predicted if predicted else math.inf)


def check_against_trace(run: dict) -> dict[str, dict]:
    """Per row kind the exchange sends — node rows across and rank rows inside the nodes (deduplicated), or
    pair rows (per-pair) — the dispatcher's rows and the meter's bytes per step (all ranks) against
    ``trace_traffic``'s rows and those rows at :func:`row_bytes`."""
    dedup = run["config"]["dispatcher"] == "dedup"
    phases, predicted = run["phases_per_step_all_ranks"], run["routing"]["predicted_rows_per_step"]
    cross, inside = (run[f"a2a_{k}_node_bytes_per_step"] * WORLD for k in ("inter", "intra"))  # meter: mean per rank
    if dedup:  # stage A's rows cross, stage B's stay inside a node
        measured = {"cross_node": (phases["dispatch_inter"]["remote_rows_sent"], cross),
                    "rank_rows": (phases["dispatch"]["remote_rows_sent"], inside)}
    else:
        measured = {"pairs_remote": (phases["dispatch"]["remote_rows_sent"], cross + inside)}
    width = row_bytes(WIDE.hidden_size, WIDE.num_experts_per_tok, dedup)
    out = {}
    for key, (rows, nbytes) in measured.items():
        out[key] = {"rows": rows, "predicted_rows": predicted[key], "rows_vs_predicted": _ratio(rows, predicted[key]),
                    "bytes": nbytes, "predicted_bytes": predicted[key] * width,
                    "bytes_vs_predicted": _ratio(nbytes, predicted[key] * width)}
    return out


def summarize(run: dict) -> dict:
    """The figures of one timed run that the comparison needs."""
    cross, inside = (run[f"a2a_{k}_node_bytes_per_step"] * WORLD for k in ("inter", "intra"))
    return {"name": run["name"], "fabric": run["fabric"], "link_gbit": run.get("link_gbit"),
            "dispatcher": run["config"]["dispatcher"], "placement": run["placement_name"],
            "samples_per_s": run["samples_per_s"], "step_s": run["step_s"],
            "cross_node_bytes_per_step": cross, "intra_node_bytes_per_step": inside,
            "token_bytes_per_step": cross + inside, "veth_bytes_per_step": run["inter_node_bytes_per_step"],
            "exposed_comm_s_per_step": run["exposed_comm_s_per_step"],
            "exposed_comm_fraction": run["exposed_comm_fraction"],
            "exposed_comm_by_op_s_per_step": run["exposed_comm_by_op_s_per_step"],
            "vs_trace_traffic": check_against_trace(run), "load_avg_1min": run["load_avg_1min"]}


def _label(s: dict) -> str:
    return "flat" if s["link_gbit"] is None else f"two-node {s['link_gbit']:g} Gbit/s"


def _side_by_side(per_pair: dict, dedup: dict, flat_step_s: float) -> dict:
    """Deduplicated over per-pair, one fabric and placement; ``r_x``: the per-pair run's cross-node bytes at
    the link rate (shared by a node's ranks) over the flat per-pair run's step time."""
    out = {f"{k}_dedup_over_per_pair": _ratio(dedup[k], per_pair[k]) if per_pair[k] else None
           for k in ("token_bytes_per_step", "cross_node_bytes_per_step", "intra_node_bytes_per_step", "samples_per_s")}
    out["exposed_comm_s_per_step"] = {"per_pair": per_pair["exposed_comm_s_per_step"],
                                      "dedup": dedup["exposed_comm_s_per_step"]}
    if per_pair["link_gbit"] is not None:
        link_bytes_per_s = per_pair["link_gbit"] * 1e9 / 8
        out["r_x_per_pair"] = per_pair["cross_node_bytes_per_step"] / link_bytes_per_s / flat_step_s
    return out


def compare(summary: list[dict], fit_ratio: float) -> dict:
    """Deduplicated over per-pair per fabric and placement (bytes across, inside, in all; samples/s; exposed
    communication), the co-activation placement's cross-node bytes, and the goal as measured: rows and bytes
    within 5% of ``trace_traffic``'s prediction."""
    by = {(_label(s), s["placement"], s["dispatcher"]): s for s in summary}
    flat_step_s = by["flat", "contiguous", "torch"]["step_s"]
    out: dict = {}
    for label, placement, _ in sorted(by):
        if (label, placement, "dedup") in by and f"{label}, {placement}" not in out:
            out[f"{label}, {placement}"] = _side_by_side(by[label, placement, "torch"], by[label, placement, "dedup"],
                                                         flat_step_s)
    first = _label(next(s for s in summary if s["placement"] == "coactivation"))
    measured = {p: by[first, p, "dedup"]["cross_node_bytes_per_step"] for p in ("contiguous", "coactivation")}
    predicted = {p: by[first, p, "dedup"]["vs_trace_traffic"]["cross_node"]["predicted_rows"]
                 for p in ("contiguous", "coactivation")}
    out["coactivation_vs_contiguous_dedup_cross_node_bytes"] = {
        "measured": measured["coactivation"] / measured["contiguous"],
        "predicted_on_the_measured_routing": predicted["coactivation"] / predicted["contiguous"],
        "predicted_on_the_fit_sample": fit_ratio}
    checks = {f"{s['name']}/{key}": c for s in summary for key, c in s["vs_trace_traffic"].items()}
    worst = max(abs(c[k] - 1) for c in checks.values() for k in ("rows_vs_predicted", "bytes_vs_predicted"))
    out["goals"] = {"rows and bytes = trace_traffic ± 5%": {"worst_deviation": worst, "met": worst <= TOLERANCE,
                                                           "checked": sorted(checks)}}
    return out


def _train(args: argparse.Namespace, work: Path, init: str, report: dict, started: float) -> tuple[str, dict]:
    """The training run from ``init`` on the flat fabric and the co-activation placement fitted on its routing;
    → (the trained checkpoint, the fit)."""
    data, trained = work / "data.npz", str(work / "trained")
    step = StepArgs(batch_per_rank=args.batch_per_rank, seq_len=64, warmup=1, steps=args.train_steps, lr=3e-3,
                    data=str(data), record_routing=True, save_to=trained)
    train = RunSpec("train-ep4", "hybrid", 1, WORLD, {"dispatcher": "torch"}, mem_limit=False)
    with FlatFabric(WORLD) as flat:
        report["fabrics"] = {"flat": flat.info}
        run = run_layout(train, flat, init, step, WORLD, str(work))
    if not run["feasible"]:
        raise SystemExit(f"training run failed: {run.get('error')}\n{run.get('traceback_tail')}")
    report["training"] = {"steps": args.train_steps, "step_s": run["step_s"], "samples_per_s": run["samples_per_s"]}
    fitted = fit_coactivation(_traces(run), WIDE.num_experts)
    print(f"[{time.monotonic() - started:5.0f}s] trained {args.train_steps} steps; co-activation placement: "
          f"predicted cross-node rows {fitted['predicted_ratio']:.3f}x contiguous on the fit sample", flush=True)
    return trained, fitted


def _timed(args: argparse.Namespace, work: Path, trained: str, fitted: dict, report: dict, started: float) -> None:
    """Per-pair and deduplicated, from the trained model, on every fabric (and placement at the first rate)."""
    step = StepArgs(batch_per_rank=args.batch_per_rank, seq_len=64, warmup=2, steps=args.steps, lr=3e-3,
                    data=str(work / "data.npz"), record_routing=True)
    placements = {"contiguous": "contiguous", "coactivation": fitted["placement"]}

    def run(fabric, placement_name: str) -> None:
        for dispatcher in DISPATCHERS:
            spec = RunSpec(f"{fabric.name}-ep4-{dispatcher}-{placement_name}", "hybrid", 1, WORLD,
                           {"dispatcher": dispatcher, "placement": placements[placement_name]})
            rec = run_layout(spec, fabric, trained, step, WORLD, str(work))
            if not rec["feasible"]:
                raise SystemExit(f"{spec.name} failed: {rec.get('error')}\n{rec.get('traceback_tail')}")
            rec |= {"link_gbit": getattr(fabric, "gbit", None), "placement_name": placement_name}
            rec["routing"].pop("trace_files")  # in the work directory, removed at the end
            report["runs"].append(rec)
            print(f"[{time.monotonic() - started:5.0f}s] {spec.name:32s} {rec['samples_per_s']:7.2f} samples/s, "
                  f"token exchange {(rec['a2a_inter_node_bytes_per_step'] + rec['a2a_intra_node_bytes_per_step']) * WORLD / 2**20:7.3f} "
                  f"MiB/step ({rec['a2a_inter_node_bytes_per_step'] * WORLD / 2**20:.3f} across); load average "
                  f"{rec['load_avg_1min']['start']:.1f} → {rec['load_avg_1min']['end']:.1f}", flush=True)

    with FlatFabric(WORLD) as flat:  # one node: the rank level alone, no link limit
        run(flat, "contiguous")
    for i, gbit in enumerate(float(g) for g in args.inter_node_gbit.split(",")):
        with TwoNodeFabric(WORLD, gbit, args.inter_node_latency_ms) as fabric:
            report["fabrics"][f"two-node {gbit:g} Gbit/s"] = fabric.info
            for placement_name in placements if i == 0 else ["contiguous"]:
                run(fabric, placement_name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("bench_dedup.json"))
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of every run (after 2 warm-up)")
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
        _corpus(work / "data.npz", 64)
        trained, fitted = _train(args, work, init, report, started)
        report["coactivation"] = fitted
        _timed(args, work, trained, fitted, report, started)
    report["summary"] = [summarize(r) for r in report["runs"]]
    report["comparison"] = compare(report["summary"], fitted["predicted_ratio"])
    report["machine"]["load_avg_at_end"] = list(os.getloadavg())
    report["elapsed_s"] = time.monotonic() - started
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["comparison"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
