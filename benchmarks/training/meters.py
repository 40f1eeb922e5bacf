"""What a rank measures about itself: memory (``/proc/self/status``), bytes sent on the namespace's interfaces,
bytes and blocked time of every torch.distributed collective (:class:`CollectiveMeter`), the profiled step's
time with a gloo collective in flight (:func:`comm_profile`), and the routing of the timed steps
(:class:`RoutingRecorder`)."""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def status_bytes(key: str) -> int:
    """Bytes of the ``key`` line (``VmRSS``, ``VmData``, …) of this process's ``/proc/self/status``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def vm_data() -> int:
    """Private writable virtual memory of this process: what RLIMIT_DATA limits."""
    return status_bytes("VmData")


def peak_rss() -> int:
    """Peak resident set size of this process so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def interface_counters() -> dict[str, int]:
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
        """Zero every tally (bytes; seconds blocked) before the timed steps."""
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
        """Tally one exchange of ``tensor`` (``[rows, ...]``, ``in_splits`` rows to each rank of ``group``),
        ``times`` over (2: a forward whose backward sends the same rows back)."""
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
        """Patch ``torch.distributed``'s collectives, ``Work.wait`` and transformers' native-EP exchange in
        this process so that every call is counted (once per process; the originals still do the work)."""
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
    """The local shard of a DTensor; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors) -> int:
    """Bytes held by ``tensors`` on this rank (a DTensor counts its local shard)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def comm_profile(prof) -> dict[str, Any]:
    """Union of gloo collective intervals inside the ``bench_step`` range, by op and in total.

    → ``comm_fraction`` (of the profiled step), ``profiled_step_s``, ``comm_seconds_by_op`` (s) and the 12 ops of
    most self CPU time (``[name, s]``)."""
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


# the row counts of ``trace_traffic`` a recorded run's routing is checked against
PREDICTED_ROWS = ("cross_node", "rank_rows", "pairs_remote")


class RoutingRecorder:
    """Top-k indices of every MoE layer while ``on`` (after capacity drops: what the dispatcher routes)."""

    def __init__(self, model) -> None:
        import hf_hybrid_ep

        self.state = hf_hybrid_ep.state_of(model)
        self.on = False
        self.traces: dict[str, list] = defaultdict(list)
        for layer in self.state.layers:
            def count(index, dropped=0, _original=layer.load.count, _name=layer.name):
                if self.on:
                    self.traces[_name].append(index.detach().reshape(-1, index.shape[-1]).clone())
                _original(index, dropped)

            layer.load.count = count

    def finish(self, path: Path, ranks_per_node: int) -> dict[str, Any]:
        """Save the traces; return the rows ``trace_traffic`` predicts this rank sends for them (one direction,
        summed over layers): ``cross_node`` (deduplicated node rows), ``rank_rows`` (deduplicated rank rows inside
        the nodes), ``pairs_remote`` (per-pair rows to other ranks); and the tables."""
        import numpy as np
        import torch

        from hf_hybrid_ep.planning.placement import trace_traffic

        mesh = self.state.mesh
        topology = mesh.topology if mesh.topology is not None else f"gpus_per_node={ranks_per_node}"
        arrays = {name: torch.cat(parts).numpy() for name, parts in self.traces.items()}
        np.savez_compressed(path, **arrays)
        tables = {layer.name: layer.table for layer in self.state.layers}
        predicted = dict.fromkeys(PREDICTED_ROWS, 0.0)
        for name, a in arrays.items():
            traffic = trace_traffic([a], tables[name], topology, sources=[mesh.ep_rank])
            for key in PREDICTED_ROWS:
                predicted[key] += traffic[key]
        return {"trace_file": str(path), "predicted_rows": predicted, "tokens": sum(len(a) for a in arrays.values()),
                "tables": {name: [list(r) for r in t.rows] for name, t in tables.items()}}
