"""Rank-local loading: build the model with no expert memory, read dense tensors and this rank's experts.

Works on hybrid-EP checkpoints and on plain Hugging Face checkpoints alike, at any EP degree (keys
carry global expert ids). Checkpoint keys are mapped to model parameters with transformers' own
conversion mapping (renamings, and converters such as "stack per-expert w1/w3 into gate_up_proj"),
applied to this rank's experts only, in local-slot order. Only the files holding needed keys are
opened, and of fused ``[E, ...]`` tensors only this rank's rows are read.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.atomic import open_checkpoint
from ..checkpoint.dequantize import DEFAULT_DTYPE, Dequantizer, Quantization
from ..checkpoint.format import INDEX_NAME, PER_EXPERT_KEY, read_weight_map
from ..checkpoint.manifest import CheckpointVerifier
from ..checkpoint.reader import CheckpointReader
from ..config import HybridEPConfig
from ..engine import config_of, expert_layers, mesh_of
from ..engine.adapters import is_peft_model
from ..engine.failures import agree_on_failure
from ..errors import CheckpointError, HybridEPConfigError
from ..moe.discovery import unwrapped_name
from ..moe.layer import ShardedExperts
from .names import model_tensor_names
from .side_state import load_side_state

logger = logging.getLogger(__name__)


@dataclass
class TensorRecipe:
    """How one model tensor is assembled from checkpoint keys."""

    converter: object | None = None
    # converter source pattern -> checkpoint keys (for expert converters: one per local slot, in slot order)
    sources: dict[str, list[str | None]] = field(default_factory=dict)
    direct: str | None = None  # a key loaded as is
    rows: list[int] | None = None  # fused expert tensor: the global expert rows this rank reads

    def for_slot(self, slot: int) -> TensorRecipe:
        """The recipe of the one expert in local slot ``slot`` of a converter's per-expert keys."""
        return TensorRecipe(self.converter, {pattern: [keys[slot]] for pattern, keys in self.sources.items()})


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model itself (inside a ``PeftModel``, the model PEFT wrapped)."""
    return model.get_base_model() if is_peft_model(model) else model


def tensor_recipes(model: nn.Module, layers: list[ShardedExperts], weight_map: dict[str, str]) -> dict[str, TensorRecipe]:
    """Map every model tensor this rank needs to the checkpoint keys it is made of (tensor names as the
    checkpoint's model has them: inside a ``PeftModel``, without PEFT's wrappers)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    model = _transformers_model(model)
    converters = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightConverter)]
    by_module = {unwrapped_name(layer.name): layer for layer in layers}
    targets: dict[str, TensorRecipe] = defaultdict(TensorRecipe)
    for key, (name, pattern) in sorted(model_tensor_names(model, weight_map).items()):
        module_name, _, param = name.rpartition(".")
        layer = by_module.get(module_name)
        if pattern is None:
            if layer is not None and param in layer.param_names:  # fused [E, ...] expert tensor
                targets[name].direct, targets[name].rows = key, list(layer.local_experts)
            else:
                targets[name].direct = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        target = targets[name]
        target.converter = converter
        match = PER_EXPERT_KEY.match(key)
        if layer is not None and match is not None:
            expert = int(match["expert"])
            if expert not in layer.local_experts:
                continue  # another rank's expert: never read
            slots = target.sources.setdefault(pattern, [None] * len(layer.local_experts))
            slots[layer.local_experts.index(expert)] = key
        else:
            target.sources.setdefault(pattern, []).append(key)
    return dict(targets)


def assemble(name: str, target: TensorRecipe, reader: CheckpointReader, model: nn.Module) -> torch.Tensor:
    """Model tensor ``name`` of ``model`` (a transformers model) read by ``reader`` as ``target`` says: a key as it
    is, this rank's rows of a fused tensor, or the keys a converter of the model's conversion mapping combines."""
    if target.converter is None:
        if target.rows is not None:
            return reader.rows(target.direct, target.rows)
        return reader.tensor(target.direct)
    conv = target.converter
    collected: dict[str, list[torch.Tensor]] = {}
    for pattern in conv.source_patterns:
        keys = target.sources.get(pattern)
        if keys is None:
            continue
        missing = [i for i, k in enumerate(keys) if k is None]
        if missing:
            raise CheckpointError(f"the checkpoint lacks local slot {missing[0]} of {name} (pattern {pattern!r})")
        collected[pattern] = [reader.tensor(k) for k in keys]
    for op in conv.operations:
        collected = op.convert(
            collected, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
            full_layer_name=name, model=model, config=model.config,
        )
    if len(collected) != 1:
        raise CheckpointError(f"conversion of {name} produced {sorted(collected)}; expected one tensor")
    return next(iter(collected.values()))


def _checkpoint_named(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor], dict[str, str]]:
    """The model's parameters and buffers by the names its checkpoint gives them (inside a ``PeftModel``: without
    PEFT's prefix and wrapper components), and each such name's name in the model."""
    peft = is_peft_model(model)
    rename = unwrapped_name if peft else str
    params = {rename(n): p for n, p in model.named_parameters(remove_duplicate=False)
              if not (peft and ".lora_" in n)}  # adapters are not the base checkpoint's
    buffers = {rename(n): b for n, b in model.named_buffers()}
    named = {rename(n): n for n, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    return params, buffers, named


def fill_tensors_(model: nn.Module, recipes: dict[str, TensorRecipe], reader: CheckpointReader, *,
                  skip: Collection[str] = (), device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, keep_model_dtypes: bool = False) -> None:
    """Fill ``model``'s parameters and buffers from ``reader`` one tensor at a time, each as its recipe says (names
    as the checkpoint's model has them: inside a ``PeftModel``, without PEFT's wrappers), all but those in
    ``skip``: meta parameters are replaced (on ``device``, default the CPU; floating-point tensors in ``dtype``,
    default the checkpoint's, or with ``keep_model_dtypes`` in the dtype the model gave each parameter), live
    ones (a resume) and buffers are copied into in place; then the model's tied weights are tied again. Recipes
    of tensors the model lacks are logged and not read.

    Raises:
        CheckpointError: naming a tensor whose shape in the checkpoint is not the model's, before it is placed.
    """
    params, buffers, named = _checkpoint_named(model)
    unexpected = sorted(set(recipes) - set(params) - set(buffers))
    if unexpected:
        logger.warning("checkpoint tensors with no model parameter (ignored): %s", unexpected[:10])
    with torch.no_grad():
        for name, target in sorted(recipes.items()):
            if name in skip or (name not in params and name not in buffers):
                continue
            value = assemble(name, target, reader, _transformers_model(model))
            current = params.get(name, buffers.get(name))
            if tuple(value.shape) != tuple(current.shape):
                raise CheckpointError(
                    f"checkpoint tensor for {name!r} has shape {tuple(value.shape)}, the model expects "
                    f"{tuple(current.shape)}"
                )
            if name in buffers:
                buffers[name].copy_(value.to(buffers[name].dtype))
                continue
            if not current.is_meta:  # loading into a live model (resume): keep the parameter objects
                current.data.copy_(value.to(current.dtype))
                continue
            if keep_model_dtypes:
                value = value.to(current.dtype)
            elif dtype is not None and value.dtype.is_floating_point:
                value = value.to(dtype)
            module_name, _, leaf = named[name].rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[leaf] = nn.Parameter(value.to(device) if device is not None else value,
                                                    requires_grad=current.requires_grad)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def load_rank_local_(
    root: Path,
    model: nn.Module,
    layers: list[ShardedExperts],
    dtype: torch.dtype | None = None,
    fetch: Callable[[str], Path] | None = None,
    verifier: CheckpointVerifier | None = None,
    quantization: Quantization | None = None,
    device: torch.device | None = None,
) -> None:
    """Fill every parameter of ``model`` (already sharded) from the checkpoint: meta parameters are
    replaced (on ``device``, default the CPU, one tensor at a time), live ones (a resume) are copied into
    in place.

    A checkpoint quantized with ``quantization`` is dequantized as it is read (to ``dtype``, default
    bfloat16), of fused expert tensors only this rank's rows.

    ``fetch(name)``, if given, returns the local path of weight file ``name`` (downloading it): only
    files holding a needed key are asked for. Every file opened is checked by ``verifier`` (default:
    :func:`open_checkpoint` of ``root`` with sha256 on) against the index's manifest.
    """
    verifier = verifier or open_checkpoint(root, local=fetch is None)
    weight_map = read_weight_map(root)
    dequantizer = Dequantizer(quantization, weight_map, dtype or DEFAULT_DTYPE)
    recipes = tensor_recipes(model, layers, dequantizer.weight_map(weight_map))
    reader = CheckpointReader(root, weight_map, fetch, verifier, dequantizer)
    fill_tensors_(model, recipes, reader, device=device, dtype=dtype)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} model tensor(s), e.g. {missing[0]!r}")


STRUCTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def check_same_model(root: str | os.PathLike[str], model: nn.Module) -> None:
    """Refuse a checkpoint of another model before reading any weight: its ``config.json`` must agree with the
    model's on the sizes that shape the weights (:data:`STRUCTURE_KEYS` and every expert count).

    Raises:
        CheckpointError: naming the checkpoint and each differing key with both values.
    """
    path = Path(root) / "config.json"
    if not path.is_file() or getattr(model, "config", None) is None:
        return
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{str(path)!r} is not a JSON config: {err}") from err
    ours = model.config.to_dict()
    keys = [k for k in ours if k in theirs and (k in STRUCTURE_KEYS or (
        "expert" in k and "per_tok" not in k and isinstance(ours[k], int) and not isinstance(ours[k], bool)))]
    differ = [f"{k}: {theirs[k]!r} in the checkpoint, {ours[k]!r} in the model" for k in keys if theirs[k] != ours[k]]
    if differ:
        raise CheckpointError(f"{str(root)!r} is a checkpoint of another model ({'; '.join(differ)}); resume from a "
                              "checkpoint of this model, or build the model from this checkpoint (from_pretrained)")


def load_checkpoint_into_(root: str | os.PathLike[str], model: nn.Module, verify: bool | None = None) -> None:
    """Resume: copy a hybrid-EP (or plain) checkpoint into a live parallelized model, in place —
    weights (this rank's experts only) and the side state, each file checked against the manifest
    (sha256 unless ``verify=False``; default: the config's ``verify_checksums``). A checkpoint of another model
    is refused before any weight is read (:func:`check_same_model`); an error on any rank is raised on every
    rank with the same message. Collective."""

    def load() -> None:
        check_same_model(root, model)
        verifier = open_checkpoint(root, verify=config_of(model).verify_checksums if verify is None else verify)
        load_rank_local_(Path(root), model, expert_layers(model), verifier=verifier)
        load_side_state(model, root, verifier)

    agree_on_failure(mesh_of(model), load)


def checkpoint_placement(root: str | os.PathLike[str]) -> list[list[int]] | dict[str, list[list[int]]] | None:
    """The placement stored in a hybrid-EP index (``metadata.hybrid_ep.placement``: one table for every
    MoE layer, or per layer a mapping from experts module name to table), else ``None``."""
    index = Path(root) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        meta = (json.loads(index.read_text()).get("metadata") or {}).get("hybrid_ep") or {}
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{str(index)!r} is not a valid safetensors index: {err}") from err
    placement = meta.get("placement")
    if not placement:
        return None
    if isinstance(placement, dict):
        return {str(layer): [list(map(int, row)) for row in rows] for layer, rows in placement.items()}
    return [list(map(int, row)) for row in placement]


def with_checkpoint_placement(config: HybridEPConfig, root: str | os.PathLike[str]) -> HybridEPConfig:
    """``config`` with the checkpoint's placement (one table or per layer) when it names none and the EP
    degree fits."""
    import dataclasses

    from ..parallel.mesh import world_size

    stored = checkpoint_placement(root)
    if stored is None or not isinstance(config.placement, str):
        return config
    tables = list(stored.values()) if isinstance(stored, dict) else [stored]
    from ..dispatch import PlacementTable

    num_experts = max(e for rows in tables for row in rows for e in row) + 1
    if all(PlacementTable.from_rows(num_experts, rows).is_contiguous() for rows in tables):
        return config
    rows = len(tables[0])
    try:  # the EP degree the run will have, as parallelize resolves it with this placement
        _, ep = dataclasses.replace(config, placement=stored).resolve(world_size(), num_experts)
    except HybridEPConfigError:  # the placement cannot serve the requested or derived degree
        ep = config.ep_degree
    if ep != rows:
        logger.warning("the checkpoint's placement is for ep_degree=%d; loading at ep_degree=%s lays the "
                       "experts out contiguously (reshard with --placement to keep a placement)", rows, ep)
        return config
    return dataclasses.replace(config, placement=stored)
