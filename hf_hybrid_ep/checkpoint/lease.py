"""Leases: which process holds a save claim or a run's output directory, and whether that process still runs.

A lease is a small JSON file created with ``O_EXCL`` that records its holder — host, boot id, PID namespace, PID,
the process's start time, the run id (``HF_HYBRID_EP_RUN_ID``, which ``hf-hybrid-ep launch`` sets for every
attempt of one job) — and whose modification time is the holder's heartbeat: a thread of the holding process
touches it every :data:`HEARTBEAT_S` seconds while the lease is held. Save claims (``.<name>.lock`` beside a
save's target, :mod:`.atomic`) and the run lease of an output directory (:data:`RUN_LEASE_NAME` inside it,
:func:`hold_output_dir`) are both leases.

Whether a holder still runs (:func:`judge`):

* a holder seen from the same machine view — this host name, this boot (``/proc/sys/kernel/random/boot_id``) and
  this PID namespace (``/proc/self/ns/pid``) — is alive exactly when a process with its PID runs **and** started at the
  recorded time (``/proc/PID/stat``, field 22: clock ticks since boot), so a PID reused by another process (a
  restarted container numbers its processes the same way) is not taken for the holder;
* any other holder — another host, another PID namespace on this host, an OS without ``/proc`` (macOS, Windows:
  there only the heartbeat is used) — is alive while its heartbeat is younger than :data:`STALE_AFTER_S`
  (compared with this host's clock: hosts keep their clocks in step, NTP), and counts as gone after that;
* a holder of this process's own run (same run id) that cannot be checked from here is an earlier attempt of the
  same job, which the launcher ended before restarting: it is taken over at once.

A lease whose holder is gone is taken over with a log line naming it and why it counts as gone. Taking over goes
through a rename to a private name and a check of what was renamed, so two processes taking over the same stale
lease at once cannot both win; a lease file another process changed in between is put back.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from ..config import run_id_from_env
from ..errors import CheckpointError
from ..parallel.watchdog import watched

logger = logging.getLogger("hf_hybrid_ep")

HEARTBEAT_S = 5.0  # a holder touches its lease this often
STALE_AFTER_S = 60.0  # a holder that cannot be checked from here counts as gone when its heartbeat is older
RUN_LEASE_NAME = ".hybrid-ep-run.lease"  # inside an output directory: the run that writes into it


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22); ``None`` when no
    such process runs (or the OS has no ``/proc``)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    try:
        return int(stat.rpartition(")")[2].split()[19])  # fields after the command name start at field 3
    except (IndexError, ValueError):
        return None


def holder_record(**what) -> dict:
    """This process as a lease records it, with ``what`` (the save id, the output directory)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": _pid_namespace(), "pid": pid, "start_time": start_time(pid), "run_id": run_id_from_env(),
            "since": datetime.now().isoformat(timespec="seconds"), "token": uuid.uuid4().hex, **what}


@dataclass(frozen=True)
class Holder:
    """The holder of a lease as its file records it, and how old its heartbeat is."""

    path: Path
    record: dict
    raw: bytes
    beat_age_s: float

    def describe(self) -> str:
        r = self.record
        if not r:
            return f"a process that recorded nothing in it (heartbeat {self.beat_age_s:.0f} s ago)"
        host = r.get("host")
        where = f"this host {host!r}" if host == socket.gethostname() else f"host {host!r}"
        facts = [f"run {r['run_id']}"] if r.get("run_id") else []
        facts += [f"since {r['since']}"] if r.get("since") else []
        facts.append(f"heartbeat {self.beat_age_s:.0f} s ago")
        return f"PID {r.get('pid')} on {where} ({', '.join(facts)})"


def read_holder(path: Path) -> Holder | None:
    """The holder of the lease ``path``; ``None`` when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY)  # opening revalidates a network filesystem's cached attributes
    except FileNotFoundError:
        return None
    try:
        raw = b""
        while chunk := os.read(fd, 1 << 16):
            raw += chunk
        mtime = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        record = {}
    return Holder(path, record if isinstance(record, dict) else {}, raw, max(0.0, time.time() - mtime))


@dataclass(frozen=True)
class Verdict:
    """Whether a holder counts as running, why, and whether that was checked on its process (``exact``) or read
    from its heartbeat."""

    alive: bool
    why: str
    exact: bool


def judge(holder: Holder) -> Verdict:
    """Whether ``holder`` still runs (see the module docstring)."""
    r, me = holder.record, holder_record()
    pid, age = r.get("pid"), holder.beat_age_s
    if not r:
        return Verdict(age < STALE_AFTER_S, f"its file records nothing and is {age:.0f} s old", False)
    same_view = r.get("boot_id") is not None and r.get("pid_namespace") is not None and (
        r.get("host"), r.get("boot_id"), r.get("pid_namespace")) == (me["host"], me["boot_id"], me["pid_namespace"])
    if same_view and isinstance(pid, int):
        started = start_time(pid)
        if started is None:
            return Verdict(False, f"PID {pid} is not running", True)
        if started != r.get("start_time"):
            return Verdict(False, f"PID {pid} is now another process (started at tick {started} since boot, the "
                                  f"holder at tick {r.get('start_time')})", True)
        return Verdict(True, f"PID {pid} runs", True)
    if r.get("run_id") and r.get("run_id") == me["run_id"]:
        return Verdict(False, f"it is an earlier attempt of this job (run id {r['run_id']})", False)
    if r.get("host") != me["host"]:
        where = f"on host {r.get('host')!r}"
    elif r.get("boot_id") is None:
        where = "that recorded no boot id"
    else:
        where = "in another PID namespace or boot of this host"
    if age < STALE_AFTER_S:
        return Verdict(True, f"a holder {where} is checked by its heartbeat only", False)
    return Verdict(False, f"its heartbeat is {age:.0f} s old, over the {STALE_AFTER_S:.0f} s after which a holder "
                          f"{where} counts as gone", False)


def wait_advice(verdict: Verdict, holder: Holder) -> str:
    """What to do about a live holder of a lease that this process wants."""
    if verdict.exact:
        return f"wait for PID {holder.record.get('pid')} to finish, or stop it"
    left = max(1, round(STALE_AFTER_S - holder.beat_age_s))
    return (f"if that process is gone: {verdict.why}, so it counts as gone once its heartbeat is "
            f"{STALE_AFTER_S:.0f} s old (in {left} s); a restart with the same HF_HYBRID_EP_RUN_ID (hf-hybrid-ep "
            "launch keeps one for all attempts of a job) takes it over at once")


class _Registry:
    """The leases this process holds (by absolute path), and the thread that beats their heartbeats."""

    def __init__(self) -> None:
        self.held: dict[Path, Lease] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self.lock:
            self.held[lease.path] = lease
            if self.thread is None or not self.thread.is_alive():  # also in a forked child: threads do not fork
                self.thread = threading.Thread(target=self._beat, name="hf_hybrid_ep lease heartbeat", daemon=True)
                self.thread.start()

    def mine(self) -> list[Lease]:
        with self.lock:
            return [lease for lease in self.held.values() if lease.pid == os.getpid()]

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            for lease in self.mine():
                lease.beat()


_REGISTRY = _Registry()
if hasattr(os, "register_at_fork"):  # a forked child gets a fresh lock: the heartbeat thread may hold the parent's
    os.register_at_fork(after_in_child=lambda: setattr(_REGISTRY, "lock", threading.Lock()))


@dataclass(eq=False)
class Lease:
    """A lease this process holds: its file and the token that tells it from any later holder's."""

    path: Path
    token: str
    pid: int

    def ours(self) -> bool:
        holder = read_holder(self.path)
        return holder is not None and holder.record.get("token") == self.token

    def beat(self) -> None:
        """Touch the lease (its heartbeat); a lease that is no longer this holder's is reported and forgotten."""
        try:
            if self.ours():
                os.utime(self.path)
                return
        except FileNotFoundError:
            pass
        holder = read_holder(self.path)
        logger.error("the lease %r of PID %d is no longer its own (%s): removed by hand, or taken over", str(self.path),
                     self.pid, "gone" if holder is None else f"now held by {holder.describe()}")
        self.forget()

    def forget(self) -> None:
        with _REGISTRY.lock:
            if _REGISTRY.held.get(self.path) is self:
                del _REGISTRY.held[self.path]

    def release(self) -> None:
        """Remove the lease file, if it is still this holder's, and stop its heartbeat."""
        self.forget()
        if os.getpid() == self.pid and self.ours():
            self.path.unlink(missing_ok=True)


def held(path: Path) -> Lease | None:
    """The lease on ``path`` this process holds, if any."""
    lease = _REGISTRY.held.get(Path(os.path.abspath(path)))
    return lease if lease is not None and lease.pid == os.getpid() else None


def release_all() -> None:
    """Release every lease this process holds (at interpreter exit)."""
    for lease in _REGISTRY.mine():
        lease.release()


atexit.register(release_all)


def take_over(holder: Holder) -> bool:
    """Remove the lease file of ``holder`` if it still holds exactly what was read; ``False`` when another process
    changed it in between (it is then left, or put back, as that process wrote it)."""
    private = holder.path.with_name(f"{holder.path.name}.taken-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(holder.path, private)
    except FileNotFoundError:
        return False
    if private.read_bytes() == holder.raw:
        private.unlink()
        return True
    try:
        os.link(private, holder.path)  # put back the lease another process wrote in between
    except FileExistsError:
        pass
    private.unlink()
    return False


def acquire(path: Path, what: dict, refuse: Callable[[Holder, Verdict], Exception], role: str) -> Lease:
    """Take the lease ``path`` for this process, recording ``what``; a lease held by a live holder raises
    ``refuse(holder, verdict)``, one whose holder is gone is taken over with a warning naming it (``role``: what
    the lease is, for that line)."""
    path = Path(os.path.abspath(path))
    record = holder_record(**what)
    body = json.dumps(record).encode()
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_holder(path)
            if holder is None:
                continue
            verdict = judge(holder)
            if verdict.alive:
                raise refuse(holder, verdict) from None
            if take_over(holder):
                logger.warning("taking over %s from %s: %s", role, holder.describe(), verdict.why)
            continue
        try:
            os.write(fd, body)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        lease = Lease(path, record["token"], record["pid"])
        _REGISTRY.add(lease)
        return lease
    raise CheckpointError(f"could not take {role} {str(path)!r}: other processes keep taking and leaving it")


def clear_if_gone(path: Path, role: str) -> Holder | None:
    """Remove the lease ``path`` when its holder is gone (logged, naming it); return the live holder otherwise
    (``None`` when there is no lease or it was removed)."""
    holder = read_holder(path)
    if holder is None:
        return None
    verdict = judge(holder)
    if verdict.alive:
        return holder
    if take_over(holder):
        logger.warning("removing %s %r of %s: %s", role, str(path), holder.describe(), verdict.why)
    return None


def _take_run_lease(directory: Path) -> Lease | None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RUN_LEASE_NAME
    if held(path) is not None:
        return None

    def refuse(holder: Holder, verdict: Verdict) -> CheckpointError:
        return CheckpointError(
            f"output directory {str(directory)!r} is in use by another run: {holder.describe()}, lease "
            f"{str(path)!r}. Two runs in one output directory replace each other's checkpoints and logs: give this "
            f"run another --output_dir, or {wait_advice(verdict, holder)}")

    return acquire(path, {"output_dir": str(directory.resolve())}, refuse, f"the output directory {str(directory)!r}")


def hold_output_dir(output_dir: str | os.PathLike[str]) -> Lease | None:
    """Hold the run lease of ``output_dir`` (:data:`RUN_LEASE_NAME` inside it): rank 0 takes it, until the
    returned lease's ``release()`` or this process's exit.

    A run that another live process holds is refused on every rank, naming it; one whose holder is gone is taken
    over with a warning. Returns the lease this call took (on rank 0), ``None`` elsewhere and when this process
    already holds it. Collective when ``torch.distributed`` is initialised (every rank calls it).

    Raises:
        CheckpointError: naming the run that holds the directory, and what to do.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    error, taken = None, None
    if not distributed or dist.get_rank() == 0:
        try:
            taken = _take_run_lease(Path(output_dir))
        except CheckpointError as err:
            error = str(err)
    if distributed:
        box = [error]
        with watched("broadcast of rank 0's lease of the output directory"):
            dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)
    return taken
