"""Writing a live hybrid-EP model as an expert-sharded checkpoint, atomically, without a long collective wait."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ..checkpoint.atomic import claim, fsync_dir, fsync_tree, new_save_id, release, staged_save
from ..checkpoint.format import INDEX_NAME, SIDE_FILE
from ..checkpoint.manifest import read_manifest, write_manifest
from ..checkpoint.safetensors_io import write_point
from ..engine import mesh_of
from ..parallel.heartbeat import Heartbeat
from ..parallel.watchdog import watched
from .stream import stream_model_files


def broadcast_save(model: nn.Module, value: object) -> object:
    """Rank 0's ``value`` on every rank of the model's world (the staging path of a save)."""
    mesh = mesh_of(model)
    if mesh.world_group is None:
        return value
    box = [value]
    with watched("broadcast of rank 0's save path"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def rank_zero_save(model: nn.Module, stage: Callable[[], AbstractContextManager[tuple[Path, str]]]
                   ) -> Iterator[tuple[Path, str]]:
    """Collective: rank 0 enters ``stage()`` (which claims a target and yields ``(staging directory, save
    id)``, putting the save in place when it exits cleanly); every rank gets rank 0's pair. On a clean exit
    rank 0 puts the save in place while the other ranks follow its heartbeat, so none waits in one long
    collective however long that takes (checksums, fsync); every rank returns once it is in place."""
    mesh = mesh_of(model)
    beat = Heartbeat(mesh)
    stack = ExitStack()
    try:
        staged = beat.alone(lambda: stack.enter_context(stage()))  # claiming may first recover an earlier save
        staging, save_id = broadcast_save(model, staged)
        yield Path(staging), save_id
    except BaseException:
        stack.__exit__(*sys.exc_info())
        raise
    beat.alone(stack.close)


def write_model_files(model: nn.Module, directory: Path, save_id: str) -> None:
    """Write the model into the existing (staging) ``directory``: weight shards for the model's EP degree
    and placement, config files, the side state, streamed one module at a time (:mod:`.stream`).
    Collective: rank 0 writes; ``directory`` must be the same path on every rank."""
    stream_model_files(model, directory, save_id, Heartbeat(mesh_of(model)))


def _replaceable(directory: Path) -> bool:
    """``directory`` can be replaced whole: absent, empty, or holding only what one earlier save listed."""
    if not directory.exists():
        return True
    manifest = read_manifest(directory) if (directory / INDEX_NAME).is_file() else None
    listed = set(manifest["files"]) | {INDEX_NAME} if manifest else set()
    return all(p.name in listed for p in directory.iterdir())


@contextmanager
def _moved_in(target: Path) -> Iterator[tuple[Path, str]]:
    """A save staged beside ``target`` (a directory holding other things) and moved into it when complete."""
    save_id = new_save_id()
    staging = claim(target, save_id)
    try:
        yield staging, save_id
        write_manifest(staging, save_id)
        _move_into(staging, target)
    finally:
        release(target, staging)


def save_hybrid_checkpoint(model: nn.Module, output_dir: str | os.PathLike[str]) -> Path:
    """Write ``model`` as a hybrid-EP checkpoint laid out for its EP degree and placement tables (stored
    in the index, so loading puts the same experts on the same ranks). Collective.

    ``output_dir`` absent, empty or holding only an earlier checkpoint: the checkpoint is staged beside
    it and put in place atomically (:mod:`hf_hybrid_ep.checkpoint.atomic`). ``output_dir`` holding other
    things too (a run directory with ``checkpoint-*`` inside): the staged files are moved in, weights first
    and the index last, and a crash in between leaves files of two saves, which every loader refuses,
    naming them.
    """
    output_dir = Path(output_dir)

    def stage() -> AbstractContextManager[tuple[Path, str]]:
        return staged_save(output_dir) if _replaceable(output_dir) else _moved_in(output_dir)

    with rank_zero_save(model, stage) as (staging, save_id):
        write_model_files(model, staging, save_id)
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
