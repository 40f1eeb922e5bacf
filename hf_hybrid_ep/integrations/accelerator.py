"""Hybrid EP in a hand-written Accelerate loop: wrapping and resumable state.

    model = hep.parallelize(model, plugin.config)
    prepare_accelerator(accelerator, model)               # before accelerator.prepare
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ...
    save_state(accelerator, model, optimizer, "ckpt/step-100", schedulers=[scheduler])
    load_state(accelerator, model, optimizer, "ckpt/step-100", schedulers=[scheduler])  # any EP degree

``save_state`` writes ``model/`` (an expert-sharded hybrid-EP checkpoint), ``optimizer/`` (state keyed
by parameter name and global expert id) and ``accelerate/`` (schedulers, dataloaders, scaler and RNG,
through Accelerate's own ``save_accelerator_state``; read back with ``weights_only=True``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import DistributedType
from torch import nn

from ..checkpoint.atomic import staged_save
from ..engine.state import state_of
from ..errors import HybridEPConfigError
from ..model_io.optimizer_state import load_optimizer_state, save_optimizer_state
from ..model_io.rank_local import load_checkpoint_into_
from ..model_io.save import rank_zero_save, save_hybrid_checkpoint

_MULTI_PROCESS = {DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def _unwrap(accelerator: Accelerator, model: nn.Module) -> nn.Module:
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def prepare_accelerator(accelerator: Accelerator, model: nn.Module) -> None:
    """Let DDP reduce the dense gradients and the engine the experts, on sync steps only.

    With ``optimizer_sharding="zero1"``, build the optimizer with :func:`hf_hybrid_ep.make_optimizer`:
    each rank then steps its shard of the DDP-averaged dense gradients and of the engine's
    reduce-scattered expert gradients. Refuses ``dense_sharding="fsdp"`` (DDP cannot wrap it).

    Call before ``accelerator.prepare(model, ...)``: the experts go on DDP's ignore list, the engine
    stops reducing dense gradients (DDP does), and expert reduction follows
    ``accelerator.sync_gradients`` (so ``accelerator.accumulate``/``no_sync`` work as usual).
    """
    state = state_of(model)
    if accelerator.distributed_type in _MULTI_PROCESS:
        if state.config.dense_sharding == "fsdp":
            raise HybridEPConfigError(
                "dense_sharding='fsdp' cannot be used under Accelerate/Trainer: they wrap the model in torch DDP, "
                "which does not hold FSDP2-sharded (DTensor) weights; use a plain torch loop, or "
                "optimizer_sharding='zero1' with replicated dense weights"
            )
        experts = state.expert_parameter_names(model)
        held = set(experts)
        if not any(p.requires_grad for n, p in model.named_parameters() if n not in held):
            raise HybridEPConfigError(
                "nothing dense is trained (only expert parameters or their adapters), but Accelerate/Trainer wrap "
                "the model in torch DDP, which needs a trainable parameter: add dense LoRA targets "
                "(target_modules, e.g. the attention projections) or train in a plain torch loop")
        state.reducer.reduce_dense = False
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    state.backward.gradient_sync = lambda: accelerator.sync_gradients


def save_state(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    output_dir: str | os.PathLike[str],
    *,
    schedulers: Sequence = (),
    dataloaders: Sequence = (),
) -> Path:
    """Save everything a resume needs, at any EP degree. Collective: call on every rank.

    ``output_dir`` is staged whole and put in place atomically (:mod:`hf_hybrid_ep.checkpoint.atomic`):
    a crash leaves the previous state or the new one."""
    output_dir = Path(output_dir)
    hybrid = _unwrap(accelerator, model)
    with rank_zero_save(hybrid, lambda: staged_save(output_dir)) as (staging, save_id):
        save_hybrid_checkpoint(hybrid, staging / "model")
        save_optimizer_state(hybrid, getattr(optimizer, "optimizer", optimizer), staging / "optimizer", save_id)
        (staging / "accelerate").mkdir(parents=True, exist_ok=True)
        save_accelerator_state(
            str(staging / "accelerate"), model_states=[], optimizers=[], schedulers=list(schedulers),
            dataloaders=list(dataloaders), process_index=accelerator.process_index, step=accelerator.step,
            scaler=accelerator.scaler,
        )
        accelerator.wait_for_everyone()
    return output_dir


def load_state(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    input_dir: str | os.PathLike[str],
    *,
    schedulers: Sequence = (),
    dataloaders: Sequence = (),
) -> None:
    """Restore a :func:`save_state` directory into a model prepared at the same or another EP degree."""
    input_dir = Path(input_dir)
    hybrid = _unwrap(accelerator, model)
    load_checkpoint_into_(input_dir / "model", hybrid)
    load_optimizer_state(hybrid, getattr(optimizer, "optimizer", optimizer), input_dir / "optimizer")
    load_accelerator_state(
        str(input_dir / "accelerate"), models=[], optimizers=[], schedulers=list(schedulers),
        dataloaders=list(dataloaders), process_index=accelerator.process_index, scaler=accelerator.scaler,
    )
