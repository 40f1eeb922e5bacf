"""One error for every rank: work that can fail on some ranks only (reading this rank's checkpoint files, checking
its device) runs on every rank, then the ranks agree; if any failed, every rank raises the same readable error
— the first failing rank's message, naming the ranks — so nobody enters the next collective alone and no rank
prints a different story (a missing expert file on one rank must not read as a shape error on another)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..errors import CheckpointError, HybridEPConfigError
from ..parallel.mesh import HybridMesh

T = TypeVar("T")
_KINDS = {cls.__name__: cls for cls in (CheckpointError, HybridEPConfigError, FileNotFoundError)}


def agree_on_failure(mesh: HybridMesh, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on every rank; if it raises on any rank, every rank raises the same error: the type of the
    first failing rank's error (``CheckpointError``, ``HybridEPConfigError``, ``FileNotFoundError``; any other:
    ``RuntimeError``) with its message and the failing ranks. Collective over the world."""
    error: BaseException | None = None
    result = None
    try:
        result = fn(*args)
    except Exception as err:  # re-raised below, after the ranks agree
        error = err
    if mesh.world_group is None:
        if error is not None:
            raise error
        return result
    mine = None if error is None else (type(error).__name__, str(error))
    everyone = mesh.gather_objects(mine, "all_gather of every rank's error (agreeing on a failure)")
    failed = [rank for rank, e in enumerate(everyone) if e is not None]
    if not failed:
        return result
    kind, message = everyone[failed[0]]
    raise _KINDS.get(kind, RuntimeError)(f"{message} (on rank(s) {failed}; every rank stops)") from error
