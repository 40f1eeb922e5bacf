"""Inference cases: forward passes and generation of the hybrid model against the reference.

:func:`forward_parity` runs one forward on the global batch (any family, dtype, dispatcher and
topology; bf16 bounded by measured round-off); :func:`generate_uneven` has ranks generate different
numbers of tokens.
"""

from __future__ import annotations

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
