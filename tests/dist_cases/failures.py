"""Failure cases: a rank that misbehaves or a layout that cannot work must be reported, never hang.

NaN router input on one rank, a layout not dividing the experts, ranks disagreeing on modality, a
diverged replica, and an fp16 overflow confined to one rank's experts.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tiny_models import build_tiny_model, tiny_inputs

import hf_hybrid_ep as hep

from .common import BATCH_PER_RANK, SEQ, _build, _global_inputs, _rank_slice


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


def replica_check(corrupt: str | None, corrupt_rank: int) -> dict:
    """verify_replicas on a (2, 2) layout after a training step; optionally corrupt one replica."""
    from hf_hybrid_ep.engine.replicas import verify_model_replicas
    from hf_hybrid_ep.errors import ReplicaDivergenceError

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=2, ep_degree=2))
    model(**_rank_slice(_global_inputs(ref, world, seed=1), rank)).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    if corrupt is not None and rank == corrupt_rank:
        with torch.no_grad():
            dict(model.named_parameters())[corrupt].view(-1)[0] += 1e-6
    try:
        verify_model_replicas(model)
    except ReplicaDivergenceError as err:
        return {"message": str(err)}
    return {"message": ""}


def fp16_overflow_agreement(agree: bool) -> dict:
    """An overflow in one rank's expert gradients must skip the optimizer step on every rank."""
    from hf_hybrid_ep.parallel.amp import agree_found_inf_

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(**_rank_slice(_global_inputs(ref, world, seed=2), rank)).loss).backward()
    if rank == 0:  # an overflow confined to rank 0's experts (their EDP group is rank 0 alone)
        hep.state_of(model).layers[0].expert_parameters()[0].grad[0, 0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    skipped = agree_found_inf_(scaler, opt, hep.state_of(model).mesh) if agree else None
    scaler.step(opt)
    scaler.update()
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    return {"skipped": skipped, "changed": changed, "scale": scaler.get_scale()}


def nonfinite_steps(policy: str = "skip", max_consecutive: int = 2, bad_rank: int = 1) -> dict:
    """A user-built ``torch.optim.AdamW`` (no ``make_optimizer``) at dp 2 × ep 2; before steps 2, 4 and 5 the first
    expert parameter's gradient on ``bad_rank`` gets a NaN. Returns, per step, whether the parameters and the
    optimizer's step count changed, the skip counters and the error of the step that stopped the run."""
    import logging

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=2, ep_degree=world // 2, on_nonfinite_grad=policy,
                                              max_consecutive_skips=max_consecutive))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expert = hep.state_of(model).layers[0].expert_parameters()[0]
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("hf_hybrid_ep").addHandler(handler)
    changed, steps, error = [], [], ""
    try:
        for step in range(1, 6):
            batch = _rank_slice(_global_inputs(model, world, seed=step), rank)
            model(**batch).loss.backward()
            if step in (2, 4, 5) and rank == bad_rank:
                expert.grad[0].view(-1)[0] = math.nan
            hep.clip_grad_norm_(model, 1.0)
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            hep.after_optimizer_step(model)
            changed.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)))
            steps.append(max(int(s["step"]) for s in optimizer.state.values()))
    except hep.NonFiniteGradientError as err:
        error = str(err)
    finally:
        logging.getLogger("hf_hybrid_ep").removeHandler(handler)
    skipped = hep.state_of(model).skipped
    return {"changed": changed, "steps": steps, "error": error, "total": skipped.total, "warnings": messages,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def save_refuses_nonfinite(directory: str) -> dict:
    """A good checkpoint, then a NaN in one expert row on the last rank: the second save is refused on every rank,
    naming the tensor, and the first checkpoint stays as it was."""
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    save_hybrid_checkpoint(model, directory)
    from pathlib import Path

    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(directory).iterdir())
    if rank == world - 1:
        with torch.no_grad():
            hep.state_of(model).layers[1].expert_parameters()[0][0, 0, 0] = math.nan
    try:
        save_hybrid_checkpoint(model, directory)
    except hep.CheckpointError as err:
        message = str(err)
    else:
        message = ""
    dist.barrier()  # rank 0 removes its staging after the others have raised
    after = sorted((p.name, p.stat().st_mtime_ns) for p in Path(directory).iterdir())
    leftovers = sorted(p.name for p in Path(directory).parent.iterdir() if p.name.startswith("."))
    return {"message": message, "unchanged": before == after, "leftovers": leftovers}
