"""Which checkpoint keys are routed experts, read from the model's config and the keys themselves.

The expert count comes from the experts modules of the model built on the meta device (no memory),
found structurally like :func:`hf_hybrid_ep.parallelize` does; a non-MoE model or an unsupported
architecture is refused here, before any file is written.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from ..config import HybridEPConfigError
from ..experts import check_shardable
from .format import PER_EXPERT_KEY
from .safetensors_io import CheckpointError, TensorSpec


@dataclass(frozen=True)
class ModelExperts:
    """Routed-expert facts of a model architecture."""

    model_type: str
    num_experts: int
    num_moe_layers: int


def _from_config(config: PretrainedConfig):
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError:
        return AutoModel.from_config(config)


def build_meta_model(config: PretrainedConfig):
    """The model for ``config`` with every parameter on the meta device: nothing is allocated, not
    even transiently (fused expert tensors of large models run to tens of GB per layer).

    Buffers are then materialised on the CPU and recomputed by the model's own ``_init_weights``
    (which transformers uses for the same purpose when it loads: rotary ``inv_freq`` and friends);
    persistent buffers are overwritten by the checkpoint anyway.
    """
    with torch.device("meta"):
        model = _from_config(config)
    for module in model.modules():
        meta = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        init = getattr(model, "_init_weights", None)
        if init is None:
            raise CheckpointError(f"{type(model).__name__} cannot recompute the buffers of {type(module).__name__}")
        init(module)
    return model


def model_experts(config_or_path) -> ModelExperts:
    """Expert count and MoE layer count of an architecture; raise for non-MoE or unsupported models."""
    config = config_or_path
    if not isinstance(config, PretrainedConfig):
        try:
            config = AutoConfig.from_pretrained(config_or_path)
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"cannot read a transformers config from {str(config_or_path)!r}: {err}") from err
    try:
        model = build_meta_model(config)
        found = check_shardable(model)
    except HybridEPConfigError as err:
        raise CheckpointError(f"model_type {config.model_type!r}: {err}") from err
    except ValueError as err:
        raise CheckpointError(f"unsupported architecture {config.model_type!r}: {err}") from err
    counts = sorted({m.num_experts for _, m in found})
    if len(counts) != 1:
        raise CheckpointError(
            f"model_type {config.model_type!r} has experts modules with different expert counts {counts}; "
            "the checkpoint format supports one expert count per model"
        )
    return ModelExperts(config.model_type, counts[0], len(found))


@dataclass(frozen=True)
class KeyRole:
    """How one key is stored: ``dense``, ``per_expert`` (with its global expert id) or ``fused`` ([E, ...])."""

    kind: str
    expert: int | None = None


def classify_keys(specs: dict[str, TensorSpec], num_experts: int) -> dict[str, KeyRole]:
    """Classify every key and check that per-expert keys cover every expert of every tensor family.

    Raises:
        CheckpointError: naming a key whose expert id is out of range, or a missing expert.
    """
    roles: dict[str, KeyRole] = {}
    families: dict[tuple[str, str], set[int]] = defaultdict(set)
    for key, spec in specs.items():
        match = PER_EXPERT_KEY.match(key)
        if match:
            expert = int(match["expert"])
            if expert >= num_experts:
                raise CheckpointError(f"key {key!r} names expert {expert}, but the model has {num_experts} experts")
            roles[key] = KeyRole("per_expert", expert)
            families[(match["prefix"], match["rest"])].add(expert)
        elif key.split(".")[-2:-1] == ["experts"] and len(spec.shape) >= 1 and spec.shape[0] == num_experts:
            roles[key] = KeyRole("fused")
        else:
            roles[key] = KeyRole("dense")
    for (prefix, rest), experts in sorted(families.items()):
        missing = sorted(set(range(num_experts)) - experts)
        if missing:
            raise CheckpointError(f"checkpoint lacks {prefix}.{missing[0]}.{rest} (expert {missing[0]} of {num_experts})")
    if not any(r.kind != "dense" for r in roles.values()):
        raise CheckpointError("the checkpoint holds no routed-expert tensors (per-expert or fused keys)")
    return roles
