"""Optimizer state keyed by parameter name and **global** expert id, so a run resumes at any EP degree.

Saved form (one safetensors file + one JSON file, written by rank 0):

* ``optimizer.safetensors``: for every parameter name and state key (``exp_avg``, ``exp_avg_sq``, ...)
  one tensor; expert tensors are full ``[E, ...]`` (gathered over the EP group: each expert once),
  dense tensors once;
* ``optimizer.json``: param-group hyperparameters (by parameter name) and scalar state (``step``).

Each rank loads dense state whole and the rows of its own experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..parallelize import state_of

TENSORS_NAME = "optimizer.safetensors"
META_NAME = "optimizer.json"


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _expert_layers(model: nn.Module) -> dict[int, object]:
    return {id(p): layer for layer in state_of(model).layers for p in layer.expert_parameters()}


def save_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Write the optimizer state of a hybrid-EP model (collective over EP groups; rank 0 writes)."""
    names, experts = _names(model), _expert_layers(model)
    mesh = state_of(model).mesh
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({
            "params": [names[id(p)] for p in group["params"]],
            **{k: v for k, v in group.items() if k != "params" and isinstance(v, int | float | bool | str | None)},
            **{k: list(v) for k, v in group.items() if isinstance(v, tuple)},
        })
        for p in group["params"]:
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    layer = experts.get(id(p))
                    tensors[f"{name}::{key}"] = (
                        layer.gather_rows(value) if layer is not None else value.detach()
                    ).cpu().contiguous()
                else:
                    scalars.setdefault(name, {})[key] = float(value.item() if torch.is_tensor(value) else value)
    if mesh.rank == 0:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, directory / TENSORS_NAME, metadata={"format": "pt"})
        (directory / META_NAME).write_text(json.dumps({"param_groups": groups, "scalars": scalars}, indent=1))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Fill ``optimizer`` (built over ``model``'s parameters, any EP degree) from a saved state."""
    directory = Path(directory)
    meta = json.loads((directory / META_NAME).read_text())
    names, experts = _names(model), _expert_layers(model)
    by_name = {n: p for n, p in model.named_parameters()}
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{directory / META_NAME}: {len(saved_groups)} param groups saved, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        mine = [names[id(p)] for p in group["params"]]
        if saved["params"] != mine:
            raise ValueError(f"{directory / META_NAME}: param group parameters differ from the optimizer's")
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    with safe_open(directory / TENSORS_NAME, framework="pt") as f:
        keys = list(f.keys())
        for full_key in keys:
            name, key = full_key.split("::")
            p = by_name[name]
            layer = experts.get(id(p))
            if layer is not None:
                sl = f.get_slice(full_key)
                value = torch.cat([sl[e : e + 1] for e in layer.local_experts])
            else:
                value = f.get_tensor(full_key)
            optimizer.state[p][key] = value.to(p.device)
    for name, values in meta["scalars"].items():
        p = by_name[name]
        for key, value in values.items():
            optimizer.state[p][key] = torch.tensor(value, dtype=torch.float32)
