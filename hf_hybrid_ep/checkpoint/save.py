"""Writing a live hybrid-EP model as an expert-sharded checkpoint, atomically."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ..dispatch.table import spec_of
from ..state import state_of
from .atomic import claim, fsync_dir, fsync_tree, new_save_id, release, staged_save
from .convert import convert_into
from .format import INDEX_NAME
from .manifest import read_manifest, write_manifest
from .safetensors_io import write_point
from .side_state import SIDE_FILE, save_side_state


def broadcast_save(model: nn.Module, value: object) -> object:
    """Rank 0's ``value`` on every rank of the model's world (the staging path of a save)."""
    mesh = state_of(model).mesh
    if mesh.world_group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_model_files(model: nn.Module, directory: Path, save_id: str) -> None:
    """Write the model into the existing (staging) ``directory``: weight shards for the model's EP degree
    and placement, config files, the side state. Collective: the experts are gathered over each EP
    group and rank 0 writes; ``directory`` must be the same path on every rank."""
    mesh = state_of(model).mesh
    plain = directory / ".plain"
    model.save_pretrained(plain)  # collective: gathers experts, rank 0 writes
    if mesh.rank == 0:
        try:
            tables = {layer.name: layer.table for layer in state_of(model).layers}
            convert_into(plain, directory, save_id, placement=spec_of(tables), progress=False)
            save_side_state(model, directory, save_id)
        finally:
            shutil.rmtree(plain, ignore_errors=True)


def _replaceable(directory: Path) -> bool:
    """``directory`` can be replaced whole: absent, empty, or holding only what one earlier save listed."""
    if not directory.exists():
        return True
    manifest = read_manifest(directory) if (directory / INDEX_NAME).is_file() else None
    listed = set(manifest["files"]) | {INDEX_NAME} if manifest else set()
    return all(p.name in listed for p in directory.iterdir())


def save_hybrid_checkpoint(model: nn.Module, output_dir: str | os.PathLike[str]) -> Path:
    """Write ``model`` as a hybrid-EP checkpoint laid out for its EP degree and placement tables (stored
    in the index, so loading puts the same experts on the same ranks). Collective.

    ``output_dir`` absent, empty or holding only an earlier checkpoint: the checkpoint is staged beside
    it and put in place atomically (:mod:`.atomic`). ``output_dir`` holding other things too (a run
    directory with ``checkpoint-*`` inside): the staged files are moved in, weights first and the index
    last, and a crash in between leaves files of two saves, which every loader refuses, naming them.
    """
    output_dir = Path(output_dir)
    mesh = state_of(model).mesh
    with ExitStack() as stack:
        whole = None
        if mesh.rank == 0:
            whole = _replaceable(output_dir)
            if whole:
                staging, save_id = stack.enter_context(staged_save(output_dir))
            else:
                save_id = new_save_id()
                staging = claim(output_dir, save_id)
                stack.callback(release, output_dir, staging)
        else:
            staging, save_id = None, None
        staging, save_id = broadcast_save(model, (staging, save_id))
        write_model_files(model, Path(staging), save_id)
        if mesh.rank == 0 and not whole:
            write_manifest(staging, save_id)
            _move_into(staging, output_dir)
    if mesh.world_group is not None:
        dist.barrier()
    return output_dir


def _move_into(src: Path, dst: Path) -> None:
    """Move a complete, fsynced save into a directory that holds other things: index last."""
    fsync_tree(src)
    dst.mkdir(parents=True, exist_ok=True)
    stale = {p.name for p in dst.glob("model*.safetensors")} | {p.name for p in dst.glob(SIDE_FILE)}
    new = sorted(p.name for p in src.iterdir())
    for name in [n for n in new if n != INDEX_NAME] + [INDEX_NAME]:
        os.replace(src / name, dst / name)
        write_point(f"moved {name}")
    fsync_dir(dst)
    for name in stale - set(new):
        (dst / name).unlink()
