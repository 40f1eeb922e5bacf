"""The move of an online rebalance: experts, their optimizer state and everything laid out by slot.

Per layer, one ``all_to_all_single`` over the EP group carries, for every expert a rank newly holds, its
rows of every expert parameter and of their optimizer state (Adam's moments; with ZeRO-1 first assembled
from the shards), as bytes, from the expert's first current holder; experts a rank keeps are copied locally.
Parameters keep their identity where the slot count stays (``p.data`` is replaced), so the optimizer, its
hooks and the model's references stay valid. Then what depends on where the experts are is rebuilt through
public methods: the layer's table and dispatcher, the device-load accounting, the gradient reducer
(:meth:`~hf_hybrid_ep.parallel.grads.GradientReducer.rehome`), the ZeRO-1 sharding and the sharded
optimizer's views (:meth:`~hf_hybrid_ep.parallel.zero.ZeroSharding.reshard`,
:meth:`~hf_hybrid_ep.parallel.zero.ShardedOptimizer.reseat`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...config import HybridEPConfig
from ...dispatch import PlacementTable
from ...parallel.grads import GradientReducer
from ...parallel.watchdog import watched
from ...parallel.zero import ShardedOptimizer
from ..holdings import expert_holdings
from ..layer import ShardedExperts


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as Accelerate's ``AcceleratedOptimizer`` (itself an
    ``Optimizer`` subclass that delegates to ``.optimizer``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _state_rows(optimizer, p: nn.Parameter, sharded: dict | None) -> dict[str, torch.Tensor]:
    """The per-slot optimizer state of expert parameter ``p`` in its local shape ``[S, ...]``."""
    if sharded is not None:
        tensors = sharded.get(id(p), {})
        return {k: v.view(p.shape) for k, v in sorted(tensors.items())}
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    return {k: v for k, v in sorted(state.items())
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape)}


@torch.no_grad()
def _move_layer(layer, new: PlacementTable, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """``tensors`` (per-slot ``[S_old, ...]`` rows under the layer's current table: parameters and optimizer
    state) laid out for ``new`` (``[S_new, ...]``), in one byte all-to-all over the EP group.

    Returns the new tensors and the bytes this rank sent."""
    mesh, old = layer.mesh, layer.table
    me, ep = mesh.ep_rank, old.ep_degree
    row_bytes = [t[0].numel() * t.element_size() for t in tensors]
    width = sum(row_bytes)
    source = {e: old.holders(e)[0] for e in range(old.num_experts)}

    def incoming(dest: int) -> list[int]:  # new slots of ``dest`` filled from another rank, in slot order
        held = set(old.rows[dest])
        return [s for s, e in enumerate(new.rows[dest]) if e not in held]

    sends: list[list[int]] = [[] for _ in range(ep)]  # per destination: old local slots of this rank to send
    recv_counts = [0] * ep
    mine_old = {e: s for s, e in enumerate(old.rows[me])}
    for dest in range(ep):
        for s in incoming(dest):
            e = new.rows[dest][s]
            if source[e] == me:
                sends[dest].append(mine_old[e])
            if dest == me:
                recv_counts[source[e]] += 1
    order = [s for dest in range(ep) for s in sends[dest]]
    device = tensors[0].device
    payload = torch.empty((len(order), width), dtype=torch.uint8, device=device)
    offset = 0
    for t, nb in zip(tensors, row_bytes, strict=True):
        if order:
            rows = t[torch.tensor(order, dtype=torch.long, device=t.device)].contiguous()
            payload[:, offset : offset + nb] = rows.view(len(order), -1).view(torch.uint8)
        offset += nb
    received = torch.empty((sum(recv_counts), width), dtype=torch.uint8, device=device)
    if mesh.ep_group is not None:  # every member calls it, even with nothing to move
        with watched(f"all_to_all of the experts a rebalance moves in {layer.name}", mesh.ep_group):
            dist.all_to_all_single(received.view(-1), payload.view(-1), [c * width for c in recv_counts],
                                   [len(s) * width for s in sends], group=mesh.ep_group)
    # rows arrive ordered by source rank, each source's in this rank's new-slot order
    arrivals = {}
    cursor = [sum(recv_counts[:q]) for q in range(ep)]
    for s in incoming(me):
        q = source[new.rows[me][s]]
        arrivals[s] = cursor[q]
        cursor[q] += 1
    out = []
    offset = 0
    for t, nb in zip(tensors, row_bytes, strict=True):
        fresh = t.new_empty((len(new.rows[me]), *t.shape[1:]))
        for s, e in enumerate(new.rows[me]):
            if e in mine_old:
                fresh[s] = t[mine_old[e]]
            else:
                fresh[s] = received[arrivals[s], offset : offset + nb].view(t.dtype).view(t.shape[1:])
        out.append(fresh)
        offset += nb
    return out, payload.numel()


@torch.no_grad()
def apply_tables(model: nn.Module, layers: list[ShardedExperts], reducer: GradientReducer, config: HybridEPConfig,
                 tables: dict[str, PlacementTable], optimizer=None) -> int:
    """Lay the experts of ``layers`` out by ``tables`` (layer name → table) now, with their optimizer state, and
    rebuild everything that depends on the layout. Call at an optimizer-step boundary (after ``step()``,
    no gradient pending), on every rank with the same tables. Returns the bytes this rank sent.

    ``model``: the module tree (ZeRO-1 wait hooks); ``optimizer``: the model's optimizer (plain or ZeRO-1;
    Accelerate's wrapper is unwrapped); without one only the weights move (an optimizer built afterwards
    starts fresh)."""
    optimizer = unwrap_optimizer(optimizer)
    sharding = reducer.sharding
    if sharding is not None:
        sharding.wait_params()
    if sharding is not None and not isinstance(optimizer, ShardedOptimizer):
        raise ValueError("the model's optimizer state is ZeRO-1-sharded: pass its sharded optimizer")
    sharded_state, scalars = (sharding.full_state(optimizer) if sharding is not None else (None, {}))
    sent = 0
    moved: dict[int, dict[str, torch.Tensor]] = {}  # id(param) -> moved optimizer state (local shape)
    for layer in layers:
        new = tables[layer.name]
        if new == layer.table:
            continue
        params = layer.expert_parameters()
        states = [_state_rows(optimizer, p, sharded_state) for p in params]
        flat = [p.detach() for p in params] + [v for st in states for v in st.values()]
        fresh, nbytes = _move_layer(layer, new, flat)
        sent += nbytes
        it = iter(fresh[len(params):])
        for pname, p, st, value in zip(layer.param_names, params, states, fresh[: len(params)], strict=True):
            p.grad = None
            if value.shape == p.shape:
                p.data = value  # the same Parameter: the optimizer, hooks and references stay valid
            else:
                # A new slot count needs a new Parameter: a live autograd graph (the last loss) keeps the old
                # one's gradient accumulator, with the old shape, for the next forward.
                old_id = id(p)
                p = _replace_parameter(reducer, layer.module, pname, p, value, optimizer)
                if old_id in scalars:
                    scalars[id(p)] = scalars[old_id]
            moved[id(p)] = {k: next(it) for k in st}
            if sharding is None and optimizer is not None and p in optimizer.state:
                optimizer.state[p].update(moved[id(p)])
        layer.set_table(new)
        if layer.controls is not None:
            layer.controls.remap([new.holders(e)[0] for e in range(new.num_experts)], layer.load.total,
                                 config.device_load_factors)
    if not moved:
        return 0
    holder_sets, holdings = expert_holdings(layers, reducer.mesh)
    reducer.rehome(holdings, holder_sets)  # new holder groups, buckets; gradients dropped
    if sharding is not None:
        sharding.reshard(model)
        optimizer.reseat(sharded_state, moved, scalars)
    return sent


def _replace_parameter(reducer: GradientReducer, module: nn.Module, pname: str, old: nn.Parameter, value: torch.Tensor,
                       optimizer) -> nn.Parameter:
    """Put a new Parameter holding ``value`` where ``old`` was: in the module, the reducer's parameter order,
    and the optimizer's groups and state (its tensor state is replaced after the move)."""
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    module._parameters[pname] = new
    reducer.replace_parameter(old, new)
    if optimizer is None:
        return new
    if isinstance(optimizer, ShardedOptimizer):  # its groups are rebuilt from the model parameters after the move
        optimizer.replace_parameter(old, new)
        return new
    for group in optimizer.param_groups:
        group["params"] = [new if q is old else q for q in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)
    return new
