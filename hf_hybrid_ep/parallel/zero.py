"""ZeRO-1 optimizer-state sharding for hybrid EP (``optimizer_sharding="zero1"``).

The unit is the gradient reducer's flat bucket (:mod:`hf_hybrid_ep.parallel.buckets`): dense buckets over the
whole world, expert buckets over the exact set of ranks holding their slots (the EDP group, plus EP
replicas). A bucket of ``N`` elements over ``G`` ranks has shards of ``S = ceil(N / G)`` elements;
member ``i`` owns ``[i·S, min((i+1)·S, N))`` (the tail of the last shard is padding, communicated as
zeros). During ``backward`` the reducer reduce-scatters each bucket as soon as its gradients are
accumulated (asynchronously, with ``overlap_grad_reduce``) and writes the reduced shard into this rank's
region of the bucket's gradient buffer: the rest of the buffer then holds this rank's *unreduced*
contributions, which only the optimizer of another rank would need.

The torch optimizer runs over **views** of the owned pieces, so it keeps state (Adam's moments) for
``≈ 1/G`` of every bucket and updates the parameters in place. The parameters of whole-parameter pieces
live in the bucket's flat parameter buffer, so :meth:`ZeroSharding.gather_params`, launched after
``step()``, all-gathers every bucket in place — asynchronously, waited for by a forward pre-hook of the
first module that needs the bucket (Megatron-Core's ``overlap_param_gather``). Whatever else reads
parameters (saving, ``full_state_dict``, the replica check, shadow refresh, ``state_dict``) calls
:func:`hf_hybrid_ep.wait_for_parameters` first. Like Megatron-Core's distributed optimizer: no separate
fp32 copy for fp32 parameters.

When torch DDP already averaged the dense gradients (the Trainer/Accelerate path), the dense buckets
are not communicated again: each rank reads its shard of the averaged gradient (an all-reduce instead of
a reduce-scatter; same results, the same optimizer-state saving).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from .buckets import FlatBucket, OwnedView
from .grads import GradientReducer
from .mesh import all_gather_flat
from .watchdog import launched, wait, watched


def _owned_views(b: FlatBucket) -> list[OwnedView]:
    a = b.index * b.shard
    owned = []
    for piece, lo, hi in b.locate(a, a + b.owned_numel):
        s = piece.start + lo - piece.offset
        if not piece.param.is_contiguous():
            raise ValueError("optimizer_sharding='zero1' needs contiguous parameters")
        owned.append(OwnedView(piece.param, s, s + hi - lo, lo - a, piece.param.detach().view(-1)[s : s + hi - lo]))
    return owned


class ZeroSharding:
    """The sharded view of one hybrid-EP model's flat buckets; shared by its reducer and its optimizer.

    Args:
        reducer: the model's gradient reducer (its buckets are sharded; it reduce-scatters from now on).
        model: the module tree whose forward pre-hooks wait for a bucket's parameter gather.
    """

    def __init__(self, reducer: GradientReducer, model: nn.Module) -> None:
        self.reducer, self.mesh = reducer, reducer.mesh
        self._hooks: list = []
        self._shard(model)

    def _shard(self, model: nn.Module) -> None:
        self.buckets: list[FlatBucket] = self.reducer.buckets()
        for b in self.buckets:
            b.allocate_param_buffer()
            b.owned = _owned_views(b)
        self.sharded_params = {id(pc.param) for b in self.buckets for pc in b.pieces}
        self._hooks = self._register_wait_hooks(model)
        self.reducer.sharding = self

    def reshard(self, model: nn.Module) -> None:
        """Shard the reducer's buckets again (after :meth:`GradientReducer.rehome`): new owned views and
        wait hooks; the optimizer's groups follow with :meth:`ShardedOptimizer.reseat`."""
        for handle in self._hooks:
            handle.remove()
        self._shard(model)

    def _register_wait_hooks(self, model: nn.Module) -> list:
        """A forward pre-hook on every module holding parameters of a bucket: wait for that bucket's gather."""
        bucket_of_param: dict[int, list[FlatBucket]] = {}
        for b in self.buckets:
            for p in b.params():
                bucket_of_param.setdefault(id(p), []).append(b)
        handles = []
        for module in model.modules():
            mine = {id(b): b for p in module.parameters(recurse=False) for b in bucket_of_param.get(id(p), ())}
            if mine:
                buckets = sorted(mine.values(), key=lambda b: b.position)
                handles.append(module.register_forward_pre_hook(lambda m, a, bs=buckets: self._wait(bs)))
        return handles

    def views_of(self, param: torch.Tensor) -> list[torch.Tensor] | None:
        """This rank's optimizer views of ``param`` (possibly none), or ``None`` if it is not sharded here."""
        if id(param) not in self.sharded_params:
            return None
        return [o.view for b in self.buckets for o in b.owned if o.param is param]

    def owned(self) -> Iterable[OwnedView]:
        for b in self.buckets:
            yield from b.owned

    # ------------------------------------------------------------------ gradients
    def attach_grads(self) -> None:
        """Point every owned view's ``.grad`` at its slice of the parameter's gradient (idempotent)."""
        for b in self.buckets:
            b.relink_params()
            for o in b.owned:
                # Re-alias the view: a wrapper may have replaced the parameter's storage (``p.data = ...``).
                current = o.param.detach().view(-1)[o.start : o.stop]
                if o.view.data_ptr() != current.data_ptr():
                    o.view.data = current
                if o.param.grad is not None:
                    o.view.grad = o.param.grad.detach().view(-1)[o.start : o.stop]

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def gather_params(self, async_op: bool = True) -> None:
        """All-gather the updated shards so every member holds the whole bucket again; in forward order
        (the last bucket holds the first layers), asynchronously unless ``async_op=False``."""
        for b in reversed(self.buckets):
            self._wait([b])
            if b.group is None:
                continue
            b.relink_params()
            mine = torch.empty(b.shard, dtype=b.dtype, device=b.device)
            b.params_in(b.index * b.shard, (b.index + 1) * b.shard, mine)
            with watched(f"all_gather of ZeRO-1 parameter bucket {b.position}", b.group) if not async_op else nullcontext():
                b.gather_work = all_gather_flat(b.param_buffer, mine, b.group, async_op=async_op)
            if not async_op:
                self._wait([b])
                continue
            launched(b.gather_work, f"all_gather of ZeRO-1 parameter bucket {b.position}", b.group)
            if b.gather_work is None:
                b.gather_work = True  # a group of one, or a wrapper that ran it synchronously

    @staticmethod
    def _wait(buckets: list[FlatBucket]) -> None:
        for b in buckets:
            if b.gather_work is None:
                continue
            if b.gather_work is not True:
                wait(b.gather_work, f"all_gather of ZeRO-1 parameter bucket {b.position}", b.group)
            b.gather_work = None
            b.params_out()

    def wait_params(self) -> None:
        """Wait for every pending parameter all-gather (before anything reads the parameters)."""
        self._wait(self.buckets)

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
                        scalars: dict[str, float], groups: dict[int, dict]) -> None:
        """Set the state of ``param``'s owned views from its whole (local-shape) state (``groups``: the
        optimizer's :func:`groups_by_param`)."""
        for b in self.buckets:
            for o in b.owned:
                if o.param is not param:
                    continue
                st = optimizer.state[o.view]
                group = groups[id(o.view)]
                for key, value in values.items():
                    st[key] = value.reshape(-1)[o.start : o.stop].to(o.view.device).clone()
                for key, value in scalars.items():
                    st[key] = scalar_state(value, o.view, group)


def groups_by_param(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """``id(tensor) -> param group`` for every tensor ``optimizer`` steps."""
    return {id(q): group for group in optimizer.param_groups for q in group["params"]}


def scalar_state(value: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Scalar optimizer state (Adam's ``step``) rebuilt as torch keeps it: a float32 tensor on the parameter's
    device for a fused or capturable group, whose kernels read it there (a host tensor is an illegal access
    or a device mismatch on CUDA), and on the CPU otherwise (``torch.optim.Optimizer.load_state_dict``'s rule)."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(value, dtype=torch.float32, device=param.device)
    return torch.tensor(value, dtype=torch.float32)


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
    """Mixin that turns a torch optimizer class into its ZeRO-1 form over a :class:`ZeroSharding`.

    Build with :func:`hf_hybrid_ep.shard_optimizer` (or :func:`hf_hybrid_ep.make_optimizer`, which follows the
    config). The result *is* an instance of the optimizer class (schedulers, ``GradScaler`` and Accelerate
    accept it); its ``param_groups`` hold this rank's views of the sharded parameters, with the groups'
    hyperparameters. Parameters outside the flat buckets (FSDP-sharded dense weights) are kept as they
    are. ``step()`` updates the owned shards and all-gathers them.
    """

    def __init__(self, sharding: ZeroSharding, params, *args, **kwargs) -> None:
        self.hybrid_sharding = sharding
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
        self.hybrid_sharding.wait_params()  # a step before any forward (the first one, or a repeated step)
        self.hybrid_sharding.attach_grads()
        loss = super().step(closure)
        self.hybrid_sharding.gather_params(async_op=self.hybrid_sharding.reducer.overlap)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.hybrid_model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def replace_parameter(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` takes ``old``'s place among the model parameters (its views follow in :meth:`reseat`)."""
        for params in self.hybrid_param_groups:
            params[:] = [new if q is old else q for q in params]
        self.hybrid_model_params[:] = [new if q is old else q for q in self.hybrid_model_params]

    def reseat(self, old_state: dict, moved: dict, scalars: dict) -> None:
        """Point the groups at the (resharded) sharding's views and load every parameter's state: ``moved``
        (``id(param)`` → moved tensor state, local shape) where given, else ``old_state`` (the
        :meth:`ZeroSharding.full_state` taken before the move); ``scalars`` the scalar state by parameter."""
        sharding = self.hybrid_sharding
        kept = {p: self.state[p] for p in self.hybrid_model_params  # outside the buckets (FSDP2 weights)
                if sharding.views_of(p) is None and p in self.state}
        self.state.clear()
        self.state.update(kept)
        for group, params in zip(self.param_groups, self.hybrid_param_groups, strict=True):
            views: list[torch.Tensor] = []
            for p in params:
                mine = sharding.views_of(p)
                views.extend([p] if mine is None else mine)
            group["params"] = views
        groups = groups_by_param(self)
        for p in self.hybrid_model_params:
            if sharding.views_of(p) is None:
                continue
            values = moved.get(id(p)) or {k: v.view(p.shape) for k, v in old_state.get(id(p), {}).items()}
            if values:
                sharding.load_full_state(self, p, values, scalars.get(id(p), {}), groups)


_CLASSES: dict[type, type] = {}


def sharded_class(optimizer_cls: type[torch.optim.Optimizer]) -> type:
    """``Sharded<optimizer_cls>``: the optimizer class with :class:`ShardedOptimizer` mixed in (one per class)."""
    cls = _CLASSES.get(optimizer_cls)
    if cls is None:
        cls = type(f"Sharded{optimizer_cls.__name__}", (ShardedOptimizer, optimizer_cls), {})
        _CLASSES[optimizer_cls] = cls
    return cls


