"""``hf-hybrid-ep launch``: run the restart command of :mod:`hf_hybrid_ep.integrations.launch` and end whatever of
it is left when it ends; on one node, optionally launch it again at a smaller world.

    hf-hybrid-ep launch --max-restarts 3 -- torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint head:29500 \\
        scripts/train.py --output_dir runs/x --save_steps 200 ...

Restarts at the same world are torchrun's elastic agent's (``--max-restarts``, c10d rendezvous at one endpoint):
run this same command on every node. The launch runs in a session of its own. When it is told to stop (SIGTERM,
SIGINT, SIGHUP) it passes the signal to the agent, which ends its workers (SIGTERM, SIGKILL after torchrun's
``--shutdown-timeout``, 30 s) and then itself; an agent that has not ended :data:`AGENT_GRACE_S` later is killed.
When the agent has ended, any of its workers still alive are ended (SIGTERM, SIGKILL after :data:`GRACE_S`):
torchrun starts every worker in a session of its own, so a killed agent leaves them running, out of reach of its
process group. They are found by the environment variable :data:`LAUNCH_MARK` that the launch gives the agent
and every process it starts inherits.

``--min-processes M`` (one node): when the agent gives up and the launch wrote no new checkpoint (the failure
repeats: a GPU is gone), the job is launched again at the largest number of processes below the current, and at
least ``M``, for which the planner (:func:`hf_hybrid_ep.planning.planner.plan`, on the newest checkpoint's config)
finds a layout that fits: the command gets that process count (Accelerate's ``--num_processes``, torchrun's
``--nproc_per_node``) and the planner's ``--dp_degree``/``--ep_degree``; the checkpoint loads at any EP degree. The
global batch shrinks with the world: rescale the learning rate or the accumulation if it matters. On several nodes
it is refused: the nodes' launchers cannot agree on a smaller world; requeue the job at fewer nodes instead
(docs/troubleshooting.md).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..errors import HybridEPConfigError
from ..model_io.resume import latest_checkpoint
from .launch import Job, restart_command, run_id

GRACE_S = 10.0  # a leftover worker gets this long after SIGTERM before SIGKILL
AGENT_GRACE_S = 45.0  # the agent's time to end its workers (torchrun waits 30 s before SIGKILL) and itself
LAUNCH_MARK = "HF_HYBRID_EP_LAUNCH"  # an environment variable naming the launch its processes belong to
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _say(message: str) -> None:
    print(f"hf-hybrid-ep launch: {message}", file=sys.stderr, flush=True)


class Stopped(Exception):
    """The launcher itself was told to stop (SIGTERM, SIGHUP, SIGINT): no relaunch."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame) -> None:
    raise Stopped(signum)


def _started(pid: int) -> tuple[int, str] | None:
    """``(start time in clock ticks, state)`` of process ``pid`` from ``/proc``, ``None`` when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]), fields[0]


def marked(mark: str) -> dict[int, int]:
    """The live processes whose environment holds ``LAUNCH_MARK=mark`` (a launch's agent and everything it
    started), ``{pid: start time}``; empty without ``/proc``."""
    entry = f"{LAUNCH_MARK}={mark}".encode()
    found = {}
    for pid in (int(e) for e in (os.listdir("/proc") if os.path.isdir("/proc") else ()) if e.isdigit()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if entry in environ.split(b"\0") and (info := _started(pid)) is not None and info[1] != "Z":
            found[pid] = info[0]
    return found


def _alive(processes: dict[int, int]) -> dict[int, int]:
    """The ones of ``processes`` (``{pid: start time}``) still running: same PID, same start time, not a zombie."""
    return {pid: t for pid, t in processes.items() if (info := _started(pid)) is not None and info[0] == t
            and info[1] != "Z"}


def end_processes(processes: dict[int, int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM to each still running of ``processes`` (``{pid: start time}``), SIGKILL to those left after
    ``grace_s``. The PIDs that were still running."""
    left = _alive(processes)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for pid in _alive(left):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _alive(left) and time.monotonic() < deadline:
            time.sleep(0.1)
    return sorted(left)


def run_launch(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` (the agent) with ``env`` added, in a session of its own; when it ends or the launcher is
    stopped, end whatever of it is left (see the module docstring). Its exit status (a signal's number negated)."""
    mark = uuid.uuid4().hex  # inherited by every process of the launch, whatever session it starts
    agent = subprocess.Popen(argv, env={**os.environ, **env, LAUNCH_MARK: mark}, start_new_session=True)
    try:
        return agent.wait()
    except (Stopped, KeyboardInterrupt) as err:
        if agent.poll() is None:
            agent.send_signal(err.signum if isinstance(err, Stopped) else signal.SIGINT)
        try:
            agent.wait(timeout=AGENT_GRACE_S)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        raise
    finally:
        left = end_processes(marked(mark))
        if left:
            _say(f"ended {len(left)} process(es) the launch left running (PIDs {left})")


def memory_per_process_gb(processes: int) -> float:
    """What one process may use, for the planner: the first GPU's memory, else the host's divided by ``processes``."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / processes


def _plan_inputs(checkpoint: Path) -> tuple[str, dict]:
    """What the planner reads for ``checkpoint``: the checkpoint itself, or, for a checkpoint of LoRA adapters, the
    base model its saved adapter config names and the adapters' rank and targets."""
    from ..checkpoint.peft_files import saved_adapter_config

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


def shrunk(job: Job, minimum: int, checkpoint: Path | None, gpu_memory_gib: float | None) -> Job | None:
    """``job`` at the planner's smaller world (see the module docstring), or ``None`` when none fits."""
    current = job.processes
    smaller = None if current is None or current <= minimum else smaller_world(current, minimum, checkpoint,
                                                                                gpu_memory_gib)
    if smaller is None:
        _say(f"no layout of fewer than {current} processes (at least {minimum}) fits; not launching again")
        return None
    world, layout = smaller
    what = "the engine's default layout" if layout is None else f"dp {layout[0]} × ep {layout[1]} (planner)"
    _say(f"the launch wrote no new checkpoint: launching again at {world} processes instead of {current}, {what}; "
         "the global batch shrinks with the world")
    return job.with_processes(world).with_layout(layout)


def _check(job: Job, min_processes: int | None) -> None:
    if min_processes is None:
        return
    if job.processes is None:
        flag = "--num_processes" if job.tool == "accelerate" else "--nproc_per_node (a number)"
        raise HybridEPConfigError(f"launch --min-processes needs the command to give {flag}")
    if job.nodes > 1:
        raise HybridEPConfigError(
            f"launch --min-processes {min_processes} works on one node; the command runs on {job.nodes}, whose "
            "launchers cannot agree on a smaller world. Leave it out (torchrun restarts at the same world) and, "
            "when a node is lost, requeue the job at fewer nodes with --resume_from_checkpoint latest (the newest "
            "checkpoint loads at any EP degree; `hf-hybrid-ep plan` gives the layout)")


def supervise(command: list[str], max_restarts: int, min_processes: int | None = None,
              gpu_memory_gib: float | None = None, dry_run: bool = False) -> int:
    """Run ``command`` with torchrun's restarts (see the module docstring). Returns the launch's exit status (0
    when the job finished; 128 + N after signal N)."""
    job = Job.of(command)
    _check(job, min_processes)
    run = run_id(job)  # one for every launch, a smaller world's too
    argv, env = restart_command(job, max_restarts, run)
    if dry_run:
        print(shlex.join([*(f"{k}={v}" for k, v in env.items()), *argv]))
        return 0
    handlers = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}
    try:
        return _launches(job, max_restarts, min_processes, gpu_memory_gib, run)
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        _say(f"stopped by {signal.Signals(signum).name}: the job's processes were ended, no restart")
        return 128 + signum
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _launches(job: Job, max_restarts: int, min_processes: int | None, gpu_memory_gib: float | None,
              run: str) -> int:
    while True:
        before = latest_checkpoint(job.output_dir) if job.output_dir else None
        argv, env = restart_command(job, max_restarts, run)
        _say("running " + shlex.join([*(f"{k}={v}" for k, v in env.items()), *argv]))
        code = run_launch(argv, env)
        if code == 0:
            return 0
        code = 128 - code if code < 0 else code
        _say(f"the launch ended with exit status {code} (torchrun's restarts: --max-restarts {max_restarts})")
        after = latest_checkpoint(job.output_dir) if job.output_dir else None
        if min_processes is None or (after is not None and after != before):
            return code
        smaller = shrunk(job, min_processes, after, gpu_memory_gib)
        if smaller is None:
            return code
        job = smaller
