"""Writing a live hybrid-EP model as an expert-sharded checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ..parallelize import state_of
from .convert import convert_checkpoint
from .side_state import SIDE_FILE, save_side_state


def save_hybrid_checkpoint(model: nn.Module, output_dir: str | os.PathLike[str]) -> Path:
    """Write ``model`` as a hybrid-EP checkpoint laid out for its EP degree and placement table (stored
    in the index, so loading puts the same experts on the same ranks). Collective.

    The experts are gathered over each EP group; rank 0 writes a vanilla checkpoint to a temporary
    sibling, converts it (streaming) into a second one, and moves the files into ``output_dir``
    (which may hold other files, e.g. a run directory): weight files first, the index last, then
    stale weight files of an earlier save are removed.
    """
    output_dir = Path(output_dir)
    mesh = state_of(model).mesh
    staging = output_dir.parent / f".{output_dir.name}.plain-tmp"
    converted = output_dir.parent / f".{output_dir.name}.hybrid-tmp"
    if mesh.rank == 0:
        for d in (staging, converted):
            shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(staging)  # collective: gathers experts, rank 0 writes
    if mesh.rank == 0:
        try:
            table = state_of(model).layers[0].table
            convert_checkpoint(staging, converted, placement=table, progress=False)
            save_side_state(model, converted)
            _move_into(converted, output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(converted, ignore_errors=True)
    if mesh.world_group is not None:
        dist.barrier()
    return output_dir


def _move_into(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    stale = {p.name for p in dst.glob("model*.safetensors")} | {p.name for p in dst.glob(SIDE_FILE)}
    new = sorted(p.name for p in src.iterdir())
    index = "model.safetensors.index.json"
    for name in [n for n in new if n != index] + [index]:
        os.replace(src / name, dst / name)
    for name in stale - set(new):
        (dst / name).unlink()
