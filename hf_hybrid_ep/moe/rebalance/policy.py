"""Online rebalancing, the policy: when experts move between EP ranks during training, and where to.

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

The move (:mod:`hf_hybrid_ep.moe.rebalance.moves`) carries the experts with their optimizer state and
rebuilds what depends on the layout. Global per-expert state (selection and correction biases) does not
move. Gradients are dropped (the step consumed them); hot-expert shadows are decided after the move (they
expire every step anyway).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ...config import HybridEPConfig
from ...dispatch import PlacementTable
from ...parallel.grads import GradientReducer
from ...parallel.mesh import HybridMesh
from ...parallel.topology import Topology
from ...planning.placement import RoutingStats, align_rows, fit_placement, imbalance, rank_loads
from ..layer import ShardedExperts
from .moves import apply_tables

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


class Rebalancer:
    """Decides and performs online rebalances for one parallelized model (collective methods).

    Args:
        model: the module tree (its forward pre-hooks wait for ZeRO-1 parameter gathers).
        layers / mesh / reducer / config: the model's EP layers, mesh, gradient reducer and config.
    """

    def __init__(self, model: nn.Module, layers: list[ShardedExperts], mesh: HybridMesh, reducer: GradientReducer,
                 config: HybridEPConfig) -> None:
        self.model, self.layers, self.mesh, self.reducer = model, layers, mesh, reducer
        self.config = config
        self.window: dict[str, torch.Tensor] = {}  # layer -> summed world totals since the last rebalance
        self.window_steps = 0
        self.events: list[RebalanceEvent] = []
        self.reported = 0  # events already in a load report
        self.optimizer = None  # registered by make_optimizer, or given to after_optimizer_step

    # ------------------------------------------------------------------ decision
    def record(self, totals: dict[str, torch.Tensor]) -> None:
        """Add one optimizer step's all-reduced counters, by layer name (``after_optimizer_step`` calls this)."""
        self.window_steps += 1
        for name, t in totals.items():
            if name in self.window:
                self.window[name] += t
            else:
                self.window[name] = t.clone()

    def _loads(self, layer) -> np.ndarray:
        totals = self.window.get(layer.name)
        if totals is None:
            return np.zeros(layer.num_experts)
        return totals[: layer.num_experts].double().numpy()

    def imbalances(self, tables: dict[str, PlacementTable] | None = None) -> dict[str, float]:
        """Per layer: max/mean expected tokens per EP rank on the window's loads (1.0 with no load).
        Vectorised (``rebalance_when_imbalance_over`` asks after every step)."""
        out = {}
        for layer in self.layers:
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
        config, mesh = self.config, self.mesh
        tables = {}
        for layer in layers:
            coact = None
            if layer.load.coactivation and layer.name in self.window:
                coact = layer.load.coactivation_matrix(self.window[layer.name]).double().numpy()
            table = refit(self._loads(layer), coact, layer.load.top_k or 1, layer.table,
                          mesh.ep_degree, config.topology, config.rebalance_replicas, config.rebalance_tolerance)
            tables[layer.name] = [list(row) for row in table.rows]
        return tables

    def decide(self) -> dict[str, PlacementTable]:
        """New tables: layer ``i`` fitted by world rank ``i mod W`` (in parallel), then all-gathered, so every
        rank installs the same tables and no floating-point difference between hosts can split them."""
        mesh, layers = self.mesh, self.layers
        mine = self._fit([layer for i, layer in enumerate(layers) if i % mesh.world_size == mesh.rank])
        gathered = mesh.gather_objects(mine, "all_gather of a rebalance's fitted tables")
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
        moved = any(tables[layer.name] != layer.table for layer in self.layers)
        sent = apply_tables(self.model, self.layers, self.reducer, self.config, tables,
                            optimizer if optimizer is not None else self.optimizer)
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
