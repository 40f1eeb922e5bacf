"""One run from outside: start one fresh process per rank on a fabric, wait for them (killing them after a failure
or the timeout), and merge their records into the run's record.

Each rank runs ``python -m benchmarks.bench_training --worker <job.json>`` (:data:`ENTRY`), which calls
:func:`benchmarks.training.worker.worker`; ``job.json`` holds the run's spec, step settings, checkpoint and output dir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .fabric import Fabric
from .merge import merge
from .runs import RunSpec, StepArgs

ROOT = Path(__file__).resolve().parents[2]  # the repository: on the ranks' PYTHONPATH (``benchmarks``, ``hf_hybrid_ep``)
ENTRY = "benchmarks.bench_training"  # the module the ranks are started as (``python -m``)
THREAD_STACK_BYTES = 2 * 2**20
FAILED_GRACE_S = 20  # after a rank fails, seconds the others get to record their own error before being killed


def _small_thread_stacks() -> None:
    """glibc takes the default stack of new threads from RLIMIT_STACK (8 MiB here). Thread stacks count
    against RLIMIT_DATA, and gloo starts threads per process group, so lower it to keep the memory limit
    about tensors rather than about how many groups a layout creates."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (THREAD_STACK_BYTES, hard))


def _rank_env(fabric: Fabric, rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank``'s process: this one's, torch.distributed's variables, and the fabric's."""
    return os.environ | {
        "RANK": str(rank), "LOCAL_RANK": str(rank % fabric.ranks_per_node), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(fabric.ranks_per_node), "MASTER_ADDR": fabric.master_addr(),
        "MASTER_PORT": str(port), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # glibc serves every block of 128 KiB or more by mmap and unmaps it on free (its initial setting,
        # made fixed), so the data size that RLIMIT_DATA limits follows the live tensors rather than the
        # heap's high-water mark. Same for every run; it costs some page faults per step.
        "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    } | fabric.env(rank)


def _start_ranks(fabric: Fabric, world: int, out: Path) -> list[subprocess.Popen]:
    """``world`` rank processes of the job in ``out``, each in its own session, logging to ``rank{r}.log``."""
    port = fabric.master_port()
    procs = []
    for rank in range(world):
        cmd = [*fabric.prefix(rank), sys.executable, "-m", ENTRY, "--worker", str(out / "job.json")]
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=_rank_env(fabric, rank, world, port), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_small_thread_stacks))
    return procs


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until every process has ended, ``FAILED_GRACE_S`` after the first failure, or ``timeout_s``; then
    kill the process groups of those still running."""
    start = time.monotonic()
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # give the others a moment to record their own error, then stop them
            if (failed_at is not None and now - failed_at > FAILED_GRACE_S) or now - start > timeout_s:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _rank_records(procs: list[subprocess.Popen], out: Path) -> list[dict]:
    """Every rank's record; for a rank that wrote none, an error with its exit code and its log's tail."""
    ranks = []
    for rank, p in enumerate(procs):
        f = out / f"rank{rank}.json"
        if f.exists():
            ranks.append(json.loads(f.read_text()))
        else:
            tail = (out / f"rank{rank}.log").read_text()[-600:]
            ranks.append({"rank": rank, "status": "error", "error": f"exit code {p.returncode}, no result; log tail: {tail}"})
    return ranks


def run_layout(spec: RunSpec, fabric: Fabric, ckpt: str, step: StepArgs, world: int, workdir: str) -> dict:
    """Train ``spec`` on ``fabric`` with ``world`` fresh processes; return the merged per-run record, with the
    machine's 1-minute load average before and after the run (its own ranks included: the cores are shared)."""
    load_at_start = os.getloadavg()
    out = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=workdir))
    payload = {"spec": dataclasses.asdict(spec), "step": dataclasses.asdict(step) | {"ranks_per_node": fabric.ranks_per_node},
               "ckpt": ckpt, "out": str(out)}
    (out / "job.json").write_text(json.dumps(payload))
    procs = _start_ranks(fabric, world, out)
    _wait(procs, step.run_timeout_s)
    rec = merge(spec, fabric, _rank_records(procs, out), step)
    rec["load_avg_1min"] = {"start": load_at_start[0], "end": os.getloadavg()[0]}
    return rec
