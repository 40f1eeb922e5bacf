"""Evaluation at a smaller EP degree, inside a training run.

Validating a model trained at EP degree ``ep`` costs fewer exchanges at a smaller ``ep'``: each rank holds ``ep/ep'``
times the experts and can take a larger evaluation batch (``ep' = 1``: no token exchange at all). Inside
:func:`eval_layout` every per-slot parameter — the experts' weights and their LoRA factors — is gathered over its
training EP group and laid out contiguously at ``ep'`` over EP groups of ``ep'`` consecutive ranks
(:func:`hf_hybrid_ep.build_mesh`, cached); on exit the training layout
comes back as it was — the same parameter objects, so the optimizer, its state and the gradient buckets are
untouched — and training continues at the full degree. The math is the layout's: results equal evaluating the
same weights at the training layout (to the round-off of a different grouping of rows).

Before anything moves, every rank checks that the experts it would add fit its memory (the device's free memory,
or the host's available memory under gloo, or ``budget_bytes``); the ranks agree, and a layout that does not fit is
refused on every rank, naming the bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..dispatch import PlacementTable
from ..errors import HybridEPConfigError
from ..parallel.mesh import build_mesh, current_device
from ..parallel.watchdog import watched
from .optimizers import wait_for_parameters
from .state import HybridEPState, state_of


def _refusal(state: HybridEPState, ep_degree: int) -> str | None:
    """Why ``ep_degree`` cannot evaluate faithfully here, or ``None``."""
    config, mesh = state.config, state.mesh
    if isinstance(ep_degree, bool) or not isinstance(ep_degree, int) or ep_degree < 1:
        return f"ep_degree={ep_degree!r} must be a positive integer"
    if mesh.ep_degree % ep_degree:
        return f"ep_degree={ep_degree} must divide the training EP degree {mesh.ep_degree}"
    odd = [layer for layer in state.layers if layer.num_experts % ep_degree]
    if odd:
        return f"{odd[0].name} has {odd[0].num_experts} experts, not divisible by ep_degree={ep_degree}"
    if config.capacity_factor is not None or config.device_load_factors:
        return ("capacity_factor and device_load_factors make routing depend on the layout: evaluation at another "
                "EP degree would not equal the training layout's")
    if any(layer.shadows is not None for layer in state.layers):
        return "hot-expert shadows are held: evaluate at the training layout (shadow_experts=True)"
    return None


def extra_bytes(state: HybridEPState, ep_degree: int) -> int:
    """Bytes a rank holds beyond the training layout at ``ep_degree``: the added slots of every per-slot parameter
    (the experts' weights and their adapters' factors), plus one parameter's full ``[E, ...]`` tensor while they
    are gathered."""
    added, gathered = 0, 0
    for layer in state.layers:
        slots = layer.num_experts // ep_degree
        for p in layer.slot_parameters():
            row = p[0].numel() * p.element_size()
            added += max(0, slots - p.shape[0]) * row
            gathered = max(gathered, layer.num_experts * row)
    return added + gathered


def free_bytes(device: torch.device) -> int | None:
    """Memory still free where the experts live: the GPU's, or the host's available memory; ``None`` if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _check_fits(state: HybridEPState, ep_degree: int, budget_bytes: int | None) -> None:
    """Every rank checks its memory and the ranks agree; refuse on every rank, naming the bytes."""
    need = extra_bytes(state, ep_degree)
    device = current_device(state.mesh)
    have = budget_bytes if budget_bytes is not None else free_bytes(device)
    short = torch.tensor([0 if have is None or need <= have else need - have], dtype=torch.float64, device=device)
    if state.mesh.world_group is not None:
        with watched("all_reduce of the evaluation layout's memory check", state.mesh.world_group):
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=state.mesh.world_group)
    if short.item() > 0:
        where = "the budget given" if budget_bytes is not None else f"the free memory of {device}"
        raise HybridEPConfigError(
            f"evaluation at ep_degree={ep_degree} needs {need / 2**20:.1f} MiB more per rank (the added experts with "
            f"their adapters, and one gathered parameter), {short.item() / 2**20:.1f} MiB beyond {where} on some "
            "rank: evaluate at a larger EP degree or the training layout")


@contextlib.contextmanager
def eval_layout(model: nn.Module, ep_degree: int, budget_bytes: int | None = None) -> Iterator[None]:
    """Inside the block, ``model``'s experts are laid out at EP degree ``ep_degree`` (dividing the training one); on
    exit the training layout is back. For forwards under ``no_grad`` (evaluation, ``generate``): no optimizer step
    and no save inside. Collective: enter and leave on every rank. ``ep_degree`` equal to the training one: nothing
    changes.

    Raises:
        HybridEPConfigError: on every rank, before anything moves: an EP degree that does not divide the training
            one or the expert counts, routing that depends on the layout (capacity, device-load factors, shadows),
            or experts that do not fit (:func:`extra_bytes` against ``budget_bytes`` or the free memory).
    """
    state = state_of(model)
    if ep_degree == state.mesh.ep_degree:
        yield
        return
    why = _refusal(state, ep_degree)
    if why is not None:
        raise HybridEPConfigError(f"evaluation layout: {why}")
    _check_fits(state, ep_degree, budget_bytes)
    wait_for_parameters(model)
    mesh = build_mesh(state.mesh.world_size // ep_degree, ep_degree, state.mesh.device_type, state.mesh.topology,
                      state.mesh.timeout)
    slots = max(math.ceil(layer.num_experts / ep_degree) for layer in state.layers)
    saved = []
    for layer in state.layers:
        table = PlacementTable.contiguous(layer.num_experts, ep_degree)
        rows = torch.tensor(table.local_experts(mesh.ep_rank), dtype=torch.long)
        training = layer.slot_parameters()
        # one gathered [E, ...] tensor at a time, freed once its rows are taken
        laid_out = [nn.Parameter(layer.gather_rows(p)[rows.to(p.device)], requires_grad=False) for p in training]
        saved.append((layer, layer.mesh, layer.table, layer.options, training))
        layer.use_slot_parameters(laid_out)
        options = dataclasses.replace(layer.options, count_slots=max(slots, layer.options.count_slots or 0))
        layer.use_layout(mesh, table, options)
    training_mesh, state.agreement.mesh = state.agreement.mesh, mesh
    try:
        yield
    finally:
        state.agreement.mesh = training_mesh
        for layer, old_mesh, old_table, old_options, old_params in saved:
            layer.use_slot_parameters(old_params)
            layer.use_layout(old_mesh, old_table, old_options)
