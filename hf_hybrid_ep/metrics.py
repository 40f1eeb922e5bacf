"""Expert-load metrics: per-layer statistics, a JSONL log, and plots.

The counters are reduced over the world once per optimizer step (:func:`hf_hybrid_ep.routing_step`),
so every figure here is the same on every rank and does not depend on the layout (with capacity
off). Definitions, per layer over the window since the last report:

* ``tokens_per_expert``: routed (token, k) assignments each expert received;
* ``tokens_per_rank``: the same summed over the experts each EP rank holds (primary replica);
* ``imbalance_expert`` / ``imbalance_rank``: max / mean of those;
* ``dropped_fraction``: assignments dropped by capacity / all assignments;
* ``router_entropy``: mean entropy (nats) of the softmax of the router logits per token;
* ``dead_experts``: experts that received no assignment in the last ``dead_expert_steps`` steps;
* ``coactivation`` (with ``coactivation_stats``): the symmetric ``E × E`` matrix of tokens that chose
  both experts a and b (kept assignments), zero diagonal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from .parallelize import state_of

JSONL_NAME = "expert_load.jsonl"


def load_report(model: nn.Module, reset: bool = True) -> dict[str, dict[str, Any]]:
    """Per-layer load statistics since the last report (world totals; identical on every rank)."""
    state = state_of(model)
    report: dict[str, dict[str, Any]] = {}
    for layer in state.layers:
        routing = layer.routing
        if routing is None or routing.window_steps == 0:
            continue
        E = routing.num_experts
        w = routing.window
        experts = w[:E]
        per_rank = [0.0] * routing.ep_degree
        for e, r in enumerate(routing.ep_rank_of_expert.tolist()):
            per_rank[r] += float(experts[e])
        assigned = float(w[E + 1])
        dropped = float(w[E])
        mean_e = float(experts.mean())
        mean_r = sum(per_rank) / len(per_rank)
        dead = (state.optimizer_steps - routing.last_active_step) >= state.config.dead_expert_steps
        report[layer.name] = {
            "steps": routing.window_steps,
            "tokens_per_expert": [int(x) for x in experts.tolist()],
            "tokens_per_rank": [int(x) for x in per_rank],
            "imbalance_expert": float(experts.max()) / mean_e if mean_e > 0 else 0.0,
            "imbalance_rank": max(per_rank) / mean_r if mean_r > 0 else 0.0,
            "dropped_fraction": dropped / (assigned + dropped) if assigned + dropped > 0 else 0.0,
            "router_entropy": float(w[E + 2] / w[E + 3]) if float(w[E + 3]) > 0 else 0.0,
            "dead_experts": int(dead.sum()) if state.optimizer_steps >= state.config.dead_expert_steps else 0,
        }
        if routing.coactivation:
            report[layer.name]["coactivation"] = routing.coactivation_matrix(w).long().tolist()
        if reset:
            routing.window.zero_()
            routing.window_steps = 0
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


def append_jsonl(path: str | os.PathLike[str], step: int, report: dict[str, dict[str, Any]]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "layers": report}) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert-load log {str(path)!r} does not exist")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON object ({err})") from err
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def write_report(stats: str | os.PathLike[str], out: str | os.PathLike[str]) -> list[Path]:
    """Plots and a text summary of an ``expert_load.jsonl``: a layers × experts heatmap of the load
    (relative to the layer mean, summed over all records), per-rank load bars, ``summary.txt``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    records = read_jsonl(stats)
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

    first, last = records[0]["layers"], records[-1]["layers"]
    lines = [f"{len(records)} records, steps {records[0]['step']}–{records[-1]['step']}, {len(names)} MoE layers",
             "layer: imbalance (expert max/mean) first → last; rank max/mean last; dropped last; dead last"]
    for n in names:
        a, b = first[n], last.get(n, first[n])
        lines.append(f"  {n}: {a['imbalance_expert']:.2f} → {b['imbalance_expert']:.2f}; "
                     f"{b['imbalance_rank']:.2f}; {b['dropped_fraction']:.3f}; {b['dead_experts']}")
    summary = out / "summary.txt"
    summary.write_text("\n".join(lines) + "\n")
    return [heatmap, bars, summary]
