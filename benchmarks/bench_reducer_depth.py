"""Gradient reduction at depth: the engine's reducer against torch ``DistributedDataParallel`` (CPU, gloo).

The same tiny Qwen3-MoE (built from its config, deeper and deeper) runs forward + backward under this library
(``parallelize``: dense gradients averaged over the world, each expert's over the ranks holding it) and under
torch DDP on an unsharded copy. The gradients are compared first (they must agree to round-off), then the arms
are timed in interleaved repeats (A, B, B, A, ...) so that drift of a shared machine hits both alike; the
medians and the median of the per-repeat ratios are reported, on two clocks — wall time, and the CPU time of
the rank's process (all its threads; far steadier than wall time on a loaded machine) — with the load average.

Each arm is also timed with reduction off (``hep.no_sync`` / ``DDP.no_sync``): the difference is what the
reduction costs on top of the backward (hooks, bucket bookkeeping, collectives), and divided by the number of
reduced parameters it is the reducer's cost per parameter — the figure to compare between an expert-parallel
layout and ep 1, where the forward and backward themselves differ.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_reducer_depth --layers 8,24,48,96
    torchrun --standalone --nproc_per_node 4 -m benchmarks.bench_reducer_depth --layers 48 --ep 2 \
        --json benchmarks/results/bench_reducer_depth_ep2.json

With ``--ep 2`` (world 4) the arms are this library at dp 2 × ep 2 and at dp 4 × ep 1, and DDP over the world.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, HfArgumentParser, Qwen3MoeConfig

import hf_hybrid_ep as hep

GRAD_TOLERANCE = 1e-5  # max |ours - DDP| / max |DDP| per parameter (round-off of a different summation order)


@dataclass
class BenchArguments:
    layers: str = field(default="8,24,48,96", metadata={"help": "comma-separated depths"})
    ep: int = field(default=1, metadata={"help": "EP degree of the hybrid arm (world = dp × ep, dp = world / ep)"})
    repeats: int = field(default=7, metadata={"help": "interleaved repeats; each times --iters forward + backward"})
    iters: int = field(default=1, metadata={"help": "forward + backward per repeat, arm and mode (median taken)"})
    # ~15 ms of CPU per layer forward + backward in one process: the per-layer cost of the measurement
    hidden: int = field(default=128)
    num_experts: int = field(default=8)
    batch_per_rank: int = field(default=4)
    seq_len: int = field(default=128)
    json: str = field(default="benchmarks/results/bench_reducer_depth.json")


def build(args: BenchArguments, layers: int) -> torch.nn.Module:
    """The tiny Qwen3-MoE, identical on every rank (11 parameters per layer, 3 outside the layers)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=args.hidden, intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        num_experts=args.num_experts, num_experts_per_tok=2, norm_topk_prob=True, attn_implementation="sdpa",
    )
    return AutoModelForCausalLM.from_config(config)


@dataclass
class Arm:
    """One way of training the model: its module, how to turn reduction off, the medians it measured."""

    name: str
    model: torch.nn.Module
    no_sync: object  # () -> context manager
    reduced: int  # parameters whose gradients it reduces
    # per repeat: (wall seconds, CPU seconds of this process, all its threads), reducing and not
    times: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"reducing": [], "no_sync": []})


def arms_for(args: BenchArguments, layers: int, world: int) -> list[Arm]:
    base = build(args, layers)
    out = []
    for ep in ([args.ep, 1] if args.ep > 1 else [1]):
        model = hep.parallelize(copy.deepcopy(base), hep.HybridEPConfig(dp_degree=world // ep, ep_degree=ep))
        reduced = len(hep.state_of(model).reducer.parameters())
        out.append(Arm(f"ours dp{world // ep}xep{ep}", model, lambda m=model: hep.no_sync(m), reduced))
    ddp = DistributedDataParallel(base)
    out.append(Arm("ddp", ddp, ddp.no_sync, sum(1 for p in base.parameters() if p.requires_grad)))
    return out


def batch(args: BenchArguments, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, 128, (args.batch_per_rank, args.seq_len), generator=g)


def fwd_bwd(arm: Arm, ids: torch.Tensor, reducing: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one forward + backward (every rank starts together; gradients cleared outside
    the time). The CPU time (``time.process_time``: every thread of the process, gloo's included) is what the
    rank itself spent: on a loaded machine it drifts far less than the wall time, which waits for a core."""
    arm.model.zero_grad(set_to_none=True)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.nullcontext() if reducing else arm.no_sync():
        arm.model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare_gradients(arms: list[Arm], ids: torch.Tensor) -> float:
    """Max over parameters of ``|ours - DDP| / max|DDP|`` after one reducing backward (ep-1 arms only: the same
    parameters whole). Raises if above :data:`GRAD_TOLERANCE`."""
    ddp = arms[-1]
    for arm in arms:
        fwd_bwd(arm, ids, reducing=True)
    want = {n: p.grad for n, p in ddp.model.module.named_parameters()}
    worst = 0.0
    for arm in arms[:-1]:
        if not arm.name.endswith("ep1"):
            continue
        for name, p in arm.model.named_parameters():
            ref = want[name]
            worst = max(worst, ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    if worst > GRAD_TOLERANCE:
        raise AssertionError(f"gradients differ from DDP's: max relative difference {worst:.2e} > {GRAD_TOLERANCE}")
    return worst


def measure(args: BenchArguments, arms: list[Arm], ids: torch.Tensor) -> None:
    """Interleaved repeats; the order of the arms alternates between repeats. Per repeat and arm, the median of
    ``iters`` iterations, reducing and not."""
    for arm in arms:  # warm-up
        fwd_bwd(arm, ids, True)
        fwd_bwd(arm, ids, False)
    for r in range(args.repeats):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            for mode in ("reducing", "no_sync") if r % 2 == 0 else ("no_sync", "reducing"):
                runs = [fwd_bwd(arm, ids, mode == "reducing") for _ in range(args.iters)]
                arm.times[mode].append(tuple(statistics.median(x) for x in zip(*runs, strict=True)))


def _ratio(a: list[float], b: list[float]) -> float:
    """Median over repeats of ``a / b`` (a slow repeat slows both sides of each ratio)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summary(arms: list[Arm]) -> dict:
    """Per arm and clock (``wall``, ``cpu``): medians in ms, the reduction's cost (reducing − no_sync) per
    reduced parameter in µs, and the ratios to DDP, reducing and not (the latter: the layers' own cost)."""
    ddp = arms[-1]
    out = {}
    for arm in arms:
        entry: dict = {"reduced_parameters": arm.reduced}
        for c, clock in enumerate(("wall", "cpu")):
            red = [t[c] for t in arm.times["reducing"]]
            off = [t[c] for t in arm.times["no_sync"]]
            entry[clock] = {
                "fwd_bwd_ms": statistics.median(red) * 1e3,
                "fwd_bwd_no_sync_ms": statistics.median(off) * 1e3,
                "reduction_us_per_parameter": (statistics.median(red) - statistics.median(off)) / arm.reduced * 1e6,
                "vs_ddp": _ratio(red, [t[c] for t in ddp.times["reducing"]]),
                "vs_ddp_no_sync": _ratio(off, [t[c] for t in ddp.times["no_sync"]]),
                "samples_ms": {"reducing": [x * 1e3 for x in red], "no_sync": [x * 1e3 for x in off]},
            }
        out[arm.name] = entry
    return out


def _table(report: dict) -> str:
    lines = ["| layers | parameters | arm | wall ms | ours / DDP (wall) | CPU ms | ours / DDP (CPU) | "
             "no_sync / DDP's (CPU) | reduction µs/param (CPU) |", "|---|---|---|---|---|---|---|---|---|"]
    for layers, d in report["depths"].items():
        for name, a in d["arms"].items():
            w, c = a["wall"], a["cpu"]
            lines.append(f"| {layers} | {a['reduced_parameters']} | {name} | {w['fwd_bwd_ms']:.0f} | {w['vs_ddp']:.2f} | "
                         f"{c['fwd_bwd_ms']:.0f} | {c['vs_ddp']:.2f} | {c['vs_ddp_no_sync']:.2f} | "
                         f"{c['reduction_us_per_parameter']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    (args,) = HfArgumentParser(BenchArguments).parse_args_into_dataclasses()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide the world size {world}")
    report = {"world": world, "ep": args.ep, "args": vars(args), "torch": torch.__version__,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_avg_start": os.getloadavg(), "depths": {}}
    ids = batch(args, rank)
    for layers in (int(x) for x in args.layers.split(",")):
        arms = arms_for(args, layers, world)
        grad_rel = compare_gradients(arms, ids)
        measure(args, arms, ids)
        report["depths"][layers] = {"grad_max_rel_diff": grad_rel, "load_avg": os.getloadavg(), "arms": summary(arms)}
        if rank == 0:
            print(f"{layers} layers: gradients vs DDP max rel diff {grad_rel:.1e}; " + "; ".join(
                f"{name} {a['wall']['vs_ddp']:.2f}x wall, {a['cpu']['vs_ddp']:.2f}x CPU"
                for name, a in report["depths"][layers]["arms"].items()), flush=True)
        del arms
    report["load_avg_end"] = os.getloadavg()
    if rank == 0:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(_table(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
