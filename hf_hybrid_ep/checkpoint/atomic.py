"""Whole-directory saves that a crash cannot mix: stage in a fresh sibling, fsync, put in place by rename.

A save (a Trainer ``checkpoint-N``, a convert / reshard / export output) is written into
``.<name>.new-<save id>/<name>`` beside its target (a hidden container holding a directory of the
target's own name, so that the Trainer can write its files there unchanged), claimed first with a
lock file ``.<name>.lock`` — a lease (:mod:`.lease`: host, PID, the process's start time, run id,
heartbeat) — so that a second writer of the same target fails at once. When complete, every file
and then the directory are fsynced and the staged directory is put in place:

* target absent: ``rename`` (atomic);
* target present: ``renameat2(RENAME_EXCHANGE)`` on Linux swaps the two directories atomically, then
  the old one (now inside the container) is removed; where the OS has no exchange, the target is
  first renamed to ``.<name>.old-<save id>`` and the new one renamed in. A crash between those two
  renames leaves no target but two complete copies; :func:`recover` (called by every loader) puts
  the new one in place, or the old one back when the new one is incomplete.

A reader therefore sees the previous checkpoint or the new one, never a mix and never nothing. What
makes "complete" checkable is the manifest every save carries, in its weight index or, for a save without one
(a Trainer checkpoint of a ``PeftModel``), in ``hybrid_ep_manifest.json`` (:mod:`.manifest`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError
from .lease import Holder, Verdict, acquire, clear_if_gone, held, wait_advice
from .manifest import CheckpointVerifier, is_complete, write_manifest
from .safetensors_io import write_point

logger = logging.getLogger("hf_hybrid_ep")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def staging_path(target: Path, save_id: str) -> Path:
    """The staged directory of save ``save_id`` of ``target`` (inside its hidden container)."""
    return target.parent / f".{target.name}.new-{save_id}" / target.name


def old_path(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}.old-{save_id}"


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _read_claim(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


CLAIM_NAME = "claim.json"  # inside each staging container: the record of its writer, as its claim holds it


_CONTAINER = re.compile(r"^\.(?P<target>.+)\.(?:new|tmp)-[^/]+$")
_LOCK = re.compile(r"^\.(?P<target>.+)\.lock$")


def _leftovers(directory: Path) -> list[tuple[Path, Path]]:
    """``(staging container, its target)`` of every save staged in ``directory`` (also the ``.tmp-<pid>``
    directories of versions before containers)."""
    found = []
    for p in sorted(directory.iterdir()) if directory.is_dir() else ():
        match = _CONTAINER.match(p.name)
        if match and p.is_dir():
            found.append((p, directory / match["target"]))
    return found


def _clear_stale_claims(directory: Path, mine: Path) -> dict[Path, Holder]:
    """Remove every claim in ``directory`` (other than ``mine``) whose writer is gone, logging each — what a crash
    or a kill of a save left; return the live ones by target."""
    live = {}
    for lock in sorted(directory.glob(".*.lock")):
        match = _LOCK.match(lock.name)
        if match and lock != mine:
            holder = clear_if_gone(lock, "the save claim")
            if holder is not None:
                live[directory / match["target"]] = holder
    return live


def _clean_leftovers(target: Path) -> None:
    """Remove (and report, with their size) the staging containers of the directory of ``target`` — of any target
    there — whose target holds no live claim, and the claims of writers that are gone: a writer holds its claim
    from before its container exists until after it is gone, so such a container is what a crash, a kill or a full
    disk left. A container whose target is claimed by a live writer (:func:`~.lease.judge`) is reported and left.
    A ``.old-*`` copy beside a present target is what a portable commit had not yet removed."""
    if target.exists():
        for old in sorted(target.parent.glob(f".{target.name}.old-*")):
            logger.warning("removing %r (%.1f MiB), the previous copy of %s left by an interrupted save",
                           str(old), _dir_bytes(old) / 2**20, target.name)
            shutil.rmtree(old, ignore_errors=True)
    live = _clear_stale_claims(target.parent, lock_path(target))
    for left, owner in _leftovers(target.parent):
        size = f"{_dir_bytes(left) / 2**20:.1f} MiB"
        holder = live.get(owner)  # never this target: claimed by this process now, its containers are earlier saves'
        if holder is not None:
            logger.warning("leaving %r (%s) alone: %s is being written by %s", str(left), size, owner.name,
                           holder.describe())
            continue
        writer = _read_claim(left / CLAIM_NAME)
        was = (f"PID {writer.get('pid')} on host {writer.get('host')!r}, no longer running or holding no claim"
               if writer else "a writer that recorded no claim (a full disk?)")
        logger.warning("removing %r (%s), left by an interrupted save of %s (%s)", str(left), size, owner.name, was)
        shutil.rmtree(left, ignore_errors=True)


def _refuse_claim(target: Path) -> Callable[[Holder, Verdict], CheckpointError]:
    def refuse(holder: Holder, verdict: Verdict) -> CheckpointError:
        return CheckpointError(
            f"{str(target)!r} is being written by {holder.describe()}, claim {str(lock_path(target))!r}: another run "
            f"or command is saving the same target. Write elsewhere, or {wait_advice(verdict, holder)}")
    return refuse


def claim(target: Path, save_id: str) -> Path:
    """Claim ``target`` for one save and create its empty staged directory; return that directory.

    The claim is a lease (:mod:`.lease`: host, PID, the process's start time, run id, a heartbeat). A claim whose
    writer still runs fails at once, naming it and what to do; one whose writer is gone (its process ended, its PID
    now another process's, or — for a writer on another host — its heartbeat older than
    :data:`~.lease.STALE_AFTER_S`) is cleared with a warning, as are such claims of other targets in the directory;
    staging that gone writers left behind is removed and reported with its size.

    Raises:
        CheckpointError: naming the target and the process that holds it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lease = acquire(lock_path(target), {"save_id": save_id, "target": target.name}, _refuse_claim(target),
                    f"the save claim of {target.name}")
    try:
        _clean_leftovers(target)
        staging = staging_path(target, save_id)
        staging.mkdir(parents=True)
        (staging.parent / CLAIM_NAME).write_bytes(lease.path.read_bytes())
    except BaseException:
        lease.release()
        raise
    return staging


def release(target: Path, staging: Path | None = None) -> None:
    """Drop the claim (and the staging container, if it is still there: the save failed)."""
    if staging is not None and staging.parent.exists():
        shutil.rmtree(staging.parent, ignore_errors=True)
    lease = held(lock_path(target))
    if lease is not None:
        lease.release()


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    dirs = [root]
    for path in sorted(root.rglob("*")):
        if path.is_dir():
            dirs.append(path)
        elif path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            write_point(f"fsync {path.name}")
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        fsync_dir(d)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); ``False`` where the OS or filesystem cannot."""
    if os.environ.get("HF_HYBRID_EP_NO_RENAME_EXCHANGE"):  # the portable path, for tests
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {str(a)!r} and {str(b)!r} failed: {os.strerror(err)}")


def commit(staging: Path, target: Path, save_id: str) -> None:
    """fsync ``staging`` and put it in place of ``target`` atomically (see the module docstring)."""
    fsync_tree(staging)
    parent = target.parent
    if not target.exists():
        os.rename(staging, target)
        write_point("renamed into place")
    elif _exchange(staging, target):
        write_point("exchanged")
        fsync_dir(parent)
        shutil.rmtree(staging)  # the previous checkpoint, now inside the container
        write_point("old removed")
    else:
        old = old_path(target, save_id)
        os.rename(target, old)
        write_point("old renamed aside")
        fsync_dir(parent)
        os.rename(staging, target)
        write_point("renamed into place")
        fsync_dir(parent)
        shutil.rmtree(old)
    shutil.rmtree(staging.parent, ignore_errors=True)
    fsync_dir(parent)
    write_point("committed")


def recover(target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Complete or roll back a save interrupted between the two renames of the portable path.

    Only acts when ``target`` is missing: a complete ``.new-*`` sibling is put in place, else the
    ``.old-*`` sibling back. Old siblings beside an existing target are left for the next save.
    """
    if target.exists() or not target.parent.is_dir():
        return
    new = sorted(c / target.name for c in target.parent.glob(f".{target.name}.new-*"))
    old = sorted(target.parent.glob(f".{target.name}.old-*"))
    chosen = next((c for c in new if is_complete(c)), old[-1] if old else None)
    if chosen is None:
        return
    logger.warning("%s an interrupted save: %s -> %s", "completing" if chosen in new else "rolling back",
                   chosen.name, target.name)
    try:
        os.rename(chosen, target)
    except OSError:  # another rank of the same job got there first
        if not target.exists():
            raise
    fsync_dir(target.parent)


def check_output_free(target: Path) -> None:
    """Refuse an output that exists and is not an empty directory (checked before any work)."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"output {str(target)!r} already exists and is not empty")


@contextmanager
def staged_save(target: Path, *, save_id: str | None = None, fresh: bool = False) -> Iterator[tuple[Path, str]]:
    """Claim ``target``, yield ``(staging directory, save id)``; on a clean exit write the manifest (into the
    staging directory's weight index, or ``hybrid_ep_manifest.json`` when it has none) and :func:`commit`. On an
    exception the staging directory is removed and ``target`` is untouched.

    Args:
        fresh: ``target`` must not exist or be empty (convert, reshard, export), checked first.
    """
    target = Path(target)
    recover(target, is_complete)
    if fresh:
        check_output_free(target)
    save_id = save_id or new_save_id()
    staging = claim(target, save_id)
    try:
        yield staging, save_id
        write_manifest(staging, save_id)
        commit(staging, target, save_id)
    finally:
        release(target, staging)


def open_checkpoint(root: str | os.PathLike[str], *, verify: bool = True, local: bool = True) -> CheckpointVerifier:
    """The verifier of checkpoint ``root``, after completing or rolling back an interrupted save of it."""
    root = Path(root)
    if local:
        recover(root, is_complete)
    return CheckpointVerifier(root, verify=verify)
