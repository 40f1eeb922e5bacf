"""Rank 0 writing alone while the other ranks wait in short collectives, never in one long one.

A checkpoint is written by rank 0; the other ranks must not return before it is complete, but a rank that
waits in one collective (a barrier) for the whole write is killed by the process group's timeout (NCCL's
watchdog: 10 minutes by default) once the write takes longer. A :class:`Heartbeat` turns the wait into
beats: one-element broadcasts from rank 0 carrying its state (working, done, failed), each at most
:data:`INTERVAL_S` apart, so no rank waits longer than that in a collective, however long the write takes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .mesh import HybridMesh, current_device
from .watchdog import watched

WORKING, DONE, FAILED = 0, 1, 2
INTERVAL_S = 5.0  # seconds between two beats of rank 0 while it works alone
T = TypeVar("T")


class Heartbeat:
    """Beats from rank 0 over the model's world (no-ops in a world of one)."""

    def __init__(self, mesh: HybridMesh) -> None:
        self.group, self.rank = mesh.world_group, mesh.rank
        self.flag = torch.zeros(1, dtype=torch.int32, device=current_device(mesh)) if self.group is not None else None

    def beat(self, state: int = WORKING, error: BaseException | None = None) -> int:
        """Rank 0 sends ``state``; every rank returns it. Collective. With ``FAILED`` rank 0 also sends
        ``error``'s message and the other ranks raise it as a :class:`CheckpointError` (rank 0 raises its own)."""
        if self.group is None:
            return state
        if self.rank == 0:
            self.flag.fill_(state)
        with watched("broadcast of rank 0's progress while it writes alone (heartbeat)", self.group):
            dist.broadcast(self.flag, src=0, group=self.group)
            received = int(self.flag.item())  # the read waits for the broadcast under NCCL
        if received == FAILED:
            box = [f"{type(error).__name__}: {error}" if error is not None else "its error says why"]
            with watched("broadcast of rank 0's error while it wrote alone", self.group):
                dist.broadcast_object_list(box, src=0, group=self.group)
            if self.rank != 0:
                raise CheckpointError(f"rank 0 failed while writing the checkpoint: {box[0]}")
        return received

    def alone(self, work: Callable[[], T] | None) -> T | None:
        """Rank 0 runs ``work`` (in a thread) and beats every :data:`INTERVAL_S` until it is done; the other
        ranks follow the beats and return ``None`` once rank 0 is done. Collective; ``work`` is used on rank 0
        only and must make no collective call."""
        if self.group is None:
            return work()
        if self.rank != 0:
            while self.beat() == WORKING:
                pass
            return None
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["result"] = work()
            except BaseException as err:  # noqa: BLE001 - re-raised on rank 0 below, after the others know
                outcome["error"] = err

        thread = threading.Thread(target=run, name="hf_hybrid_ep-rank0-write", daemon=True)
        thread.start()
        while True:
            thread.join(timeout=INTERVAL_S)
            if not thread.is_alive():
                break
            self.beat(WORKING)
        if "error" in outcome:
            self.beat(FAILED, outcome["error"])
            raise outcome["error"]
        self.beat(DONE)
        return outcome.get("result")
