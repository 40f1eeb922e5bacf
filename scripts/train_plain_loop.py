"""The engine in a plain PyTorch loop, without the Trainer (torchrun, 2 CPU processes, gloo).

Builds a tiny Qwen3-MoE from its config (nothing downloaded), shards its experts with
``hf_hybrid_ep.parallelize`` and trains it with a plain PyTorch loop: gradient accumulation under
``no_sync``, global-norm clipping, AdamW. Rank 0 reports loss, gradient norm and what the dispatcher
moved; at the end it checks the run against one process training the full model on the global batch.

    torchrun --standalone --nproc_per_node 2 scripts/train_plain_loop.py --ep_degree 2 --steps 20
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, HfArgumentParser, Qwen3MoeConfig

import hf_hybrid_ep as hep


@dataclass
class DemoArguments:
    steps: int = field(default=20, metadata={"help": "optimizer steps"})
    accumulation: int = field(default=2, metadata={"help": "micro-batches per optimizer step"})
    batch_per_rank: int = field(default=4, metadata={"help": "sequences per rank and micro-batch"})
    seq_len: int = field(default=32, metadata={"help": "tokens per sequence"})
    num_experts: int = field(default=8, metadata={"help": "routed experts per MoE layer"})
    dp_degree: int | None = field(default=None, metadata={"help": "data-parallel degree (default: derived)"})
    ep_degree: int | None = field(default=None, metadata={"help": "expert-parallel degree (default: EP in node)"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW learning rate"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this"})
    check_reference: bool = field(default=True, metadata={"help": "compare with a single-process reference"})


def tiny_qwen3_moe(num_experts: int) -> torch.nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=num_experts,
        num_experts_per_tok=2, norm_topk_prob=True, attn_implementation="eager",
    )
    return AutoModelForCausalLM.from_config(config)


def synthetic_batch(step: int, micro: int, batch: int, seq_len: int) -> torch.Tensor:
    """Learnable token streams: each sequence counts upward from a random start (mod 256)."""
    g = torch.Generator().manual_seed(10_000 * step + micro)
    start = torch.randint(0, 256, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % 256


def main() -> None:
    (args,) = HfArgumentParser(DemoArguments).parse_args_into_dataclasses()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_qwen3_moe(args.num_experts)
    reference = copy.deepcopy(model) if args.check_reference else None
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=args.dp_degree, ep_degree=args.ep_degree))
    mesh = hep.state_of(model).mesh
    if rank == 0:
        print(f"world {world}: dp_degree={mesh.dp_degree} ep_degree={mesh.ep_degree}; "
              f"rank 0 holds experts {hep.state_of(model).layers[0].local_experts} of {args.num_experts}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None
    lo, hi = rank * args.batch_per_rank, (rank + 1) * args.batch_per_rank
    for step in range(args.steps):
        losses = []
        for micro in range(args.accumulation):
            ids = synthetic_batch(step, micro, args.batch_per_rank * world, args.seq_len)
            sync = contextlib.nullcontext() if micro == args.accumulation - 1 else hep.no_sync(model)
            with sync:
                loss = model(input_ids=ids[lo:hi], labels=ids[lo:hi]).loss
                (loss / args.accumulation).backward()
            losses.append(loss.detach())
            if reference is not None:
                (reference(input_ids=ids, labels=ids).loss / args.accumulation).backward()
        norm = hep.clip_grad_norm_(model, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if reference is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            stats = hep.comm_stats(model)
            sent = sum(v["dispatch"]["remote_bytes_sent"] for v in hep.layer_counters(stats))
            print(f"step {step:3d}  loss {mean_loss.item() / world:.4f}  grad-norm {norm.item():.3f}  "
                  f"all-to-all sent {sent / 1024:.1f} KiB  all-reduced {stats['gradient_reduction']['expert_bytes'] / 1024:.1f} KiB (experts)")
        hep.reset_comm_stats(model)
    if reference is not None:
        worst = 0.0
        state = hep.state_of(model)
        local = {id(p): layer.local_experts for layer in state.layers for p in layer.expert_parameters()}
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            r = ref_params[name].detach()
            r = r[local[id(p)]] if id(p) in local else r
            worst = max(worst, ((p.detach() - r).norm() / r.norm().clamp_min(1e-30)).item())
        worst_t = torch.tensor(worst)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"largest per-tensor relative difference to one process on the global batch: {worst_t.item():.2e} "
                  "(fp32 round-off, which Adam's per-element normalisation amplifies over the steps)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
