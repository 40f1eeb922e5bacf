"""A parallelized PEFT model as a whole: its adapters in PEFT's own layout, a collective ``save_pretrained``
that writes an ordinary PEFT adapter directory, and ``merge_and_unload`` / ``unload`` that hand the engine's
state to the unloaded model.

The expert adapters' factors are held slot-major on each rank (:mod:`hf_hybrid_ep.moe.lora`); PEFT's files
hold every expert in its own layout (``lora_A [r·E, in]``, ``lora_B [out, r·E]``), which
:func:`adapter_state_dict` assembles over the EP group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..parallel.heartbeat import Heartbeat
from .model_io import expert_factors, host_tensors
from .state import state_of


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``False`` without PEFT installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every expert adapter factor in PEFT's layout over all experts, on rank 0 in
    host memory (gathered over rank 0's EP group, one factor at a time); the other entries, and every entry on
    the other ranks, reference the rank's own tensors. Collective: call on every rank."""
    out = dict(model.state_dict())
    out.update(host_tensors(model, {name: out[name] for name in expert_factors(model)}, rank0_only=True))
    return out


def wrap_adapter_methods(model: nn.Module, on_unload: Callable[[nn.Module, nn.Module], None]) -> None:
    """Make a parallelized ``PeftModel``'s ``save_pretrained`` collective — every expert's adapter gathered, rank 0
    writing a standard PEFT adapter directory that ``PeftModel.from_pretrained`` loads in one process — and let
    ``merge_and_unload`` / ``unload`` call ``on_unload(peft_model, unloaded_model)`` (merging adds each rank's
    slots' ``ΔW`` to its own expert slots)."""
    original_save = model.save_pretrained

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        state_dict = adapter_state_dict(model) if state_dict is None else state_dict
        return Heartbeat(state_of(model).mesh).alone(
            lambda: original_save(save_directory, *args, state_dict=state_dict, **kwargs))

    save_pretrained.__doc__ = (original_save.__doc__ or "") + "\n\n(hf_hybrid_ep: collective; gathers the experts' adapters.)"
    model.save_pretrained = save_pretrained
    for method in ("merge_and_unload", "unload"):
        original = getattr(model, method)

        def unloading(*args, _original=original, **kwargs):
            unloaded = _original(*args, **kwargs)
            on_unload(model, unloaded)
            return unloaded

        unloading.__doc__ = (original.__doc__ or "") + "\n\n(hf_hybrid_ep: the hybrid-EP state moves to the result.)"
        setattr(model, method, unloading)
