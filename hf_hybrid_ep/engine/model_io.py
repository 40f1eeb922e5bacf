"""The unsharded model from a parallelized one: host copies of its tensors, ``full_state_dict``, and the
``save_pretrained`` / ``generate`` wrappers that make those methods collective."""

from __future__ import annotations

import torch
from torch import nn

from ..moe.layer import ShardedExperts
from ..moe.lora import peft_from_slots
from ..parallel.heartbeat import Heartbeat
from ..parallel.mesh import is_dtensor, local_tensor
from .optimizers import wait_for_parameters
from .state import state_of


def savable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries ``save_pretrained`` writes: without the keys the model ignores on save and the
    duplicates of tied weights. References to this rank's tensors (local expert slots, FSDP2 shards)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    wait_for_parameters(model)
    tensors = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        tensors.pop(key, None)
    kept = remove_tied_weights_from_state_dict({k: local_tensor(v) for k, v in tensors.items()}, model)
    return {k: v for k, v in tensors.items() if k in kept}


def expert_layers_by_key(model: nn.Module) -> dict[str, ShardedExperts]:
    """State-dict key of every expert parameter → its EP layer."""
    return {f"{layer.name}.{p}": layer for layer in state_of(model).layers for p in layer.param_names}


def expert_factors(model: nn.Module, layers: list[ShardedExperts] | None = None
                   ) -> dict[str, tuple[ShardedExperts, str]]:
    """Parameter name of every expert adapter factor (:mod:`hf_hybrid_ep.moe.lora`) → its EP layer (of ``layers``,
    default the model's) and kind (``"A"`` / ``"B"``), in the model's parameter order (the same on every rank)."""
    layers = state_of(model).layers if layers is None else layers
    of = {id(p): (layer, kind) for layer in layers for kind, p in layer.experts.adapter_factors()}
    return {name: of[id(p)] for name, p in model.named_parameters() if id(p) in of}


def gather_scratch(model: nn.Module) -> torch.Tensor:
    """A device buffer (uint8) that holds every EP rank's slots of the largest expert parameter or adapter
    factor: one gathered tensor at a time passes through it on its way to host memory."""
    layers = expert_layers_by_key(model)
    params = [(getattr(layer.module, name.rpartition(".")[2]), layer) for name, layer in layers.items()]
    params += [(p, layer) for layer in state_of(model).layers for p in layer.experts.adapter_parameters()]
    nbytes = max((layer.gathered_bytes(p) for p, layer in params), default=0)
    return torch.empty(nbytes, dtype=torch.uint8, device=params[0][0].device if params else None)


@torch.no_grad()
def host_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], rank0_only: bool,
                 scratch: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """State-dict entries ``tensors`` of the unsharded model (every expert, global ids; expert adapter factors
    in PEFT's layout over all experts) in host memory, one tensor at a time: beyond the model the device
    holds one :func:`gather_scratch` buffer (``scratch``, or one made for the call).

    With ``rank0_only`` only rank 0 gets them (``{}`` elsewhere) and only rank 0's EP group gathers experts;
    otherwise every rank does. Collective: expert parameters over the EP group, FSDP2-sharded tensors over
    the world; call on every rank with the same keys.
    """
    mesh = state_of(model).mesh
    keep = mesh.rank == 0 or not rank0_only
    gathers = mesh.edp_rank == 0 or not rank0_only
    experts = {name: (layer, None) for name, layer in expert_layers_by_key(model).items()}
    experts.update(expert_factors(model))  # adapter factors: PEFT's layout over all experts
    if gathers and scratch is None and any(name in experts for name in tensors):
        scratch = gather_scratch(model)
    out = {}
    for name, t in tensors.items():
        if name in experts:
            layer, kind = experts[name]
            full = layer.gather_to_host(t, keep, scratch) if gathers else None
            if full is not None:
                out[name] = full if kind is None else peft_from_slots(full, kind)
            continue
        if is_dtensor(t):
            t = t.full_tensor()
        if keep:
            out[name] = t.detach().cpu()
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded model (every expert, global ids), on every rank, in host memory.

    Collective over each EP group (and the world for FSDP2-sharded weights): call on every rank.
    """
    wait_for_parameters(model)
    return host_tensors(model, model.state_dict(), rank0_only=False)


def wrap_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` write the full model (a vanilla transformers checkpoint).

    Collective, like ``accelerator.get_state_dict``: the experts are gathered over rank 0's EP group one
    parameter at a time into rank 0's host memory, and transformers writes them there while the other
    ranks follow rank 0's heartbeat (no rank waits in one long collective).
    """
    original = getattr(model, "save_pretrained", None)
    if original is None:
        return

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            state_dict = host_tensors(model, savable_state(model), rank0_only=True)
        return Heartbeat(state_of(model).mesh).alone(
            lambda: original(save_directory, *args, state_dict=state_dict, **kwargs))

    save_pretrained.__doc__ = (original.__doc__ or "") + "\n\n(hf_hybrid_ep: collective; gathers the experts.)"
    model.save_pretrained = save_pretrained


def wrap_generate(model: nn.Module) -> None:
    """Make ``model.generate`` keep every rank stepping until all ranks are done (``synced_gpus``).

    Every decoding step runs the all-to-all, so a rank that stops early (EOS, a shorter
    ``max_new_tokens``) must keep running forward passes until the others finish: transformers does
    exactly that with ``synced_gpus=True``, which becomes the default here when the world has more
    than one rank.
    """
    original = getattr(model, "generate", None)
    if original is None or state_of(model).mesh.world_group is None:
        return

    def generate(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return original(*args, **kwargs)

    generate.__doc__ = original.__doc__
    model.generate = generate
