"""Hangs named: a collective that does not complete within the run's timeout ends every surviving rank with one
message that names it, its group's ranks and which of them did not arrive.

Neither backend says which rank is missing, gloo has no watchdog, and NCCL's (:mod:`hf_hybrid_ep.parallel.nccl`)
cannot see where the host waits: under NCCL launching a collective and ``work.wait()`` return at once, and the host
blocks later, in a read of a result (``.item()``, ``.tolist()``), wherever that is. So the package watches each
collective from its launch to its completion, not where the host happens to wait:

- :func:`watched` marks the main thread as inside one collective over a process group (a blocking one, or the
  host-side wait of an asynchronous one with the read of its result); under NCCL a blocking collective stays *in
  flight* after the section, until an event recorded behind it on the current stream completes;
- :func:`launched` puts an asynchronous collective's work handle in flight at its launch and :func:`wait` waits
  for it inside a section that carries its name; it leaves the flight when ``work.is_completed()`` (under gloo:
  once waited for);
- :func:`region` marks a stretch such as a Trainer run that holds collectives this package does not see (DDP's).

A thread of the :class:`Watchdog` publishes this rank's position (:mod:`hf_hybrid_ep.parallel.positions`) every
half :attr:`Watchdog.interval_s`. The run ends when the main thread has made no progress (entered or left a
section, launched a collective) for ``timeout_s`` while inside a section or with a collective in flight, or when a
watched collective raised (a peer died, the backend's own timeout). The collective named is the oldest one in
flight (the one the host waits behind, wherever it waits), else the section's. The positions of the group's ranks
are read twice, an interval apart, while this rank goes on beating; the message names the ranks whose heartbeat
stopped or that run elsewhere, still before the collective. It is printed once; under NCCL the flight recorder is
written and the communicators aborted; the process ends with :data:`EXIT_CODE`, like NCCL's error handling, so
that a launcher can restart the job.

A process that was itself suspended for longer than the timeout (``SIGSTOP``) notices the gap when it runs
again and ends the same way: its peers have given up on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import nccl
from .positions import Board, describe, diagnose, group_key, silent_ranks

EXIT_CODE = 124  # what ``timeout(1)`` exits with: the run ended because a collective did not complete


class InFlight(NamedTuple):
    """A collective launched and not yet seen complete: its name, group's ranks, sequence number on the group,
    launch time (``time.monotonic``) and the test of its completion."""

    what: str
    ranks: tuple[int, ...]
    seq: int
    since: float
    done: Callable[[], bool]


def _done(entry: InFlight) -> bool:
    try:
        return bool(entry.done())
    except Exception:  # noqa: BLE001 - a work that failed is over; its waiter reports the error
        return True


class Watchdog:
    """The per-process watchdog (see the module docstring). Start it with :func:`start`.

    Args:
        timeout_s: seconds a collective may stay in flight, and the main thread inside a section without
            progress, before the run ends.
        rank / world: this process's rank and the world size.
        board: where positions are published (:class:`~hf_hybrid_ep.parallel.positions.Board`).
    """

    def __init__(self, timeout_s: float, rank: int, world: int, board: Board) -> None:
        self.rank, self.world, self.board = rank, world, board
        self.world_group = dist.group.WORLD  # the default group it watches (a new one gets a new watchdog)
        self.set_timeout(timeout_s)
        self.stack: list[tuple[str, tuple[int, ...], int]] = []  # (what, group ranks, sequence number on the group)
        self.counts: dict[tuple[int, ...], int] = {}  # collectives entered per group
        self.flight: OrderedDict[int, InFlight] = OrderedDict()  # in launch order, keyed by the handle's id
        self.last_done = "nothing yet"
        self.progress = time.monotonic()
        self.beats = 0
        self.ending: str | None = None  # what this rank's watchdog is ending it for (published)
        self.ended: str | None = None  # the same, once its message is out
        self.silent: list[dict] = []  # the positions of the ranks whose heartbeat stopped, once looked at
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._blocks: dict[int, bool] = {}
        self._lock = threading.Lock()
        self._ending = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_hybrid_ep-watchdog", daemon=True)
        self._thread.start()

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.interval_s = min(5.0, self.timeout_s / 4)

    # ------------------------------------------------------------------ the main thread
    def group_ranks(self, group: dist.ProcessGroup | None) -> tuple[int, ...]:
        """The world ranks of ``group`` (``None``: the world), cached."""
        if group is None:
            return tuple(range(self.world))
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[key]

    def blocks_host(self, group: dist.ProcessGroup | None) -> bool:
        """Whether a blocking collective over ``group`` has completed when its call returns (gloo), cached."""
        key = id(group)
        if key not in self._blocks:
            try:
                self._blocks[key] = str(dist.get_backend(group)) in ("gloo", "mpi")
            except (RuntimeError, ValueError):  # not a group of this rank: nothing to watch after the call
                self._blocks[key] = True
        return self._blocks[key]

    def count(self, ranks: tuple[int, ...]) -> int:
        """Count one more collective entered on the group ``ranks``; its sequence number there."""
        with self._lock:  # the watchdog thread copies the counts
            self.counts[ranks] = self.counts.get(ranks, 0) + 1
            return self.counts[ranks]

    def enter(self, what: str, ranks: tuple[int, ...], seq: int) -> None:
        self.stack.append((what, ranks, seq))
        self.progress = time.monotonic()

    def leave(self, error: BaseException | None, since: float | None = None, complete: bool = True) -> None:
        """Leave the innermost section; ``since``: put its collective in flight, from then on, until the work
        queued on the current stream so far has run (a blocking collective under NCCL); ``complete``: its
        collective is complete (the last one completed here)."""
        what, ranks, seq = self.stack[-1]
        if error is not None and seq and not isinstance(error, KeyboardInterrupt):
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.end(f"{what} over {describe(ranks, self.world)} failed on rank {self.rank}: "
                     f"{type(error).__name__}: {first}", ranks, seq)
        self.stack.pop()
        if seq and since is not None and error is None and torch.accelerator.is_available():
            event = torch.accelerator.current_stream().record_event()
            self.put(event, InFlight(what, ranks, seq, since, event.query))
        elif seq and complete:
            self.last_done = f"{what} over {describe(ranks, self.world)}"
        self.progress = time.monotonic()

    def put(self, handle: object, entry: InFlight) -> None:
        """Put ``entry`` in flight (until ``entry.done()``), keyed by ``handle``; forget those done before it."""
        with self._lock:
            self.flight[id(handle)] = entry
            while self.flight and _done(next(iter(self.flight.values()))):
                self._forget(next(iter(self.flight)))
        self.progress = time.monotonic()

    def _forget(self, key: int) -> None:
        """Take a completed collective out of flight (the lock held): the last one completed here."""
        entry = self.flight.pop(key, None)
        if entry is not None:
            self.last_done = f"{entry.what} over {describe(entry.ranks, self.world)}"

    def entry_of(self, handle: object) -> InFlight | None:
        with self._lock:
            return self.flight.get(id(handle))

    def landed(self, handle: object) -> None:
        """``handle``'s collective is complete: out of flight."""
        with self._lock:
            self._forget(id(handle))

    def oldest_in_flight(self) -> InFlight | None:
        """The oldest collective in flight not yet complete (every one done is forgotten)."""
        with self._lock:
            for key in [k for k, entry in self.flight.items() if _done(entry)]:
                self._forget(key)
            return next(iter(self.flight.values()), None)

    # ------------------------------------------------------------------ the watchdog thread
    def _run(self) -> None:
        previous = time.monotonic()
        self.publish()
        while not self._stop.wait(self.interval_s / 2):
            now = time.monotonic()
            if not (dist.is_available() and dist.is_initialized()):
                return  # the process group is gone: so is every collective to watch
            if now - previous > self.timeout_s:
                self.end(f"rank {self.rank} did not run for {now - previous:.0f} s (suspended, e.g. by SIGSTOP, "
                         f"or starved); its peers' collective timeout of {self.timeout_s:g} s has passed", (), 0)
            previous = now
            self.publish()
            hang = self.hang(now)
            if hang is not None:
                self.end(*hang)

    def hang(self, now: float) -> tuple[str, tuple[int, ...], int] | None:
        """What ended the run at ``now``, if anything: ``(what, ranks, seq)`` of the message."""
        stack = list(self.stack)
        oldest = self.oldest_in_flight()
        if not (stack or oldest) or now - self.progress < self.timeout_s:
            return None
        section = next((s for s in reversed(stack) if s[2]), stack[-1] if stack else None)
        inside = f" (inside {stack[0][0]})" if stack and section is not None and stack[0][0] != section[0] else ""
        if oldest is None:
            what, ranks, seq = section
            return (f"{what}{inside} over {describe(ranks, self.world)} has not completed after "
                    f"{now - self.progress:.0f} s (collective_timeout_s={self.timeout_s:g})", ranks, seq)
        if section is None:
            host = ("; this rank's main thread is outside the package's collectives (a read of a result, such as "
                    "loss.item(), waits for it)")
        elif (section[0], section[2]) != (oldest.what, oldest.seq):
            host = f"; this rank waits in {section[0]}{inside}"
        else:
            host = ""
        return (f"{oldest.what} over {describe(oldest.ranks, self.world)} has not completed "
                f"{now - oldest.since:.0f} s after its launch (collective_timeout_s={self.timeout_s:g}){host}",
                oldest.ranks, oldest.seq)

    def position(self) -> dict:
        """This rank's position, as published."""
        stack = list(self.stack)
        current = next((s for s in reversed(stack) if s[2]), None)
        oldest = self.oldest_in_flight()
        with self._lock:
            counts = {group_key(r): n for r, n in self.counts.items()}
        return {"beat": self.beats, "at": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "in": None if current is None else [current[0], list(current[1]), current[2]],
                "pending": None if oldest is None else [oldest.what, list(oldest.ranks), oldest.seq,
                                                        round(time.monotonic() - oldest.since, 1)],
                "region": stack[0][0] if stack else None, "idle_s": round(time.monotonic() - self.progress, 1),
                "last": self.last_done, "counts": counts,
                "ending": self.ending, "ended": self.ended}

    def publish(self) -> None:
        """One heartbeat: publish this rank's position."""
        self.beats += 1
        self.board.publish(self.rank, self.position())

    def _beat_for(self, seconds: float) -> None:
        """Go on beating for ``seconds`` (the watchdog thread may be the one waiting)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, self.interval_s / 2))
            self.publish()

    def peers(self, ranks: tuple[int, ...], seq: int) -> str:
        """Where each other rank of ``ranks`` is: read twice, an interval and a half apart (a rank whose heartbeat
        count did not move is not running); this rank beats meanwhile."""
        others = [r for r in (ranks or range(self.world)) if r != self.rank]
        if not others:
            return ""
        first = self.board.read(others)
        if isinstance(first, str):
            return f"; the other ranks' positions are unknown: {first}"
        self._beat_for(self.interval_s * 1.5)
        second = self.board.read(others)
        if isinstance(second, str):
            return f"; the other ranks' positions are unknown: {second}"
        self.silent = [second[r] for r in silent_ranks(others, first, second) if r in second]
        return diagnose(others, ranks, seq, first, second)

    def end(self, what: str, ranks: tuple[int, ...], seq: int) -> None:
        """Print one message naming ``what`` and the group's ranks, then end the process with :data:`EXIT_CODE`
        (under NCCL after writing the flight recorder and aborting the communicators)."""
        if not self._ending.acquire(blocking=False):
            if threading.current_thread() is self._thread:
                return  # the main thread is ending the process: go on beating meanwhile
            while True:
                time.sleep(3600)
        self.ending = what
        try:
            message = (f"hf_hybrid_ep watchdog, rank {self.rank} (host {socket.gethostname()}, PID {os.getpid()}): "
                       f"{what}; last completed here: {self.last_done}{self.peers(ranks, seq)}")
            message += "".join(f"\n{line}" for line in (nccl.flight_recorder_line(), nccl.dump(self.rank)) if line)
        except Exception as err:  # noqa: BLE001 - the message must go out whatever failed while composing it
            message = f"hf_hybrid_ep watchdog, rank {self.rank}: {what} ({type(err).__name__} while naming peers)"
        message += "".join(f"\n{line}" for line in map(continue_stopped_worker, self.silent) if line)
        sys.stderr.write(f"{message}\nending this process with exit code {EXIT_CODE}\n")
        sys.stderr.flush()
        self.ended = what
        self.publish()
        nccl.abort()
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # it hosts the c10d store
            self._beat_for(self.interval_s)  # (a launcher's agent does not): leave the others time to read it
        os._exit(EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()


def continue_stopped_worker(position: dict) -> str | None:
    """``SIGCONT`` the rank of ``position`` when it is a worker of this process's own torchrun agent (the same
    parent, on this host) stopped by a signal; the line that says so, else ``None``.

    The agent ends a failed job's workers with SIGTERM, and a stopped worker takes it only once continued: the agent
    waits out its 30 s shutdown grace, then SIGKILLs it. Continued, it takes the pending SIGTERM, or its own watchdog
    sees it was suspended past the timeout and ends it, at once (it resumes no training)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or position.get("host") != socket.gethostname():
        return None
    pid = position.get("pid")
    try:
        state, parent = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[:2]
    except (OSError, ValueError):
        return None
    if state != "T" or int(parent) != os.getppid():
        return None
    os.kill(int(pid), signal.SIGCONT)
    return f"continued the stopped worker PID {pid} of this torchrun agent, so that the job ends now"


_WATCHDOG: Watchdog | None = None


def start(timeout_s: float) -> Watchdog | None:
    """Start this process's watchdog with ``timeout_s`` (or set the timeout of the running one); ``None`` in a
    world of one process."""
    global _WATCHDOG
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if current() is not None and _WATCHDOG.world_group is dist.group.WORLD:
        _WATCHDOG.set_timeout(timeout_s)
        return _WATCHDOG
    if _WATCHDOG is not None:  # of an earlier default group
        _WATCHDOG.stop()
    _WATCHDOG = Watchdog(timeout_s, dist.get_rank(), dist.get_world_size(), Board.of_default_group())
    return _WATCHDOG


def current() -> Watchdog | None:
    """The running watchdog, if any."""
    return _WATCHDOG if _WATCHDOG is not None and _WATCHDOG._thread.is_alive() else None


@contextlib.contextmanager
def _section(what: str, group: dist.ProcessGroup | None, collective: bool, entry: InFlight | None = None
             ) -> Iterator[None]:
    """A section of the main thread; ``entry``: the wait for that collective in flight (counted at its launch)."""
    watchdog = current()
    if watchdog is None:
        yield
        return
    since = time.monotonic()
    if entry is not None:
        ranks, seq = entry.ranks, entry.seq
    else:
        ranks = watchdog.group_ranks(group) if collective else tuple(range(watchdog.world))
        seq = watchdog.count(ranks) if collective else 0
    watchdog.enter(what, ranks, seq)
    try:
        yield
    except BaseException as err:
        watchdog.leave(err)
        raise
    host = watchdog.blocks_host(group)  # gloo: the collective is complete when the call returns
    in_flight = collective and entry is None and not host
    watchdog.leave(None, since if in_flight else None, complete=host or entry is None)


def watched(what: str, group: dist.ProcessGroup | None = None) -> contextlib.AbstractContextManager[None]:
    """Mark the main thread as inside the blocking collective ``what`` over ``group`` (``None``: the world),
    from its launch to the read of its result: put that read inside too. A no-op without a running watchdog."""
    return _section(what, group, True)


def launched(work, what: str, group: dist.ProcessGroup | None = None):
    """Put the asynchronous collective ``what`` over ``group``, whose handle ``work`` was just returned, in flight
    until it completes; returns ``work`` (``None`` passes through: nothing was launched)."""
    watchdog = current()
    done = getattr(work, "is_completed", None)  # a wrapper's stand-in handle (or None) is not watched
    if watchdog is not None and done is not None:
        ranks = watchdog.group_ranks(group)
        watchdog.put(work, InFlight(what, ranks, watchdog.count(ranks), time.monotonic(), done))
    return work


@contextlib.contextmanager
def waiting(work, what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """``work.wait()`` inside a section named ``what`` over ``group`` (for a work :func:`launched`, its group); the
    body reads the result (under NCCL the host waits there). A work not launched counts as a collective entered
    here."""
    watchdog = current()
    entry = watchdog.entry_of(work) if watchdog is not None and work is not None else None
    with _section(what, group, True, entry):
        if work is not None:
            work.wait()
        yield
    if entry is not None and (watchdog.blocks_host(group) or _done(entry)):  # gloo: waited is done (some of its
        watchdog.landed(work)  # works never report completion, reduce_scatter_tensor's)


def wait(work, what: str, group: dist.ProcessGroup | None = None) -> None:
    """:func:`waiting` with nothing to read."""
    with waiting(work, what, group):
        pass


def region(what: str) -> contextlib.AbstractContextManager[None]:
    """Mark a stretch of work over the world that holds collectives this package does not see (a Trainer run:
    DDP's all-reduce, Accelerate's gathers): no progress inside it for the timeout ends the run too."""
    return _section(what, None, False)


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
