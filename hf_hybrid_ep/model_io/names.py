"""How a checkpoint's keys name a model's tensors: transformers' conversion mapping of the model (renamings, then
converters such as "stack per-expert ``w1``/``w3`` into ``gate_up_proj``") applied to key names, and the MoE layer
of each per-expert key."""

from __future__ import annotations

from torch import nn

from ..dispatch import PlacementTable
from ..errors import CheckpointError


def model_tensor_names(model: nn.Module, keys) -> dict[str, tuple[str, str | None]]:
    """For each checkpoint key, the model tensor it becomes under transformers' conversion mapping
    (renamings, then converters) and the converter source pattern it matched (``None``: loaded as is)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_converters, apply_renamings

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return {key: apply_converters(apply_renamings(key, renamings), converters) for key in keys}


def expert_key_layers(model: nn.Module, keys: list[str], tables: dict[str, PlacementTable]) -> dict[str, str]:
    """The MoE layer (experts module name) of every per-expert checkpoint key, through transformers'
    conversion mapping (checkpoint formats name layers their own way, e.g. ``block_sparse_moe``)."""
    layer_of = {}
    for key, (name, _) in model_tensor_names(model, keys).items():
        module = name.rpartition(".")[0]
        if module not in tables:
            raise CheckpointError(f"per-expert key {key!r} maps to {name!r}, which is in no MoE layer of the model "
                                  f"({sorted(tables)})")
        layer_of[key] = module
    return layer_of
