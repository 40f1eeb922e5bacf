"""PEFT adapters of a hybrid-EP model, read rank-locally from an ordinary PEFT adapter directory.

A PEFT adapter directory (:mod:`hf_hybrid_ep.checkpoint.peft_files`) holds every expert's factors
in PEFT's layout: ``lora_A [r·E, in]`` (expert-major rows) and ``lora_B [out, r·E]`` (the expert index
fastest). A rank reads the dense adapters whole and, of each expert factor, only its own experts' rows of
``lora_A`` and columns of ``lora_B`` (strided slices of the file), into the slot-major layout the engine trains
(:mod:`hf_hybrid_ep.moe.lora`). Fresh adapters (``from_pretrained(..., peft_config=...)``) are drawn the same
way: each expert's ``lora_A`` from its own generator, so no rank draws another rank's experts and the initial
adapter is the same at every layout.
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.manifest import CheckpointVerifier
from ..checkpoint.peft_files import (
    ADAPTER_CONFIG,
    ADAPTER_FIELDS,
    ADAPTER_WEIGHTS,
    adapter_conflicts,
    checked_adapter_file,
    read_adapter_config,
)
from ..engine.model_io import expert_factors
from ..errors import CheckpointError, HybridEPConfigError
from ..moe.discovery import unwrapped_name
from ..moe.layer import ShardedExperts
from ..moe.lora import is_param_wrapper


def check_adapter_config(model: nn.Module, directory: str | os.PathLike[str], adapter: str = "default",
                         verifier: CheckpointVerifier | None = None) -> None:
    """Refuse to resume ``model``'s adapter ``adapter`` from ``directory`` when the adapter config saved there
    differs from the model's in a field of :data:`ADAPTER_FIELDS`, naming each field and both values.

    Raises:
        HybridEPConfigError: before any tensor is read.
    """
    config = model.peft_config[adapter]
    conflicts = adapter_conflicts(read_adapter_config(directory, verifier),
                                  {f: getattr(config, f, None) for f in ADAPTER_FIELDS}, "in the model")
    if conflicts:
        raise HybridEPConfigError(
            f"the model's adapter {adapter!r} is not the one saved in {str(Path(directory) / ADAPTER_CONFIG)!r} "
            f"({'; '.join(conflicts)}): resume with the saved adapter config (PeftConfig.from_pretrained of the "
            "checkpoint), or start a new run in another output directory")


def adapter_file_keys(model: nn.Module, adapter: str = "default") -> dict[str, str]:
    """Parameter name → its key in PEFT's ``adapter_model.safetensors``, for every parameter PEFT saves of
    ``adapter`` (PEFT's own naming: the adapter name dropped)."""
    from peft.utils import get_peft_model_state_dict

    named = dict(model.named_parameters())
    saved = get_peft_model_state_dict(model, state_dict=named, adapter_name=adapter, save_embedding_layers=False)
    name_of = {id(p): n for n, p in named.items()}
    return {name_of[id(v)]: key for key, v in saved.items() if id(v) in name_of}


def _expert_rows(tensor_slice, kind: str, layer: ShardedExperts) -> torch.Tensor:
    """This rank's experts of a file's expert factor (a safetensors slice of PEFT's layout), slot-major."""
    experts = layer.num_experts
    if kind == "A":
        rows = tensor_slice.get_shape()[0] // experts
        return torch.stack([tensor_slice[e * rows : (e + 1) * rows] for e in layer.local_experts])
    return torch.stack([tensor_slice[:, e::experts] for e in layer.local_experts])


def _put(model: nn.Module, name: str, value: torch.Tensor, device: torch.device | None) -> None:
    """``value`` into parameter ``name``: copied into a live parameter, or a new one replacing a meta one."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._parameters[leaf]
    if tuple(value.shape) != tuple(current.shape):
        raise CheckpointError(f"adapter tensor for {name!r} has shape {tuple(value.shape)}, the model expects "
                              f"{tuple(current.shape)} (another rank or target set?)")
    if not current.is_meta:
        current.data.copy_(value.to(current.dtype))
        return
    module._parameters[leaf] = nn.Parameter(value.to(device=device, dtype=current.dtype),
                                            requires_grad=current.requires_grad)


@torch.no_grad()
def load_adapter_(model: nn.Module, layers: list[ShardedExperts], directory: str | os.PathLike[str],
                  adapter: str = "default", device: torch.device | None = None,
                  verifier: CheckpointVerifier | None = None) -> None:
    """Fill the adapter parameters of a ``PeftModel`` (its EP ``layers`` sharded) from a PEFT adapter directory: dense adapters
    whole, expert factors of this rank's experts only. Meta parameters are replaced (on ``device``), live ones
    (a resume, at any EP degree) copied into. The weights file is checked first (``verifier``, default: the
    directory's manifest, when it has one).

    Raises:
        CheckpointError: naming the file and the key it lacks, a tensor of the wrong shape, or a file that fails
            its manifest.
    """
    from safetensors import safe_open

    path = checked_adapter_file(Path(directory), ADAPTER_WEIGHTS, verifier)
    factors = expert_factors(model, layers)
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        for name, key in adapter_file_keys(model, adapter).items():
            if key not in keys:
                raise CheckpointError(f"{str(path)!r} lacks {key!r} (adapter parameter {name}); was it saved for "
                                      "the same targets?")
            if name in factors:
                layer, kind = factors[name]
                value = _expert_rows(f.get_slice(key), kind, layer)
            else:
                value = f.get_tensor(key)
            _put(model, name, value, device)


def _expert_generator(seed: int, name: str, expert: int) -> torch.Generator:
    """The generator of one expert's ``lora_A`` rows: from the run's seed, the factor's name without PEFT's
    prefix and the expert id (stable across processes, layouts and Python hash seeds)."""
    return torch.Generator().manual_seed((seed + zlib.crc32(f"{unwrapped_name(name)}:{expert}".encode())) % 2**63)


@torch.no_grad()
def init_adapters_(model: nn.Module, layers: list[ShardedExperts], adapter: str = "default",
                   device: torch.device | None = None) -> None:
    """Fresh adapters for a ``PeftModel`` (its EP ``layers`` sharded), built on the meta device or drawn by PEFT over
    this rank's slots: dense adapters by PEFT's own ``reset_lora_parameters`` (from the global RNG, identical on every
    rank under the same seed); expert factors as PEFT draws them — ``lora_A`` uniform in ``±1/√in``
    (``init_lora_weights=True``) or normal with std ``1/r`` (``"gaussian"``), ``lora_B`` zero — each expert from its
    own generator (:func:`_expert_generator`). Made on ``device``, by default on the device of the weights each
    adapter adapts."""
    init = model.peft_config[adapter].init_lora_weights
    seed = int(torch.randint(0, 2**62, ()).item())  # one draw: the same on every rank under the same seed
    factors = expert_factors(model, layers)
    for module in model.modules():
        if hasattr(module, "reset_lora_parameters") and adapter in getattr(module, "lora_A", {}) \
                and not is_param_wrapper(module):
            made_on = device if device is not None else module.get_base_layer().weight.device
            for linear in (module.lora_A[adapter], module.lora_B[adapter]):
                linear.to_empty(device=made_on)
            module.reset_lora_parameters(adapter, init)
    params = dict(model.named_parameters())
    for name, (layer, kind) in factors.items():
        shape = params[name].shape
        made_on = device if device is not None else layer.expert_parameters()[0].device
        if kind == "B":
            _put(model, name, torch.zeros(shape), made_on)
            continue
        rows = []
        for e in layer.local_experts:
            g = _expert_generator(seed, name, e)
            if init == "gaussian":
                rows.append(torch.randn(shape[1:], generator=g) / shape[1])
            else:
                bound = 1 / math.sqrt(shape[2])
                rows.append(torch.rand(shape[1:], generator=g) * (2 * bound) - bound)
        _put(model, name, torch.stack(rows), made_on)
