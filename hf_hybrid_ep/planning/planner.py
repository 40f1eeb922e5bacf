"""Memory and communication estimates for every dp × ep layout, before booking a cluster.

Memory model (per GPU, layout dp × ep on W = dp·ep GPUs):

* parameters held: ``P_dense + P_experts / ep`` (counted exactly from the model built on the meta
  device: every tensor of the transformers model, experts found structurally);
* training state per held parameter, recipe ``bf16-adamw`` (the default): bf16 weights 2 B + bf16
  gradients 2 B + fp32 master weights 4 B + fp32 Adam moments 4 + 4 B = 16 B; ``fp32-adamw``:
  4 + 4 + 4 + 4 = 16 B (no master copy); ``bf16-sgd``: 2 + 2 + 4 = 8 B;
* sharding (``--optimizer-sharding``, ``--dense-sharding``; docs/memory.md), exact per rank:
  ``zero1`` keeps optimizer state for one shard of a flat bucket: the dense parameters (N elements)
  over all W ranks, a rank's experts (M = P_experts/ep) over its dp EDP ranks; a bucket of N elements
  over G ranks gives member i ``clamp(N − i·ceil(N/G), 0, ceil(N/G))`` elements. ``fsdp`` shards each
  dense tensor on dim 0 over W ranks (FSDP2): rank r keeps ``clamp(d0 − r·ceil(d0/W), 0, ceil(d0/W))``
  rows of weights, gradients and optimizer state. The table shows rank 0, which holds the most;
* LoRA (``--lora-r R``): every held parameter keeps its weight bytes, the adapters' ``r·(in + out)`` per adapted
  matrix (dense ones whole, a rank's experts' ones) added; gradients and optimizer state (and their ZeRO-1
  shards) are the adapters' only, and so are the reduced gradient bytes; compute counts ``4·N_active`` (no
  weight gradients of the frozen base) plus ``6·`` the active adapter parameters;
* activations for one micro-batch of B sequences of S tokens, bf16, per layer (Korthikanti et al.
  2022, with a fused/flash attention kernel so no S×S score matrix is stored, plus the routed-expert
  tensors): ``B·S·(10·H + k·(2·H + 6·I)) + 4·B·S·E`` bytes for an MoE layer (k experts per token of
  width I, E experts) and ``34·B·S·H`` for a dense layer. With activation checkpointing: the layer
  inputs ``2·B·S·H`` per layer plus one layer's full activations.

Communication per optimizer step (n micro-batches per GPU, ``tokens_per_step / (W·B·S)``, one by
default; bf16 gradients and activations):

* dense gradient all-reduce over the world (ring): ``2·(W−1)/W · 2·P_dense``;
* expert gradient all-reduce over each EDP group of dp ranks: ``2·(dp−1)/dp · 2·P_experts/ep``;
* all-to-all per MoE layer and micro-batch: ``k·B·S·H·2`` bytes routed, a fraction ``(ep−1)/ep``
  crossing ranks, for dispatch and combine, forward and backward (×4; ×6 with checkpointing, which
  recomputes the forward).

Topology (``--topology``, :mod:`hf_hybrid_ep.parallel.topology`): ranks fill nodes of ``gpus_per_node`` GPUs
and racks of ``nodes_per_rack`` nodes; EP groups are consecutive ranks, so an EP group lies inside a
node when ep ≤ GPUs per node and spans ep / gpus_per_node whole nodes otherwise (a layout whose EP
group would straddle a node boundary is left out). Bytes are split per GPU by the link they cross:

* all-to-all: routed tokens go to each EP rank of the group with equal probability, so of the
  ``k·B·S·H·2`` routed bytes a fraction ``(g−1)/ep`` stays inside the node (g: GPUs of the group on
  one node), ``(ep_rack − g)/ep`` crosses nodes inside a rack, ``(ep − ep_rack)/ep`` crosses racks
  (ep_rack: GPUs of the group in one rack);
* all-reduces run hierarchically: reduce-scatter and all-gather inside the node
  (``2·(g−1)/g · size`` over the intra-node link), then a ring over the N nodes on 1/g of the data
  (``2·(N−1)/N · size/g`` over the network; it crosses racks when the group spans racks).

Communication time without overlap (``est_step_comm_s``): per level, bytes / that level's bandwidth
(GB/s per GPU); the levels of one collective are summed (NVLink, network and spine are used one after
the other by a hierarchical collective), and the collectives of a step are summed (no overlap assumed).

Predicted step time (``step_time``, :mod:`hf_hybrid_ep.planning.step_time`, whose docstring states every
formula): ``compute + exposed communication + optimizer``, where compute = ``T · (6·N_active +
6·L·S·(d_qk + d_v)) / (device FLOP/s · efficiency)`` (×4/3 with checkpointing; T tokens per GPU per
step, N_active = dense − input-embedding lookup + k/E · expert parameters), the token exchange is
exposed in full (``max`` of the intra-node and the network part: they run concurrently), the
gradient reduction is hidden behind the last micro-batch's backward up to that backward's length,
ZeRO-1 and FSDP2 gathers are exposed in full, and the optimizer reads and writes its state at the
memory bandwidth. A layout that fits only with activation checkpointing is timed with it. The
recommended layout is the fastest predicted that fits (a tie goes to less memory); the fastest
hybrid (dp > 1, ep > 1) is compared with pure EP (dp = 1): the samples/s ratio, ``T/T*`` (T* the
tokens per GPU and step at which the hybrid's cross-node expert-gradient bytes equal pure EP's
cross-node token bytes) and ``r_x`` (pure EP's cross-node token-exchange time / compute time).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig

from ..checkpoint.format import format_bytes
from ..moe.lora import DEFAULT_LORA_TARGETS
from ..parallel.topology import Topology, ep_group_span
from .counts import (  # noqa: F401  (re-exported: the planner's public names of 0.1)
    KNOWN_CONFIGS,
    RECIPES,
    ModelCounts,
    activation_bytes,
    allreduce_split,
    count_parameters,
    load_config,
    rank_state_bytes,
    ranks_per_level,
    trained_params,
    with_lora,
)
from .step_time import (
    DEFAULT_EFFICIENCY,
    H100_BF16_FLOPS,
    H100_MEMORY_GBPS,
    StepTime,
    check_step_inputs,
    compare,
    predict_step_time,
)


@dataclass
class LayoutPlan:
    dp: int
    ep: int
    params_per_gpu: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    activation_bytes_checkpointed: int
    memory_per_gpu_bytes: int
    memory_per_gpu_checkpointed_bytes: int
    fits: bool
    fits_with_checkpointing: bool
    allreduce_bytes_per_step: int
    a2a_bytes_per_step: int
    comm_bytes_per_step: int
    est_step_comm_s: float
    ep_group: str = "intra_node"  # intra_node | hierarchical | cross_rack (topology.ep_group_span)
    comm_bytes_intra_node: int = 0  # per GPU per step, by the link level crossed
    comm_bytes_inter_node: int = 0
    comm_bytes_cross_rack: int = 0
    step_time: StepTime | None = None  # predicted step (hf_hybrid_ep.planning.step_time), checkpointed unless it fits without


def plan_layout(m: ModelCounts, gpus: int, dp: int, ep: int, memory_bytes: int, topo: Topology,
                batch: int, seq: int, recipe: str, optimizer_sharding: str = "none",
                dense_sharding: str = "replicate", micro_batches: int = 1) -> LayoutPlan:
    """Memory, fit and communication bytes of one layout; ``micro_batches`` per GPU per step."""
    w, g, o = RECIPES[recipe]
    rank0 = rank_state_bytes(m, dp, ep, 0, recipe, optimizer_sharding, dense_sharding)  # rank 0 holds the most
    held = rank0["params"]
    act, act_ckpt = activation_bytes(m, batch, seq)
    state = rank0["weight_bytes"] + rank0["grad_bytes"] + rank0["optimizer_bytes"]
    dense, expert = trained_params(m)  # the parameters whose gradients are reduced
    dense_ar = 2 * (gpus - 1) / gpus * dense * g if gpus > 1 else 0
    expert_ar = 2 * (dp - 1) / dp * (expert / ep) * g if dp > 1 else 0
    routed = m.top_k * batch * seq * m.hidden * 2 * m.moe_layers * micro_batches
    a2a = routed * (ep - 1) / ep * 4
    split = _comm_split(gpus, dp, ep, topo, dense * g, expert / ep * g, routed * 4)
    seconds = sum(split[level] / (topo.bandwidth(level) * 1e9) for level in split)
    group = ep_group_span(gpus, ep, topo).kind if _follows(gpus, ep, topo) else "straddles_nodes"
    return LayoutPlan(
        dp=dp, ep=ep, params_per_gpu=held, weight_bytes=rank0["weight_bytes"], grad_bytes=rank0["grad_bytes"],
        optimizer_bytes=rank0["optimizer_bytes"],
        activation_bytes=act, activation_bytes_checkpointed=act_ckpt, memory_per_gpu_bytes=state + act,
        memory_per_gpu_checkpointed_bytes=state + act_ckpt, fits=state + act <= memory_bytes,
        fits_with_checkpointing=state + act_ckpt <= memory_bytes, allreduce_bytes_per_step=int(dense_ar + expert_ar),
        a2a_bytes_per_step=int(a2a), comm_bytes_per_step=int(dense_ar + expert_ar + a2a), est_step_comm_s=seconds,
        ep_group=group, comm_bytes_intra_node=int(split["intra_node"]), comm_bytes_inter_node=int(split["inter_node"]),
        comm_bytes_cross_rack=int(split["cross_rack"]),
    )


def _comm_split(gpus: int, dp: int, ep: int, topo: Topology, dense_bytes: float, expert_bytes: float,
                a2a_routed: float) -> dict[str, float]:
    """Per-GPU bytes per step by link level: dense all-reduce over the world, expert all-reduce over an
    EDP group (ranks ``{r + i·ep}``), all-to-all over an EP group (ranks ``0..ep−1``)."""
    out = allreduce_split(topo, list(range(gpus)), dense_bytes)
    for level, b in allreduce_split(topo, [i * ep for i in range(dp)], expert_bytes).items():
        out[level] += b
    if ep > 1:
        g, in_rack, _, _ = ranks_per_level(topo, list(range(ep)))
        out["intra_node"] += a2a_routed * (g - 1) / ep
        out["inter_node"] += a2a_routed * (in_rack - g) / ep
        out["cross_rack"] += a2a_routed * (ep - in_rack) / ep
    return out


def plan(model: str | PretrainedConfig, gpus: int, gpu_memory_gib: float, topology: str | None = None,
         micro_batch: int = 1, seq_len: int = 4096, recipe: str = "bf16-adamw", optimizer_sharding: str = "none",
         dense_sharding: str = "replicate", *, trust_remote_code: bool = False, tokens_per_step: int | None = None,
         device_flops: float | None = None, efficiency: float | None = None, memory_gbps: float | None = None,
         calibration: dict[str, Any] | None = None, dispatcher: str = "auto", lora_r: int | None = None,
         lora_target_modules: list[str] | None = None, lora_target_parameters: list[str] | None = None,
         ) -> dict[str, Any]:
    """Every dp × ep layout of ``gpus`` GPUs: memory, communication, predicted step time, fit; the
    recommended layout (the fastest predicted that fits, with activation checkpointing where only that
    fits; a tie goes to less memory) and the fastest hybrid against pure EP.

    ``tokens_per_step`` (over the world; default one micro-batch per GPU), ``device_flops`` (peak FLOP/s
    of a GPU; default H100 bf16, 989e12), ``efficiency`` (default 0.4) and ``memory_gbps`` (default
    3350) feed :func:`hf_hybrid_ep.planning.step_time.predict_step_time`; ``calibration`` (a
    :class:`~hf_hybrid_ep.planning.step_time.Calibration` as a dict) is recorded with them. Link bandwidths come
    from ``topology``. ``dispatcher`` (as ``HybridEPConfig.dispatcher``) decides how the token exchange is
    modelled: ``"dedup"`` (and ``"auto"`` where the engine picks it) counts one row per token and destination node and
    rank.
    ``trust_remote_code=True`` lets a config's ``auto_map`` code run; off, it never runs.
    ``lora_r``: only LoRA adapters of that rank train (:func:`~hf_hybrid_ep.planning.counts.with_lora`; targets
    default to :data:`hf_hybrid_ep.moe.lora.DEFAULT_LORA_TARGETS`): the base is frozen, gradients, their
    reduction and optimizer state are the adapters' only."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r} is not one of {sorted(RECIPES)}")
    sources = {"device_flops": "default" if device_flops is None else "given",
               "efficiency": "default" if efficiency is None else "given",
               "memory_gbps": "default" if memory_gbps is None else "given"}
    if calibration is not None:
        sources.update(device_flops="calibrated", efficiency="calibrated")
    device_flops = H100_BF16_FLOPS if device_flops is None else device_flops
    efficiency = DEFAULT_EFFICIENCY if efficiency is None else efficiency
    memory_gbps = H100_MEMORY_GBPS if memory_gbps is None else memory_gbps
    tokens_per_step = gpus * micro_batch * seq_len if tokens_per_step is None else tokens_per_step
    check_step_inputs(gpus, tokens_per_step, micro_batch, seq_len, device_flops, efficiency, memory_gbps)
    config = load_config(model, trust_remote_code=trust_remote_code) if isinstance(model, str) else model
    counts = count_parameters(config, trust_remote_code)
    if lora_r is not None:
        targets = {"target_modules": lora_target_modules, "target_parameters": lora_target_parameters}
        targets = {k: DEFAULT_LORA_TARGETS[k] if v is None else v for k, v in targets.items()}
        counts = with_lora(counts, config, lora_r, **targets, trust_remote_code=trust_remote_code)
    topo = Topology.parse(topology)
    memory = int(gpu_memory_gib * 2**30)
    topo.check_world(gpus)
    sharding = (optimizer_sharding, dense_sharding)
    micro_batches = tokens_per_step // (gpus * micro_batch * seq_len)
    layouts = [plan_layout(counts, gpus, gpus // ep, ep, memory, topo, micro_batch, seq_len, recipe, *sharding,
                           micro_batches=micro_batches)
               for ep in range(1, gpus + 1) if gpus % ep == 0 and counts.num_experts % ep == 0
               and _follows(gpus, ep, topo)]
    for p in layouts:
        p.step_time = predict_step_time(
            counts, p.dp, p.ep, topo, tokens_per_step=tokens_per_step, micro_batch=micro_batch, seq_len=seq_len,
            activation_checkpointing=not p.fits and p.fits_with_checkpointing, device_flops=device_flops,
            efficiency=efficiency, memory_gbps=memory_gbps, optimizer_sharding=optimizer_sharding,
            dense_sharding=dense_sharding, recipe=recipe, dispatcher=dispatcher)
    fitting = [p for p in layouts if p.fits_with_checkpointing]
    best = min(fitting, key=lambda p: (p.step_time.step_s, _memory_used(p)), default=None)
    result: dict[str, Any] = {
        "model": {k: v for k, v in asdict(counts).items() if k != "dense_shapes"}, "gpus": gpus, "gpu_memory_bytes": memory, "topology": asdict(topo),
        "topology_spec": topology, "micro_batch": micro_batch, "seq_len": seq_len, "recipe": recipe,
        "optimizer_sharding": optimizer_sharding, "dense_sharding": dense_sharding,
        "step_time_model": {
            "tokens_per_step": tokens_per_step, "device_flops": device_flops, "efficiency": efficiency,
            "dispatcher": dispatcher,
            "effective_flops": device_flops * efficiency, "memory_gbps": memory_gbps, "sources": sources,
            "calibration": calibration,
            "links": {"source": "topology spec", "intra_node_gbps": topo.nvlink_gbps,
                      "inter_node_gbps": topo.network_gbps, "cross_rack_gbps": topo.rack_gbps},
        },
        "layouts": [asdict(p) for p in layouts],
        "recommended": None if best is None else {"dp": best.dp, "ep": best.ep,
                                                  "activation_checkpointing": not best.fits},
        "hybrid_vs_pure_ep": _hybrid_vs_pure_ep(layouts, compare),
    }
    if best is None:
        result["advice"] = _advice(counts, gpus, gpu_memory_gib, memory, topo, micro_batch, seq_len, recipe, layouts,
                                   sharding)
    return result


def _memory_used(p: LayoutPlan) -> int:
    """Bytes per GPU of a layout as it would run: checkpointed when only that fits."""
    return p.memory_per_gpu_bytes if p.fits or not p.fits_with_checkpointing else p.memory_per_gpu_checkpointed_bytes


def _hybrid_vs_pure_ep(layouts: list[LayoutPlan], compare: Any) -> dict[str, Any] | None:
    """The fastest hybrid layout (dp > 1 and ep > 1; among those that fit, if any do) against pure EP
    (dp = 1), with ``fits`` for each side; ``None`` when either is missing."""
    hybrids = [p for p in layouts if p.dp > 1 and p.ep > 1]
    hybrids = [p for p in hybrids if p.fits_with_checkpointing] or hybrids
    pure = next((p for p in layouts if p.dp == 1 and p.ep > 1), None)
    if not hybrids or pure is None:
        return None
    hybrid = min(hybrids, key=lambda p: (p.step_time.step_s, _memory_used(p)))
    out = compare(hybrid.step_time, pure.step_time)
    out["hybrid"]["fits"] = hybrid.fits_with_checkpointing
    out["pure_ep"]["fits"] = pure.fits_with_checkpointing
    return out


def _follows(gpus: int, ep: int, topo: Topology) -> bool:
    """Whether EP groups of ``ep`` consecutive ranks lie inside a node or span whole nodes."""
    try:
        ep_group_span(gpus, ep, topo)
    except ValueError:
        return False
    return True


def _advice(counts: ModelCounts, gpus: int, gpu_memory_gib: float, memory: int, topo: Topology, batch: int, seq: int,
            recipe: str, layouts: list[LayoutPlan], sharding: tuple[str, str] = ("none", "replicate")) -> dict[str, Any]:
    """What would fit. Without sharding memory per GPU depends on ep only, so find the smallest ep that fits;
    with sharding more data parallelism also helps, so try dp up to 1024 as well (fewest GPUs first)."""
    smallest = min(layouts, key=lambda p: p.memory_per_gpu_checkpointed_bytes)
    eps = [ep for ep in range(1, counts.num_experts + 1) if counts.num_experts % ep == 0]
    dps = [1] if sharding == ("none", "replicate") else [2**i for i in range(11)]
    candidates = sorted(((dp * ep, dp, ep) for ep in eps for dp in dps), key=lambda c: (c[0], c[2]))
    fitting = [(dp, ep) for _, dp, ep in candidates
               if plan_layout(counts, dp * ep, dp, ep, memory, topo, batch, seq, recipe, *sharding).fits_with_checkpointing]
    leanest = plan_layout(counts, eps[-1] * dps[-1], dps[-1], eps[-1], memory, topo, batch, seq, recipe, *sharding)
    if fitting:
        dp, ep = fitting[0]
        needed = math.lcm(dp * ep, gpus)  # a GPU count that the fitting world divides (more dp: no more memory)
        message = (f"nothing fits on {gpus} × {gpu_memory_gib:g} GiB: the leanest layout here (dp {smallest.dp} × ep "
                   f"{smallest.ep}, checkpointed) needs {smallest.memory_per_gpu_checkpointed_bytes / 2**30:.1f} GiB per "
                   f"GPU; with {needed} GPUs (ep {ep}) a layout fits")
        return {"memory_per_gpu_needed_bytes": smallest.memory_per_gpu_checkpointed_bytes, "gpus_needed": needed,
                "message": message}
    message = (f"nothing fits on {gpus} × {gpu_memory_gib:g} GiB, and more GPUs of this size do not help: even at ep = "
               f"{eps[-1]} (one expert per rank) a GPU holds the dense weights plus its experts, "
               f"{leanest.memory_per_gpu_checkpointed_bytes / 2**30:.1f} GiB with checkpointing; it needs GPUs with at "
               "least that much memory, or optimizer-state / dense-weight sharding")
    return {"memory_per_gpu_needed_bytes": leanest.memory_per_gpu_checkpointed_bytes, "gpus_needed": None,
            "message": message}


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.4g} TFLOP/s"


def _topology_line(result: dict[str, Any]) -> str:
    """The cluster the plan assumes: GPUs per node (and racks), whether given or the default."""
    topo = result["topology"]
    racks = f", {topo['nodes_per_rack']} nodes per rack" if topo.get("nodes_per_rack") else ""
    given = result.get("topology_spec")
    source = f"--topology {given}" if given else "the default; give --topology gpus_per_node=N,... for your cluster"
    return (f"assumed: {topo['gpus_per_node']} GPUs per node{racks} ({source}); memory in GiB (2^30 bytes), "
            "bandwidths in GB/s (10^9 bytes/s)")


def format_plan(result: dict[str, Any]) -> str:
    """The plan as text: a header, one table row per layout, the step-time assumptions, the
    recommendation and the hybrid / pure-EP comparison."""
    m = result["model"]
    model = result["step_time_model"]
    tokens = model["tokens_per_step"]
    per_gpu = tokens // result["gpus"]
    lines = [f"{m['model_type']}: {m['total_params'] / 1e9:.2f}B parameters ({m['dense_params'] / 1e9:.2f}B dense, "
             f"{m['expert_params'] / 1e9:.2f}B in {m['num_experts']} experts × {m['moe_layers']} MoE layers, top-{m['top_k']}); "
             f"{result['gpus']} GPUs × {result['gpu_memory_bytes'] / 2**30:g} GiB, recipe {result['recipe']}, "
             f"optimizer sharding {result.get('optimizer_sharding', 'none')}, dense {result.get('dense_sharding', 'replicate')}, "
             f"micro-batch {result['micro_batch']} × {result['seq_len']} tokens; {tokens} tokens per step "
             f"({tokens // result['seq_len']} samples, {per_gpu // (result['micro_batch'] * result['seq_len'])} "
             f"micro-batches per GPU)",
             _topology_line(result),
             *([f"LoRA rank {m['lora_r']}: {m['adapter_dense_params'] / 1e6:.3g}M dense and "
                f"{m['adapter_expert_params'] / 1e6:.3g}M expert adapter parameters train; the base is frozen (weights "
                "only: no gradients, no reduction, no optimizer state for it)"] if m.get("lora_r") else []),
             "| dp × ep | params/GPU | state GiB | activations GiB (ckpt) | total GiB (ckpt) | fits | comm MiB/step | "
             "comm s (no overlap) | compute s | exposed comm s | step s | samples/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["layouts"]:
        state = (p["weight_bytes"] + p["grad_bytes"] + p["optimizer_bytes"]) / 2**30
        fits = "yes" if p["fits"] else ("ckpt" if p["fits_with_checkpointing"] else "no")
        t = p["step_time"]
        lines.append(f"| {p['dp']} × {p['ep']} | {p['params_per_gpu'] / 1e9:.2f}B | {state:.1f} | "
                     f"{p['activation_bytes'] / 2**30:.1f} ({p['activation_bytes_checkpointed'] / 2**30:.1f}) | "
                     f"{p['memory_per_gpu_bytes'] / 2**30:.1f} ({p['memory_per_gpu_checkpointed_bytes'] / 2**30:.1f}) | "
                     f"{fits} | {p['comm_bytes_per_step'] / 2**20:.0f} | {p['est_step_comm_s']:.3f} | "
                     f"{t['compute_s']:.4g} | {t['exposed_comm_s']:.4g} | {t['step_s']:.4g} | {t['samples_per_s']:.4g} |")
    if m.get("quantization"):
        lines.append(f"checkpoint: {m['quantization']}, {format_bytes(m['checkpoint_bytes'])} (the tensors the model "
                     f"loads); `hf-hybrid-ep convert` writes {format_bytes(m['converted_bytes'])} (dequantized to "
                     "bfloat16)")
    src, links = model["sources"], model["links"]
    if model["calibration"] is not None:
        c = model["calibration"]
        compute = (f"compute at {_rate(model['effective_flops'])}, measured on this machine (--calibrate: "
                   f"fwd+bwd of {c['layers']} × {c['size']}² {c['dtype']} GEMMs on {c['device']}, "
                   f"{c['repeats']} passes, {c['seconds']:.1f} s)")
    else:
        compute = (f"compute at {_rate(model['device_flops'])} peak × efficiency {model['efficiency']:g} = "
                   f"{_rate(model['effective_flops'])} ({src['device_flops']} peak, {src['efficiency']} efficiency)")
    where = model["calibration"]["links"] if model["calibration"] else "from the topology spec"
    lines.append(f"step time (ckpt rows checkpointed): {compute}; links {where} "
                 f"(intra-node {links['intra_node_gbps']:g}, inter-node {links['inter_node_gbps']:g}, cross-rack "
                 f"{links['cross_rack_gbps']:g} GB/s per GPU); optimizer and exchange gathers at "
                 f"{model['memory_gbps']:g} GB/s memory ({src['memory_gbps']})")
    deduplicated = [f"{p['dp']} × {p['ep']}" for p in result["layouts"]
                    if p["step_time"].get("dispatcher") == "dedup"]
    lines.append(f"token exchange as dispatcher={model.get('dispatcher', 'torch')!r}: "
                 + (f"one row per token and destination node and rank for {', '.join(deduplicated)}; one row per "
                    "token and expert elsewhere" if deduplicated else "one row per token and expert"))
    rec = result["recommended"]
    if rec is None:
        lines.append(result["advice"]["message"])
    else:
        best = next(p for p in result["layouts"] if (p["dp"], p["ep"]) == (rec["dp"], rec["ep"]))
        lines.append(f"recommended: dp {rec['dp']} × ep {rec['ep']}"
                     + (" with activation checkpointing" if rec["activation_checkpointing"] else "")
                     + f" (fastest predicted that fits): {best['step_time']['step_s']:.4g} s/step, "
                     f"{best['step_time']['samples_per_s']:.4g} samples/s")
    cmp = result.get("hybrid_vs_pure_ep")
    if cmp is None:
        lines.append("hybrid / pure EP: no pair here (needs a layout with dp > 1 and ep > 1 and one with dp = 1)")
    else:
        h, e = cmp["hybrid"], cmp["pure_ep"]
        star = ("pure EP sends no token across nodes" if cmp["T_star"] is None
                else f"T* = {cmp['T_star']:.5g} (T/T* = {cmp['T_over_T_star']:.4g})")
        lines.append(f"hybrid dp {h['dp']} × ep {h['ep']}{'' if h['fits'] else ' (does not fit)'} / pure EP dp 1 × "
                     f"ep {e['ep']}{'' if e['fits'] else ' (does not fit)'}: {cmp['ratio']:.3g} × samples/s predicted; "
                     f"T = {cmp['T']} tokens/rank/step, {star}; r_x = {cmp['r_x']:.3g} (pure EP's cross-node token "
                     "exchange s / compute s)")
    return "\n".join(lines)
