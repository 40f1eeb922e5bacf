"""Shared helpers of the multi-process cases: tolerances, tiny model pairs, global batches, comparisons.

Every case builds a tiny real transformers model identically on every rank with :func:`_build` (the
second copy is the unsharded single-process reference), draws the global batch with
:func:`_global_inputs` (each rank takes its :func:`_rank_slice`) and compares with :func:`_rel` and
:func:`_compare_params` (:mod:`parity`'s criterion, on this rank's local expert slots). The process
group itself is set up by :class:`worker_pool.WorkerPool`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import parity
import torch
from tiny_models import build_tiny_model, tiny_inputs

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


def _global_inputs(model: torch.nn.Module, world: int, seed: int, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(seed)
    return tiny_inputs(model, BATCH_PER_RANK * world, seq, g)


def _skew_routers(model: torch.nn.Module, hot: list[int], bias: float) -> None:
    """Make experts ``hot`` draw most tokens: raise their logits in every router's bias."""
    from hf_hybrid_ep.moe.router_rules import find_router

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


def _local_view(model: torch.nn.Module, tensor_of_ref: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """The part of the reference's tensor that ``p`` holds on this rank: its local expert slots, and for an
    expert adapter's factor those slots in the engine's slot-major layout (PEFT's is expert-major in
    ``lora_A [r·E, in]`` and expert-fastest in ``lora_B [out, r·E]``)."""
    from hf_hybrid_ep.moe.lora import slots_from_peft

    state = hep.state_of(model)
    for layer in state.layers:
        if any(p is q for q in layer.expert_parameters()):
            return tensor_of_ref[layer.local_experts]
        for kind, q in layer.experts.adapter_factors():
            if p is q:
                return slots_from_peft(tensor_of_ref, kind, layer.num_experts, list(layer.local_experts))
    return tensor_of_ref


def _compare_params(model: torch.nn.Module, ref: torch.nn.Module, measured_names: set[str] | None = None,
                    spread_of: Callable[[list[str]], dict[str, float]] | None = None,
                    step_budget: float | None = None) -> dict:
    """The ``final_params`` check of :mod:`parity` on this rank's parameters (local expert slots against the
    reference's same slots; FSDP2-sharded weights assembled whole)."""
    hep.wait_for_parameters(model)
    ref_params = dict(ref.named_parameters())
    triples = ((name, _full(p.detach()), _local_view(model, ref_params[name].detach(), p))
               for name, p in model.named_parameters())
    return parity.compare_params(triples, measured_names, spread_of, step_budget)


def _build(model_type: str, num_experts: int, top_k: int = 2) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_tiny_model(model_type, num_experts=num_experts, top_k=top_k)
    model.train()
    return model, copy.deepcopy(model)


def _tables(model: torch.nn.Module) -> dict[str, list[list[int]]]:
    return {layer.name: [list(r) for r in layer.table.rows] for layer in hep.state_of(model).layers}
