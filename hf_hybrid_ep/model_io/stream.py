"""Writing a live hybrid-EP model as a hybrid-EP checkpoint, one module at a time.

Every rank derives the same schedule from the model, without a collective: the modules in order, and the
checkpoint keys each module's tensors are saved as (the model's original key format: transformers' reverse
weight conversion, applied to meta tensors of the full shapes), laid out in files as conversion lays them
out (:class:`~hf_hybrid_ep.checkpoint.rewrite.WeightFileMap`). Then module by module: a dense module's
tensors are read on rank 0 (FSDP2-sharded ones assembled over the world first); an MoE layer's experts are
all-gathered over rank 0's EP group one parameter at a time, into host memory on rank 0. Rank 0 reverts
them to the checkpoint keys and writes them at their offsets in the files (their headers are written up
front), so it holds one module in host memory at a time, and no device holds more than one expert
parameter's full tensor beyond the model. Each module starts with a beat of the
:class:`~hf_hybrid_ep.parallel.heartbeat.Heartbeat`, and rank 0 finishes the files (checksums, index,
config, side state) alone while the others follow its beats: no rank waits long in one collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.format import FileInfo
from ..checkpoint.manifest import save_metadata
from ..checkpoint.rewrite import WeightFileMap
from ..checkpoint.safetensors_io import StreamingSafetensorsWriter, TensorSpec, nonfinite_count, sha256_file
from ..engine import expert_layers, mesh_of
from ..engine.model_io import gather_scratch, host_tensors, savable_state
from ..errors import CheckpointError
from ..moe.layer import ShardedExperts
from ..parallel.heartbeat import FAILED, WORKING, Heartbeat
from .names import expert_key_layers
from .side_state import save_side_state


@dataclass
class _Unit:
    """The tensors of one module that are written together: ``names`` are state-dict keys; ``layer`` is set
    for an MoE layer's experts module (its expert parameters are gathered over the EP group)."""

    module: str
    names: list[str] = field(default_factory=list)
    layer: ShardedExperts | None = None


def _units(tensors: dict[str, torch.Tensor], layers: list[ShardedExperts]) -> list[_Unit]:
    """One unit per module holding tensors, in state-dict order."""
    by_module = {layer.name: layer for layer in layers}
    units: dict[str, _Unit] = {}
    for name in tensors:
        module = name.rpartition(".")[0]
        unit = units.setdefault(module, _Unit(module, layer=by_module.get(module)))
        unit.names.append(name)
    return list(units.values())


def _full_meta(name: str, tensor: torch.Tensor, unit: _Unit) -> torch.Tensor:
    """A meta tensor of the unsharded shape: ``[E, ...]`` for expert parameters, the global shape of a DTensor."""
    shape = tuple(tensor.shape)
    if unit.layer is not None and name.rpartition(".")[2] in unit.layer.param_names:
        shape = (unit.layer.num_experts, *shape[1:])
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


def _revert(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint keys and tensors ``tensors`` (model names) are saved as (transformers' reverse conversion)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, tensors))


@dataclass
class SaveSchedule:
    """The same on every rank: the units in order, each one's checkpoint keys, and every key's spec."""

    units: list[_Unit]
    keys: list[list[str]]
    specs: dict[str, TensorSpec]

    @classmethod
    def of(cls, model: nn.Module, tensors: dict[str, torch.Tensor]) -> SaveSchedule:
        units = _units(tensors, expert_layers(model))
        keys, specs = [], {}
        for unit in units:
            reverted = _revert(model, {n: _full_meta(n, tensors[n], unit) for n in unit.names})
            keys.append(sorted(reverted))
            specs.update({k: TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in reverted.items()})
        whole = _revert(model, {n: _full_meta(n, tensors[n], u) for u in units for n in u.names})
        if set(whole) != set(specs):  # a conversion whose tensors span modules cannot be written module by module
            odd = sorted(set(whole) ^ set(specs))
            raise CheckpointError(f"cannot save {type(model).__name__} module by module: the weight conversion "
                                  f"of {odd[0]!r} spans modules")
        return cls(units, keys, specs)


def _checked(tensors: dict[str, torch.Tensor], keys: list[str], unit: _Unit) -> dict[str, torch.Tensor]:
    if sorted(tensors) != keys:
        raise CheckpointError(f"module {unit.module!r} reverted to keys {sorted(tensors)[:3]}..., the schedule has "
                              f"{keys[:3]}...")
    return tensors


class _Files:
    """Rank 0's checkpoint files, their headers written from the schedule, filled as the units come."""

    def __init__(self, directory: Path, files: dict[str, list[TensorSpec]], save_id: str) -> None:
        self.directory = directory
        self.file_of = {s.name: f for f, specs in files.items() for s in specs}
        self.writers: dict[str, StreamingSafetensorsWriter] = {}
        for f, specs in files.items():
            self.writers[f] = StreamingSafetensorsWriter(directory / f, specs, save_metadata(save_id))

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            self.writers[self.file_of[key]].write(key, tensor)

    def close(self) -> dict[str, FileInfo]:
        """Close every file; their sizes and checksums."""
        infos = {}
        for f, writer in self.writers.items():
            writer.close()
            infos[f] = FileInfo("", (self.directory / f).stat().st_size, sha256_file(self.directory / f))
        return infos

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()


def _save_config(model: nn.Module, directory: Path) -> None:
    """config.json (with the model's dtype and class), generation_config.json and remote code, as
    ``save_pretrained`` writes them."""
    from transformers.dynamic_module_utils import custom_object_save

    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    if getattr(model, "is_remote_code", lambda: False)():
        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if getattr(model, "can_generate", lambda: False)():
        model.generation_config.save_pretrained(directory)


def stream_model_files(model: nn.Module, directory: Path, save_id: str, beat: Heartbeat) -> None:
    """Write ``model`` into the existing (staging) ``directory``, the same path on every rank: weight files
    laid out for the model's EP degree and placement, the index, config files and the side state.
    Collective; rank 0 writes."""
    layers = expert_layers(model)
    tensors = savable_state(model)
    schedule = SaveSchedule.of(model, tensors)
    tables = {layer.name: layer.table for layer in layers}
    file_map = WeightFileMap(layers[0].num_experts, len(layers), tables,
                             partial(expert_key_layers, model, tables=tables))
    files = beat.alone(lambda: _Files(directory, file_map.assign(schedule.specs), save_id))  # None but on rank 0
    scratch = gather_scratch(model) if mesh_of(model).edp_rank == 0 else None  # every expert parameter passes through
    failure, poisoned = None, []
    try:
        for unit, keys in zip(schedule.units, schedule.keys, strict=True):
            if beat.beat(FAILED if failure else WORKING, failure) == FAILED:  # rank 0 stops at its first failure
                raise failure
            host = host_tensors(model, {n: tensors[n] for n in unit.names}, rank0_only=True, scratch=scratch)
            if files is not None and failure is None:
                poisoned += nonfinite_names(host)
                try:
                    files.write(_checked(_revert(model, host), keys, unit))
                except Exception as err:  # reported to every rank at the next beat
                    failure = err
            del host  # one module in host memory at a time
        if poisoned and failure is None:
            failure = CheckpointError(
                f"refusing to save {directory.name}: {len(poisoned)} tensor(s) hold NaN or inf, e.g. "
                f"{', '.join(poisoned[:5])}; a step with non-finite gradients or an overflow poisoned the weights "
                "(resume from an earlier checkpoint)")
        if beat.beat(FAILED if failure else WORKING, failure) == FAILED:
            raise failure
        total = sum(spec.nbytes for spec in schedule.specs.values())
        beat.alone(lambda: _finish(model, directory, files, file_map, total, save_id))
    except BaseException:
        if files is not None:
            files.abort()
        raise


def nonfinite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors that hold NaN or inf."""
    return [name for name, t in tensors.items() if nonfinite_count(t)]


def _finish(model: nn.Module, directory: Path, files: _Files, file_map: WeightFileMap, total: int, save_id: str) -> None:
    """Rank 0: close and checksum the files, then the index, config files and side state."""
    file_map.finish(directory, dict(files.file_of), files.close(), total)
    _save_config(model, directory)
    save_side_state(model, directory, save_id)
