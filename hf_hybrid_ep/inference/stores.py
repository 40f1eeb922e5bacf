"""Where offloaded experts live while not resident: CPU memory (:class:`MemoryStore`) or the expert files
of a checkpoint, memory-mapped (:class:`SafetensorsStore`).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import HybridEPConfigError


class MemoryStore:
    """Every expert in (pageable) CPU memory; on CUDA a load is staged through a few pinned buffers
    (:class:`~hf_hybrid_ep.inference.offload.ExpertTransfers`), so the page-locked memory stays a few experts."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}

    def bind(self, model: nn.Module, layers: list[tuple[str, nn.Module, list[str]]]) -> None:
        for name, module, param_names in layers:
            self.tensors[name] = {p: getattr(module, p).detach().to("cpu").clone() for p in param_names}

    def expert(self, layer: str, expert: int) -> dict[str, torch.Tensor]:
        """``{parameter: [...]}`` rows of ``expert`` (one expert, no leading dimension), on the CPU."""
        return {p: t[expert] for p, t in self.tensors[layer].items()}


class SafetensorsStore:
    """Experts read on demand from a checkpoint's safetensors files through ``safe_open`` (memory-mapped):
    a hybrid-EP checkpoint (per-rank expert files or fused tensors) or a plain Hugging Face one. Keys are
    mapped to the fused parameters with transformers' own conversion mapping (as rank-local loading
    does), so one expert is one small read per source key."""

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        from ..checkpoint.atomic import open_checkpoint
        from ..checkpoint.format import read_weight_map

        self.root = Path(path)
        if not self.root.is_dir():
            raise HybridEPConfigError(f"expert store {str(self.root)!r} is not a checkpoint directory")
        self.verifier = open_checkpoint(self.root, verify=verify)  # each file checked when first opened
        self.weight_map = read_weight_map(self.root)
        self.targets: dict = {}
        self.model: nn.Module | None = None
        self.reader = None

    def bind(self, model: nn.Module, layers: list[tuple[str, nn.Module, list[str]]]) -> None:
        from ..checkpoint.reader import CheckpointReader
        from ..model_io.rank_local import tensor_recipes

        views = [SimpleNamespace(name=n, param_names=ps, local_experts=list(range(m.num_experts))) for n, m, ps in layers]
        self.targets = tensor_recipes(model, views, self.weight_map)
        self.model, self.reader = model, CheckpointReader(self.root, self.weight_map, verifier=self.verifier)
        self.param_names = {name: param_names for name, _, param_names in layers}
        for name, module, param_names in layers:  # a checkpoint of another model fails here, naming the key
            for p in param_names:
                if f"{name}.{p}" not in self.targets:
                    raise HybridEPConfigError(f"expert store {str(self.root)!r} has no tensor for {name}.{p}")
            for p, value in self.expert(name, 0).items():
                want = tuple(getattr(module, p).shape[1:])
                if tuple(value.shape) != want:
                    raise HybridEPConfigError(
                        f"expert store {str(self.root)!r}: {name}.{p} has expert shape {tuple(value.shape)}, "
                        f"the model expects {want}"
                    )

    def expert(self, layer: str, expert: int) -> dict[str, torch.Tensor]:
        from ..model_io.rank_local import assemble

        out = {}
        for p in self.param_names[layer]:
            key = f"{layer}.{p}"
            target = self.targets[key]
            if target.converter is None:
                if target.rows is None:
                    raise HybridEPConfigError(f"expert store {str(self.root)!r}: {key} is not an expert tensor")
                value = self.reader.rows(target.direct, [expert])
            else:
                value = assemble(key, target.for_slot(expert), self.reader, self.model)  # every expert held: slot = id
            out[p] = value[0]
        return out


def make_store(store) -> MemoryStore | SafetensorsStore:
    """The store ``offload(store=...)`` names: ``None`` / ``"memory"``, a store, or a checkpoint directory."""
    if store is None or store == "memory":
        return MemoryStore()
    if isinstance(store, MemoryStore | SafetensorsStore):
        return store
    if isinstance(store, str | os.PathLike):
        return SafetensorsStore(store)
    raise HybridEPConfigError(f"store={store!r} must be 'memory', a checkpoint directory or an expert store")
