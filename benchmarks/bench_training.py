"""Training throughput side by side: hybrid EP vs pure DP vs pure EP vs transformers' native EP.

One invocation trains the same Qwen3-MoE model (built from its transformers config, random weights saved
once as a safetensors checkpoint) on the same synthetic data under every layout of ``--world`` ranks and
on two fabrics:

* **flat**: all ranks in one network namespace, every byte over loopback;
* **two-node**: two network namespaces ("nodes") of ``world / 2`` ranks each, joined by a veth pair
  shaped by ``tc`` (token-bucket ``tbf`` at ``--inter-node-gbit``; ``netem`` delay of
  ``--inter-node-latency-ms`` where the kernel has it). gloo binds to the node's veth address, so traffic
  between ranks of one node goes to a local address (the kernel carries it over loopback) and only traffic
  to the other node crosses the shaped veth. Interface byte counters (``/sys/class/net``) measure both.

Each run is a fresh set of processes (one per rank) under a per-process memory limit (``RLIMIT_DATA`` set
to the process's data size after imports and process-group setup plus ``--mem-budget-mib``; default: 4.5 ×
one full replica's parameter bytes, i.e. its parameters + gradients + AdamW moments and half a replica more,
so a full replica, which also needs gradient all-reduce buffers and activations, does not fit). A run whose
ranks fail to allocate is recorded as infeasible with the error.

Per run: samples/s and tokens/s (median over timed steps after warm-up), parameter / gradient / optimizer
bytes per rank, peak RSS per rank, bytes handed to all-to-all and to the gradient collectives per step
(all-to-all split into intra- and inter-node by the split sizes), bytes measured on the inter-node link,
and the fraction of step time with a gloo collective in flight (from a ``torch.profiler`` step).

Needs root for the namespaces (``ip netns``, ``tc``); ``--fabrics flat --no-netns`` runs without.

    python benchmarks/bench_training.py --quick --json bench_training.json --chart docs/img/bench_training.png
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from regimes import REGIMES  # noqa: E402

PREFIX = "hbep-"  # every namespace and link this script creates starts with this
# Default memory budget per rank, in units of one full replica's parameter bytes: its parameters, gradients and
# two AdamW moments (4) plus half a replica for activations and communication buffers. A pure-DP rank needs the
# 4 replicas of state plus its gradient all-reduce buffers and activations, so it does not fit.
AUTO_BUDGET_REPLICAS = 4.5
# Every arm steps the same optimizer implementation (torch's fused AdamW kernel, CPU and CUDA).
OPTIMIZER = {"fused": True}


# ----------------------------------------------------------------------------------------------------------------
# what is run
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One layout to train.

    ``engine``: ``"hybrid"`` (this library; ``config`` = extra :class:`hf_hybrid_ep.HybridEPConfig` fields),
    ``"ddp"`` (torch ``DistributedDataParallel``, full replicas) or ``"hf-native"`` (transformers'
    ``DistributedConfig``; ``config`` = its fields). ``dp`` = number of distinct micro-batches per step,
    ``ep`` = expert-parallel degree. ``mem_limit=False`` runs without the memory limit (speed reference).
    """

    name: str
    engine: str
    dp: int
    ep: int
    config: dict[str, Any] = field(default_factory=dict)
    mem_limit: bool = True


def default_runs(world: int) -> list[RunSpec]:
    """Every dp × ep factorization of ``world`` with this library, DDP, and transformers' native EP layouts.

    Adding a variant is one line, e.g.
    ``RunSpec("hybrid-dp2-ep2-zero1", "hybrid", 2, 2, {"optimizer_sharding": "zero1"})``.
    """
    runs = [RunSpec(f"dp{world}", "hybrid", world, 1),
            RunSpec(f"dp{world}-unlimited", "hybrid", world, 1, mem_limit=False),
            RunSpec(f"ddp{world}", "ddp", world, 1)]
    runs += [RunSpec(f"hybrid-dp{world // ep}-ep{ep}", "hybrid", world // ep, ep)
             for ep in range(2, world) if world % ep == 0]
    runs.append(RunSpec(f"ep{world}", "hybrid", 1, world))
    # Memory scaling (issue 11): ZeRO-1 optimizer state, and FSDP2 dense weights on top of it.
    runs += [RunSpec(f"hybrid-dp2-ep{world // 2}-zero1", "hybrid", 2, world // 2, {"optimizer_sharding": "zero1"}),
             RunSpec(f"hybrid-dp2-ep{world // 2}-fsdp-zero1", "hybrid", 2, world // 2,
                     {"optimizer_sharding": "zero1", "dense_sharding": "fsdp"})]
    # Communication overlap (issue 16): every hybrid variant also with the blocking reduction, side by side.
    runs += [dataclasses.replace(r, name=f"{r.name}-blocking", config={**r.config, "overlap_grad_reduce": False})
             for r in runs if r.engine == "hybrid"]
    # The plain all-to-all in every arm, as recorded in the regime tables (auto would pick the hierarchical
    # dispatcher for pure EP on the two-node fabric; benchmarks/bench_hierarchical.py compares the two).
    runs = [dataclasses.replace(r, config={"dispatcher": "torch", **r.config}) if r.engine == "hybrid" else r
            for r in runs]
    runs.append(RunSpec(f"hf-native-fsdp{world}-ep{world}", "hf-native", world, world,
                        {"fsdp_size": world, "ep_size": world}))
    if world % 2 == 0 and world >= 4:  # HSDP: replicated across the two nodes, FSDP + EP inside a node
        half = world // 2
        runs.append(RunSpec(f"hf-native-hsdp2x{half}-ep{half}", "hf-native", world, half,
                            {"dp_replicate_size": 2, "fsdp_size": half, "ep_size": half}))
    return runs


@dataclass
class ModelArgs:
    """A Qwen3-MoE config: every layer MoE, fp32."""

    vocab_size: int = 4096
    hidden_size: int = 512
    num_hidden_layers: int = 4
    num_experts: int = 16
    moe_intermediate_size: int = 512
    num_experts_per_tok: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4

    def hf_config(self):
        from regimes import qwen3_moe_config

        return qwen3_moe_config(dataclasses.asdict(self))


@dataclass
class StepArgs:
    batch_per_rank: int = 2
    seq_len: int = 256
    warmup: int = 2
    steps: int = 5
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    mem_budget_bytes: int | None = None
    ranks_per_node: int = 4
    run_timeout_s: float = 900.0
    # token ids to train on: an ``.npz`` whose ``blocks`` is ``[N, seq_len]`` (default: uniform random ids)
    data: str | None = None
    # hybrid runs: record every timed step's top-k indices per layer (``routing_rank{r}.npz`` in the run's
    # directory) and the node-deduplicated cross-node rows ``trace_traffic`` predicts for them
    record_routing: bool = False
    # save the trained model here (a plain transformers checkpoint) after the timed steps
    save_to: str | None = None


# ----------------------------------------------------------------------------------------------------------------
# fabrics
# ----------------------------------------------------------------------------------------------------------------


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Fabric:
    """Where each rank runs and how it reaches the others. A context manager: namespaces live inside it."""

    name = "flat"
    ranks_per_node: int = 0
    info: dict[str, Any]

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def prefix(self, rank: int) -> list[str]:
        return []

    def env(self, rank: int) -> dict[str, str]:
        return {}

    def master_addr(self) -> str:
        return "127.0.0.1"

    def master_port(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


class _Namespaces:
    """Creates network namespaces (and records them) so that they are always deleted, even on failure."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def add(self, name: str) -> None:
        assert name.startswith(PREFIX)
        _sh("ip", "netns", "add", name)
        self.created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def cleanup(self) -> None:
        while self.created:
            _sh("ip", "netns", "del", self.created.pop(), check=False)  # deletes the veth ends inside it too


class FlatFabric(Fabric):
    """All ranks on loopback; inside one private namespace (so its loopback counters are ours) when
    ``netns`` (root), else in the host namespace (no byte counters)."""

    def __init__(self, world: int, netns: bool = True) -> None:
        self.world, self.netns, self.ranks_per_node = world, netns, world
        self._ns = _Namespaces()
        self.ns = f"{PREFIX}{os.getpid()}-flat"
        self.info = {"kind": "flat", "namespace": netns, "ranks_per_node": world}

    def __enter__(self) -> FlatFabric:
        if self.netns:
            try:
                self._ns.add(self.ns)
            except BaseException:
                self._ns.cleanup()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._ns.cleanup()

    def prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns] if self.netns else []

    def env(self, rank: int) -> dict[str, str]:
        env = {"GLOO_SOCKET_IFNAME": "lo"}
        if self.netns:
            env["HBEP_COUNTERS"] = "lo:intra"
        return env

    def master_port(self) -> int:
        return 29500 if self.netns else super().master_port()  # a fresh namespace has every port free


class TwoNodeFabric(Fabric):
    """Two namespaces of ``world / 2`` ranks joined by a rate-limited veth pair.

    Addressing: node n's veth end has 10.213.0.(n+1)/24; every rank binds gloo to its node's veth
    (``GLOO_SOCKET_IFNAME``). A connection to a local address is carried over loopback by the kernel,
    so intra-node pairs never touch the veth; only the other node's address routes over the veth.
    """

    name = "two-node"

    def __init__(self, world: int, gbit: float, latency_ms: float) -> None:
        if world % 2:
            raise ValueError(f"two-node fabric needs an even world size, got {world}")
        self.world, self.gbit, self.latency_ms = world, gbit, latency_ms
        self.ranks_per_node = world // 2
        tag = f"{PREFIX}{os.getpid() % 10**7}"
        self.ns = [f"{tag}-n0", f"{tag}-n1"]
        self.veth = [f"{tag}a", f"{tag}b"]  # <= 15 characters (IFNAMSIZ)
        self.addr = ["10.213.0.1", "10.213.0.2"]
        self._ns = _Namespaces()
        self.info = {"kind": "two-node", "ranks_per_node": self.ranks_per_node, "inter_node_gbit": gbit,
                     "inter_node_latency_ms_requested": latency_ms}

    def __enter__(self) -> TwoNodeFabric:
        try:
            self._setup()
        except BaseException:
            self._ns.cleanup()
            _sh("ip", "link", "del", self.veth[0], check=False)
            raise
        return self

    def _setup(self) -> None:
        for ns in self.ns:
            self._ns.add(ns)
        _sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        for ns, dev, addr in zip(self.ns, self.veth, self.addr, strict=True):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        rate = f"{self.gbit}gbit"
        burst = max(64 * 1024, int(self.gbit * 1e9 / 8 / 1000))  # >= one timer tick (1 ms) of traffic
        latency = "unavailable"
        for ns, dev in zip(self.ns, self.veth, strict=True):  # shape both directions
            tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
            netem = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                        "netem", "delay", f"{self.latency_ms}ms", check=False) if self.latency_ms > 0 else None
            if netem is not None and netem.returncode == 0:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "10:", *tbf)
                latency = f"netem delay {self.latency_ms}ms"
            else:
                if netem is not None:
                    latency = f"not emulated: netem failed ({netem.stderr.strip()})"
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)
        self.info["latency_emulation"] = latency
        self.info["tc"] = _sh("ip", "netns", "exec", self.ns[0], "tc", "qdisc", "show", "dev", self.veth[0]).stdout.strip()
        self.info.update(self._measure_link())

    def _measure_link(self) -> dict[str, float]:
        """Bulk TCP throughput and round-trip time from node 1 to node 0 over the shaped veth."""
        server = subprocess.Popen(["ip", "netns", "exec", self.ns[0], sys.executable, "-c", _LINK_SERVER, self.addr[0]],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            out = _sh("ip", "netns", "exec", self.ns[1], sys.executable, "-c", _LINK_CLIENT, self.addr[0]).stdout
            return json.loads(out)
        finally:
            server.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        self._ns.cleanup()

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[self.node(rank)]]

    def env(self, rank: int) -> dict[str, str]:
        dev = self.veth[self.node(rank)]
        return {"GLOO_SOCKET_IFNAME": dev, "HBEP_COUNTERS": f"lo:intra,{dev}:inter"}

    def master_addr(self) -> str:
        return self.addr[0]

    def master_port(self) -> int:
        return 29500


_LINK_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 29400)); print("ready", flush=True)
c, _ = s.accept()
for _ in range(20):
    c.recv(1); c.sendall(b"x")
n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b"k"); c.close()
"""
_LINK_CLIENT = """
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 29400))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtt.append(time.perf_counter() - t)
data = b"\\0" * (1 << 20); n = 32
t = time.perf_counter()
for _ in range(n): c.sendall(data)
c.shutdown(socket.SHUT_WR); c.recv(1)
dt = time.perf_counter() - t
print(json.dumps({"measured_gbit": n * len(data) * 8 / dt / 1e9, "measured_rtt_ms": statistics.median(rtt) * 1e3}))
"""


# ----------------------------------------------------------------------------------------------------------------
# one run: processes
# ----------------------------------------------------------------------------------------------------------------


THREAD_STACK_BYTES = 2 * 2**20


def _small_thread_stacks() -> None:
    """glibc takes the default stack of new threads from RLIMIT_STACK (8 MiB here). Thread stacks count
    against RLIMIT_DATA, and gloo starts threads per process group, so lower it to keep the memory limit
    about tensors rather than about how many groups a layout creates."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (THREAD_STACK_BYTES, hard))


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces this script left behind in an earlier run that was killed (``hbep-<pid>-…`` whose
    process no longer exists). Never touches a name without the prefix or of a live process."""
    removed = []
    listing = _sh("ip", "netns", "list", check=False).stdout.split()
    for name in listing:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def run_layout(spec: RunSpec, fabric: Fabric, ckpt: str, step: StepArgs, world: int, workdir: str) -> dict:
    """Train ``spec`` on ``fabric`` with ``world`` fresh processes; return the merged per-run record."""
    out = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=workdir))
    payload = {"spec": dataclasses.asdict(spec), "step": dataclasses.asdict(step) | {"ranks_per_node": fabric.ranks_per_node},
               "ckpt": ckpt, "out": str(out)}
    (out / "job.json").write_text(json.dumps(payload))
    port = fabric.master_port()
    procs = []
    for rank in range(world):
        env = os.environ | {
            "RANK": str(rank), "LOCAL_RANK": str(rank % fabric.ranks_per_node), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(fabric.ranks_per_node), "MASTER_ADDR": fabric.master_addr(),
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # glibc serves every block of 128 KiB or more by mmap and unmaps it on free (its initial setting,
            # made fixed), so the data size that RLIMIT_DATA limits follows the live tensors rather than the
            # heap's high-water mark. Same for every run; it costs some page faults per step.
            "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])),
        } | fabric.env(rank)
        cmd = [*fabric.prefix(rank), sys.executable, str(Path(__file__).resolve()), "--worker", str(out / "job.json")]
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_small_thread_stacks))
    start = time.monotonic()
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # give the others a moment to record their own error, then stop them
            if (failed_at is not None and now - failed_at > 20) or now - start > step.run_timeout_s:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    ranks = []
    for rank, p in enumerate(procs):
        f = out / f"rank{rank}.json"
        if f.exists():
            ranks.append(json.loads(f.read_text()))
        else:
            tail = (out / f"rank{rank}.log").read_text()[-600:]
            ranks.append({"rank": rank, "status": "error", "error": f"exit code {p.returncode}, no result; log tail: {tail}"})
    return merge(spec, fabric, ranks, step)


def merge(spec: RunSpec, fabric: Fabric, ranks: list[dict], step: StepArgs) -> dict:
    """Per-rank records → one run record (schema of issue 9 plus breakdowns)."""
    ok = all(r.get("status") == "ok" for r in ranks)
    oom = [r for r in ranks if r.get("status") == "out_of_memory"]
    rec: dict[str, Any] = {
        "name": spec.name, "fabric": fabric.name, "engine": spec.engine, "dp": spec.dp, "ep": spec.ep,
        "config": spec.config, "feasible": ok, "mem_limited": spec.mem_limit,
        "status": "ok" if ok else ("out_of_memory" if oom else "error"),
        "mem_limit_bytes": (ranks[0].get("mem_limit_bytes") if ranks else None) if spec.mem_limit else None,
    }
    if not ok:
        bad = oom[0] if oom else next(r for r in ranks if r.get("status") != "ok")
        rec["error"] = f"rank {bad.get('rank')}: {bad.get('error')}"
        rec["traceback_tail"] = (bad.get("traceback") or "")[-1500:]
        rec["failed_phase"] = bad.get("phase")
        for key in ("samples_per_s", "tokens_per_s", "comm_fraction", "a2a_bytes_per_step", "allreduce_bytes_per_step",
                    "inter_node_bytes_per_step", "exposed_comm_fraction", "exposed_comm_s_per_step"):
            rec[key] = None
        known = [r for r in ranks if "param_bytes" in r]
        rec["param_bytes_per_rank"] = max(r["param_bytes"] for r in known) if known else None
        rss = [r.get("peak_rss_bytes") for r in ranks if r.get("peak_rss_bytes")]
        rec["peak_rss_bytes_per_rank"] = max(rss) if rss else None
        return rec
    step_s = statistics.median(max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"])))
    samples = len(ranks) * step.batch_per_rank * step.grad_accum  # every rank reads its own micro-batches
    mean = lambda key: sum(r[key] for r in ranks) / len(ranks)  # noqa: E731
    node_leads = [r for r in ranks if r.get("counters")]
    wire = defaultdict(int)
    for r in node_leads:
        for kind, value in r["counters"].items():
            wire[kind] += value
    steps = len(ranks[0]["step_times"])
    inter = wire.get("inter") if fabric.name == "two-node" else 0
    rec |= {
        "samples_per_s": samples / step_s, "tokens_per_s": samples * step.seq_len / step_s, "step_s": step_s,
        "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
        "grad_bytes_per_rank": max(r["grad_bytes"] for r in ranks),
        "optimizer_bytes_per_rank": max(r["optimizer_bytes"] for r in ranks),
        "param_bytes_each_rank": [r["param_bytes"] for r in ranks],
        "peak_rss_bytes_per_rank": max(r["peak_rss_bytes"] for r in ranks),
        "peak_rss_bytes_each_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_data_bytes_above_setup_per_rank": max(r["peak_data_above_setup"] for r in ranks),
        "rss_bytes_at_setup": max(r["rss_at_setup"] for r in ranks),
        "a2a_bytes_per_step": round(mean("a2a_remote_bytes") / steps),
        "a2a_intra_node_bytes_per_step": round(mean("a2a_intra_bytes") / steps),
        "a2a_inter_node_bytes_per_step": round(mean("a2a_inter_bytes") / steps),
        "allreduce_bytes_per_step": round(mean("reduce_bytes") / steps),
        "collective_bytes_by_op_per_step": {k: round(sum(r["bytes_by_op"].get(k, 0) for r in ranks) / len(ranks) / steps)
                                            for k in sorted({k for r in ranks for k in r["bytes_by_op"]})},
        "inter_node_bytes_per_step": round(inter / steps) if inter is not None else None,
        "intra_node_wire_bytes_per_step": round(wire["intra"] / steps) if node_leads else None,
        # cross-node wire bytes not explained by token rows: gradient / parameter collectives, counts, framing
        "inter_node_non_a2a_wire_bytes_per_step": (round((inter - sum(r["a2a_inter_bytes"] for r in ranks)) / steps)
                                                   if inter is not None else None),
        "comm_fraction": max(r["comm_fraction"] for r in ranks),
        # exposed communication: the training thread blocked in collectives or Work.wait(), per step, over the
        # step time of the slowest rank (the worst rank's figure)
        "exposed_comm_s_per_step": max(r["blocked_s"] for r in ranks) / steps,
        "exposed_comm_fraction": max(r["blocked_s"] for r in ranks) / steps / step_s,
        "exposed_comm_by_op_s_per_step": {k: round(max(r["blocked_by_op"].get(k, 0.0) for r in ranks) / steps, 4)
                                          for k in sorted({k for r in ranks for k in r["blocked_by_op"]})},
        "backward_after_first_bucket_s": (statistics.median(r["engine_counters"]["ready_to_end_s_per_step"]
                                                            for r in ranks) if ranks[0].get("engine_counters") else None),
        "comm_seconds_by_op": ranks[0]["comm_seconds_by_op"],
        "profiled_step_s": ranks[0]["profiled_step_s"],
        "profile_top_ops": ranks[0]["profile_top_ops"],
        "engine_counters": ranks[0].get("engine_counters"),
        "notes": sorted({n for r in ranks for n in r.get("notes", [])}),
    }
    if ranks[0].get("engine_counters"):  # every rank's token-exchange rows and bytes by phase, summed
        phases = [r["engine_counters"]["phases_per_step"] for r in ranks]
        rec["phases_per_step_all_ranks"] = {p: {k: sum(x[p][k] for x in phases) for k in phases[0][p]}
                                            for p in phases[0]}
    if all("routing" in r for r in ranks):
        rec["routing"] = {"predicted_cross_node_rows_per_step": sum(r["routing"]["predicted_cross_node_rows"]
                                                                    for r in ranks) / steps,
                          "trace_files": [r["routing"]["trace_file"] for r in ranks],
                          "tables": ranks[0]["routing"]["tables"]}
    return rec


# ----------------------------------------------------------------------------------------------------------------
# one run: inside a rank
# ----------------------------------------------------------------------------------------------------------------


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _vm_data() -> int:
    """Private writable virtual memory of this process: what RLIMIT_DATA limits."""
    return _status_bytes("VmData")


def _counters() -> dict[str, int]:
    """Bytes sent on this namespace's interfaces named in HBEP_COUNTERS (``dev:kind,...``). Summed over the
    nodes, every byte that crossed a link is counted once (what one end sends, the other receives)."""
    out: dict[str, int] = {}
    for item in filter(None, os.environ.get("HBEP_COUNTERS", "").split(",")):
        dev, kind = item.split(":")
        base = Path("/sys/class/net") / dev / "statistics"
        value = int((base / "tx_bytes").read_text())
        out[kind] = out.get(kind, 0) + value
    return out


class CollectiveMeter:
    """Counts bytes handed to torch.distributed collectives (patched module attributes, pass-through).

    all-to-all: remote bytes of token rows sent (own rows excluded), split into peers on this node and on
    other nodes; the small integer count exchanges are tallied apart (``all_to_all_counts``).
    Everything else (all-reduce, all-gather, reduce-scatter, broadcast): the largest tensor handed to the call.
    transformers' native EP exchanges tokens with ``all_to_all_single_autograd`` (functional collectives,
    backward in C++): its forward is counted here and its backward, the reverse exchange of the same rows,
    is counted as the same bytes again.
    """

    REDUCE_NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                    "reduce_scatter_single", "broadcast")

    def __init__(self, rank: int, ranks_per_node: int) -> None:
        self.rank, self.per_node = rank, ranks_per_node
        self.reset()

    def reset(self) -> None:
        self.a2a_remote = self.a2a_intra = self.a2a_inter = self.reduce = 0
        self.by_op: dict[str, int] = defaultdict(int)
        self.blocked_s = 0.0  # training thread inside a collective call or a ``Work.wait()``
        self.depth = 0
        self.blocked_by_op: dict[str, float] = defaultdict(float)

    def timed(self, name: str, fn, *a, **k):
        """Call a collective, timing the call (its handle's ``wait()`` is timed by the patched ``Work.wait``)."""
        t = time.perf_counter()
        self.depth += 1  # a blocking call waits on its own handle inside: counted once, here
        try:
            out = fn(*a, **k)
        finally:
            self.depth -= 1
            dt = time.perf_counter() - t
            if self.depth == 0:
                self.blocked_s += dt
                self.blocked_by_op[name] += dt
        return out

    def _a2a(self, tensor, out_splits, in_splits, group, times: int = 1) -> None:
        import torch
        import torch.distributed as dist

        if tensor.dtype in (torch.int64, torch.int32):  # the per-expert row counts sent ahead of the tokens
            self.by_op["all_to_all_counts"] += tensor.numel() * tensor.element_size() * times
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        rows = tensor.shape[0] if tensor.dim() else tensor.numel()
        splits = list(in_splits) if in_splits else [rows // len(ranks)] * len(ranks)
        row_bytes = tensor[0:1].numel() * tensor.element_size() if tensor.dim() else tensor.element_size()
        for peer, n in zip(ranks, splits, strict=True):
            if peer == self.rank:
                continue
            b = int(n) * row_bytes * times
            self.a2a_remote += b
            if peer // self.per_node == self.rank // self.per_node:
                self.a2a_intra += b
            else:
                self.a2a_inter += b
        self.by_op["all_to_all"] += sum(int(n) for peer, n in zip(ranks, splits, strict=True) if peer != self.rank) \
            * row_bytes * times

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        meter = self
        orig_a2a = dist.all_to_all_single
        work_cls = torch._C._distributed_c10d.Work
        orig_wait = work_cls.wait

        def wait(work, *a, **k):  # every asynchronous collective's wait, whoever launched it
            if meter.depth:
                return orig_wait(work, *a, **k)
            t = time.perf_counter()
            try:
                return orig_wait(work, *a, **k)
            finally:
                dt = time.perf_counter() - t
                meter.blocked_s += dt
                meter.blocked_by_op["Work.wait"] += dt

        work_cls.wait = wait

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *a, **k):
            meter._a2a(input, output_split_sizes, input_split_sizes, group)
            name = "all_to_all_counts" if input.dtype in (torch.int64, torch.int32) else "all_to_all"
            return meter.timed(name, orig_a2a, output, input, output_split_sizes, input_split_sizes, group, *a, **k)

        dist.all_to_all_single = all_to_all_single
        for name in self.REDUCE_NAMES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue

            def wrapped(*a, __orig=orig, __name=name, **k):
                sizes = [t.numel() * t.element_size() for t in (*a, *k.values()) if isinstance(t, torch.Tensor)]
                b = max(sizes, default=0)
                meter.reduce += b
                meter.by_op[__name] += b
                return meter.timed(__name, __orig, *a, **k)

            setattr(dist, name, wrapped)
        try:
            import transformers.distributed.expert_parallel as hf_ep
        except ImportError:
            return
        orig_auto = hf_ep.all_to_all_single_autograd

        def all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, group, *a, **k):
            meter._a2a(input, output_split_sizes, input_split_sizes, group, times=2 if input.requires_grad else 1)
            # functional collective: the wait happens at first use, inside other ops (and its backward in C++),
            # so only the call itself is timed here
            return meter.timed("all_to_all_functional", orig_auto, input, output_split_sizes, input_split_sizes,
                               group, *a, **k)

        hf_ep.all_to_all_single_autograd = all_to_all_single_autograd
        hf_ep.all_to_all_single = all_to_all_single


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _is_oom(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, MemoryError) or any(s in text for s in (
        "can't allocate memory", "DefaultCPUAllocator", "std::bad_alloc", "Cannot allocate memory", "out of memory"))


def _build(spec: dict, ckpt: str, step: dict, notes: list[str]):
    """→ (model, optimizer, clip() callable, no_sync() context factory for gradient-accumulation steps)."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_hybrid_ep as hep

    engine = spec["engine"]
    if engine == "hybrid":
        cfg = hep.HybridEPConfig(dp_degree=spec["dp"], ep_degree=spec["ep"], **spec["config"])
        model = hep.from_pretrained(ckpt, cfg)
        model.train()
        opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=step["lr"], **OPTIMIZER)  # zero1 if set
        return model, opt, lambda: hep.clip_grad_norm_(model, step["max_grad_norm"]), lambda: hep.no_sync(model)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=step["lr"], **OPTIMIZER)
        return (model, opt, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), step["max_grad_norm"]),
                model.no_sync)
    if engine == "hf-native":
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(**spec["config"]))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=step["lr"], **OPTIMIZER)


        @contextlib.contextmanager
        def no_sync():  # FSDP2: skip reduce-scatter / all-reduce of gradients on this backward
            modules = [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]
            for m in modules:
                m.set_requires_gradient_sync(False, recurse=False)
            try:
                yield
            finally:
                for m in modules:
                    m.set_requires_gradient_sync(True, recurse=False)

        return model, opt, lambda: _clip_mixed_meshes(model, step["max_grad_norm"]), no_sync
    raise ValueError(f"unknown engine {engine!r}")


def _clip_mixed_meshes(model, max_norm: float):
    """Global-norm clipping for transformers' native EP, whose dense and expert DTensors live on two meshes
    (``torch.nn.utils.clip_grad_norm_`` refuses to stack them): one norm per mesh, combined."""
    import torch

    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict[Any, list] = defaultdict(list)
    for p in params:
        groups[getattr(p.grad, "device_mesh", None)].append(p.grad)
    sq = torch.zeros(())
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        sq = sq + (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total


def _data_batches(path: str, shape: tuple[int, int, int], count: int, rank: int, world: int) -> list:
    """``count`` batches of ``shape`` token ids from the ``blocks`` of an ``.npz``, each rank its own rows."""
    import numpy as np
    import torch

    blocks = np.load(path)["blocks"]
    accum, batch, seq = shape
    if blocks.shape[1] < seq:
        raise ValueError(f"{path}: blocks of {blocks.shape[1]} tokens, shorter than seq_len={seq}")
    per = accum * batch
    out = []
    for i in range(count):
        start = ((i * world + rank) * per) % max(1, len(blocks) - per)
        out.append(torch.as_tensor(blocks[start : start + per, :seq], dtype=torch.long).reshape(shape))
    return out


class _RoutingRecorder:
    """Top-k indices of every MoE layer while ``on`` (after capacity drops: what the dispatcher routes)."""

    def __init__(self, model) -> None:
        import hf_hybrid_ep

        self.state = hf_hybrid_ep.state_of(model)
        self.on = False
        self.traces: dict[str, list] = defaultdict(list)
        for layer in self.state.layers:
            def count(index, dropped=0, _original=layer.routing.count, _name=layer.name):
                if self.on:
                    self.traces[_name].append(index.detach().reshape(-1, index.shape[-1]).clone())
                _original(index, dropped)

            layer.routing.count = count

    def finish(self, path: Path, ranks_per_node: int) -> dict[str, Any]:
        """Save the traces; return the predicted cross-node node rows (one direction) and the tables."""
        import numpy as np
        import torch

        from hf_hybrid_ep.placement import trace_traffic

        mesh = self.state.mesh
        topology = mesh.topology if mesh.topology is not None else f"gpus_per_node={ranks_per_node}"
        arrays = {name: torch.cat(parts).numpy() for name, parts in self.traces.items()}
        np.savez_compressed(path, **arrays)
        tables = {layer.name: layer.table for layer in self.state.layers}
        predicted = sum(trace_traffic([a], tables[name], topology, sources=[mesh.ep_rank])["cross_node"]
                        for name, a in arrays.items())
        return {"trace_file": str(path), "predicted_cross_node_rows": predicted,
                "tokens": sum(len(a) for a in arrays.values()),
                "tables": {name: [list(r) for r in t.rows] for name, t in tables.items()}}


def worker(job_path: str) -> None:
    """One rank of one run: writes ``rank{RANK}.json`` into the job's directory."""
    job = json.loads(Path(job_path).read_text())
    spec, step, ckpt, out = job["spec"], job["step"], job["ckpt"], Path(job["out"])
    rank = int(os.environ["RANK"])
    rec: dict[str, Any] = {"rank": rank, "status": "ok", "phase": "setup", "notes": []}

    def finish(code: int) -> None:
        rec.setdefault("peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        tmp = out / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(rec))
        tmp.rename(out / f"rank{rank}.json")
        sys.stdout.flush()
        os._exit(code)  # never wait in a collective for a rank that has failed

    try:
        import datetime

        import torch
        import torch.distributed as dist
        import transformers.distributed.expert_parallel  # noqa: F401  (so the meter can wrap it)

        import hf_hybrid_ep  # noqa: F401

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        meter = CollectiveMeter(rank, step["ranks_per_node"])
        meter.install()
        base_data = _vm_data()
        rec["rss_at_setup"] = _status_bytes("VmRSS")
        peak = [base_data]
        if spec["mem_limit"] and step["mem_budget_bytes"]:
            limit = base_data + step["mem_budget_bytes"]
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
            rec["mem_limit_bytes"] = step["mem_budget_bytes"]
        rec["phase"] = "load"
        model, opt, clip, no_sync = _build(spec, ckpt, step, rec["notes"])
        rec["param_bytes"] = _nbytes(model.parameters())  # FSDP: this rank's shard
        g = torch.Generator().manual_seed(1234 + rank)
        vocab = model.config.vocab_size if hasattr(model, "config") else model.module.config.vocab_size
        n_batches = step["warmup"] + step["steps"] + 1
        shape = (step["grad_accum"], step["batch_per_rank"], step["seq_len"])
        if step.get("data"):
            batches = _data_batches(step["data"], shape, n_batches, rank, dist.get_world_size())
        else:
            batches = [torch.randint(0, vocab, shape, generator=g) for _ in range(n_batches)]
        recorder = _RoutingRecorder(model) if step.get("record_routing") and spec["engine"] == "hybrid" else None

        def train_step(micro_batches, zero: bool = True) -> None:
            for j, ids in enumerate(micro_batches):  # gradients synchronized on the last micro-batch only
                with no_sync() if j < len(micro_batches) - 1 else contextlib.nullcontext():
                    (model(input_ids=ids, labels=ids).loss / len(micro_batches)).backward()
            peak.append(_vm_data())
            clip()
            opt.step()
            peak.append(_vm_data())
            rec["peak_data_above_setup"] = max(peak) - base_data
            if zero:
                opt.zero_grad(set_to_none=True)

        rec["phase"] = "train"
        for i in range(step["warmup"]):
            train_step(batches[i])
        dist.barrier()
        meter.reset()
        if spec["engine"] == "hybrid":
            hf_hybrid_ep.reset_comm_stats(model)
        c0 = _counters()
        times = []
        if recorder is not None:
            recorder.on = True
        for i in range(step["steps"]):
            t = time.perf_counter()
            train_step(batches[step["warmup"] + i])
            dist.barrier()
            times.append(time.perf_counter() - t)
        c1 = _counters()
        if recorder is not None:
            recorder.on = False
            rec["routing"] = recorder.finish(out / f"routing_rank{rank}.npz", step["ranks_per_node"])
        rec["step_times"] = times
        rec["a2a_remote_bytes"], rec["a2a_intra_bytes"], rec["a2a_inter_bytes"] = meter.a2a_remote, meter.a2a_intra, meter.a2a_inter
        rec["reduce_bytes"], rec["bytes_by_op"] = meter.reduce, dict(meter.by_op)
        rec["blocked_s"], rec["blocked_by_op"] = meter.blocked_s, dict(meter.blocked_by_op)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and c0:
            rec["counters"] = {k: c1[k] - c0[k] for k in c0}
        if spec["engine"] == "hybrid":
            from hf_hybrid_ep.dispatch.stats import PHASES

            stats = hf_hybrid_ep.comm_stats(model)
            red = stats["gradient_reduction"]
            rec["engine_counters"] = {
                "a2a_remote_bytes_sent_per_step": sum(
                    v[p]["remote_bytes_sent"] for k, v in stats.items() if k != "gradient_reduction"
                    for p in PHASES) // step["steps"],
                "allreduce_dense_bytes_per_step": red["dense_bytes"] // step["steps"],
                "allreduce_expert_bytes_per_step": red["expert_bytes"] // step["steps"],
                "ready_to_end_s_per_step": red["ready_to_end_s"] / step["steps"],
                "buckets_launched_in_backward_per_step": red["buckets_launched_in_backward"] / step["steps"],
                # every phase of the token exchange (the hierarchical dispatcher's cross-node stage is "*_inter")
                "phases_per_step": {p: {key: sum(v[p][key] for k, v in stats.items() if k != "gradient_reduction")
                                        // step["steps"] for key in ("remote_rows_sent", "remote_bytes_sent")}
                                    for p in PHASES},
            }
        # one profiled step: time with a gloo collective in flight, and where the rest goes. Memory figures are
        # taken before it, and the limit lifted for it: the profiler's own event records are not training.
        from torch.profiler import ProfilerActivity, profile, record_function

        rec["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_data = rec["peak_data_above_setup"]
        resource.setrlimit(resource.RLIMIT_DATA, resource.getrlimit(resource.RLIMIT_DATA)[1:] * 2)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("bench_step"):
                train_step(batches[-1], zero=False)
                dist.barrier()
        rec["peak_data_above_setup"] = peak_data
        rec.update(_comm_profile(prof))
        rec["grad_bytes"] = _nbytes(p.grad for p in model.parameters() if p.grad is not None)
        rec["optimizer_bytes"] = _nbytes(t for s in opt.state.values() for t in s.values()
                                         if isinstance(t, torch.Tensor) and t.dim() > 0)
        if step.get("save_to"):
            model.save_pretrained(step["save_to"])  # collective: the experts are gathered; rank 0 writes
        rec["phase"] = "done"
        dist.barrier()
        dist.destroy_process_group()
        finish(0)
    except BaseException as exc:  # noqa: BLE001  (recorded, then the process ends)
        import traceback

        rec["status"] = "out_of_memory" if _is_oom(exc) else "error"
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        print(rec["traceback"], file=sys.stderr)
        finish(3)


def _comm_profile(prof) -> dict[str, Any]:
    """Union of gloo collective intervals inside the ``bench_step`` range, by op and in total."""
    events = list(prof.events())
    step = next(e for e in events if e.name == "bench_step")
    s0, s1 = step.time_range.start, step.time_range.end
    intervals, by_op = [], defaultdict(float)
    for e in events:
        if e.name.startswith("gloo:"):
            a, b = max(e.time_range.start, s0), min(e.time_range.end, s1)
            if b > a:
                intervals.append((a, b))
                by_op[e.name[5:]] += (b - a) / 1e6
    intervals.sort()
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in intervals:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    total = (s1 - s0)
    top = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()), key=lambda kv: -kv[1])[:12]
    return {"comm_fraction": busy / total if total else 0.0, "profiled_step_s": total / 1e6,
            "comm_seconds_by_op": dict(by_op), "profile_top_ops": [[k, round(v, 4)] for k, v in top]}


# ----------------------------------------------------------------------------------------------------------------
# the whole benchmark
# ----------------------------------------------------------------------------------------------------------------


def model_bytes(model_args: ModelArgs) -> dict[str, int]:
    """Exact fp32 bytes of the dense part and of all routed experts (from the model on the meta device)."""
    from hf_hybrid_ep.planner import count_parameters

    counts = count_parameters(model_args.hf_config())
    return {"dense_bytes": 4 * counts.dense_params, "expert_bytes": 4 * counts.expert_params,
            "total_bytes": 4 * counts.total_params}


def save_checkpoint(model_args: ModelArgs, path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_args.hf_config()).save_pretrained(path)


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_avg_at_start": os.getloadavg()}


def check_param_formula(runs: list[dict], sizes: dict[str, int]) -> list[str]:
    """Hybrid (dp, ep): parameter bytes on every rank == dense + experts / ep, exactly."""
    failures = []
    for r in runs:
        if r["engine"] != "hybrid" or not r.get("param_bytes_each_rank"):
            continue
        if r.get("config", {}).get("dense_sharding") == "fsdp":  # dense sharded: not dense + experts/ep
            continue
        want = sizes["dense_bytes"] + sizes["expert_bytes"] // r["ep"]
        r["param_bytes_formula_ok"] = all(b == want for b in r["param_bytes_each_rank"])
        if not r["param_bytes_formula_ok"]:
            failures.append(f"{r['fabric']}/{r['name']}: {r['param_bytes_each_rank']} != {want}")
    return failures


def goals(runs: list[dict]) -> dict[str, Any]:
    """Issue 9 point 5, as measured ratios (reported whether met or not)."""
    out: dict[str, Any] = {}
    for fabric in sorted({r["fabric"] for r in runs}):
        # layouts that ran under the memory limit (a speed reference without it is not a candidate)
        rs = [r for r in runs if r["fabric"] == fabric and r["feasible"] and r.get("mem_limited", True)]
        ours = [r for r in rs if r["engine"] == "hybrid"]
        hybrid = [r for r in ours if r["dp"] > 1 and r["ep"] > 1]
        pure_ep = [r for r in ours if r["dp"] == 1]
        native = [r for r in rs if r["engine"] == "hf-native"]
        dp_param = max((r["param_bytes_per_rank"] for r in runs if r["fabric"] == fabric and r["ep"] == 1
                        and r["engine"] == "hybrid" and r["param_bytes_per_rank"]), default=None)
        g: dict[str, Any] = {}
        if hybrid and pure_ep:
            best = max(hybrid, key=lambda r: r["samples_per_s"])
            g["hybrid_best"] = best["name"]
            g["hybrid_best_vs_pure_ep"] = best["samples_per_s"] / pure_ep[0]["samples_per_s"]
            if fabric == "two-node":
                g["goal_hybrid_ge_1.3x_pure_ep"] = g["hybrid_best_vs_pure_ep"] >= 1.3
        if ours:
            best = max(ours, key=lambda r: r["samples_per_s"])
            g["ours_best"] = best["name"]
            if native:
                top = max(native, key=lambda r: r["samples_per_s"])
                g["ours_best_vs_native_best"] = best["samples_per_s"] / top["samples_per_s"]
                g["native_best"] = top["name"]
                g["goal_not_slower_than_native"] = g["ours_best_vs_native_best"] >= 1.0
            if dp_param:
                g["ours_best_param_bytes_vs_dp"] = best["param_bytes_per_rank"] / dp_param
                g["goal_param_bytes_le_dp"] = best["param_bytes_per_rank"] <= dp_param
        out[fabric] = g
    return out


def overlap_goals(runs: list[dict], fabrics: dict[str, dict]) -> dict[str, Any]:
    """Issue 16 point 7, as measured (reported whether met or not): overlap vs the blocking path of the same
    layout, exposed link time of two-node hybrid against what overlap can hide, and ours vs native EP."""
    out: dict[str, Any] = {}
    for fabric in sorted({r["fabric"] for r in runs}):
        rs = {r["name"]: r for r in runs if r["fabric"] == fabric and r["feasible"]}
        g: dict[str, Any] = {"overlap_vs_blocking": {
            name: r["samples_per_s"] / rs[name + "-blocking"]["samples_per_s"]
            for name, r in rs.items() if name + "-blocking" in rs}}
        world = max((r["dp"] * r["ep"] for r in rs.values() if r["engine"] == "hybrid"), default=0)
        ep_name = f"ep{world}"
        if ep_name in g["overlap_vs_blocking"]:
            g["goal_pure_ep_overlap_ge_0.95x_blocking"] = g["overlap_vs_blocking"][ep_name] >= 0.95
        hybrid = rs.get(f"hybrid-dp2-ep{world // 2}")
        if fabric == "two-node" and hybrid is not None:
            rate = fabrics.get(fabric, {}).get("measured_gbit")
            link_s = hybrid["inter_node_bytes_per_step"] * 8 / (rate * 1e9) if rate else None
            b = hybrid.get("backward_after_first_bucket_s")
            g["hybrid_L_link_s"], g["hybrid_B_backward_after_first_bucket_s"] = link_s, b
            g["hybrid_exposed_comm_s"] = hybrid["exposed_comm_s_per_step"]
            if link_s is not None and b is not None:
                allowed = 1.2 * max(0.0, link_s - b)
                g["hybrid_exposed_allowed_s"] = allowed
                g["goal_hybrid_exposed_le_1.2x_(L-B)"] = hybrid["exposed_comm_s_per_step"] <= allowed
            ratio = g["overlap_vs_blocking"].get(hybrid["name"])
            if ratio is not None:
                g["goal_two_node_hybrid_overlap_ge_1.15x_blocking"] = ratio >= 1.15
        limited = [r for r in rs.values() if r.get("mem_limited", True)]
        ours = [r for r in limited if r["engine"] == "hybrid"]
        native = [r for r in limited if r["engine"] == "hf-native"]
        if ours and native:
            best, top = (max(x, key=lambda r: r["samples_per_s"]) for x in (ours, native))
            g["ours_best"], g["native_best"] = best["name"], top["name"]
            g["ours_best_vs_native_best"] = best["samples_per_s"] / top["samples_per_s"]
            g["goal_ours_ge_1.5x_native"] = g["ours_best_vs_native_best"] >= 1.5
        out[fabric] = g
    return out


def table(runs: list[dict]) -> str:
    mib = lambda b: "–" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = ["| fabric | run | dp×ep | feasible | samples/s | tokens/s | param MiB/rank | param+grad+opt MiB/rank | "
             "peak RSS MiB/rank | a2a MiB/step (inter) | grad-sync MiB/step | inter-node wire MiB/step | comm in flight | "
             "exposed comm |",
             "|" + "---|" * 14]
    for r in runs:
        if r["feasible"]:
            state = r["param_bytes_per_rank"] + r["grad_bytes_per_rank"] + r["optimizer_bytes_per_rank"]
            lines.append(
                f"| {r['fabric']} | {r['name']} | {r['dp']}×{r['ep']} | yes | {r['samples_per_s']:.2f} | "
                f"{r['tokens_per_s']:.0f} | {mib(r['param_bytes_per_rank'])} | {mib(state)} | "
                f"{mib(r['peak_rss_bytes_per_rank'])} | {mib(r['a2a_bytes_per_step'])} "
                f"({mib(r['a2a_inter_node_bytes_per_step'])}) | {mib(r['allreduce_bytes_per_step'])} | "
                f"{mib(r['inter_node_bytes_per_step'])} | {r['comm_fraction']:.2f} | {r['exposed_comm_fraction']:.2f} |")
        else:
            lines.append(f"| {r['fabric']} | {r['name']} | {r['dp']}×{r['ep']} | **no** ({r['status']}) | – | – | "
                         f"{mib(r['param_bytes_per_rank'])} | – | {mib(r['peak_rss_bytes_per_rank'])} | – | – | – | – | – |")
    return "\n".join(lines)


def chart(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fabrics = sorted({r["fabric"] for r in runs}, key=lambda f: f != "flat")
    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    width = 0.8 / max(len(fabrics), 1)
    for k, fabric in enumerate(fabrics):
        by = {r["name"]: r for r in runs if r["fabric"] == fabric}
        xs = [i + k * width for i in range(len(names))]
        sps = [by[n]["samples_per_s"] if n in by and by[n]["feasible"] else 0 for n in names]
        axes[0].bar(xs, sps, width, label=fabric)
        for x, n in zip(xs, names, strict=True):
            if n in by and not by[n]["feasible"]:
                axes[0].text(x, 0, "OOM" if by[n]["status"] == "out_of_memory" else "fail", rotation=90,
                             ha="center", va="bottom", fontsize=8)
        cf = [by[n]["comm_fraction"] if n in by and by[n]["feasible"] else 0 for n in names]
        axes[2].bar(xs, cf, width, label=fabric)
        if k == 0:
            pb = [(by[n]["param_bytes_per_rank"] or 0) / 2**20 if n in by else 0 for n in names]
            axes[1].bar(range(len(names)), pb, 0.6, color="gray")
    for ax, label in zip(axes, ("samples/s (higher is better)", "parameter MiB per rank", "fraction of step in collectives"),
                         strict=True):
        ax.set_xticks([i + width * (len(fabrics) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _clean_start() -> None:
    """SIGTERM exits through ``finally`` (so namespaces are removed); namespaces of killed runs are removed."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() == 0 and shutil.which("ip"):
        stale = remove_stale_namespaces()
        if stale:
            print(f"removed stale namespaces of earlier killed runs: {stale}")


def _run_logged(spec: RunSpec, fabric: Fabric, ckpt: str, step: StepArgs, world: int, workdir: str, report: dict,
                started: float) -> dict:
    """``run_layout`` with the fabric's ranks per node; the record appended to the report and one line printed."""
    rec = run_layout(spec, fabric, ckpt, dataclasses.replace(step, ranks_per_node=fabric.ranks_per_node), world, workdir)
    report["runs"].append(rec)
    sps = f"{rec['samples_per_s']:.2f} samples/s" if rec["feasible"] else f"{rec['status']}: {rec.get('error', '')[:200]}"
    print(f"[{time.monotonic() - started:6.0f}s] {fabric.name:8s} {spec.name:26s} {sps}", flush=True)
    return rec


def _write_json(report: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def memory_rate_gbps(seconds: float = 1.0) -> float:
    """Bytes read + written per second by a large tensor copy on this machine (the optimizer term's rate)."""
    import torch

    src, dst = torch.empty(2**25), torch.empty(2**25)  # 128 MiB each
    dst.copy_(src)
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - t))
    return statistics.median(rates) / 1e9


def run_regime(regime, args) -> None:
    """One regime: the calibration run on the flat fabric, the link rate it implies, the table on the two-node
    fabric, target vs achieved ratios, and the step-time model's predictions against every run."""
    import regimes as rg

    from hf_hybrid_ep.planner import count_parameters

    world = 4
    started = time.monotonic()
    model_args = ModelArgs(**regime.model)
    counts = count_parameters(model_args.hf_config())
    sizes = model_bytes(model_args)
    budget = rg.memory_budget(counts, regime)
    shapes = rg.t_over_t_star(regime)
    steps = args.steps or 2  # 8 runs of 4 steps of many micro-batches: ≤ 10 minutes on 2 cores
    step = StepArgs(batch_per_rank=regime.batch_per_rank, seq_len=regime.seq_len, warmup=args.warmup or 1, steps=steps,
                    grad_accum=regime.grad_accum, mem_budget_bytes=budget["budget_bytes"])
    specs = {s.name: s for s in default_runs(world)}
    memory_gbps = memory_rate_gbps()
    report: dict[str, Any] = {
        "regime": {"name": regime.name, "reference": regime.reference, "targets": {
            "T_over_T_star": regime.target_t_over_t_star, "r_x": regime.target_r_x, "mfu_assumed": 0.4},
            "shapes": shapes, "memory_budget": budget, "memory_gbps": memory_gbps},
        "runs": [], "machine": machine_info(), "model": dataclasses.asdict(model_args) | sizes,
        "step": dataclasses.asdict(step), "fabrics": {},
        "optimizer": {"class": "torch.optim.AdamW", "lr": step.lr, **OPTIMIZER, "note": "the same settings for every arm"}}
    print(f"regime {regime.name}: T = {shapes['T']}, T* = {shapes['T_star']:.1f}, T/T* = {shapes['T_over_T_star']:.2f} "
          f"(target {regime.target_t_over_t_star}); memory budget {budget['budget_bytes'] / rg.MIB:.0f} MiB per rank "
          f"(1.5 × planner {budget['planner_hybrid_bytes'] / rg.MIB:.1f} MiB + 128 MiB)", flush=True)
    _clean_start()
    workdir = tempfile.mkdtemp(prefix=PREFIX)
    try:
        ckpt = str(Path(workdir) / "ckpt")
        save_checkpoint(model_args, ckpt)
        with FlatFabric(world) as flat:
            report["fabrics"]["flat"] = flat.info
            cal_run = run_layout(specs[rg.CALIBRATION_RUN], flat, ckpt, dataclasses.replace(step, ranks_per_node=world),
                                 world, workdir)
        report["runs"].append(cal_run)
        if not cal_run["feasible"]:
            raise SystemExit(f"calibration run {rg.CALIBRATION_RUN} failed: {cal_run.get('error')}")
        calibration = rg.calibrate(cal_run, counts, regime)
        pure_ep = rg.predict({"engine": "hybrid", "dp": 1, "ep": world, "config": {}}, counts, regime, calibration,
                             {"kind": "two-node", "ranks_per_node": world // 2, "measured_gbit": 1.0}, memory_gbps)
        cross = pure_ep.a2a_bytes["inter_node"]
        gbit = rg.link_gbit_for(regime.target_r_x, cross, world // 2, calibration["compute_s"])
        report["regime"]["calibration"] = calibration
        report["regime"]["link_gbit_chosen"] = gbit
        print(f"[{time.monotonic() - started:6.0f}s] calibration ({rg.CALIBRATION_RUN}, flat): compute "
              f"{calibration['compute_s']:.2f} s/step, {calibration['flops_per_s'] / 1e9:.1f} GFLOP/s per rank, loopback "
              f"{calibration['intra_gbps']:.2f} GB/s; link for r_x = {regime.target_r_x}: {gbit:.3f} Gbit/s", flush=True)
        with TwoNodeFabric(world, gbit, args.inter_node_latency_ms) as fabric:
            report["fabrics"]["two-node"] = fabric.info
            print(f"[{time.monotonic() - started:6.0f}s] fabric two-node: {fabric.info}", flush=True)
            for name in regime.runs:
                _run_logged(specs[name], fabric, ckpt, step, world, workdir, report, started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["elapsed_s"] = time.monotonic() - started
    _regime_results(report, regime)
    _write_json(report, args.json)
    with contextlib.suppress(Exception):
        chart([r for r in report["runs"] if r["fabric"] == "two-node"], args.chart,
              f"regime {regime.name}: Qwen3-MoE {model_args.num_experts} experts top-{model_args.num_experts_per_tok}, "
              f"expert width {model_args.moe_intermediate_size}; T/T* {shapes['T_over_T_star']:.1f}; "
              f"two-node link {gbit:.2f} Gbit/s")
    print(table(report["runs"]))
    print(json.dumps({k: report["regime"][k] for k in ("achieved", "goals", "validation")}, indent=1))
    print(f"elapsed {report['elapsed_s']:.0f} s")


def _regime_results(report: dict, regime) -> None:
    """Achieved ratios and the step-time model's predictions (``regimes.evaluate``), and the goals."""
    import regimes as rg

    evaluated = rg.evaluate(report)
    for r in report["runs"]:
        r["predicted"] = evaluated["predictions"].get(r["key"])
    g = goals([r for r in report["runs"] if r["fabric"] == "two-node"]).get("two-node", {})
    out = {k: v for k, v in g.items() if k.startswith(("hybrid_best", "ours_best", "native_best"))}
    want = {"fine-grained": 1.3, "coarse": 1.0}.get(regime.name)
    if want and "hybrid_best_vs_pure_ep" in g:
        out[f"goal_hybrid_ge_{want}x_pure_ep"] = g["hybrid_best_vs_pure_ep"] >= want
    if "ours_best_vs_native_best" in g:
        out["goal_ours_ge_1.5x_native"] = g["ours_best_vs_native_best"] >= 1.5
    out["predicted_hybrid_vs_pure_ep"] = evaluated["predicted_hybrid_vs_pure_ep"]
    report["regime"] |= {"calibration": evaluated["calibration"], "achieved": evaluated["achieved"], "goals": out,
                         "validation": evaluated["validation"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (under 10 minutes on 2 cores)")
    parser.add_argument("--json", default="bench_training.json")
    parser.add_argument("--chart", default="bench_training.png")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reevaluate", metavar="JSON", default=None,
                        help="recompute a regime report's ratios, predictions and goals with the current code (the "
                             "measured runs are kept as they are) and rewrite the file")
    parser.add_argument("--regime", choices=sorted(REGIMES), default=None,
                        help="a named regime (benchmarks/regimes.py): sets the model shape, the workload, the memory "
                             "budget and the link rate; runs the calibration run on the flat fabric, then the table "
                             "on the two-node fabric, and checks the step-time model against it")
    parser.add_argument("--fabrics", default="flat,two-node")
    parser.add_argument("--runs", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--hybrid-config", default="{}",
                        help='JSON of HybridEPConfig fields added to every hybrid run, e.g. \'{"bucket_size_mb": 5}\'')
    parser.add_argument("--no-netns", action="store_true", help="flat fabric in the host namespace (no root)")
    parser.add_argument("--inter-node-gbit", type=float, default=1.0)
    parser.add_argument("--inter-node-latency-ms", type=float, default=0.5)
    parser.add_argument("--mem-budget-mib", default="auto",
                        help="RLIMIT_DATA above the post-setup data size; 'auto' = 4.5 × one full replica's "
                             "parameter bytes (its params + grads + AdamW state, plus half for activations); "
                             "'none' = no limit")
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (gradients synchronized once per step)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    for f in dataclasses.fields(ModelArgs):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if args.reevaluate:
        report = json.loads(Path(args.reevaluate).read_text())
        _regime_results(report, REGIMES[report["regime"]["name"]])
        _write_json(report, args.reevaluate)
        print(json.dumps({k: report["regime"][k] for k in ("achieved", "goals", "validation")}, indent=1))
        return
    if args.regime:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            parser.error("--regime needs root with `ip` and `tc` (the two-node fabric)")
        run_regime(REGIMES[args.regime], args)
        return
    needs_root = "two-node" in args.fabrics.split(",") or not args.no_netns
    if needs_root and (os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc")):
        parser.error("the two-node fabric and the flat fabric's private namespace need root with `ip` and `tc`; "
                     "without them use --fabrics flat --no-netns")
    model_args = ModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs)})
    sizes = model_bytes(model_args)
    budget = (None if args.mem_budget_mib == "none" else
              int(AUTO_BUDGET_REPLICAS * sizes["total_bytes"]) if args.mem_budget_mib == "auto"
              else int(float(args.mem_budget_mib) * 2**20))
    steps = args.steps or (3 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    step = StepArgs(batch_per_rank=args.batch_per_rank, seq_len=args.seq_len, warmup=warmup, steps=steps,
                    grad_accum=args.grad_accum, mem_budget_bytes=budget)
    specs = default_runs(args.world)
    extra = json.loads(args.hybrid_config)
    specs = [dataclasses.replace(r, config={**extra, **r.config}) if r.engine == "hybrid" else r for r in specs]
    if args.runs:
        wanted = args.runs.split(",")
        unknown = set(wanted) - {s.name for s in specs}
        if unknown:
            parser.error(f"unknown run names {sorted(unknown)}; known: {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in wanted]
    report: dict[str, Any] = {"runs": [], "machine": machine_info(), "model": dataclasses.asdict(model_args) | sizes,
                              "step": dataclasses.asdict(step), "fabrics": {},
                              "optimizer": {"class": "torch.optim.AdamW", "lr": step.lr, **OPTIMIZER,
                                            "note": "the same settings for every arm"}}
    started = time.monotonic()
    _clean_start()
    workdir = tempfile.mkdtemp(prefix=PREFIX)
    try:
        ckpt = str(Path(workdir) / "ckpt")
        save_checkpoint(model_args, ckpt)
        for name in args.fabrics.split(","):
            fabric = (FlatFabric(args.world, netns=not args.no_netns) if name == "flat" else
                      TwoNodeFabric(args.world, args.inter_node_gbit, args.inter_node_latency_ms))
            with fabric:
                report["fabrics"][fabric.name] = fabric.info
                print(f"[{time.monotonic() - started:6.0f}s] fabric {fabric.name}: {fabric.info}", flush=True)
                for spec in specs:
                    _run_logged(spec, fabric, ckpt, step, args.world, workdir, report, started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["elapsed_s"] = time.monotonic() - started
    failures = check_param_formula(report["runs"], sizes)
    report["param_bytes_formula"] = {"ok": not failures, "failures": failures}
    report["goals"] = goals(report["runs"])
    report["overlap_goals"] = overlap_goals(report["runs"], report["fabrics"])
    _write_json(report, args.json)
    with contextlib.suppress(Exception):
        chart(report["runs"], args.chart,
              f"Qwen3-MoE {model_args.num_experts} experts, hidden {model_args.hidden_size}, {model_args.num_hidden_layers} "
              f"layers; world {args.world}; two-node link {args.inter_node_gbit} Gbit/s")
    print(table(report["runs"]))
    print(json.dumps(report["goals"], indent=1))
    print(json.dumps(report["overlap_goals"], indent=1))
    print(f"parameter bytes = dense + experts/ep on every hybrid rank: {'yes' if not failures else failures}")
    print(f"elapsed {report['elapsed_s']:.0f} s")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
