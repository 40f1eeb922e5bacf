"""Hangs named: a collective that does not complete within the run's timeout ends every surviving rank with one
message that names it, its group's ranks and which of them did not arrive.

NCCL has a watchdog (with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` it ends a process whose collective timed out);
gloo has none, and neither says which rank is missing. Here the main thread marks where it waits
(:func:`watched`: one collective with its process group, or :func:`region`: a stretch such as a Trainer run that
holds collectives this package does not see, DDP's). A thread of the :class:`Watchdog` publishes this rank's
position (the section it is in, how many collectives it entered on each group, a heartbeat count) to the c10d
store every :attr:`Watchdog.interval_s`. When the main thread has been inside a section without progress
(entering or leaving any section) for ``timeout_s``, or a watched collective raised (a peer died, the backend's
own timeout), the positions of the group's ranks are read twice, an interval apart; the message names the
collective, the layer or bucket, the group's ranks, the ranks whose heartbeat stopped (stopped, dead or hung
outside Python) and where each of the others is; it is printed once and the process ends with
:data:`EXIT_CODE`, like NCCL's error handling, so that a launcher can restart the job.

A process that was itself suspended for longer than the timeout (``SIGSTOP``) notices the gap when it runs
again and ends the same way: its peers have given up on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

EXIT_CODE = 124  # what ``timeout(1)`` exits with: the run ended because a collective did not complete
STORE_TIMEOUT_S = 5.0  # a store operation of the watchdog thread gives up after this long
_PREFIX = "hf_hybrid_ep/watchdog/"


def describe(ranks: tuple[int, ...], world: int) -> str:
    """``"the world (ranks 0–3)"`` or ``"ranks [0, 2]"``."""
    if len(ranks) == world and world > 1:
        return f"the world (ranks 0–{world - 1})"
    return f"ranks {list(ranks)}"


class Watchdog:
    """The per-process watchdog (see the module docstring). Start it with :func:`start`.

    Args:
        timeout_s: seconds without progress inside a section after which the run ends.
        rank / world: this process's rank and the world size.
        store: the c10d store shared by every rank (positions are published under ``hf_hybrid_ep/watchdog/``);
            ``None``: nothing is published and the message names no missing rank.
    """

    def __init__(self, timeout_s: float, rank: int, world: int, store: dist.Store | None) -> None:
        self.timeout_s, self.rank, self.world = float(timeout_s), rank, world
        self.interval_s = min(5.0, self.timeout_s / 4)
        self.store = store
        self.stack: list[tuple[str, tuple[int, ...], int]] = []  # (what, group ranks, sequence number on the group)
        self.counts: dict[tuple[int, ...], int] = {}  # collectives entered per group
        self.last_done = "nothing yet"
        self.progress = time.monotonic()
        self.beats = 0
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._ending = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_hybrid_ep-watchdog", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the main thread
    def group_ranks(self, group: dist.ProcessGroup | None) -> tuple[int, ...]:
        """The world ranks of ``group`` (``None``: the world), cached."""
        if group is None:
            return tuple(range(self.world))
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[key]

    def enter(self, what: str, ranks: tuple[int, ...], collective: bool) -> None:
        seq = 0
        if collective:
            seq = self.counts[ranks] = self.counts.get(ranks, 0) + 1
        self.stack.append((what, ranks, seq))
        self.progress = time.monotonic()

    def leave(self, error: BaseException | None) -> None:
        what, ranks, seq = self.stack[-1]
        if error is not None and seq and not isinstance(error, KeyboardInterrupt):
            self.end(f"{what} over {describe(ranks, self.world)} failed on rank {self.rank}: "
                     f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
                     ranks, seq)
        self.stack.pop()
        if seq:
            self.last_done = f"{what} over {describe(ranks, self.world)}"
        self.progress = time.monotonic()

    # ------------------------------------------------------------------ the watchdog thread
    def _run(self) -> None:
        previous = time.monotonic()
        self._publish()
        while not self._stop.wait(self.interval_s / 2):
            now = time.monotonic()
            if not (dist.is_available() and dist.is_initialized()):
                return  # the process group is gone: so is every collective to watch
            if now - previous > self.timeout_s:
                self.end(f"rank {self.rank} did not run for {now - previous:.0f} s (suspended, e.g. by SIGSTOP, "
                         f"or starved); its peers' collective timeout of {self.timeout_s:g} s has passed", (), 0)
            previous = now
            self.beats += 1
            self._publish()
            stack = list(self.stack)
            if stack and now - self.progress >= self.timeout_s:
                what, ranks, seq = next((s for s in reversed(stack) if s[2]), stack[-1])
                inside = f" (inside {stack[0][0]})" if stack[0][0] != what else ""
                self.end(f"{what}{inside} over {describe(ranks, self.world)} has not completed after "
                         f"{now - self.progress:.0f} s (collective_timeout_s={self.timeout_s:g})", ranks, seq)

    def position(self) -> dict:
        """This rank's position, as published."""
        stack = list(self.stack)
        current = next((s for s in reversed(stack) if s[2]), None)
        return {"beat": self.beats, "at": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "in": None if current is None else [current[0], list(current[1]), current[2]],
                "region": stack[0][0] if stack else None, "idle_s": round(time.monotonic() - self.progress, 1),
                "last": self.last_done, "counts": {",".join(map(str, r)): n for r, n in self.counts.items()}}

    def _publish(self) -> None:
        if self.store is None:
            return
        with contextlib.suppress(Exception):  # a store that does not answer is reported when it matters
            self.store.set(_PREFIX + str(self.rank), json.dumps(self.position()))

    def _read(self, ranks: list[int]) -> dict[int, dict] | str:
        """The published positions of ``ranks``, or why they could not be read."""
        if self.store is None:
            return "no c10d store to read them from"
        try:
            keys = [_PREFIX + str(r) for r in ranks]
            present = [k for k in keys if self.store.check([k])]
            values = self.store.multi_get(present) if present else []
        except Exception as err:  # noqa: BLE001 - the store host may be the stopped rank
            return (f"the c10d store did not answer ({type(err).__name__}); the process that hosts it (the launcher, "
                    "or rank 0) may be stopped or dead")
        out = {}
        for key, value in zip(present, values, strict=True):
            with contextlib.suppress(ValueError):
                out[int(key.rsplit("/", 1)[1])] = json.loads(bytes(value).decode())
        return out

    def peers(self, ranks: tuple[int, ...], seq: int) -> str:
        """Where each other rank of ``ranks`` is: read twice, an interval apart (a rank whose heartbeat count did
        not move is not running)."""
        others = [r for r in (ranks or range(self.world)) if r != self.rank]
        if not others:
            return ""
        first = self._read(others)
        if isinstance(first, str):
            return f"; the other ranks' positions are unknown: {first}"
        time.sleep(self.interval_s * 1.5)
        second = self._read(others)
        if isinstance(second, str):
            return f"; the other ranks' positions are unknown: {second}"
        key = ",".join(map(str, ranks))
        silent, behind, lines = [], [], []
        for r in others:
            now, before = second.get(r), first.get(r)
            if now is None or before is None or now["beat"] == before["beat"]:
                silent.append(r)
                seen = ("never published a position" if now is None else
                        f"last seen {time.time() - now['at']:.0f} s ago: {_where(now)}")
                lines.append(f"rank {r} (host {now['host'] if now else '?'}, PID {now['pid'] if now else '?'}): "
                             f"no heartbeat; {seen}")
            elif seq and now["counts"].get(key, 0) < seq:
                behind.append(r)
                lines.append(f"rank {r}: has not reached it; {_where(now)}")
            else:
                lines.append(f"rank {r}: {_where(now)}")
        parts = [f"rank(s) {silent} (no heartbeat: stopped, dead or hung outside Python)"] if silent else []
        parts += [f"rank(s) {behind} (running, still before it)"] if behind else []
        head = (f"; did not arrive: {', '.join(parts)}" if parts else
                "; every rank of the group is running (a desynchronised collective order, or the network)")
        return head + "".join(f"\n  {line}" for line in lines)

    def end(self, what: str, ranks: tuple[int, ...], seq: int) -> None:
        """Print one message naming ``what`` and the group's ranks, then end the process with :data:`EXIT_CODE`."""
        if not self._ending.acquire(blocking=False):
            while True:  # another thread is already ending the process
                time.sleep(3600)
        try:
            message = (f"hf_hybrid_ep watchdog, rank {self.rank} (host {socket.gethostname()}, PID {os.getpid()}): "
                       f"{what}; last completed here: {self.last_done}{self.peers(ranks, seq)}\n"
                       f"ending this process with exit code {EXIT_CODE}")
        except Exception as err:  # noqa: BLE001 - the message must go out whatever failed while composing it
            message = f"hf_hybrid_ep watchdog, rank {self.rank}: {what} ({type(err).__name__} while naming peers)"
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        if self.rank == 0:  # it may host the c10d store: leave the others time to read the positions
            time.sleep(self.interval_s)
        os._exit(EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()


def _where(position: dict) -> str:
    if position.get("in"):
        what, ranks, _ = position["in"]
        return f"waiting in {what} over ranks {ranks} for {position['idle_s']:g} s"
    region = f" inside {position['region']}" if position.get("region") else ""
    return f"running{region}, {position['idle_s']:g} s since its last collective ({position['last']})"


_WATCHDOG: Watchdog | None = None


def _store() -> dist.Store | None:
    """A connection of its own to the default group's store (so that a slow store never blocks the main thread),
    with a short timeout."""
    try:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        return store
    except Exception:  # noqa: BLE001 - a store without a client of its own: publish nothing
        return None


def start(timeout_s: float) -> Watchdog | None:
    """Start this process's watchdog with ``timeout_s`` (or set the timeout of the running one); ``None`` in a
    world of one process."""
    global _WATCHDOG
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _WATCHDOG is not None and _WATCHDOG._thread.is_alive():
        _WATCHDOG.timeout_s = float(timeout_s)
        _WATCHDOG.interval_s = min(5.0, _WATCHDOG.timeout_s / 4)
        return _WATCHDOG
    _WATCHDOG = Watchdog(timeout_s, dist.get_rank(), dist.get_world_size(), _store())
    return _WATCHDOG


def current() -> Watchdog | None:
    """The running watchdog, if any."""
    return _WATCHDOG if _WATCHDOG is not None and _WATCHDOG._thread.is_alive() else None


@contextlib.contextmanager
def _section(what: str, ranks: tuple[int, ...] | None, group: dist.ProcessGroup | None, collective: bool
             ) -> Iterator[None]:
    watchdog = current()
    if watchdog is None:
        yield
        return
    watchdog.enter(what, ranks if ranks is not None else watchdog.group_ranks(group), collective)
    try:
        yield
    except BaseException as err:
        watchdog.leave(err)
        raise
    watchdog.leave(None)


def watched(what: str, group: dist.ProcessGroup | None = None) -> contextlib.AbstractContextManager[None]:
    """Mark the main thread as waiting in the collective ``what`` over ``group`` (``None``: the world): launching
    a blocking one, or waiting for an asynchronous one. A no-op without a running watchdog."""
    return _section(what, None, group, True)


def region(what: str) -> contextlib.AbstractContextManager[None]:
    """Mark a stretch of work over the world that holds collectives this package does not see (a Trainer run:
    DDP's all-reduce, Accelerate's gathers): no progress inside it for the timeout ends the run too."""
    return _section(what, None, None, False)


_LABEL = ["the model"]


def set_label(text: str) -> None:
    """Name what the main thread works on now (an MoE layer's forward sets its name), for the messages of the
    collectives that follow; :func:`label` reads it."""
    _LABEL[0] = text


def label() -> str:
    return _LABEL[0]


def timeout_of(seconds: float | None) -> timedelta | None:
    """The ``timeout`` argument for a process group the package creates (``None``: the backend's default)."""
    return None if seconds is None else timedelta(seconds=seconds)
