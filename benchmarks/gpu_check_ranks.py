"""The GPU check's multi-rank sections: a world of 4 rank processes sharing one device.

NCCL refuses two ranks of one communicator on the same GPU, and a world of one runs no exchange, no gradient
reduction and no reduce-scatter. So the four ranks run gloo: a gloo process group bound to the GPU
(``init_process_group("gloo", device_id=cuda:0)``) makes the engine's mesh a CUDA one (parameters, buffers,
buckets, the token exchange's rows on the GPU) while gloo carries every collective through pinned host memory
(``all_to_all_single``, ``all_reduce``, ``broadcast``, ``all_gather_into_tensor``, and ``reduce_scatter_tensor``
as an all-reduce: torch 2.13's ProcessGroupGloo has CUDA work for each). That is no NCCL and no speed figure,
but every other part of a multi-rank step runs on the device: the exchanges (per-pair, the deduplicated one's
members and its relay across two emulated nodes, the overlapped chunks, the recompute of activation
checkpointing issuing them from the autograd engine's device thread), the bucketed reducer, ZeRO-1, LoRA on the
experts, ``eval_layout``, ``HybridEP(Trainer)`` and TRL's ``SFTTrainer``. Threads as ranks (torch's
multi-threaded process group) cannot serve: the autograd engine runs every backward of one device on one
thread, so four ranks' backward passes, each waiting in a collective for the others, would deadlock there.

``--dry-run`` starts the same 4 processes on the CPU (plain gloo, tiny shapes): the same code paths.

Every section compares against the unsharded model in the rank's own process (the same initial weights on the
global batch, trained by torch alone) per parameter, or, for the trainers, against the same trainer in one
process (:func:`write_references`, run by the parent before the ranks start). Rank ``r`` writes
``rank{r}.json`` after every section; after each section the ranks agree on whether all passed and stop at the
first failure (a failed rank is not left behind in a collective).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.bench_gpu_check import (
    Sizes,
    build_model,
    cuda_sizes,
    device_peak,
    dry_sizes,
    layer_expert_bytes,
    rel_err,
)

WORLD = 4
TWO_NODES = "gpus_per_node=2"  # two emulated nodes of two ranks: the deduplicated exchange relays across them
ROOT = Path(__file__).resolve().parents[1]
# fp32 on both sides; the sharded run sums in other orders (per-rank partial gradients, gloo's reductions) and,
# on the GPU, multiplies fewer rows per GEMM than the reference (other kernels): relative, per parameter
TOL = {"cpu": 1e-5, "cuda": 1e-4}
LR, EPS, MAX_NORM = 1e-3, 1e-6, 0.5
ACCUM = 2
FAILED_GRACE_S = 30  # after a rank failed, seconds the others get to record their own error
SECTIONS = ("g_exchanges", "h_reducer_zero1", "i_lora", "j_eval_layout", "k_trainer", "l_sft")


@dataclass(frozen=True)
class Ctx:
    """One rank's view of the job: sizes, this rank's device, its rank, the job's directory, the tolerance."""

    sizes: Sizes
    device: Any
    rank: int
    out: Path

    @property
    def tol(self) -> float:
        return TOL[self.device.type]


# ----------------------------------------------------------------------------------------------------------------
# launching the ranks (the parent: benchmarks.bench_gpu_check)
# ----------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, port: int, dry_run: bool) -> dict[str, str]:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           # accelerate gives DDP ``device_ids=[LOCAL_RANK]``; the four ranks share device 0, so none (DDP then
           # uses the module's device)
           "ACCELERATE_BYPASS_DEVICE_MAP": "true",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:  # every rank sees the parent's current GPU, as cuda:0
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = torch.cuda.current_device()
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return env


def run_ranks(sizes: Sizes, tmp: Path) -> dict[str, dict]:
    """The reference trainers in this process, then the 4 rank processes (killed after ``sizes.ranks_timeout_s``):
    one result per section of :data:`SECTIONS`, merged over the ranks."""
    out = tmp / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    write_references(sizes, out)
    port = _free_port()
    cmd = [sys.executable, "-m", "benchmarks.gpu_check_ranks", "--out-dir", str(out)]
    cmd += ["--dry-run"] if sizes.dry_run else []
    procs = []
    for rank in range(WORLD):
        log = open(out / f"rank{rank}.log", "w")  # closed once the process has ended
        procs.append((subprocess.Popen(cmd, env=_rank_env(rank, port, sizes.dry_run), stdout=log,
                                       stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True), log))
    _wait([p for p, _ in procs], sizes.ranks_timeout_s)
    for _, log in procs:
        log.close()
    return merge_ranks(out, [p.returncode for p, _ in procs])


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait until every rank has ended, :data:`FAILED_GRACE_S` after one failed (a rank that failed ends at once,
    the others' collectives with it fail when its connections close), or ``timeout_s``; then kill the rest."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def merge_ranks(out: Path, codes: list[int]) -> dict[str, dict]:
    """Per section: ``ok`` when every rank recorded it ``ok``; the figures of every rank (``ranks``), the failed
    ranks' errors, and each missing rank's log tail (a rank that ended or was killed before recording it)."""
    records = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {} for r in range(WORLD)]
    merged: dict[str, dict] = {}
    for name in SECTIONS:
        got = [rec.get(name) for rec in records]
        if all(g is None for g in got) and any(m["status"] != "ok" for m in merged.values()):
            merged[name] = {"status": "not run", "seconds": 0.0, "error": "not run: an earlier section failed"}
            continue
        errors = {r: g["error"] for r, g in enumerate(got) if g is not None and g["status"] != "ok"}
        missing = {r: _log_tail(out / f"rank{r}.log", codes[r]) for r, g in enumerate(got) if g is None}
        status = "ok" if not errors and not missing else "failed"
        merged[name] = {"status": status, "seconds": max((g["seconds"] for g in got if g), default=0.0),
                        "ranks": [g and {k: v for k, v in g.items() if k not in ("status", "seconds", "error")}
                                  for g in got]}
        if status != "ok":
            merged[name]["error"] = "\n".join([f"rank {r}: {e}" for r, e in errors.items()] +
                                              [f"rank {r} recorded nothing: {t}" for r, t in missing.items()])
    return merged


def _log_tail(path: Path, code: int | None) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return f"exit status {code}; log tail:\n{text[-1500:]}"


# ----------------------------------------------------------------------------------------------------------------
# models, batches and comparisons
# ----------------------------------------------------------------------------------------------------------------


_BASE: dict[int, Any] = {}  # the base model, built once per process


def base_model(sizes: Sizes):
    """A fresh copy of the multi-rank sections' model: built on the CPU once (the same weights in every process),
    in train mode."""
    import torch

    if not _BASE:
        _BASE[0] = build_model(sizes.ranks_model, "cpu", torch.float32).train()
    return copy.deepcopy(_BASE[0])


def global_batches(ctx: Ctx, steps: int, seed: int) -> list[list[Any]]:
    """``steps`` × :data:`ACCUM` global micro-batches of token ids ``[WORLD · per_rank, seq]`` on the device."""
    import torch

    per_rank, seq = ctx.sizes.ranks_batch
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, ctx.sizes.ranks_model["vocab"], (WORLD * per_rank, seq), generator=g).to(ctx.device)
             for _ in range(ACCUM)] for _ in range(steps)]


def mine(ctx: Ctx, ids):
    """This rank's rows of a global batch."""
    per_rank = ctx.sizes.ranks_batch[0]
    return ids[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]


def local_view(model, ref_tensor, p):
    """The part of the reference's tensor that ``p`` holds on this rank: its expert slots (an expert adapter's
    factor in the engine's slot-major layout), else the whole tensor."""
    import hf_hybrid_ep as hep
    from hf_hybrid_ep.moe.lora import slots_from_peft

    for layer in hep.state_of(model).layers:
        if any(p is q for q in layer.expert_parameters()):
            return ref_tensor[list(layer.local_experts)]
        for kind, q in layer.experts.adapter_factors():
            if p is q:
                return slots_from_peft(ref_tensor, kind, layer.num_experts, list(layer.local_experts))
    return ref_tensor


def compare(model, ref, ctx: Ctx, what: str) -> dict[str, Any]:
    """Per trainable parameter of ``model``, ``||mine - ref's same slots|| / ||ref's||`` of its gradient (``what``
    = ``"grad"``) or its value (``"param"``): the worst, and the parameters beyond the tolerance or missing."""
    import hf_hybrid_ep as hep

    hep.wait_for_parameters(model)
    theirs = dict(ref.named_parameters())
    rels, missing = {}, []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        got, want = (p.grad, theirs[name].grad) if what == "grad" else (p.detach(), theirs[name].detach())
        if got is None or want is None:
            if (got is None) != (want is None):
                missing.append(name)
            continue
        rels[name] = rel_err(got.detach(), local_view(model, want.detach(), p))
    worst = max(rels, key=rels.get)
    return {"parameters": len(rels), "worst": worst, "worst_rel": rels[worst], "tol": ctx.tol, "missing": missing,
            "violations": sorted(n for n, r in rels.items() if not r <= ctx.tol)}


def train(model, ref, optimizers: tuple, batches: list[list[Any]], ctx: Ctx) -> dict[str, Any]:
    """One optimizer step of both models per entry of ``batches`` (:data:`ACCUM` micro-batches, gradients
    synchronised on the last, clipped to :data:`MAX_NORM`): the mean loss over the ranks and the reference's
    loss, the clipping norms, the first step's gradients compared per parameter, and the final parameters."""
    import torch
    import torch.distributed as dist

    import hf_hybrid_ep as hep

    report: dict[str, Any] = {"loss_rel": [], "norm_rel": []}
    for step, micro_batches in enumerate(batches):
        for micro, ids in enumerate(micro_batches):
            with contextlib.nullcontext() if micro == ACCUM - 1 else hep.no_sync(model):
                loss = model(input_ids=mine(ctx, ids), labels=mine(ctx, ids)).loss
                (loss / ACCUM).backward()
            ref_loss = ref(input_ids=ids, labels=ids).loss
            (ref_loss / ACCUM).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            report["loss_rel"].append(rel_err(mean / WORLD, ref_loss.detach()))
        if step == 0 and not isinstance(optimizers[0], hep.ShardedOptimizer):  # ZeRO-1 holds shards of gradients
            report["first_step_grads"] = compare(model, ref, ctx, "grad")
        norm = hep.clip_grad_norm_(model, MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], MAX_NORM)
        report["norm_rel"].append(rel_err(norm, ref_norm))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    report["params"] = compare(model, ref, ctx, "param")
    return report


def optimizers(model, ref) -> tuple:
    """``hep.make_optimizer``'s AdamW over ``model``'s trainable parameters and torch's AdamW (the same
    implementation: fused or not) over the reference's."""
    import torch

    import hf_hybrid_ep as hep

    opt = hep.make_optimizer(model, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=LR,
                             eps=EPS)
    fused = bool(opt.defaults.get("fused"))
    return opt, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS, fused=fused)


def problems_of(report: dict[str, Any], ctx: Ctx, where: str) -> list[str]:
    """What a run of :func:`train` got wrong against its reference, beyond the tolerance (empty when nothing)."""
    problems = [f"{where}: {key} {max(report[key]):.3g}" for key in ("loss_rel", "norm_rel")
                if not max(report[key]) <= ctx.tol]
    for key in ("first_step_grads", "params"):
        if key in report and (report[key]["violations"] or report[key]["missing"]):
            problems.append(f"{where}: {key} {report[key]}")
    return problems


def raise_if(problems: list[str], figures: dict[str, Any]) -> dict[str, Any]:
    """``figures`` when ``problems`` is empty; else an AssertionError listing them (and the figures, cut)."""
    if problems:
        raise AssertionError("; ".join(problems) + f" -- figures: {json.dumps(figures, default=str)[:2500]}")
    return figures


def pair(ctx: Ctx, config, prepare: Callable | None = None) -> tuple:
    """The reference on the device and a parallelized copy of the same base model (``prepare`` applied to both
    before, e.g. PEFT's adapters)."""
    import hf_hybrid_ep as hep

    base = base_model(ctx.sizes)
    if prepare is not None:
        base = prepare(base)
    ref = copy.deepcopy(base).to(ctx.device)
    return hep.parallelize(base, config), ref


def phase_calls(model) -> dict[str, int]:
    """Calls and remote rows of every exchange phase, summed over the MoE layers (this rank)."""
    import hf_hybrid_ep as hep

    out: dict[str, int] = {}
    for layer in hep.layer_counters(hep.comm_stats(model)):
        for phase, c in layer.items():
            if isinstance(c, dict) and "calls" in c:
                out[f"{phase}_calls"] = out.get(f"{phase}_calls", 0) + c["calls"]
                out[f"{phase}_remote_rows"] = out.get(f"{phase}_remote_rows", 0) + c["remote_rows_sent"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# g. the token exchanges
# ----------------------------------------------------------------------------------------------------------------

# name: (HybridEPConfig fields at dp 1 x ep 4, activation checkpointing)
EXCHANGES: dict[str, tuple[dict[str, Any], bool]] = {
    "per_pair": ({"dispatcher": "torch"}, False),
    "per_pair_triton": ({"dispatcher": "triton"}, False),
    "dedup_one_node": ({"dispatcher": "dedup"}, False),
    "dedup_two_nodes": ({"dispatcher": "dedup", "topology": TWO_NODES}, False),
    "overlap_degree_2": ({"dispatcher": "torch", "overlap_degree": 2}, False),
    "activation_checkpointing": ({"dispatcher": "dedup", "topology": TWO_NODES}, True),
}


def exchange_run(ctx: Ctx, fields: dict[str, Any], checkpointing: bool) -> dict[str, Any]:
    """One optimizer step (two micro-batches) at dp 1 × ep 4 against the reference: what the exchanges moved
    and the comparisons of :func:`train`."""
    import hf_hybrid_ep as hep

    start = time.perf_counter()
    model, ref = pair(ctx, hep.HybridEPConfig(dp_degree=1, ep_degree=WORLD, **fields))
    if checkpointing:  # the forward's exchanges run again inside the backward, from the autograd engine's thread
        model.activation_checkpointing_enable()
    report = train(model, ref, optimizers(model, ref), global_batches(ctx, 1, seed=21), ctx)
    state = hep.state_of(model)
    report.update(dispatcher=state.layers[0].dispatcher.name, layers=len(state.layers), **phase_calls(model),
                  seconds=time.perf_counter() - start)
    return report


def section_exchanges(ctx: Ctx) -> dict[str, Any]:
    """Every exchange of :data:`EXCHANGES` against the reference; each must move rows to other ranks, the
    deduplicated one across the two emulated nodes only with the topology, the chunked one twice per layer, and
    the recompute must repeat the forward's exchanges."""
    runs = {name: exchange_run(ctx, fields, ckpt) for name, (fields, ckpt) in EXCHANGES.items()}
    problems = [p for name, run in runs.items() for p in problems_of(run, ctx, name)]
    forwards = runs["per_pair"]["layers"] * ACCUM  # dispatch calls of one step without chunks or recompute
    expect = {"per_pair": forwards, "overlap_degree_2": 2 * forwards, "activation_checkpointing": 2 * forwards}
    problems += [f"{name}: {runs[name]['dispatch_calls']} dispatch calls, expected {calls}"
                 for name, calls in expect.items() if runs[name]["dispatch_calls"] != calls]
    for name, run in runs.items():
        fields = EXCHANGES[name][0]
        relayed = run.get("dispatch_inter_calls", 0) > 0
        if run["dispatch_remote_rows"] <= 0 or relayed != ("topology" in fields):
            problems.append(f"{name}: remote rows {run['dispatch_remote_rows']}, relayed across nodes {relayed}")
        if run["dispatcher"] != fields["dispatcher"]:
            problems.append(f"{name}: ran {run['dispatcher']!r}")
    return raise_if(problems, {"runs": runs})


# ----------------------------------------------------------------------------------------------------------------
# h. the bucketed gradient reducer, ZeRO-1, and the peak device memory of a save and an optimizer save
# ----------------------------------------------------------------------------------------------------------------


def layout_config(ctx: Ctx, **fields):
    """dp 2 × ep 2 with small gradient buckets (several per step), the per-pair exchange, the router aux loss
    formed over the global batch (as one process forms it over its whole batch)."""
    import hf_hybrid_ep as hep

    return hep.HybridEPConfig(dp_degree=2, ep_degree=2, dispatcher="torch", bucket_size_mb=ctx.sizes.ranks_bucket_mb,
                              aux_loss_scope="global", **fields)


def save_peaks(model, optimizer, ctx: Ctx) -> dict[str, Any]:
    """The device memory a streamed model save and an optimizer-state save allocate on this rank, against one
    layer's experts (unsharded: what the save streams at a time) and the unsharded optimizer state of the dense
    weights (what ZeRO-1 assembles whole to save it)."""
    import hf_hybrid_ep as hep
    from hf_hybrid_ep.model_io.optimizer_state import save_optimizer_state
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

    state = hep.state_of(model)
    experts = {id(p) for layer in state.layers for p in layer.slot_parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts)
    where = ctx.device.type
    return {"save_peak_extra_bytes": device_peak(lambda: save_hybrid_checkpoint(model, ctx.out / "save" / "model"),
                                                 where),
            "optimizer_save_peak_extra_bytes": device_peak(
                lambda: save_optimizer_state(model, optimizer, ctx.out / "save" / "optimizer"), where),
            "layer_expert_bytes": layer_expert_bytes(model), "dense_optimizer_state_bytes": 2 * dense}


def section_reducer_zero1(ctx: Ctx) -> dict[str, Any]:
    """dp 2 × ep 2, ``sizes.ranks_steps`` steps: the reducer (several buckets, launched while backward runs,
    dense and expert bytes reduced) against the reference per parameter; ZeRO-1 (each rank keeps a quarter of the
    dense state) against the reference's AdamW per parameter; then a save and an optimizer save of the ZeRO-1
    model, their peak device memory against what they must hold at once."""
    import hf_hybrid_ep as hep

    batches = global_batches(ctx, ctx.sizes.ranks_steps, seed=31)
    model, ref = pair(ctx, layout_config(ctx))
    reducer = train(model, ref, optimizers(model, ref), batches, ctx)
    reducer["reduction"] = hep.comm_stats(model)["gradient_reduction"]
    reducer["buckets"] = [(b.kind, b.numel) for b in hep.state_of(model).reducer.active_buckets()]
    model, ref = pair(ctx, layout_config(ctx, optimizer_sharding="zero1"))
    opt, ref_opt = optimizers(model, ref)
    zero1 = train(model, ref, (opt, ref_opt), batches, ctx)
    report = hep.memory_report(model, opt)
    zero1.update(optimizer=type(opt).__name__, state_elements=report["state_elements"],
                 parameters=sum(p.numel() for p in ref.parameters()))
    saves = save_peaks(model, opt, ctx)
    problems = problems_of(reducer, ctx, "reducer") + problems_of(zero1, ctx, "zero1")
    r = reducer["reduction"]
    if not (r["reductions"] > 1 and r["buckets_launched_in_backward"] > 0 and r["dense_bytes"] > 0
            and r["expert_bytes"] > 0 and len(reducer["buckets"]) > 2):
        problems.append(f"reducer: {r}, buckets {reducer['buckets']}")
    if not (zero1["optimizer"] == "ShardedAdamW" and zero1["state_elements"] < zero1["parameters"] / 2):
        problems.append(f"zero1: {zero1['optimizer']} keeps {zero1['state_elements']} of {zero1['parameters']}")
    if saves["save_peak_extra_bytes"] is not None and saves["save_peak_extra_bytes"] > saves["layer_expert_bytes"]:
        problems.append(f"the save allocated {saves['save_peak_extra_bytes']} device bytes, more than one layer's "
                        f"experts ({saves['layer_expert_bytes']})")
    bound = saves["layer_expert_bytes"] * 2 + saves["dense_optimizer_state_bytes"]
    if (saves["optimizer_save_peak_extra_bytes"] or 0) > bound:
        problems.append(f"the optimizer save allocated {saves['optimizer_save_peak_extra_bytes']} device bytes, "
                        f"more than the dense optimizer state and one layer's expert state ({bound})")
    return raise_if(problems, {"reducer": reducer, "zero1": zero1, **saves})


# ----------------------------------------------------------------------------------------------------------------
# i. LoRA on attention and on the experts
# ----------------------------------------------------------------------------------------------------------------


def with_adapters(base):
    """PEFT's LoRA on ``q_proj`` / ``v_proj`` and on the fused experts' parameters, every ``lora_B`` drawn
    non-zero (PEFT starts it at zero, which would leave ``lora_A`` without a first gradient)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(41)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def section_lora(ctx: Ctx) -> dict[str, Any]:
    """dp 2 × ep 2, ``sizes.ranks_steps`` AdamW steps on the adapters against PEFT's own code path in this
    process: every adapter's first gradient and final value (expert factors in their slots); the base weights
    get no gradient."""
    model, ref = pair(ctx, layout_config(ctx), with_adapters)
    run = train(model, ref, optimizers(model, ref), global_batches(ctx, ctx.sizes.ranks_steps, seed=41), ctx)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    run.update(adapters=len(trainable), expert_adapters=sum("experts" in n for n in trainable),
               base_grads=[n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None])
    problems = problems_of(run, ctx, "lora")
    if run["base_grads"] or not run["expert_adapters"] or not all("lora_" in n for n in trainable):
        problems.append(f"trainable {trainable}, base weights with gradients {run['base_grads']}")
    return raise_if(problems, run)


# ----------------------------------------------------------------------------------------------------------------
# j. evaluation at a smaller EP degree
# ----------------------------------------------------------------------------------------------------------------


def section_eval_layout(ctx: Ctx) -> dict[str, Any]:
    """dp 1 × ep 4: logits under ``no_grad`` at the training layout and inside ``eval_layout(model, 1)`` (every
    rank holding all experts) against the reference's; the training layout back afterwards, and a training step
    after it still equal to the reference's."""
    import torch

    import hf_hybrid_ep as hep

    model, ref = pair(ctx, hep.HybridEPConfig(dp_degree=1, ep_degree=WORLD, dispatcher="torch"))
    ids = mine(ctx, global_batches(ctx, 1, seed=51)[0][0])
    shapes = [tuple(p.shape) for p in model.parameters()]
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        report: dict[str, Any] = {"training_layout_rel": rel_err(model(input_ids=ids).logits, want)}
        with hep.eval_layout(model, 1):
            report["inside_expert_shapes"] = [tuple(layer.expert_parameters()[0].shape)
                                              for layer in hep.state_of(model).layers]
            report["eval_layout_rel"] = rel_err(model(input_ids=ids).logits, want)
    report["restored"] = shapes == [tuple(p.shape) for p in model.parameters()]
    report["after"] = train(model, ref, optimizers(model, ref), global_batches(ctx, 1, seed=52), ctx)
    experts = ctx.sizes.ranks_model["experts"]
    problems = [f"{k} {report[k]:.3g}" for k in ("training_layout_rel", "eval_layout_rel") if not report[k] <= ctx.tol]
    if not report["restored"] or any(s[0] != experts for s in report["inside_expert_shapes"]):
        problems.append(f"inside: {report['inside_expert_shapes']}, restored after: {report['restored']}")
    return raise_if(problems + problems_of(report["after"], ctx, "after eval_layout"), report)


# ----------------------------------------------------------------------------------------------------------------
# k, l. HybridEP(Trainer) and HybridEP(SFTTrainer), against the same trainers in one process
# ----------------------------------------------------------------------------------------------------------------

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(100)]


def _rows(sizes: Sizes) -> int:
    """Examples a run of ``sizes.ranks_steps`` steps reads (every rank's per-device batch, accumulated)."""
    return WORLD * sizes.ranks_batch[0] * ACCUM * sizes.ranks_steps


def lm_dataset(sizes: Sizes):
    """Rows of random token ids (``labels`` = ``input_ids``), ``sizes.ranks_batch[1]`` tokens each."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(61)
    ids = torch.randint(3, sizes.ranks_model["vocab"], (_rows(sizes), sizes.ranks_batch[1]), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def tokenizer():
    """A word-level tokenizer of :data:`WORDS`, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft_dataset(sizes: Sizes):
    """Prompt-completion rows of 2-6 words each (the loss on the completions only)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(62)

    def words() -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 100, (int(torch.randint(2, 7, (), generator=g)),),
                                                              generator=g))

    rows = [(words(), words()) for _ in range(_rows(sizes))]
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [" " + c for _, c in rows]})


def sft_model(sizes: Sizes):
    """:func:`base_model` with the tokenizer's special tokens."""
    model = base_model(sizes)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, None
    return model


def trainer_settings(sizes: Sizes, output_dir: Path, per_device: int, ranks: bool) -> dict[str, Any]:
    """The arguments both trainers share (fp32, sequential data, accumulation, clipping that acts); ``ranks``:
    the distributed run (gloo, the process group the rank made)."""
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=per_device, gradient_accumulation_steps=ACCUM,
                    max_steps=sizes.ranks_steps, learning_rate=LR, adam_epsilon=EPS, max_grad_norm=MAX_NORM,
                    logging_steps=1, save_strategy="no", use_cpu=sizes.dry_run, bf16=False, report_to=[], seed=0,
                    dataloader_num_workers=0, disable_tqdm=True, train_sampling_strategy="sequential")
    return {**settings, "ddp_backend": "gloo"} if ranks else settings


def make_trainer(kind: str, sizes: Sizes, output_dir: Path, model, ranks: bool):
    """The stock ``Trainer`` (``kind="trainer"``) or TRL's ``SFTTrainer`` (``"sft"``) on ``model``: per device one
    rank's batch in the distributed run, the global batch in one process."""
    per_device = sizes.ranks_batch[0] * (1 if ranks else WORLD)
    settings = trainer_settings(sizes, output_dir, per_device, ranks)
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        trainer_class, args, data = Trainer, TrainingArguments(**settings), {"train_dataset": lm_dataset(sizes)}
    else:
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**settings, packing=False, max_length=sizes.ranks_batch[1])
        trainer_class, data = SFTTrainer, {"train_dataset": sft_dataset(sizes), "processing_class": tokenizer()}
    if ranks:
        from hf_hybrid_ep.integrations import HybridEP

        trainer_class = HybridEP(trainer_class)
    return trainer_class(model=model, args=args, **data)


def logged(trainer) -> dict[str, list[float]]:
    history = trainer.state.log_history
    return {"losses": [e["loss"] for e in history if "loss" in e],
            "grad_norms": [e["grad_norm"] for e in history if "grad_norm" in e]}


def write_references(sizes: Sizes, out: Path) -> None:
    """The losses and gradient norms of the stock ``Trainer`` and of ``SFTTrainer`` in this one process on the
    global batches, in ``out/reference.json``."""
    reference = {}
    for kind, build in (("trainer", base_model), ("sft", sft_model)):
        trainer = make_trainer(kind, sizes, out / f"reference-{kind}", build(sizes), ranks=False)
        trainer.train()
        reference[kind] = logged(trainer)
    (out / "reference.json").write_text(json.dumps(reference))


def trainer_section(kind: str) -> Callable[[Ctx], dict[str, Any]]:
    """A section: ``HybridEP(kind)`` at dp 2 × ep 2 for ``sizes.ranks_steps`` steps; its logged losses and gradient
    norms against the same trainer in one process; DDP wraps the model and reduces the dense gradients."""

    def section(ctx: Ctx) -> dict[str, Any]:
        import hf_hybrid_ep as hep

        build = base_model if kind == "trainer" else sft_model
        model = hep.parallelize(build(ctx.sizes), layout_config(ctx))
        trainer = make_trainer(kind, ctx.sizes, ctx.out / f"run-{kind}", model, ranks=True)
        trainer.train()
        want = json.loads((ctx.out / "reference.json").read_text())[kind]
        report = {**logged(trainer), "reference": want, "wrapped": type(trainer.model_wrapped).__name__,
                  "placed_on": sorted({str(p.device) for p in model.parameters()}),
                  "dense_bytes_reduced_by_engine": hep.comm_stats(model)["gradient_reduction"]["dense_bytes"]}
        problems = []
        for key in ("losses", "grad_norms"):
            if len(report[key]) != len(want[key]) or not all(
                    abs(a - b) <= ctx.tol * abs(b) for a, b in zip(report[key], want[key], strict=False)):
                problems.append(f"{key} {report[key]} vs {want[key]}")
        if report["wrapped"] != "DistributedDataParallel" or report["dense_bytes_reduced_by_engine"] != 0:
            problems.append(f"wrapped in {report['wrapped']}, engine reduced {report['dense_bytes_reduced_by_engine']} "
                            "dense bytes")
        if report["placed_on"] != [str(ctx.device) if ctx.device.type == "cpu" else "cuda:0"]:
            problems.append(f"parameters on {report['placed_on']}")
        return raise_if(problems, report)

    return section


# ----------------------------------------------------------------------------------------------------------------
# the rank's driver
# ----------------------------------------------------------------------------------------------------------------

SECTION_FNS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "g_exchanges": section_exchanges, "h_reducer_zero1": section_reducer_zero1, "i_lora": section_lora,
    "j_eval_layout": section_eval_layout, "k_trainer": trainer_section("trainer"), "l_sft": trainer_section("sft"),
}
PG_TIMEOUT_S = 300  # a rank that stops in a collective ends the others' wait after this (gloo's timeout)


def init_world(dry_run: bool):
    """The world's gloo process group; on the GPU bound to ``cuda:0`` (the engine's mesh is then a CUDA one).
    Returns this rank's device."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=PG_TIMEOUT_S)
    if dry_run:
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.init()  # DeviceMesh sets the device from LOCAL_RANK where CUDA is not initialised yet
    dist.init_process_group("gloo", timeout=timeout, device_id=device)
    return device


def worker(out: Path, dry_run: bool) -> int:
    """Run every section on this rank, recording each in ``rank{r}.json``; end at once after a section that failed
    here (the other ranks' next collective with this one then fails), and after one that failed elsewhere."""
    import torch.distributed as dist

    from benchmarks.bench_gpu_check import run_section

    device = init_world(dry_run)
    ctx = Ctx(dry_sizes() if dry_run else cuda_sizes(), device, dist.get_rank(), out)
    record: dict[str, dict] = {}
    for name in SECTIONS:
        record[name] = run_section(lambda name=name: SECTION_FNS[name](ctx))
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record, default=str))
        print(f"rank {ctx.rank}: {name}: {record[name]['status']} ({record[name]['seconds']:.1f} s)", flush=True)
        statuses: list = [None] * WORLD
        if record[name]["status"] == "ok":
            with contextlib.suppress(RuntimeError):  # a rank that failed has gone: its connections are closed
                dist.all_gather_object(statuses, "ok")
        if any(s != "ok" for s in statuses):
            sys.stdout.flush()
            os._exit(1)  # no process-group teardown with ranks gone or stuck
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True, help="the job's directory (reference.json in, rank*.json out)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny shapes")
    args = parser.parse_args(argv)
    return worker(Path(args.out_dir), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
