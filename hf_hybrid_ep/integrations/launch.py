"""The launch command that ``hf-hybrid-ep launch`` runs: the user's ``torchrun`` or ``accelerate launch`` command,
set up so that torchrun's elastic agent restarts every node's workers together after a failure and the training
resumes from the newest complete checkpoint.

    hf-hybrid-ep launch --max-restarts 3 -- torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint head:29500 \\
        scripts/train.py --output_dir runs/x --save_steps 200 ...

What the command gets (:func:`restart_command`; ``hf-hybrid-ep launch --dry-run`` prints it):

- ``--max-restarts N`` (Accelerate: ``--max_restarts``). When a worker fails, the agent of its node ends the node's
  workers and opens a new rendezvous round; the agents of the other nodes see the round and end theirs: every node
  starts a new worker group, together, at the same world.
- c10d rendezvous at one endpoint for every node: torchrun ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` (as
  given, or from ``--master_addr``/``--master_port``; ``--standalone`` on one node); Accelerate ``--rdzv_backend
  c10d``, its ``--main_process_ip``/``--main_process_port`` being the endpoint on several machines, torchrun's
  ``--standalone`` (``PET_STANDALONE=1``) on one. The static rendezvous (the default of both) cannot restart.
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. By default (torch 2.13) the workers of every round share one c10d store
  kept by the agent, holding the previous round's keys, so a restarted worker can read the old addresses of its
  process group: gloo fails in ``connectFullMesh ... Connection refused`` (seen on every try here, one node and
  two), NCCL can take the old unique id. With it, each round's rank 0 hosts a new store on a new port.
- ``HF_HYBRID_EP_RUN_ID``, the same for every round and every node (kept when set; else torchrun's ``--rdzv-id``
  when given, else drawn once on one node; several nodes without either derive it from the endpoint and the output
  directory): by it a restarted rank 0 takes over the lease of the output directory and the save claims its
  predecessor left, even from another node (:mod:`hf_hybrid_ep.checkpoint.lease`).
- ``--resume_from_checkpoint latest`` after the script's arguments, unless they pass ``--resume_from_checkpoint``:
  the first round starts fresh, every restart resumes from the newest complete checkpoint of ``--output_dir``
  (:mod:`hf_hybrid_ep.model_io.resume`).

Process counts are read as each launcher means them: Accelerate's ``--num_processes`` is the total over its
``--num_machines``, torchrun's ``--nproc_per_node`` is per node of its ``--nnodes``; Accelerate's values missing
from the command line are read from its config file, as ``accelerate launch`` does.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import RUN_ID_ENV
from ..errors import HybridEPConfigError

STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RESUME = ("--resume_from_checkpoint", "latest")

# each flag with its aliases, the first the spelling written
TORCHRUN = {
    "nodes": ("--nnodes",),
    "per_node": ("--nproc-per-node", "--nproc_per_node"),
    "restarts": ("--max-restarts", "--max_restarts"),
    "backend": ("--rdzv-backend", "--rdzv_backend"),
    "endpoint": ("--rdzv-endpoint", "--rdzv_endpoint"),
    "addr": ("--master-addr", "--master_addr"),
    "port": ("--master-port", "--master_port"),
}
ACCELERATE = {
    "nodes": ("--num_machines",),
    "total": ("--num_processes",),
    "restarts": ("--max_restarts",),
    "backend": ("--rdzv_backend",),
    "addr": ("--main_process_ip",),
    "port": ("--main_process_port",),
}
# what ``accelerate launch`` takes from its config file when the command line leaves it out (its other defaults,
# such as ``rdzv_backend``, are not None, so the file never overrides them)
ACCELERATE_CONFIG_KEYS = {"nodes": "num_machines", "total": "num_processes", "addr": "main_process_ip",
                          "port": "main_process_port"}
RESTARTABLE_BACKENDS = ("static", "c10d")  # static is replaced by c10d; another backend is refused
ACCELERATE_AGENT = ("--multi_gpu", "--use_fsdp")  # what makes accelerate launch run torchrun's agent
ACCELERATE_AGENT_TYPES = ("MULTI_GPU", "FSDP")  # the same, as the config file's distributed_type
ACCELERATE_OTHER = ("--cpu", "--use_deepspeed", "--tpu")  # launchers of its own instead of torchrun's agent


def _value(args: list[str], flags: tuple[str, ...]) -> str | None:
    """The value of the first of ``flags`` in ``args`` (``--flag value`` or ``--flag=value``), else ``None``."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            if eq:
                return value
            if i + 1 < len(args):
                return args[i + 1]
    return None


def _set(args: list[str], flags: tuple[str, ...], value: str | None, at: int = 0) -> list[str]:
    """``args`` with the flag of spellings ``flags`` set to ``value`` (removed when ``None``): in place of its first
    occurrence, as spelled there, the others dropped; a flag that was not there goes at ``at``, as ``flags[0]``."""
    out, i, first, spelling = [], 0, None, flags[0]
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name in flags:
            if first is None:
                first, spelling = len(out), name
            i += 1 if eq else 2
            continue
        out.append(args[i])
        i += 1
    if value is not None:
        where = at if first is None else first
        out[where:where] = [spelling, value]
    return out


def _count(value: str, flag: str) -> int:
    """A positive process or node count; a torchrun node range ``MIN:MAX`` counts as its ``MAX``."""
    text = value.rpartition(":")[2]
    if not text.isdigit() or int(text) < 1:
        raise HybridEPConfigError(f"{flag} {value!r} is not a positive number")
    return int(text)


def _accelerate_config(flags: list[str]) -> dict[str, object]:
    """What Accelerate's config file (``--config_file``, else its default file, if any) sets, as ``accelerate
    launch`` reads it for the flags its command line leaves out."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file

    path = _value(flags, ("--config_file",))
    if path is None and not Path(default_config_file).is_file():
        return {}
    return load_config_from_file(path).to_dict()


@dataclass(frozen=True)
class Job:
    """A launch command split at its script: ``head`` names the launcher (``torchrun``, ``python -m
    torch.distributed.run``, ``accelerate launch``), ``flags`` are the launcher's, ``args`` the script's."""

    tool: str  # "torchrun" or "accelerate"
    head: tuple[str, ...]
    flags: tuple[str, ...]
    script: str
    args: tuple[str, ...]
    config: tuple[tuple[str, object], ...] = ()  # Accelerate's config file, for the flags not given

    @classmethod
    def of(cls, command: list[str]) -> Job:
        if not command:
            raise HybridEPConfigError("give the command after '--': -- torchrun ... train.py ... or "
                                      "-- accelerate launch ... train.py ...")
        name = Path(command[0]).name
        if name == "accelerate" and command[1:2] == ["launch"]:
            tool, head = "accelerate", 2
        elif name == "torchrun":
            tool, head = "torchrun", 1
        elif command[1:3] == ["-m", "torch.distributed.run"]:
            tool, head = "torchrun", 3
        else:
            raise HybridEPConfigError(f"the command {shlex.join(command[:3])!r}... is neither torchrun nor "
                                      "accelerate launch: the restarts are torchrun's elastic agent's, which both run")
        at = next((i for i in range(head, len(command)) if command[i].endswith(".py")), None)
        if at is None:
            raise HybridEPConfigError(f"the command {command!r} names no Python script (…/train.py)")
        flags = command[head:at]
        config = tuple(_accelerate_config(flags).items()) if tool == "accelerate" else ()
        return cls(tool, tuple(command[:head]), tuple(flags), command[at], tuple(command[at + 1 :]), config)

    def setting(self, key: str) -> str | None:
        """A launcher setting: from the command line, else (Accelerate) from its config file."""
        names = (TORCHRUN if self.tool == "torchrun" else ACCELERATE)[key]
        value = _value(list(self.flags), names)
        if value is None and key in ACCELERATE_CONFIG_KEYS and self.tool == "accelerate":
            found = dict(self.config).get(ACCELERATE_CONFIG_KEYS[key])
            value = None if found is None else str(found)
        return value

    @property
    def nodes(self) -> int:
        value = self.setting("nodes")
        return 1 if value is None else _count(value, "--nnodes" if self.tool == "torchrun" else "--num_machines")

    @property
    def processes(self) -> int | None:
        """The total number of processes over all nodes (``None``: not given, or torchrun's ``gpu``/``auto``)."""
        if self.tool == "accelerate":
            value = self.setting("total")
            return None if value is None else _count(value, "--num_processes")
        value = self.setting("per_node")
        return None if value is None or not value.isdigit() else _count(value, "--nproc_per_node") * self.nodes

    @property
    def output_dir(self) -> str | None:
        return _value(list(self.args), ("--output_dir",))

    def check(self) -> None:
        """Refuse what the agent could not restart or would start at another world than asked."""
        total, nodes = self.processes, self.nodes
        if self.tool == "accelerate" and total is not None and total % nodes:
            raise HybridEPConfigError(
                f"accelerate launch --num_processes {total} --num_machines {nodes}: --num_processes is the "
                f"total over all machines and Accelerate starts {total} // {nodes} = {total // nodes} on each "
                f"({total // nodes * nodes} ranks); give a multiple of --num_machines")
        backend = self.setting("backend")
        if backend is not None and backend not in RESTARTABLE_BACKENDS:
            raise HybridEPConfigError(f"--rdzv-backend {backend}: restarts here use the c10d rendezvous "
                                      "(leave the flag out, or give c10d)")
        if self.tool == "accelerate":
            other = [flag for flag in ACCELERATE_OTHER if flag in self.flags]
            if other or not (set(ACCELERATE_AGENT) & set(self.flags)
                             or dict(self.config).get("distributed_type") in ACCELERATE_AGENT_TYPES):
                raise HybridEPConfigError(
                    f"accelerate launch {' '.join(other) or 'without --multi_gpu'} does not run torchrun's elastic "
                    "agent, so nothing would restart: give --multi_gpu (on the CPU too, with ACCELERATE_USE_CPU=1)")

    def with_processes(self, total: int) -> Job:
        """This job at ``total`` processes over its nodes (torchrun: ``total / nodes`` per node)."""
        nodes = self.nodes
        if total % nodes:
            raise HybridEPConfigError(f"{total} processes do not split over {nodes} nodes")
        if self.tool == "accelerate":
            return replace(self, flags=tuple(_set(list(self.flags), ACCELERATE["total"], str(total))))
        return replace(self, flags=tuple(_set(list(self.flags), TORCHRUN["per_node"], str(total // nodes))))

    def with_layout(self, layout: tuple[int, int] | None) -> Job:
        """This job with the script's ``--dp_degree``/``--ep_degree`` set to ``layout`` (``None``: left out, the
        engine's default)."""
        args = list(self.args)
        for name, value in zip(("--dp_degree", "--ep_degree"), layout or (None, None), strict=True):
            args = _set(args, (name,), None if value is None else str(value), at=len(args))
        return replace(self, args=tuple(args))


def _torchrun_rendezvous(flags: list[str], nodes: int) -> list[str]:
    """torchrun's flags with the c10d rendezvous at one endpoint (``--standalone`` on one node)."""
    if "--standalone" in flags:
        if nodes > 1:
            raise HybridEPConfigError(f"--standalone is one node, the command asks --nnodes {nodes}: give "
                                      "--rdzv-endpoint HOST:PORT, the same on every node, instead")
        return _set(flags, TORCHRUN["backend"], None)
    endpoint = _value(flags, TORCHRUN["endpoint"])
    if endpoint is None:
        addr, port = _value(flags, TORCHRUN["addr"]), _value(flags, TORCHRUN["port"])
        if addr is None and port is None:
            if nodes > 1:
                raise HybridEPConfigError(
                    f"--nnodes {nodes} needs the rendezvous endpoint: give --rdzv-endpoint HOST:PORT, the "
                    "same on every node (HOST: a node every node reaches, e.g. the first of the job)")
            return ["--standalone", *_set(flags, TORCHRUN["backend"], None)]
        if addr is None and nodes > 1:
            raise HybridEPConfigError(f"--master_port {port} without --master_addr on {nodes} nodes: give "
                                      "--rdzv-endpoint HOST:PORT, the same on every node")
        endpoint = f"{addr or '127.0.0.1'}:{port or 29500}"
        where = next(i for i, arg in enumerate(flags) if arg.partition("=")[0] in TORCHRUN["addr"] + TORCHRUN["port"])
        flags = _set(_set(flags, TORCHRUN["addr"], None), TORCHRUN["port"], None)
        flags = _set(flags, TORCHRUN["endpoint"], endpoint, at=where)
    return _set(flags, TORCHRUN["backend"], "c10d")


def _accelerate_rendezvous(job: Job) -> tuple[list[str], dict[str, str]]:
    """Accelerate's flags with the c10d rendezvous, and the environment it needs on one machine."""
    flags = list(job.flags)
    if "--same_network" in flags:
        raise HybridEPConfigError("accelerate launch --same_network rendezvouses statically, which cannot "
                                  "restart: leave it out (the c10d rendezvous meets at --main_process_ip:port)")
    env = {}
    if job.nodes > 1:
        missing = [flag for key, flag in (("addr", "--main_process_ip"), ("port", "--main_process_port"))
                   if job.setting(key) is None]
        if missing:
            raise HybridEPConfigError(f"accelerate launch --num_machines {job.nodes} needs "
                                      f"{' and '.join(missing)}: the rendezvous endpoint, the same on every machine")
    else:
        env["PET_STANDALONE"] = "1"  # torchrun's --standalone, which accelerate launch does not pass on
    return _set(flags, ACCELERATE["backend"], "c10d"), env


def run_id(job: Job) -> str:
    """The run id every round of ``job`` on every node runs with (see the module docstring)."""
    given = os.environ.get(RUN_ID_ENV) or (_value(list(job.flags), ("--rdzv-id", "--rdzv_id"))
                                           if job.tool == "torchrun" else None)
    if given:
        return given
    if job.nodes == 1:
        return uuid.uuid4().hex[:16]
    endpoint = (_value(list(job.flags), TORCHRUN["endpoint"]) if job.tool == "torchrun" else None) or \
        f"{job.setting('addr')}:{job.setting('port')}"
    return hashlib.sha256(f"{endpoint} {job.output_dir}".encode()).hexdigest()[:16]


def restart_command(job: Job, max_restarts: int, run: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The command that runs ``job`` with torchrun's elastic agent restarting it up to ``max_restarts`` times
    (see the module docstring), and the environment variables it needs beside the caller's (``run``: the run id,
    else :func:`run_id`)."""
    job.check()
    env = dict(STORE_ENV)
    if job.tool == "torchrun":
        flags = _set(_torchrun_rendezvous(list(job.flags), job.nodes), TORCHRUN["restarts"], str(max_restarts))
    else:
        flags, extra = _accelerate_rendezvous(job)
        flags = _set(flags, ACCELERATE["restarts"], str(max_restarts))
        env.update(extra)
    env[RUN_ID_ENV] = run or run_id(job)
    args = list(job.args)
    if _value(args, (RESUME[0],)) is None and RESUME[0] not in args:
        args += RESUME
    return [*job.head, *flags, job.script, *args], env
