"""A prepared GPU check: one command on one CUDA GPU, at most 8 minutes, two result files.

    timeout 480 python -m benchmarks.bench_gpu_check --out-dir gpu_check_out   # one CUDA GPU
    python -m benchmarks.bench_gpu_check --dry-run --out-dir /tmp/x             # CPU, tiny shapes, the same code
    python -m benchmarks.bench_gpu_check --sections g,m --out-dir gpu_check_out # a rerun of some sections

Dependencies are checked first (torch with CUDA unless ``--dry-run``, triton, transformers, accelerate); a
missing one stops the run within seconds with a message naming it. Every model is built from a transformers
``Qwen3MoeConfig`` with random weights: nothing is downloaded. Each section runs on its own (an exception in
one is recorded as ``{"status": "failed", "error": <traceback tail>}`` and the next one runs); the exit code
is 0 only when every section is ``"ok"``.

Sections (shapes on the GPU; ``--dry-run`` runs the same code with tiny ones):

a. ``dispatch_kernels`` -- the Triton permute and unpermute-combine kernels (the ``"triton"`` dispatcher's
   ``_permute`` / ``_unpermute_combine``) against the torch dispatcher's, forward and backward, at
   T = 4k / 16k tokens, H = 4096, k = 2 / 8, E = 64 / 256; also their masked paths (``masked_*``: EP rank 0
   of 2 with remote, shadowed and dropped pairs) and ``fused_gather_rows``' padded regroup (``padded_regroup``)
   against indexing. fp32: relative error <= 1e-6. bf16: both paths
   are compared with the torch path in fp32 on the same values; the Triton error must be <= 2x the torch
   error (floor 2**-9, half a bf16 ulp). GB/s of the forward kernels against a device-to-device copy
   (median of per-call ``torch.cuda.Event`` timings, the helpers of ``benchmarks.common.kernels``).
b. ``experts_implementation`` -- transformers' experts implementation ``"hybrid_ep_triton"`` (registered by
   ``import hf_hybrid_ep``) against ``"grouped_mm"`` on one experts module with fixed routing, same shapes:
   output and gradients (input, routing weights, expert weights) against ``"eager"`` in fp32 (same 2x rule;
   fp32 relative error <= 1e-5), and forward + backward time.
c. ``engine`` -- ``hep.parallelize`` at world 1 (a one-rank NCCL process group on the GPU, so the mesh is a
   CUDA one; no process group in ``--dry-run``, as the tests do) with dispatcher ``"torch"``, ``"triton"``,
   ``"dedup"`` (its packed rows, fan-out and partial sums on the device; the Triton kernels serve the per-pair
   layout only) and ``"auto"`` (records which one auto-selection picked; ``"triton"`` expected on CUDA at
   world 1, where nothing crosses ranks), ZeRO-1
   (``optimizer_sharding="zero1"``, ``hep.make_optimizer``: fused AdamW), the bucketed gradient reducer,
   ``hep.clip_grad_norm_``, on a ~1.8 B-parameter Qwen3-MoE-shaped model in bf16 for a few steps: every
   parameter's first-step gradient against an fp32 reference, within 3x the distance of the reference computed
   in bf16 (fp32 runs: 1e-5); losses against the same model trained without the engine (bf16: relative
   <= 2e-2 per step; fp32: 1e-5); the ``"auto"`` run starts from a copy on the CPU, which ``parallelize`` must
   place on ``cuda:0``;
   tokens/s, MFU (6 x active parameters x tokens per second over an assumed 989 TFLOP/s, H200 dense bf16;
   attention's sequence-length term not counted) and ``hep.memory_report`` against
   ``torch.cuda.max_memory_allocated``.
d. ``offloaded_decoding`` -- greedy decoding with a 25 % expert budget through
   ``hep.load_offloaded(path, capacity, prefetch=True, device="cuda")`` and through ``hep.offload`` of a model on
   the CPU (memory store, no prefetch; every tensor but the experts must land on the GPU) against the fully
   resident model and accelerate's ``cpu_offload`` of the same checkpoint: tokens/s, cache hit rate and prefetch
   recall; fp32 tokens must be identical (asserted); bf16 records the first position where offloaded and
   resident differ.
e. ``save_resume`` -- an fp32 model built on the CPU and parallelized (ZeRO-1, fused AdamW) takes one step, is
   saved (streamed hybrid-EP checkpoint: the device memory the save allocates must stay within one layer's
   experts) with its optimizer state (its peak device memory recorded), resumed with ``hep.from_pretrained`` and ``load_optimizer_state`` (the
   parameters and AdamW's ``step`` must be on ``cuda:0``), and both take one more step: equal losses and
   parameters (relative 1e-5).
f. ``autocast`` -- fp32 weights under ``torch.autocast(bfloat16)``: the engine's grouped GEMMs must run in bf16,
   its rows be 2·H bytes in the dispatcher's counters, and every fp32 gradient be within 3x the bf16 round-off
   of the fp32 reference (the reference under autocast with eager experts).

g-l. the multi-rank sections (``benchmarks/gpu_check_ranks.py``): 4 rank processes sharing this one device, a
   gloo process group bound to it (NCCL refuses two ranks on one GPU; gloo carries CUDA tensors through pinned
   host memory), a ~130 M-parameter Qwen3-MoE in fp32, every result against the unsharded model trained by torch
   alone in the same process on the global batch, per parameter (relative 1e-4 on the GPU, 1e-5 on the CPU):
   g. ``exchanges`` at dp 1 × ep 4 -- the per-pair exchange (``"torch"`` and ``"triton"``), the deduplicated one
      inside one node (its members) and across two emulated nodes (``topology="gpus_per_node=2"``: the relay
      stage), ``overlap_degree=2`` (twice the dispatch calls) and activation checkpointing (the recompute repeats
      every exchange, from the autograd engine's device thread): loss, clipping norm, first-step gradients and
      parameters after the step, and rows that crossed to other ranks (across the nodes only with the topology);
   h. ``reducer_zero1`` at dp 2 × ep 2 -- the bucketed reducer (several buckets, launched while backward runs,
      dense and expert bytes reduced) and ZeRO-1 (``ShardedAdamW``, each rank keeping a quarter of the dense
      state) for 3 steps; then the peak device memory of a streamed save (at most one layer's experts) and of an
      optimizer-state save (at most the dense optimizer state, which ZeRO-1 assembles whole, and one layer's);
   i. ``lora`` -- PEFT's LoRA on attention and on the experts against PEFT's own code path;
   j. ``eval_layout`` -- logits inside ``hep.eval_layout(model, 1)`` equal to the training layout's and the
      reference's, the layout back afterwards and a training step after it still equal;
   k, l. ``HybridEP(Trainer)`` and ``HybridEP(SFTTrainer)`` at dp 2 × ep 2 for 3 steps: logged losses and gradient
      norms against the same trainer in one process (run here, before the ranks start), DDP wrapping the model
      (``SFTConfig``'s default turns activation checkpointing on: the recompute under the Trainer too).
m. ``sync_debug`` -- one ZeRO-1 training step at world 1 (one-rank NCCL) under
   ``torch.cuda.set_sync_debug_mode("error")`` must finish; the step before it, under ``"warn"``, lists every
   synchronising call (file:line). It cannot run in the multi-rank job: gloo's CUDA collectives synchronise
   their copies on their own threads, which the process-wide mode flags.

Expected run time on one H200: sections a-f 3-5 minutes (mostly model building, Triton compilation and section
e's files), g-l 1-2 minutes (4 processes starting, then small steps whose collectives cross host memory), m
seconds; not yet measured. The report files are rewritten after every section, so a run cut short by the
timeout keeps every finished section; ``--sections`` reruns a subset. ``--dry-run`` takes about a minute on two
idle CPU cores (4 rank processes for g-l).

What it cannot verify: NCCL at world > 1 (NCCL refuses two ranks on one GPU) and therefore no collective speed:
sections c, e, f and m run with a one-rank NCCL group, and g-l move every collective through host memory. At
world 1 the reducer allocates no buckets and reduces nothing (section c records its counters, all zero); section
h runs it. ``--dry-run`` skips every bf16 comparison (the Triton interpreter's bf16 arithmetic is broken), all
CUDA timing and memory figures, and the sync-debug mode (CUDA only).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEAK_BF16_FLOPS = 989e12
NCCL_NOTE = ("NCCL is not verified by this check: NCCL refuses two ranks on one GPU, so the multi-rank sections "
             "(g-l) run 4 ranks on this one device with gloo carrying the tensors through host memory")
GRAD_REDUCTION_NOTE = ("at world 1 the bucketed gradient reducer attaches no bucket buffers and reduces nothing "
                       "('gradient_reduction' records 0 reductions); section h runs it at world 4")
DRY_RUN_NOTE = ("dry run: CPU, tiny shapes, Triton interpreter, fp32 only -- bf16 comparisons and CUDA timings "
                "skipped (the interpreter's bf16 arithmetic is broken)")
FP32_KERNEL_TOL = 1e-6
FP32_EXPERTS_TOL = 1e-5
BF16_FLOOR = 2.0**-9
BF16_FACTOR = 2.0
LOSS_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
OFFLOAD_NO_PREFETCH = "hf_hybrid_ep offloaded (memory store, no prefetch)"
FP32_GRAD_TOL = 1e-5  # per parameter, relative (fp32 round-off of another summation order)
SAFETY = 3.0  # a lower-precision run may differ from fp32 by this many times its reference's own distance


@dataclass(frozen=True)
class Sizes:
    """Every size of one run: ``shapes`` are (T tokens, H hidden, k, E experts) for sections a and b."""

    dry_run: bool
    device: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, int, int, int], ...]
    expert_width: Callable[[int], int]
    reps: int
    engine_model: dict[str, int] = field(default_factory=dict)
    engine_batch: tuple[int, int] = (1, 1)
    engine_steps: int = 3
    decode_model: dict[str, int] = field(default_factory=dict)
    decode_prompt: int = 8
    decode_tokens: int = 8
    # the multi-rank sections (benchmarks/gpu_check_ranks.py): world 4 on one device, fp32
    ranks_model: dict[str, int] = field(default_factory=dict)
    ranks_batch: tuple[int, int] = (2, 16)  # (sequences per rank, tokens per sequence)
    ranks_steps: int = 2
    ranks_bucket_mb: float = 0.02  # small, so that a step fills several gradient buckets
    ranks_timeout_s: float = 600.0  # the 4 rank processes are killed after this


def cuda_sizes() -> Sizes:
    shapes = tuple((t, 4096, k, e) for t in (4096, 16384) for k in (2, 8) for e in (64, 256))
    return Sizes(
        dry_run=False, device="cuda", dtypes=("float32", "bfloat16"), shapes=shapes,
        expert_width=lambda hidden: hidden // 8, reps=10,
        engine_model=dict(hidden=2048, layers=8, experts=64, top_k=8, expert_width=512, vocab=32000, heads=16,
                          kv_heads=4),
        engine_batch=(4, 2048), engine_steps=4,
        decode_model=dict(hidden=1024, layers=4, experts=32, top_k=4, expert_width=768, vocab=32000, heads=8,
                          kv_heads=4),
        decode_prompt=32, decode_tokens=32,
        ranks_model=dict(hidden=1024, layers=4, experts=16, top_k=4, expert_width=512, vocab=8192, heads=8,
                         kv_heads=4),
        ranks_batch=(2, 256), ranks_steps=3, ranks_bucket_mb=4.0, ranks_timeout_s=300.0,
    )


def dry_sizes() -> Sizes:
    return Sizes(
        dry_run=True, device="cpu", dtypes=("float32",), shapes=((48, 256, 2, 8), (32, 128, 3, 16)),
        expert_width=lambda hidden: 32, reps=1,
        engine_model=dict(hidden=64, layers=2, experts=8, top_k=2, expert_width=32, vocab=256, heads=4, kv_heads=2),
        engine_batch=(2, 16), engine_steps=3,
        decode_model=dict(hidden=64, layers=2, experts=8, top_k=2, expert_width=32, vocab=256, heads=4, kv_heads=2),
        decode_prompt=6, decode_tokens=6,
        ranks_model=dict(hidden=64, layers=2, experts=8, top_k=2, expert_width=32, vocab=256, heads=4, kv_heads=2),
    )


# ----------------------------------------------------------------------------------------------------------------
# dependencies
# ----------------------------------------------------------------------------------------------------------------


def missing_dependencies(dry_run: bool) -> list[str]:
    """One message per missing dependency (empty when the check can run); imports torch only when present."""
    problems = [f"the '{name}' package is not installed (pip install {name})"
                for name in ("torch", "triton", "transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if problems:
        return problems
    import torch

    if not dry_run and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
        return [f"CUDA is not available ({build}); run on a CUDA GPU, or use --dry-run for the CPU rehearsal "
                "with tiny shapes"]
    try:
        import triton  # noqa: F401
    except Exception as exc:
        problems.append(f"'triton' is installed but cannot be imported: {type(exc).__name__}: {exc}")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------------------


def rel_err(got, want) -> float:
    """``||got - want|| / ||want||`` in fp64 (0 when both are zero)."""
    got, want = got.double(), want.double()
    denom = want.norm().item()
    diff = (got - want).norm().item()
    return diff / denom if denom else diff


def bf16_bound(torch_err: float) -> float:
    """Largest accepted Triton bf16 error (vs fp32) given the torch path's bf16 error."""
    return max(BF16_FACTOR * torch_err, BF16_FLOOR)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def free_cuda_cache(device: str) -> None:
    """Collect reference cycles (parallelized models, hooks) and, on CUDA, return cached blocks."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def qwen3_moe_config(hidden: int, layers: int, experts: int, top_k: int, expert_width: int, vocab: int,
                     heads: int, kv_heads: int):
    """A Qwen3-MoE config of these sizes (every layer MoE, head_dim = hidden / heads, sdpa attention)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=expert_width,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )


def build_model(spec: dict[str, int], device: str, dtype, seed: int = 0):
    """A randomly initialised ``Qwen3MoeForCausalLM`` built directly on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(qwen3_moe_config(**spec), dtype=dtype)


def _dtype(name: str):
    import torch

    return getattr(torch, name)


# ----------------------------------------------------------------------------------------------------------------
# a. dispatch kernels
# ----------------------------------------------------------------------------------------------------------------


def _dispatchers(experts: int, ep: int = 1):
    from hf_hybrid_ep.dispatch import CommStats, PlacementTable, TorchDispatcher, TritonDispatcher

    table = PlacementTable.contiguous(experts, ep)
    return {"torch": TorchDispatcher(table, 0, None, CommStats()),
            "triton": TritonDispatcher(table, 0, None, CommStats())}


def masked_case(tokens: int, hidden: int, k: int, experts: int, device: str) -> dict:
    """EP rank 0 of 2 (no process group: the plan is computed locally): distinct experts per token, every
    fifth token's last pair dropped (-1), expert ``E/2`` (on rank 1) held here as a shadow, so the pairs are
    local, remote, shadowed and dropped; fp32 activations for every masked path of the kernels."""
    import torch

    from hf_hybrid_ep.dispatch import SideChannel

    g = torch.Generator(device=device).manual_seed(4)
    index = torch.rand(tokens, experts, device=device, generator=g).topk(k, dim=-1).indices
    index[::5, -1] = -1
    shadow = torch.full((experts,), -1, dtype=torch.long, device=device)
    shadow[experts // 2] = 0
    (plan,) = _dispatchers(experts, ep=2)["torch"].plan(index, SideChannel(local_slot_of=shadow))
    f = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    return {"index": index, "shadow_slot_of": shadow, "masked_x": f(tokens, hidden),
            "masked_back": f(plan.num_sent, hidden), "masked_shadow": f(plan.num_local, hidden),
            "masked_weights": torch.rand(tokens, k, device=device, generator=g), "regroup_rows": f(plan.num_sent, hidden)}


def masked_outputs(name: str, case: dict, experts: int, grad: Any) -> dict[str, Any]:
    """Forward and backward of dispatcher ``name``'s permute and combine on :func:`masked_case` (remote,
    shadowed and dropped pairs), and of the regroup to expert-major order padded to 8 rows per slot (the
    Triton ``fused_gather_rows``; indexing with zero padding for the torch path). ``grad`` scales every output."""
    import torch

    from hf_hybrid_ep.dispatch import SideChannel
    from hf_hybrid_ep.moe.experts import regroup_index

    paths = _dispatchers(experts, ep=2)
    d = paths[name]
    (plan,) = paths["torch"].plan(case["index"], SideChannel(local_slot_of=case["shadow_slot_of"]))
    x, back, shadow, w, rows = (case[n].detach().requires_grad_() for n in
                                ("masked_x", "masked_back", "masked_shadow", "masked_weights", "regroup_rows"))
    k = case["index"].shape[1]
    permuted = d._permute(x, plan.order, plan.num_sent, k)
    combined = d._finish_combine(back, w, plan, shadow)
    index, destination, _, _ = regroup_index(plan.received, paths["triton"].table.slots_per_rank, alignment=8)
    if name == "triton":
        regrouped = d._kernels.fused_gather_rows(rows, index, destination)
    else:
        regrouped = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])[torch.where(index >= 0, index, rows.shape[0])]
    outputs = {"masked_permute": permuted, "masked_combine": combined, "padded_regroup": regrouped}
    loss = sum((o.float() * grad).sum() for o in outputs.values())
    gx, gback, gshadow, gw, grows = torch.autograd.grad(loss, (x, back, shadow, w, rows))
    return {**{n: o.detach() for n, o in outputs.items()}, "masked_permute_backward": gx,
            "masked_combine_backward_rows": gback, "masked_combine_backward_shadow": gshadow,
            "masked_combine_backward_weights": gw, "padded_regroup_backward": grows}


def _handle(batch: dict, tokens: int, k: int):
    from types import SimpleNamespace

    return SimpleNamespace(num_dropped=0, position=batch["position"], order=batch["order"], num_tokens=tokens,
                           top_k=k)


def permute_combine(dispatcher, batch: dict, tokens: int, k: int, grads: tuple) -> dict[str, Any]:
    """Forward and backward of one dispatcher's permute ([T, H] -> [T*k, H]) and unpermute-combine
    ([T*k, H], [T, k] -> [T, H]); ``grads`` = (grad of the permuted rows [T*k, H], grad of the combined
    tokens [T, H])."""
    import torch

    x = batch["x"].detach().requires_grad_()
    rows_in = batch["rows"].detach().requires_grad_()
    w = batch["weights"].detach().requires_grad_()
    rows = dispatcher._permute(x, batch["order"], tokens * k, k)
    (grad_x,) = torch.autograd.grad(rows, x, grads[0])
    combined = dispatcher._unpermute_combine(rows_in, w, _handle(batch, tokens, k))
    grad_rows, grad_w = torch.autograd.grad(combined, (rows_in, w), grads[1].to(combined.dtype))
    return {"permute": rows.detach(), "permute_backward": grad_x, "combine": combined.detach(),
            "combine_backward_rows": grad_rows, "combine_backward_weights": grad_w}


def _cast_batch(batch: dict, dtype) -> dict:
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in batch.items()}


def kernel_equality(shape: tuple[int, int, int, int], dtypes: tuple[str, ...], device: str) -> dict[str, Any]:
    """Relative errors of the Triton path per output; fp32 against the torch path, bf16 against the
    torch path in fp32 (with the torch bf16 error and the bound it sets)."""
    import torch

    from benchmarks.common.kernels import routed_batch

    tokens, hidden, k, experts = shape
    paths = _dispatchers(experts)
    batch32 = routed_batch(tokens, hidden, k, experts, device, torch.float32)
    g = torch.Generator(device=device).manual_seed(1)
    grads32 = (torch.randn(tokens * k, hidden, device=device, generator=g),
               torch.randn(tokens, hidden, device=device, generator=g))
    out: dict[str, Any] = {}
    case = masked_case(tokens, hidden, k, experts, device)

    def run(name: str, batch: dict, grads: tuple, masked: dict) -> dict[str, Any]:
        return {**permute_combine(paths[name], batch, tokens, k, grads), **masked_outputs(name, masked, experts, 1.5)}

    ref32 = run("torch", batch32, grads32, case)
    tri32 = run("triton", batch32, grads32, case)
    out["float32"] = {name: {"rel_err": rel_err(tri32[name], ref32[name]), "tol": FP32_KERNEL_TOL} for name in ref32}
    del tri32
    if "bfloat16" in dtypes:
        batch16, case16 = _cast_batch(batch32, torch.bfloat16), _cast_batch(case, torch.bfloat16)
        grads16 = tuple(t.to(torch.bfloat16) for t in grads32)
        ref = run("torch", _cast_batch(batch16, torch.float32), tuple(t.float() for t in grads16),
                  _cast_batch(case16, torch.float32))
        torch16 = run("torch", batch16, grads16, case16)
        tri16 = run("triton", batch16, grads16, case16)
        out["bfloat16"] = {}
        for name in ref:
            torch_err = rel_err(torch16[name], ref[name])
            out["bfloat16"][name] = {"rel_err": rel_err(tri16[name], ref[name]), "torch_rel_err": torch_err,
                                     "tol": bf16_bound(torch_err)}
    return out


def kernel_bandwidth(shape: tuple[int, int, int, int], reps: int) -> dict[str, Any]:
    """GB/s (1e9 bytes read + written per second) of the bf16 forward permute and combine, both paths, and
    of a device-to-device copy of the routed rows ([T*k, H])."""
    import torch

    from benchmarks.common.kernels import copy_seconds, cuda_seconds, routed_batch

    tokens, hidden, k, experts = shape
    paths = _dispatchers(experts)
    b = routed_batch(tokens, hidden, k, experts, "cuda", torch.bfloat16)
    handle = _handle(b, tokens, k)
    element = 2
    moved = {"permute": 2 * tokens * k * hidden * element,
             "combine": (tokens * k + tokens) * hidden * element + tokens * k * element}
    seconds = {"copy": copy_seconds(tokens * k * hidden, torch.bfloat16, reps)}
    with torch.no_grad():
        for name, d in paths.items():
            seconds[f"permute_{name}"] = cuda_seconds(lambda d=d: d._permute(b["x"], b["order"], tokens * k, k), reps)
            seconds[f"combine_{name}"] = cuda_seconds(lambda d=d: d._unpermute_combine(b["rows"], b["weights"], handle),
                                                      reps)
    copy_gbs = 2 * tokens * k * hidden * element / seconds["copy"] / 1e9
    report: dict[str, Any] = {"copy": {"seconds": seconds["copy"], "GB_per_s": copy_gbs}}
    for name, t in seconds.items():
        if name != "copy":
            gbs = moved[name.split("_")[0]] / t / 1e9
            report[name] = {"seconds": t, "GB_per_s": gbs, "fraction_of_copy": gbs / copy_gbs}
    return report


def section_dispatch_kernels(sizes: Sizes) -> dict[str, Any]:
    runs = []
    for shape in sizes.shapes:
        run: dict[str, Any] = {"shape": dict(zip(("T", "H", "k", "E"), shape, strict=True))}
        run["equality"] = kernel_equality(shape, sizes.dtypes, sizes.device)
        run["bandwidth"] = None if sizes.dry_run else kernel_bandwidth(shape, sizes.reps)
        runs.append(run)
        free_cuda_cache(sizes.device)
    failures = [(r["shape"], dt, name, v) for r in runs for dt, per in r["equality"].items() for name, v in per.items()
                if not v["rel_err"] <= v["tol"]]
    if failures:
        raise AssertionError(f"Triton kernels outside tolerance: {failures}")
    return {"runs": runs, "bandwidth_note": "skipped: no CUDA (dry run)" if sizes.dry_run else
            "bf16 forward; bytes = reads + writes of activations (and routing weights for combine)"}


# ----------------------------------------------------------------------------------------------------------------
# b. experts implementation
# ----------------------------------------------------------------------------------------------------------------


def _experts_inputs(tokens: int, hidden: int, k: int, experts: int, device: str) -> dict:
    """fp32 ``hidden`` [T, H], ``index`` [T, k] (distinct experts per token), ``weights`` [T, k] summing to 1."""
    import torch

    g = torch.Generator(device=device).manual_seed(2)
    index = torch.rand(tokens, experts, device=device, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, device=device, generator=g)
    return {"hidden": torch.randn(tokens, hidden, device=device, generator=g), "index": index,
            "weights": weights / weights.sum(-1, keepdim=True)}


def experts_step(model, module, impl: str, inputs: dict, dtype, grad_out) -> dict[str, Any]:
    """Forward + backward of one experts module under experts implementation ``impl``: the output [T, H]
    and the gradients of the input, the routing weights and the expert weights."""
    model.set_experts_implementation(impl)
    hidden = inputs["hidden"].detach().to(dtype).requires_grad_()
    weights = inputs["weights"].detach().to(dtype).requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(hidden, inputs["index"], weights)
    out.backward(grad_out.to(out.dtype))
    return {"output": out.detach(), "grad_input": hidden.grad, "grad_weights": weights.grad,
            **{f"grad_{n}": p.grad for n, p in module.named_parameters(recurse=False)}}


def _experts_model(shape: tuple[int, int, int, int], width: int, device: str, dtype):
    tokens, hidden, k, experts = shape
    spec = dict(hidden=hidden, layers=1, experts=experts, top_k=k, expert_width=width, vocab=128,
                heads=max(1, hidden // 128), kv_heads=max(1, hidden // 512))
    model = build_model(spec, device, dtype)
    return model, model.model.layers[0].mlp.experts


def experts_shape(shape: tuple[int, int, int, int], sizes: Sizes) -> dict[str, Any]:
    """Equality and (on CUDA) forward + backward time of ``hybrid_ep_triton`` vs ``grouped_mm`` at one shape."""
    import torch

    tokens, hidden, k, experts = shape
    width = sizes.expert_width(hidden)
    inputs = _experts_inputs(tokens, hidden, k, experts, sizes.device)
    grad_out = torch.randn(tokens, hidden, device=sizes.device, generator=torch.Generator(sizes.device).manual_seed(3))
    model, module = _experts_model(shape, width, sizes.device, torch.float32)
    report: dict[str, Any] = {"shape": {"T": tokens, "H": hidden, "k": k, "E": experts, "expert_width": width}}
    ref = experts_step(model, module, "eager", inputs, torch.float32, grad_out)
    got = {impl: experts_step(model, module, impl, inputs, torch.float32, grad_out)
           for impl in ("grouped_mm", "hybrid_ep_triton")}
    report["equality"] = {"float32": {
        name: {"rel_err": rel_err(got["hybrid_ep_triton"][name], ref[name]),
               "grouped_mm_rel_err": rel_err(got["grouped_mm"][name], ref[name]), "tol": FP32_EXPERTS_TOL}
        for name in ref}}
    del got
    if "bfloat16" in sizes.dtypes:
        model = model.to(torch.bfloat16)
        got = {impl: experts_step(model, module, impl, inputs, torch.bfloat16, grad_out)
               for impl in ("grouped_mm", "hybrid_ep_triton")}
        report["equality"]["bfloat16"] = {}
        for name in ref:
            base = rel_err(got["grouped_mm"][name], ref[name])
            report["equality"]["bfloat16"][name] = {"rel_err": rel_err(got["hybrid_ep_triton"][name], ref[name]),
                                                    "grouped_mm_rel_err": base, "tol": bf16_bound(base)}
        del got
        report["timing"] = experts_timing(model, module, inputs, grad_out, sizes.reps)
    return report


def experts_timing(model, module, inputs: dict, grad_out, reps: int) -> dict[str, Any]:
    """Median forward + backward seconds (bf16) per implementation, and the ratio to ``grouped_mm``."""
    import torch

    from benchmarks.common.kernels import cuda_seconds

    seconds = {impl: cuda_seconds(lambda impl=impl: experts_step(model, module, impl, inputs, torch.bfloat16,
                                                                 grad_out), reps)
               for impl in ("grouped_mm", "hybrid_ep_triton")}
    return {impl: {"seconds": t, "ratio_vs_grouped_mm": t / seconds["grouped_mm"]} for impl, t in seconds.items()}


def section_experts_implementation(sizes: Sizes) -> dict[str, Any]:
    import hf_hybrid_ep  # noqa: F401  (registers "hybrid_ep_triton")

    runs = []
    for shape in sizes.shapes:
        runs.append(experts_shape(shape, sizes))
        free_cuda_cache(sizes.device)
    failures = [(r["shape"], dt, name, v) for r in runs for dt, per in r["equality"].items() for name, v in per.items()
                if not v["rel_err"] <= v["tol"]]
    if failures:
        raise AssertionError(f"hybrid_ep_triton outside tolerance: {failures}")
    return {"runs": runs, "reference": "transformers 'eager' experts in fp32 on the same (bf16-rounded) weights",
            "timing_note": "skipped: no CUDA (dry run)" if sizes.dry_run else "forward + backward, bf16"}


# ----------------------------------------------------------------------------------------------------------------
# c. engine at world 1
# ----------------------------------------------------------------------------------------------------------------


def init_world_of_one(device: str, tmp: Path) -> str:
    """A one-rank NCCL process group on CUDA (so the engine's mesh is a CUDA one); none on CPU."""
    import torch.distributed as dist

    if device != "cuda":
        return "none (world of one without torch.distributed, as the tests run it)"
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    return f"{dist.get_backend()} world of {dist.get_world_size()}"


def close_process_group() -> None:
    """Destroy the one-rank process group of section c, if it made one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active_parameters(model) -> int:
    """Parameters one token's forward multiplies by: all but the input embedding, experts scaled by k / E."""
    from hf_hybrid_ep.moe.discovery import find_experts_modules

    experts = find_experts_modules(model)
    expert_ids = {id(p) for _, m in experts for p in m.parameters(recurse=False)}
    dense = sum(p.numel() for p in model.parameters()
                if id(p) not in expert_ids and p is not model.get_input_embeddings().weight)
    k = model.config.num_experts_per_tok
    routed = sum(p.numel() * k // m.num_experts for _, m in experts for p in m.parameters(recurse=False))
    return dense + routed


def train(model, optimizer, clip: Callable[[], object], batches: list, device: str,
          first_grads: dict | None = None) -> dict[str, Any]:
    """Steps of loss / backward / clip / optimizer step; the first step is warm-up for the timing. The first
    step's gradients go into ``first_grads`` (fp32 copies), when given."""
    losses, times = [], []
    for ids in batches:
        synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first_grads is not None and not losses:
            first_grads.update(grads_fp32(model))
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"losses": losses, "step_seconds": statistics.median(times[1:] if len(times) > 1 else times)}


def grads_fp32(model) -> dict[str, Any]:
    """A copy of every parameter's gradient in fp32 (on the device: compared there)."""
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def fp32_grads(base, ids) -> dict[str, Any]:
    """The gradients of an fp32 copy of ``base`` on ``ids`` (one forward and backward, no engine)."""
    model = copy.deepcopy(base).float()
    model(input_ids=ids, labels=ids).loss.backward()
    return grads_fp32(model)


def grad_check(got: dict, exact: dict, spread: dict) -> dict[str, Any]:
    """Per parameter ``||got - exact|| / ||exact||`` against ``max(SAFETY x spread, FP32_GRAD_TOL)``, where
    ``spread`` is the same distance of the reference computed in the run's dtype (0 in fp32)."""
    rels = {n: rel_err(got[n], exact[n]) for n in exact}
    bounds = {n: max(SAFETY * spread.get(n, 0.0), FP32_GRAD_TOL) for n in exact}
    worst = max(rels, key=lambda n: rels[n] / bounds[n])
    return {"parameters": len(rels), "missing": sorted(set(exact) - set(got)), "worst": worst,
            "worst_rel": rels[worst], "worst_bound": bounds[worst],
            "violations": sorted(n for n in rels if not rels[n] <= bounds[n])}


def reference_run(base, batches: list, device: str, first_grads: dict | None = None) -> dict[str, Any]:
    """A copy of ``base`` trained without the engine: fused AdamW, ``torch.nn.utils.clip_grad_norm_``."""
    import torch

    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return train(model, optimizer, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), batches, device,
                 first_grads)


def engine_run(base, dispatcher: str, batches: list, sizes: Sizes, first_grads: dict, from_cpu: bool
               ) -> dict[str, Any]:
    """One parallelized copy of ``base`` trained on ``batches``: losses, speed, memory, what ran; its first
    step's gradients in ``first_grads``. With ``from_cpu`` the copy starts on the CPU and ``parallelize``
    moves it to the rank's device (recorded)."""
    import torch

    import hf_hybrid_ep as hep

    free_cuda_cache(sizes.device)  # the previous run's parallelized model is a reference cycle (its hooks hold it)
    if sizes.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    config = hep.HybridEPConfig(dispatcher=dispatcher, optimizer_sharding="zero1", bucket_size_mb=32.0)
    model = copy.deepcopy(base).to("cpu") if from_cpu else copy.deepcopy(base)
    model = hep.parallelize(model, config).train()
    placed = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
    optimizer = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-4)
    result = train(model, optimizer, lambda: hep.clip_grad_norm_(model, 1.0), batches, sizes.device, first_grads)
    state = hep.state_of(model)
    result.update({
        "placed_on": placed, "started_on_cpu": from_cpu,
        "dispatcher_selected": state.layers[0].dispatcher.name,
        "optimizer": type(optimizer).__name__, "fused": bool(optimizer.defaults.get("fused")),
        "gradient_reduction": hep.comm_stats(model)["gradient_reduction"],
        "memory_report": hep.memory_report(model, optimizer),
        "max_memory_allocated": torch.cuda.max_memory_allocated() if sizes.device == "cuda" else None,
    })
    mem = result["memory_report"]
    result["memory_report_bytes"] = mem["weight_bytes"] + mem["grad_bytes"] + (mem["optimizer_bytes"] or 0)
    if result["max_memory_allocated"]:
        result["max_allocated_over_report"] = result["max_memory_allocated"] / result["memory_report_bytes"]
    return result


def _speed(result: dict, tokens: int, active: int, dry_run: bool) -> None:
    result["tokens_per_s"] = tokens / result["step_seconds"]
    result["model_tflops_per_s"] = 6 * active * result["tokens_per_s"] / 1e12
    result["mfu"] = None if dry_run else result["model_tflops_per_s"] * 1e12 / PEAK_BF16_FLOPS


def section_engine(sizes: Sizes, tmp: Path) -> dict[str, Any]:
    import torch

    dtype_name = "float32" if sizes.dry_run else "bfloat16"
    report: dict[str, Any] = {"process_group": init_world_of_one(sizes.device, tmp), "dtype": dtype_name,
                              "nccl": NCCL_NOTE, "peak_flops_assumed": None if sizes.dry_run else PEAK_BF16_FLOPS,
                              "flops_formula": "6 x active parameters x tokens (attention score FLOPs not counted)"}
    base = build_model(sizes.engine_model, sizes.device, _dtype(dtype_name)).train()
    batch, seq = sizes.engine_batch
    g = torch.Generator(device=sizes.device).manual_seed(5)
    batches = [torch.randint(0, base.config.vocab_size, (batch, seq), device=sizes.device, generator=g)
               for _ in range(sizes.engine_steps)]
    active = active_parameters(base)
    report.update(parameters=sum(p.numel() for p in base.parameters()), active_parameters=active,
                  tokens_per_step=batch * seq, steps=sizes.engine_steps)
    ref_grads: dict = {}
    runs = {"without engine": reference_run(base, batches, sizes.device, ref_grads)}
    exact = ref_grads if dtype_name == "float32" else fp32_grads(base, batches[0])
    spread = {n: rel_err(ref_grads[n], exact[n]) for n in exact}
    for dispatcher in ("torch", "triton", "dedup", "auto"):
        grads: dict = {}
        runs[dispatcher] = engine_run(base, dispatcher, batches, sizes, grads, from_cpu=dispatcher == "auto")
        runs[dispatcher]["first_step_grads"] = grad_check(grads, exact, spread)
    tol = LOSS_TOL[dtype_name]
    want = runs["without engine"]["losses"]
    for result in runs.values():
        _speed(result, batch * seq, active, sizes.dry_run)
        result["max_loss_rel_err"] = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], want, strict=True))
        result["loss_tol"] = tol
    report["runs"] = runs
    report["auto_expected"] = "torch" if sizes.dry_run else "triton"
    report["bucketed_gradient_reduction"] = GRAD_REDUCTION_NOTE
    report["zero1_state_elements_ok"] = all(
        r["memory_report"]["state_elements"] == report["parameters"] for n, r in runs.items() if n != "without engine")
    if not report["zero1_state_elements_ok"]:
        raise AssertionError("ZeRO-1 at world 1 must keep the optimizer state of every parameter element")
    bad = {name: r["max_loss_rel_err"] for name, r in runs.items() if not r["max_loss_rel_err"] <= tol}
    if bad:
        raise AssertionError(f"losses differ from the model without the engine beyond {tol}: {bad}")
    bad = {name: r["first_step_grads"] for name, r in runs.items()
           if "first_step_grads" in r and (r["first_step_grads"]["violations"] or r["first_step_grads"]["missing"])}
    if bad:
        raise AssertionError(f"first-step gradients differ from the reference's beyond their bounds: {bad}")
    device = "cuda:0" if sizes.device == "cuda" else "cpu"
    if runs["auto"]["placed_on"] != [device]:
        raise AssertionError(f"parallelize left a model built on the CPU on {runs['auto']['placed_on']}, not {device}")
    if runs["auto"]["dispatcher_selected"] != report["auto_expected"]:
        raise AssertionError(f"dispatcher='auto' picked {runs['auto']['dispatcher_selected']!r}, "
                             f"expected {report['auto_expected']!r}")
    return report


# ----------------------------------------------------------------------------------------------------------------
# d. offloaded decoding
# ----------------------------------------------------------------------------------------------------------------


def decode(model, prompt, new_tokens: int, device: str) -> tuple[Any, float]:
    """Greedy decoding of exactly ``new_tokens`` tokens: (token ids [B, prompt + new], seconds)."""
    import torch

    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    synchronize(device)
    return out, time.perf_counter() - start


def first_divergence(a, b, prompt_len: int) -> int | None:
    """Index (among the generated tokens) of the first position where ``a`` and ``b`` differ, or None."""
    diff = (a[:, prompt_len:] != b[:, prompt_len:]).any(dim=0).nonzero()
    return int(diff[0]) if diff.numel() else None


def cache_summary(model) -> dict[str, Any]:
    """Hits, misses and hit rate over all offloaded layers, and per-layer hit rate / prefetch recall."""
    import hf_hybrid_ep as hep

    stats = hep.cache_stats(model)
    hits = sum(s["hits"] for s in stats.values())
    misses = sum(s["misses"] for s in stats.values())
    return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "per_layer": {name: {"hit_rate": s["hit_rate"], "prefetch_recall": s["prefetch_recall"],
                                 "resident_experts": s["resident_experts"], "capacity": s["capacity"]}
                          for name, s in stats.items()}}


def decode_paths(path: Path, capacity: int, prompt, sizes: Sizes, dtype) -> dict[str, Any]:
    """Resident, hf_hybrid_ep offloaded and accelerate-offloaded decoding of one checkpoint."""
    import torch
    from accelerate import cpu_offload
    from transformers import AutoModelForCausalLM

    import hf_hybrid_ep as hep

    n = sizes.decode_tokens
    runs: dict[str, Any] = {}
    resident = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(sizes.device).eval()
    decode(resident, prompt, 2, sizes.device)
    runs["resident"] = dict(zip(("tokens", "seconds"), decode(resident, prompt, n, sizes.device), strict=True))
    del resident
    offloaded = hep.load_offloaded(path, capacity, prefetch=True, device=sizes.device)
    runs["hf_hybrid_ep offloaded"] = dict(zip(("tokens", "seconds"), decode(offloaded, prompt, n, sizes.device),
                                              strict=True))
    runs["hf_hybrid_ep offloaded"]["cache"] = cache_summary(offloaded)
    del offloaded
    # the memory store (pageable host memory, loads staged through pinned buffers) from a model on the CPU
    in_memory = hep.offload(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), capacity,
                            device=sizes.device, prefetch=False)
    placed = sorted({str(t.device) for t in (*in_memory.parameters(), *in_memory.buffers())})
    runs[OFFLOAD_NO_PREFETCH] = dict(zip(("tokens", "seconds"), decode(in_memory, prompt, n, sizes.device),
                                         strict=True))
    runs[OFFLOAD_NO_PREFETCH].update(cache=cache_summary(in_memory), placed_on=placed)
    del in_memory
    accel = cpu_offload(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(),
                        execution_device=torch.device(sizes.device))
    runs["accelerate cpu_offload"] = dict(zip(("tokens", "seconds"), decode(accel, prompt, n, sizes.device),
                                              strict=True))
    del accel
    want = runs["resident"]["tokens"]
    for run in runs.values():
        run["tokens_per_s"] = prompt.shape[0] * n / run["seconds"]
        run["first_divergence_vs_resident"] = first_divergence(run["tokens"], want, prompt.shape[1])
        run["identical_to_resident"] = run["first_divergence_vs_resident"] is None
        run["tokens"] = run["tokens"][:, prompt.shape[1]:].tolist()
    return runs


def section_offloaded_decoding(sizes: Sizes, tmp: Path) -> dict[str, Any]:
    import torch

    spec = sizes.decode_model
    capacity = max(1, spec["experts"] // 4)
    model = build_model(spec, sizes.device, torch.float32).eval()
    prompt = torch.randint(3, spec["vocab"], (1, sizes.decode_prompt), device=sizes.device,
                           generator=torch.Generator(sizes.device).manual_seed(7))
    report: dict[str, Any] = {"experts_per_layer": spec["experts"], "capacity": capacity,
                              "budget": capacity / spec["experts"], "new_tokens": sizes.decode_tokens,
                              "prompt_tokens": sizes.decode_prompt, "accelerate": "accelerate.cpu_offload"}
    paths = {"float32": tmp / "decode-fp32"}
    model.save_pretrained(paths["float32"])
    if "bfloat16" in sizes.dtypes:
        paths["bfloat16"] = tmp / "decode-bf16"
        model.to(torch.bfloat16).save_pretrained(paths["bfloat16"])
    del model
    for dtype_name, path in paths.items():
        report[dtype_name] = decode_paths(path, capacity, prompt, sizes, _dtype(dtype_name))
    if "bfloat16" not in paths:
        report["bfloat16"] = "skipped (dry run)"
    different = [name for name, run in report["float32"].items() if not run["identical_to_resident"]]
    if different:
        raise AssertionError(f"fp32 greedy tokens differ from the resident model's: {different}")
    device = "cuda:0" if sizes.device == "cuda" else "cpu"
    if report["float32"][OFFLOAD_NO_PREFETCH]["placed_on"] != [device]:
        raise AssertionError(f"offload left tensors on {report['float32'][OFFLOAD_NO_PREFETCH]['placed_on']}")
    return report


# ----------------------------------------------------------------------------------------------------------------
# e. save and resume
# ----------------------------------------------------------------------------------------------------------------


def _step(model, optimizer, ids) -> float:
    import hf_hybrid_ep as hep

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    hep.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def layer_expert_bytes(model) -> int:
    import hf_hybrid_ep as hep

    return max(sum(p.numel() * p.element_size() for p in layer.expert_parameters()) * layer.num_experts
               // len(layer.local_experts) for layer in hep.state_of(model).layers)


def device_peak(fn: Callable[[], object], device: str) -> int | None:
    """The device memory ``fn()`` allocated at its peak beyond what was allocated before (CUDA only)."""
    import torch

    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _saved(model, optimizer, directory: Path, device: str) -> dict[str, Any]:
    """Save ``model`` (streamed hybrid-EP checkpoint) and its optimizer state; the device memory each save
    allocated beyond what it found (CUDA only)."""
    from hf_hybrid_ep.model_io.optimizer_state import save_optimizer_state
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

    return {"save_peak_extra_bytes": device_peak(lambda: save_hybrid_checkpoint(model, directory / "model"), device),
            "optimizer_save_peak_extra_bytes": device_peak(
                lambda: save_optimizer_state(model, optimizer, directory / "optimizer"), device),
            "layer_expert_bytes": layer_expert_bytes(model)}


def section_save_resume(sizes: Sizes, tmp: Path) -> dict[str, Any]:
    """One step, a save (model and ZeRO-1 fused AdamW state), a resume through ``from_pretrained`` and
    ``load_optimizer_state``, then one more step on the continued and on the resumed model: losses and every
    parameter must agree (fp32, so only round-off could differ)."""
    import torch

    import hf_hybrid_ep as hep
    from hf_hybrid_ep.model_io.optimizer_state import load_optimizer_state

    init_world_of_one(sizes.device, tmp)
    config = hep.HybridEPConfig(optimizer_sharding="zero1")
    model = hep.parallelize(build_model(sizes.decode_model, "cpu", torch.float32).train(), config)  # placed
    optimizer = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
    g = torch.Generator(device=sizes.device).manual_seed(9)
    batches = [torch.randint(0, model.config.vocab_size, (2, 32), device=sizes.device, generator=g) for _ in range(2)]
    _step(model, optimizer, batches[0])
    report = _saved(model, optimizer, tmp / "resume", sizes.device)
    resumed = hep.from_pretrained(tmp / "resume" / "model", config)
    resumed.set_attn_implementation(model.config._attn_implementation)
    resumed.train()
    resumed_optimizer = hep.make_optimizer(resumed, torch.optim.AdamW, resumed.parameters(), lr=1e-3)
    load_optimizer_state(resumed, resumed_optimizer, tmp / "resume" / "optimizer")
    report["placed_on"] = sorted({str(t.device) for t in (*model.parameters(), *resumed.parameters())})
    report["step_devices"] = sorted({str(v.device) for st in resumed_optimizer.state.values() for k, v in st.items()
                                     if k == "step"})
    report["losses"] = [_step(m, o, batches[1]) for m, o in ((model, optimizer), (resumed, resumed_optimizer))]
    hep.wait_for_parameters(model)
    hep.wait_for_parameters(resumed)
    theirs = dict(resumed.named_parameters())
    rels = {n: rel_err(theirs[n].detach(), p.detach()) for n, p in model.named_parameters()}
    report.update(max_param_rel_err=max(rels.values()), worst_param=max(rels, key=rels.get), tol=FP32_GRAD_TOL)
    device = "cuda:0" if sizes.device == "cuda" else "cpu"
    problems = [f"parameters on {report['placed_on']}, not {device}"] if report["placed_on"] != [device] else []
    if report["step_devices"] != [device]:
        problems.append(f"fused AdamW's step on {report['step_devices']}, not {device}")
    if not (report["max_param_rel_err"] <= FP32_GRAD_TOL
            and abs(report["losses"][0] - report["losses"][1]) <= FP32_GRAD_TOL * abs(report["losses"][0])):
        problems.append(f"resumed differs: losses {report['losses']}, {report['worst_param']} "
                        f"{report['max_param_rel_err']:.3g}")
    if report["save_peak_extra_bytes"] is not None and report["save_peak_extra_bytes"] > report["layer_expert_bytes"]:
        problems.append(f"the save allocated {report['save_peak_extra_bytes']} device bytes, more than one layer's "
                        f"experts ({report['layer_expert_bytes']})")
    if problems:
        raise AssertionError("; ".join(problems))
    return report


# ----------------------------------------------------------------------------------------------------------------
# f. autocast over fp32 weights
# ----------------------------------------------------------------------------------------------------------------


def grouped_gemm_dtypes():
    """A ``TorchDispatchMode`` recording the input dtypes of every grouped GEMM run inside it (``.dtypes``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "grouped_mm" in func._overloadpacket.__name__:
                self.dtypes.update(str(a.dtype).removeprefix("torch.") for a in args[:2] if hasattr(a, "dtype"))
            return func(*args, **(kwargs or {}))

    return Recorder()


def section_autocast(sizes: Sizes, tmp: Path) -> dict[str, Any]:
    """The usual ``--bf16`` run: fp32 weights under ``torch.autocast(bfloat16)``. The engine's rows must travel in
    bf16 (2·H bytes a row in the dispatcher's counters), its grouped GEMMs run in bf16, its gradients land in the
    fp32 parameters within ``SAFETY`` x the bf16 round-off of the fp32 reference (the reference model under
    autocast with eager experts, every expert GEMM an autocast ``F.linear``)."""
    import torch

    import hf_hybrid_ep as hep

    init_world_of_one(sizes.device, tmp)
    base = build_model(sizes.decode_model, sizes.device, torch.float32).train()
    ids = torch.randint(0, base.config.vocab_size, (2, 32), device=sizes.device,
                        generator=torch.Generator(sizes.device).manual_seed(11))
    exact = fp32_grads(base, ids)
    reference = copy.deepcopy(base)
    reference.set_experts_implementation("eager")
    model = hep.parallelize(copy.deepcopy(base), hep.HybridEPConfig(dispatcher="torch"))
    gemms = grouped_gemm_dtypes()
    with torch.autocast(sizes.device, dtype=torch.bfloat16):
        with gemms:
            loss = model(input_ids=ids, labels=ids).loss
        reference_loss = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    reference_loss.backward()
    spread = {n: rel_err(g, exact[n]) for n, g in grads_fp32(reference).items()}
    counters = hep.layer_counters(hep.comm_stats(model))
    report = {"grouped_gemm_dtypes": sorted(gemms.dtypes), "hidden": base.config.hidden_size,
              "dispatch_bytes_per_row": sorted({c["dispatch"]["bytes_sent"] // c["dispatch"]["rows_sent"]
                                                for c in counters if c["dispatch"]["rows_sent"]}),
              "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
              "grads": grad_check(grads_fp32(model), exact, spread)}
    problems = []
    if report["grouped_gemm_dtypes"] != ["bfloat16"]:
        problems.append(f"grouped GEMMs ran in {report['grouped_gemm_dtypes']}")
    if report["dispatch_bytes_per_row"] != [2 * report["hidden"]]:
        problems.append(f"{report['dispatch_bytes_per_row']} bytes a row, not 2·H = {2 * report['hidden']}")
    if report["grad_dtypes"] != ["torch.float32"] or report["grads"]["violations"]:
        problems.append(f"gradients: {report['grad_dtypes']}, {report['grads']}")
    if problems:
        raise AssertionError("; ".join(problems))
    return report


# ----------------------------------------------------------------------------------------------------------------
# m. a training step under CUDA's sync-debug mode
# ----------------------------------------------------------------------------------------------------------------

SYNC_DEBUG_SKIPPED = "skipped: the CPU has no sync-debug mode (the same steps ran without it)"


def _quiet_step(model, optimizer, ids) -> Any:
    """One step (forward, backward, clipping, ZeRO-1 fused AdamW); the loss stays on the device (reading it
    would synchronise)."""
    import hf_hybrid_ep as hep

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    hep.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _under_sync_debug(mode: str, step: Callable[[], object]) -> tuple[list[str], str | None]:
    """``step()`` under ``torch.cuda.set_sync_debug_mode(mode)``: the Python lines of the synchronising calls it
    warned about (``"warn"``) and the error it raised (``"error"``: the first synchronising call), or ``None``."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            step()
            error = None
        except RuntimeError as err:
            error = f"{err}\n{traceback.format_exc()[-1500:]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    sites = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
    return sites, error


def section_sync_debug(sizes: Sizes, tmp: Path) -> dict[str, Any]:
    """A ZeRO-1 model at world 1 (the one-rank NCCL group of section c, whose collectives never wait on the host):
    after a warm-up step, one step under sync-debug ``"warn"`` (listing every synchronising call) and one under
    ``"error"``, which must finish: a step reads nothing back to the host (gloo's CUDA collectives do, on their
    own threads, so the multi-rank sections cannot run this)."""
    import torch

    import hf_hybrid_ep as hep

    report: dict[str, Any] = {"process_group": init_world_of_one(sizes.device, tmp)}
    config = hep.HybridEPConfig(optimizer_sharding="zero1")
    model = hep.parallelize(build_model(sizes.decode_model, "cpu", torch.float32).train(), config)
    optimizer = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), device=sizes.device,
                        generator=torch.Generator(sizes.device).manual_seed(13))
    losses = [_quiet_step(model, optimizer, ids)]  # warm-up: the optimizer's state, the allocator's blocks
    if sizes.device != "cuda":
        losses.append(_quiet_step(model, optimizer, ids))
        return {**report, "mode": SYNC_DEBUG_SKIPPED, "losses": [float(x) for x in losses]}
    report["warn_sites"], _ = _under_sync_debug("warn", lambda: losses.append(_quiet_step(model, optimizer, ids)))
    report["warned"] = len(report["warn_sites"])
    _, report["error"] = _under_sync_debug("error", lambda: losses.append(_quiet_step(model, optimizer, ids)))
    report.update(mode="error", losses=[float(x) for x in losses])
    if report["error"] is not None:
        raise AssertionError(f"a step under sync-debug 'error' synchronised: {report['error']}; every synchronising "
                             f"call of the step under 'warn': {report['warn_sites']}")
    return report


# ----------------------------------------------------------------------------------------------------------------
# driver and report
# ----------------------------------------------------------------------------------------------------------------


def run_section(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s figures with ``status`` and ``seconds``; a raised exception becomes ``status: failed``."""
    start = time.perf_counter()
    try:
        result = {"status": "ok", **fn()}
    except Exception:
        result = {"status": "failed", "error": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - start
    return result


def meta(sizes: Sizes) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    return {
        "dry_run": sizes.dry_run, "device": torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "transformers": transformers.__version__, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "notes": [NCCL_NOTE] + ([DRY_RUN_NOTE] if sizes.dry_run else []),
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "—" if v is None else str(v)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: a status table, then one table per section."""
    s = report["sections"]
    lines = [f"# gpu_check ({report['meta']['device']}, dry run: {report['meta']['dry_run']})", ""]
    lines += [f"> {note}" for note in report["meta"]["notes"]] + ["", "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {r['status']} | {r['seconds']:.1f} |" for name, r in s.items()]
    for name, r in s.items():
        lines += ["", f"## {name}", ""]
        if r["status"] != "ok":
            lines += ["```", r["error"].strip(), "```"]
            continue
        lines += SECTION_TABLES.get(name, _ranks_table if "ranks" in r else _figure_table)(r)
    return "\n".join(lines) + "\n"


def _equality_rows(runs: list[dict]) -> list[str]:
    lines = ["| shape | dtype | output | rel. error | reference error | tolerance |", "|---|---|---|---|---|---|"]
    for r in runs:
        shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
        for dt, per in r["equality"].items():
            for out, v in per.items():
                other = v.get("torch_rel_err", v.get("grouped_mm_rel_err"))
                lines.append(f"| {shape} | {dt} | {out} | {_fmt(v['rel_err'])} | {_fmt(other)} | {_fmt(v['tol'])} |")
    return lines


def _kernel_tables(r: dict) -> list[str]:
    lines = _equality_rows(r["runs"]) + ["", f"Bandwidth: {r['bandwidth_note']}"]
    timed = [run for run in r["runs"] if run["bandwidth"]]
    if timed:
        names = [n for n in timed[0]["bandwidth"] if n != "copy"]
        lines += ["", "| shape | copy GB/s | " + " | ".join(f"{n} GB/s (× copy)" for n in names) + " |",
                  "|---" * (len(names) + 2) + "|"]
        for run in timed:
            b = run["bandwidth"]
            cells = [f"{b[n]['GB_per_s']:.0f} ({b[n]['fraction_of_copy']:.2f})" for n in names]
            shape = ", ".join(f"{k}={v}" for k, v in run["shape"].items())
            lines.append(f"| {shape} | {b['copy']['GB_per_s']:.0f} | " + " | ".join(cells) + " |")
    return lines


def _experts_tables(r: dict) -> list[str]:
    lines = _equality_rows(r["runs"]) + ["", f"Reference: {r['reference']}. Timing: {r['timing_note']}."]
    timed = [run for run in r["runs"] if "timing" in run]
    if timed:
        lines += ["", "| shape | grouped_mm s | hybrid_ep_triton s | ratio |", "|---|---|---|---|"]
        for run in timed:
            t = run["timing"]
            shape = ", ".join(f"{k}={v}" for k, v in run["shape"].items())
            lines.append(f"| {shape} | {t['grouped_mm']['seconds']:.4f} | {t['hybrid_ep_triton']['seconds']:.4f} | "
                         f"{t['hybrid_ep_triton']['ratio_vs_grouped_mm']:.2f} |")
    return lines


def _engine_tables(r: dict) -> list[str]:
    lines = [f"{r['parameters'] / 1e6:.1f} M parameters ({r['active_parameters'] / 1e6:.1f} M active), {r['dtype']}, "
             f"{r['tokens_per_step']} tokens/step, {r['steps']} steps; process group: {r['process_group']}; "
             f"peak FLOP/s assumed: {_fmt(r['peak_flops_assumed'])} ({r['flops_formula']}). {r['nccl']}. "
             f"Gradient reduction: {r['bucketed_gradient_reduction']}. ZeRO-1 state covers every parameter: "
             f"{r['zero1_state_elements_ok']}.", "",
             "| run | dispatcher | max loss rel. err (tol) | tokens/s | MFU | memory_report weights+grads+optimizer GiB "
             "| max_memory_allocated GiB |", "|---|---|---|---|---|---|---|"]
    for name, run in r["runs"].items():
        held = run["memory_report_bytes"] / 2**30 if "memory_report_bytes" in run else None
        peak = run.get("max_memory_allocated")
        lines.append(f"| {name} | {run.get('dispatcher_selected', '—')} | {_fmt(run['max_loss_rel_err'])} "
                     f"({_fmt(run['loss_tol'])}) | {run['tokens_per_s']:.0f} | {_fmt(run['mfu'])} | {_fmt(held)} | "
                     f"{_fmt(peak / 2**30 if peak else None)} |")
    return lines


def _decode_tables(r: dict) -> list[str]:
    lines = [f"{r['capacity']} of {r['experts_per_layer']} experts per layer resident ({r['budget']:.0%}), "
             f"{r['new_tokens']} greedy tokens after a {r['prompt_tokens']}-token prompt.", "",
             "| dtype | path | tokens/s | hit rate | identical to resident | first divergence |", "|---|---|---|---|---|---|"]
    for dt in ("float32", "bfloat16"):
        if not isinstance(r.get(dt), dict):
            lines.append(f"| {dt} | {r.get(dt, 'skipped')} | | | | |")
            continue
        for name, run in r[dt].items():
            hit = run["cache"]["hit_rate"] if "cache" in run else None
            lines.append(f"| {dt} | {name} | {run['tokens_per_s']:.1f} | {_fmt(hit)} | {run['identical_to_resident']} "
                         f"| {_fmt(run['first_divergence_vs_resident'])} |")
    return lines


def _figure_table(r: dict) -> list[str]:
    """Every scalar or list figure of a section, one row each."""
    lines = ["| figure | value |", "|---|---|"]
    for name, value in r.items():
        if name not in ("status", "seconds"):
            lines.append(f"| {name} | {_fmt(value)} |")
    return lines


def _flat(figures: dict, prefix: str = "") -> dict[str, Any]:
    """Nested figures as ``a.b.c`` keys; lists longer than 8 items left out."""
    out: dict[str, Any] = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif not (isinstance(value, list | tuple) and len(value) > 8):
            out[f"{prefix}{key}"] = value
    return out


def _ranks_table(r: dict) -> list[str]:
    """A multi-rank section: every figure of each rank, one column per rank."""
    ranks = [_flat(figures or {}) for figures in r["ranks"]]
    names = list(dict.fromkeys(k for figures in ranks for k in figures))
    lines = ["| figure | " + " | ".join(f"rank {i}" for i in range(len(ranks))) + " |", "|---" * (len(ranks) + 1) + "|"]
    return lines + [f"| {n} | " + " | ".join(_fmt(f.get(n)) for f in ranks) + " |" for n in names]


SECTION_TABLES: dict[str, Callable[[dict], list[str]]] = {
    "a_dispatch_kernels": _kernel_tables,
    "b_experts_implementation": _experts_tables,
    "c_engine": _engine_tables,
    "d_offloaded_decoding": _decode_tables,
    "e_save_resume": _figure_table,
    "f_autocast": _figure_table,
    "m_sync_debug": _figure_table,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=".", help="where gpu_check.json and gpu_check.md go")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter, fp32 only")
    parser.add_argument("--sections", default=None,
                        help="comma-separated letters of the sections to run (g runs g-l, the 4-rank job); "
                             "default: all")
    return parser.parse_args(argv)


def chosen(functions: dict[str, Callable], letters: str | None) -> dict[str, Callable]:
    """The sections whose first letter is in ``letters`` (the 4-rank job, key ``ranks``, answers to ``g``)."""
    if letters is None:
        return functions
    wanted = {x.strip() for x in letters.split(",") if x.strip()}
    first = {name: "g" if name == "ranks" else name[0] for name in functions}
    unknown = wanted - set(first.values())
    if unknown:
        raise SystemExit(f"gpu_check: unknown sections {sorted(unknown)}; choose from {sorted(set(first.values()))}")
    return {name: fn for name, fn in functions.items() if first[name] in wanted}


def section_functions(sizes: Sizes, tmp: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """The sections in their order; ``ranks`` returns the multi-rank sections (g to l) under ``"sections"``."""
    from benchmarks.gpu_check_ranks import run_ranks

    return {
        "a_dispatch_kernels": lambda: section_dispatch_kernels(sizes),
        "b_experts_implementation": lambda: section_experts_implementation(sizes),
        "c_engine": lambda: section_engine(sizes, tmp),
        "d_offloaded_decoding": lambda: section_offloaded_decoding(sizes, tmp),
        "e_save_resume": lambda: section_save_resume(sizes, tmp),
        "f_autocast": lambda: section_autocast(sizes, tmp),
        "ranks": lambda: {"sections": run_ranks(sizes, tmp)},
        "m_sync_debug": lambda: section_sync_debug(sizes, tmp),
    }


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "gpu_check.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported
    problems = missing_dependencies(args.dry_run)
    if problems:
        print("gpu_check: cannot run:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    sizes = dry_sizes() if args.dry_run else cuda_sizes()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        report = {"meta": meta(sizes), "sections": {}}
        for name, fn in chosen(section_functions(sizes, Path(tmp)), args.sections).items():
            result = run_section(fn)
            found = result.pop("sections", None)  # the multi-rank job reports several sections at once
            for section, r in (found or {name: result}).items():
                report["sections"][section] = r
                print(f"gpu_check: {section}: {r['status']} ({r['seconds']:.1f} s)", flush=True)
            write_report(report, out_dir)  # after every section: a run cut short keeps what it finished
    close_process_group()
    print(f"gpu_check: wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}; {NCCL_NOTE}")
    return 0 if all(r["status"] == "ok" for r in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
