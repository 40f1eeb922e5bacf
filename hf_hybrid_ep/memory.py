"""Per-rank bytes of weights, gradients and optimizer state of a hybrid-EP model (measured).

The same quantities :func:`hf_hybrid_ep.planning.planner.rank_state_bytes` predicts; docs/memory.md states the
formula. Only tensors this rank holds count: local shards of FSDP2 ``DTensor`` parameters, this rank's
experts, the optimizer state of its ZeRO-1 shard. Not counted: activations, communication buffers
(the gradient buckets' buffers hold the gradients themselves; ZeRO-1 adds one shard of each bucket in
flight), FSDP's transient
all-gathered layers, and scalar optimizer state (Adam's ``step``: one 0-dim tensor per parameter).

    torchrun --nproc_per_node 4 -m hf_hybrid_ep.memory --dp 2 --ep 2 --optimizer-sharding zero1
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .engine.state import state_of
from .parallel.mesh import local_tensor

logger = logging.getLogger("hf_hybrid_ep")

# Optimizer state tensors per parameter element, in units of the parameter's element size.
STATE_TENSORS = {"Adam": 2, "AdamW": 2, "SGD": 1}


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters (or ZeRO-1 views) whose state ``optimizer`` keeps."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _base_class(optimizer: torch.optim.Optimizer) -> str:
    from .parallel.zero import ShardedOptimizer

    for cls in type(optimizer).__mro__:
        if cls is not ShardedOptimizer and cls.__name__ in STATE_TENSORS and issubclass(cls, torch.optim.Optimizer):
            return cls.__name__
    return type(optimizer).__name__


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's bytes of weights, gradients and optimizer state.

    Returns a dict with ``weight_bytes`` (parameters held), ``grad_bytes`` (the gradients one backward
    leaves: one per trainable parameter held, in its dtype), ``optimizer_bytes`` (tensor state with at
    least one dimension; predicted from the optimizer class before its first step: Adam/AdamW 2, SGD
    with momentum 1 tensor per element; ``None`` when unknown), ``optimizer_state_measured`` (whether
    that figure was measured), ``state_elements`` (parameter elements whose state this rank keeps),
    ``optimizer_sharding``, ``dense_sharding`` and the layout.
    """
    state = state_of(model)
    params = list(model.parameters())
    report: dict[str, Any] = {
        "rank": state.mesh.rank, "dp": state.mesh.dp_degree, "ep": state.mesh.ep_degree,
        "optimizer_sharding": state.config.optimizer_sharding, "dense_sharding": state.config.dense_sharding,
        "weight_bytes": sum(_nbytes(p) for p in params),
        "grad_bytes": sum(_nbytes(p) for p in params if p.requires_grad),
        "optimizer_bytes": None, "optimizer_state_measured": False, "state_elements": None,
    }
    if optimizer is None:
        return report
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    tensors = _optimizer_tensors(optimizer)
    report["state_elements"] = sum(local_tensor(t).numel() for t in tensors)
    measured = [v for t in tensors for v in optimizer.state.get(t, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    if measured:
        report["optimizer_bytes"] = sum(_nbytes(v) for v in measured)
        report["optimizer_state_measured"] = True
    else:
        per = STATE_TENSORS.get(_base_class(optimizer))
        if per == 1 and not any(g.get("momentum", 0) for g in optimizer.param_groups):
            per = 0
        if per is not None:
            report["optimizer_bytes"] = per * sum(_nbytes(t) for t in tensors)
    return report


def format_report(report: dict[str, Any]) -> str:
    def gib(n: int | None) -> str:
        return "?" if n is None else f"{n / 2**20:.2f} MiB"

    opt = gib(report["optimizer_bytes"]) + ("" if report["optimizer_state_measured"] else " (expected)")
    return (f"hybrid-EP memory, rank {report['rank']} (dp {report['dp']} × ep {report['ep']}, optimizer sharding "
            f"{report['optimizer_sharding']}, dense {report['dense_sharding']}): weights {gib(report['weight_bytes'])}, "
            f"gradients {gib(report['grad_bytes'])}, optimizer state {opt}")


def log_memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Log (INFO, logger ``hf_hybrid_ep``) and return :func:`memory_report`."""
    report = memory_report(model, optimizer)
    logger.info(format_report(report))
    return report


def measure(model_type: str = "qwen3_moe", num_experts: int = 4, dp: int | None = None, ep: int | None = None,
            optimizer_sharding: str = "none", dense_sharding: str = "replicate", lora_r: int | None = None,
            **model_kwargs) -> dict[str, Any]:
    """Build a tiny model of a transformers family (random weights, nothing downloaded), take one AdamW step
    under the given layout and sharding, and return measured and planned bytes for this rank. With ``lora_r``
    only PEFT LoRA adapters of that rank train (on the default targets: attention and the experts).

    For benchmarks and the docs' table; run on every rank of an initialised process group (or alone).
    """
    import torch.distributed as dist

    from .config import HybridEPConfig
    from .engine.optimizers import make_optimizer
    from .engine.setup import parallelize
    from .planning.counts import count_parameters, rank_state_bytes

    model = _tiny_model(model_type, num_experts, **model_kwargs)
    counts = count_parameters(model.config)
    if lora_r is not None:
        from peft import LoraConfig, get_peft_model

        from .moe.lora import DEFAULT_LORA_TARGETS
        from .planning.counts import with_lora

        counts = with_lora(counts, model.config, lora_r, **DEFAULT_LORA_TARGETS)
        model = get_peft_model(model, LoraConfig(r=lora_r, **DEFAULT_LORA_TARGETS))
    config = HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding=optimizer_sharding,
                            dense_sharding=dense_sharding)
    parallelize(model, config)
    opt = make_optimizer(model, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()
                        if dist.is_initialized() else 0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt.step()
    report = memory_report(model, opt)
    mesh = state_of(model).mesh
    planned = rank_state_bytes(counts, mesh.dp_degree, mesh.ep_degree, mesh.rank, "fp32-adamw", optimizer_sharding,
                               dense_sharding)
    report["grad_bytes_after_backward"] = grads
    report["planned"] = {k: planned[k] for k in ("weight_bytes", "grad_bytes", "optimizer_bytes")}
    return report


def _tiny_model(model_type: str, num_experts: int, **kwargs) -> nn.Module:
    """A small fp32 model of a transformers MoE family (2 layers, hidden 64), seeded identically on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs.setdefault("vocab_size", 128)
    config = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=num_experts, num_local_experts=num_experts, num_experts_per_tok=2, **kwargs,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def main(argv: list[str] | None = None) -> int:
    """``torchrun --nproc_per_node 4 -m hf_hybrid_ep.memory --dp 2 --ep 2 --optimizer-sharding zero1``:
    one JSON line per rank (printed by rank 0) with measured and planned bytes."""
    import argparse
    import json

    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m hf_hybrid_ep.memory", description=main.__doc__)
    parser.add_argument("--model-type", default="qwen3_moe")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=128, help="e.g. 131: shards of unequal size")
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=None)
    parser.add_argument("--optimizer-sharding", choices=["none", "zero1"], default="none")
    parser.add_argument("--dense-sharding", choices=["replicate", "fsdp"], default="replicate")
    args = parser.parse_args(argv)
    import os

    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        report = measure(args.model_type, args.experts, args.dp, args.ep, args.optimizer_sharding, args.dense_sharding,
                         vocab_size=args.vocab_size)
        reports = [report]
        if dist.is_initialized():  # rank 0 prints every rank's line (no interleaving)
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, report)
        if not dist.is_initialized() or dist.get_rank() == 0:
            for r in reports:
                print(json.dumps(r), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
