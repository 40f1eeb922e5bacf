"""Optimizer state keyed by parameter name and **global** expert id, so a run resumes at any EP degree
and with or without ZeRO-1 optimizer-state sharding.

Saved form (one safetensors file + one JSON file, written by rank 0):

* ``optimizer.safetensors``: for every parameter name and state key (``exp_avg``, ``exp_avg_sq``, ...)
  one tensor; expert tensors are full ``[E, ...]`` (gathered over the EP group: each expert once),
  dense tensors once;
* ``optimizer.json``: param-group hyperparameters (by parameter name) and scalar state (``step``).

A sharded optimizer (:class:`hf_hybrid_ep.ShardedOptimizer`) first all-gathers its shards over each
flat bucket's ranks, so the files are the same whichever ``optimizer_sharding`` wrote them. Each rank
loads dense state whole and the rows of its own experts, and a sharded optimizer keeps its shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.atomic import open_checkpoint
from ..checkpoint.format import OPTIMIZER_META_NAME, OPTIMIZER_TENSORS_NAME
from ..checkpoint.manifest import save_metadata
from ..checkpoint.safetensors_io import write_point
from ..engine import expert_layers, mesh_of
from ..parallel.heartbeat import Heartbeat
from ..parallel.mesh import is_dtensor
from ..parallel.zero import ShardedOptimizer, groups_by_param, scalar_state

TENSORS_NAME = OPTIMIZER_TENSORS_NAME
META_NAME = OPTIMIZER_META_NAME


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _expert_layers(model: nn.Module) -> dict[int, object]:
    return {id(p): layer for layer in expert_layers(model) for p in layer.slot_parameters()}


def _model_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Model parameters per param group (a sharded optimizer's groups hold views of them)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.hybrid_param_groups
    return [g["params"] for g in optimizer.param_groups]


def _refuse_dtensors(model: nn.Module) -> None:
    if any(is_dtensor(p) for p in model.parameters()):
        raise NotImplementedError(
            "optimizer-state checkpoints of dense_sharding='fsdp' models are not supported yet; "
            "use torch.distributed.checkpoint for the FSDP2 part"
        )


def _param_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """``id(param) -> {key: tensor in the parameter's local shape, or scalar}`` (collective if sharded)."""
    states: dict[int, dict] = {}
    if isinstance(optimizer, ShardedOptimizer):
        tensors, scalars = optimizer.hybrid_sharding.full_state(optimizer)
        for p in optimizer.hybrid_model_params:
            if id(p) in tensors or id(p) in scalars:
                states[id(p)] = {**scalars.get(id(p), {}),
                                 **{k: v.view_as(p) for k, v in tensors.get(id(p), {}).items()}}
            elif p in optimizer.state:  # kept whole (not in a flat bucket)
                states[id(p)] = dict(optimizer.state[p])
        return states
    for group in optimizer.param_groups:
        for p in group["params"]:
            states[id(p)] = dict(optimizer.state.get(p, {}))
    return states


def save_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path,
                         save_id: str | None = None) -> None:
    """Write the optimizer state of a hybrid-EP model (collective; rank 0 writes while the others follow its
    heartbeat), each file through a temporary name; ``save_id`` tags it as part of one checkpoint save."""
    _refuse_dtensors(model)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    names, experts = _names(model), _expert_layers(model)
    mesh = mesh_of(model)
    keep = mesh.rank == 0  # rank 0 writes; only its EP group gathers expert state, one tensor at a time
    states = _param_states(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    groups = []
    for group, params in zip(optimizer.param_groups, _model_groups(optimizer), strict=True):
        groups.append({
            "params": [names[id(p)] for p in params],
            **{k: v for k, v in group.items() if k != "params" and isinstance(v, int | float | bool | str | None)},
            **{k: list(v) for k, v in group.items() if isinstance(v, tuple)},
        })
        for p in params:
            name = names[id(p)]
            for key, value in sorted(states.get(id(p), {}).items()):
                if not (torch.is_tensor(value) and value.dim() > 0):
                    scalars.setdefault(name, {})[key] = float(value.item() if torch.is_tensor(value) else value)
                elif experts.get(id(p)) is not None:
                    full = experts[id(p)].gather_to_host(value, keep) if mesh.edp_rank == 0 else None
                    if keep:
                        tensors[f"{name}::{key}"] = full.contiguous()
                elif keep:
                    tensors[f"{name}::{key}"] = value.detach().cpu().contiguous()
    Heartbeat(mesh).alone(lambda: _write_optimizer_files(Path(directory), tensors, groups, scalars, save_id))


def _write_optimizer_files(directory: Path, tensors: dict[str, torch.Tensor], groups: list[dict],
                           scalars: dict[str, dict[str, float]], save_id: str | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{TENSORS_NAME}.tmp"
    write_point(f"open {TENSORS_NAME}")
    save_file(tensors, tmp, metadata=save_metadata(save_id))
    write_point(f"close {TENSORS_NAME}")
    tmp.replace(directory / TENSORS_NAME)
    tmp = directory / f".{META_NAME}.tmp"
    tmp.write_text(json.dumps({"param_groups": groups, "scalars": scalars}, indent=1))
    write_point(f"close {META_NAME}")
    tmp.replace(directory / META_NAME)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path,
                         verify: bool = True) -> None:
    """Fill ``optimizer`` (built over ``model``'s parameters, any EP degree, sharded or not) from a saved
    state; both files are checked against the checkpoint's manifest first (sha256 too unless ``verify=False``)."""
    _refuse_dtensors(model)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    directory = Path(directory)
    checker = open_checkpoint(directory, verify=verify)
    for name in (META_NAME, TENSORS_NAME):
        checker.check(name)
    meta = json.loads((directory / META_NAME).read_text())
    names, experts = _names(model), _expert_layers(model)
    by_name = {n: p for n, p in model.named_parameters()}
    saved_groups = meta["param_groups"]
    model_groups = _model_groups(optimizer)
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{directory / META_NAME}: {len(saved_groups)} param groups saved, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    for saved, group, params in zip(saved_groups, optimizer.param_groups, model_groups, strict=True):
        mine = [names[id(p)] for p in params]
        if saved["params"] != mine:
            raise ValueError(f"{directory / META_NAME}: param group parameters differ from the optimizer's")
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    loaded: dict[str, dict] = {}
    with safe_open(directory / TENSORS_NAME, framework="pt") as f:
        for full_key in f.keys():
            name, key = full_key.split("::")
            p = by_name[name]
            layer = experts.get(id(p))
            if layer is not None:
                sl = f.get_slice(full_key)
                value = torch.cat([sl[e : e + 1] for e in layer.local_experts])
            else:
                value = f.get_tensor(full_key)
            loaded.setdefault(name, {})[key] = value.to(p.device)
    sharding = optimizer.hybrid_sharding if isinstance(optimizer, ShardedOptimizer) else None
    groups = groups_by_param(optimizer)
    for name in set(loaded) | set(meta["scalars"]):
        p = by_name[name]
        scalars = meta["scalars"].get(name, {})
        if sharding is not None and sharding.views_of(p) is not None:
            sharding.load_full_state(optimizer, p, loaded.get(name, {}), scalars, groups)
            continue
        optimizer.state[p].update(loaded.get(name, {}))
        for key, value in scalars.items():
            optimizer.state[p][key] = scalar_state(value, p, groups[id(p)])
