"""Training throughput side by side: hybrid EP vs pure DP vs pure EP vs transformers' native EP.

One invocation trains the same Qwen3-MoE model (built from its transformers config, random weights saved
once as a safetensors checkpoint) on the same synthetic data under every layout of ``--world`` ranks and
on two fabrics:

* **flat**: all ranks in one network namespace, every byte over loopback;
* **two-node**: two network namespaces ("nodes") of ``world / 2`` ranks each, joined by a veth pair
  shaped by ``tc`` (token-bucket ``tbf`` at ``--inter-node-gbit``; ``netem`` delay of
  ``--inter-node-latency-ms`` where the kernel has it). gloo binds to the node's veth address, so traffic
  between ranks of one node goes to a local address (the kernel carries it over loopback) and only traffic
  to the other node crosses the shaped veth. Interface byte counters (``/sys/class/net``) measure both.

Each run is a fresh set of processes (one per rank) under a per-process memory limit (``RLIMIT_DATA`` set
to the process's data size after imports and process-group setup plus ``--mem-budget-mib``; default: 4.5 ×
one full replica's parameter bytes, i.e. its parameters + gradients + AdamW moments and half a replica more,
so a full replica, which also needs gradient all-reduce buffers and activations, does not fit). A run whose
ranks fail to allocate is recorded as infeasible with the error.

Per run: samples/s and tokens/s (median over timed steps after warm-up), parameter / gradient / optimizer
bytes per rank, peak RSS per rank, bytes handed to all-to-all and to the gradient collectives per step
(all-to-all split into intra- and inter-node by the split sizes), bytes measured on the inter-node link,
and the fraction of step time with a gloo collective in flight (from a ``torch.profiler`` step).

Needs root for the namespaces (``ip netns``, ``tc``); ``--fabrics flat --no-netns`` runs without.

    python -m benchmarks.bench_training --quick --json bench_training.json --chart docs/img/bench_training.png
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time

from .fabric import Fabric, FlatFabric, TwoNodeFabric
from .goals import check_param_formula, goals, overlap_goals
from .regime_run import reevaluate, run_regime
from .regimes import REGIMES
from .report import chart, new_report, table, write_json
from .runs import AUTO_BUDGET_REPLICAS, ModelArgs, RunSpec, StepArgs, default_runs, model_bytes
from .session import clean_start, run_logged, scratch_checkpoint
from .worker import worker


def build_parser() -> argparse.ArgumentParser:
    """The command line: what to run (``--regime``, ``--fabrics``, ``--runs``, …), the model's fields, the outputs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (under 10 minutes on 2 cores)")
    parser.add_argument("--json", default="bench_training.json")
    parser.add_argument("--chart", default="bench_training.png")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reevaluate", metavar="JSON", default=None,
                        help="recompute a regime report's ratios, predictions and goals with the current code (the "
                             "measured runs are kept as they are) and rewrite the file")
    parser.add_argument("--regime", choices=sorted(REGIMES), default=None,
                        help="a named regime (benchmarks/training/regimes.py): sets the model shape, the workload, the memory "
                             "budget and the link rate; runs the calibration run on the flat fabric, then the table "
                             "on the two-node fabric, and checks the step-time model against it")
    parser.add_argument("--fabrics", default="flat,two-node")
    parser.add_argument("--runs", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--hybrid-config", default="{}",
                        help='JSON of HybridEPConfig fields added to every hybrid run, e.g. \'{"bucket_size_mb": 5}\'')
    parser.add_argument("--no-netns", action="store_true", help="flat fabric in the host namespace (no root)")
    parser.add_argument("--inter-node-gbit", type=float, default=1.0)
    parser.add_argument("--inter-node-latency-ms", type=float, default=0.5)
    parser.add_argument("--mem-budget-mib", default="auto",
                        help="RLIMIT_DATA above the post-setup data size; 'auto' = 4.5 × one full replica's "
                             "parameter bytes (its params + grads + AdamW state, plus half for activations); "
                             "'none' = no limit")
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (gradients synchronized once per step)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    for f in dataclasses.fields(ModelArgs):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    return parser


def _has_root_tools() -> bool:
    """Root, with ``ip`` and ``tc`` on the PATH (network namespaces and the shaped link)."""
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


def _step_args(args: argparse.Namespace, sizes: dict[str, int]) -> StepArgs:
    """Step settings from the command line; the memory budget (bytes) from ``--mem-budget-mib`` and the model's
    total parameter bytes ``sizes["total_bytes"]``."""
    budget = (None if args.mem_budget_mib == "none" else
              int(AUTO_BUDGET_REPLICAS * sizes["total_bytes"]) if args.mem_budget_mib == "auto"
              else int(float(args.mem_budget_mib) * 2**20))
    steps = args.steps or (3 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    return StepArgs(batch_per_rank=args.batch_per_rank, seq_len=args.seq_len, warmup=warmup, steps=steps,
                    grad_accum=args.grad_accum, mem_budget_bytes=budget)


def _selected_runs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[RunSpec]:
    """The default runs of ``--world`` with ``--hybrid-config`` added to every hybrid one, narrowed to ``--runs``."""
    specs = default_runs(args.world)
    extra = json.loads(args.hybrid_config)
    specs = [dataclasses.replace(r, config={**extra, **r.config}) if r.engine == "hybrid" else r for r in specs]
    if args.runs:
        wanted = args.runs.split(",")
        unknown = set(wanted) - {s.name for s in specs}
        if unknown:
            parser.error(f"unknown run names {sorted(unknown)}; known: {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in wanted]
    return specs


def _fabric(name: str, args: argparse.Namespace) -> Fabric:
    """The fabric named ``name`` (``flat`` or ``two-node``) of ``--world`` ranks."""
    if name == "flat":
        return FlatFabric(args.world, netns=not args.no_netns)
    return TwoNodeFabric(args.world, args.inter_node_gbit, args.inter_node_latency_ms)


def run_sweep(args: argparse.Namespace, model_args: ModelArgs, specs: list[RunSpec]) -> None:
    """Every run of ``specs`` on every fabric of ``--fabrics``; the checks and goals, the JSON, the chart, the table.
    Exits with 1 when a hybrid rank's parameter bytes are not dense + experts / ep."""
    sizes = model_bytes(model_args)
    step = _step_args(args, sizes)
    report = new_report(model_args, sizes, step)
    started = time.monotonic()
    clean_start()
    with scratch_checkpoint(model_args) as (workdir, ckpt):
        for name in args.fabrics.split(","):
            with _fabric(name, args) as fabric:
                report["fabrics"][fabric.name] = fabric.info
                print(f"[{time.monotonic() - started:6.0f}s] fabric {fabric.name}: {fabric.info}", flush=True)
                for spec in specs:
                    run_logged(spec, fabric, ckpt, step, args.world, workdir, report, started)
    report["elapsed_s"] = time.monotonic() - started
    failures = check_param_formula(report["runs"], sizes)
    report["param_bytes_formula"] = {"ok": not failures, "failures": failures}
    report["goals"] = goals(report["runs"])
    report["overlap_goals"] = overlap_goals(report["runs"], report["fabrics"])
    write_json(report, args.json)
    with contextlib.suppress(Exception):
        chart(report["runs"], args.chart,
              f"Qwen3-MoE {model_args.num_experts} experts, hidden {model_args.hidden_size}, {model_args.num_hidden_layers} "
              f"layers; world {args.world}; two-node link {args.inter_node_gbit} Gbit/s")
    print(table(report["runs"]))
    print(json.dumps(report["goals"], indent=1))
    print(json.dumps(report["overlap_goals"], indent=1))
    print(f"parameter bytes = dense + experts/ep on every hybrid rank: {'yes' if not failures else failures}")
    print(f"elapsed {report['elapsed_s']:.0f} s")
    if failures:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run what it asks: one rank (``--worker``), a re-evaluation, a regime, or the
    sweep of runs × fabrics."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.reevaluate:
        reevaluate(args.reevaluate)
        return
    if args.regime:
        if not _has_root_tools():
            parser.error("--regime needs root with `ip` and `tc` (the two-node fabric)")
        run_regime(REGIMES[args.regime], args)
        return
    needs_root = "two-node" in args.fabrics.split(",") or not args.no_netns
    if needs_root and not _has_root_tools():
        parser.error("the two-node fabric and the flat fabric's private namespace need root with `ip` and `tc`; "
                     "without them use --fabrics flat --no-netns")
    model_args = ModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs)})
    run_sweep(args, model_args, _selected_runs(parser, args))
