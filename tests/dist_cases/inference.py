"""Inference cases: forward passes and generation of the hybrid model against the reference.

:func:`forward_parity` runs one forward on the global batch (any family, dtype, dispatcher and
topology; bf16 bounded by measured round-off); :func:`generate_uneven` has ranks generate different
numbers of tokens.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from tiny_models import SkipModel, tiny_inputs

import hf_hybrid_ep as hep

from .common import BATCH_PER_RANK, SEQ, _build, _global_inputs, _rank_slice, _rel


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
    remote = sum(v["dispatch"]["remote_rows_sent"] for v in hep.layer_counters(stats))
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


def routing_replay(new_tokens_by_rank: list[int]) -> dict:
    """Record the routing of a greedy generation under EP (ranks ask for different lengths, so the shorter keeps
    stepping), then replay it in a training forward over the generated sequences: with the routers as they were,
    the forward equals the plain one; with the routers moved (as by an optimizer step), the recorded experts are
    used where the router alone would choose others, and the router still gets a gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world))
    model.eval()
    prompt = _rank_slice(_global_inputs(model, world, seed=9), rank)["input_ids"][:, :4]
    n = new_tokens_by_rank[rank]
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    with hep.record_routing(model) as routing:
        sequences = model.generate(prompt, **kw)
    model.train()
    routers = [layer.load.router for layer in hep.state_of(model).layers]
    plain = model(input_ids=sequences).logits
    with hep.replay_routing(model, routing):
        same = model(input_ids=sequences).logits
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for router in routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * router.weight.std())
    free = _choices(model, routers, sequences)
    chosen = _choices(model, routers, sequences, routing)
    replayed = chosen.pop("logits")
    replayed.float().pow(2).mean().backward()
    free.pop("logits")
    layers = [layer.name for layer in hep.state_of(model).layers]
    recorded = {name: routing.choices(name) for name in layers}
    covered = {name: min(recorded[name].shape[1], sequences.shape[1]) for name in layers}
    return {
        "identity_rel": _rel(same, plain),
        "recorded_positions": recorded[layers[0]].shape[1], "sequence_length": sequences.shape[1],
        "replayed_equal": all(torch.equal(chosen[i][:, :covered[n]], recorded[n][:, :covered[n]])
                              for i, n in enumerate(layers)),
        "free_differs": sum(int((free[i][:, :covered[n]] != recorded[n][:, :covered[n]]).any(-1).sum())
                            for i, n in enumerate(layers)),
        "router_grads": all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers),
    }


def _choices(model, routers, sequences, routing=None) -> dict:
    """The experts each router's output names (after any replay) per layer ``[B, S, k]``, and the logits."""
    seen: dict = {}
    context = hep.replay_routing(model, routing) if routing is not None else contextlib.nullcontext()
    with context:
        hooks = [r.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[2])) for i, r in enumerate(routers)]
        logits = model(input_ids=sequences).logits
        for h in hooks:
            h.remove()
    rows, positions = sequences.shape
    return {**{i: index.reshape(rows, positions, -1) for i, index in seen.items()}, "logits": logits}
