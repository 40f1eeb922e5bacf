"""Streaming checkpoint rewriting: convert (Hub or local → hybrid EP), reshard and export.

All three are one operation: read a safetensors checkpoint tensor by tensor and write it to new
files. Peak memory is one tensor plus the writers' buffers, never the model. OUT is checked and
claimed before any work; output goes to a hidden staging sibling that is fsynced and renamed into
place only when complete and listed in the manifest (:mod:`.atomic`); on any error it is removed and
OUT is left untouched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..dispatch import PlacementTable
from ..dispatch.table import PlacementSpec, layer_tables, spec_of
from ..errors import CheckpointError, HybridEPConfigError
from ..moe.discovery import find_experts_modules
from .atomic import check_output_free, open_checkpoint, staged_save
from .dequantize import DEFAULT_DTYPE, Dequantizer, quantization_of
from .format import (
    INDEX_NAME,
    SIDE_FILE,
    SINGLE_NAME,
    TRAINING_STATE,
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
from .keys import ModelExperts, classify_keys, model_experts, model_tensor_names
from .manifest import save_metadata
from .safetensors_io import StreamingSafetensorsWriter, TensorFiles, TensorSpec, sha256_file
from .validate import validate_against_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
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


def hub_metadata(repo_id: str, revision: str | None = None) -> tuple[Path, dict[str, Any], list[str]]:
    """Download a Hub repo's config, side files and index (no weights); return the snapshot directory,
    the source record (repo id and resolved commit) and the weight files the checkpoint consists of."""
    if not _REPO_ID.match(repo_id):
        raise CheckpointError(f"{repo_id!r} is neither a checkpoint directory nor a Hub repo id")
    from huggingface_hub import HfApi, hf_hub_download

    info = HfApi().model_info(repo_id, revision=revision, files_metadata=False)
    files = [s.rfilename for s in (info.siblings or [])]
    side = [f for f in files if "/" not in f and not f.endswith(_WEIGHT_SUFFIXES) and f != INDEX_NAME]
    if INDEX_NAME in files:
        index_path = Path(hf_hub_download(repo_id, INDEX_NAME, revision=info.sha))
        weights = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    elif SINGLE_NAME in files:
        weights = [SINGLE_NAME]
    else:
        raise CheckpointError(f"Hub repo {repo_id!r} has no safetensors weights ({INDEX_NAME} or {SINGLE_NAME})")
    root = None
    for name in side or ["config.json"]:
        root = Path(hf_hub_download(repo_id, name, revision=info.sha)).parent
    return root, {"repo_id": repo_id, "revision": info.sha}, weights


def resolve_source(src: str | os.PathLike[str], revision: str | None = None) -> tuple[Path, dict[str, Any]]:
    """A local checkpoint directory, or a Hub repo id downloaded with only the files conversion needs."""
    path = Path(src)
    if path.is_dir():
        return path, {"folder": path.resolve().name}
    from huggingface_hub import hf_hub_download

    root, source, weights = hub_metadata(str(src), revision)
    _check_quantization(root, str(src))  # before downloading any weights
    for name in tqdm(weights, desc=f"download {src}", unit="file"):
        hf_hub_download(source["repo_id"], name, revision=source["revision"])
    return root, source


def _check_quantization(root: Path, where: str) -> None:
    """Refuse a quantization method that cannot be dequantized, reading only ``config.json``."""
    config = root / "config.json"
    if config.is_file():
        try:
            quantization_of(json.loads(config.read_text()), where)
        except json.JSONDecodeError:
            pass  # read_config names the file with transformers' own error


def _drop_quantization_config(config: Path) -> None:
    """Rewrite ``config.json`` without ``quantization_config`` (its weights are dequantized)."""
    data = json.loads(config.read_text())
    data.pop("quantization_config", None)
    config.write_text(json.dumps(data, indent=2) + "\n")


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
        elif not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)


@dataclass
class _Tensors:
    """What a rewrite writes: the tensors (dequantized where the source is quantized), their specs
    (less the ``dropped`` keys the model never loads), and how to say so."""

    dequantizer: Dequantizer
    specs: dict[str, TensorSpec]
    dropped: list[str]

    @classmethod
    def plain(cls, index: CheckpointIndex) -> _Tensors:
        return cls(Dequantizer(None, index.specs), dict(index.specs), [])

    def describe(self) -> str:
        quantization = self.dequantizer.quantization
        return "" if quantization is None else f", {quantization.describe()}"


def _rewrite(
    index: CheckpointIndex,
    tmp: Path,
    save_id: str,
    assign: Callable[[dict[str, TensorSpec]], dict[str, list[TensorSpec]]],
    finish: Callable[[Path, dict[str, str], dict[str, FileInfo], int], None],
    dtype: torch.dtype | None,
    progress: bool,
    plain_model: bool = False,
    tensors: _Tensors | None = None,
) -> None:
    """Stream every tensor of a (checked) source index into the files ``assign`` lays out in the staging
    directory ``tmp``, then ``finish`` (which writes the index). The caller commits ``tmp``.

    A dequantized tensor of three or more dimensions is read, dequantized and written one expert at a
    time; any other tensor whole. Source files are opened one at a time (a scale stored in another
    file opens that one too) and closed before the next."""
    src_dir = index.root
    tensors = tensors or _Tensors.plain(index)
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


def _check_space(index: CheckpointIndex, tmp: Path, file_map: dict[str, list[TensorSpec]], tensors: _Tensors,
                 progress: bool) -> None:
    """State the output's size (and the keys left out) and refuse, before writing, when the output's
    filesystem lacks the room for it."""
    out = tmp.parent.parent / tmp.name  # the staging directory sits in a hidden sibling of OUT
    specs = [s for group in file_map.values() for s in group]
    side = sum(f.stat().st_size for f in index.root.iterdir() if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES))
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


def _source_record(src_dir: Path, source: dict[str, Any], index: CheckpointIndex) -> dict[str, Any]:
    """Where the weights came from: the Hub id and commit, or a folder *name* (never a local path)."""
    if index.hybrid_ep is not None and index.hybrid_ep.source:
        return dict(index.hybrid_ep.source)
    return source


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    ep_degree: int | None = None,
    placement: PlacementSpec | PlacementTable | None = None,
    dtype: str | None = None,
    revision: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> Path:
    """Convert a Hub repo or local checkpoint (or reshard a hybrid-EP one) for ``ep_degree`` EP ranks.

    Per-expert keys go to one file per EP rank (global expert ids in the keys): the rank that holds
    the expert under ``placement`` (one table — one row of expert ids per EP rank — for every MoE
    layer, or a mapping from experts module name to its layer's table, as ``HybridEPConfig`` takes it;
    default contiguous), the first holder for a replicated expert (a key lives in one file; loading
    reads keys, not files, so every holder finds it). Fused ``[E, ...]`` expert tensors stay whole;
    dense tensors go to size-capped shards. The tables are stored in the index
    (``metadata.hybrid_ep.placement``: one table when every layer has the same, else per layer) and
    used by :func:`hf_hybrid_ep.from_pretrained` when the config names no placement.

    A quantized source (``quantization_config`` block-FP8 or MXFP4, :mod:`.dequantize`) is dequantized
    as it streams, one tensor or one expert at a time, to ``dtype`` (default ``"bfloat16"``; other
    tensors keep their dtype unless ``dtype`` is given); the output's ``config.json`` has no
    ``quantization_config`` and its index records the method (``source.dequantized_from``). Keys the
    model never loads (DeepSeek-V3's multi-token-prediction layer ``model.layers.61.*``) are left out.

    OUT is checked first (it must not exist or be empty, nor lie inside a checkpoint) and claimed, so a concurrent convert into
    it fails at once; the output's size is stated (with ``progress``) and checked against the free
    space of OUT's filesystem; the result is staged and renamed into place complete (:mod:`.atomic`).
    No code the source's config names (``auto_map``) runs unless ``trust_remote_code=True``.

    Raises:
        CheckpointError: before anything is written, naming the file or key at fault (also for a
            placement that does not fit the model or disagrees with ``ep_degree``, a quantization
            method that is not dequantized exactly, or too little free space).
    """
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if ep_degree is not None and (isinstance(ep_degree, bool) or not isinstance(ep_degree, int) or ep_degree < 1):
        raise CheckpointError(f"ep_degree must be a positive integer, got {ep_degree!r}")
    torch_dtype = DTYPES[dtype] if dtype else None
    out = Path(out)
    check_output_free(out)
    check_outside_checkpoints(out)
    with staged_save(out, fresh=True) as (tmp, save_id):
        convert_into(src, tmp, save_id, ep_degree=ep_degree, placement=placement, dtype=torch_dtype,
                     revision=revision, max_shard_bytes=max_shard_bytes, progress=progress,
                     trust_remote_code=trust_remote_code)
    return out


@dataclass
class ShardFileMap:
    """Where each tensor of a hybrid-EP checkpoint goes (:meth:`assign`) and the index that describes the files
    (:meth:`finish`): dense tensors in size-capped shards, per-expert keys in the file of the EP rank holding
    the expert (its first holder), fused ``[E, ...]`` tensors whole in size-capped shards."""

    experts: ModelExperts
    tables: dict[str, PlacementTable]
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    source: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, tuple[str, int | None]] = field(default_factory=dict, init=False)
    storage: str = field(default="", init=False)
    dtype: str = field(default="", init=False)

    @property
    def ep_degree(self) -> int:
        return next(iter(self.tables.values())).ep_degree

    def assign(self, specs: dict[str, TensorSpec]) -> dict[str, list[TensorSpec]]:
        roles = classify_keys(specs, self.experts.num_experts)
        layer_of = _expert_key_layers(self.experts.model, [k for k, r in roles.items() if r.kind == "per_expert"],
                                      self.tables)
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
            ep_degree=self.ep_degree, num_experts=self.experts.num_experts,
            num_moe_layers=self.experts.num_moe_layers, storage=self.storage, placement=spec_of(self.tables),
            dtype=self.dtype, source=self.source, files=infos,
        )
        write_index(tmp, weight_map, total, meta)


def convert_into(
    src: str | os.PathLike[str],
    tmp: Path,
    save_id: str,
    *,
    ep_degree: int | None = None,
    placement: PlacementSpec | PlacementTable | None = None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> None:
    """:func:`convert_checkpoint` into an existing staging directory ``tmp`` (the caller commits it)."""
    torch_dtype = dtype
    src_dir, source = resolve_source(src, revision)
    experts = model_experts(src_dir, trust_remote_code)
    tables = _placement_tables(placement, ep_degree, experts)
    index = read_index(src_dir)
    tensors = _source_tensors(index, experts, dtype)
    source = _source_record(src_dir, source, index)
    if tensors.dequantizer.quantization is not None:
        source["dequantized_from"] = tensors.dequantizer.quantization.record(tensors.dequantizer.dtype)
    file_map = ShardFileMap(experts, tables, max_shard_bytes, source)

    def finish(tmp: Path, weight_map: dict[str, str], infos: dict[str, FileInfo], total: int) -> None:
        file_map.finish(tmp, weight_map, infos, total)
        if tensors.dequantizer.quantization is not None and (tmp / "config.json").is_file():
            _drop_quantization_config(tmp / "config.json")

    _rewrite(index, tmp, save_id, file_map.assign, finish, torch_dtype, progress, tensors=tensors)


def _source_tensors(index: CheckpointIndex, experts: ModelExperts, dtype: torch.dtype | None) -> _Tensors:
    """The source's tensors as the output holds them, checked against the model: quantized pairs
    dequantized to ``dtype`` (default bfloat16), keys the model never loads left out.

    Raises:
        CheckpointError: for a quantization method or a tensor that cannot be dequantized exactly, or
            a checkpoint that does not match the model (naming the keys).
    """
    where = str(index.root)
    quantization = quantization_of(experts.model.config, where)
    dequantizer = Dequantizer(quantization, index.specs, dtype or DEFAULT_DTYPE)
    specs = dequantizer.specs(index.specs)
    dropped = validate_against_model(experts.model, specs, where)
    return _Tensors(dequantizer, {k: s for k, s in specs.items() if k not in set(dropped)}, dropped)


def _placement_tables(placement: PlacementSpec | PlacementTable | None, ep_degree: int | None,
                      experts: ModelExperts) -> dict[str, PlacementTable]:
    """One table per MoE layer (experts module name → table) from a placement spec, or contiguous."""
    from ..config import placement_row_count

    layers = [(name, m.num_experts) for name, m in find_experts_modules(experts.model)]
    if isinstance(placement, PlacementTable):
        placement = [list(r) for r in placement.rows]
    if placement is None:
        if ep_degree is None:
            raise CheckpointError("give an EP degree or a placement table to lay the experts out for")
        placement = "contiguous"
    try:
        rows = placement_row_count(placement)
    except HybridEPConfigError as err:
        raise CheckpointError(str(err)) from err
    if ep_degree is not None and rows is not None and ep_degree != rows:
        raise CheckpointError(f"ep_degree={ep_degree} disagrees with the placement's {rows} rows")
    if rows is None and ep_degree is None:
        raise CheckpointError("a placement that gives no table needs an EP degree")
    try:
        tables = layer_tables(placement, layers, ep_degree or rows)
    except (HybridEPConfigError, TypeError) as err:
        if isinstance(placement, str):
            raise  # the contiguous placement's own error names the values
        raise CheckpointError(f"placement does not fit a model with {experts.num_experts} experts: {err}") from err
    return {name: table for (name, _), table in zip(layers, tables, strict=True)}


def _expert_key_layers(model: nn.Module, keys: list[str], tables: dict[str, PlacementTable]) -> dict[str, str]:
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
        _rewrite(index, tmp, save_id, assign, finish, None, progress, plain_model=True)
    return dropped
