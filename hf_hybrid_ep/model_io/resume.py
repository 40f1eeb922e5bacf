"""Resuming a Trainer run by itself: the newest complete checkpoint of an output directory, and the logs cut back to
it so that every step is recorded once.

``resume_from_checkpoint="latest"`` (or ``True``, as in transformers) names the newest ``checkpoint-N`` of the
output directory whose manifest lists every file it holds with its size — of a full model or of PEFT adapters
alike (an interrupted save is completed or rolled back first, :func:`hf_hybrid_ep.checkpoint.atomic.recover`);
a newer one that is not complete is skipped with a warning naming what it lacks; with none the run starts fresh.
A job that torchrun restarts (:mod:`hf_hybrid_ep.integrations.launch`) can therefore always pass it, before its first
checkpoint exists.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from ..checkpoint.atomic import recover
from ..checkpoint.manifest import incompleteness, is_complete
from ..metrics import JSONL_NAME, drop_records_after

logger = logging.getLogger("hf_hybrid_ep")

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_NAME = re.compile(r"^\.?checkpoint-(\d+)(?:\.(?:old|new)-.+)?$")  # also an interrupted save's copies


def checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[Path, str | None]]:
    """Every ``checkpoint-N`` directory of ``output_dir``, oldest first, with why it is not complete (``None``: it
    is — a manifest, every listed file with its size, ``trainer_state.json``)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    steps = sorted({int(m[1]) for p in root.iterdir() if (m := _NAME.match(p.name))})
    found = []
    for step in steps:
        path = root / f"checkpoint-{step}"
        recover(path, is_complete)
        if path.is_dir():
            why = incompleteness(path) or (None if (path / TRAINER_STATE).is_file() else f"no {TRAINER_STATE}")
            found.append((path, why))
    return found


def complete_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete ``checkpoint-N`` directories of ``output_dir``, oldest first (:func:`checkpoints`)."""
    return [path for path, why in checkpoints(output_dir) if why is None]


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of ``output_dir``, or ``None``."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def _means_latest(value: str | bool | None) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == LATEST)


def resume_target(value: str | bool | None, output_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint a ``resume_from_checkpoint`` value names: ``"latest"`` / ``True`` → the newest complete one of
    ``output_dir`` (``None`` when there is none), a path as it is, ``None`` / ``False`` → none. Logs nothing."""
    if _means_latest(value):
        found = latest_checkpoint(output_dir)
        return None if found is None else str(found)
    return None if value is False else value


def checkpoint_step(checkpoint: str | os.PathLike[str]) -> int:
    """The optimizer step a Trainer checkpoint was saved at (its ``trainer_state.json``)."""
    state = Path(checkpoint) / TRAINER_STATE
    try:
        return int(json.loads(state.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        match = _CHECKPOINT.match(Path(checkpoint).name)
        return int(match[1]) if match else 0


def resolve_resume(value: str | bool | None, output_dir: str | os.PathLike[str], *, main_process: bool) -> str | None:
    """The checkpoint a run resumes from: ``"latest"`` / ``True`` → the newest complete one of ``output_dir`` (``None``
    when there is none: a fresh start), a path as it is, ``None`` / ``False`` → none. The main process also drops
    the records of later steps from ``<output_dir>/expert_load.jsonl``: the resumed run logs them again."""
    latest = _means_latest(value)
    value = resume_target(value, output_dir)
    if latest and main_process:
        for path, why in checkpoints(output_dir):
            if why is not None and (value is None or checkpoint_step(path) > checkpoint_step(value)):
                logger.warning("resume_from_checkpoint=latest: skipping %s, which is not complete: %s", path, why)
        logger.warning("resume_from_checkpoint=latest: %s", f"resuming from {value}" if value else
                       f"no complete checkpoint in {str(output_dir)!r}, starting fresh")
    if main_process:
        step = 0 if value is None else checkpoint_step(value)
        dropped = drop_records_after(Path(output_dir) / JSONL_NAME, step)
        if dropped:
            logger.warning("dropped %d record(s) of steps after %d from %s: the run logs them again", dropped, step,
                           JSONL_NAME)
    return value
