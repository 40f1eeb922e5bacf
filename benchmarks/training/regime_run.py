"""``--regime`` and ``--reevaluate``: one named regime of :mod:`.regimes` end to end (the calibration
run on the flat fabric, the link rate it implies, the regime's runs on the two-node fabric), and its ratios,
step-time predictions and goals (``regimes.evaluate``)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from . import regimes as rg
from .fabric import FlatFabric, TwoNodeFabric
from .goals import exchange_side_by_side, goals, same_layout_vs_native
from .launch import run_layout
from .report import chart, new_report, table, write_json
from .runs import ModelArgs, RunSpec, StepArgs, default_runs, model_bytes
from .session import clean_start, run_logged, scratch_checkpoint

WORLD = 4  # ranks of every regime run: two nodes of two on the two-node fabric
HYBRID_OVER_PURE_EP_GOAL = {"fine-grained": 1.5, "coarse": 1.0}  # samples/s, the best arm of each
SAME_LAYOUT_GOAL = 1.5  # our best dp2×ep2 arm over transformers' native EP at that layout, samples/s
NATIVE_SAME_LAYOUT = "hf-native-hsdp2x2-ep2"
DEDUP_BYTES_GOAL = {"fine-grained": 0.35}  # deduplicated / per-pair token-exchange bytes per step at dp2×ep2


def memory_rate_gbps(seconds: float = 1.0) -> float:
    """Bytes read + written per second by a large tensor copy on this machine (the optimizer term's rate)."""
    import torch

    src, dst = torch.empty(2**25), torch.empty(2**25)  # 128 MiB each
    dst.copy_(src)
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - t))
    return statistics.median(rates) / 1e9


def _calibration_run(spec: RunSpec, step: StepArgs, ckpt: str, workdir: str) -> tuple[dict[str, Any], dict]:
    """``spec`` trained on the flat fabric (all ``WORLD`` ranks on one node); → (the fabric's info, the run)."""
    with FlatFabric(WORLD) as flat:
        run = run_layout(spec, flat, ckpt, step, WORLD, workdir)
        return flat.info, run


def _link_gbit(regime, counts, calibration: dict[str, Any], memory_gbps: float) -> float:
    """The inter-node rate (Gbit/s) at which pure EP's predicted cross-node exchange is ``regime.target_r_x`` × the
    calibrated compute time per step."""
    pure_ep = rg.predict({"engine": "hybrid", "dp": 1, "ep": WORLD, "config": {}}, counts, regime, calibration,
                         {"kind": "two-node", "ranks_per_node": WORLD // 2, "measured_gbit": 1.0}, memory_gbps)
    cross = pure_ep.a2a_bytes["inter_node"]
    return rg.link_gbit_for(regime.target_r_x, cross, WORLD // 2, calibration["compute_s"])


def run_regime(regime, args) -> None:
    """One regime: the calibration run on the flat fabric, the link rate it implies, the table on the two-node
    fabric, target vs achieved ratios, and the step-time model's predictions against every run."""
    from hf_hybrid_ep.planning.planner import count_parameters

    started = time.monotonic()
    model_args = ModelArgs(**regime.model)
    counts = count_parameters(model_args.hf_config())
    sizes = model_bytes(model_args)
    budget = rg.memory_budget(counts, regime)
    shapes = rg.t_over_t_star(regime)
    steps = args.steps or 2  # 8 runs of 4 steps of many micro-batches: ≤ 10 minutes on 2 cores
    step = StepArgs(batch_per_rank=regime.batch_per_rank, seq_len=regime.seq_len, warmup=args.warmup or 1, steps=steps,
                    grad_accum=regime.grad_accum, mem_budget_bytes=budget["budget_bytes"])
    specs = {s.name: s for s in default_runs(WORLD)}
    memory_gbps = memory_rate_gbps()
    report: dict[str, Any] = {
        "regime": {"name": regime.name, "reference": regime.reference, "targets": {
            "T_over_T_star": regime.target_t_over_t_star, "r_x": regime.target_r_x, "mfu_assumed": 0.4},
            "shapes": shapes, "memory_budget": budget, "memory_gbps": memory_gbps}} | new_report(model_args, sizes, step)
    print(f"regime {regime.name}: T = {shapes['T']}, T* = {shapes['T_star']:.1f}, T/T* = {shapes['T_over_T_star']:.2f} "
          f"(target {regime.target_t_over_t_star}); memory budget {budget['budget_bytes'] / rg.MIB:.0f} MiB per rank "
          f"(1.5 × planner {budget['planner_hybrid_bytes'] / rg.MIB:.1f} MiB + 128 MiB)", flush=True)
    clean_start()
    with scratch_checkpoint(model_args) as (workdir, ckpt):
        report["fabrics"]["flat"], cal_run = _calibration_run(specs[rg.CALIBRATION_RUN], step, ckpt, workdir)
        report["runs"].append(cal_run)
        if not cal_run["feasible"]:
            raise SystemExit(f"calibration run {rg.CALIBRATION_RUN} failed: {cal_run.get('error')}")
        calibration = rg.calibrate(cal_run, counts, regime, memory_gbps)
        gbit = _link_gbit(regime, counts, calibration, memory_gbps)
        report["regime"]["calibration"] = calibration
        report["regime"]["link_gbit_chosen"] = gbit
        print(f"[{time.monotonic() - started:6.0f}s] calibration ({rg.CALIBRATION_RUN}, flat): compute "
              f"{calibration['compute_s']:.2f} s/step, {calibration['flops_per_s'] / 1e9:.1f} GFLOP/s per rank, loopback "
              f"{calibration['intra_gbps']:.2f} GB/s; link for r_x = {regime.target_r_x}: {gbit:.3f} Gbit/s", flush=True)
        with TwoNodeFabric(WORLD, gbit, args.inter_node_latency_ms) as fabric:
            report["fabrics"]["two-node"] = fabric.info
            print(f"[{time.monotonic() - started:6.0f}s] fabric two-node: {fabric.info}", flush=True)
            for name in regime.runs:
                run_logged(specs[name], fabric, ckpt, step, WORLD, workdir, report, started)
    report["elapsed_s"] = time.monotonic() - started
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    regime_results(report, regime)
    write_json(report, args.json)
    with contextlib.suppress(Exception):
        chart([r for r in report["runs"] if r["fabric"] == "two-node"], args.chart,
              f"regime {regime.name}: Qwen3-MoE {model_args.num_experts} experts top-{model_args.num_experts_per_tok}, "
              f"expert width {model_args.moe_intermediate_size}; T/T* {shapes['T_over_T_star']:.1f}; "
              f"two-node link {gbit:.2f} Gbit/s")
    print(table(report["runs"]))
    _print_summary(report)
    print(f"elapsed {report['elapsed_s']:.0f} s")


def regime_results(report: dict, regime) -> None:
    """Achieved ratios and the step-time model's predictions (``regimes.evaluate``), and the goals on the two-node
    fabric, each with the arm that reached it: the best hybrid arm over the best pure-EP arm, our best arm at
    the layout of transformers' native HSDP 2×2 + EP 2 over it, and the deduplicated exchange's token bytes at
    dp2×ep2 over the per-pair exchange's."""
    evaluated = rg.evaluate(report)
    for r in report["runs"]:
        r["predicted"] = evaluated["predictions"].get(r["key"])
    two = [r for r in report["runs"] if r["fabric"] == "two-node"]
    g = goals(two).get("two-node", {})
    out = {k: v for k, v in g.items() if k.startswith(("hybrid_best", "pure_ep_best", "ours_best", "native_best"))}
    want = HYBRID_OVER_PURE_EP_GOAL.get(regime.name)
    if want and "hybrid_best_vs_pure_ep" in g:
        out[f"goal_hybrid_ge_{want}x_pure_ep"] = g["hybrid_best_vs_pure_ep"] >= want
    out["same_layout_vs_native"] = same = same_layout_vs_native(two)
    if NATIVE_SAME_LAYOUT in same:
        out[f"goal_same_layout_ge_{SAME_LAYOUT_GOAL}x_native"] = same[NATIVE_SAME_LAYOUT]["ratio"] >= SAME_LAYOUT_GOAL
    out["exchange"] = exchange = exchange_side_by_side(two)
    most = DEDUP_BYTES_GOAL.get(regime.name)
    if most and "2x2" in exchange:
        out[f"goal_dedup_bytes_le_{most}x_per_pair_dp2xep2"] = (
            exchange["2x2"]["a2a_bytes_per_step"]["dedup_over_per_pair"] <= most)
    out |= {k: v for k, v in evaluated.items() if k.startswith("predicted_hybrid_vs_pure_ep")}
    report["regime"] |= {"calibration": evaluated["calibration"], "achieved": evaluated["achieved"], "goals": out,
                         "validation": evaluated["validation"]}


def reevaluate(path: str) -> None:
    """Recompute a regime report's ratios, predictions and goals with the current code (the measured runs kept as
    they are), rewrite the file and print the summary."""
    report = json.loads(Path(path).read_text())
    regime_results(report, rg.REGIMES[report["regime"]["name"]])
    write_json(report, path)
    _print_summary(report)


def _print_summary(report: dict) -> None:
    """The regime's achieved ratios, goals and validation of the step-time model, as indented JSON."""
    print(json.dumps({k: report["regime"][k] for k in ("achieved", "goals", "validation")}, indent=1))
