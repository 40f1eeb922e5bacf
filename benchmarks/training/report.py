"""The invocation's report: its skeleton (machine, model, step settings, optimizer), the Markdown table of the
runs, the chart (samples/s, parameter MiB per rank, fraction of step in collectives), and the JSON file."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from pathlib import Path
from typing import Any

from .runs import OPTIMIZER, ModelArgs, StepArgs


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory bytes, kernel, Python / torch / transformers versions, OMP threads, load average."""
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_avg_at_start": os.getloadavg()}



def new_report(model_args: ModelArgs, sizes: dict[str, int], step: StepArgs) -> dict[str, Any]:
    """An empty report (no runs, no fabrics yet) with this machine, the model's fields and byte sizes, the step
    settings and the optimizer every arm uses."""
    return {"runs": [], "machine": machine_info(), "model": dataclasses.asdict(model_args) | sizes,
            "step": dataclasses.asdict(step), "fabrics": {},
            "optimizer": {"class": "torch.optim.AdamW", "lr": step.lr, **OPTIMIZER,
                          "note": "the same settings for every arm"}}


def write_json(report: dict, path: str) -> None:
    """Write ``report`` to ``path`` (indented JSON), replacing the file atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def table(runs: list[dict]) -> str:
    """One Markdown row per run record (MiB = 2**20 bytes; infeasible runs with their status)."""
    mib = lambda b: "–" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = ["| fabric | run | dp×ep | feasible | samples/s | tokens/s | param MiB/rank | param+grad+opt MiB/rank | "
             "peak RSS MiB/rank | a2a MiB/step (inter) | grad-sync MiB/step | inter-node wire MiB/step | comm in flight | "
             "exposed comm |",
             "|" + "---|" * 14]
    for r in runs:
        if r["feasible"]:
            state = r["param_bytes_per_rank"] + r["grad_bytes_per_rank"] + r["optimizer_bytes_per_rank"]
            lines.append(
                f"| {r['fabric']} | {r['name']} | {r['dp']}×{r['ep']} | yes | {r['samples_per_s']:.2f} | "
                f"{r['tokens_per_s']:.0f} | {mib(r['param_bytes_per_rank'])} | {mib(state)} | "
                f"{mib(r['peak_rss_bytes_per_rank'])} | {mib(r['a2a_bytes_per_step'])} "
                f"({mib(r['a2a_inter_node_bytes_per_step'])}) | {mib(r['allreduce_bytes_per_step'])} | "
                f"{mib(r['inter_node_bytes_per_step'])} | {r['comm_fraction']:.2f} | {r['exposed_comm_fraction']:.2f} |")
        else:
            lines.append(f"| {r['fabric']} | {r['name']} | {r['dp']}×{r['ep']} | **no** ({r['status']}) | – | – | "
                         f"{mib(r['param_bytes_per_rank'])} | – | {mib(r['peak_rss_bytes_per_rank'])} | – | – | – | – | – |")
    return "\n".join(lines)


def chart(runs: list[dict], path: str, title: str) -> None:
    """Three bar panels over the runs, one bar per fabric (samples/s, comm fraction) or per run (parameter MiB
    per rank), saved as an image at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fabrics = sorted({r["fabric"] for r in runs}, key=lambda f: f != "flat")
    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    width = 0.8 / max(len(fabrics), 1)
    for k, fabric in enumerate(fabrics):
        by = {r["name"]: r for r in runs if r["fabric"] == fabric}
        xs = [i + k * width for i in range(len(names))]
        sps = [by[n]["samples_per_s"] if n in by and by[n]["feasible"] else 0 for n in names]
        axes[0].bar(xs, sps, width, label=fabric)
        for x, n in zip(xs, names, strict=True):
            if n in by and not by[n]["feasible"]:
                axes[0].text(x, 0, "OOM" if by[n]["status"] == "out_of_memory" else "fail", rotation=90,
                             ha="center", va="bottom", fontsize=8)
        cf = [by[n]["comm_fraction"] if n in by and by[n]["feasible"] else 0 for n in names]
        axes[2].bar(xs, cf, width, label=fabric)
        if k == 0:
            pb = [(by[n]["param_bytes_per_rank"] or 0) / 2**20 if n in by else 0 for n in names]
            axes[1].bar(range(len(names)), pb, 0.6, color="gray")
    for ax, label in zip(axes, ("samples/s (higher is better)", "parameter MiB per rank", "fraction of step in collectives"),
                         strict=True):
        ax.set_xticks([i + width * (len(fabrics) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
