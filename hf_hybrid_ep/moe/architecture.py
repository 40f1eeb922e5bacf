"""An architecture on the meta device: its transformers config, its model without memory, its routed-expert facts.

The expert count comes from the experts modules of the model built on the meta device (no memory), found
structurally like :func:`hf_hybrid_ep.parallelize` does; a non-MoE model or an unsupported architecture is
refused here, before any file is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from ..errors import CheckpointError, HybridEPConfigError
from .discovery import check_shardable


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


def model_from_config(config: PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    """The model transformers builds for ``config`` (a causal LM where the architecture has one), on the current
    default device: under ``torch.device("meta")`` without memory."""
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
        model = model_from_config(config, trust_remote_code)
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
