"""Predicted optimizer-step time of a dp × ep layout: compute + exposed communication + optimizer.

All quantities are per GPU and per optimizer step unless stated; seconds, bytes, FLOP and FLOP/s.
Layout dp × ep on W = dp·ep GPUs; the workload is ``tokens_per_step`` tokens over the world, so a
rank sees ``T = tokens_per_step / W`` tokens per step in ``T / (micro_batch · seq_len)`` micro-batches.

Compute (perfect expert load balance: every rank computes the same number of expert tokens):

* FLOPs per token, forward + backward: ``6 · N_active + 6 · L · S · (d_qk + d_v)``, where
  ``N_active = P_dense − P_lookup + (k/E) · P_experts`` (router included in the dense parameters;
  ``P_lookup``: the input-embedding table, a lookup without FLOPs, counted unless it is tied to the
  output projection) and the second term is the attention scores ``Q·Kᵀ`` and the weighted values
  ``P·V`` of every one of the L layers over the full sequence S (``d_qk``, ``d_v``: heads × head
  width; the usual ``12·L·H·S`` when both are H). Not halved for causal masking and not reduced for
  sliding windows (a causal kernel does about half of it). A third of it is the forward, two thirds
  the backward; activation checkpointing recomputes the forward during the backward (×4/3).
* time: ``T · FLOPs per token / (device FLOP/s · efficiency)``, split into forward, backward and
  recompute in the same proportions.

Communication (bytes split by link level as in :mod:`hf_hybrid_ep.planning.planner`: ``intra_node``,
``inter_node``, ``cross_rack``; a level moves its bytes at the topology spec's bandwidth —
``nvlink_gbps``, ``network_gbps``, ``rack_gbps`` — GB/s per GPU):

* token exchange: ``k · T · H · b_a`` bytes routed per MoE layer and exchange (b_a: the recipe's
  activation bytes, 2 for bf16, 4 for fp32), 4 exchanges per layer (dispatch and combine, forward
  and backward; 6 with activation checkpointing), a fraction per level as in the planner. The
  exchanges with peers on different links run concurrently, and the inter-node and cross-rack parts
  share the GPU's NIC, so an all-to-all takes ``max(intra-node s, inter-node s + cross-rack s)``.
  Exposed in full (``a2a_hidden_fraction = 0``): the engine's ``overlap_degree`` pipelining hides
  part of it behind expert compute, not modelled unless that fraction is set. Each exchange collective
  (the counts exchange of every dispatch and the 4 or 6 token exchanges, per MoE layer and micro-batch)
  also costs ``exchange_overhead_s`` (latency and the wait for the slowest peer; default 0, which suits
  large GPU exchanges; measured on a CPU world it is milliseconds);
* with the deduplicated dispatcher (``dispatcher="dedup"``, or ``"auto"`` where the cost below predicts it
  faster) a token travels once to each destination: under uniform routing over a contiguous placement a group
  of ``E_g`` of the E experts holds one of a token's k distinct experts with probability
  ``p(E_g) = 1 − C(E − E_g, k)/C(E, k)``. Inside one node, ``p(E/ep) · (ep − 1) · T`` rows per exchange go
  to the other ranks. Across ``N = ep/g`` nodes, stage A sends ``p(E·g/ep) · T`` rows to each other node
  (inter-node or cross-rack by where it sits) and the relays forward ``p(E/ep) · (ep − N) · T`` rows
  inside the nodes (a rank's rows to the rank with its own local index stay there); the two stages run
  one after the other (``a2a s = intra-node s + inter-node s + cross-rack s``), two collectives per
  exchange. Every row carries ``H · b_a`` bytes of activations per exchange; the dispatch adds
  ``k · (b_a + 2)`` bytes of routing weights and keys, its backward ``k · b_a``
  (:func:`hf_hybrid_ep.dispatch.cost.link_bytes`);
* the gathers around the exchange, as bytes read and written in device memory at ``memory_gbps``
  (:func:`hf_hybrid_ep.dispatch.cost.memory_bytes`, per token and MoE layer; ``h = H · b_a``): the per-pair
  exchange's permute and weighted combine, forward and backward, ``k · 15 h + 3 h`` unfused (``"torch"``),
  ``k · 8 h + 2 h`` with the fused Triton kernels (``"triton"``); the deduplicated exchange's row picking,
  packing, fan-out, partial sums and node sums, several times more (about ``5 ×`` the torch path's at
  Qwen3-30B-A3B, EP 8 in one node). Serial with the compute (``exchange_memory_s``), never hidden;
* ``dispatcher="auto"`` models what the engine picks on CUDA: the per-pair exchange with the fused kernels
  or the deduplicated one, whichever :func:`hf_hybrid_ep.dispatch.cost.cheaper_exchange` predicts faster for
  the layout (links and memory together, memory at the engine's CUDA figure whatever ``memory_gbps`` says);
* gradient reduction, once per step (gradient accumulation reduces on the last micro-batch only):
  dense gradients (``P_dense · b_g``) over the world, expert gradients (``P_experts/ep · b_g``) over
  the EDP group of dp ranks, hierarchical ring all-reduces (a reduce-scatter — half the bytes — with
  ``optimizer_sharding="zero1"``, and for the dense gradients with ``dense_sharding="fsdp"``); the
  levels of one collective are summed (its phases run one after the other). The bucketed reducer
  overlaps it with the backward of the last micro-batch (recompute included): hidden =
  ``min(reduction s, that backward's compute s)``, exposed = the rest. Optimistic in that the first
  bucket is ready only after the last layer's backward;
* ZeRO-1 parameter all-gather after the step (``optimizer_sharding="zero1"``): the updated weights
  (``b_w`` bytes each) of the dense shard over the world (unless FSDP holds them sharded) and of the
  expert shard over the EDP group, half an all-reduce's bytes; exposed in full (the engine waits for
  it in the next forward's pre-hooks, and this model does not credit that);
* FSDP2 (``dense_sharding="fsdp"``): the dense weights are all-gathered for the forward and again for
  the backward of every micro-batch, exposed in full (FSDP2's one-layer prefetch is not credited).

Optimizer: memory-bound, ``updated parameters · (2·(b_w + b_o) + b_g) / memory bandwidth`` (it reads
the gradient, reads and writes the weights and the optimizer state; b_o: optimizer-state bytes per
parameter of the recipe, 12 for bf16 AdamW); updated parameters: those whose state the rank keeps
(a shard with ZeRO-1).

Step: ``compute + exchange gathers + exposed token exchange + exposed gradient reduction + ZeRO-1 gather +
FSDP gathers + optimizer``; samples/s = ``tokens_per_step / seq_len / step``. No latency term, no kernel-launch or
routing overhead beyond the efficiency factor, no straggler from load imbalance.

Hybrid against pure EP (:func:`compare`): ``T*`` is the tokens per rank per step at which the hybrid's
cross-node expert-gradient bytes (reduction + ZeRO-1 gather) equal pure EP's cross-node token-exchange
bytes; for one EDP rank per node this is ``(E/ep_h) · 3I · b_g · 2(d−1)/d ÷ (n_x · k · b_a · f_x)``
(n_x = 4 exchanges, 6 with checkpointing; f_x: share of a token's experts on other nodes under pure
EP). ``r_x`` is pure EP's cross-node token-exchange time over its compute time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..config import DENSE_SHARDINGS, DISPATCHER_BACKENDS, OPTIMIZER_SHARDINGS, check_int
from ..dispatch.cost import (
    MEMORY_GBPS,
    ExchangeShape,
    cheaper_exchange,
    link_bytes,
    link_seconds,
    memory_bytes,
)
from ..errors import HybridEPConfigError
from ..parallel.topology import Topology
from .counts import RECIPES, ModelCounts, allreduce_split, rank_state_bytes, ranks_per_level, trained_params

H100_BF16_FLOPS = 989e12  # dense bf16 peak, FLOP/s (H100 SXM)
H100_MEMORY_GBPS = 3350.0  # HBM3, GB/s (H100 SXM)
DEFAULT_EFFICIENCY = 0.4
LINK_LEVELS = ("intra_node", "inter_node", "cross_rack")

Levels = dict[str, float]


@dataclass(frozen=True)
class StepTime:
    """Every term of the predicted step time of one layout (per GPU, per optimizer step).

    Byte fields are dicts ``{"intra_node", "inter_node", "cross_rack"} → bytes`` by the link crossed;
    ``*_s`` fields are seconds; FLOP fields are per token.
    """

    dp: int
    ep: int
    tokens_per_step: int  # over the world
    tokens_per_rank: int  # T
    micro_batches: int  # per rank per step
    samples_per_step: int  # sequences of seq_len tokens over the world
    activation_checkpointing: bool
    matmul_flops_per_token: float  # 6 · N_active (forward + backward)
    attention_flops_per_token: float  # 6 · L · S · (d_qk + d_v) (forward + backward)
    recompute_flops_per_token: float  # the forward again with activation checkpointing, else 0
    flops_per_token: float  # the sum of the three
    effective_flops: float  # device FLOP/s × efficiency
    forward_s: float
    backward_s: float
    recompute_s: float
    compute_s: float
    a2a_bytes: Levels
    a2a_s_by_level: Levels
    a2a_s: float  # max(intra, inter + cross-rack)
    a2a_hidden_s: float
    a2a_exposed_s: float
    dense_grad_bytes: Levels
    expert_grad_bytes: Levels
    grad_reduce_s_by_level: Levels
    grad_reduce_s: float
    grad_hide_window_s: float  # backward (+ recompute) compute of the last micro-batch
    grad_reduce_hidden_s: float
    grad_reduce_exposed_s: float
    zero1_dense_gather_bytes: Levels
    zero1_expert_gather_bytes: Levels
    zero1_gather_s: float  # exposed in full
    fsdp_gather_bytes: Levels  # all micro-batches, forward and backward
    fsdp_gather_s: float  # exposed in full
    optimizer_params: int  # parameters this rank's optimizer updates
    optimizer_bytes_touched: int
    optimizer_s: float
    exposed_comm_s: float  # a2a + gradient reduction + ZeRO-1 gather + FSDP gathers, exposed parts
    step_s: float
    tokens_per_s: float  # over the world
    samples_per_s: float  # over the world
    dispatcher: str = "torch"  # the token exchange modelled: "torch", "triton" (one row per pair) or "dedup"
    exchange_memory_bytes: float = 0.0  # read + written by the gathers around the token exchange
    exchange_memory_s: float = 0.0  # those bytes at the device's memory bandwidth


def zero_levels(value: float = 0.0) -> Levels:
    """``value`` at every link level."""
    return dict.fromkeys(LINK_LEVELS, value)


def _scaled(split: dict[str, float], factor: float) -> Levels:
    return {level: split[level] * factor for level in LINK_LEVELS}


def _seconds(split: Levels, topo: Topology) -> Levels:
    return {level: split[level] / (topo.bandwidth(level) * 1e9) for level in LINK_LEVELS}


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HybridEPConfigError(f"{name} must be a positive finite number, got {value!r}")


def check_step_inputs(world: int, tokens_per_step: int, micro_batch: int, seq_len: int, device_flops: float,
                      efficiency: float, memory_gbps: float, a2a_hidden_fraction: float = 0.0,
                      exchange_overhead_s: float = 0.0) -> None:
    """Raise :class:`HybridEPConfigError` naming the first bad value of a step-time workload."""
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("world", world),
                        ("tokens_per_step", tokens_per_step)):
        check_int(name, value)
    unit = world * micro_batch * seq_len
    if tokens_per_step % unit:
        raise HybridEPConfigError(
            f"tokens_per_step={tokens_per_step} is not a multiple of gpus × micro_batch × seq_len = {world} × "
            f"{micro_batch} × {seq_len} = {unit}: every rank must run whole micro-batches (nearest: "
            f"{max(1, round(tokens_per_step / unit)) * unit})")
    _positive("device FLOP/s", device_flops)
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise HybridEPConfigError(f"efficiency must be in (0, 1] (achieved / peak FLOP/s), got {efficiency!r}")
    _positive("memory bandwidth (GB/s)", memory_gbps)
    if isinstance(exchange_overhead_s, bool) or not isinstance(exchange_overhead_s, (int, float)) \
            or not 0 <= exchange_overhead_s < math.inf:
        raise HybridEPConfigError(f"exchange_overhead_s must be a finite number ≥ 0, got {exchange_overhead_s!r}")
    if not 0 <= a2a_hidden_fraction <= 1:
        raise HybridEPConfigError(f"a2a_hidden_fraction must be in [0, 1], got {a2a_hidden_fraction!r}")


def predict_step_time(counts: ModelCounts, dp: int, ep: int, topology: Topology | str | None, *,
                      tokens_per_step: int, micro_batch: int = 1, seq_len: int = 4096,
                      activation_checkpointing: bool = False, device_flops: float = H100_BF16_FLOPS,
                      efficiency: float = DEFAULT_EFFICIENCY, memory_gbps: float = H100_MEMORY_GBPS,
                      optimizer_sharding: str = "none", dense_sharding: str = "replicate",
                      recipe: str = "bf16-adamw", a2a_hidden_fraction: float = 0.0,
                      exchange_overhead_s: float = 0.0, dispatcher: str = "torch") -> StepTime:
    """Predicted step time of layout ``dp × ep`` (formulas in the module docstring).

    Args:
        counts: parameter counts and shapes (:func:`hf_hybrid_ep.planning.planner.count_parameters`).
        dp, ep: the layout; EP groups are consecutive ranks, EDP groups ``{r + i·ep}``.
        topology: a :class:`Topology` or its spec string; link bandwidths come from it.
        tokens_per_step: tokens per optimizer step over the whole world (a multiple of
            ``dp·ep·micro_batch·seq_len``).
        micro_batch, seq_len: sequences per micro-batch and tokens per sequence.
        activation_checkpointing: recompute the forward during the backward.
        device_flops: peak FLOP/s of one GPU; ``efficiency`` ∈ (0, 1] the achieved share (MFU).
        memory_gbps: device memory bandwidth in GB/s, for the optimizer term and the exchange's gathers.
        optimizer_sharding, dense_sharding, recipe: as in :func:`hf_hybrid_ep.planning.planner.plan`.
        a2a_hidden_fraction: share of the token exchange hidden behind expert compute (0: none).
        exchange_overhead_s: fixed seconds per exchange collective (latency, waiting for peers).
        dispatcher: the engine's ``dispatcher`` setting: ``"dedup"`` models one row per token and destination
            node and rank, ``"torch"`` / ``"triton"`` one row per (token, expert) (unfused / fused gathers),
            ``"auto"`` what the engine picks on CUDA (:func:`modelled_exchange`).
    """
    topo = Topology.of(topology)
    world = dp * ep
    check_step_inputs(world, tokens_per_step, micro_batch, seq_len, device_flops, efficiency, memory_gbps,
                      a2a_hidden_fraction, exchange_overhead_s)
    _check_layout_choices(counts, ep, recipe, optimizer_sharding, dense_sharding)
    if dispatcher not in DISPATCHER_BACKENDS:
        raise HybridEPConfigError(f"dispatcher={dispatcher!r} is not one of {list(DISPATCHER_BACKENDS)}")
    topo.check_world(world)
    b_w, b_g, _ = RECIPES[recipe]
    tokens = tokens_per_step // world
    micro_batches = tokens // (micro_batch * seq_len)
    compute = _compute_terms(counts, tokens, seq_len, activation_checkpointing, device_flops * efficiency)
    exchange = _exchange_terms(counts, topo, ep, tokens, micro_batches, b_w, activation_checkpointing, dispatcher,
                               exchange_overhead_s, a2a_hidden_fraction, memory_gbps)
    window = (compute["backward_s"] + compute["recompute_s"]) / micro_batches
    reduction = _reduction_terms(counts, topo, dp, ep, b_g, optimizer_sharding, dense_sharding, window)
    gathers = _gather_terms(counts, topo, dp, ep, b_w, micro_batches, optimizer_sharding, dense_sharding)
    optimizer = _optimizer_terms(counts, dp, ep, recipe, optimizer_sharding, dense_sharding, memory_gbps)
    exposed = (exchange["a2a_exposed_s"] + reduction["grad_reduce_exposed_s"] + gathers["zero1_gather_s"]
               + gathers["fsdp_gather_s"])
    step_s = compute["compute_s"] + exchange["exchange_memory_s"] + exposed + optimizer["optimizer_s"]
    return StepTime(
        dp=dp, ep=ep, tokens_per_step=tokens_per_step, tokens_per_rank=tokens, micro_batches=micro_batches,
        samples_per_step=tokens_per_step // seq_len, activation_checkpointing=activation_checkpointing,
        **compute, **exchange, **reduction, **gathers, **optimizer,
        exposed_comm_s=exposed, step_s=step_s, tokens_per_s=tokens_per_step / step_s,
        samples_per_s=tokens_per_step / seq_len / step_s,
    )


def _check_layout_choices(counts: ModelCounts, ep: int, recipe: str, optimizer_sharding: str,
                          dense_sharding: str) -> None:
    if recipe not in RECIPES:
        raise HybridEPConfigError(f"recipe {recipe!r} is not one of {sorted(RECIPES)}")
    if optimizer_sharding not in OPTIMIZER_SHARDINGS:
        raise HybridEPConfigError(f"optimizer_sharding={optimizer_sharding!r} is not one of {list(OPTIMIZER_SHARDINGS)}")
    if dense_sharding not in DENSE_SHARDINGS:
        raise HybridEPConfigError(f"dense_sharding={dense_sharding!r} is not one of {list(DENSE_SHARDINGS)}")
    if counts.num_experts % ep:
        raise HybridEPConfigError(f"ep={ep} does not divide the {counts.num_experts} experts")


def _compute_terms(counts: ModelCounts, tokens: int, seq_len: int, activation_checkpointing: bool,
                   rate: float) -> dict[str, float]:
    """FLOPs per token (matmuls of the active parameters, attention, recompute) and seconds per step
    of one rank's ``tokens`` at ``rate`` FLOP/s."""
    active = counts.dense_params - counts.embedding_lookup_params + counts.expert_params * counts.top_k / counts.num_experts
    layers = counts.moe_layers + counts.dense_layers
    qk = counts.qk_dim or counts.hidden
    v = counts.v_dim or counts.hidden
    matmul = 6.0 * active
    if counts.lora_r:  # frozen bases: no weight gradients (backward = activation gradients); adapters trained
        matmul = 4.0 * active + 6.0 * (counts.adapter_dense_params
                                       + counts.adapter_expert_params * counts.top_k / counts.num_experts)
    attention = 6.0 * layers * seq_len * (qk + v)
    recompute = (matmul + attention) / 3 if activation_checkpointing else 0.0
    forward_s = tokens * (matmul + attention) / 3 / rate
    backward_s = 2 * forward_s
    recompute_s = tokens * recompute / rate
    return {"matmul_flops_per_token": matmul, "attention_flops_per_token": attention,
            "recompute_flops_per_token": recompute, "flops_per_token": matmul + attention + recompute,
            "effective_flops": rate, "forward_s": forward_s, "backward_s": backward_s, "recompute_s": recompute_s,
            "compute_s": forward_s + backward_s + recompute_s}


def exchange_shape(counts: ModelCounts, topo: Topology, ep: int, b_a: int) -> ExchangeShape:
    """One MoE layer's token exchange on a rank of the EP group ``0..ep−1`` (activations of ``b_a`` bytes)."""
    g, in_rack, _, _ = ranks_per_level(topo, list(range(ep)))
    return ExchangeShape(counts.num_experts, counts.top_k, ep, g, in_rack, counts.hidden, b_a)


def modelled_exchange(dispatcher: str, shape: ExchangeShape, topo: Topology) -> str:
    """The exchange ``dispatcher`` runs: ``"torch"``, ``"triton"`` or ``"dedup"`` as given; ``"auto"`` as the engine
    picks it on CUDA, the devices this model plans for: the per-pair exchange with the fused Triton kernels or the
    deduplicated one, whichever :func:`hf_hybrid_ep.dispatch.cost.cheaper_exchange` predicts faster at these links
    and the engine's CUDA memory figure (:data:`hf_hybrid_ep.dispatch.cost.MEMORY_GBPS`)."""
    if dispatcher != "auto":
        return dispatcher
    return cheaper_exchange(shape, "triton", topo, MEMORY_GBPS["cuda"])[0] if shape.ep > 1 else "triton"


def _exchange_terms(counts: ModelCounts, topo: Topology, ep: int, tokens: int, micro_batches: int, b_a: int,
                    activation_checkpointing: bool, dispatcher: str, exchange_overhead_s: float,
                    a2a_hidden_fraction: float, memory_gbps: float) -> dict[str, Any]:
    """The token exchange over the EP group (ranks 0..ep-1): bytes and seconds per link level, the
    collectives' fixed costs, the hidden share, and the bytes its gathers move in memory. Activations travel in
    the compute dtype (``b_a``)."""
    exchanges = 6 if activation_checkpointing else 4
    shape = exchange_shape(counts, topo, ep, b_a)
    backend = modelled_exchange(dispatcher, shape, topo)
    layer_tokens = tokens * counts.moe_layers
    a2a = {level: b * layer_tokens for level, b in link_bytes(shape, backend, activation_checkpointing).items()}
    a2a_by_level = _seconds(a2a, topo)
    a2a_s = link_seconds(a2a, topo, backend, shape.nodes)
    collectives = (2 * exchanges + 1 if backend == "dedup" and shape.nodes > 1 else exchanges + 1) if ep > 1 else 0
    a2a_s += collectives * counts.moe_layers * micro_batches * exchange_overhead_s
    a2a_hidden = a2a_s * a2a_hidden_fraction
    memory = memory_bytes(shape, backend, activation_checkpointing) * layer_tokens
    return {"a2a_bytes": a2a, "a2a_s_by_level": a2a_by_level, "a2a_s": a2a_s, "a2a_hidden_s": a2a_hidden,
            "a2a_exposed_s": a2a_s - a2a_hidden, "dispatcher": backend, "exchange_memory_bytes": memory,
            "exchange_memory_s": memory / (memory_gbps * 1e9)}


def _reduction_terms(counts: ModelCounts, topo: Topology, dp: int, ep: int, b_g: int, optimizer_sharding: str,
                     dense_sharding: str, window: float) -> dict[str, Any]:
    """Gradient reduction (all-reduce, or reduce-scatter: half the bytes), hidden up to the last
    micro-batch's backward (``window`` seconds)."""
    world_ranks, edp_ranks = list(range(dp * ep)), [i * ep for i in range(dp)]
    dense_factor = 0.5 if optimizer_sharding == "zero1" or dense_sharding == "fsdp" else 1.0
    expert_factor = 0.5 if optimizer_sharding == "zero1" else 1.0
    dense, expert = trained_params(counts)
    dense_grad = _scaled(allreduce_split(topo, world_ranks, dense * b_g), dense_factor)
    expert_grad = _scaled(allreduce_split(topo, edp_ranks, expert / ep * b_g), expert_factor)
    reduce_by_level = _seconds({lv: dense_grad[lv] + expert_grad[lv] for lv in LINK_LEVELS}, topo)
    reduce_s = sum(reduce_by_level.values())
    reduce_hidden = min(reduce_s, window)
    return {"dense_grad_bytes": dense_grad, "expert_grad_bytes": expert_grad, "grad_reduce_s_by_level": reduce_by_level,
            "grad_reduce_s": reduce_s, "grad_hide_window_s": window, "grad_reduce_hidden_s": reduce_hidden,
            "grad_reduce_exposed_s": reduce_s - reduce_hidden}


def _gather_terms(counts: ModelCounts, topo: Topology, dp: int, ep: int, b_w: int, micro_batches: int,
                  optimizer_sharding: str, dense_sharding: str) -> dict[str, Any]:
    """ZeRO-1's parameter all-gather after the step; FSDP2's weight gathers every micro-batch."""
    world_ranks, edp_ranks = list(range(dp * ep)), [i * ep for i in range(dp)]
    zero_dense, zero_expert = zero_levels(), zero_levels()
    dense, expert = trained_params(counts)
    if optimizer_sharding == "zero1":
        if dense_sharding == "replicate":
            zero_dense = _scaled(allreduce_split(topo, world_ranks, dense * b_w), 0.5)
        zero_expert = _scaled(allreduce_split(topo, edp_ranks, expert / ep * b_w), 0.5)
    zero_s = sum(_seconds({lv: zero_dense[lv] + zero_expert[lv] for lv in LINK_LEVELS}, topo).values())
    fsdp = zero_levels()
    if dense_sharding == "fsdp":
        fsdp = _scaled(allreduce_split(topo, world_ranks, counts.dense_params * b_w), 0.5 * 2 * micro_batches)
    return {"zero1_dense_gather_bytes": zero_dense, "zero1_expert_gather_bytes": zero_expert, "zero1_gather_s": zero_s,
            "fsdp_gather_bytes": fsdp, "fsdp_gather_s": sum(_seconds(fsdp, topo).values())}


def _optimizer_terms(counts: ModelCounts, dp: int, ep: int, recipe: str, optimizer_sharding: str,
                     dense_sharding: str, memory_gbps: float) -> dict[str, float]:
    """The optimizer step as memory traffic: every updated parameter's weight, state and gradient."""
    b_w, b_g, b_o = RECIPES[recipe]
    state = rank_state_bytes(counts, dp, ep, 0, recipe, optimizer_sharding, dense_sharding)
    updated = state["optimizer_bytes"] // b_o
    touched = updated * (2 * (b_w + b_o) + b_g)
    return {"optimizer_params": updated, "optimizer_bytes_touched": touched,
            "optimizer_s": touched / (memory_gbps * 1e9)}


def _cross(split: Levels) -> float:
    return split["inter_node"] + split["cross_rack"]


def compare(hybrid: StepTime, pure_ep: StepTime) -> dict[str, Any]:
    """The predicted hybrid / pure-EP ratio and what explains it, for two layouts of one workload.

    Returns ``ratio`` (hybrid samples/s over pure EP's), ``T`` (tokens per rank per step), ``T_star``
    (the crossover of the module docstring; ``None`` when pure EP sends nothing across nodes),
    ``T_over_T_star`` (``None`` likewise; ``inf`` when the hybrid's expert gradients stay in a node),
    ``r_x`` (pure EP's cross-node token-exchange seconds over its compute seconds) and both step times.
    """
    if hybrid.tokens_per_rank != pure_ep.tokens_per_rank:
        raise HybridEPConfigError(f"the two layouts see different workloads: {hybrid.tokens_per_rank} vs "
                                  f"{pure_ep.tokens_per_rank} tokens per rank per step")
    per_token = _cross(pure_ep.a2a_bytes) / pure_ep.tokens_per_rank
    hybrid_bytes = _cross(hybrid.expert_grad_bytes) + _cross(hybrid.zero1_expert_gather_bytes)
    t_star = hybrid_bytes / per_token if per_token else None
    t = pure_ep.tokens_per_rank
    over = None if t_star is None else (t / t_star if t_star else math.inf)
    return {"hybrid": {"dp": hybrid.dp, "ep": hybrid.ep}, "pure_ep": {"dp": pure_ep.dp, "ep": pure_ep.ep},
            "ratio": hybrid.samples_per_s / pure_ep.samples_per_s, "T": t, "T_star": t_star, "T_over_T_star": over,
            "r_x": _cross(pure_ep.a2a_s_by_level) / pure_ep.compute_s,
            "hybrid_step_s": hybrid.step_s, "pure_ep_step_s": pure_ep.step_s}


@dataclass(frozen=True)
class Calibration:
    """Achieved fwd+bwd FLOP/s of a stack of square linear layers on this machine."""

    flops_per_s: float
    device: str
    dtype: str
    size: int  # n: tokens = in = out features of each of ``layers`` linear layers
    layers: int
    repeats: int
    seconds: float  # wall time of the whole calibration


def calibrate_compute(budget_s: float = 10.0, device: str | None = None, layers: int = 4) -> Calibration:
    """Measure achieved forward + backward matmul FLOP/s on this machine within ``budget_s`` seconds.

    A chain of ``layers`` bias-free ``n × n`` linear maps applied to ``n`` tokens that need gradients
    (``6·n³`` FLOP per layer: forward, input gradient, weight gradient), bf16 on CUDA, fp32 on CPU.
    ``n`` doubles from 256 (CPU) / 1024 (CUDA) while one pass takes under ``budget_s / 20`` (at most
    2048 / 8192), then passes repeat until the budget would be exceeded; the rate is the median pass.
    This is the rate of dense GEMMs: attention, routing and the token exchange's local work run slower,
    so the achieved training rate is lower. ``budget_s`` must be in (0, 30].
    """
    import torch

    if not 0 < budget_s <= 30:
        raise HybridEPConfigError(f"calibration budget must be in (0, 30] seconds, got {budget_s!r}")
    start = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n, largest = (1024, 8192) if dev.type == "cuda" else (256, 2048)

    def one_pass(size: int) -> float:
        weights = [torch.randn(size, size, device=dev, dtype=dtype, requires_grad=True) for _ in range(layers)]
        x = torch.randn(size, size, device=dev, dtype=dtype, requires_grad=True)
        sync()
        begin = time.perf_counter()
        h = x
        for w in weights:
            h = h @ w
        h.backward(torch.ones_like(h))
        sync()
        return time.perf_counter() - begin

    one_pass(n)  # warm-up (kernel selection, allocator)
    elapsed = one_pass(n)
    while elapsed < budget_s / 20 and n < largest and time.perf_counter() - start + 8 * elapsed < budget_s / 2:
        n *= 2
        elapsed = one_pass(n)
    times = [elapsed]
    while time.perf_counter() - start + max(times) < budget_s and len(times) < 1000:
        times.append(one_pass(n))
    times.sort()
    median = times[len(times) // 2]
    return Calibration(flops_per_s=6 * n**3 * layers / median, device=str(dev), dtype=str(dtype).removeprefix("torch."),
                       size=n, layers=layers, repeats=len(times), seconds=time.perf_counter() - start)
