"""Dispatch cases: which dispatcher a layer gets, and exchange paths that must agree with the per-pair one.

The deduplicated dispatcher against the per-pair one (logits, gradients and rows against ``trace_traffic``),
the dispatcher choice and its log lines, the chunked overlapped exchange and the shared-expert overlap.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from tiny_models import build_tiny_model

import hf_hybrid_ep as hep
from hf_hybrid_ep.dispatch.stats import PHASES

from .common import _build, _global_inputs, _rank_slice, _rel


def dispatcher_equivalence(model_type: str, dp: int, ep: int, topology: str | None, num_experts: int = 4, top_k: int = 2,
                           placement: list[list[int]] | None = None, capacity_factor: float | None = None,
                           overlap_degree: int = 1) -> dict:
    """The deduplicated dispatcher against the per-pair one on the same model, batch and layout (logits and
    gradients after one forward and backward), and its rows per phase against ``trace_traffic`` for the
    routing this rank sent (exact without replicas): ``cross_node`` rows this rank sends across nodes, and
    ``rank_rows``, the rows its tokens cause inside the destination nodes (sent by their relays)."""
    from hf_hybrid_ep.planning.placement import trace_traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for dispatcher in ("torch", "dedup"):
        torch.manual_seed(0)
        model = build_tiny_model(model_type, num_experts=num_experts, top_k=top_k)
        model.train()
        hep.parallelize(model, hep.HybridEPConfig(
            dp_degree=dp, ep_degree=ep, topology=topology, dispatcher=dispatcher, placement=placement or "contiguous",
            capacity_factor=capacity_factor, overlap_degree=overlap_degree))
        traces: dict[str, list[torch.Tensor]] = {}
        for layer in hep.state_of(model).layers:
            def count(index: torch.Tensor, dropped: int = 0, _original: Callable[..., None] = layer.load.count,
                      _name: str = layer.name, _traces: dict[str, list[torch.Tensor]] = traces) -> None:
                _traces.setdefault(_name, []).append(index.detach().reshape(-1, index.shape[-1]).clone())
                _original(index, dropped)

            layer.load.count = count
        out = model(**_rank_slice(_global_inputs(model, world, seed=4), rank))
        out.loss.backward()
        runs[dispatcher] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                            hep.comm_stats(model), traces, hep.state_of(model))
    (logits_a, grads_a, plain_stats, _, _), (logits_b, grads_b, stats, traces, state) = runs["torch"], runs["dedup"]
    layers = {layer.name: layer for layer in state.layers}
    topology = topology or f"gpus_per_node={state.mesh.ranks_per_node}"
    predicted: dict[str, float] = {"cross_node": 0.0, "rank_rows": 0.0}
    for name in traces:
        traced = trace_traffic([t.numpy() for t in traces[name]], layers[name].table, topology,
                               sources=[state.mesh.ep_rank] * len(traces[name]))
        predicted = {key: predicted[key] + traced[key] for key in predicted}
    phases = {p: sum(stats[name][p]["remote_rows_sent"] for name in layers) for p in PHASES}
    return {
        "logits_rel": _rel(logits_b, logits_a), "grad_rel": max(_rel(grads_b[n], grads_a[n]) for n in grads_a),
        "kinds": sorted({type(layer.dispatcher).__name__ for layer in state.layers}),
        "predicted": predicted, "phase_rows": phases, "nodes": state.mesh.ep_nodes,
        "plain_remote_rows": sum(plain_stats[name]["dispatch"]["remote_rows_sent"] for name in layers),
        "dropped": sum(int((t < 0).sum()) for ts in traces.values() for t in ts),
    }


def dispatcher_choice(dp: int, ep: int, dispatcher: str, topology: str | None = None,
                      local_world_size: int | None = None) -> dict:
    """The dispatcher class every layer got, and the dispatcher lines of the ``hf_hybrid_ep`` log (the start-up
    summary, logged at the first training forward)."""
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
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, 8))).logits.sum().backward()
        lines = [line.strip() for m in records for line in m.splitlines()]
        return {"kinds": sorted({type(layer.dispatcher).__name__ for layer in hep.state_of(model).layers}),
                "log": [line for line in lines if line.startswith("dispatcher")]}
    except hep.HybridEPConfigError as err:
        return {"error": str(err)}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
        if saved_env is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved_env


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


def exchange_memory(topology: str | None, hidden: int, chunk_bytes: int | None = None, tokens: int = 512,
                    num_experts: int = 16, top_k: int = 4) -> dict:
    """One MoE layer's exchange on every backend of this layout (pure EP over the world, uniform routing, fp32):
    dispatch, an identity expert, combine, and the backward of both. Per backend: the bytes its ATen ops read and
    write (``memory_counting.MemoryTrafficCounter``), the step-time model's prediction
    (``dispatch.cost.memory_bytes`` × tokens), the largest tensor created (``memory_counting.LargestTensor``) and
    the largest row buffer the exchange itself needs (rows sent, received or returned, with the deduplicated rows'
    weights and keys). ``chunk_bytes``: the deduplicated dispatcher's bound on picked rows."""
    from memory_counting import LargestTensor, MemoryTrafficCounter

    from hf_hybrid_ep.dispatch import CommStats, make_dispatcher
    from hf_hybrid_ep.dispatch.cost import ExchangeShape, memory_bytes

    world = dist.get_world_size()
    mesh = hep.build_mesh(1, world, topology=topology)
    shape = ExchangeShape(num_experts, top_k, world, mesh.ranks_per_node, world, hidden, 4)
    out = {}
    for backend in ("torch", "dedup"):
        dispatcher = make_dispatcher(backend, hep.PlacementTable.contiguous(num_experts, world), mesh, CommStats())
        if chunk_bytes is not None:
            dispatcher.chunk_bytes = chunk_bytes
        generator = torch.Generator().manual_seed(dist.get_rank())
        index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
        x = torch.randn(tokens, hidden, generator=generator, requires_grad=True)
        weights = torch.rand(tokens, top_k, generator=generator, requires_grad=True)
        plan = dispatcher.plan(index)[0]
        grad = torch.randn(tokens, hidden, generator=generator)
        with MemoryTrafficCounter() as counter, LargestTensor() as largest:
            rows = dispatcher.dispatch(x, plan, weights)
            dispatcher.combine(rows, weights, plan).backward(grad)
        stages = [s for s in (getattr(plan, "stage_a", None), getattr(plan, "stage_b", None)) if s is not None]
        counts = [tokens, rows.shape[0], plan.num_sent] + [sum(c) for s in stages for c in (s.send, s.recv)]
        out[backend] = {"measured": counter.total, "predicted": memory_bytes(shape, backend) * tokens,
                        "largest": largest.largest, "largest_op": largest.op,
                        "row_buffer": max(counts) * (hidden * 4 + top_k * (4 + 2))}
    return out
