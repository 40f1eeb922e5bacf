"""Training-step cost of hybrid EP layouts, side by side in one run (CPU, gloo).

Every layout (dp, ep) of the world trains the same tiny Qwen3-MoE on the same data; rounds are
interleaved (layout A, B, A, B, ...) so drift of the shared machine hits all layouts alike. Reports
per-rank parameter bytes, bytes moved by all-to-all and all-reduce per step, and the median step
time as a ratio to pure data parallelism (ep = 1).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_engine_step --num_experts 8 --rounds 5
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, HfArgumentParser, Qwen3MoeConfig

import hf_hybrid_ep as hep


@dataclass
class BenchArguments:
    num_experts: int = field(default=8)
    hidden: int = field(default=256)
    moe_intermediate: int = field(default=256)
    layers: int = field(default=2)
    batch_per_rank: int = field(default=4)
    seq_len: int = field(default=128)
    rounds: int = field(default=5, metadata={"help": "interleaved rounds; each round times steps_per_round steps"})
    steps_per_round: int = field(default=3)
    overlap_degrees: str = field(default="1", metadata={"help": "comma-separated overlap_degree values to compare"})


def build(args: BenchArguments) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.num_experts, num_experts_per_tok=2,
        norm_topk_prob=True, attn_implementation="sdpa",
    )
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    (args,) = HfArgumentParser(BenchArguments).parse_args_into_dataclasses()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts = [(world // ep, ep) for ep in range(1, world + 1) if world % ep == 0 and args.num_experts % ep == 0]
    degrees = [int(d) for d in args.overlap_degrees.split(",")]
    runs = {}
    for dp, ep in layouts:
        for degree in degrees if ep > 1 else [1]:
            config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, overlap_degree=degree)
            model = hep.parallelize(build(args), config)
            runs[(dp, ep, degree)] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 1024, (args.batch_per_rank, args.seq_len), generator=g)
    for model, opt, _ in runs.values():  # warm-up
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        hep.reset_comm_stats(model)
    for _ in range(args.rounds):
        for model, opt, times in runs.values():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_round):
                model(input_ids=ids, labels=ids).loss.backward()
                hep.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
            dist.barrier()
            times.append((time.perf_counter() - start) / args.steps_per_round)
    if rank == 0:
        base = statistics.median(runs[(world, 1, 1)][2])
        steps = args.rounds * args.steps_per_round
        print(f"world {world}, {args.num_experts} experts, hidden {args.hidden}, {args.layers} layers, "
              f"{args.batch_per_rank}x{args.seq_len} tokens per rank; {steps} timed steps per layout")
        print("| dp × ep | overlap_degree | param MiB/rank | all-to-all KiB/step (remote, sent) | all-reduce KiB/step "
              "| step time vs ep=1 |")
        print("|---|---|---|---|---|---|")
        for (dp, ep, degree), (model, _, times) in runs.items():
            stats = hep.comm_stats(model)
            a2a = sum(
                v[p]["remote_bytes_sent"] for v in hep.layer_counters(stats)
                for p in ("dispatch", "combine", "dispatch_backward", "combine_backward")
            )
            red = stats["gradient_reduction"]
            mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            print(f"| {dp} × {ep} | {degree} | {mib:.2f} | {a2a / steps / 1024:.1f} | "
                  f"{(red['dense_bytes'] + red['expert_bytes']) / steps / 1024:.1f} | "
                  f"{statistics.median(times) / base:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
