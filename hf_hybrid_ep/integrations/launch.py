"""``hf-hybrid-ep launch``: run a training job and, when it fails, run the whole job again, by itself.

    hf-hybrid-ep launch --max-restarts 3 -- accelerate launch --multi_gpu --num_processes 8 scripts/train.py \\
        --output_dir runs/x --save_steps 200 --resume_from_checkpoint latest ...

torchrun's and Accelerate's own restarts (``--max-restarts``) re-rendezvous the workers inside the same agent;
with gloo on torch 2.13 the new workers die in ``connectFullMesh`` ("Connection refused"). Here every attempt is a
fresh launch: new processes, a new process group on a new port, and the training command resumes from the newest
complete checkpoint of its output directory (``--resume_from_checkpoint latest``; a fresh start when there is
none). Before the next attempt the failed one's leftover processes (its whole process group) are ended, so a rank
that hangs cannot hold the job. Every attempt runs with the same ``HF_HYBRID_EP_RUN_ID`` (kept when set, else
drawn here), by which it takes over the lease of the output directory and the save claims its predecessor left,
even from another host (:mod:`hf_hybrid_ep.checkpoint.lease`).

``--min-processes M`` allows a smaller world: an attempt that failed without writing a new checkpoint (a failure
that repeats, such as a lost GPU) is followed by one at the largest number of processes below the current, and at
least ``M``, for which the planner (:func:`hf_hybrid_ep.planning.planner.plan`, on the newest checkpoint's config; of
a checkpoint of LoRA adapters, on the base model its adapter config names, with the adapters' rank and targets)
finds a layout that fits; the command gets that ``--num_processes`` and the planner's ``--dp_degree`` /
``--ep_degree``, and the checkpoint loads at that EP degree. The global batch shrinks with the world
(per-device batch × accumulation × processes): rescale the learning rate or the accumulation if it matters.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..config import RUN_ID_ENV
from ..errors import HybridEPConfigError
from .resume import latest_checkpoint

PROCESS_FLAGS = ("--num_processes", "--nproc_per_node", "--nproc-per-node")
PORT_FLAGS = {"accelerate": "--main_process_port", "torchrun": "--master_port"}
GRACE_S = 10.0  # a failed attempt's processes get this long after SIGTERM before SIGKILL


def _say(message: str) -> None:
    print(f"hf-hybrid-ep launch: {message}", file=sys.stderr, flush=True)


def _value(args: list[str], flags: tuple[str, ...]) -> tuple[int, str] | None:
    """``(index, value)`` of the first of ``flags`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            if eq:
                return i, value
            if i + 1 < len(args):
                return i, args[i + 1]
    return None


def _set(args: list[str], flag: str, value: str | None, at: int | None = None) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (removed when ``None``); a new flag goes at ``at`` (default: the end)."""
    out, i, found = [], 0, False
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name == flag:
            found = True
            if value is not None:
                out += [flag, value]
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    if not found and value is not None:
        at = len(out) if at is None else at
        out[at:at] = [flag, value]
    return out


@dataclass
class Job:
    """A launch command split into the launcher's part and the training script's arguments."""

    launcher: list[str]  # up to and including the script
    script: list[str]

    @classmethod
    def of(cls, command: list[str]) -> Job:
        if not command:
            raise HybridEPConfigError("launch: give the command after '--', e.g. -- accelerate launch ... train.py ...")
        at = next((i for i, a in enumerate(command) if a.endswith(".py")), None)
        if at is None:
            raise HybridEPConfigError(f"launch: the command {command!r} names no Python script (…/train.py)")
        return cls(command[: at + 1], command[at + 1 :])

    @property
    def processes(self) -> int | None:
        found = _value(self.launcher, PROCESS_FLAGS)
        return None if found is None else int(found[1])

    @property
    def output_dir(self) -> str | None:
        found = _value(self.script, ("--output_dir",))
        return None if found is None else found[1]

    def command(self, port: int) -> list[str]:
        """The command of one attempt, rendezvousing on ``port`` (Accelerate and torchrun, unless set)."""
        launcher = list(self.launcher)
        tool = Path(launcher[0]).name
        flag = PORT_FLAGS.get("accelerate" if tool == "accelerate" else tool)
        if flag is not None and _value(launcher, (flag,)) is None and "--standalone" not in launcher:
            launcher = _set(launcher, flag, str(port), at=2 if tool == "accelerate" else 1)
        return launcher + self.script

    def at_world(self, processes: int, layout: tuple[int, int] | None) -> Job:
        """This job at ``processes`` processes with the planner's ``(dp, ep)`` (``None``: the engine's default)."""
        found = _value(self.launcher, PROCESS_FLAGS)
        flag = PROCESS_FLAGS[0] if found is None else self.launcher[found[0]].partition("=")[0]
        script = self.script
        for name, value in zip(("--dp_degree", "--ep_degree"), layout or (None, None), strict=True):
            script = _set(script, name, None if value is None else str(value))
        return Job(_set(self.launcher, flag, str(processes)), script)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stopped(Exception):
    """The launcher itself was told to stop (SIGTERM, SIGHUP): no restart."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame) -> None:
    raise Stopped(signum)


def run_attempt(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``command`` (in environment ``env``, default this process's) in a session of its own; when it ends (or
    the launcher is stopped), end whatever of it is left. Its exit status (a signal's number negated)."""
    process = subprocess.Popen(command, start_new_session=True, env=env)
    try:
        code = process.wait()
    finally:
        _end_group(process.pid)
    return code


def _end_group(pgid: int) -> None:
    """SIGTERM, then SIGKILL after :data:`GRACE_S`, to every process still in process group ``pgid``."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def memory_per_process_gb(processes: int) -> float:
    """What one process may use, for the planner: the first GPU's memory, else the host's divided by ``processes``."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / processes


def _plan_inputs(checkpoint: Path) -> tuple[str, dict]:
    """What the planner reads for ``checkpoint``: the checkpoint itself, or, for a checkpoint of LoRA adapters, the
    base model its saved adapter config names and the adapters' rank and targets."""
    from ..checkpoint.adapters import saved_adapter_config

    adapter = saved_adapter_config(checkpoint)
    if adapter is None:
        return str(checkpoint), {}

    def names(value) -> list[str] | None:
        return sorted(value) if isinstance(value, list | set | tuple) else None

    return adapter.base_model_name_or_path or "", {
        "lora_r": adapter.r, "lora_target_modules": names(adapter.target_modules),
        "lora_target_parameters": names(getattr(adapter, "target_parameters", None))}


def smaller_world(current: int, minimum: int, checkpoint: Path | None, memory_gb: float | None
                  ) -> tuple[int, tuple[int, int] | None] | None:
    """The largest world below ``current`` and at least ``minimum`` with a layout that fits, and the planner's
    ``(dp, ep)`` for it (``None`` without a checkpoint to plan from, or a checkpoint of adapters that names no base
    model: the engine's default layout)."""
    from ..planning.planner import plan

    model, lora = (None, {}) if checkpoint is None else _plan_inputs(Path(checkpoint))
    for world in range(current - 1, minimum - 1, -1):
        if not model:
            return world, None
        result = plan(model, world, memory_gb or memory_per_process_gb(world), **lora)
        recommended = result["recommended"]
        if recommended is not None:
            return world, (recommended["dp"], recommended["ep"])
    return None


def supervise(command: list[str], max_restarts: int, min_processes: int | None = None,
              gpu_memory_gib: float | None = None) -> int:
    """Run ``command`` and restart it whole after a failure, up to ``max_restarts`` times (see the module
    docstring). Returns the last attempt's exit status (0 when the job finished)."""
    job = Job.of(command)
    if min_processes is not None and job.processes is None:
        raise HybridEPConfigError(f"launch --min-processes needs the command to give {' or '.join(PROCESS_FLAGS)}")
    if "--resume_from_checkpoint" not in " ".join(job.script):
        _say("the command passes no --resume_from_checkpoint: unless its --hybrid_ep_config file sets "
             "resume_from_checkpoint: latest, every restart starts from scratch")
    env = {**os.environ, RUN_ID_ENV: os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:16]}  # one for every attempt
    _say(f"run id {env[RUN_ID_ENV]} ({RUN_ID_ENV}): each attempt takes over its predecessor's lease and save claims")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        return _attempts(job, max_restarts, min_processes, gpu_memory_gib, env)
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        _say(f"stopped by {signal.Signals(signum).name}: the job's processes were ended, no restart")
        return 128 + signum


def _attempts(job: Job, max_restarts: int, min_processes: int | None, gpu_memory_gib: float | None,
              env: dict[str, str]) -> int:
    code = 0
    for attempt in range(max_restarts + 1):
        before = latest_checkpoint(job.output_dir) if job.output_dir else None
        code = run_attempt(job.command(_free_port()), env)
        if code == 0:
            return 0
        after = latest_checkpoint(job.output_dir) if job.output_dir else None
        if attempt == max_restarts:
            _say(f"attempt {attempt + 1} failed with exit status {code}; no restart left (--max-restarts {max_restarts})")
            return code
        job = _next_job(job, min_processes, after, progressed=after is not None and after != before,
                        gpu_memory_gib=gpu_memory_gib)
        _say(f"attempt {attempt + 1} failed with exit status {code}; restarting the whole job ({attempt + 1} of "
             f"{max_restarts} restarts), resuming from {after or 'the start (no complete checkpoint yet)'}")
    return code


def _next_job(job: Job, min_processes: int | None, checkpoint: Path | None, progressed: bool,
              gpu_memory_gib: float | None) -> Job:
    """The same job, or, with ``min_processes``, after an attempt that wrote no checkpoint, a smaller world."""
    if min_processes is None or progressed or job.processes is None or job.processes <= min_processes:
        return job
    smaller = smaller_world(job.processes, min_processes, checkpoint, gpu_memory_gib)
    if smaller is None:
        _say(f"no layout of fewer than {job.processes} processes (at least {min_processes}) fits; keeping the world")
        return job
    world, layout = smaller
    what = "the engine's default layout" if layout is None else f"dp {layout[0]} × ep {layout[1]} (planner)"
    _say(f"the attempt wrote no new checkpoint: shrinking the world from {job.processes} to {world} processes, "
         f"{what}; the global batch shrinks with it")
    return job.at_world(world, layout)
