"""Model-level gradient controls: the true global norm and clipping, and skipping reduction (``no_sync``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .backward import suspended
from .nonfinite import record_norm
from .state import state_of


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient reduction inside the block (gradient-accumulation micro-steps); reduce on the next
    ``backward`` outside it, exactly like ``DistributedDataParallel.no_sync``."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = model if isinstance(model, FSDPModule) else None
    with suspended(state_of(model).backward):
        if fsdp is not None:  # dense_sharding="fsdp": FSDP2 keeps unsharded gradients until the sync step
            fsdp.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            if fsdp is not None:
                fsdp.set_requires_gradient_sync(True)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip all gradients of a hybrid-EP model by their true global norm; return that norm.

    Same semantics as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the norm covers dense
    parameters once and every expert once, whichever ranks hold it; a NaN or inf norm leaves the gradients as
    they are (the next optimizer step is skipped on every rank, :mod:`hf_hybrid_ep.engine.nonfinite`, and names
    the layers whose gradients were non-finite). Collective: call on every rank.
    """
    reducer = state_of(model).reducer
    total = reducer.global_grad_norm(norm_type)
    record_norm(model, total)
    # no host read here: a non-finite norm scales by 1 (the gradients stay as they are; the step is skipped)
    coef = torch.where(torch.isfinite(total), torch.clamp(max_norm / (total + 1e-6), max=1.0), torch.ones_like(total))
    for g in reducer.clip_targets():
        g.mul_(coef.to(g.device, g.dtype))
    return total
