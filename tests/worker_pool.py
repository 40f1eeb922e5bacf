"""A pool of real processes holding one gloo process group, reused across test cases.

``WorkerPool(world_size).run(fn, *args)`` runs ``fn(*args)`` on every rank (``fn`` must be an importable
module-level function) and returns the per-rank results. A rank that raises makes ``run`` raise with
every failing rank's traceback; a job that overruns its timeout kills the pool (the next ``run`` on a
fresh pool starts clean) so no test can hang the suite.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

PG_TIMEOUT_S = 60


class RankError(AssertionError):
    """One or more ranks raised; ``errors`` maps rank → (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]) -> None:
        self.errors = errors
        text = "\n".join(f"--- rank {r}: {tb}" for r, (_, _, tb) in sorted(errors.items()))
        super().__init__(f"ranks {sorted(errors)} raised:\n{text}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_worker() -> int:
    """Intra-op threads of every worker: ``OMP_NUM_THREADS`` (``make test`` sets 1), else 1."""
    raw = os.environ.get("OMP_NUM_THREADS", "1")
    try:
        threads = int(raw)
    except ValueError:
        raise ValueError(f"OMP_NUM_THREADS={raw!r} is not a positive integer") from None
    if threads < 1:
        raise ValueError(f"OMP_NUM_THREADS={raw!r} is not a positive integer")
    return threads


def _worker(rank: int, world: int, port: int, jobs: mp.Queue, results: mp.Queue, sys_path: list[str],
            threads: int) -> None:
    sys.path[:] = sys_path
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
    )
    while True:
        job = jobs.get()
        if job is None:
            break
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as err:  # noqa: BLE001 - reported to the parent verbatim
            results.put((rank, False, (type(err).__name__, str(err), traceback.format_exc())))
    dist.barrier()
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results: mp.Queue = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self._jobs[r], self._results, list(sys.path), threads_per_worker()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results ordered by rank."""
        if not self.alive:
            raise RuntimeError("worker pool was killed by an earlier timeout")
        for q in self._jobs:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) + len(errors) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, value = self._results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                self.kill()
                raise TimeoutError(
                    f"{fn.__name__} did not finish on ranks "
                    f"{sorted(set(range(self.world_size)) - set(results) - set(errors))} within {timeout}s"
                ) from None
            (results if ok else errors)[rank] = value
        if errors:
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self.alive = False

    def close(self) -> None:
        if self.alive:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        self.kill()
