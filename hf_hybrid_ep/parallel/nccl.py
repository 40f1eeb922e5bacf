"""torch's own NCCL watchdog and flight recorder, set up to back the package's watchdog.

ProcessGroupNCCL runs a watchdog thread of its own: a collective not completed within its group's timeout aborts
the process, after writing the flight recorder (a ring buffer of the last collectives of every group, with their
state and call stacks) to ``TORCH_FR_DUMP_TEMP_FILE<rank>``. It cannot say which rank is missing, and it cannot see
a collective the host has not reached; the package's watchdog (:mod:`hf_hybrid_ep.parallel.watchdog`) names both
at ``collective_timeout_s``. So under NCCL the groups get ``collective_timeout_s +`` :data:`GRACE_S`: the package's
message comes first, NCCL's abort is the backstop (a hang the Python thread cannot see). The environment defaults
of :data:`ENV_DEFAULTS` (set unless already set, before a process group is created) keep the flight recorder on
with a dump on timeout, and NCCL's error handling ending the process without ``ncclCommAbort`` (which can itself
hang). When the package's watchdog ends a process it writes the same dump itself (:func:`dump`) and aborts the
communicators (:func:`abort`, bounded), then exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GRACE_S = 30.0  # NCCL's watchdog aborts this long after the package's has named the hang
ABORT_S = 5.0  # the package's watchdog waits this long for the communicators' abort before it exits
ENV_DEFAULTS = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder entries (TORCH_FR_BUFFER_SIZE in newer torch)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # NCCL's watchdog writes the flight recorder before it aborts
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a timed-out collective ends the process, skipping ncclCommAbort
}
_ALIASES = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE"}


def set_env_defaults() -> None:
    """Set :data:`ENV_DEFAULTS` where neither the variable nor its newer name is set. NCCL reads them when a
    process group is created (the buffer size when the first one is), so call this before."""
    for name, value in ENV_DEFAULTS.items():
        if name not in os.environ and _ALIASES.get(name, name) not in os.environ:
            os.environ[name] = value


def group_timeout(timeout: timedelta | None, device_type: str) -> timedelta | None:
    """The timeout of a process group the package creates for a run whose collectives may take ``timeout``: the
    same under gloo (its error is the package's first sign of a hang), ``timeout +`` :data:`GRACE_S` under NCCL."""
    if timeout is None or device_type != "cuda":
        return timeout
    return timeout + timedelta(seconds=GRACE_S)


def runs_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (``None``: the default group) has an NCCL backend."""
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False


def set_world_timeout(timeout: timedelta) -> None:
    """Give the default group ``timeout`` under NCCL (the package's collectives over the world run on it)."""
    if dist.is_initialized() and runs_nccl():
        dist.distributed_c10d._set_pg_timeout(timeout, None)


def _trace() -> dict | None:
    """This rank's flight recorder (NCCL's, else the generic one gloo records into), ``None`` without one."""
    c10d = torch._C._distributed_c10d
    reader = getattr(c10d, "_dump_nccl_trace", None) if runs_nccl() else None
    reader = reader or getattr(c10d, "_dump_fr_trace", None)
    if reader is None:
        return None
    try:
        return pickle.loads(reader(True, False, False))
    except Exception:  # noqa: BLE001 - a diagnostic: never in the way of ending the process
        return None


def _ranks_by_name() -> dict[str, list[int]]:
    try:
        return {name: dist.get_process_group_ranks(pg) for pg, name in dist.distributed_c10d._world.pg_names.items()}
    except Exception:  # noqa: BLE001 - a diagnostic
        return {}


def oldest_incomplete(trace: dict | None) -> str:
    """The flight recorder's oldest collective not completed on this rank, in words (``""``: none). It names
    collectives the package does not issue (DDP's) too."""
    entries = (trace or {}).get("entries", [])
    entry = next((e for e in entries if e.get("state") != "completed" and not e.get("retired")), None)
    if entry is None:
        return ""
    name, desc = entry.get("process_group", ("?", "?"))
    ranks = _ranks_by_name().get(name, "?")
    return (f"flight recorder: oldest collective not completed on this rank: {entry.get('profiling_name')} "
            f"#{entry.get('collective_seq_id')} of process group {name} ({desc}, ranks {ranks}), "
            f"{entry.get('state')}, sizes {entry.get('input_sizes')}")


def flight_recorder_line() -> str:
    """:func:`oldest_incomplete` of this rank's flight recorder."""
    return oldest_incomplete(_trace())


def dump_path(rank: int) -> Path:
    """Where NCCL's watchdog writes this rank's flight recorder: ``TORCH_FR_DUMP_TEMP_FILE`` (or
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) followed by the rank, by default under ``~/.cache/torch``."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ.get("HOME", "/tmp"), ".cache")
        prefix = os.path.join(cache, "torch", "comm_lib_trace_rank_")
    return Path(f"{prefix}{rank}")


def dump(rank: int) -> str:
    """Under NCCL: write this rank's flight recorder where NCCL's watchdog would and say where (``""``
    otherwise), so that ``torchfrtrace DIR`` can match every rank's collectives."""
    reader = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if reader is None or not runs_nccl():
        return ""
    try:
        path = dump_path(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(reader())
    except Exception as err:  # noqa: BLE001 - a diagnostic: never in the way of ending the process
        return f"flight recorder not written ({type(err).__name__}: {err})"
    prefix = path.name[: -len(str(rank))]
    return f"flight recorder written to {path} (every rank's, matched: torchfrtrace {path.parent} -p {prefix})"


def abort() -> None:
    """Under NCCL: abort every communicator (frees them; unblocks this rank's streams), waiting at most
    :data:`ABORT_S`."""
    if not (dist.is_initialized() and runs_nccl()):
        return

    def run() -> None:
        with contextlib.suppress(Exception):  # aborting is the last thing this process does: nothing to report
            dist.distributed_c10d._abort_process_group()

    thread = threading.Thread(target=run, daemon=True, name="hf_hybrid_ep-nccl-abort")
    thread.start()
    thread.join(ABORT_S)
