"""fp16 loss scaling under hybrid EP: every rank skips the step when any rank overflowed.

``torch.amp.GradScaler`` decides per process whether gradients hold inf/NaN. Dense gradients are
all-reduced over the world, so an overflow there reaches every rank, but expert gradients are only
reduced within their EDP group: an overflow in one rank's experts would make that rank skip the
step while others take it, and the replicas would diverge. :func:`agree_found_inf_` unscales (if
not yet done) and all-reduces the scaler's ``found_inf`` over the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mesh import HybridMesh, current_device
from .watchdog import watched

_AGREED = "hybrid_ep_found_inf_agreed"


def agree_found_inf_(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, mesh: HybridMesh) -> bool:
    """Unscale ``optimizer``'s gradients (once per step) and make ``found_inf`` the world's maximum.

    Returns True when the coming ``scaler.step(optimizer)`` will be skipped (on every rank alike).
    Relies on ``GradScaler``'s per-optimizer state, the documented behaviour of ``unscale_``/``step``.
    """
    if not scaler.is_enabled():
        return False
    state = scaler._per_optimizer_states[id(optimizer)]
    if _AGREED in state:
        return bool(state[_AGREED])
    if state["stage"].name == "READY":
        scaler.unscale_(optimizer)
    per_device = state["found_inf_per_device"]
    device = current_device(mesh)
    found = torch.zeros((), dtype=torch.float32, device=device)
    for value in per_device.values():
        found = torch.maximum(found, value.to(device))
    if mesh.world_group is not None:
        with watched("all_reduce of the fp16 overflow flags", mesh.world_group):
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=mesh.world_group)
    if not per_device:
        per_device[device] = found.clone()
    for dev in list(per_device):
        per_device[dev] = found.to(dev)
    state[_AGREED] = found.item() > 0
    return bool(state[_AGREED])
