"""One rank of one run, inside its own process: build the engine's model and optimizer, train the warm-up and
timed steps, measure them, profile one more step, and write the rank's record (``rank{RANK}.json``).

Started by :func:`benchmarks.training.launch.run_layout` as ``python -m benchmarks.bench_training --worker <job.json>``, with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT`` and the fabric's variables set.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .meters import (
    CollectiveMeter,
    RoutingRecorder,
    comm_profile,
    interface_counters,
    nbytes,
    peak_rss,
    status_bytes,
    vm_data,
)
from .runs import OPTIMIZER


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation (under the memory limit: the layout does not fit)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or any(s in text for s in (
        "can't allocate memory", "DefaultCPUAllocator", "std::bad_alloc", "Cannot allocate memory", "out of memory"))


def _build(spec: dict, ckpt: str, step: dict, notes: list[str]) -> tuple[Any, Any, Callable, Callable]:
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


class _RankRun:
    """One rank's run, phase by phase (``rec["phase"]``: setup, load, train, done); every figure goes into
    ``rec``, the rank's record. ``job``: the run's ``spec`` and ``step`` (as dicts), ``ckpt`` and ``out`` dir."""

    def __init__(self, job: dict[str, Any], rank: int, rec: dict[str, Any]) -> None:
        self.spec, self.step, self.ckpt, self.out = job["spec"], job["step"], job["ckpt"], Path(job["out"])
        self.rank, self.rec = rank, rec

    def run(self) -> None:
        """Every phase in order; the process group is destroyed at the end."""
        import torch.distributed as dist

        self.setup()
        self.load()
        self.train()
        if self.spec["engine"] == "hybrid":
            self.rec["engine_counters"] = _engine_counters(self.model, self.step["steps"])
        self.profile()
        self.rec["grad_bytes"], self.rec["optimizer_bytes"] = _state_bytes(self.model, self.opt)
        if self.step.get("save_to"):
            self.model.save_pretrained(self.step["save_to"])  # collective: the experts are gathered; rank 0 writes
        self.rec["phase"] = "done"
        dist.barrier()
        dist.destroy_process_group()

    def setup(self) -> None:
        """Process group (gloo), the collective meter, and the memory limit: ``RLIMIT_DATA`` = the data size
        after setup (bytes) + the step's ``mem_budget_bytes``, for runs under the limit."""
        import datetime

        import torch.distributed as dist
        import transformers.distributed.expert_parallel  # noqa: F401  (so the meter can wrap it)

        import hf_hybrid_ep  # noqa: F401

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        self.meter = CollectiveMeter(self.rank, self.step["ranks_per_node"])
        self.meter.install()
        self.base_data = vm_data()
        self.rec["rss_at_setup"] = status_bytes("VmRSS")
        self.peak = [self.base_data]
        if self.spec["mem_limit"] and self.step["mem_budget_bytes"]:
            limit = self.base_data + self.step["mem_budget_bytes"]
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
            self.rec["mem_limit_bytes"] = self.step["mem_budget_bytes"]

    def load(self) -> None:
        """The engine's model and optimizer, and ``warmup + steps + 1`` batches of token ids, each
        ``[grad_accum, batch_per_rank, seq_len]`` (the data file's rows, else uniform ids seeded by rank)."""
        import torch
        import torch.distributed as dist

        step, rank = self.step, self.rank
        self.rec["phase"] = "load"
        self.model, self.opt, self.clip, self.no_sync = _build(self.spec, self.ckpt, step, self.rec["notes"])
        model = self.model
        self.rec["param_bytes"] = nbytes(model.parameters())  # FSDP: this rank's shard
        g = torch.Generator().manual_seed(1234 + rank)
        vocab = model.config.vocab_size if hasattr(model, "config") else model.module.config.vocab_size
        n_batches = step["warmup"] + step["steps"] + 1
        shape = (step["grad_accum"], step["batch_per_rank"], step["seq_len"])
        if step.get("data"):
            self.batches = _data_batches(step["data"], shape, n_batches, rank, dist.get_world_size())
        else:
            self.batches = [torch.randint(0, vocab, shape, generator=g) for _ in range(n_batches)]
        record = step.get("record_routing") and self.spec["engine"] == "hybrid"
        self.recorder = RoutingRecorder(model) if record else None

    def train_step(self, micro_batches, zero: bool = True) -> None:
        """One optimizer step over ``micro_batches`` (``[grad_accum, batch, seq]``); the data size's peak above
        setup (bytes) is updated in ``rec``. ``zero=False`` keeps the gradients (to count their bytes)."""
        for j, ids in enumerate(micro_batches):  # gradients synchronized on the last micro-batch only
            with self.no_sync() if j < len(micro_batches) - 1 else contextlib.nullcontext():
                (self.model(input_ids=ids, labels=ids).loss / len(micro_batches)).backward()
        self.peak.append(vm_data())
        self.clip()
        self.opt.step()
        self.peak.append(vm_data())
        self.rec["peak_data_above_setup"] = max(self.peak) - self.base_data
        if zero:
            self.opt.zero_grad(set_to_none=True)

    def train(self) -> None:
        """The warm-up steps, then the timed ones: their times (s), the meter's bytes and blocked seconds, the
        interface bytes (a node's local rank 0) and the recorded routing."""
        import torch.distributed as dist

        import hf_hybrid_ep

        step, rec = self.step, self.rec
        rec["phase"] = "train"
        for i in range(step["warmup"]):
            self.train_step(self.batches[i])
        dist.barrier()
        self.meter.reset()
        if self.spec["engine"] == "hybrid":
            hf_hybrid_ep.reset_comm_stats(self.model)
        c0 = interface_counters()
        times = []
        if self.recorder is not None:
            self.recorder.on = True
        for i in range(step["steps"]):
            t = time.perf_counter()
            self.train_step(self.batches[step["warmup"] + i])
            dist.barrier()
            times.append(time.perf_counter() - t)
        c1 = interface_counters()
        if self.recorder is not None:
            self.recorder.on = False
            rec["routing"] = self.recorder.finish(self.out / f"routing_rank{self.rank}.npz", step["ranks_per_node"])
        rec["step_times"] = times
        rec.update(_meter_figures(self.meter))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and c0:
            rec["counters"] = {k: c1[k] - c0[k] for k in c0}

    def profile(self) -> None:
        """One profiled step: time with a gloo collective in flight, and where the rest goes. Memory figures are
        taken before it, and the limit lifted for it: the profiler's own event records are not training."""
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile, record_function

        rec = self.rec
        rec["peak_rss_bytes"] = peak_rss()
        peak_data = rec["peak_data_above_setup"]
        resource.setrlimit(resource.RLIMIT_DATA, resource.getrlimit(resource.RLIMIT_DATA)[1:] * 2)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("bench_step"):
                self.train_step(self.batches[-1], zero=False)
                dist.barrier()
        rec["peak_data_above_setup"] = peak_data
        rec.update(comm_profile(prof))


def _meter_figures(meter: CollectiveMeter) -> dict[str, Any]:
    """The meter's tallies over the timed steps (bytes; seconds blocked), as the rank record's fields."""
    return {"a2a_remote_bytes": meter.a2a_remote, "a2a_intra_bytes": meter.a2a_intra,
            "a2a_inter_bytes": meter.a2a_inter, "reduce_bytes": meter.reduce, "bytes_by_op": dict(meter.by_op),
            "blocked_s": meter.blocked_s, "blocked_by_op": dict(meter.blocked_by_op)}


def _engine_counters(model, steps: int) -> dict[str, Any]:
    """This library's own counters (``hf_hybrid_ep.comm_stats``) per timed step: token-exchange bytes and rows by
    phase, gradient-reduction bytes, seconds of backward after the first bucket was ready, buckets launched."""
    import hf_hybrid_ep
    from hf_hybrid_ep.dispatch.stats import PHASES

    stats = hf_hybrid_ep.comm_stats(model)
    layers, red = hf_hybrid_ep.layer_counters(stats), stats["gradient_reduction"]
    return {
        "a2a_remote_bytes_sent_per_step": sum(
            v[p]["remote_bytes_sent"] for v in layers for p in PHASES) // steps,
        "allreduce_dense_bytes_per_step": red["dense_bytes"] // steps,
        "allreduce_expert_bytes_per_step": red["expert_bytes"] // steps,
        "ready_to_end_s_per_step": red["ready_to_end_s"] / steps,
        "buckets_launched_in_backward_per_step": red["buckets_launched_in_backward"] / steps,
        # every phase of the token exchange (the deduplicated dispatcher's cross-node stage is "*_inter")
        "phases_per_step": {p: {key: sum(v[p][key] for v in layers)
                                // steps for key in ("remote_rows_sent", "remote_bytes_sent")}
                            for p in PHASES},
    }


def _state_bytes(model, opt) -> tuple[int, int]:
    """Bytes on this rank of the gradients and of the optimizer's tensor state (scalar step counts excluded)."""
    import torch

    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    state = nbytes(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return grads, state


def _write_and_exit(rec: dict[str, Any], out: Path, rank: int, code: int) -> None:
    """Write ``rec`` as ``out/rank{rank}.json`` (atomically) and end the process with ``code``."""
    rec.setdefault("peak_rss_bytes", peak_rss())
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(rec))
    tmp.rename(out / f"rank{rank}.json")
    sys.stdout.flush()
    os._exit(code)  # never wait in a collective for a rank that has failed


def worker(job_path: str) -> None:
    """One rank of one run: writes ``rank{RANK}.json`` into the job's directory, then ends the process (exit code
    0, or 3 after an error, which is recorded with its phase and traceback)."""
    job = json.loads(Path(job_path).read_text())
    out, rank = Path(job["out"]), int(os.environ["RANK"])
    rec: dict[str, Any] = {"rank": rank, "status": "ok", "phase": "setup", "notes": []}
    try:
        _RankRun(job, rank, rec).run()
        _write_and_exit(rec, out, rank, 0)
    except BaseException as exc:  # noqa: BLE001  (recorded, then the process ends)
        import traceback

        rec["status"] = "out_of_memory" if _is_oom(exc) else "error"
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        print(rec["traceback"], file=sys.stderr)
        _write_and_exit(rec, out, rank, 3)
