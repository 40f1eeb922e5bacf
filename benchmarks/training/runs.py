"""What is trained: the layouts (:class:`RunSpec`, :func:`default_runs`), the model (:class:`ModelArgs`, its
exact byte sizes and its random-weight checkpoint) and the step settings (:class:`StepArgs`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .regimes import qwen3_moe_config

# Default memory budget per rank, in units of one full replica's parameter bytes: its parameters, gradients and
# two AdamW moments (4) plus half a replica for activations and communication buffers. A pure-DP rank needs the
# 4 replicas of state plus its gradient all-reduce buffers and activations, so it does not fit.
AUTO_BUDGET_REPLICAS = 4.5
# Every arm steps the same optimizer implementation (torch's fused AdamW kernel, CPU and CUDA).
OPTIMIZER = {"fused": True}


@dataclass(frozen=True)
class RunSpec:
    """One layout to train.

    ``engine``: ``"hybrid"`` (this library; ``config`` = extra :class:`hf_hybrid_ep.HybridEPConfig` fields),
    ``"ddp"`` (torch ``DistributedDataParallel``, full replicas) or ``"hf-native"`` (transformers'
    ``DistributedConfig``; ``config`` = its fields). ``dp`` = number of distinct micro-batches per step,
    ``ep`` = expert-parallel degree. ``mem_limit=False`` runs without the memory limit (speed reference).
    """

    name: str
    engine: str
    dp: int
    ep: int
    config: dict[str, Any] = field(default_factory=dict)
    mem_limit: bool = True


def default_runs(world: int) -> list[RunSpec]:
    """Every dp × ep factorization of ``world`` with this library, DDP, and transformers' native EP layouts.

    Adding a variant is one line, e.g.
    ``RunSpec("hybrid-dp2-ep2-zero1", "hybrid", 2, 2, {"optimizer_sharding": "zero1"})``. Arms whose config names
    no dispatcher run the per-pair exchange (``"torch"``); the ``-dedup`` arms the deduplicated one.
    """
    runs = [RunSpec(f"dp{world}", "hybrid", world, 1),
            RunSpec(f"dp{world}-unlimited", "hybrid", world, 1, mem_limit=False),
            RunSpec(f"ddp{world}", "ddp", world, 1)]
    runs += [RunSpec(f"hybrid-dp{world // ep}-ep{ep}", "hybrid", world // ep, ep)
             for ep in range(2, world) if world % ep == 0]
    runs.append(RunSpec(f"ep{world}", "hybrid", 1, world))
    # Memory scaling: ZeRO-1 optimizer state, and FSDP2 dense weights on top of it.
    runs += [RunSpec(f"hybrid-dp2-ep{world // 2}-zero1", "hybrid", 2, world // 2, {"optimizer_sharding": "zero1"}),
             RunSpec(f"hybrid-dp2-ep{world // 2}-fsdp-zero1", "hybrid", 2, world // 2,
                     {"optimizer_sharding": "zero1", "dense_sharding": "fsdp"})]
    # Communication overlap: every hybrid variant also with the blocking reduction, side by side.
    runs += [dataclasses.replace(r, name=f"{r.name}-blocking", config={**r.config, "overlap_grad_reduce": False})
             for r in runs if r.engine == "hybrid"]
    # The deduplicated exchange (one row per token and destination rank, partial sums back) at the hybrid and the
    # pure-EP layout, side by side with the same layouts' per-pair exchange.
    if world % 2 == 0 and world >= 4:
        runs.append(RunSpec(f"hybrid-dp2-ep{world // 2}-dedup", "hybrid", 2, world // 2, {"dispatcher": "dedup"}))
    runs.append(RunSpec(f"ep{world}-dedup", "hybrid", 1, world, {"dispatcher": "dedup"}))
    # Every other arm exchanges one row per (token, expert) pair ("torch"; auto would pick the deduplicated
    # exchange for these top-k >= 2 models), so that tables recorded at different times compare.
    runs = [dataclasses.replace(r, config={"dispatcher": "torch", **r.config}) if r.engine == "hybrid" else r
            for r in runs]
    runs.append(RunSpec(f"hf-native-fsdp{world}-ep{world}", "hf-native", world, world,
                        {"fsdp_size": world, "ep_size": world}))
    if world % 2 == 0 and world >= 4:  # HSDP: replicated across the two nodes, FSDP + EP inside a node
        half = world // 2
        runs.append(RunSpec(f"hf-native-hsdp2x{half}-ep{half}", "hf-native", world, half,
                            {"dp_replicate_size": 2, "fsdp_size": half, "ep_size": half}))
    return runs


@dataclass
class ModelArgs:
    """A Qwen3-MoE config: every layer MoE, fp32."""

    vocab_size: int = 4096
    hidden_size: int = 512
    num_hidden_layers: int = 4
    num_experts: int = 16
    moe_intermediate_size: int = 512
    num_experts_per_tok: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4

    def hf_config(self):
        """The transformers ``Qwen3MoeConfig`` of these fields (``regimes.qwen3_moe_config``)."""
        return qwen3_moe_config(dataclasses.asdict(self))


@dataclass
class StepArgs:
    """How every rank steps: micro-batches of ``[batch_per_rank, seq_len]`` token ids, ``grad_accum`` of them per
    optimizer step; ``warmup`` untimed then ``steps`` timed steps. ``mem_budget_bytes``: RLIMIT_DATA above the
    rank's data size after setup (``None``: no limit); ``run_timeout_s``: seconds before a run's ranks are killed."""

    batch_per_rank: int = 2
    seq_len: int = 256
    warmup: int = 2
    steps: int = 5
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    mem_budget_bytes: int | None = None
    ranks_per_node: int = 4  # replaced by the fabric's when a run is launched (launch.run_layout)
    run_timeout_s: float = 900.0
    # token ids to train on: an ``.npz`` whose ``blocks`` is ``[N, seq_len]`` (default: uniform random ids)
    data: str | None = None
    # hybrid runs: record every timed step's top-k indices per layer (``routing_rank{r}.npz`` in the run's
    # directory) and the rows ``trace_traffic`` predicts for them (``meters.PREDICTED_ROWS``)
    record_routing: bool = False
    # save the trained model here (a plain transformers checkpoint) after the timed steps
    save_to: str | None = None


def model_bytes(model_args: ModelArgs) -> dict[str, int]:
    """Exact fp32 bytes of the dense part and of all routed experts (from the model on the meta device)."""
    from hf_hybrid_ep.planning.planner import count_parameters

    counts = count_parameters(model_args.hf_config())
    return {"dense_bytes": 4 * counts.dense_params, "expert_bytes": 4 * counts.expert_params,
            "total_bytes": 4 * counts.total_params}


def save_checkpoint(model_args: ModelArgs, path: str) -> None:
    """Random weights (seed 0) of ``model_args`` saved as a transformers checkpoint (safetensors) at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_args.hf_config()).save_pretrained(path)
