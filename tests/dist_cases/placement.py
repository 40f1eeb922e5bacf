"""Placement cases: what each rank holds, where experts sit, how they move, and the routing load.

Parameter bytes per rank, the mesh layout and its group creation, placement tables through a
checkpoint, online rebalancing followed by a save, and the per-expert load metrics (with aux-loss-free
biases) that drive rebalancing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import hf_hybrid_ep as hep

from .common import _build, _global_inputs, _rank_slice, _tables


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


def mesh_layout(dp: int | None, ep: int | None, topology: str) -> dict:
    """Parallelize with a topology; report the layout and this rank's EP group."""
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, topology=topology))
    mesh = hep.state_of(model).mesh
    group = [mesh.global_rank(mesh.edp_rank, r) for r in range(mesh.ep_degree)]
    return {"kind": mesh.ep_span.kind, "ep": mesh.ep_degree, "group": group,
            "nodes": sorted({mesh.topology.node_of(g) for g in group})}


def group_creation_calls(dp: int, ep: int, sets: list[tuple[int, ...]]) -> list[list[int]]:
    """The ``new_group`` calls this rank makes when asked for ``sets`` (every rank must make the same)."""
    from unittest import mock

    from hf_hybrid_ep.parallel.mesh import build_mesh

    mesh = build_mesh(dp, ep)
    calls = []
    real = dist.new_group

    def recording(ranks: list[int], *args: Any, **kwargs: Any) -> Any:
        calls.append(list(ranks))
        return real(ranks, *args, **kwargs)

    with mock.patch.object(dist, "new_group", recording):
        for ranks in sets:
            mesh.group_of(tuple(ranks))
    return calls


def save_and_reload_placement(directory: str, placement: list[list[int]] | dict[str, list[list[int]]]) -> dict:
    """Save a model parallelized with ``placement`` (one table or per layer); reload it with no placement
    in the config."""
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

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
    from hf_hybrid_ep.model_io.save import save_hybrid_checkpoint

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
        hep.after_optimizer_step(model)
    save_hybrid_checkpoint(model, directory)
    trained = hep.full_state_dict(model)
    loaded = hep.from_pretrained(directory, hep.HybridEPConfig(dp_degree=world, ep_degree=1))
    again = hep.full_state_dict(loaded)
    return {"tables": _tables(model), "events": len(hep.state_of(model).rebalancer.events),
            "equal": sorted(trained) == sorted(again) and all(torch.equal(trained[k], again[k]) for k in trained),
            "loaded_tables": _tables(loaded)}


def routing_metrics(dp: int, ep: int, steps: int = 3, **controls: Any) -> dict:
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
        hep.after_optimizer_step(model)
        report = load_report(model)
        first = next(iter(report.values()))
        shares.append(first["tokens_per_rank"][0] / max(1, sum(first["tokens_per_rank"])))
    state = hep.state_of(model)
    biases = [layer.controls.selection_bias.tolist() for layer in state.layers
              if layer.controls is not None and layer.controls.selection_bias is not None]
    return {"report": report, "biases": biases, "rank0_share": shares}


def rebalance_without_optimizer() -> dict:
    """Rebalancing due after a step that no optimizer took: refused before any expert moves."""
    model, _ = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=dist.get_world_size(), rebalance_every=1))
    model(**_rank_slice(_global_inputs(model, dist.get_world_size(), seed=0), dist.get_rank())).loss.backward()
    before = _tables(model)
    try:
        hep.after_optimizer_step(model)
    except hep.HybridEPConfigError as err:
        return {"message": str(err), "unmoved": _tables(model) == before}
    return {"message": "", "unmoved": _tables(model) == before}


def group_timeouts(dp: int, ep: int, timeout_s: float) -> dict:
    """The timeout of every process group ``parallelize`` creates (the mesh's, the reduction group, holder sets of
    replicated experts) and the watchdog's, with ``collective_timeout_s=timeout_s``."""
    from hf_hybrid_ep.parallel import watchdog

    model, _ = _build("mixtral", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, placement=[[0, 1], [1, 2], [2, 3], [3, 0]],
                                              collective_timeout_s=timeout_s))
    state = hep.state_of(model)

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    holders = [b.group for b in state.reducer.holder_groups if b.group is not None and len(b.ranks) == 2]
    timeouts = {"ep": seconds(state.mesh.ep_group), "edp": seconds(state.mesh.edp_group),
                "reduction": seconds(state.mesh.reduction_group)}
    if holders:
        timeouts["holders"] = seconds(holders[0])
    return {"timeouts": timeouts, "watchdog": watchdog.current().timeout_s}
