"""What every invocation does around its runs: a clean start (SIGTERM exits through cleanup; namespaces of
killed runs removed), a scratch directory holding the model's checkpoint, and each run recorded and logged."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .fabric import PREFIX, Fabric, remove_stale_namespaces
from .launch import run_layout
from .runs import ModelArgs, RunSpec, StepArgs, save_checkpoint


def clean_start() -> None:
    """SIGTERM exits through ``finally`` (so namespaces are removed); namespaces of killed runs are removed."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() == 0 and shutil.which("ip"):
        stale = remove_stale_namespaces()
        if stale:
            print(f"removed stale namespaces of earlier killed runs: {stale}")


@contextlib.contextmanager
def scratch_checkpoint(model_args: ModelArgs) -> Iterator[tuple[str, str]]:
    """A fresh directory (``PREFIX…`` in the system's temporary directory) with the model's random-weight
    checkpoint in ``ckpt/``; yields ``(workdir, ckpt)`` and removes the directory on exit."""
    workdir = tempfile.mkdtemp(prefix=PREFIX)
    try:
        ckpt = str(Path(workdir) / "ckpt")
        save_checkpoint(model_args, ckpt)
        yield workdir, ckpt
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_logged(spec: RunSpec, fabric: Fabric, ckpt: str, step: StepArgs, world: int, workdir: str, report: dict,
               started: float) -> dict:
    """``run_layout``; the record appended to the report and one line printed (seconds since ``started``, a
    ``time.monotonic()`` value)."""
    rec = run_layout(spec, fabric, ckpt, step, world, workdir)
    report["runs"].append(rec)
    sps = f"{rec['samples_per_s']:.2f} samples/s" if rec["feasible"] else f"{rec['status']}: {rec.get('error', '')[:200]}"
    print(f"[{time.monotonic() - started:6.0f}s] {fabric.name:8s} {spec.name:26s} {sps}", flush=True)
    return rec
