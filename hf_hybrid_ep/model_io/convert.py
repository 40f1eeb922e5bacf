"""Converting a checkpoint for the model it belongs to (Hub or local → hybrid EP, or resharding a hybrid-EP one).

The architecture is built from the checkpoint's config on the meta device (:mod:`hf_hybrid_ep.moe.architecture`):
its experts modules give the expert count and the MoE layers the placement tables are laid out over, and every
source key is checked against it (:mod:`.validate`) before anything is written. The files are then written by the
model-free rewrite of :mod:`hf_hybrid_ep.checkpoint.rewrite`.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.atomic import check_output_free, staged_save
from ..checkpoint.dequantize import DEFAULT_DTYPE, Dequantizer, quantization_of
from ..checkpoint.format import CheckpointIndex, FileInfo, read_index
from ..checkpoint.rewrite import (
    DEFAULT_MAX_SHARD_BYTES,
    RewriteTensors,
    WeightFileMap,
    check_outside_checkpoints,
    rewrite_files,
)
from ..checkpoint.sources import resolve_source
from ..dispatch import PlacementTable
from ..dispatch.table import PlacementSpec, layer_tables
from ..errors import CheckpointError, HybridEPConfigError
from ..moe.architecture import ModelExperts, model_experts
from ..moe.discovery import find_experts_modules
from .names import expert_key_layers
from .validate import validate_against_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _drop_quantization_config(config: Path) -> None:
    """Rewrite ``config.json`` without ``quantization_config`` (its weights are dequantized)."""
    data = json.loads(config.read_text())
    data.pop("quantization_config", None)
    config.write_text(json.dumps(data, indent=2) + "\n")


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

    A quantized source (``quantization_config`` block-FP8 or MXFP4,
    :mod:`hf_hybrid_ep.checkpoint.dequantize`) is dequantized as it streams, one tensor or one expert at a
    time, to ``dtype`` (default ``"bfloat16"``; other tensors keep their dtype unless ``dtype`` is given); the
    output's ``config.json`` has no ``quantization_config`` and its index records the method
    (``source.dequantized_from``). Keys the model never loads (DeepSeek-V3's multi-token-prediction layer
    ``model.layers.61.*``) are left out.

    OUT is checked first (it must not exist or be empty, nor lie inside a checkpoint) and claimed, so a
    concurrent convert into it fails at once; the output's size is stated (with ``progress``) and checked
    against the free space of OUT's filesystem; the result is staged and renamed into place complete
    (:mod:`hf_hybrid_ep.checkpoint.atomic`).
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
    file_map = WeightFileMap(experts.num_experts, experts.num_moe_layers, tables,
                             partial(expert_key_layers, experts.model, tables=tables), max_shard_bytes, source)

    def finish(tmp: Path, weight_map: dict[str, str], infos: dict[str, FileInfo], total: int) -> None:
        file_map.finish(tmp, weight_map, infos, total)
        if tensors.dequantizer.quantization is not None and (tmp / "config.json").is_file():
            _drop_quantization_config(tmp / "config.json")

    rewrite_files(index, tmp, save_id, file_map.assign, finish, torch_dtype, progress, tensors=tensors)


def _source_tensors(index: CheckpointIndex, experts: ModelExperts, dtype: torch.dtype | None) -> RewriteTensors:
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
    return RewriteTensors(dequantizer, {k: s for k, s in specs.items() if k not in set(dropped)}, dropped)


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
