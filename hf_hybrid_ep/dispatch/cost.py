"""What one MoE layer's token exchange costs one rank, per token, and ``auto``'s choice by that cost.

Pure arithmetic (no tensors): the dispatcher choice (:func:`hf_hybrid_ep.dispatch.resolve_backend`) and the
step-time model (:mod:`hf_hybrid_ep.planning.step_time`) both call it.

Uniform routing over a contiguous placement: each of the ``ep`` ranks holds ``E/ep`` experts and a token's
``k`` distinct experts are drawn uniformly, so a group of ``E_g`` experts holds at least one of them with
probability ``p(E_g) = 1 − C(E − E_g, k)/C(E, k)``. Per token of a rank (``T = 1``), with ``g`` ranks of the
EP group on a node and ``N = ep/g`` nodes:

* **per-pair** (``torch``, ``triton``): ``P = k`` rows, one per (token, expert) pair, a share ``1/ep`` to each
  rank (its own included);
* **dedup**: inside one node ``R = ep · p(E/ep)`` rank rows (``(ep − 1) · p(E/ep)`` leave the rank); across
  nodes ``R_A = N · p(E·g/ep)`` node rows first (``(N − 1) · p(E·g/ep)`` leave the node), then the relays'
  ``R = ep · p(E/ep)`` rank rows (``(ep − N) · p(E/ep)`` leave the relay). Each destination receives as many
  rows as it sends, ``C = R · k`` (row, k) cells of which ``P = k`` hold a pair.

**Link bytes** (:func:`link_bytes`): every row carries ``H · b`` bytes per exchange (4 per training step:
dispatch, combine and their backwards; 6 with activation checkpointing); a deduplicated row adds ``k · (b + 2)``
bytes of routing weights and int16 keys in each dispatch and ``k · b`` weight gradients in its backward.

**Memory bytes** (:func:`memory_bytes`): what the gathers around the exchange read and write, counted the way
``tests/memory_counting.py`` counts each ATen op (a gather reads the rows it picks and an int64 index per row
and writes them; every other op reads its inputs and writes its outputs). With ``h = H · b``, forward and
backward of one layer:

* ``torch``: ``P · (15 h + 40) + T · 3 h`` — the permute (a gather), the weighted combine (a gather and a
  batched product), and their backwards (two gathers for the pair rows and the weight gradients, one for the
  tokens' gradients);
* ``triton``: ``P · 8 h + T · 2 h`` — the fused kernels' loads and stores (not measurable by the ATen counter);
* ``dedup``: per deduplicating stage (``I`` rows in, ``O`` rows out, ``M`` members: ``T, R, ep`` inside one
  node; ``T, R_A, N`` then ``R_A, R, g`` across nodes) ``O · (12 h + 8 k b + 8 k + 16) + I · M · (10 h + 34) +
  I · 2 h`` — the rows picked, packed with their weights and keys, unpacked, and the sums of each input row's
  returned rows (a gather of ``M`` rows per input row, zeroed where it has none, and their sum), both ways —
  and at the destination ``C · (11 h + 25 + 2 b) + P · (6 h + 24) + R · 3 h`` — the fan-out, the partial sums
  (a gather of ``k`` cells per row, zeroed where the cell holds no pair, and a batched product) and their
  backwards. At Qwen3-30B-A3B, EP 8 in one node (``R = 5.3``, ``C = 43``): ``681 h`` against ``123 h`` (torch)
  and ``66 h`` (triton).

The integer bookkeeping (sorting keys, inverse permutations, the row grids: tens of bytes per pair and per
(token, member) cell) is left out: 1–3% of the counted bytes at ``h = 1 KiB``, less above. An EP group of one
rank adds a copy of the rows in each of its exchanges (``2 · rows · h`` each). Activation checkpointing runs each
forward once more. Seconds: link bytes at the topology's bandwidth per level
(an exchange's levels run concurrently, ``max(intra, inter + cross-rack)``; the deduplicated exchange's two
stages one after the other: their sum) plus memory bytes at the device's memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import DISPATCHER_BACKENDS
from ..errors import HybridEPConfigError
from ..parallel.topology import Topology

LINK_LEVELS = ("intra_node", "inter_node", "cross_rack")
# Device memory bandwidth (GB/s) auto prices the gathers at, the same figure on every rank: on CUDA the H100 SXM's
# HBM3 peak (3350 GB/s) × 0.8, the share a streaming gather reaches; on the CPU the bulk copy rate measured on the
# 2-core development machine (17–26 GB/s, benchmarks/training/regime_run.memory_rate_gbps), its lowest.
MEMORY_GBPS = {"cuda": 3350.0 * 0.8, "cpu": 17.0}
INDEX_BYTES = 8  # an int64 row index
KEY_BYTES = 2  # an int16 destination key


@dataclass(frozen=True)
class ExchangeShape:
    """One MoE layer's token exchange seen from one rank of its EP group.

    Attributes:
        per_node: ranks of the EP group on one node (``ep`` when the group lies inside one node).
        per_rack: ranks of the EP group in one rack (``ep`` when it lies inside one rack).
        act_bytes: bytes of one activation element and of one routing weight (2 for bf16, 4 for fp32).
    """

    num_experts: int
    top_k: int
    ep: int
    per_node: int
    per_rack: int
    hidden: int
    act_bytes: int

    @property
    def nodes(self) -> int:
        return max(1, self.ep // self.per_node)

    def hit(self, ranks: int) -> float:
        """``p``: the probability that ``ranks`` ranks' experts hold at least one of a token's ``k``."""
        return node_hit_probability(self.num_experts, self.num_experts * ranks // self.ep, self.top_k)

    def rows(self) -> dict[str, float]:
        """Rows per token of the deduplicated exchange: ``rank_rows`` (R), ``node_rows`` (R_A, 0 inside a node)."""
        return {"rank_rows": self.ep * self.hit(1), "node_rows": self.nodes * self.hit(self.per_node)
                if self.nodes > 1 else 0.0}


def node_hit_probability(num_experts: int, experts_on_node: int, top_k: int) -> float:
    """Probability that a node holding ``experts_on_node`` of ``num_experts`` experts holds at least one of
    a token's ``top_k`` distinct experts, drawn uniformly: ``1 − C(E − E_n, k) / C(E, k)``."""
    return 1.0 - math.comb(num_experts - experts_on_node, top_k) / math.comb(num_experts, top_k)


def link_bytes(shape: ExchangeShape, backend: str, activation_checkpointing: bool = False) -> dict[str, float]:
    """Bytes one rank sends per token and MoE layer over a training step, by link level (module docstring)."""
    s, exchanges = shape, 6 if activation_checkpointing else 4
    if s.ep == 1:
        return dict.fromkeys(LINK_LEVELS, 0.0)
    if backend != "dedup":
        routed = s.top_k * s.hidden * s.act_bytes * exchanges
        return {"intra_node": routed * (s.per_node - 1) / s.ep, "inter_node": routed * (s.per_rack - s.per_node) / s.ep,
                "cross_rack": routed * (s.ep - s.per_rack) / s.ep}
    b, k = s.act_bytes, s.top_k
    row = s.hidden * b * exchanges + k * ((b + KEY_BYTES) * (2 if activation_checkpointing else 1) + b)
    if s.nodes == 1:
        return {"intra_node": s.hit(1) * (s.ep - 1) * row, "inter_node": 0.0, "cross_rack": 0.0}
    node = s.hit(s.per_node) * row
    return {"intra_node": s.hit(1) * (s.ep - s.nodes) * row, "inter_node": node * (s.per_rack // s.per_node - 1),
            "cross_rack": node * ((s.ep - s.per_rack) // s.per_node)}


def _stage_bytes(shape: ExchangeShape, rows_in: float, rows_out: float, members: int) -> tuple[float, float]:
    """(forward, backward) memory bytes of one deduplicating stage per token."""
    h, k, b = shape.hidden * shape.act_bytes, shape.top_k, shape.act_bytes
    sums = rows_in * members * (5 * h + 2 * INDEX_BYTES + 1) + rows_in * h  # gather, zero, sum: once each way
    forward = rows_out * (6 * h + 4 * k * (b + KEY_BYTES) + INDEX_BYTES) + sums
    backward = rows_out * (6 * h + 4 * k * b + INDEX_BYTES) + sums
    return forward, backward


def memory_bytes(shape: ExchangeShape, backend: str, activation_checkpointing: bool = False) -> float:
    """Bytes the gathers around one MoE layer's exchange read and write per token over forward and backward (a
    second forward with activation checkpointing); formulas in the module docstring."""
    s = shape
    h, k, b, pairs = s.hidden * s.act_bytes, s.top_k, s.act_bytes, s.top_k
    if backend == "triton":
        forward, backward, rows = pairs * 3 * h + h, pairs * 5 * h + h, pairs
    elif backend == "torch":
        forward = pairs * (5 * h + 2 * INDEX_BYTES) + h
        backward, rows = pairs * (10 * h + 3 * INDEX_BYTES) + 2 * h, pairs
    elif backend == "dedup":
        counted = s.rows()
        rows = counted["rank_rows"]
        cells = rows * k
        stages = ([(1.0, counted["node_rows"], s.nodes), (counted["node_rows"], rows, s.per_node)] if s.nodes > 1
                  else [(1.0, rows, s.ep)])
        parts = [_stage_bytes(s, *stage) for stage in stages]
        forward = sum(f for f, _ in parts) + pairs * (2 * h + 2 * INDEX_BYTES) + cells * (5 * h + INDEX_BYTES + 1 + b) \
            + rows * h
        backward = sum(w for _, w in parts) + pairs * (4 * h + INDEX_BYTES) + cells * (6 * h + 2 * INDEX_BYTES + b) \
            + rows * 2 * h
    else:
        raise HybridEPConfigError(f"no memory model for dispatcher backend {backend!r}; one of "
                                  f"{[name for name in DISPATCHER_BACKENDS if name != 'auto']}")
    if s.ep == 1:  # the exchange of a group of one rank is a copy of its rows
        forward, backward = forward + 2 * 2 * rows * h, backward + 2 * 2 * rows * h
    return forward * (2 if activation_checkpointing else 1) + backward


def link_seconds(by_level: dict[str, float], topology: Topology, backend: str, nodes: int) -> float:
    """Seconds the exchange's bytes take on the links: levels concurrently, the two stages of the deduplicated
    exchange across nodes one after the other."""
    seconds = {level: by_level[level] / (topology.bandwidth(level) * 1e9) for level in LINK_LEVELS}
    if backend == "dedup" and nodes > 1:
        return sum(seconds.values())
    return max(seconds["intra_node"], seconds["inter_node"] + seconds["cross_rack"])


def exchange_seconds(shape: ExchangeShape, backend: str, topology: Topology, memory_gbps: float,
                     activation_checkpointing: bool = False) -> dict[str, float]:
    """``{"link_s", "memory_s", "total_s"}`` per token and MoE layer over a training step."""
    link = link_seconds(link_bytes(shape, backend, activation_checkpointing), topology, backend, shape.nodes)
    memory = memory_bytes(shape, backend, activation_checkpointing) / (memory_gbps * 1e9)
    return {"link_s": link, "memory_s": memory, "total_s": link + memory}


def cheaper_exchange(shape: ExchangeShape, per_pair: str, topology: Topology,
                     memory_gbps: float) -> tuple[str, dict[str, dict[str, float]]]:
    """``per_pair`` (``"torch"`` or ``"triton"``) or ``"dedup"``, whichever this model predicts faster for
    ``shape`` (per-pair on a tie), and both predictions (:func:`exchange_seconds`)."""
    times = {name: exchange_seconds(shape, name, topology, memory_gbps) for name in (per_pair, "dedup")}
    return ("dedup" if times["dedup"]["total_s"] < times[per_pair]["total_s"] else per_pair), times
