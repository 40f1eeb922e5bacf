"""Gradient reduction for hybrid EP and the true global gradient norm.

Convention: every gradient equals the reference gradient of one process training the full model on
the global batch, when each rank's loss is the mean over its own (equal-sized) batch.

* dense parameters: averaged over the world (the DDP convention);
* an expert's gradient is a sum of contributions from every rank whose tokens reached it; it is
  summed over the ranks holding that expert (its EDP group, plus EP replicas) and divided by ``W``.

Gradients live in persistent flat buckets (:mod:`hf_hybrid_ep.parallel.buckets`; ``.grad`` is a view into
them, attached before a differentiated forward). :class:`GradientReducer` knows buckets, groups and
collectives only; when each step of a backward happens is decided by its caller
(:class:`hf_hybrid_ep.engine.backward.BackwardSequence`): :meth:`~GradientReducer.begin` arms the buckets,
:meth:`~GradientReducer.mark_ready` launches a bucket's collective (``all_reduce``, or ``reduce_scatter``
under ZeRO-1) asynchronously as soon as its last gradient is accumulated — in bucket order within each set
of ranks, so every member issues the same sequence — and :meth:`~GradientReducer.launch_remaining` /
:meth:`~GradientReducer.wait_all` finish the rest in a fixed order and divide. With ``overlap=False`` the
same buckets run blocking, one after the other, at the end. Gradients that are ``None`` at the end are set
to zeros (:meth:`~GradientReducer.gradients_complete`), so the optimizer never skips a parameter on one rank
and not on another.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .buckets import FlatBucket, bucket_of, runs
from .mesh import HybridMesh, current_device, is_dtensor, reduce_scatter_flat
from .watchdog import launched, wait, watched


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


@dataclass(frozen=True)
class ExpertHolding:
    """One expert parameter of this rank and where its slots are reduced (plain data from the placement
    tables, :func:`hf_hybrid_ep.moe.holdings.expert_holdings`).

    Attributes:
        param: the parameter, ``[S, ...]`` over this rank's local slots.
        homes: ``(holder ranks, slots)``: each exact set of world ranks (sorted) holding some of its slots, and
            this rank's local slots held by that set, in global expert order.
        experts: the global expert id of each local slot.
    """

    param: nn.Parameter
    homes: list[tuple[tuple[int, ...], list[int]]]
    experts: list[int]

    def norm_weight(self) -> torch.Tensor:
        """``[S]`` float64 on the parameter's device: 1 / (ranks holding the slot's expert), so a world-wide sum
        counts each expert once (made once per layout; the norm reads it every step, with no host copy)."""
        weight = torch.empty(len(self.experts), dtype=torch.float64)
        for ranks, slots in self.homes:
            weight[slots] = 1.0 / len(ranks)
        return weight.to(self.param.device)


@dataclass
class HolderSet:
    """Expert slots held by exactly the same set of ranks, and their process group (for the replica check).

    ``entries`` are ``(holding, local slot indices)`` in (layer, global expert id) order, which every member
    rank derives identically from the placement tables.
    """

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    entries: list[tuple[ExpertHolding, torch.Tensor]] = field(default_factory=list)


class GradientReducer:
    """Reduces hybrid-EP gradients in flat buckets (see the module docstring for the calls of one backward).

    Args:
        mesh: the DP×EP mesh.
        order: every parameter of the model, in registration order.
        dense: the dense (replicated) parameters.
        holdings: this rank's expert parameters and their holder sets (:class:`ExpertHolding`).
        holder_sets: every holder set of the model on every rank (sorted): a process group is made for each,
            in this order, on every rank (group creation is a world collective).
        reduce_dense: average dense gradients over the world (off when torch DDP does it).
        bucket_bytes: a bucket is closed once it holds this many bytes of gradients.
        overlap: launch each bucket's collective during backward (else blocking, at the end).
    """

    def __init__(
        self,
        mesh: HybridMesh,
        order: list[nn.Parameter],
        dense: list[nn.Parameter],
        holdings: list[ExpertHolding],
        holder_sets: list[tuple[int, ...]],
        *,
        reduce_dense: bool = True,
        bucket_bytes: int = 8 * 2**20,
        overlap: bool = True,
    ) -> None:
        self.mesh = mesh
        self.order = order
        self.dense = dense
        self.reduce_dense = reduce_dense
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        # Dense gradients are averaged over this group (the world); a test swaps it to inject a fault.
        self.dense_group, self.dense_group_size = mesh.reduction_group, mesh.world_size
        self.stats = ReducerStats()
        # A zero.ZeroSharding once a sharded optimizer exists: reduce-scatter instead of all-reduce.
        self.sharding = None
        self._dense_ids = {id(p) for p in dense}
        self._set_holdings(holdings, holder_sets)
        self._holding = False
        self._first_ready: float | None = None
        # per backward: its number, the number of the last backward each parameter was ready in, and per set of
        # ranks the active buckets in bucket order with the index of the first one not launched yet
        self._backward = 0
        self._ready_in: dict[int, int] = {}
        self._streams: dict[tuple[int, ...], list[FlatBucket]] = {}
        self._next: dict[tuple[int, ...], int] = {}
        self._rebuild()

    def _set_holdings(self, holdings: list[ExpertHolding], holder_sets: list[tuple[int, ...]]) -> None:
        """Process groups of the holder sets (made in ``holder_sets`` order), each expert parameter's homes,
        the slots grouped by holder set (replica check) and the per-slot norm weights."""
        groups = {ranks: self.mesh.group_of(ranks) for ranks in holder_sets}
        self.holdings = holdings
        self.expert_homes = {id(h.param): [(ranks, groups[ranks], slots) for ranks, slots in sorted(h.homes)]
                             for h in holdings}
        by_set = {ranks: HolderSet(ranks, group) for ranks, group in groups.items() if self.mesh.rank in ranks}
        for h in holdings:
            for ranks, slots in h.homes:
                by_set[ranks].entries.append((h, torch.tensor(slots, dtype=torch.long, device=h.param.device)))
        self.holder_groups = [by_set[r] for r in sorted(by_set)]
        self.expert_norm_weights = [(h.param, h.norm_weight()) for h in holdings]

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter whose gradient this reducer reduces (dense first, then experts)."""
        seen: dict[int, nn.Parameter] = {id(p): p for p in self.dense}
        for p, _ in self.expert_norm_weights:
            seen.setdefault(id(p), p)
        return list(seen.values())

    # ------------------------------------------------------------------ experts moved
    def replace_parameter(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` takes ``old``'s place in the parameter order (online rebalancing changed its slot count);
        :meth:`rehome` follows with the new holdings."""
        self.order = [new if p is old else p for p in self.order]

    def rehome(self, holdings: list[ExpertHolding], holder_sets: list[tuple[int, ...]]) -> None:
        """Experts moved (online rebalancing): new holder sets and homes, new buckets and buffers. Gradients
        are dropped and the ZeRO-1 sharding detached (its owner relays it out, see
        :meth:`hf_hybrid_ep.parallel.zero.ZeroSharding.reshard`). Collective (new process groups)."""
        self._set_holdings(holdings, holder_sets)
        for p in self.parameters():
            p.grad = None
        self.sharding = None
        self._rebuild()

    # ------------------------------------------------------------------ buckets
    def buckets(self) -> list[FlatBucket]:
        """The flat buckets, as last built (:meth:`trainable_changed` rebuilds them)."""
        return self._built

    def _trainable(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.order)

    def trainable_changed(self) -> bool:
        """Rebuild the buckets if the set of trainable parameters (``requires_grad``) changed since they were
        built; returns whether it did. One read of every parameter's flag: call it at the points where the set
        may have changed (the engine does before every differentiated forward), never per gradient.

        Raises:
            RuntimeError: when the set changed after a ZeRO-1 optimizer sharded the buckets.
        """
        if self._trainable() == self._built_for:
            return False
        if self.sharding is not None:
            raise RuntimeError(
                "the set of trainable parameters changed after the ZeRO-1 optimizer was built; build the "
                "optimizer after setting requires_grad"
            )
        self._rebuild()
        return True

    def _rebuild(self) -> None:
        """Buckets for the current trainable set, and the buckets of each parameter (what a hook looks up)."""
        self._built_for = self._trainable()
        self._built = self._build()
        self._buckets_of = {}
        for b in self._built:
            for p in b.params():
                self._buckets_of.setdefault(id(p), []).append(b)
        self._ready_in = {}

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
                homes = [(world, self.mesh.reduction_group, None)]
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
        return out

    def passive(self, bucket: FlatBucket) -> bool:
        """Dense buckets are left to torch DDP when it reduces the dense gradients."""
        return bucket.kind == "dense" and not self.reduce_dense

    def active_buckets(self) -> list[FlatBucket]:
        return [b for b in self.buckets() if not self.passive(b)]

    def attach_grads(self) -> None:
        """Point ``.grad`` of every view piece at its bucket buffer (before a forward that will be
        differentiated, so autograd accumulates in place)."""
        if self.mesh.world_size == 1:
            return
        for b in self.active_buckets():
            if b.grad_buffer is None:
                b.allocate_grad_buffer()
            b.attach_grads()

    # ------------------------------------------------------------------ one backward
    def begin(self, hold_experts: bool = False) -> None:
        """Arm every bucket for a reducing backward: all its gradients pending, nothing launched. With
        ``hold_experts`` expert buckets wait for :meth:`launch_remaining` (shadow gradients are still out).

        The active buckets are queued per set of ranks in bucket order, whatever their kind or dtype: buckets
        that share a communicator are launched in that order on every rank (NCCL pairs collectives by order).
        """
        self._holding = hold_experts
        self._first_ready = None
        self._backward += 1
        self._streams = {}
        for b in self._built:
            b.pending, b.work, b.launched = b.param_count, None, False
            if self.passive(b):
                continue
            if b.grad_buffer is None:
                b.allocate_grad_buffer()
            self._streams.setdefault(b.ranks, []).append(b)
        self._next = dict.fromkeys(self._streams, 0)

    def mark_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is accumulated; with ``overlap``, launch the buckets that became complete.
        Constant work per parameter (its own buckets, and the launches it makes possible)."""
        if self._ready_in.get(id(param)) == self._backward:
            return  # accumulated again in the same backward (a recomputed segment): counted once
        self._ready_in[id(param)] = self._backward
        for b in self._buckets_of.get(id(param), ()):
            b.pending -= 1
            if b.pending == 0 and not self.passive(b):
                if self._first_ready is None:
                    self._first_ready = time.perf_counter()
                if self.overlap:
                    self._launch_ready(b.ranks)

    def _launch_ready(self, ranks: tuple[int, ...]) -> None:
        """Launch the next buckets over ``ranks``, in bucket order, while their gradients are all accumulated:
        whatever order gradients become ready in, every rank issues one group's collectives in one order."""
        stream, i = self._streams[ranks], self._next[ranks]
        while i < len(stream):
            b = stream[i]
            if b.pending or (self._holding and b.kind == "expert"):
                break
            self._launch(b, async_op=True)
            self.stats.buckets_launched_in_backward += 1
            i += 1
        self._next[ranks] = i

    def _group_of(self, b: FlatBucket) -> tuple[dist.ProcessGroup | None, int]:
        if b.kind == "dense":
            return self.dense_group, self.dense_group_size
        return b.group, self.mesh.world_size

    def bucket_name(self, b: FlatBucket) -> str:
        """``"all_reduce of dense gradient bucket 3"``: what the watchdog names."""
        kind = "reduce_scatter" if self.sharding is not None else "all_reduce"
        return f"{kind} of {b.kind} gradient bucket {b.position} ({b.numel} elements)"

    def _launch(self, b: FlatBucket, async_op: bool) -> None:
        b.attach_grads()
        b.stage_in()
        group, _ = self._group_of(b)
        if b.size == 1 or group is None:
            b.work = None
        else:
            self._issue(b, group, async_op)
        b.launched = True
        nbytes = b.padded * b.grad_buffer.element_size() if group is not None and b.size > 1 else 0
        if b.kind == "dense":
            self.stats.dense_bytes += nbytes
        else:
            self.stats.expert_bytes += nbytes

    def _issue(self, b: FlatBucket, group: dist.ProcessGroup, async_op: bool) -> None:
        """The bucket's collective: reduce-scatter under ZeRO-1, else all-reduce (watched when blocking)."""
        with watched(self.bucket_name(b), group) if not async_op else contextlib.nullcontext():
            if self.sharding is not None:
                b.shard_out = torch.empty(b.shard, dtype=b.dtype, device=b.device)
                b.work = reduce_scatter_flat(b.shard_out, b.grad_buffer, group, async_op=async_op)
            else:
                b.work = dist.all_reduce(b.grad_buffer, group=group, async_op=async_op)
        if async_op:
            launched(b.work, self.bucket_name(b), group)

    def _finish(self, b: FlatBucket) -> None:
        if b.work is not None:
            wait(b.work, self.bucket_name(b), self._group_of(b)[0])
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

    @torch.no_grad()
    def gradients_complete(self) -> None:
        """Backward has ended: record how long the complete buckets could hide communication, and give every
        trainable parameter that got no gradient a zero one (every rank steps every parameter)."""
        if self._first_ready is not None:
            self.stats.ready_to_end_s += time.perf_counter() - self._first_ready
            self._first_ready = None
        for b in self._built:
            if not b.pending:
                continue
            for p in b.params():  # only the buckets that still wait: no pass over every parameter
                if self._ready_in.get(id(p)) != self._backward and p.grad is None:
                    p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def launch_remaining(self) -> None:
        """Launch the buckets not launched during backward, in bucket order (blocking without ``overlap``)."""
        for b in self.active_buckets():
            if b.grad_buffer is None:
                b.allocate_grad_buffer()
            if not b.launched:
                self._launch(b, async_op=self.overlap)
                self.stats.buckets_launched_at_end += 1
                if not self.overlap:
                    self._finish(b)

    @torch.no_grad()
    def wait_all(self) -> None:
        """Wait for every bucket's collective in bucket order and divide; under ZeRO-1 point the optimizer's
        views at the reduced shards (what clipping and the optimizer read)."""
        for b in self.active_buckets():
            if b.work is not None or self.overlap:
                self._finish(b)
        if self.sharding is not None:
            self.sharding.attach_grads()
        self.stats.reductions += 1

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
                with watched("all_reduce of the global gradient norm", self.mesh.world_group):
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
                partial_sum += (per_slot.pow(norm_type) * weight).sum().to(device)
        if self.mesh.world_group is not None:
            with watched("all_reduce of the global gradient norm", self.mesh.world_group):
                dist.all_reduce(partial_sum, group=self.mesh.world_group)
        return (dense_sum + partial_sum).pow(1.0 / norm_type).float()

    def clip_targets(self) -> list[torch.Tensor]:
        """The gradients the optimizer will read (shard views under zero1, local shards under FSDP)."""
        replicated, partial = self._norm_terms()
        return replicated + [g for g, _ in partial]
