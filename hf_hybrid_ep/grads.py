"""Gradient reduction for hybrid EP and the true global gradient norm.

Convention (DESIGN.md): every gradient equals the reference gradient of one process training the
full model on the global batch, when each rank's loss is the mean over its own (equal-sized) batch.

* dense parameters: averaged over the world (the DDP convention);
* an expert's gradient is a sum of contributions from every rank whose tokens reached it; it is
  summed over the ranks holding that expert (its EDP group, plus EP replicas) and divided by ``W``.

The reduction runs once at the end of ``loss.backward()`` (an autograd engine callback queued from a
post-accumulate-grad hook), in one fixed order on every rank, so a plain PyTorch loop needs no extra
call. Gradients that are ``None`` at that point are set to zeros, so the optimizer never skips a
parameter on one rank and not on another.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from .mesh import HybridMesh, current_device, is_dtensor

DENSE_BUCKET_BYTES = 64 * 2**20


@dataclass
class ReducerStats:
    """All-reduced payload, in bytes, summed over reductions (this rank's view)."""

    reductions: int = 0
    dense_bytes: int = 0
    expert_bytes: int = 0

    def reset(self) -> None:
        self.reductions = self.dense_bytes = self.expert_bytes = 0


@dataclass
class ExpertBucket:
    """Expert-slot gradients reduced together: all slots held by exactly the same set of ranks.

    ``entries`` are ``(parameter, local slot indices)`` in (layer, global expert id) order, which every
    member rank derives identically from the placement tables.
    """

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    entries: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)


class GradientReducer:
    """Reduces hybrid-EP gradients at the end of every backward pass unless disabled (``no_sync``)."""

    def __init__(
        self,
        mesh: HybridMesh,
        dense: list[nn.Parameter],
        buckets: list[ExpertBucket],
        expert_norm_weights: list[tuple[nn.Parameter, torch.Tensor]],
        reduce_dense: bool = True,
    ) -> None:
        self.mesh = mesh
        self.dense = dense
        self.buckets = buckets
        self.expert_norm_weights = expert_norm_weights
        self.reduce_dense = reduce_dense
        # Dense gradients are averaged over this group (the world); a test swaps it to inject a fault.
        self.dense_group, self.dense_group_size = mesh.world_group, mesh.world_size
        self.enabled = True
        # Optional extra condition, e.g. ``lambda: accelerator.sync_gradients`` under Accelerate.
        self.sync_predicate: Callable[[], bool] | None = None
        # Run at the start of every reduction, after missing gradients are zero-filled (e.g. shadow
        # gradients returned to their owners by hot-expert shadowing). Collective on every rank.
        self.pre_reduce_hooks: list[Callable[[], None]] = []
        self.stats = ReducerStats()
        # A zero.ZeroSharding once a sharded optimizer exists: reduce-scatter instead of all-reduce.
        self.sharding = None
        self._queued = False
        self._whole: dict[tuple[int, int], bool] = {}
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

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ reduction
    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        if not self.enabled or self._queued or self.mesh.world_size == 1:
            return
        if self.sync_predicate is None or self.sync_predicate():
            self._queued = True
            Variable._execution_engine.queue_callback(self._reduce_all)

    def _reduce_all(self) -> None:
        self._queued = False
        self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        """Reduce all gradients now (called automatically at the end of ``backward``)."""
        for p in self.parameters():
            if p.requires_grad and p.grad is None and not is_dtensor(p):
                p.grad = torch.zeros_like(p)
        for hook in self.pre_reduce_hooks:
            hook()
        world = self.mesh.world_size
        if self.sharding is not None:
            self.sharding.reduce_scatter_grads(world, dense_reduced=not self.reduce_dense)
            self._count_sharded()
            self.stats.reductions += 1
            return
        if self.reduce_dense:
            for bucket in _buckets_by_size([p for p in self.dense if p.requires_grad], DENSE_BUCKET_BYTES):
                grads = [p.grad for p in bucket]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.dense_group)
                flat.div_(self.dense_group_size)
                _unflatten_into(flat, grads)
                self.stats.dense_bytes += flat.numel() * flat.element_size()
        for bucket in self.buckets:
            entries = [(p, idx) for p, idx in bucket.entries if p.requires_grad]
            if not entries:
                continue
            # Slots covering a whole parameter (the usual case) are read and written without an index copy;
            # a bucket of one such parameter is reduced in place, with no copy at all.
            rows = [p.grad if self._all_slots(p, idx) else p.grad[idx] for p, idx in entries]
            in_place = len(entries) == 1 and rows[0] is entries[0][0].grad and rows[0].is_contiguous()
            flat = rows[0].view(-1) if in_place else torch.cat([r.reshape(-1) for r in rows])
            if bucket.group is not None:
                dist.all_reduce(flat, group=bucket.group)
                self.stats.expert_bytes += flat.numel() * flat.element_size()
            flat.div_(world)
            if in_place:
                continue
            offset = 0
            for (p, idx), r in zip(entries, rows, strict=True):
                part = flat[offset : offset + r.numel()].view_as(r)
                if r is p.grad:
                    p.grad.copy_(part)
                else:
                    p.grad[idx] = part
                offset += r.numel()
        self.stats.reductions += 1

    def _all_slots(self, p: torch.Tensor, idx: torch.Tensor) -> bool:
        """Whether local slot indices ``idx`` are every slot of ``p`` in order (cached per bucket entry)."""
        key = (id(p), id(idx))
        if key not in self._whole:
            self._whole[key] = idx.numel() == p.shape[0] and bool((idx.cpu() == torch.arange(p.shape[0])).all())
        return self._whole[key]

    def _count_sharded(self) -> None:
        for b in self.sharding.buckets:
            if b.group is None or (b.kind == "dense" and not self.reduce_dense):
                continue
            nbytes = b.size * b.shard * b.pieces[0].param.element_size()  # reduce-scatter input per rank
            if b.kind == "dense":
                self.stats.dense_bytes += nbytes
            else:
                self.stats.expert_bytes += nbytes

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


def _buckets_by_size(params: list[nn.Parameter], cap_bytes: int) -> Iterator[list[nn.Parameter]]:
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def reducer_of(model: nn.Module) -> GradientReducer:
    state = getattr(model, "_hybrid_ep", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not prepared with hf_hybrid_ep.parallelize")
    return state.reducer


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
