"""Streaming checkpoint rewriting: the one operation under convert (Hub or local → hybrid EP), reshard and export.

Read a safetensors checkpoint tensor by tensor and write it to new files. Peak memory is one tensor plus the
writers' buffers, never the model. OUT is checked and claimed before any work; output goes to a hidden staging
sibling that is fsynced and renamed into place only when complete and listed in the manifest (:mod:`.atomic`);
on any error it is removed and OUT is left untouched. What the files of a hybrid-EP checkpoint hold comes from
the placement tables and a map of per-expert keys to MoE layers (:class:`WeightFileMap`); the model those are
read from is the caller's (:mod:`hf_hybrid_ep.model_io.convert`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..dispatch import PlacementTable
from ..dispatch.table import spec_of
from ..errors import CheckpointError
from .atomic import check_output_free, open_checkpoint, staged_save
from .dequantize import Dequantizer
from .format import (
    INDEX_NAME,
    SIDE_FILE,
    SINGLE_NAME,
    TRAINING_STATE,
    WEIGHT_SUFFIXES,
    CheckpointIndex,
    FileInfo,
    HybridEPMetadata,
    dense_file,
    format_bytes,
    fused_file,
    rank_file,
    read_index,
    write_index,
)
from .keys import classify_keys
from .manifest import save_metadata
from .safetensors_io import StreamingSafetensorsWriter, TensorFiles, TensorSpec, sha256_file

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_HEADER_BYTES_PER_TENSOR = 256  # a safetensors header entry, generously
logger = logging.getLogger("hf_hybrid_ep")


def _cast(spec: TensorSpec, dtype: torch.dtype | None) -> TensorSpec:
    if dtype is None or not spec.dtype.is_floating_point:
        return spec
    return TensorSpec(spec.name, dtype, spec.shape)


def _pack_by_size(specs: list[TensorSpec], cap: int) -> list[list[TensorSpec]]:
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return [g for g in groups if g]


def _copy_side_files(src: Path, dst: Path, plain_model: bool = False) -> None:
    """Copy config, tokenizer and other non-weight files; ``plain_model`` (export): model files only — neither the
    hybrid-EP side file nor a Trainer checkpoint's training state (:data:`~.format.TRAINING_STATE`)."""
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name == INDEX_NAME:
            continue
        if plain_model and TRAINING_STATE.match(f.name):
            continue
        if f.name == SIDE_FILE:
            if not plain_model:
                shutil.copy2(f, dst / f.name)
        elif not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)


@dataclass
class RewriteTensors:
    """What a rewrite writes: the tensors (dequantized where the source is quantized), their specs
    (less the ``dropped`` keys the model never loads), and how to say so."""

    dequantizer: Dequantizer
    specs: dict[str, TensorSpec]
    dropped: list[str]

    @classmethod
    def plain(cls, index: CheckpointIndex) -> RewriteTensors:
        return cls(Dequantizer(None, index.specs), dict(index.specs), [])

    def describe(self) -> str:
        quantization = self.dequantizer.quantization
        return "" if quantization is None else f", {quantization.describe()}"


def rewrite_files(
    index: CheckpointIndex,
    tmp: Path,
    save_id: str,
    assign: Callable[[dict[str, TensorSpec]], dict[str, list[TensorSpec]]],
    finish: Callable[[Path, dict[str, str], dict[str, FileInfo], int], None],
    dtype: torch.dtype | None,
    progress: bool,
    plain_model: bool = False,
    tensors: RewriteTensors | None = None,
) -> None:
    """Stream every tensor of a (checked) source index into the files ``assign`` lays out in the staging
    directory ``tmp``, then ``finish`` (which writes the index). The caller commits ``tmp``.

    A dequantized tensor of three or more dimensions is read, dequantized and written one expert at a
    time; any other tensor whole. Source files are opened one at a time (a scale stored in another
    file opens that one too) and closed before the next."""
    src_dir = index.root
    tensors = tensors or RewriteTensors.plain(index)
    open_checkpoint(src_dir, verify=True).check_all()
    file_map = assign({k: _cast(s, dtype) for k, s in tensors.specs.items()})
    _check_space(index, tmp, file_map, tensors, progress)
    writers: dict[str, StreamingSafetensorsWriter] = {}
    try:
        weight_map = {spec.name: file for file, specs in file_map.items() for spec in specs}
        for file, specs in file_map.items():
            writers[file] = StreamingSafetensorsWriter(tmp / file, specs, save_metadata(save_id))
        by_file: dict[str, list[str]] = {}
        for key in sorted(tensors.specs):
            by_file.setdefault(index.weight_map[tensors.dequantizer.sources(key)[0]], []).append(key)
        total = sum(s.nbytes for specs in file_map.values() for s in specs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
            for src_file in sorted(by_file):
                with TensorFiles(index.weight_map, index.path) as raw:
                    for key in by_file[src_file]:
                        for rows in tensors.dequantizer.chunks(tensors.specs[key]):
                            tensor = tensors.dequantizer.read(raw, key, rows)
                            if dtype is not None and tensor.dtype.is_floating_point:
                                tensor = tensor.to(dtype)
                            writers[weight_map[key]].write(key, tensor, 0 if rows is None else rows.start)
                            bar.update(tensor.nbytes)
                            del tensor
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    infos = {file: FileInfo("", (tmp / file).stat().st_size, sha256_file(tmp / file)) for file in file_map}
    _copy_side_files(src_dir, tmp, plain_model)
    finish(tmp, weight_map, infos, sum(s.nbytes for specs in file_map.values() for s in specs))


def _is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint: model weights (an index or one file), adapters, or Trainer state."""
    return any((directory / name).is_file() for name in (INDEX_NAME, SINGLE_NAME, "adapter_model.safetensors",
                                                         "trainer_state.json"))


def check_outside_checkpoints(out: Path) -> None:
    """Refuse an output inside an existing checkpoint (checked before any work): it would be a folder that
    checkpoint's manifest does not list, which loaders never read and which a save of that checkpoint replaces."""
    for parent in Path(out).resolve().parents:
        if _is_checkpoint(parent):
            raise CheckpointError(f"output {str(out)!r} is inside the checkpoint {str(parent)!r}: write it outside "
                                  f"any checkpoint, e.g. {str(parent.parent / f'{parent.name}-{Path(out).name}')!r}")


def free_bytes(directory: Path) -> int:
    """Free bytes of the filesystem holding ``directory``."""
    return shutil.disk_usage(directory).free


def _check_space(index: CheckpointIndex, tmp: Path, file_map: dict[str, list[TensorSpec]], tensors: RewriteTensors,
                 progress: bool) -> None:
    """State the output's size (and the keys left out) and refuse, before writing, when the output's
    filesystem lacks the room for it."""
    out = tmp.parent.parent / tmp.name  # the staging directory sits in a hidden sibling of OUT
    specs = [s for group in file_map.values() for s in group]
    side = sum(f.stat().st_size for f in index.root.iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES))
    needed = sum(s.nbytes for s in specs) + side + _HEADER_BYTES_PER_TENSOR * len(specs)
    source = sum(s.nbytes for s in index.specs.values())
    message = (f"{out}: writing {format_bytes(needed)} in {len(file_map)} files from {index.root.name} "
               f"({format_bytes(source)}{tensors.describe()})")
    if tensors.dropped:
        message += (f"; leaving out {len(tensors.dropped)} key(s) the model does not load "
                    f"({', '.join(tensors.dropped[:3])}{', ...' if len(tensors.dropped) > 3 else ''})")
    logger.info(message)
    if progress:
        tqdm.write(message, file=sys.stderr)
    free = free_bytes(tmp)
    if free < needed:
        raise CheckpointError(f"{out}: the output needs {format_bytes(needed)}, its filesystem has "
                              f"{format_bytes(free)} free; free some space or write it elsewhere")


@dataclass
class WeightFileMap:
    """Where each tensor of a hybrid-EP checkpoint goes (:meth:`assign`) and the index that describes the files
    (:meth:`finish`): dense tensors in size-capped files, per-expert keys in the file of the EP rank holding
    the expert (its first holder), fused ``[E, ...]`` tensors whole in size-capped files. ``layer_of`` maps
    per-expert keys to their MoE layer (the experts module name ``tables`` is keyed by)."""

    num_experts: int
    num_moe_layers: int
    tables: dict[str, PlacementTable]
    layer_of: Callable[[list[str]], dict[str, str]]
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    source: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, tuple[str, int | None]] = field(default_factory=dict, init=False)
    storage: str = field(default="", init=False)
    dtype: str = field(default="", init=False)

    @property
    def ep_degree(self) -> int:
        return next(iter(self.tables.values())).ep_degree

    def assign(self, specs: dict[str, TensorSpec]) -> dict[str, list[TensorSpec]]:
        roles = classify_keys(specs, self.num_experts)
        layer_of = self.layer_of([k for k, r in roles.items() if r.kind == "per_expert"])
        owner = {(name, e): t.holders(e)[0] for name, t in self.tables.items() for e in range(t.num_experts)}
        dense = [s for k, s in sorted(specs.items()) if roles[k].kind == "dense"]
        fused = [s for k, s in sorted(specs.items()) if roles[k].kind == "fused"]
        per_rank: dict[int, list[TensorSpec]] = {r: [] for r in range(self.ep_degree)}
        for k, s in sorted(specs.items()):
            if roles[k].kind == "per_expert":
                per_rank[owner[(layer_of[k], roles[k].expert)]].append(s)
        file_map: dict[str, list[TensorSpec]] = {}
        dense_groups = _pack_by_size(dense, self.max_shard_bytes)
        for i, group in enumerate(dense_groups, 1):
            file_map[dense_file(i, len(dense_groups))] = group
        self.roles = {}
        for r, group in per_rank.items():
            if group:
                file_map[rank_file(r, self.ep_degree)] = group
                self.roles[rank_file(r, self.ep_degree)] = ("experts", r)
        fused_groups = _pack_by_size(fused, self.max_shard_bytes)
        for i, group in enumerate(fused_groups, 1):
            file_map[fused_file(i, len(fused_groups))] = group
            self.roles[fused_file(i, len(fused_groups))] = ("fused", None)
        kinds = {r.kind for r in roles.values()} - {"dense"}
        self.storage = kinds.pop() if len(kinds) == 1 else "mixed"
        floats = [s.dtype for s in specs.values() if s.dtype.is_floating_point]
        self.dtype = str(max(set(floats), key=floats.count)).removeprefix("torch.") if floats else "none"
        return file_map

    def finish(self, tmp: Path, weight_map: dict[str, str], infos: dict[str, FileInfo], total: int) -> None:
        for name, info in infos.items():
            info.role, info.ep_rank = self.roles.get(name, ("dense", None))
        meta = HybridEPMetadata(
            ep_degree=self.ep_degree, num_experts=self.num_experts,
            num_moe_layers=self.num_moe_layers, storage=self.storage, placement=spec_of(self.tables),
            dtype=self.dtype, source=self.source, files=infos,
        )
        write_index(tmp, weight_map, total, meta)


def export_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> list[str]:
    """Write a plain Hugging Face checkpoint (the model's original key format, standard shard names): the model's
    files only — weights, config, tokenizer — never a Trainer checkpoint's training state.

    Returns what was left out, each with why: the hybrid_ep metadata block and side state, which vanilla
    transformers has no place for, and the training state (optimizer, scheduler, RNG, Trainer state).
    """
    src_dir, out = Path(src), Path(out)
    check_output_free(out)
    check_outside_checkpoints(out)
    index = read_index(src_dir)
    dropped = ["model.safetensors.index.json: metadata.hybrid_ep"] if index.hybrid_ep is not None else []
    if (src_dir / SIDE_FILE).is_file():
        dropped.append(f"{SIDE_FILE}: selection-only router biases (aux-loss-free balancing)")
    training = sorted(f.name for f in src_dir.iterdir() if f.is_file() and TRAINING_STATE.match(f.name))
    if training:
        dropped.append(f"{', '.join(training)}: training state (resume from {src_dir.name} itself)")

    def assign(specs: dict[str, TensorSpec]) -> dict[str, list[TensorSpec]]:
        groups = _pack_by_size([s for _, s in sorted(specs.items())], max_shard_bytes)
        return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups, 1)}

    def finish(tmp: Path, weight_map: dict[str, str], infos: dict[str, FileInfo], total: int) -> None:
        write_index(tmp, weight_map, total, None)

    with staged_save(out, fresh=True) as (tmp, save_id):
        rewrite_files(index, tmp, save_id, assign, finish, None, progress, plain_model=True)
    return dropped
