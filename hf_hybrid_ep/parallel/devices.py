"""Where one rank's tensors live: its device, moving a model there, and the check that agrees them.

Under NCCL a rank computes on ``cuda:LOCAL_RANK`` (the launchers' convention; the device the process group is
bound to when it was created with ``device_id``; ``cuda:0`` when a process sees one GPU only), under gloo on
the CPU, or on the GPU a gloo group was bound to (``init_process_group("gloo", device_id=...)``: several ranks
sharing one GPU, gloo carrying CUDA tensors through host memory). :func:`hf_hybrid_ep.parallelize` makes that device current and moves the model there, so a model
built or loaded on the CPU trains as written; a model already on another GPU is refused, naming the devices.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..errors import HybridEPConfigError


def local_rank() -> int:
    """``LOCAL_RANK`` of the launcher (torchrun, accelerate), 0 without one."""
    raw = os.environ.get("LOCAL_RANK", "") or "0"
    try:
        return int(raw)
    except ValueError:
        raise HybridEPConfigError(f"LOCAL_RANK={raw!r} is not an integer") from None


def cuda_device_for(rank: int, visible: int) -> torch.device:
    """The GPU of the process with local rank ``rank`` when ``visible`` GPUs are visible to it."""
    if visible < 1:
        raise HybridEPConfigError("the process group runs NCCL but this process sees no CUDA device")
    if visible == 1:  # one GPU per process (CUDA_VISIBLE_DEVICES set per rank)
        return torch.device("cuda", 0)
    if rank >= visible:
        raise HybridEPConfigError(f"LOCAL_RANK={rank} but this process sees only {visible} CUDA devices: one rank "
                                  "per GPU (NCCL refuses two ranks on one GPU)")
    return torch.device("cuda", rank)


def rank_device(device_type: str) -> torch.device:
    """This rank's device for a mesh of ``device_type`` (``"cuda"`` under NCCL or a GPU-bound gloo group, ``"cpu"``
    under gloo)."""
    if device_type != "cuda":
        return torch.device(device_type)
    bound = getattr(dist.group.WORLD, "bound_device_id", None) if dist.is_initialized() else None
    if bound is not None:
        return torch.device(bound)
    return cuda_device_for(local_rank(), torch.cuda.device_count())


def current_cuda_device() -> torch.device | None:
    """The current CUDA device, ``None`` without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def check_devices(model: nn.Module, device: torch.device, current: torch.device | None) -> None:
    """Refuse parameters on an accelerator other than ``device`` (this rank's device on the mesh), naming the
    parameter's device, the current CUDA device ``current`` and ``device``. Parameters on the CPU (moved
    afterwards) or on the meta device (materialised afterwards) pass."""
    misplaced = next(((n, p.device) for n, p in model.named_parameters()
                      if p.device.type not in ("cpu", "meta") and p.device != device), None)
    if misplaced is None:
        return
    name, where = misplaced
    raise HybridEPConfigError(
        f"devices disagree on this rank: parameter {name!r} is on {where}, the current CUDA device is {current or 'none'}, "
        f"and this rank's device on the mesh is {device} (LOCAL_RANK={os.environ.get('LOCAL_RANK', 'unset')}); "
        f"build or load the model on the CPU (parallelize moves it), or call torch.cuda.set_device({device.index}) "
        "before building it on the GPU"
    )


def use_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (NCCL's collectives and every later ``.cuda()`` use it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def place_module(module: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``module`` that is not on ``device`` there, in place (parameters keep
    their objects where the tensor types allow it, as ``Module.to`` does); meta tensors stay (not yet loaded)."""
    if all(t.device == device or t.is_meta for t in (*module.parameters(), *module.buffers())):
        return
    module._apply(lambda t: t if t.is_meta or t.device == device else t.to(device))
