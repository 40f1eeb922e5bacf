"""Gradient reduction at depth: the engine's reducer against torch ``DistributedDataParallel`` (CPU, gloo).

The same tiny Qwen3-MoE (built from its config, deeper and deeper) runs forward + backward under this library
(``parallelize``: dense gradients averaged over the world, each expert's over the ranks holding it) and under
torch DDP on an unsharded copy. The gradients are compared first (they must agree to round-off), then the arms
are timed in interleaved repeats (A, B, B, A, ...) so that drift of a shared machine hits both alike; the
medians and their ratio are reported, with the load average around the run.

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
    iters: int = field(default=3)
    hidden: int = field(default=32)
    num_experts: int = field(default=4)
    batch_per_rank: int = field(default=2)
    seq_len: int = field(default=32)
    json: str = field(default="benchmarks/results/bench_reducer_depth.json")


def build(args: BenchArguments, layers: int) -> torch.nn.Module:
    """The tiny Qwen3-MoE, identical on every rank (11 parameters per layer, 3 outside the layers)."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=args.hidden, intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=args.hidden // 2,
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
    times: dict[str, list[float]] = field(default_factory=lambda: {"reducing": [], "no_sync": []})


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


def fwd_bwd(arm: Arm, ids: torch.Tensor, reducing: bool) -> float:
    """Seconds of one forward + backward (every rank starts together; gradients cleared outside the time)."""
    arm.model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    with contextlib.nullcontext() if reducing else arm.no_sync():
        arm.model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start


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
            for mode in ("reducing", "no_sync"):
                arm.times[mode].append(statistics.median(fwd_bwd(arm, ids, mode == "reducing")
                                                         for _ in range(args.iters)))


def summary(arms: list[Arm]) -> dict:
    ddp = arms[-1]
    out = {}
    for arm in arms:
        red, off = statistics.median(arm.times["reducing"]), statistics.median(arm.times["no_sync"])
        # per repeat, so that a slow repeat slows both sides of the ratio
        ratios = [a / b for a, b in zip(arm.times["reducing"], ddp.times["reducing"], strict=True)]
        out[arm.name] = {
            "reduced_parameters": arm.reduced,
            "fwd_bwd_ms": red * 1e3,
            "fwd_bwd_no_sync_ms": off * 1e3,
            "reduction_ms": (red - off) * 1e3,
            "reduction_us_per_parameter": (red - off) / arm.reduced * 1e6,
            "vs_ddp_median_of_ratios": statistics.median(ratios),
            "vs_ddp_ratio_of_medians": red / statistics.median(ddp.times["reducing"]),
            "times_ms": {k: [t * 1e3 for t in v] for k, v in arm.times.items()},
        }
    return out


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
        report["depths"][layers] = {"grad_max_rel_diff": grad_rel, "arms": summary(arms)}
        if rank == 0:
            print(f"{layers} layers: grad rel diff {grad_rel:.1e}; " + "; ".join(
                f"{name} {s['fwd_bwd_ms']:.0f} ms ({s['vs_ddp_median_of_ratios']:.2f}x DDP, reduction "
                f"{s['reduction_us_per_parameter']:.0f} us/param)" for name, s in report["depths"][layers]["arms"].items()),
                flush=True)
        del arms
    report["load_avg_end"] = os.getloadavg()
    if rank == 0:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print("| layers | parameters | ours ms | DDP ms | ours / DDP | reduction µs/param ours | DDP |")
        print("|---|---|---|---|---|---|---|")
        for layers, d in report["depths"].items():
            a = d["arms"]
            ours = next(v for k, v in a.items() if k.startswith("ours"))
            print(f"| {layers} | {ours['reduced_parameters']} | {ours['fwd_bwd_ms']:.0f} | {a['ddp']['fwd_bwd_ms']:.0f} | "
                  f"{ours['vs_ddp_median_of_ratios']:.2f} | {ours['reduction_us_per_parameter']:.0f} | "
                  f"{a['ddp']['reduction_us_per_parameter']:.0f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
