"""Online rebalancing: move experts between EP ranks during training, at an optimizer-step boundary.

``HybridEPConfig(rebalance_every=N)`` and/or ``rebalance_when_imbalance_over=x`` turn it on;
:func:`hf_hybrid_ep.after_optimizer_step` (after ``optimizer.step()``) calls :meth:`Rebalancer.after_step`.

Decision. The loads (and co-activation counts, with ``coactivation_stats``) of every layer are the
world totals that ``after_optimizer_step`` all-reduces once per step, summed since the last rebalance, so every
rank holds the same numbers. A rebalance runs every ``N`` steps, or when the worst layer's rank
imbalance (max/mean of the expected tokens per EP rank under its current table, the window's loads)
exceeds ``x``. The new tables come from :func:`hf_hybrid_ep.planning.placement.fit_placement` per layer
(co-activation-aware where the counts exist, else the hierarchical load-balanced packing; topology-
aware; ``rebalance_replicas`` extra copies of the hottest experts), each layer's computed by one rank
(layers spread over the world) and all-gathered, so that no floating-point difference between hosts
can split the ranks.

Move. Per layer, one ``all_to_all_single`` over the EP group carries, for every expert a rank newly
holds, its rows of every expert parameter and of their optimizer state (Adam's moments; with ZeRO-1
first assembled from the shards), as bytes, from the expert's first current holder; experts a rank
keeps are copied locally. Parameters keep their identity (``p.data`` is replaced), so the optimizer,
its hooks and the model's references stay valid. Then the per-rank state is rebuilt: the layer's
table, local experts and dispatcher; the device-load accounting (primary holder of each expert, the
per-rank load estimate re-derived from the window); the gradient reducer's buckets and buffers (and
process groups of new holder sets); the ZeRO-1 shards and the optimizer's views. Global per-expert
state (selection and correction biases) does not move. Gradients are dropped (the step consumed
them); hot-expert shadows are decided after the move (they expire every step anyway).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..dispatch import PlacementTable
from ..parallel.grads import expert_homes
from ..parallel.topology import Topology
from ..parallel.zero import ShardedOptimizer, ZeroSharding, groups_by_param, wait_for_parameters
from ..planning.placement import RoutingStats, align_rows, fit_placement, imbalance, rank_loads
from ..state import state_of

logger = logging.getLogger("hf_hybrid_ep")


@dataclass
class RebalanceEvent:
    """One rebalance: when, why, what it cost and what it changed (this rank's view of the bytes)."""

    step: int
    reason: str
    seconds: float
    bytes_sent: int  # this rank's payload over all layers (weights + optimizer state)
    imbalance_before: dict[str, float]  # per layer, under the old table, on the window's loads
    imbalance_after: dict[str, float]  # per layer, under the new table, on the same loads
    moved: bool = False  # whether any layer's table changed
    fit_seconds: float = 0.0  # of ``seconds``: fitting the tables (layers spread over ranks) and sharing them
    tables: dict[str, list[list[int]]] = field(default_factory=dict)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as Accelerate's ``AcceleratedOptimizer`` (itself an
    ``Optimizer`` subclass that delegates to ``.optimizer``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class Rebalancer:
    """Decides and performs online rebalances for one parallelized model (collective methods)."""

    def __init__(self, model: nn.Module) -> None:

        state = state_of(model)
        self.model, self.state = model, state
        self.config = state.config
        self.window: dict[str, torch.Tensor] = {}  # layer -> summed world totals since the last rebalance
        self.window_steps = 0
        self.events: list[RebalanceEvent] = []
        self.reported = 0  # events already in a load report
        self.optimizer = None  # registered by make_optimizer, or given to after_optimizer_step

    # ------------------------------------------------------------------ decision
    def record(self, layer_name: str, totals: torch.Tensor) -> None:
        """Add one step's all-reduced counters of a layer (``after_optimizer_step`` calls this)."""
        if layer_name in self.window:
            self.window[layer_name] += totals
        else:
            self.window[layer_name] = totals.clone()

    def step_done(self) -> None:
        self.window_steps += 1

    def _loads(self, layer) -> np.ndarray:
        totals = self.window.get(layer.name)
        if totals is None:
            return np.zeros(layer.num_experts)
        return totals[: layer.num_experts].double().numpy()

    def imbalances(self, tables: dict[str, PlacementTable] | None = None) -> dict[str, float]:
        """Per layer: max/mean expected tokens per EP rank on the window's loads (1.0 with no load).
        Vectorised (``rebalance_when_imbalance_over`` asks after every step)."""
        out = {}
        for layer in self.state.layers:
            table = layer.table if tables is None else tables[layer.name]
            loads = self._loads(layer)
            per_rank = loads @ _replica_shares(table)
            mean = per_rank.mean()
            out[layer.name] = float(per_rank.max() / mean) if mean > 0 else 1.0
        return out

    def due(self, step: int) -> str | None:
        """Why a rebalance is due after optimizer step ``step`` (identical on every rank), or ``None``."""
        config = self.config
        if self.window_steps == 0:
            return None
        if config.rebalance_every is not None and step % config.rebalance_every == 0:
            return f"every {config.rebalance_every} steps"
        threshold = config.rebalance_when_imbalance_over
        if threshold is not None:
            worst = max(self.imbalances().values())
            if worst > threshold:
                return f"worst layer imbalance {worst:.3f} > {threshold}"
        return None

    def _fit(self, layers: list) -> dict[str, list[list[int]]]:
        config, mesh = self.config, self.state.mesh
        tables = {}
        for layer in layers:
            coact = None
            if layer.routing is not None and layer.routing.coactivation and layer.name in self.window:
                coact = layer.routing.coactivation_matrix(self.window[layer.name]).double().numpy()
            table = refit(self._loads(layer), coact, layer.routing.top_k if layer.routing else 1, layer.table,
                          mesh.ep_degree, config.topology, config.rebalance_replicas, config.rebalance_tolerance)
            tables[layer.name] = [list(row) for row in table.rows]
        return tables

    def decide(self) -> dict[str, PlacementTable]:
        """New tables: layer ``i`` fitted by world rank ``i mod W`` (in parallel), then all-gathered, so every
        rank installs the same tables and no floating-point difference between hosts can split them."""
        mesh, layers = self.state.mesh, self.state.layers
        mine = self._fit([layer for i, layer in enumerate(layers) if i % mesh.world_size == mesh.rank])
        if mesh.world_group is not None:
            gathered: list = [None] * mesh.world_size
            dist.all_gather_object(gathered, mine, group=mesh.world_group)
            mine = {name: rows for part in gathered for name, rows in part.items()}
        return {layer.name: PlacementTable.from_rows(layer.num_experts, mine[layer.name]) for layer in layers}

    # ------------------------------------------------------------------ after a step
    def after_step(self, step: int, optimizer=None) -> RebalanceEvent | None:
        """Rebalance when due. Collective: call on every rank, after ``optimizer.step()``."""
        reason = self.due(step)
        if reason is None:
            return None
        start = time.perf_counter()
        tables = self.decide()
        fitted = time.perf_counter() - start
        before = self.imbalances()
        after = self.imbalances(tables)
        moved = any(tables[layer.name] != layer.table for layer in self.state.layers)
        sent = apply_tables(self.model, tables, optimizer if optimizer is not None else self.optimizer)
        event = RebalanceEvent(step, reason, time.perf_counter() - start, sent, before, after, moved, fitted,
                               {n: [list(r) for r in t.rows] for n, t in tables.items()})
        self.events.append(event)
        self.window, self.window_steps = {}, 0
        logger.info("rebalanced after step %d (%s): worst layer imbalance %.3f -> %.3f, %d bytes sent, %.3f s",
                    step, reason, max(before.values()), max(after.values()), sent, event.seconds)
        return event


@functools.lru_cache(maxsize=1024)
def _replica_shares(table: PlacementTable) -> np.ndarray:
    """``[E, ep]``: the share of expert e's tokens EP rank r receives (1 / replicas on each holder)."""
    shares = np.zeros((table.num_experts, table.ep_degree))
    for r, row in enumerate(table.rows):
        for e in row:
            shares[e, r] = 1.0
    return shares / shares.sum(axis=1, keepdims=True)


def refit(loads: np.ndarray, coactivation: np.ndarray | None, top_k: int, current: PlacementTable, ep_degree: int,
          topology=None, replicas: int = 0, tolerance: float = 0.05) -> PlacementTable:
    """The table a rebalance puts in place of ``current`` for one layer with these window statistics
    (``loads [E]``, ``coactivation [E, E]`` or ``None``): fitted by :func:`~hf_hybrid_ep.planning.placement.fit_placement`,
    aligned to ``current`` (fewest experts moved), or ``current`` itself where the fit does not lower the
    layer's rank imbalance on ``loads``."""

    topology = Topology.of(topology) if topology else None
    stats = RoutingStats(np.asarray(loads, dtype=float) + 1e-9, coactivation, top_k)
    table, _ = fit_placement(stats, ep_degree, topology, replicas, tolerance)
    table = align_rows(table, current, topology)
    if np.sum(loads) > 0 and imbalance(rank_loads(loads, table)) >= imbalance(rank_loads(loads, current)) - 1e-9:
        return current  # no better: nothing moves
    return table


# ---------------------------------------------------------------------------------------------- the move


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
        dist.all_to_all_single(received.view(-1), payload.view(-1),
                               [c * width for c in recv_counts], [len(s) * width for s in sends], group=mesh.ep_group)
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
def apply_tables(model: nn.Module, tables: dict[str, PlacementTable], optimizer=None) -> int:
    """Lay ``model``'s experts out by ``tables`` (layer name → table) now, with their optimizer state, and
    rebuild everything that depends on the layout. Call at an optimizer-step boundary (after ``step()``,
    no gradient pending), on every rank with the same tables. Returns the bytes this rank sent.

    ``optimizer``: the model's optimizer (plain or ZeRO-1; Accelerate's wrapper is unwrapped); without
    one only the weights move (an optimizer built afterwards starts fresh)."""

    state = state_of(model)
    optimizer = unwrap_optimizer(optimizer)
    reducer = state.reducer
    wait_for_parameters(model)
    sharding = reducer.sharding
    if sharding is not None and not isinstance(optimizer, ShardedOptimizer):
        raise ValueError("the model's optimizer state is ZeRO-1-sharded: pass its sharded optimizer")
    sharded_state, scalars = (sharding.full_state(optimizer) if sharding is not None else (None, {}))
    sent = 0
    moved: dict[int, dict[str, torch.Tensor]] = {}  # id(param) -> moved optimizer state (local shape)
    for layer in state.layers:
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
                p = _replace_parameter(model, layer.module, pname, p, value, optimizer)
                if old_id in scalars:
                    scalars[id(p)] = scalars[old_id]
            moved[id(p)] = {k: next(it) for k in st}
            if sharding is None and optimizer is not None and p in optimizer.state:
                optimizer.state[p].update(moved[id(p)])
        layer.set_table(new)
        if layer.routing is not None:
            layer.routing.remap([new.holders(e)[0] for e in range(new.num_experts)], state.config.device_load_factors)
    if not moved:
        return 0
    _relayout_reducer(model)
    if sharding is not None:
        for handle in sharding._hooks:
            handle.remove()
        new_sharding = ZeroSharding(model)
        reducer.sharding = new_sharding
        _reseat_sharded_optimizer(optimizer, new_sharding, sharded_state, moved, scalars)
    return sent


def _replace_parameter(model: nn.Module, module: nn.Module, pname: str, old: nn.Parameter, value: torch.Tensor,
                       optimizer) -> nn.Parameter:
    """Put a new Parameter holding ``value`` where ``old`` was: in the module, the reducer's parameter order
    and gradient hooks, and the optimizer's groups and state (its tensor state is replaced after the move)."""

    new = nn.Parameter(value, requires_grad=old.requires_grad)
    module._parameters[pname] = new
    state_of(model).reducer.replace_parameter(old, new)
    if optimizer is None:
        return new
    if isinstance(optimizer, ShardedOptimizer):  # its groups are rebuilt from these lists after the move
        for params in optimizer.hybrid_param_groups:
            params[:] = [new if q is old else q for q in params]
        optimizer.hybrid_model_params[:] = [new if q is old else q for q in optimizer.hybrid_model_params]
        return new
    for group in optimizer.param_groups:
        group["params"] = [new if q is old else q for q in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)
    return new


def _relayout_reducer(model: nn.Module) -> None:
    """Rebuild the reducer's expert homes (and process groups of new holder sets), buckets and buffers."""

    state = state_of(model)
    reducer = state.reducer
    homes, holder_groups, norm_weights = expert_homes(state.layers, state.mesh)
    reducer.expert_homes, reducer.holder_groups, reducer.expert_norm_weights = homes, holder_groups, norm_weights
    for p in reducer.parameters():
        p.grad = None
    reducer.sharding = None  # rebuilt by the caller (the layout may change under a new sharding)
    reducer.buckets, reducer._layout_key, reducer._buckets_of = [], None, {}
    reducer.layout()


def _reseat_sharded_optimizer(optimizer, sharding, old_state: dict, moved: dict, scalars: dict) -> None:
    """Point a ZeRO-1 optimizer's groups at the new sharding's views and load every parameter's state."""
    optimizer.hybrid_sharding = sharding
    kept = {p: optimizer.state[p] for p in optimizer.hybrid_model_params  # outside the buckets (FSDP2 weights)
            if sharding.views_of(p) is None and p in optimizer.state}
    optimizer.state.clear()
    optimizer.state.update(kept)
    for group, params in zip(optimizer.param_groups, optimizer.hybrid_param_groups, strict=True):
        views: list[torch.Tensor] = []
        for p in params:
            mine = sharding.views_of(p)
            views.extend([p] if mine is None else mine)
        group["params"] = views
    groups = groups_by_param(optimizer)
    for p in optimizer.hybrid_model_params:
        if sharding.views_of(p) is None:
            continue
        values = moved.get(id(p)) or {k: v.view(p.shape) for k, v in old_state.get(id(p), {}).items()}
        if values:
            sharding.load_full_state(optimizer, p, values, scalars.get(id(p), {}), groups)
