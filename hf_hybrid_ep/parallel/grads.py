"""Gradient reduction for hybrid EP and the true global gradient norm.

Convention: every gradient equals the reference gradient of one process training the full model on
the global batch, when each rank's loss is the mean over its own (equal-sized) batch.

* dense parameters: averaged over the world (the DDP convention);
* an expert's gradient is a sum of contributions from every rank whose tokens reached it; it is
  summed over the ranks holding that expert (its EDP group, plus EP replicas) and divided by ``W``.

Gradients live in persistent flat buckets (:mod:`hf_hybrid_ep.parallel.buckets`; ``.grad`` is a view into
them, attached by a forward pre-hook of the model). With ``overlap_grad_reduce`` (the default) a
post-accumulate-grad hook marks each parameter ready during ``backward``, and a bucket's collective
(``all_reduce``, or ``reduce_scatter`` under ZeRO-1) is launched asynchronously as soon as its last
gradient is accumulated — in bucket order within each process group, so every member issues the same
sequence. An autograd-engine callback at the end of ``backward`` launches what is left (buckets whose
parameters got no gradient, or held back while hot-expert shadows return their gradients), waits for
every collective in a fixed order and divides. ``overlap_grad_reduce=False`` runs the same buckets
blocking, one after the other, at the end of ``backward``. A plain PyTorch loop needs no extra call.
Gradients that are ``None`` at that point are set to zeros, so the optimizer never skips a parameter
on one rank and not on another.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ..state import state_of
from .buckets import FlatBucket, bucket_of, runs
from .mesh import HybridMesh, current_device, is_dtensor, reduce_scatter_flat

if TYPE_CHECKING:
    from ..moe.layer import ShardedExperts


@dataclass
class ReducerStats:
    """Reduced payload, in bytes, summed over reductions (this rank's view)."""

    reductions: int = 0
    dense_bytes: int = 0
    expert_bytes: int = 0
    buckets_launched_in_backward: int = 0  # launched by a gradient hook, while backward still ran
    buckets_launched_at_end: int = 0  # launched by the end-of-backward callback (or blocking)
    # seconds from the moment the first bucket had all its gradients to the end of backward, summed: the
    # compute that communication can hide behind (with or without overlap)
    ready_to_end_s: float = 0.0

    def reset(self) -> None:
        self.reductions = self.dense_bytes = self.expert_bytes = 0
        self.buckets_launched_in_backward = self.buckets_launched_at_end = 0
        self.ready_to_end_s = 0.0


@dataclass
class ExpertBucket:
    """Expert slots held by exactly the same set of ranks (for the replica check).

    ``entries`` are ``(parameter, local slot indices)`` in (layer, global expert id) order, which every
    member rank derives identically from the placement tables.
    """

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    entries: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)


# Where an expert parameter's slots are reduced: (holder ranks, their group, local slots in global id order).
ExpertHome = tuple[tuple[int, ...], "dist.ProcessGroup | None", list[int]]


class GradientReducer:
    """Reduces hybrid-EP gradients during every backward pass unless disabled (``no_sync``).

    Args:
        mesh: the DP×EP mesh.
        order: every parameter of the model, in registration order.
        dense: the dense (replicated) parameters.
        expert_homes: ``id(expert parameter)`` → the holder sets of its slots.
        holder_groups: the slot groups by exact holder set (consistency checks).
        expert_norm_weights: ``(expert parameter, per-slot 1/replicas)`` for the global norm.
        reduce_dense: average dense gradients over the world (off when torch DDP does it).
        bucket_bytes: a bucket is closed once it holds this many bytes of gradients.
        overlap: launch each bucket's collective during backward (else blocking, at the end).
    """

    def __init__(
        self,
        mesh: HybridMesh,
        order: list[nn.Parameter],
        dense: list[nn.Parameter],
        expert_homes: dict[int, list[ExpertHome]],
        holder_groups: list[ExpertBucket],
        expert_norm_weights: list[tuple[nn.Parameter, torch.Tensor]],
        reduce_dense: bool = True,
        bucket_bytes: int = 8 * 2**20,
        overlap: bool = True,
    ) -> None:
        self.mesh = mesh
        self.order = order
        self.dense = dense
        self.expert_homes = expert_homes
        self.holder_groups = holder_groups
        self.expert_norm_weights = expert_norm_weights
        self.reduce_dense = reduce_dense
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        # Dense gradients are averaged over this group (the world); a test swaps it to inject a fault.
        self.dense_group, self.dense_group_size = mesh.reduction_group, mesh.world_size
        self.enabled = True
        # Optional extra condition, e.g. ``lambda: accelerator.sync_gradients`` under Accelerate.
        self.sync_predicate: Callable[[], bool] | None = None
        # Run at the end of a reducing backward before the remaining buckets launch, after missing
        # gradients are zero-filled (hot-expert shadowing returns shadow gradients to their owners here).
        # Collective on every rank.
        self.pre_reduce_hooks: list[Callable[[], None]] = []
        # While it returns True, expert buckets wait for the end of backward (shadow gradients pending).
        self.hold_expert_buckets: Callable[[], bool] | None = None
        # Called at the first gradient of a reducing backward, before any bucket launches (the finite-
        # input agreement starts there), and after every bucket completed at its end.
        self.on_backward_start: list[Callable[[], None]] = []
        self.on_backward_end: list[Callable[[], None]] = []
        self.stats = ReducerStats()
        # A zero.ZeroSharding once a sharded optimizer exists: reduce-scatter instead of all-reduce.
        self.sharding = None
        self.buckets: list[FlatBucket] = []
        self._layout_key: tuple | None = None
        self._buckets_of: dict[int, list[FlatBucket]] = {}
        self._queued = False
        self._holding = False
        self._first_ready: float | None = None
        self._dense_ids = {id(p) for p in dense}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for p in self.parameters()
            if p.requires_grad and not is_dtensor(p)  # FSDP2 reduces (and assigns) its own gradients
        ]

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {id(p): p for p in self.dense}
        for p, _ in self.expert_norm_weights:
            seen.setdefault(id(p), p)
        return list(seen.values())

    def replace_parameter(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` takes ``old``'s place (online rebalancing changed its slot count): in the parameter order
        and with the gradient hook. The expert homes and buckets are rebuilt by the caller."""
        self.order = [new if p is old else p for p in self.order]
        self.expert_norm_weights = [(new if p is old else p, w) for p, w in self.expert_norm_weights]
        if new.requires_grad and not is_dtensor(new):
            self._handles.append(new.register_post_accumulate_grad_hook(self._on_grad_ready))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ layout
    def layout(self) -> list[FlatBucket]:
        """The flat buckets (built on first use, rebuilt when the set of trainable parameters changes)."""
        key = tuple(p.requires_grad for p in self.order)
        if key != self._layout_key:
            if self.sharding is not None and self._layout_key is not None:
                raise RuntimeError(
                    "the set of trainable parameters changed after the ZeRO-1 optimizer was built; build the "
                    "optimizer after setting requires_grad"
                )
            self.buckets = self._build()
            self._layout_key = key
            self._buckets_of = {}
            for b in self.buckets:
                for p in b.params():
                    self._buckets_of.setdefault(id(p), []).append(b)
        return self.buckets

    def _build(self) -> list[FlatBucket]:
        """Buckets in reverse registration order, one stream per (kind, holder set, dtype), each closed at
        :attr:`bucket_bytes`; every member of a holder set derives the same buckets and offsets."""
        world = tuple(range(self.mesh.world_size))
        open_: dict[tuple, list[tuple[nn.Parameter, int, int]]] = {}
        sizes: dict[tuple, int] = {}
        groups: dict[tuple, dist.ProcessGroup | None] = {}
        out: list[FlatBucket] = []

        def close(key: tuple) -> None:
            kind, ranks, _ = key
            out.append(bucket_of(kind, ranks, groups[key], self.mesh.rank, open_.pop(key)))
            sizes.pop(key)

        for p in reversed(self.order):
            if not p.requires_grad or is_dtensor(p):
                continue
            if id(p) in self._dense_ids:
                homes: list[ExpertHome] = [(world, self.mesh.reduction_group, None)]
                kind = "dense"
            elif id(p) in self.expert_homes:
                homes, kind = self.expert_homes[id(p)], "expert"
            else:
                continue
            for ranks, group, slots in homes:
                if slots is None or list(slots) == list(range(p.shape[0])):
                    pieces = [(p, 0, p.numel())]
                else:
                    row = math.prod(p.shape[1:])
                    pieces = [(p, first * row, count * row) for first, count in runs(slots)]
                key = (kind, ranks, p.dtype)
                open_.setdefault(key, []).extend(pieces)
                groups[key] = group
                sizes[key] = sizes.get(key, 0) + sum(n for _, _, n in pieces) * p.element_size()
            for key in [k for k, n in sizes.items() if n >= self.bucket_bytes]:
                close(key)
        for key in list(open_):
            close(key)
        for i, b in enumerate(out):
            b.position = i
            # Every earlier bucket over the same ranks, whatever its kind or dtype: buckets that share a
            # communicator are launched in bucket order on every rank (NCCL pairs collectives by order).
            b.previous = [o for o in out[:i] if o.ranks == b.ranks]
        return out

    def passive(self, bucket: FlatBucket) -> bool:
        """Dense buckets are left to torch DDP when it reduces the dense gradients."""
        return bucket.kind == "dense" and not self.reduce_dense

    def active_buckets(self) -> list[FlatBucket]:
        return [b for b in self.layout() if not self.passive(b)]

    def attach_grads(self) -> None:
        """Point ``.grad`` of every view piece at its bucket buffer (the model's forward pre-hook calls this
        when gradients are enabled, so autograd accumulates in place)."""
        if self.mesh.world_size == 1:
            return
        for b in self.active_buckets():
            if b.grad_buffer is None:
                b.allocate_grad_buffer()
            b.attach_grads()

    # ------------------------------------------------------------------ reduction
    def _reducing(self) -> bool:
        return self.enabled and self.mesh.world_size > 1 and (self.sync_predicate is None or self.sync_predicate())

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._reducing():
            return
        if not self._queued:
            self._begin_backward()
        for b in self._buckets_of.get(id(param), ()):
            if not b.launched:
                b.waiting.discard(id(param))
                if not b.waiting and self._first_ready is None:
                    self._first_ready = time.perf_counter()
        if self.overlap:
            self._launch_ready()

    def _begin_backward(self) -> None:
        self._queued = True
        Variable._execution_engine.queue_callback(self._end_backward)
        for hook in self.on_backward_start:
            hook()
        self._holding = bool(self.hold_expert_buckets and self.hold_expert_buckets())
        self._first_ready = None
        for b in self.active_buckets():
            if b.grad_buffer is None:
                b.allocate_grad_buffer()
            b.waiting = {id(p) for p in b.params()}
            b.work, b.launched = None, False

    def _launch_ready(self) -> None:
        """Launch, per set of ranks, the next buckets in bucket order whose gradients are all accumulated:
        whatever order gradients become ready in, every rank issues one group's collectives in one order."""
        for b in self.active_buckets():
            if b.launched or b.waiting or (self._holding and b.kind == "expert"):
                continue
            if any(not o.launched for o in b.previous if not self.passive(o)):
                continue
            self._launch(b, async_op=True)
            self.stats.buckets_launched_in_backward += 1

    def _group_of(self, b: FlatBucket) -> tuple[dist.ProcessGroup | None, int]:
        if b.kind == "dense":
            return self.dense_group, self.dense_group_size
        return b.group, self.mesh.world_size

    def _launch(self, b: FlatBucket, async_op: bool) -> None:
        b.attach_grads()
        b.stage_in()
        group, _ = self._group_of(b)
        if b.size == 1 or group is None:
            b.work = None
        elif self.sharding is not None:
            b.shard_out = torch.empty(b.shard, dtype=b.dtype, device=b.device)
            b.work = reduce_scatter_flat(b.shard_out, b.grad_buffer, group, async_op=async_op)
        else:
            b.work = dist.all_reduce(b.grad_buffer, group=group, async_op=async_op)
        b.launched = True
        nbytes = b.padded * b.grad_buffer.element_size() if group is not None and b.size > 1 else 0
        if b.kind == "dense":
            self.stats.dense_bytes += nbytes
        else:
            self.stats.expert_bytes += nbytes

    def _finish(self, b: FlatBucket) -> None:
        if b.work is not None:
            b.work.wait()
        b.work = None
        _, divisor = self._group_of(b)
        if self.sharding is None:
            b.grad_buffer.div_(divisor)
            b.stage_out()
            return
        a = b.index * b.shard
        region = b.grad_buffer[a : a + b.shard]
        if b.shard_out is not None:
            region.copy_(b.shard_out)
            b.shard_out = None
        region.div_(divisor)
        b.stage_out(a, a + b.shard)

    def _end_backward(self) -> None:
        self._queued = False
        if self._first_ready is not None:
            self.stats.ready_to_end_s += time.perf_counter() - self._first_ready
        self.reduce(_in_backward=True)

    @torch.no_grad()
    def reduce(self, _in_backward: bool = False) -> None:
        """Finish the reduction now (called automatically at the end of ``backward``): zero-fill missing
        gradients, run the pre-reduce hooks, launch the remaining buckets and wait for all of them."""
        if not _in_backward:  # a direct call reduces everything, blocking
            if self._queued:
                return
            for b in self.active_buckets():
                b.launched, b.work = False, None
        for p in self.parameters():
            if p.requires_grad and p.grad is None and not is_dtensor(p):
                p.grad = torch.zeros_like(p)
        for hook in self.pre_reduce_hooks:
            hook()
        buckets = self.active_buckets()
        for b in buckets:
            if b.grad_buffer is None:
                b.allocate_grad_buffer()
            if not b.launched:
                self._launch(b, async_op=self.overlap)
                self.stats.buckets_launched_at_end += 1
                if not self.overlap:
                    self._finish(b)
        for b in buckets:
            if b.work is not None or self.overlap:
                self._finish(b)
        if self.sharding is not None:
            self.sharding.attach_grads()
        self.stats.reductions += 1
        for hook in self.on_backward_end:
            hook()

    # ------------------------------------------------------------------ norm
    def _norm_terms(self) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """Gradients for the norm: ``replicated`` (identical on every rank, counted once) and ``partial``
        (``(grad, per-slot weights or None)``, whose sum over the world counts every element once)."""
        replicated: list[torch.Tensor] = []
        partial: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        sharded = self.sharding.sharded_params if self.sharding is not None else set()
        if self.sharding is not None:
            self.sharding.attach_grads()
            partial += [(o.view.grad, None) for o in self.sharding.owned() if o.view.grad is not None]
        for p in self.dense:
            if p.grad is None or id(p) in sharded:
                continue
            if is_dtensor(p.grad):
                partial.append((p.grad.to_local(), None))
            else:
                replicated.append(p.grad)
        for p, weight in self.expert_norm_weights:
            if p.grad is not None and id(p) not in sharded:
                partial.append((p.grad, weight))
        return replicated, partial

    @torch.no_grad()
    def global_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the full model's gradient (each expert counted once), identical on every rank."""
        device = current_device(self.mesh)  # NCCL reduces device tensors only
        replicated, partial = self._norm_terms()
        # Per-tensor (per-slot) norms in the gradient's dtype, like torch.nn.utils.clip_grad_norm_, combined
        # in float64: no float64 copy of any gradient.
        if norm_type == math.inf:
            local = [torch.linalg.vector_norm(g, math.inf).float().to(device) for g in replicated if g.numel()]
            local += [torch.linalg.vector_norm(g, math.inf).float().to(device) for g, _ in partial if g.numel()]
            total = torch.stack(local).max() if local else torch.zeros((), device=device)
            if self.mesh.world_group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.mesh.world_group)
            return total
        dense_sum = torch.zeros((), dtype=torch.float64, device=device)
        for g in replicated:
            dense_sum += torch.linalg.vector_norm(g, norm_type).double().pow(norm_type).to(device)
        partial_sum = torch.zeros((), dtype=torch.float64, device=device)
        for g, weight in partial:
            if weight is None:
                partial_sum += torch.linalg.vector_norm(g, norm_type).double().pow(norm_type).to(device)
            elif g.numel():
                per_slot = torch.linalg.vector_norm(g.reshape(g.shape[0], -1), norm_type, dim=1).double()
                partial_sum += (per_slot.pow(norm_type) * weight.to(per_slot.device)).sum().to(device)
        if self.mesh.world_group is not None:
            dist.all_reduce(partial_sum, group=self.mesh.world_group)
        return (dense_sum + partial_sum).pow(1.0 / norm_type).float()

    def clip_targets(self) -> list[torch.Tensor]:
        """The gradients the optimizer will read (shard views under zero1, local shards under FSDP)."""
        replicated, partial = self._norm_terms()
        return replicated + [g for g, _ in partial]


def reducer_of(model: nn.Module) -> GradientReducer:
    """The gradient reducer :func:`hf_hybrid_ep.parallelize` attached to ``model``."""
    return state_of(model).reducer


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient reduction inside the block (gradient-accumulation micro-steps); reduce on the next
    ``backward`` outside it, exactly like ``DistributedDataParallel.no_sync``."""
    reducer = reducer_of(model)
    previous = reducer.enabled
    reducer.enabled = False
    fsdp = _fsdp_root(model)
    if fsdp is not None:  # dense_sharding="fsdp": FSDP2 keeps unsharded gradients until the sync step
        fsdp.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        reducer.enabled = previous
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(True)


def _fsdp_root(model: nn.Module):
    from torch.distributed.fsdp import FSDPModule

    return model if isinstance(model, FSDPModule) else None


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip all gradients of a hybrid-EP model by their true global norm; return that norm.

    Same semantics as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the norm covers dense
    parameters once and every expert once, whichever ranks hold it. Collective: call on every rank.
    """
    reducer = reducer_of(model)
    total = reducer.global_grad_norm(norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in reducer.clip_targets():
        g.mul_(coef.to(g.device, g.dtype))
    return total


def expert_homes(layers: list[ShardedExperts], mesh: HybridMesh) -> tuple[
    dict[int, list[ExpertHome]], list[ExpertBucket], list[tuple[nn.Parameter, torch.Tensor]]
]:
    """Group expert-slot gradients by the exact set of world ranks holding them.

    Every rank walks all layers and experts (global knowledge from the tables) so that process groups
    are created in the same order everywhere; it keeps its own slots. Returns, per expert parameter of
    this rank, its homes ``(holder ranks, group, local slots in global id order)``; the same slots
    grouped by holder set (for the replica check); and the per-slot norm weights (1 / holders).
    """
    holders_of: dict[tuple[int, int], tuple[int, ...]] = {}
    for li, layer in enumerate(layers):
        for e in range(layer.num_experts):
            ranks = sorted(mesh.global_rank(d, r) for d in range(mesh.dp_degree) for r in layer.table.holders(e))
            holders_of[(li, e)] = tuple(ranks)
    groups = {ranks: mesh.group_of(ranks) for ranks in sorted(set(holders_of.values()))}
    holder_groups = {ranks: ExpertBucket(ranks, group) for ranks, group in groups.items() if mesh.rank in ranks}
    homes: dict[int, list[ExpertHome]] = {}
    norm_weights = []
    for li, layer in enumerate(layers):
        local = layer.local_experts
        order = sorted(range(len(local)), key=lambda s: local[s])
        weight = torch.tensor([1.0 / len(holders_of[(li, local[s])]) for s in range(len(local))], dtype=torch.float64)
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for s in order:
            by_ranks.setdefault(holders_of[(li, local[s])], []).append(s)
        for p in layer.expert_parameters():
            norm_weights.append((p, weight))
            homes[id(p)] = [(ranks, groups[ranks], slots) for ranks, slots in sorted(by_ranks.items())]
            for ranks, slots in by_ranks.items():
                holder_groups[ranks].entries.append((p, torch.tensor(slots, dtype=torch.long, device=p.device)))
    return homes, [holder_groups[r] for r in sorted(holder_groups)], norm_weights
