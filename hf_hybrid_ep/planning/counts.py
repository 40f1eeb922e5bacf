"""What the planner and the step-time model count: a model's parameters (from its config, built on the
meta device), a layout's per-rank training state, and how a collective's bytes split over link levels.

The memory model these implement is in :mod:`hf_hybrid_ep.planning.planner`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from ..checkpoint.dequantize import checkpoint_bytes, quantization_config_of, quantization_of
from ..config import DENSE_SHARDINGS, OPTIMIZER_SHARDINGS
from ..moe.architecture import model_from_config
from ..moe.discovery import check_shardable, expert_parameter_names
from ..parallel.topology import Topology

KNOWN_CONFIGS = Path(__file__).resolve().parent.parent / "known_configs"
RECIPES = {"bf16-adamw": (2, 2, 12), "fp32-adamw": (4, 4, 8), "bf16-sgd": (2, 2, 4)}  # weights, grads, optimizer


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of an architecture (exact, from the model built on the meta device)."""

    model_type: str
    total_params: int
    dense_params: int
    expert_params: int
    num_experts: int
    top_k: int
    moe_layers: int
    dense_layers: int
    hidden: int
    heads: int
    expert_width: int
    dense_shapes: tuple[tuple[int, ...], ...] = field(default=(), repr=False)  # for FSDP's dim-0 shards
    embedding_lookup_params: int = 0  # input-embedding table not tied to the output projection (no FLOPs)
    qk_dim: int = 0  # heads × query/key head width (attention scores); 0: hidden
    v_dim: int = 0  # heads × value head width; 0: hidden
    quantization: str = ""  # how the checkpoint is quantized ("fp8 block 128×128"); "" when it is not
    checkpoint_bytes: int = 0  # the model's tensors in its checkpoint (quantized where it is)
    converted_bytes: int = 0  # the same after `hf-hybrid-ep convert` (dequantized tensors in bfloat16)
    lora_r: int = 0  # LoRA rank when only adapters train (the base frozen, :func:`with_lora`); 0: every parameter
    adapter_dense_params: int = 0  # LoRA factors on dense modules (replicated)
    adapter_expert_params: int = 0  # LoRA factors on the routed experts' parameters (all experts)


def trained_params(m: ModelCounts) -> tuple[int, int]:
    """``(dense, expert)`` parameters that get gradients and optimizer state: the adapters' under LoRA, else all."""
    if m.lora_r:
        return m.adapter_dense_params, m.adapter_expert_params
    return m.dense_params, m.expert_params


def _matches(name: str, targets) -> bool:
    """PEFT's rule for a target list: the name itself or a ``.``-separated suffix of it."""
    return any(name == t or name.endswith(f".{t}") for t in targets or ())


def with_lora(m: ModelCounts, config: PretrainedConfig, r: int, target_modules, target_parameters,
              trust_remote_code: bool = False) -> ModelCounts:
    """``m`` training LoRA adapters of rank ``r`` only: on the ``nn.Linear`` modules named by ``target_modules``
    (``r·(in + out)`` each) and on the experts' 3-D parameters named by ``target_parameters`` (``r·E·(in + out)``
    each), matched as PEFT matches them; the base frozen."""
    import torch
    from torch import nn

    if r < 1:
        raise ValueError(f"lora_r={r} must be a positive integer")
    with torch.device("meta"):
        model = model_from_config(config, trust_remote_code)
    found = check_shardable(model)
    dense = sum(r * (mod.in_features + mod.out_features) for name, mod in model.named_modules()
                if isinstance(mod, nn.Linear) and _matches(name, target_modules))
    expert = sum(r * p.shape[0] * (p.shape[1] + p.shape[2]) for name, module in found
                 for pname, p in module.named_parameters(recurse=False)
                 if p.dim() == 3 and _matches(f"{name}.{pname}", target_parameters))
    from dataclasses import replace

    return replace(m, lora_r=r, adapter_dense_params=dense, adapter_expert_params=expert)


def load_config(model: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """A config from a directory, a config.json, a shipped well-known repo id, or the Hub.

    Code a config names in ``auto_map`` runs only with ``trust_remote_code=True`` (never a prompt)."""
    path = Path(model)
    shipped = KNOWN_CONFIGS / (model.replace("/", "__") + ".json")
    if path.is_dir():
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if path.is_file():
        return _config_from_json(path)
    if shipped.is_file():
        return _config_from_json(shipped)
    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def _config_from_json(path: Path) -> PretrainedConfig:
    import json

    data = json.loads(path.read_text())
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def count_parameters(config: PretrainedConfig, trust_remote_code: bool = False) -> ModelCounts:
    import torch

    with torch.device("meta"):
        model = model_from_config(config, trust_remote_code)
    found = check_shardable(model)
    expert_ids = set()
    expert = 0
    for name, module in found:
        for pname in expert_parameter_names(name, module):
            p = getattr(module, pname)
            expert_ids.add(id(p))
            expert += p.numel()
    total = sum(p.numel() for p in model.parameters())
    first = found[0][1]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = next(getattr(text, a) for a in ("num_experts_per_tok", "moe_k", "top_k") if hasattr(text, a))
    width = first.down_proj.shape[1] if first.is_transposed else first.down_proj.shape[2]  # I
    heads = int(text.num_attention_heads)
    head = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
    qk = getattr(text, "qk_head_dim", None) or head  # MLA (DeepSeek): no-RoPE + RoPE parts
    v = getattr(text, "v_head_dim", None) or head
    table, output = model.get_input_embeddings(), model.get_output_embeddings()
    lookup = table.weight.numel() if output is None or output.weight is not table.weight else 0
    quantization = quantization_of(config, f"the {config.model_type} config")
    skip = (quantization_config_of(config) or {}).get("modules_to_not_convert") or ()
    expert_tensors = {f"{n}.{p}" for n, m in found for p, t in m.named_parameters(recurse=False) if t.dim() == 3}
    stored, converted = checkpoint_bytes(model, quantization, expert_tensors, skip, _checkpoint_dtype(config))
    return ModelCounts(
        model_type=config.model_type, total_params=total, dense_params=total - expert, expert_params=expert,
        num_experts=first.num_experts, top_k=int(top_k), moe_layers=len(found),
        dense_layers=int(text.num_hidden_layers) - len(found), hidden=int(text.hidden_size),
        heads=heads, expert_width=int(width),
        dense_shapes=tuple(tuple(p.shape) for p in model.parameters() if id(p) not in expert_ids),
        embedding_lookup_params=int(lookup), qk_dim=heads * int(qk), v_dim=heads * int(v),
        quantization=quantization.describe() if quantization else "", checkpoint_bytes=stored,
        converted_bytes=converted,
    )


def _checkpoint_dtype(config: PretrainedConfig):
    """The dtype of a config's unquantized tensors (``dtype``; bfloat16, the Hub's usual, when unset)."""
    import torch

    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def _shard_numel(n: int, members: int, index: int) -> int:
    """Elements member ``index`` of ``members`` owns of an ``n``-element flat bucket (ceil-sized shards)."""
    size = math.ceil(n / members)
    return max(0, min(n - index * size, size))


def _fsdp_numel(shapes: tuple[tuple[int, ...], ...], world: int, rank: int) -> int:
    """Elements of the dense tensors that FSDP2 leaves on ``rank`` (dim-0 chunks of ``ceil(d0/W)`` rows)."""
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        total += _shard_numel(shape[0], world, rank) * rest if shape else 1
    return total


def rank_state_bytes(m: ModelCounts, dp: int, ep: int, rank: int = 0, recipe: str = "bf16-adamw",
                     optimizer_sharding: str = "none", dense_sharding: str = "replicate") -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state on global rank ``rank`` of a dp × ep layout.

    The same formula the engine's :func:`hf_hybrid_ep.memory.memory_report` measures (contiguous
    placement; every parameter trainable).
    """
    if optimizer_sharding not in OPTIMIZER_SHARDINGS:
        raise ValueError(f"optimizer_sharding={optimizer_sharding!r} is not one of {list(OPTIMIZER_SHARDINGS)}")
    if dense_sharding not in DENSE_SHARDINGS:
        raise ValueError(f"dense_sharding={dense_sharding!r} is not one of {list(DENSE_SHARDINGS)}")
    w, g, o = RECIPES[recipe]
    world = dp * ep
    experts = m.expert_params // ep
    if m.lora_r:
        return _lora_state_bytes(m, dp, ep, rank, (w, g, o), optimizer_sharding, dense_sharding)
    dense = _fsdp_numel(m.dense_shapes, world, rank) if dense_sharding == "fsdp" else m.dense_params
    held = dense + experts
    if optimizer_sharding == "zero1":
        dense_state = dense if dense_sharding == "fsdp" else _shard_numel(m.dense_params, world, rank)
        state = dense_state + _shard_numel(experts, dp, rank // ep)
    else:
        state = held
    return {"params": held, "weight_bytes": held * w, "grad_bytes": held * g, "optimizer_bytes": state * o}


def _lora_state_bytes(m: ModelCounts, dp: int, ep: int, rank: int, recipe_bytes: tuple[int, int, int],
                      optimizer_sharding: str, dense_sharding: str) -> dict[str, int]:
    """:func:`rank_state_bytes` when only LoRA adapters train: every held parameter (frozen base and adapters)
    has weight bytes; only the adapters (dense ones whole, this rank's experts' ones) have gradients and
    optimizer state, which ZeRO-1 shards like any trained parameter."""
    if dense_sharding == "fsdp":
        raise ValueError("dense_sharding='fsdp' is not supported with LoRA (the engine refuses it for PEFT models)")
    w, g, o = recipe_bytes
    adapters = m.adapter_dense_params + m.adapter_expert_params // ep
    held = m.dense_params + m.expert_params // ep + adapters
    state = adapters
    if optimizer_sharding == "zero1":
        state = (_shard_numel(m.adapter_dense_params, dp * ep, rank)
                 + _shard_numel(m.adapter_expert_params // ep, dp, rank // ep))
    return {"params": held, "weight_bytes": held * w, "grad_bytes": adapters * g, "optimizer_bytes": state * o}


def activation_bytes(m: ModelCounts, batch: int, seq: int) -> tuple[int, int]:
    """Activation bytes of ``batch`` sequences of ``seq`` tokens through every layer (in bf16): ``(kept for backward,
    with activation checkpointing)``."""
    attention = batch * seq * 10 * m.hidden
    moe = attention + batch * seq * m.top_k * (2 * m.hidden + 6 * m.expert_width) + 4 * batch * seq * m.num_experts
    dense = batch * seq * 34 * m.hidden
    full = m.moe_layers * moe + m.dense_layers * dense
    layers = m.moe_layers + m.dense_layers
    checkpointed = 2 * batch * seq * m.hidden * layers + max(moe, dense if m.dense_layers else 0)
    return full, checkpointed


def ranks_per_level(topo: Topology, ranks: list[int]) -> tuple[int, int, int, int]:
    """(ranks on one node, ranks in one rack, nodes, racks) of a group of global ranks (uniform groups)."""
    nodes = {topo.node_of(r) for r in ranks}
    racks = {topo.rack_of(r) for r in ranks}
    return len(ranks) // len(nodes), len(ranks) // len(racks), len(nodes), len(racks)


def allreduce_split(topo: Topology, ranks: list[int], size: float) -> dict[str, float]:
    """Per-GPU bytes of a hierarchical all-reduce of ``size`` bytes over ``ranks``, by link level."""
    out = {"intra_node": 0.0, "inter_node": 0.0, "cross_rack": 0.0}
    if len(ranks) < 2:
        return out
    g, _, nodes, racks = ranks_per_level(topo, ranks)
    out["intra_node"] = 2 * (g - 1) / g * size
    if nodes > 1:
        out["cross_rack" if racks > 1 else "inter_node"] = 2 * (nodes - 1) / nodes * size / g
    return out
