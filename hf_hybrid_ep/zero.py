"""ZeRO-1 optimizer-state sharding for hybrid EP (``optimizer_sharding="zero1"``).

Gradients are laid out in *flat buckets*: a virtual 1-D concatenation of parameter pieces that is
reduced together and split into equal contiguous shards, one per member rank:

* one bucket per dtype for the trainable dense parameters, over the whole world (``W`` shards);
* one bucket per expert bucket of the :class:`~hf_hybrid_ep.grads.GradientReducer` (the slots held by
  exactly one set of ranks: the EDP group, plus EP replicas), over those ranks (``dp`` shards with the
  contiguous placement).

A bucket of ``N`` elements over ``G`` ranks has shards of ``S = ceil(N / G)`` elements; member ``i``
owns ``[i·S, min((i+1)·S, N))`` (the tail of the last shard is padding, which is communicated as zeros
and never stored). After ``backward`` the reducer reduce-scatters each bucket (one collective per chunk
of at most :data:`CHUNK_BYTES` per rank), writes the reduced shard into this rank's part of the
parameters' ``.grad`` and nothing else: the rest of ``.grad`` then holds this rank's *unreduced*
contributions, which only the optimizer of another rank would need.

The torch optimizer runs over **views** (``p.detach().view(-1)[a:b]``) of the owned pieces, so it keeps
state (Adam's moments) for ``≈ 1/G`` of every bucket, updates the parameters in place, and
:meth:`ZeroSharding.gather_params` all-gathers the updated shards. Like Megatron-Core's distributed
optimizer: no separate fp32 copy for fp32 parameters, each view is one parameter's contiguous range.

When torch DDP already averaged the dense gradients (the Trainer/Accelerate path), the dense bucket is
not communicated again: each rank reads its shard of the averaged gradient (an all-reduce instead of
a reduce-scatter; same results, the same optimizer-state saving).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .mesh import all_gather_flat, is_dtensor, reduce_scatter_flat

CHUNK_BYTES = 64 * 2**20  # per rank and collective: the temporary buffers hold group_size × this


@dataclass
class Piece:
    """``param.view(-1)[start : start + length]`` at ``offset`` of its bucket's flat layout."""

    param: nn.Parameter
    start: int
    length: int
    offset: int


@dataclass
class OwnedView:
    """The part of a piece that this rank owns: ``param.view(-1)[start:stop]`` = shard ``[lo:hi]``."""

    param: nn.Parameter
    start: int
    stop: int
    lo: int  # offset inside this rank's shard
    view: torch.Tensor  # what the torch optimizer steps (shares storage with ``param``)


@dataclass
class FlatBucket:
    """Parameter pieces reduced together and sharded over ``ranks`` (sorted global ranks)."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    index: int  # this rank's position in ``ranks``
    pieces: list[Piece]
    numel: int
    kind: str = "expert"  # or "dense"
    owned: list[OwnedView] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def shard(self) -> int:
        """Elements per shard ``S = ceil(N / G)``."""
        return math.ceil(self.numel / self.size)

    @property
    def owned_numel(self) -> int:
        return max(0, min(self.numel - self.index * self.shard, self.shard))

    def _locate(self, a: int, b: int) -> Iterable[tuple[Piece, int, int]]:
        """Pieces intersecting flat range ``[a, b)``: ``(piece, lo, hi)`` in flat coordinates."""
        offsets = [p.offset for p in self.pieces]
        i = max(0, bisect.bisect_right(offsets, a) - 1)
        while i < len(self.pieces) and self.pieces[i].offset < b:
            piece = self.pieces[i]
            lo, hi = max(a, piece.offset), min(b, piece.offset + piece.length)
            if lo < hi:
                yield piece, lo, hi
            i += 1

    def read(self, a: int, b: int, out: torch.Tensor, grads: bool) -> None:
        """Copy flat range ``[a, b)`` of the gradients (or parameters) into ``out`` (zeros past ``N``)."""
        out.zero_()
        for piece, lo, hi in self._locate(a, min(b, self.numel)):
            src = piece.param.grad if grads else piece.param
            s = piece.start + lo - piece.offset
            out[lo - a : hi - a].copy_(src.detach().view(-1)[s : s + hi - lo])

    def write(self, a: int, values: torch.Tensor, grads: bool) -> None:
        """Copy ``values`` into flat range ``[a, a + len(values))`` of the gradients (or parameters)."""
        for piece, lo, hi in self._locate(a, min(a + values.numel(), self.numel)):
            dst = piece.param.grad if grads else piece.param
            s = piece.start + lo - piece.offset
            dst.detach().view(-1)[s : s + hi - lo].copy_(values[lo - a : hi - a])


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``(first, count)`` of sorted slot indices."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def _bucket(ranks: tuple[int, ...], group, rank: int, pieces: list[tuple[nn.Parameter, int, int]]) -> FlatBucket:
    laid, offset = [], 0
    for p, start, length in pieces:
        laid.append(Piece(p, start, length, offset))
        offset += length
    bucket = FlatBucket(ranks, group, ranks.index(rank), laid, offset)
    a = bucket.index * bucket.shard
    b = a + bucket.owned_numel
    for piece, lo, hi in bucket._locate(a, b):
        s = piece.start + lo - piece.offset
        if not piece.param.is_contiguous():
            raise ValueError("optimizer_sharding='zero1' needs contiguous parameters")
        view = piece.param.detach().view(-1)[s : s + hi - lo]
        bucket.owned.append(OwnedView(piece.param, s, s + hi - lo, lo - a, view))
    return bucket


class ZeroSharding:
    """The flat-bucket layout of one hybrid-EP model; shared by its reducer and its sharded optimizer."""

    def __init__(self, model: nn.Module) -> None:
        from .parallelize import state_of

        state = state_of(model)
        reducer, mesh = state.reducer, state.mesh
        self.mesh = mesh
        self.buckets: list[FlatBucket] = []
        world = tuple(range(mesh.world_size))
        dense = [p for p in reducer.dense if p.requires_grad and not is_dtensor(p)]
        for dtype in sorted({p.dtype for p in dense}, key=str):
            pieces = [(p, 0, p.numel()) for p in dense if p.dtype == dtype]
            bucket = _bucket(world, mesh.world_group, mesh.rank, pieces)
            bucket.kind = "dense"
            self.buckets.append(bucket)
        for eb in reducer.buckets:
            entries = [(p, idx) for p, idx in eb.entries if p.requires_grad]
            for dtype in sorted({p.dtype for p, _ in entries}, key=str):
                pieces = []
                for p, idx in entries:
                    if p.dtype != dtype:
                        continue
                    row = math.prod(p.shape[1:])  # elements per expert slot
                    for first, count in _runs(idx.tolist()):
                        pieces.append((p, first * row, count * row))
                self.buckets.append(_bucket(eb.ranks, eb.group, mesh.rank, pieces))
        self.sharded_params = {id(pc.param) for b in self.buckets for pc in b.pieces}

    def views_of(self, param: torch.Tensor) -> list[torch.Tensor] | None:
        """This rank's optimizer views of ``param`` (possibly none), or ``None`` if it is not sharded here."""
        if id(param) not in self.sharded_params:
            return None
        return [o.view for b in self.buckets for o in b.owned if o.param is param]

    def owned(self) -> Iterable[OwnedView]:
        for b in self.buckets:
            yield from b.owned

    # ------------------------------------------------------------------ collectives
    @torch.no_grad()
    def reduce_scatter_grads(self, world_size: int, dense_reduced: bool = False) -> None:
        """Average every bucket's gradients and leave this rank's shard in its views' ``.grad``.

        ``dense_reduced``: torch DDP already averaged the dense gradients; only read the shard.
        """
        for b in self.buckets:
            reduced = dense_reduced and b.kind == "dense"
            if reduced or b.group is None:
                if not reduced:
                    for o in b.owned:
                        o.param.grad.view(-1)[o.start : o.stop].div_(world_size)
                self._attach_grads(b)
                continue
            dtype = b.pieces[0].param.dtype
            device = b.pieces[0].param.device
            chunk = _chunk_elems(b, dtype)
            base = b.index * b.shard
            for c0 in range(0, b.shard, chunk):
                c1 = min(b.shard, c0 + chunk)
                n = c1 - c0
                inp = torch.empty(b.size * n, dtype=dtype, device=device)
                for j in range(b.size):
                    b.read(j * b.shard + c0, j * b.shard + c1, inp[j * n : (j + 1) * n], grads=True)
                out = torch.empty(n, dtype=dtype, device=device)
                reduce_scatter_flat(out, inp, b.group)
                out.div_(world_size)
                b.write(base + c0, out, grads=True)
            self._attach_grads(b)

    @staticmethod
    def _attach_grads(b: FlatBucket) -> None:
        for o in b.owned:
            # Re-alias the view: wrappers may have swapped the parameter's storage (``p.data = ...``,
            # as the Trainer/Accelerate preparation does) since the optimizer was built.
            current = o.param.detach().view(-1)[o.start : o.stop]
            if o.view.data_ptr() != current.data_ptr():
                o.view.data = current
            if o.param.grad is not None:
                o.view.grad = o.param.grad.detach().view(-1)[o.start : o.stop]

    def attach_grads(self) -> None:
        """Point every owned view's ``.grad`` at its slice of the parameter's gradient (idempotent)."""
        for b in self.buckets:
            self._attach_grads(b)

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the updated shards so every member holds the whole bucket again."""
        for b in self.buckets:
            if b.group is None:
                continue
            dtype = b.pieces[0].param.dtype
            device = b.pieces[0].param.device
            chunk = _chunk_elems(b, dtype)
            base = b.index * b.shard
            for c0 in range(0, b.shard, chunk):
                c1 = min(b.shard, c0 + chunk)
                n = c1 - c0
                mine = torch.empty(n, dtype=dtype, device=device)
                b.read(base + c0, base + c1, mine, grads=False)
                full = torch.empty(b.size * n, dtype=dtype, device=device)
                all_gather_flat(full, mine, b.group)
                for j in range(b.size):
                    if j != b.index:
                        b.write(j * b.shard + c0, full[j * n : (j + 1) * n], grads=False)

    @torch.no_grad()
    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict]]:
        """Every sharded parameter's optimizer state, assembled to the parameter's (local) shape.

        Returns ``(tensors, scalars)`` keyed by ``id(param)``: tensor state (``exp_avg``, ...) whole on
        every member rank, and scalar state (``step``) from whichever rank owns a piece. Collective over
        each bucket's ranks (and the world for the scalars).
        """
        tensors: dict[int, dict[str, torch.Tensor]] = {}
        scalars: dict[int, dict[str, float]] = {}
        for b in self.buckets:
            keys: set[str] = set()
            mine_scalars: dict[str, float] = {}
            for o in b.owned:
                for k, v in optimizer.state.get(o.view, {}).items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        keys.add(k)
                    else:
                        mine_scalars.setdefault(k, float(v.item() if torch.is_tensor(v) else v))
            # Scalar state (Adam's step) is the same for every piece of a bucket: all are stepped together.
            bucket_scalars = _first_nonempty(mine_scalars, b)
            for piece in b.pieces:
                scalars[id(piece.param)] = dict(bucket_scalars)
            for key in sorted(_agree_keys(keys, b)):
                dtype = next((optimizer.state[o.view][key].dtype for o in b.owned if key in optimizer.state.get(o.view, {})),
                             None)
                dtype = _agree_dtype(dtype, b)
                device = b.pieces[0].param.device
                mine = torch.zeros(b.shard, dtype=dtype, device=device)
                for o in b.owned:
                    if key in optimizer.state.get(o.view, {}):
                        mine[o.lo : o.lo + o.stop - o.start].copy_(optimizer.state[o.view][key])
                full = torch.empty(b.size * b.shard, dtype=dtype, device=device)
                if b.group is None:
                    full.copy_(mine)
                else:
                    all_gather_flat(full, mine, b.group)
                for piece in b.pieces:
                    t = tensors.setdefault(id(piece.param), {}).get(key)
                    if t is None:
                        t = torch.zeros(piece.param.numel(), dtype=dtype, device=device)
                        tensors[id(piece.param)][key] = t
                    t[piece.start : piece.start + piece.length].copy_(full[piece.offset : piece.offset + piece.length])
        return tensors, scalars

    def load_full_state(self, optimizer: torch.optim.Optimizer, param: nn.Parameter, values: dict[str, torch.Tensor],
                        scalars: dict[str, float]) -> None:
        """Set the state of ``param``'s owned views from its whole (local-shape) state."""
        for b in self.buckets:
            for o in b.owned:
                if o.param is not param:
                    continue
                st = optimizer.state[o.view]
                for key, value in values.items():
                    st[key] = value.reshape(-1)[o.start : o.stop].to(o.view.device).clone()
                for key, value in scalars.items():
                    st[key] = torch.tensor(value, dtype=torch.float32)


def _chunk_elems(b: FlatBucket, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return max(1, CHUNK_BYTES // elem)


def _agree_keys(keys: set[str], b: FlatBucket) -> set[str]:
    """The union of state keys over the bucket's ranks (a rank owning nothing has none)."""
    if b.group is None:
        return keys
    gathered: list = [None] * b.size
    dist.all_gather_object(gathered, sorted(keys), group=b.group)
    return set().union(*map(set, gathered))


def _agree_dtype(dtype: torch.dtype | None, b: FlatBucket) -> torch.dtype:
    """The state dtype of the ranks that hold it (a rank owning nothing has none)."""
    name = None if dtype is None else str(dtype).removeprefix("torch.")
    return getattr(torch, _first_nonempty(name, b) or "float32")


def _first_nonempty(value, b: FlatBucket):
    """The first non-empty ``value`` over the bucket's ranks, in rank order."""
    if b.group is None:
        return value
    gathered: list = [None] * b.size
    dist.all_gather_object(gathered, value, group=b.group)
    return next((v for v in gathered if v), value)


class ShardedOptimizer:
    """Mixin that turns a torch optimizer class into its ZeRO-1 form over a hybrid-EP model.

    Build with :func:`shard_optimizer` (or :func:`make_optimizer`, which follows the config). The
    result *is* an instance of the optimizer class (schedulers, ``GradScaler`` and Accelerate accept
    it); its ``param_groups`` hold this rank's views of the sharded parameters, with the groups'
    hyperparameters. Parameters outside the flat buckets (FSDP-sharded dense weights) are kept as they
    are. ``step()`` updates the owned shards and all-gathers them.
    """

    def __init__(self, model: nn.Module, params, *args, **kwargs) -> None:
        from .parallelize import state_of

        state = state_of(model)
        reducer = state.reducer
        if reducer.sharding is None:
            reducer.sharding = ZeroSharding(model)
        self.hybrid_sharding: ZeroSharding = reducer.sharding
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        shard_groups = []
        for g in groups:
            views: list[torch.Tensor] = []
            for p in g["params"]:
                mine = self.hybrid_sharding.views_of(p)
                views.extend([p] if mine is None else mine)
            shard_groups.append({**g, "params": views})
        self.hybrid_param_groups = [list(g["params"]) for g in groups]  # model parameters, per group
        self.hybrid_model_params = [p for g in self.hybrid_param_groups for p in g]
        super().__init__(shard_groups, *args, **kwargs)

    def step(self, closure=None):
        self.hybrid_sharding.attach_grads()
        loss = super().step(closure)
        self.hybrid_sharding.gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.hybrid_model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


_CLASSES: dict[type, type] = {}


def shard_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], params, *args, **kwargs):
    """``optimizer_cls(params, *args, **kwargs)`` with its state sharded ZeRO-1 style over the DP dimensions.

    ``params`` are the model's parameters or param groups, as for the optimizer class itself. Call on
    every rank, after :func:`hf_hybrid_ep.parallelize`; the model's reducer then reduce-scatters.
    """
    cls = _CLASSES.get(optimizer_cls)
    if cls is None:
        cls = type(f"Sharded{optimizer_cls.__name__}", (ShardedOptimizer, optimizer_cls), {})
        _CLASSES[optimizer_cls] = cls
    return cls(model, params, *args, **kwargs)


def make_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], params, *args, **kwargs):
    """The optimizer the model's config asks for: sharded with ``optimizer_sharding="zero1"``, plain otherwise."""
    from .parallelize import state_of

    if state_of(model).config.optimizer_sharding == "zero1":
        return shard_optimizer(model, optimizer_cls, params, *args, **kwargs)
    return optimizer_cls(params, *args, **kwargs)


def reshard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A fresh (state-less) plain optimizer turned into its sharded form, same groups and defaults."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError("reshard_optimizer needs a fresh optimizer (it already holds state)")
    groups = [dict(g) for g in optimizer.param_groups]  # every hyperparameter is in the groups
    return shard_optimizer(model, type(optimizer), groups)
