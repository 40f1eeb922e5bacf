"""Which checkpoint keys are routed experts, read from the model's config and the keys themselves.

The expert count comes from the experts modules of the model built on the meta device (no memory),
found structurally like :func:`hf_hybrid_ep.parallelize` does; a non-MoE model or an unsupported
architecture is refused here, before any file is written.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from ..errors import CheckpointError, HybridEPConfigError
from ..moe.discovery import check_shardable
from .format import PER_EXPERT_KEY
from .safetensors_io import TensorSpec


@dataclass(frozen=True)
class ModelExperts:
    """Routed-expert facts of a model architecture, and the meta model they were read from."""

    model_type: str
    num_experts: int
    num_moe_layers: int
    model: nn.Module = field(compare=False, repr=False)


def read_config(path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The transformers config of a checkpoint directory. Code a config names (``auto_map``) runs only
    with ``trust_remote_code=True``; without it transformers' own class for the ``model_type`` is
    used, or the config is refused — never a prompt.

    Raises:
        CheckpointError: naming the path.
    """
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"cannot read a transformers config from {str(path)!r}: {err}") from err


def _from_config(config: PretrainedConfig, trust_remote_code: bool = False):
    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError:
        return AutoModel.from_config(config, trust_remote_code=trust_remote_code)


def build_meta_model(config: PretrainedConfig, trust_remote_code: bool = False):
    """The model for ``config`` with every parameter on the meta device: nothing is allocated, not
    even transiently (fused expert tensors of large models run to tens of GB per layer).

    Buffers are then materialised on the CPU and recomputed by the model's own ``_init_weights``
    (which transformers uses for the same purpose when it loads: rotary ``inv_freq`` and friends);
    persistent buffers are overwritten by the checkpoint anyway.
    """
    with torch.device("meta"):
        model = _from_config(config, trust_remote_code)
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


def model_experts(config_or_path, trust_remote_code: bool = False) -> ModelExperts:
    """Expert count and MoE layer count of an architecture (and its meta model, for checking a checkpoint
    against it); raise for non-MoE or unsupported models."""
    config = config_or_path
    if not isinstance(config, PretrainedConfig):
        config = read_config(config_or_path, trust_remote_code)
    try:
        model = build_meta_model(config, trust_remote_code)
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
    return ModelExperts(config.model_type, counts[0], len(found), model)


@dataclass(frozen=True)
class KeyRole:
    """How one key is stored: ``dense``, ``per_expert`` (with its global expert id) or ``fused`` ([E, ...])."""

    kind: str
    expert: int | None = None


def classify_keys(specs: dict[str, TensorSpec], num_experts: int) -> dict[str, KeyRole]:
    """Classify every key and check that per-expert keys cover every expert of every tensor family.

    A tensor directly under an ``experts`` module is fused and must be ``[num_experts, ...]``.

    Raises:
        CheckpointError: naming a key whose expert id is out of range, a tensor under an experts
            module without the leading expert dimension (with its shape), or a missing expert.
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
        elif key.split(".")[-2:-1] == ["experts"]:
            if not spec.shape or spec.shape[0] != num_experts:
                raise CheckpointError(
                    f"key {key!r} of shape {tuple(spec.shape)} is under an experts module, but its leading "
                    f"dimension is not the model's expert count {num_experts}"
                )
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


def model_tensor_names(model: nn.Module, keys) -> dict[str, tuple[str, str | None]]:
    """For each checkpoint key, the model tensor it becomes under transformers' conversion mapping
    (renamings, then converters) and the converter source pattern it matched (``None``: loaded as is)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_converters, apply_renamings

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return {key: apply_converters(apply_renamings(key, renamings), converters) for key in keys}
