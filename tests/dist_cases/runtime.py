"""The runtime's own cost, counted: the reducer's work per gradient hook as the model deepens, and the host
tensors a training step would copy to the device."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import build_tiny_model, tiny_inputs
from work_counting import LineCounter

import hf_hybrid_ep as hep

from .common import (
    ADAM_EPS,
    BATCH_PER_RANK,
    SEQ,
    _build,
    _global_inputs,
    _local_view,
    _rank_slice,
    _rel,
    _skew_routers,
)

# the files a gradient's hook and the end-of-backward callback run in
REDUCTION_FILES = ("parallel/grads.py", "parallel/buckets.py", "engine/backward.py")


def reducer_work(model_type: str, dp: int, ep: int, depths: list[int]) -> dict:
    """Per depth (decoder layers): the parameters the reducer reduces, and the library lines executed in one
    reducing forward and one backward (after a warm-up step), in total and in the reduction's files."""
    out = {}
    for layers in depths:
        torch.manual_seed(0)
        model = build_tiny_model(model_type, num_experts=4, num_layers=layers)
        model.train()
        hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
        g = torch.Generator().manual_seed(dist.get_rank())
        batch = tiny_inputs(model, BATCH_PER_RANK, SEQ, g)
        model(**batch).loss.backward()  # warm-up: buffers allocated, first-use work done
        model.zero_grad(set_to_none=True)
        forward, backward = LineCounter(), LineCounter()
        with forward.active():
            loss = model(**batch).loss
        with backward.active():
            loss.backward()
        out[layers] = {
            "parameters": len(hep.state_of(model).reducer.parameters()),
            "forward_lines": forward.total(),
            "backward_lines": backward.total(),
            "reduction_lines": sum(backward.total(f) for f in REDUCTION_FILES),
        }
    return out


def host_copies(model_type: str, dp: int, ep: int, steps: int, skew: bool = False, freeze: list[int] | None = None,
                **config) -> dict:
    """``steps`` training steps (forward, backward, clip, optimizer step, ``after_optimizer_step``) under
    :class:`host_copies.HostCopies`, which tracks host tensors from ``parallelize`` on (``freeze``: these experts
    frozen from the second step, :class:`hf_hybrid_ep.ExpertFreezer`). Returns its findings per
    phase (``"step N"``, ``"after_optimizer_step N"``, ``"rebalance N"`` when experts moved), the rebalances
    (step, bytes sent) and the largest move of a selection bias in one step."""
    from host_copies import HostCopies

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build(model_type, 4)
    if skew:
        _skew_routers(model, [0], 2.0)
    mode = HostCopies()
    with mode:
        hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, **config))
        state = hep.state_of(model)
        biases, bias_moved = _biases(state), 0.0
        optimizer = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3, eps=ADAM_EPS)
        if freeze is not None:
            hep.ExpertFreezer(model, optimizer, freeze, from_step=1)
        for step in range(steps):
            batch = _rank_slice(_global_inputs(ref, world, seed=step), rank)
            mode.phase = f"step {step}"
            model(**batch).loss.backward()
            hep.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            moved = 0 if state.rebalancer is None else len(state.rebalancer.events)
            mode.phase = f"after_optimizer_step {step}"
            hep.after_optimizer_step(model, optimizer)
            if state.rebalancer is not None and len(state.rebalancer.events) > moved:
                mode.found[f"rebalance {step}"] = mode.found.pop(mode.phase, {})
            mode.phase = None
            previous, biases = biases, _biases(state)
            bias_moved = max([bias_moved] + [float((a - b).abs().max()) for a, b in zip(biases, previous, strict=True)])
    return {"found": {k: v for k, v in mode.found.items() if v},
            "rebalances": [] if state.rebalancer is None else [(e.step, e.bytes_sent) for e in state.rebalancer.events],
            "bias_moved": bias_moved}


def _biases(state) -> list[torch.Tensor]:
    """Every layer's selection bias (or its router's native correction bias), copied to the host."""
    out = []
    for layer in state.layers:
        c = layer.controls
        if c is not None:
            bias = c.selection_bias if c.selection_bias is not None else c.router.e_score_correction_bias
            out.append(bias.detach().cpu().clone())
    return out


def trainable_set_changes(dp: int, ep: int) -> dict:
    """``requires_grad`` changed after ``parallelize``, between steps: the embedding frozen, then trained again
    (with one expert parameter frozen meanwhile). Per backward, the largest gradient difference to the unsharded
    reference on the global batch (the same parameters frozen), the frozen parameters left with a gradient, and
    the buckets launched by gradient hooks; then whether a ZeRO-1 optimizer refuses a change, and its message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, bucket_size_mb=0.004))
    reducer = hep.state_of(model).reducer
    expert = next(n for n, _ in model.named_parameters() if "experts" in n)
    frozen_by_step = [{"model.embed_tokens.weight"}, {expert}, set()]
    out = {"grad_rel": [], "frozen_with_grad": [], "launched_in_backward": []}
    for step, frozen in enumerate(frozen_by_step):
        for m in (model, ref):
            for n, p in m.named_parameters():
                p.requires_grad_(n not in frozen)
            m.zero_grad(set_to_none=True)
        batch = _global_inputs(ref, world, seed=step)
        launched = reducer.stats.buckets_launched_in_backward
        model(**_rank_slice(batch, rank)).loss.backward()
        ref(**batch).loss.backward()
        want = dict(ref.named_parameters())
        out["grad_rel"].append(max(_rel(p.grad, _local_view(model, want[n].grad, p))
                                   for n, p in model.named_parameters() if p.requires_grad))
        out["frozen_with_grad"].append([n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None])
        out["launched_in_backward"].append(reducer.stats.buckets_launched_in_backward - launched)
    optimizer = hep.shard_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
    model.get_input_embeddings().weight.requires_grad_(False)
    try:
        model(**_rank_slice(_global_inputs(ref, world, seed=9), rank)).loss.backward()
        out["zero1_refusal"] = ""
    except RuntimeError as err:
        out["zero1_refusal"] = str(err)
    del optimizer
    return out
