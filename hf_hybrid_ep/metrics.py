"""Expert-load metrics: per-layer statistics, a JSONL log, and plots.

The counters are reduced over the world once per optimizer step (:func:`hf_hybrid_ep.after_optimizer_step`),
so every figure here is the same on every rank and does not depend on the layout (with capacity
off). Definitions, per layer over the window since the last report:

* ``tokens_per_expert``: routed (token, k) assignments each expert received;
* ``tokens_per_rank``: the same summed over the experts each EP rank holds (an expert's tokens split
  evenly over its replicas);
* ``placement``: the layer's placement table at the report (rows: the experts of each EP rank; with
  online rebalancing it changes over the run);
* ``imbalance_expert`` / ``imbalance_rank``: max / mean of those;
* ``dropped_fraction``: assignments dropped by capacity / all assignments;
* ``router_entropy``: mean entropy (nats) of the softmax of the router logits per token;
* ``dead_experts``: experts that received no assignment in the last ``dead_expert_steps`` steps;
* ``coactivation`` (with ``coactivation_stats``): the symmetric ``E × E`` matrix of tokens that chose
  both experts a and b (kept assignments), zero diagonal.

A record's top-level ``rebalances`` (with online rebalancing) lists the rebalances since the previous
record: step, reason, per-layer rank imbalance before and after (expected tokens per EP rank on the
window's loads), this rank's bytes sent and seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from .engine.state import state_of
from .errors import HybridEPConfigError
from .planning.placement import rank_loads
from .planning.placement.stats import check_records

JSONL_NAME = "expert_load.jsonl"


def load_report(model: nn.Module, reset: bool = True) -> dict[str, dict[str, Any]]:
    """Per-layer load statistics since the last report (world totals; identical on every rank)."""
    state = state_of(model)
    report: dict[str, dict[str, Any]] = {}
    for layer in state.layers:
        load = layer.load
        if load is None or load.window_steps == 0:
            continue
        E = load.num_experts
        w = load.window
        experts = w[:E]
        per_rank = rank_loads(experts.tolist(), layer.table)
        assigned = float(w[E + 1])
        dropped = float(w[E])
        mean_e = float(experts.mean())
        mean_r = sum(per_rank) / len(per_rank)
        dead = (state.optimizer_steps - load.last_active_step) >= state.config.dead_expert_steps
        report[layer.name] = {
            "steps": load.window_steps,
            "tokens_per_expert": [int(x) for x in experts.tolist()],
            "tokens_per_rank": [round(x, 3) for x in per_rank],
            "placement": [list(row) for row in layer.table.rows],
            "imbalance_expert": float(experts.max()) / mean_e if mean_e > 0 else 0.0,
            "imbalance_rank": max(per_rank) / mean_r if mean_r > 0 else 0.0,
            "dropped_fraction": dropped / (assigned + dropped) if assigned + dropped > 0 else 0.0,
            "router_entropy": float(w[E + 2] / w[E + 3]) if float(w[E + 3]) > 0 else 0.0,
            "dead_experts": int(dead.sum()) if state.optimizer_steps >= state.config.dead_expert_steps else 0,
        }
        if load.coactivation:
            report[layer.name]["coactivation"] = load.coactivation_matrix(w).long().tolist()
        if reset:
            load.window.zero_()
            load.window_steps = 0
    return report


def summary_scalars(report: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Scalars for a training log (TensorBoard and the other report_to targets)."""
    if not report:
        return {}
    layers = list(report.values())
    return {
        "moe/imbalance_expert_max": max(r["imbalance_expert"] for r in layers),
        "moe/imbalance_rank_max": max(r["imbalance_rank"] for r in layers),
        "moe/dropped_fraction": sum(r["dropped_fraction"] for r in layers) / len(layers),
        "moe/router_entropy": sum(r["router_entropy"] for r in layers) / len(layers),
        "moe/dead_experts": float(sum(r["dead_experts"] for r in layers)),
    }


def rebalance_report(model: nn.Module, reset: bool = True) -> list[dict[str, Any]]:
    """The online rebalances since the last report (empty without rebalancing)."""
    rebalancer = state_of(model).rebalancer
    if rebalancer is None:
        return []
    events = rebalancer.events[rebalancer.reported:]
    if reset:
        rebalancer.reported = len(rebalancer.events)
    return [{"step": e.step, "reason": e.reason, "imbalance_before": e.imbalance_before,
             "imbalance_after": e.imbalance_after, "bytes_sent": e.bytes_sent, "seconds": round(e.seconds, 6),
             "moved": e.moved} for e in events]


def append_jsonl(path: str | os.PathLike[str], step: int, report: dict[str, dict[str, Any]],
                 rebalances: list[dict[str, Any]] | None = None) -> None:
    record: dict[str, Any] = {"step": step, "layers": report}
    if rebalances:
        record["rebalances"] = rebalances
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def drop_records_after(path: str | os.PathLike[str], step: int) -> int:
    """Remove the records of steps after ``step`` from an ``expert_load.jsonl`` (a run resumed from the checkpoint
    of ``step`` logs them again), rewriting it atomically; returns how many were removed (0 without a file)."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return len(lines) - len(kept)


REPORT_KEYS = ("tokens_per_rank", "imbalance_expert", "imbalance_rank", "dropped_fraction", "dead_experts")


def read_jsonl(path: str | os.PathLike[str], require: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The records of an ``expert_load.jsonl``, checked by :func:`check_records` (errors name ``file:line``)."""
    path = Path(path)
    if path.is_dir():
        raise HybridEPConfigError(f"expert-load log {str(path)!r} is a directory, not a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"expert-load log {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise HybridEPConfigError(f"expert-load log {str(path)!r} is not UTF-8 text (byte {err.start}); "
                                  "expected one JSON object per line") from err
    records, where = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise HybridEPConfigError(f"{path}:{n}: not a JSON object ({err})") from err
            where.append(f"{path}:{n}")
    if not records:
        raise HybridEPConfigError(f"{path} holds no records")
    check_records(records, where, require=require)
    return records


def write_report(stats: str | os.PathLike[str], out: str | os.PathLike[str]) -> list[Path]:
    """Plots and a text summary of an ``expert_load.jsonl``: a layers × experts heatmap of the load
    (relative to the layer mean, summed over all records), per-rank load bars, ``summary.txt``."""
    records = read_jsonl(stats, require=REPORT_KEYS)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(records[0]["layers"])
    experts = np.array([np.sum([r["layers"][n]["tokens_per_expert"] for r in records if n in r["layers"]], axis=0)
                        for n in names], dtype=float)
    ranks = np.array([np.sum([r["layers"][n]["tokens_per_rank"] for r in records if n in r["layers"]], axis=0)
                      for n in names], dtype=float)
    relative = experts / np.maximum(experts.mean(axis=1, keepdims=True), 1e-12)

    fig, ax = plt.subplots(figsize=(max(4, experts.shape[1] * 0.5 + 2), max(3, len(names) * 0.4 + 1.5)))
    image = ax.imshow(relative, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(names)), [n.replace(".mlp.experts", "") for n in names], fontsize=7)
    ax.set_title(f"expert load / layer mean (steps {records[0]['step']}–{records[-1]['step']})")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    heatmap = out / "expert_load_heatmap.png"
    fig.savefig(heatmap, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(4, ranks.shape[1] + 2), 3))
    total = ranks.sum(axis=0)
    ax.bar(range(len(total)), total / max(total.mean(), 1e-12))
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("EP rank")
    ax.set_ylabel("load / mean")
    ax.set_title("per-rank load, all MoE layers")
    fig.tight_layout()
    bars = out / "rank_load.png"
    fig.savefig(bars, dpi=120)
    plt.close(fig)

    written = [heatmap, bars]
    written += _placement_plots(records, names, out, plt)

    first, last = records[0]["layers"], records[-1]["layers"]
    steps = [r["step"] for r in records]
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    lines = [f"{len(records)} records, steps {records[0]['step']}–{records[-1]['step']}, {len(names)} MoE layers",
             "layer: imbalance (expert max/mean) first → last; rank max/mean last; dropped last; dead last"]
    for n in names:
        a, b = first[n], last.get(n, first[n])
        lines.append(f"  {n}: {a['imbalance_expert']:.2f} → {b['imbalance_expert']:.2f}; "
                     f"{b['imbalance_rank']:.2f}; {b['dropped_fraction']:.3f}; {b['dead_experts']}")
    if repeated:
        lines.append(f"WARNING: step(s) {repeated[:10]} logged more than once (a resumed run appended to the log of an "
                     "interrupted one; HybridEP(Trainer) drops the later records when it resumes): figures count them "
                     "twice")
    events = [e for r in records for e in r.get("rebalances", [])]
    if events:
        lines.append(f"{len(events)} rebalances ({sum(bool(e.get('moved', True)) for e in events)} moved experts); "
                     "worst layer's rank imbalance before → after:")
        for e in events:
            lines.append(f"  step {e['step']}: {max(e['imbalance_before'].values()):.3f} → "
                         f"{max(e['imbalance_after'].values()):.3f} ({e['reason']}; {e['bytes_sent']} bytes, "
                         f"{e['seconds']:.3f} s)")
    summary = out / "summary.txt"
    summary.write_text("\n".join(lines) + "\n")
    return [*written, summary]


def _placement_plots(records: list[dict[str, Any]], names: list[str], out: Path, plt) -> list[Path]:
    """With placements in the records: which EP rank holds each expert over the run (one panel per layer,
    up to 8; an expert on several ranks shows its first); with rebalances: rank imbalance before/after."""
    written = []
    placed = [r for r in records if all("placement" in r["layers"].get(n, {}) for n in names)]
    if placed:
        shown = names[:8]
        fig, axes = plt.subplots(1, len(shown), figsize=(3 * len(shown) + 1, 3.5), squeeze=False)
        for ax, name in zip(axes[0], shown, strict=False):
            E = len(placed[0]["layers"][name]["tokens_per_expert"])
            grid = np.full((E, len(placed)), -1.0)
            for j, r in enumerate(placed):
                for rank, row in reversed(list(enumerate(r["layers"][name]["placement"]))):
                    for e in row:
                        grid[e, j] = rank
            image = ax.imshow(grid, aspect="auto", cmap="tab10", interpolation="nearest", vmin=0, vmax=9)
            ax.set_title(name.replace(".mlp.experts", ""), fontsize=8)
            ax.set_xlabel("record (step)")
            ax.set_xticks(range(len(placed)), [str(r["step"]) for r in placed], fontsize=6, rotation=90)
            ax.set_ylabel("expert")
        fig.colorbar(image, ax=axes[0].tolist(), label="EP rank (first holder)")
        fig.suptitle("placement over time")
        path = out / "placement_over_time.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    events = [e for r in records for e in r.get("rebalances", [])]
    if events:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = [e["step"] for e in events]
        ax.plot(steps, [max(e["imbalance_before"].values()) for e in events], "o-", color="tab:red",
                label="worst layer, before")
        ax.plot(steps, [max(e["imbalance_after"].values()) for e in events], "o-", color="tab:green",
                label="worst layer, after")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("optimizer step of the rebalance")
        ax.set_ylabel("rank imbalance (max/mean)")
        ax.set_title("online rebalancing")
        ax.legend()
        fig.tight_layout()
        path = out / "rebalance_imbalance.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
