"""Functions that run on every rank of a :class:`worker_pool.WorkerPool` (one gloo process group).

Each builds a tiny real transformers model identically on every rank, keeps an unsharded copy as
the single-process reference (trained on the global batch), parallelizes the other copy and returns
plain numbers for the test to assert on.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import parity
import torch
import torch.distributed as dist
from tiny_models import SkipModel, build_tiny_model, tiny_inputs

import hf_hybrid_ep as hep

BATCH_PER_RANK = 2
SEQ = 8
REL_TOL = parity.REL_TOL  # the criterion and its rule: tests/parity.py
# Adam's default eps=1e-8 turns gradient elements of ~1e-8 into sign-like steps. Such elements are sums
# of cancelling contributions (fp32 round-off ~1e-9), or whole tensors whose true gradient is identically
# zero (k_proj.bias under softmax shift invariance): their updates are then set by round-off alone, and
# two correct fp32 computations that only sum in another order differ by >1e-5 per tensor after a few
# steps (measured on a Mixtral embedding row: g = 1.539e-8 vs 1.447e-8 gave updates -3.881e-4 vs
# -3.765e-4). eps=1e-6 keeps Adam well-conditioned, so the comparison measures the engine.
ADAM_EPS = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return parity.rel(a, b)


def _global_inputs(model, world: int, seed: int, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(seed)
    return tiny_inputs(model, BATCH_PER_RANK * world, seq, g)


def _skew_routers(model, hot: list[int], bias: float) -> None:
    """Make experts ``hot`` draw most tokens: raise their logits in every router's bias."""
    from hf_hybrid_ep.routing import find_router

    for name, module in hep.find_experts_modules(model):
        router = find_router(model, name, module.num_experts)[1]
        with torch.no_grad():
            router.bias[hot] += bias


def _rank_slice(inputs: dict, rank: int) -> dict:
    lo, hi = rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK
    return {k: (v[lo:hi] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in inputs.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2-sharded dense weight or gradient) assembled whole; other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_view(model, tensor_of_ref, p):
    state = hep.state_of(model)
    for layer in state.layers:
        if any(p is q for q in layer.expert_parameters()):
            return tensor_of_ref[layer.local_experts]
    return tensor_of_ref


def _compare_params(model, ref, measured_names=None, spread_of=None, step_budget=None) -> dict:
    """The ``final_params`` check of :mod:`parity` on this rank's parameters (local expert slots against the
    reference's same slots; FSDP2-sharded weights assembled whole)."""
    hep.wait_for_parameters(model)
    ref_params = dict(ref.named_parameters())
    triples = ((name, _full(p.detach()), _local_view(model, ref_params[name].detach(), p))
               for name, p in model.named_parameters())
    return parity.compare_params(triples, measured_names, spread_of, step_budget)


def _build(model_type: str, num_experts: int, top_k: int = 2):
    torch.manual_seed(0)
    model = build_tiny_model(model_type, num_experts=num_experts, top_k=top_k)
    model.train()
    return model, copy.deepcopy(model)


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
    expert_cache_capacity: int | None = None,
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
) -> dict:
    """AdamW steps with gradient accumulation and clipping, hybrid vs the single-process reference.

    The reference trains the unsharded model on the global batch in fp32; the checks and the measured
    bound of zero-initialised tensors are :mod:`parity`'s. ``expert_cache_capacity`` turns hot-expert
    shadowing on (``routing_step`` after every optimizer step); ``skew = (hot experts, bias)`` raises
    those experts' router bias in both models. With ``load_from``, the hybrid model is loaded
    rank-locally from that checkpoint of the same weights (``hf_hybrid_ep.from_pretrained``; its
    placement is the one stored in the index). ``fault`` injects one of :data:`faults.FAULTS` into the
    hybrid run (undone when the case returns), to show that the criterion catches it. With
    ``rebalance_every``, experts move online (``routing_step`` after every optimizer step); the tables
    before and after each rebalance are returned.
    """
    import faults

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    if skew is not None:
        _skew_routers(model, *skew)
        _skew_routers(ref, *skew)
    initial = copy.deepcopy(ref)
    measured_names = parity.zero_initialised(initial)
    if dispatcher == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # the CPU interpreter; read when the kernels are imported
    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, placement=placement or "contiguous", dispatcher=dispatcher,
                                expert_alignment=expert_alignment, expert_cache=expert_cache_capacity is not None,
                                expert_cache_capacity=expert_cache_capacity or 1, optimizer_sharding=optimizer_sharding,
                                dense_sharding=dense_sharding, bucket_size_mb=bucket_size_mb,
                                overlap_grad_reduce=overlap_grad_reduce, rebalance_every=rebalance_every,
                                rebalance_replicas=rebalance_replicas, rebalance_when_imbalance_over=rebalance_over,
                                topology=topology, overlap_degree=overlap_degree)
    if load_from is not None:
        model = hep.from_pretrained(load_from, config)
        model.set_attn_implementation(ref.config._attn_implementation)
        model.train()
    else:
        hep.parallelize(model, config)
    if gradient_checkpointing:  # recomputes the EP forward (and its collectives) inside backward
        model.activation_checkpointing_enable()
    opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=lr, eps=ADAM_EPS)
    implementation = {k: v for k, v in opt.defaults.items() if k in ("fused", "foreach") and v}

    def ref_optimizer(params):  # the hybrid run's implementation (fused AdamW here), so only the engine differs
        return torch.optim.AdamW(params, lr=lr, eps=ADAM_EPS, **implementation)

    ref_opt = ref_optimizer(ref.parameters())
    ref_grads = dict(ref.named_parameters())
    batches = [[_global_inputs(ref, world, seed=1000 * step + micro, seq=seq) for micro in range(accum)]
               for step in range(steps)]
    loss_diffs, norm_diffs, norms, grad_diffs, shadow_steps, tables = [], [], [], [], [], []
    with faults.injected(fault, model):
        for step in range(steps):
            for micro, batch in enumerate(batches[step]):
                sync = contextlib.nullcontext() if micro == accum - 1 else hep.no_sync(model)
                with sync:
                    loss = model(**_rank_slice(batch, rank)).loss
                    (loss / accum).backward()
                ref_loss = ref(**batch).loss
                (ref_loss / accum).backward()
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)
                loss_diffs.append(abs(mean_loss.item() / world - ref_loss.item()) / abs(ref_loss.item()))
            if step == 0:
                grad_diffs = _grad_diffs(model, ref_grads)
                frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
            norm = hep.clip_grad_norm_(model, max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            norms.append(ref_norm.item())
            norm_diffs.append(abs(norm.item() - ref_norm.item()) / ref_norm.item())
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            if expert_cache_capacity is not None:
                shadow_steps.append(_shadow_step_counters(model))
                hep.reset_comm_stats(model)
            if expert_cache_capacity is not None or rebalance_every is not None or rebalance_over is not None:
                tables.append(_tables(model))
                hep.routing_step(model)
    params = dict(model.named_parameters())
    view = lambda name, t: _local_view(model, t, params[name])  # noqa: E731
    spread_of = lambda names: parity.measured_spread(initial, ref, names, ref_optimizer, batches, max_norm, world,  # noqa: E731
                                                     view)
    reducer = hep.state_of(model).reducer
    rebalancer = hep.state_of(model).rebalancer
    return {
        "tables": [*tables, _tables(model)],  # before each routing_step, and at the end
        "rebalances": [] if rebalancer is None else [(e.step, e.bytes_sent) for e in rebalancer.events],
        "shadow_steps": shadow_steps,
        "buckets": [(b.kind, b.size, b.numel) for b in reducer.active_buckets()],
        "launched_in_backward": reducer.stats.buckets_launched_in_backward,
        "max_loss_rel": max(loss_diffs),
        "max_norm_rel": max(norm_diffs),
        "max_grad_rel_step0": max(grad_diffs),
        "clipped": any(n > max_norm for n in norms),
        "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
        "frozen_with_grad": frozen_with_grad,
        "placement": [list(row) for row in hep.state_of(model).layers[0].table.rows],
        "placements": {layer.name: [list(row) for row in layer.table.rows] for layer in hep.state_of(model).layers},
        "zero_initialised": sorted(measured_names),
        **_compare_params(model, ref, measured_names, spread_of, step_budget=2 * steps * lr),
    }


def _tables(model) -> dict[str, list[list[int]]]:
    return {layer.name: [list(r) for r in layer.table.rows] for layer in hep.state_of(model).layers}


def _shadow_step_counters(model) -> dict:
    """Hot-expert shadowing counters of one optimizer step, summed over the MoE layers."""
    layers = [v for k, v in hep.comm_stats(model).items() if k != "gradient_reduction"]
    keys = ("rows_local", "shadows_held", "net_bytes_saved", "weight_bytes_received", "grad_bytes_sent",
            "token_bytes_avoided")
    return {key: sum(v["shadow"][key] for v in layers) for key in keys} | {
        "remote_rows_sent": sum(v["dispatch"]["remote_rows_sent"] for v in layers)}


def _grad_diffs(model, ref_params: dict) -> list[float]:
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


def forward_parity(model_type: str, num_experts: int = 4, dtype: torch.dtype = torch.float32,
                   dispatcher: str = "auto", topology: str | None = None) -> dict:
    """One forward pass of a parallelized model vs the reference on the global batch (ep = world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model, ref = _build(model_type, num_experts)
    except SkipModel as err:
        return {"skipped": str(err)}
    ref32 = copy.deepcopy(ref).eval() if dtype != torch.float32 else None
    model.to(dtype)
    ref.to(dtype)
    model.eval()
    ref.eval()
    batch = tiny_inputs(ref, BATCH_PER_RANK * world, SEQ, torch.Generator().manual_seed(7), exercise_all_experts=True)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world, dispatcher=dispatcher, topology=topology))
    with torch.no_grad():
        out = model(**_rank_slice(batch, rank))
        ref_out = ref(**batch)
    key = "logits" if getattr(out, "logits", None) is not None else "last_hidden_state"
    lo, hi = rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK
    got, want = getattr(out, key), getattr(ref_out, key)[lo:hi]
    stats = hep.comm_stats(model)
    remote = sum(v["dispatch"]["remote_rows_sent"] for k, v in stats.items() if k != "gradient_reduction")
    spread = fp32_distance = None
    if dtype != torch.float32:  # the round-off of equally correct computations in this dtype, measured
        alt = copy.deepcopy(ref)
        alt.set_experts_implementation("batched_mm")
        with torch.no_grad():
            alternatives = [getattr(ref(**_rank_slice(batch, rank)), key),  # this rank's sequences alone
                            getattr(alt(**batch), key)[lo:hi]]  # another GEMM kernel for the experts
        values = [want, *alternatives]
        spread = max(_rel(a, b) for i, a in enumerate(values) for b in values[i + 1 :])
        with torch.no_grad():  # how far this dtype's reference is from the fp32 computation
            fp32_distance = _rel(want.float(), getattr(ref32(**batch), key)[lo:hi])
    return {"rel": _rel(got, want), "spread": spread, "fp32_distance": fp32_distance,
            "layers": len(hep.state_of(model).layers), "remote_rows": remote}


def parameter_bytes(model_type: str, dp: int, ep: int, num_experts: int) -> dict:
    """Bytes of parameters held by this rank, split into dense and expert parts, vs the full model."""
    model, ref = _build(model_type, num_experts)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    expert_ids = {id(p) for layer in hep.state_of(model).layers for p in layer.expert_parameters()}
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    full_expert_names = set(hep.state_of(model).expert_parameter_names(model))
    return {
        "held": nbytes(model.parameters()),
        "dense": nbytes(p for p in model.parameters() if id(p) not in expert_ids),
        "full_dense": nbytes(p for n, p in ref.named_parameters() if n not in full_expert_names),
        "full_experts": nbytes(p for n, p in ref.named_parameters() if n in full_expert_names),
    }


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


def nan_in_router_input(model_type: str, bad_rank: int, dp: int = 1, backward: bool = False) -> dict:
    """Inject NaN into one rank's embeddings; every rank must raise naming the layer and the rank — from the
    forward under ``no_grad``, from ``backward()`` (after every gradient bucket completed) otherwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _build(model_type, 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=world // dp))
    batch = _rank_slice(_global_inputs(model, world, seed=3), rank)
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach()
    if rank == bad_rank:
        embeds[0, 1, 3] = math.nan
    where = ""
    try:
        if backward:
            loss = model(inputs_embeds=embeds, **batch).loss
            where = "forward returned"
            loss.backward()
        else:
            with torch.no_grad():
                model(inputs_embeds=embeds, **batch)
    except FloatingPointError as err:
        message = str(err)
    else:
        message = ""
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the group is still usable: nobody was left inside a collective
    # and the model too: a clean step afterwards trains normally
    clean = _rank_slice(_global_inputs(model, world, seed=4), rank)
    model.zero_grad()
    loss = model(**clean).loss
    loss.backward()
    return {"message": message, "alive": flag.item() == world, "where": where,
            "clean_loss_finite": bool(torch.isfinite(loss).item())}


def bad_layout_refused(model_type: str, num_experts: int, ep: int) -> dict:
    """parallelize must refuse before touching the model when num_experts % ep != 0."""
    model, _ = _build(model_type, num_experts)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    try:
        hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep))
    except hep.HybridEPConfigError as err:
        message = str(err)
    else:
        message = ""
    untouched = shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"message": message, "untouched": untouched and getattr(model, "_hybrid_ep", None) is None}


def save_generate_reload(model_type: str, dp: int, ep: int, num_experts: int, directory: str) -> dict:
    """After a training step: generate matches the reference, and save_pretrained writes a full vanilla
    checkpoint whose logits match the trained hybrid model."""
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, num_experts)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    batch = _global_inputs(ref, world, seed=5)
    for m, inputs in ((model, _rank_slice(batch, rank)), (ref, batch)):
        torch.optim.SGD(m.parameters(), lr=0.1).zero_grad()
        m(**inputs).loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    model.eval()
    ref.eval()
    prompt = _rank_slice(batch, rank)["input_ids"][:, :4]
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    generated = model.generate(prompt, **kw)
    want = ref.generate(prompt, **kw)
    model.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    reloaded.eval()
    with torch.no_grad():
        local = _rank_slice(batch, rank)
        got = reloaded(input_ids=local["input_ids"]).logits
        hybrid = model(input_ids=local["input_ids"]).logits
    return {
        "generate_equal": bool(torch.equal(generated, want)),
        "reload_rel": _rel(got, hybrid),
        "config_experts": model.config.num_local_experts if hasattr(model.config, "num_local_experts") else None,
    }


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


def modality_mismatch(model_type: str) -> dict:
    """ERNIE-4.5-VL runs its vision experts only when the local batch has vision tokens: ranks that disagree
    must get a clear error on every rank, not a hang."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_tiny_model(model_type, num_experts=4, num_layers=3)  # a dense layer, then two MoE layers
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    batch = tiny_inputs(model, BATCH_PER_RANK, SEQ, torch.Generator().manual_seed(rank), exercise_all_experts=rank == 0)
    try:
        model(**batch).last_hidden_state.sum().backward()  # reported at backward, on every rank
    except FloatingPointError as err:
        return {"message": str(err)}
    return {"message": ""}


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


def rank_local_load(ckpt: str, dp: int, ep: int, reference_dir: str, sabotage: bool = False) -> dict:
    """Load with hf_hybrid_ep.from_pretrained and compare with a vanilla single-process load.

    With ``sabotage``, the rank loads from its own copy of the checkpoint in which every expert file
    holding none of its experts is deleted (per-expert storage) and every other rank's rows of fused
    expert tensors are NaN (fused storage): a clean, correct model proves it read only its own bytes.
    """
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from hf_hybrid_ep.checkpoint import read_index
    from hf_hybrid_ep.checkpoint.safetensors_io import read_header

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(ckpt)
    deleted = poisoned = 0
    if sabotage:
        meta = read_index(root).hybrid_ep
        per = meta.num_experts // ep
        mine = set(range((rank % ep) * per, (rank % ep + 1) * per))
        copy_dir = root.parent / f"{root.name}-rank{rank}"
        shutil.copytree(root, copy_dir)
        for name, info in meta.files.items():
            if info.role == "experts" and not mine & set(meta.placement[info.ep_rank]):
                (copy_dir / name).unlink()
                deleted += 1
            elif info.role == "fused":
                tensors = load_file(copy_dir / name)
                for value in tensors.values():
                    others = [e for e in range(meta.num_experts) if e not in mine]
                    value[others] = float("nan")
                    poisoned += len(others)
                save_file(tensors, copy_dir / name, metadata=read_header(copy_dir / name)[1])  # same save id
        root = copy_dir
    # the whole-file sha256 would (rightly) refuse the poisoned fused files: skip only the hash here
    model = hep.from_pretrained(root, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep), verify=not poisoned)
    ref = AutoModelForCausalLM.from_pretrained(reference_dir)
    ref.eval()
    state = hep.state_of(model)
    local = {id(p): layer.local_experts for layer in state.layers for p in layer.expert_parameters()}
    ref_params = dict(ref.named_parameters())
    mismatched = []
    for name, p in model.named_parameters():
        want = ref_params[name].detach()
        want = want[local[id(p)]] if id(p) in local else want
        if not torch.equal(p.detach(), want):
            mismatched.append(name)
    batch = _rank_slice(_global_inputs(ref, world, seed=21), rank)
    with torch.no_grad():
        got = model(input_ids=batch["input_ids"]).logits
        want = ref(input_ids=batch["input_ids"]).logits
    return {"mismatched": mismatched, "logits_rel": _rel(got, want), "finite": bool(torch.isfinite(got).all()),
            "deleted": deleted, "poisoned": poisoned, "expert_bytes": sum(
                p.numel() * p.element_size() for layer in state.layers for p in layer.expert_parameters())}


def hub_rank_local_load(endpoint: str, repo_id: str, cache_base: str, reference_dir: str, dp: int, ep: int) -> dict:
    """hf_hybrid_ep.from_pretrained on a Hub repo id: each rank fetches only the files it needs."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    # Point this worker's Hub client at the loopback stub (the env twins are read at import time).
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_DISABLE_XET = True
    constants.HF_HUB_CACHE = f"{cache_base}/rank{rank}"
    model = hep.from_pretrained(repo_id, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    ref = AutoModelForCausalLM.from_pretrained(reference_dir)
    ref.eval()
    batch = _rank_slice(_global_inputs(ref, world, seed=22), rank)
    with torch.no_grad():
        rel = _rel(model(input_ids=batch["input_ids"]).logits, ref(input_ids=batch["input_ids"]).logits)
    return {"logits_rel": rel}


def load_with_a_missing_file(ckpt: str, bad_rank: int) -> dict:
    """One rank's copy lacks its expert file: that rank names the file, every other rank raises too."""
    import shutil
    from pathlib import Path

    rank = dist.get_rank()
    root = Path(ckpt)
    mine = root.parent / f"{root.name}-missing-rank{rank}"
    shutil.copytree(root, mine)
    if rank == bad_rank:
        (mine / f"model-experts-rank{rank:03d}-of-002.safetensors").unlink()
    try:
        hep.from_pretrained(mine, hep.HybridEPConfig(ep_degree=2))
    except Exception as err:  # noqa: BLE001 - the message is the result
        message = f"{type(err).__name__}: {err}"
    else:
        message = ""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return {"message": message, "alive": flag.item() == dist.get_world_size()}


def trainer_run(
    dp: int, ep: int, output_dir: str, max_steps: int = 6, save_steps: int | None = None,
    resume_from: str | None = None, verify_sync_steps: int = 0, optimizer_sharding: str = "none",
    rebalance_every: int | None = None, rebalance_replicas: int = 0, **extra_args,
) -> dict:
    """The stock Trainer loop on a hybrid-EP model (Accelerate wraps it in DDP on every rank)."""
    import trainer_cases as tc

    from hf_hybrid_ep.integrations import HybridEPTrainer

    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding=optimizer_sharding,
                                rebalance_every=rebalance_every, rebalance_replicas=rebalance_replicas)
    model = hep.parallelize(tc.model(), config)
    args = tc.arguments(output_dir, 2, max_steps, save_steps, **extra_args)
    trainer = HybridEPTrainer(
        model=model, args=args, train_dataset=tc.dataset(), verify_sync_steps=verify_sync_steps
    )
    output = trainer.train(resume_from_checkpoint=resume_from)
    stats = hep.comm_stats(model)["gradient_reduction"]
    wrapped = type(trainer.model_wrapped).__name__
    return {"losses": tc.losses(trainer), "dense_bytes": stats["dense_bytes"], "wrapped": wrapped,
            "memory": {k: v for k, v in output.metrics.items() if k.startswith("hybrid_ep_")},
            "optimizer_class": type(trainer.optimizer.optimizer).__name__,
            "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]}


def replica_check(corrupt: str | None, corrupt_rank: int) -> dict:
    """verify_replicas on a (2, 2) layout after a training step; optionally corrupt one replica."""
    from hf_hybrid_ep.consistency import ReplicaDivergenceError, verify_replicas

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=2, ep_degree=2))
    model(**_rank_slice(_global_inputs(ref, world, seed=1), rank)).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    if corrupt is not None and rank == corrupt_rank:
        with torch.no_grad():
            dict(model.named_parameters())[corrupt].view(-1)[0] += 1e-6
    try:
        verify_replicas(model)
    except ReplicaDivergenceError as err:
        return {"message": str(err)}
    return {"message": ""}


def fp16_overflow_agreement(agree: bool) -> dict:
    """An overflow in one rank's expert gradients must skip the optimizer step on every rank."""
    from hf_hybrid_ep.amp import agree_found_inf_

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(**_rank_slice(_global_inputs(ref, world, seed=2), rank)).loss).backward()
    if rank == 0:  # an overflow confined to rank 0's experts (their EDP group is rank 0 alone)
        hep.state_of(model).layers[0].expert_parameters()[0].grad[0, 0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    skipped = agree_found_inf_(scaler, opt, model) if agree else None
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    return {"skipped": skipped, "changed": changed, "scale": scaler.get_scale()}


def trainer_eval(dp: int, ep: int, output_dir: str, num: int, hybrid: bool = True) -> dict:
    """Evaluation on a set that does not split evenly over the ranks (every rank runs as many passes).

    ``hybrid=False`` runs the plain Trainer (DDP) on the unsharded model, for comparison.
    """
    import trainer_cases as tc
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEPTrainer

    args = tc.arguments(output_dir, 2, 1, per_device_eval_batch_size=2)
    if hybrid:
        model = hep.parallelize(tc.model(), hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
        trainer = HybridEPTrainer(model=model, args=args, eval_dataset=tc.dataset(num))
    else:
        trainer = Trainer(model=tc.model(), args=args, eval_dataset=tc.dataset(num))
    return {"eval_loss": trainer.evaluate()["eval_loss"]}


def accelerate_loop(dp: int, ep: int, state_dir: str, steps: int, save_at: int | None = None,
                    resume: bool = False, optimizer_sharding: str = "none") -> dict:
    """A hand-written Accelerate loop (accumulate 2, clipping, a scheduler) with save_state/load_state."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    from hf_hybrid_ep.integrations.accelerator import load_state, prepare_accelerator, save_state

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding=optimizer_sharding))
    prepare_accelerator(accelerator, model)
    opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3, eps=ADAM_EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    wrapped, opt, sched = accelerator.prepare(model, opt, sched)
    start = 0
    if resume:
        load_state(accelerator, wrapped, opt, state_dir, schedulers=[sched])
        start = save_at
    set_seed(0)
    losses = []
    for step in range(start, steps):
        for micro in range(2):
            batch = _rank_slice(_global_inputs(ref, world, seed=100 * step + micro), rank)
            with accelerator.accumulate(wrapped):
                loss = wrapped(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    hep.clip_grad_norm_(model, 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        if save_at is not None and not resume and step + 1 == save_at:
            save_state(accelerator, wrapped, opt, state_dir, schedulers=[sched])
    return {"losses": losses, "dense_bytes": hep.comm_stats(model)["gradient_reduction"]["dense_bytes"]}


def fsdp_under_accelerate() -> dict:
    """Accelerate wraps a multi-process model in DDP, which cannot hold FSDP2-sharded weights: refused."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from hf_hybrid_ep.integrations.accelerator import prepare_accelerator

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dense_sharding="fsdp"))
    try:
        prepare_accelerator(accelerator, model)
    except hep.HybridEPConfigError as err:
        return {"message": str(err)}
    return {"message": ""}


def generate_uneven(max_new_tokens_by_rank: list[int]) -> dict:
    """Ranks ask for different numbers of new tokens: nobody hangs, each matches the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    model.eval()
    ref.eval()
    prompt = _rank_slice(_global_inputs(ref, world, seed=9), rank)["input_ids"][:, :4]
    n = max_new_tokens_by_rank[rank]
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    got = model.generate(prompt, **kw)
    want = ref.generate(prompt, **kw)
    return {"equal": bool(torch.equal(got, want)), "length": got.shape[1]}


def routing_metrics(dp: int, ep: int, steps: int = 3, **controls) -> dict:
    """Per-expert load metrics (and aux-loss-free biases) after a few steps on a given layout."""
    from hf_hybrid_ep.metrics import load_report

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("gpt_oss", 4)
    for name, p in model.named_parameters():
        if name.endswith("mlp.router.bias"):
            p.data[0] += 2.0  # skew towards expert 0 (EP rank 0 when ep > 1)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, **controls))
    shares = []
    for step in range(steps):
        with torch.no_grad():
            model(**{k: v for k, v in _rank_slice(_global_inputs(ref, world, seed=step), rank).items() if k != "labels"})
        hep.routing_step(model)
        report = load_report(model)
        first = next(iter(report.values()))
        shares.append(first["tokens_per_rank"][0] / max(1, sum(first["tokens_per_rank"])))
    state = hep.state_of(model)
    biases = [layer.routing.selection_bias.tolist() for layer in state.layers if layer.routing.selection_bias is not None]
    return {"report": report, "biases": biases, "rank0_share": shares}


def ctr_parity(dp: int, ep: int) -> dict:
    """One Adam step of the CTR example's MoE model on hybrid EP vs one process (the example's own check)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "recsys_ctr"))
    from step_parity import one_step_parity

    return one_step_parity(dp, ep)


def overlap_equivalence(model_type: str, ep: int, degree: int) -> dict:
    """The chunked, overlapped exchange gives the same logits and gradients as the plain path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for overlap in (1, degree):
        model, ref = _build(model_type, 4)
        hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep, overlap_degree=overlap))
        batch = _rank_slice(_global_inputs(ref, world, seed=4), rank)
        out = model(**batch)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    worst = max(_rel(grads_b[n], grads_a[n]) for n in grads_a)
    return {"logits_rel": _rel(logits_b, logits_a), "grad_rel": worst}


def shared_overlap_equivalence(model_type: str) -> dict:
    """overlap_shared_expert reorders the shared expert into the return exchange: bit-identical results,
    and the shared expert runs once per layer and forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results, calls = [], []
    for overlap in (False, True):
        model, ref = _build(model_type, 4)
        hep.parallelize(model, hep.HybridEPConfig(ep_degree=world, overlap_shared_expert=overlap))
        count = [0]
        for layer in hep.state_of(model).layers:
            block = model.get_submodule(layer.name.rpartition(".")[0])
            shared = getattr(block, "shared_experts", None) or block.shared_expert
            inner = shared.down_proj if hasattr(shared, "down_proj") else shared
            inner.register_forward_hook(lambda *a, c=count: c.__setitem__(0, c[0] + 1))
        for seed in (4, 5):  # the first forward observes the block's order, the second overlaps
            model.zero_grad()
            batch = _rank_slice(_global_inputs(ref, world, seed=seed), rank)
            out = model(**batch)
            out.loss.backward()
        calls.append(count[0])
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = results
    state = hep.state_of(model)
    return {"equal": bool(torch.equal(la, lb)) and all(torch.equal(ga[n], gb[n]) for n in ga),
            "calls": calls, "after": [layer.shared_overlap.after_experts for layer in state.layers]}


def trainer_shadow_run(output_dir: str, expert_cache: bool, max_steps: int = 4, rebalance: bool = False,
                       hot: tuple[int, int] = (0, 2)) -> dict:
    """The stock Trainer on a skewed GPT-OSS (experts ``hot`` draw nearly every token), with hot-expert
    shadowing off or on: the Trainer's step-end callback (routing_step) must refresh the shadows (and, with
    ``rebalance``, move experts after every step, before the shadows are decided)."""
    import trainer_cases as tc
    from datasets import Dataset

    from hf_hybrid_ep.integrations import HybridEPTrainer

    torch.manual_seed(0)
    model = build_tiny_model("gpt_oss", num_experts=4)
    model.train()
    _skew_routers(model, list(hot), 4.0)
    world = dist.get_world_size()
    config = hep.HybridEPConfig(dp_degree=1, ep_degree=world, expert_cache=expert_cache, expert_cache_capacity=1,
                                rebalance_every=1 if rebalance else None)
    hep.parallelize(model, config)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 100, (64, 32), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = HybridEPTrainer(model=model, args=tc.arguments(output_dir, 2, max_steps), train_dataset=data)
    trainer.train()
    layers = [v for k, v in hep.comm_stats(model).items() if k != "gradient_reduction"]
    rebalancer = hep.state_of(model).rebalancer
    return {"losses": tc.losses(trainer), "shadows_held": sum(v["shadow"]["shadows_held"] for v in layers),
            "rows_local": sum(v["shadow"]["rows_local"] for v in layers),
            "rebalances": [] if rebalancer is None else [e.step for e in rebalancer.events if e.bytes_sent]}


def save_and_reload_placement(directory: str, placement: list[list[int]] | dict[str, list[list[int]]]) -> dict:
    """Save a model parallelized with ``placement`` (one table or per layer); reload it with no placement
    in the config."""
    from hf_hybrid_ep.checkpoint.save import save_hybrid_checkpoint

    model, ref = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=1, ep_degree=2, placement=placement))
    save_hybrid_checkpoint(model, directory)
    loaded = hep.from_pretrained(directory, hep.HybridEPConfig(dp_degree=1, ep_degree=2))
    mine = dict(model.named_parameters())
    equal = all(torch.equal(p, mine[n]) for n, p in loaded.named_parameters())
    tables = {layer.name: [list(r) for r in layer.table.rows] for layer in hep.state_of(loaded).layers}
    return {"reloaded": next(iter(tables.values())), "reloaded_per_layer": tables, "equal": equal}


def rebalance_then_save(directory: str) -> dict:
    """Train 2 steps with a rebalance after each (replicas: new slot counts), save, reload the checkpoint at
    EP 1 (every expert on every rank) and compare every tensor with the trained model's full state."""
    from hf_hybrid_ep.checkpoint.save import save_hybrid_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=1, ep_degree=world, rebalance_every=1,
                                              rebalance_replicas=world))
    opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
    for step in range(2):
        batch = _global_inputs(ref, world, seed=step)
        model(**_rank_slice(batch, rank)).loss.backward()
        opt.step()
        opt.zero_grad()
        hep.routing_step(model)
    save_hybrid_checkpoint(model, directory)
    trained = hep.full_state_dict(model)
    loaded = hep.from_pretrained(directory, hep.HybridEPConfig(dp_degree=world, ep_degree=1))
    again = hep.full_state_dict(loaded)
    return {"tables": _tables(model), "events": len(hep.state_of(model).rebalancer.events),
            "equal": sorted(trained) == sorted(again) and all(torch.equal(trained[k], again[k]) for k in trained),
            "loaded_tables": _tables(loaded)}


def group_creation_calls(dp: int, ep: int, sets: list[tuple[int, ...]]) -> list[list[int]]:
    """The ``new_group`` calls this rank makes when asked for ``sets`` (every rank must make the same)."""
    from unittest import mock

    from hf_hybrid_ep.mesh import build_mesh

    mesh = build_mesh(dp, ep)
    calls = []
    real = dist.new_group

    def recording(ranks, *args, **kwargs):
        calls.append(list(ranks))
        return real(ranks, *args, **kwargs)

    with mock.patch.object(dist, "new_group", recording):
        for ranks in sets:
            mesh.group_of(tuple(ranks))
    return calls


def mesh_layout(dp: int | None, ep: int | None, topology: str) -> dict:
    """Parallelize with a topology; report the layout and this rank's EP group."""
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, topology=topology))
    mesh = hep.state_of(model).mesh
    group = [mesh.global_rank(mesh.dp_rank, r) for r in range(mesh.ep_degree)]
    return {"kind": mesh.layout.kind, "ep": mesh.ep_degree, "group": group,
            "nodes": sorted({mesh.topology.node_of(g) for g in group})}


def save_right_after_step(directory: str, dp: int, ep: int) -> dict:
    """ZeRO-1 with overlapped parameter gathers: a save and a ``state_dict`` taken right after ``step()``
    (gathers still pending, no forward in between) hold the updated parameters."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid_ep.checkpoint.save import save_hybrid_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding="zero1",
                                              bucket_size_mb=0.01))
    opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    batch = _global_inputs(ref, world, seed=3)
    model(**_rank_slice(batch, rank)).loss.backward()
    ref(**batch).loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    opt.step()
    ref_opt.step()
    pending = sum(b.gather_work is not None for b in hep.state_of(model).reducer.sharding.buckets)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # waits for the gathers
    save_hybrid_checkpoint(model, directory)
    reloaded = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    want = dict(ref.named_parameters())
    saved_rel = max(_rel(reloaded[n], want[n].detach()) for n in want)
    local = dict(model.named_parameters())
    state_rel = max(_rel(state[n], _local_view(model, want[n].detach(), local[n])) for n in local)
    return {"pending": pending, "saved_rel": saved_rel, "state_dict_rel": state_rel}


def dispatcher_equivalence(model_type: str, dp: int, ep: int, topology: str, num_experts: int = 4, top_k: int = 2,
                           placement: list[list[int]] | None = None, capacity_factor: float | None = None,
                           overlap_degree: int = 1) -> dict:
    """The hierarchical dispatcher against the plain one on the same model, batch and layout (logits and
    gradients after one forward and backward), and its cross-node rows per direction against
    ``trace_traffic`` for the routing this rank sent (exact without replicas)."""
    from hf_hybrid_ep.placement import trace_traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for dispatcher in ("torch", "hierarchical"):
        torch.manual_seed(0)
        model = build_tiny_model(model_type, num_experts=num_experts, top_k=top_k)
        model.train()
        hep.parallelize(model, hep.HybridEPConfig(
            dp_degree=dp, ep_degree=ep, topology=topology, dispatcher=dispatcher, placement=placement or "contiguous",
            capacity_factor=capacity_factor, overlap_degree=overlap_degree))
        traces: dict[str, list[torch.Tensor]] = {}
        for layer in hep.state_of(model).layers:
            def count(index, dropped=0, _original=layer.routing.count, _name=layer.name, _traces=traces):
                _traces.setdefault(_name, []).append(index.detach().reshape(-1, index.shape[-1]).clone())
                _original(index, dropped)

            layer.routing.count = count
        out = model(**_rank_slice(_global_inputs(model, world, seed=4), rank))
        out.loss.backward()
        runs[dispatcher] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                            hep.comm_stats(model), traces, hep.state_of(model))
    (logits_a, grads_a, _, _, _), (logits_b, grads_b, stats, traces, state) = runs["torch"], runs["hierarchical"]
    layers = {layer.name: layer for layer in state.layers}
    predicted = sum(trace_traffic([t.numpy() for t in traces[name]], layers[name].table, topology,
                                  sources=[state.mesh.ep_rank] * len(traces[name]))["cross_node"] for name in traces)
    phases = {p: sum(stats[name][p]["remote_rows_sent"] for name in layers)
              for p in ("dispatch_inter", "combine_inter", "dispatch_inter_backward", "combine_inter_backward")}
    plain_stats = runs["torch"][2]
    per_node = state.mesh.layout.nodes_per_group if state.mesh.layout else 1
    return {
        "logits_rel": _rel(logits_b, logits_a), "grad_rel": max(_rel(grads_b[n], grads_a[n]) for n in grads_a),
        "kinds": sorted({type(layer.dispatcher).__name__ for layer in state.layers}),
        "predicted_cross_node_rows": predicted, "phase_rows": phases, "nodes": per_node,
        "plain_remote_rows": sum(plain_stats[name]["dispatch"]["remote_rows_sent"] for name in layers),
        "dropped": sum(int((t < 0).sum()) for ts in traces.values() for t in ts),
    }


def dispatcher_choice(dp: int, ep: int, dispatcher: str, topology: str | None = None,
                      local_world_size: int | None = None) -> dict:
    """The dispatcher class every layer got, and the ``hf_hybrid_ep`` log lines of ``parallelize``."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("hf_hybrid_ep")
    saved_env, saved_level = os.environ.get("LOCAL_WORLD_SIZE"), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        torch.manual_seed(0)
        model = build_tiny_model("qwen3_moe", num_experts=4)
        hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, dispatcher=dispatcher, topology=topology))
        return {"kinds": sorted({type(layer.dispatcher).__name__ for layer in hep.state_of(model).layers}),
                "log": [m for m in records if m.startswith("dispatcher")]}
    except hep.HybridEPConfigError as err:
        return {"error": str(err)}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
        if saved_env is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved_env
