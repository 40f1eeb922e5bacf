"""Training cases: optimizer steps of the hybrid model against the single-process reference.

:func:`train_parity` is the main parity case (accumulation, clipping, AdamW, with every engine option:
placement, dispatcher, sharding, shadowing, rebalancing, loading, injected faults); the others cover
one-expert routing, composition with torch DDP, inf-norm clipping and the CTR example's own check.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from collections.abc import Callable, Iterable

import parity
import torch
import torch.distributed as dist
from tiny_models import build_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import hf_hybrid_ep as hep

from .common import (
    ADAM_EPS,
    SEQ,
    _build,
    _compare_params,
    _full,
    _global_inputs,
    _local_view,
    _rank_slice,
    _rel,
    _skew_routers,
    _tables,
)


def train_parity(
    model_type: str,
    dp: int,
    ep: int,
    num_experts: int,
    steps: int = 3,
    accum: int = 2,
    max_norm: float = 0.5,
    placement: list[list[int]] | dict[str, list[list[int]]] | None = None,
    lr: float = 1e-3,
    gradient_checkpointing: bool = False,
    dispatcher: str = "auto",
    expert_alignment: int = 1,
    optimizer_sharding: str = "none",
    dense_sharding: str = "replicate",
    shadow_capacity: int | None = None,
    skew: tuple[list[int], float] | None = None,
    seq: int = SEQ,
    load_from: str | None = None,
    fault: str | None = None,
    bucket_size_mb: float = 8.0,
    overlap_grad_reduce: bool = True,
    rebalance_every: int | None = None,
    rebalance_replicas: int = 0,
    rebalance_over: float | None = None,
    topology: str | None = None,
    overlap_degree: int = 1,
    plain_optimizer: bool = False,
    router_aux: tuple[float, str] | None = None,
) -> dict:
    """AdamW steps with gradient accumulation and clipping, hybrid vs the single-process reference.

    The reference trains the unsharded model on the global batch in fp32; the checks and the measured
    bound of zero-initialised tensors are :mod:`parity`'s. ``shadow_capacity`` turns hot-expert
    shadowing on (``after_optimizer_step`` after every optimizer step); ``skew = (hot experts, bias)`` raises
    those experts' router bias in both models. With ``load_from``, the hybrid model is loaded
    rank-locally from that checkpoint of the same weights (``hf_hybrid_ep.from_pretrained``; its
    placement is the one stored in the index). ``fault`` injects one of :data:`faults.FAULTS` into the
    hybrid run (undone when the case returns), to show that the criterion catches it. With
    ``rebalance_every``, experts move online (``after_optimizer_step`` after every optimizer step); the tables
    before and after each rebalance are returned. ``plain_optimizer``: ``torch.optim.AdamW(model.parameters())``
    built by hand instead of ``make_optimizer`` (rebalancing must find it). ``router_aux = (coef, scope)``: the
    model's own router aux loss on in both (``output_router_logits``), formed by the hybrid model over the tokens
    ``aux_loss_scope=scope`` says.
    """
    import faults

    world = dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    if skew is not None:
        _skew_routers(model, *skew)
        _skew_routers(ref, *skew)
    for m in (model, ref) if router_aux is not None else ():
        m.config.output_router_logits, m.router_aux_loss_coef = True, router_aux[0]
    initial = copy.deepcopy(ref)
    measured_names = parity.zero_initialised(initial)
    if dispatcher == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # the CPU interpreter; read when the kernels are imported
    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, placement=placement or "contiguous", dispatcher=dispatcher,
                                expert_alignment=expert_alignment, shadow_experts=shadow_capacity is not None,
                                shadow_capacity=shadow_capacity or 1, optimizer_sharding=optimizer_sharding,
                                dense_sharding=dense_sharding, bucket_size_mb=bucket_size_mb,
                                overlap_grad_reduce=overlap_grad_reduce, rebalance_every=rebalance_every,
                                rebalance_replicas=rebalance_replicas, rebalance_when_imbalance_over=rebalance_over,
                                topology=topology, overlap_degree=overlap_degree,
                                aux_loss_scope=router_aux[1] if router_aux else "local")
    model = _hybrid_model(model, ref, config, load_from)
    if gradient_checkpointing:  # recomputes the EP forward (and its collectives) inside backward
        model.activation_checkpointing_enable()
    opt, ref_opt, ref_optimizer = _optimizers(model, ref, lr, plain_optimizer)
    batches = [[_global_inputs(ref, world, seed=1000 * step + micro, seq=seq) for micro in range(accum)]
               for step in range(steps)]
    shadowing = shadow_capacity is not None
    routing = shadowing or rebalance_every is not None or rebalance_over is not None
    with faults.injected(fault, model):
        run = _train_steps(model, ref, (opt, ref_opt), batches, max_norm, shadowing, routing)
    params = dict(model.named_parameters())
    view = lambda name, t: _local_view(model, t, params[name])  # noqa: E731
    spread_of = lambda names: parity.measured_spread(initial, ref, names, ref_optimizer, batches, max_norm, world,  # noqa: E731
                                                     view)
    return _parity_report(model, ref, run, max_norm, measured_names, spread_of, step_budget=2 * steps * lr)


def _hybrid_model(model: torch.nn.Module, ref: torch.nn.Module, config: hep.HybridEPConfig,
                  load_from: str | None) -> torch.nn.Module:
    """``model`` parallelized with ``config`` or, with ``load_from``, the same weights loaded rank-locally from
    that checkpoint (in the reference's attention implementation, in training mode)."""
    if load_from is not None:
        model = hep.from_pretrained(load_from, config)
        model.set_attn_implementation(ref.config._attn_implementation)
        model.train()
    else:
        hep.parallelize(model, config)
    return model


def _optimizers(model: torch.nn.Module, ref: torch.nn.Module, lr: float, plain: bool = False) -> tuple[
        torch.optim.Optimizer, torch.optim.Optimizer, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]]:
    """AdamW for the hybrid model (``plain``: built by hand, fused) and for the reference, and the reference's
    factory (for the measured spread)."""
    if plain:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS, fused=True)
    else:
        opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=lr, eps=ADAM_EPS)
    implementation = {k: v for k, v in opt.defaults.items() if k in ("fused", "foreach") and v}

    # the hybrid run's implementation (fused AdamW here), so only the engine differs
    def ref_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, eps=ADAM_EPS, **implementation)

    return opt, ref_optimizer(ref.parameters()), ref_optimizer


@dataclasses.dataclass
class _TrainingRun:
    """What :func:`_train_steps` measured: per micro-batch, per step, and at step 0."""

    loss_diffs: list[float] = dataclasses.field(default_factory=list)
    norm_diffs: list[float] = dataclasses.field(default_factory=list)
    norms: list[float] = dataclasses.field(default_factory=list)
    grad_diffs: list[float] = dataclasses.field(default_factory=list)
    frozen_with_grad: list[str] = dataclasses.field(default_factory=list)
    shadow_steps: list[dict] = dataclasses.field(default_factory=list)
    tables: list[dict[str, list[list[int]]]] = dataclasses.field(default_factory=list)


def _train_steps(model: torch.nn.Module, ref: torch.nn.Module,
                 optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer], batches: list[list[dict]],
                 max_norm: float, shadowing: bool, routing: bool) -> _TrainingRun:
    """One optimizer step of both models per entry of ``batches`` (accumulated, clipped); with ``shadowing``
    the step's shadow counters, with ``routing`` the tables before each ``after_optimizer_step``."""
    ref_grads = dict(ref.named_parameters())
    run = _TrainingRun()
    for step in range(len(batches)):
        run.loss_diffs += _accumulate(model, ref, batches[step])
        if step == 0:
            run.grad_diffs = _grad_diffs(model, ref_grads)
            run.frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        norm = hep.clip_grad_norm_(model, max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        run.norms.append(ref_norm.item())
        run.norm_diffs.append(abs(norm.item() - ref_norm.item()) / ref_norm.item())
        for o in optimizers:
            o.step()
            o.zero_grad()
        if shadowing:
            run.shadow_steps.append(_shadow_step_counters(model))
            hep.reset_comm_stats(model)
        if routing:
            run.tables.append(_tables(model))
            hep.after_optimizer_step(model)
    return run


def _accumulate(model: torch.nn.Module, ref: torch.nn.Module, micro_batches: list[dict]) -> list[float]:
    """Forward and backward of one step's micro-batches (the hybrid model on this rank's slice, gradients
    synchronised on the last; the reference on the global batch); each mean loss's relative difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    accum, loss_diffs = len(micro_batches), []
    for micro, batch in enumerate(micro_batches):
        sync = contextlib.nullcontext() if micro == accum - 1 else hep.no_sync(model)
        with sync:
            loss = model(**_rank_slice(batch, rank)).loss
            (loss / accum).backward()
        ref_loss = ref(**batch).loss
        (ref_loss / accum).backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        loss_diffs.append(abs(mean_loss.item() / world - ref_loss.item()) / abs(ref_loss.item()))
    return loss_diffs


def _parity_report(model: torch.nn.Module, ref: torch.nn.Module, run: _TrainingRun, max_norm: float,
                   measured_names: set[str], spread_of: Callable[[list[str]], dict[str, float]],
                   step_budget: float) -> dict:
    """The result of :func:`train_parity`: tables, rebalances, buckets, the measured differences and
    :mod:`parity`'s check of the final parameters."""
    state = hep.state_of(model)
    reducer, rebalancer, final = state.reducer, state.rebalancer, _tables(model)
    return {
        "tables": [*run.tables, final],  # before each after_optimizer_step, and at the end
        "rebalances": [] if rebalancer is None else [(e.step, e.bytes_sent) for e in rebalancer.events],
        "shadow_steps": run.shadow_steps,
        "buckets": [(b.kind, b.size, b.numel) for b in reducer.active_buckets()],
        "launched_in_backward": reducer.stats.buckets_launched_in_backward,
        "max_loss_rel": max(run.loss_diffs),
        "max_norm_rel": max(run.norm_diffs),
        "max_grad_rel_step0": max(run.grad_diffs),
        "clipped": any(n > max_norm for n in run.norms),
        "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
        "frozen_with_grad": run.frozen_with_grad,
        "placement": final[state.layers[0].name],
        "placements": final,
        "zero_initialised": sorted(measured_names),
        **_compare_params(model, ref, measured_names, spread_of, step_budget=step_budget),
    }


def _shadow_step_counters(model: torch.nn.Module) -> dict:
    """Hot-expert shadowing counters of one optimizer step, summed over the MoE layers."""
    layers = hep.layer_counters(hep.comm_stats(model))
    keys = ("rows_local", "shadows_held", "net_bytes_saved", "weight_bytes_received", "grad_bytes_sent",
            "token_bytes_avoided")
    return {key: sum(v["shadow"][key] for v in layers) for key in keys} | {
        "remote_rows_sent": sum(v["dispatch"]["remote_rows_sent"] for v in layers)}


def _grad_diffs(model: torch.nn.Module, ref_params: dict) -> list[float]:
    """Per-tensor relative gradient differences vs the reference; under zero1 only the owned shards
    hold reduced gradients, so those slices are compared."""
    sharding = hep.state_of(model).reducer.sharding
    names = {id(p): n for n, p in model.named_parameters()}
    diffs = []
    if sharding is not None:  # per whole tensor: ‖a − b‖² and ‖b‖² summed over the owners of its pieces
        sharding.attach_grads()
        order = [n for n, p in model.named_parameters() if id(p) in sharding.sharded_params]
        sums = torch.zeros(len(order), 2, dtype=torch.float64)
        for o in sharding.owned():
            n = names[id(o.param)]
            want = _local_view(model, ref_params[n].grad, o.param).reshape(-1)[o.start : o.stop].double()
            sums[order.index(n)] += torch.stack([(o.view.grad.double() - want).pow(2).sum(), want.pow(2).sum()])
        dist.all_reduce(sums)
        diffs += [(num / den).sqrt().item() if den > 0 else num.sqrt().item() for num, den in sums]
    for n, p in model.named_parameters():
        if p.requires_grad and (sharding is None or id(p) not in sharding.sharded_params):
            diffs.append(_rel(_full(p.grad), _local_view(model, ref_params[n].grad, p)))
    return diffs


def one_hot_expert_training(model_type: str, ep: int, num_experts: int) -> dict:
    """top-1 routing with a zeroed router: every token goes to one expert, the other ranks receive nothing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_tiny_model(model_type, num_experts=num_experts, top_k=1)
    for name, p in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")):
            p.data.zero_()
    model.train()
    ref = copy.deepcopy(model)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=ADAM_EPS)
    received, none_grads, zero_slots = 0, 0, 0
    for step in range(2):
        batch = _global_inputs(ref, world, seed=step)
        model(**_rank_slice(batch, rank)).loss.backward()
        ref(**batch).loss.backward()
        state = hep.state_of(model)
        received += sum(layer.stats.phases["dispatch"].rows_received for layer in state.layers)
        for layer in state.layers:
            for p in layer.expert_parameters():
                none_grads += p.grad is None
                if p.grad is not None:
                    zero_slots += int((p.grad.reshape(p.shape[0], -1).abs().sum(1) == 0).sum())
        hep.clip_grad_norm_(model, 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        hep.reset_comm_stats(model)
    return {"rows_received": received, "none_grads": none_grads, "zero_slots": zero_slots,
            **_compare_params(model, ref)}


def ddp_composition(model_type: str, dp: int, ep: int, num_experts: int) -> dict:
    """torch DDP reduces the dense weights (experts on its ignore list), the engine only the experts."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, reduce_dense_gradients=False))
    DDP._set_params_and_buffers_to_ignore_for_model(model, hep.state_of(model).expert_parameter_names(model))
    wrapped = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=ADAM_EPS)
    for step in range(2):
        batch = _global_inputs(ref, world, seed=step)
        wrapped(**_rank_slice(batch, rank)).loss.backward()
        ref(**batch).loss.backward()
        hep.clip_grad_norm_(model, 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    stats = hep.comm_stats(model)["gradient_reduction"]
    return {**_compare_params(model, ref), "dense_bytes": stats["dense_bytes"]}


def inf_norm(model_type: str, ep: int, num_experts: int) -> dict:
    """clip_grad_norm_ with norm_type=inf equals torch's on the unsharded model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep))
    batch = _global_inputs(ref, world, seed=11)
    model(**_rank_slice(batch, rank)).loss.backward()
    ref(**batch).loss.backward()
    got = hep.clip_grad_norm_(model, 1e-3, norm_type=math.inf)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=math.inf)
    return {"rel": abs(got.item() - want.item()) / want.item()}


def ctr_parity(dp: int, ep: int) -> dict:
    """One Adam step of the CTR example's MoE model on hybrid EP vs one process (the example's own check)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "recsys_ctr"))
    from step_parity import one_step_parity

    return one_step_parity(dp, ep)


def bucket_launch_order() -> dict:
    """Three one-parameter buckets over the world (fp32, bf16, fp32: two dtypes share one process group),
    whose gradients become ready in opposite orders on even and odd ranks. Returns each rank's readiness
    order, the bucket positions in the order their all-reduces were issued, and the reduced gradients."""
    from hf_hybrid_ep.engine.backward import BackwardSequence
    from hf_hybrid_ep.parallel.grads import GradientReducer
    from hf_hybrid_ep.parallel.mesh import build_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    params = [torch.nn.Parameter(torch.ones(8, dtype=dt)) for dt in (torch.float32, torch.bfloat16, torch.float32)]
    ready: list[int] = []
    for i, p in enumerate(params):  # registered before the reducer's hooks, so they see readiness first
        p.register_post_accumulate_grad_hook(lambda _, i=i: ready.append(i))
    reducer = GradientReducer(build_mesh(world, 1), params, params, [], [], bucket_bytes=1)
    BackwardSequence(reducer)  # hooks its parameters: the reduction runs in backward
    reducer.attach_grads()
    position = {b.grad_buffer.data_ptr(): b.position for b in reducer.buckets()}
    issued: list[int] = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        issued.append(position[tensor.data_ptr()])
        return real(tensor, *args, **kwargs)

    # autograd runs the branch built last first: even ranks build 0, 1, 2 and odd ranks 2, 1, 0
    order = range(3) if rank % 2 == 0 else range(2, -1, -1)
    dist.all_reduce = spy
    try:
        sum((params[i].float() * (i + 1)).sum() for i in order).backward()
    finally:
        dist.all_reduce = real
    return {"ready": ready, "issued": issued, "grads": [p.grad.float().tolist() for p in params]}


class _GroupedGemmDtypes(TorchDispatchMode):
    """The input dtypes of every grouped GEMM (``_grouped_mm`` or transformers' fallback op) run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "grouped_mm" in func._overloadpacket.__name__:
            self.dtypes.update(str(a.dtype).removeprefix("torch.") for a in args[:2] if torch.is_tensor(a))
        return func(*args, **(kwargs or {}))


def autocast_parity(model_type: str, ep: int, num_experts: int, overlap_degree: int = 1, dispatcher: str = "auto") -> dict:
    """One forward and backward of the hybrid model (grouped_mm experts) under ``torch.autocast(bfloat16)``
    over fp32 weights, against the fp32 single-process reference. The bf16 round-off of that computation is
    measured by the reference model run the same way in one process, with eager experts (each expert GEMM
    an ``F.linear``, which autocast runs in bf16). Returns the dtypes of the hybrid's grouped GEMMs, the
    bytes per exchanged row of every phase, the gradients' dtypes, and per tensor the distance to the
    fp32 reference with its bound (``SAFETY`` × the measured round-off, at least ``REL_TOL``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    bf16_ref = copy.deepcopy(ref)
    bf16_ref.set_experts_implementation("eager")
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep, overlap_degree=overlap_degree, dispatcher=dispatcher))
    batch = _global_inputs(ref, world, seed=3)
    gemms = _GroupedGemmDtypes()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with gemms:
            loss = model(**_rank_slice(batch, rank)).loss
        bf16_loss = bf16_ref(**batch).loss
    loss.backward()
    bf16_loss.backward()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    mean_loss = loss.detach().float().clone()
    dist.all_reduce(mean_loss)
    refs, bf16s = dict(ref.named_parameters()), dict(bf16_ref.named_parameters())
    tensors = []
    for name, p in model.named_parameters():
        want = _local_view(model, refs[name].grad, p)
        spread = _rel(_local_view(model, bf16s[name].grad, p), want)
        tensors.append((name, _rel(p.grad, want), max(parity.SAFETY * spread, parity.REL_TOL)))
    counters = hep.layer_counters(hep.comm_stats(model))
    return {
        "gemm_dtypes": sorted(gemms.dtypes), "hidden": model.config.hidden_size,
        "top_k": hep.state_of(model).layers[0].load.top_k,
        "row_bytes": {phase: sorted({layer[phase]["bytes_sent"] // layer[phase]["rows_sent"] for layer in counters
                                     if layer[phase]["rows_sent"]}) for phase in ("dispatch", "combine",
                                                                                   "dispatch_backward", "combine_backward")},
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "loss": (_rel(mean_loss / world, ref_loss.detach()), _rel(bf16_loss.detach().float(), ref_loss.detach())),
        "tensors": tensors,
    }


def engine_aux_global(dp: int, ep: int) -> dict:
    """The engine's own router losses (``aux_loss_coef`` / ``z_loss_coef``) with ``aux_loss_scope="global"``: their
    value on this rank and the routers' world-averaged gradient, against the Switch and z losses written out over
    the global batch in one process (the unsharded reference's router outputs)."""
    from hf_hybrid_ep.moe.router_rules import find_router

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    plain = copy.deepcopy(model)
    coef, z_coef = 0.1, 0.01  # large enough that the language-model loss's round-off does not mask them
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, aux_loss_scope="global",
                                              aux_loss_coef=coef, z_loss_coef=z_coef))
    hep.parallelize(plain, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    batch = _global_inputs(ref, world, seed=7)
    routers = {id(m): [layer.load.router for layer in hep.state_of(m).layers] for m in (model, plain)}
    routers[id(ref)] = [find_router(ref, n, e.num_experts)[1] for n, e in hep.find_experts_modules(ref)]
    outs: list = []
    hooks = [r.register_forward_hook(lambda m, a, o: outs.append(o)) for r in routers[id(ref)]]
    ref(**batch)
    for h in hooks:
        h.remove()
    want = 0.0
    for logits, _, index in outs:
        tokens_per_expert = torch.bincount(index.reshape(-1), minlength=4).float()
        want = want + coef * 4 * (tokens_per_expert / index.numel() * torch.softmax(logits.float(), -1).mean(0)).sum()
        want = want + z_coef * torch.logsumexp(logits.float(), -1).pow(2).mean()
    want.backward()
    losses = [m(**_rank_slice(batch, rank)).loss for m in (model, plain)]
    for loss in losses:  # the same language-model loss: the difference is the router losses' gradient
        loss.backward()
    grad_rels = []
    for mine, base, r in zip(routers[id(model)], routers[id(plain)], routers[id(ref)], strict=True):
        grad = mine.weight.grad - base.weight.grad
        dist.all_reduce(grad)  # DDP's mean
        grad_rels.append(_rel(grad / world, r.weight.grad))
    value = (losses[0] - losses[1]).item()
    return {"value_rel": abs(value - want.item()) / want.item(), "grad_rel": max(grad_rels)}
