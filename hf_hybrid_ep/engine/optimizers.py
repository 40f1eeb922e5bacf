"""The model's optimizer: plain or ZeRO-1-sharded (:mod:`hf_hybrid_ep.parallel.zero`), on the fast kernels.

Model-level entry points: :func:`make_optimizer` (what the config asks for), :func:`shard_optimizer`,
:func:`reshard_optimizer` and :func:`wait_for_parameters`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.mesh import is_dtensor
from ..parallel.zero import ShardedOptimizer, ZeroSharding, sharded_class
from .state import state_of


def shard_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], params, *args, **kwargs):
    """``optimizer_cls(params, *args, **kwargs)`` with its state sharded ZeRO-1 style: dense over the world, each expert over its holders.

    ``params`` are the model's parameters or param groups, as for the optimizer class itself. Call on
    every rank, after :func:`hf_hybrid_ep.parallelize`; the model's reducer then reduce-scatters.
    """
    state = state_of(model)
    reducer = state.reducer
    if reducer.sharding is None:
        state.backward.follow_trainable()  # shard the buckets of the parameters trainable now
    sharding = reducer.sharding if reducer.sharding is not None else ZeroSharding(reducer, model)
    return sharded_class(optimizer_cls)(sharding, params, *args, **kwargs)


def fast_implementation(optimizer_cls: type[torch.optim.Optimizer], params, **kwargs) -> dict[str, bool]:
    """``{"fused": True}`` where ``optimizer_cls`` has a fused kernel for these parameters' device and dtypes,
    else ``{"foreach": True}`` where it takes that flag, else ``{}``; nothing when ``kwargs`` already choose,
    (:func:`make_optimizer` puts FSDP2's DTensor parameters and plain ones in separate groups, which the
    multi-tensor kernels need).

    torch's default on CPU is the per-tensor loop (for AdamW on one 32.5 M-parameter rank, 0.155 s vs
    0.048 s fused, single-threaded); the Trainer already defaults to ``adamw_torch_fused``.
    """
    import inspect

    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if "fused" in kwargs or "foreach" in kwargs:
        return {}
    accepted = inspect.signature(optimizer_cls.__init__).parameters
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    floating = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    if "fused" in accepted and tensors and all(
        t.dtype in floating and t.device.type in _get_fused_kernels_supported_devices() for t in tensors
    ):
        return {"fused": True}
    if "foreach" in accepted:
        return {"foreach": True}
    return {}


def _split_dtensor_groups(params: list) -> list:
    """Param groups with FSDP2 DTensor parameters and plain ones apart (same hyperparameters): the fused and
    foreach kernels take one kind per call. Unchanged when there is one kind."""
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    if len({is_dtensor(p) for g in groups for p in g["params"]}) < 2:
        return params
    out = []
    for g in groups:
        for kind in (True, False):
            mine = [p for p in g["params"] if is_dtensor(p) is kind]
            if mine:
                out.append({**g, "params": mine})
    return out


def make_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], params, *args, **kwargs):
    """The optimizer the model's config asks for: sharded with ``optimizer_sharding="zero1"``, plain otherwise;
    with the fused (or multi-tensor) kernel of :func:`fast_implementation` unless ``kwargs`` choose one."""

    params = _split_dtensor_groups(list(params))
    kwargs = {**fast_implementation(optimizer_cls, params, **kwargs), **kwargs}
    state = state_of(model)
    if state.config.optimizer_sharding == "zero1":
        optimizer = shard_optimizer(model, optimizer_cls, params, *args, **kwargs)
    else:
        optimizer = optimizer_cls(params, *args, **kwargs)
    if state.rebalancer is not None:  # online rebalancing moves this optimizer's state with the experts
        state.rebalancer.optimizer = optimizer
    return optimizer


def reshard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A fresh (state-less) plain optimizer turned into its sharded form, same groups and defaults."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError("reshard_optimizer needs a fresh optimizer (it already holds state)")
    groups = [dict(g) for g in optimizer.param_groups]  # every hyperparameter is in the groups
    return shard_optimizer(model, type(optimizer), groups)


def wait_for_parameters(model: nn.Module) -> None:
    """Wait for the ZeRO-1 parameter all-gathers launched by the last ``optimizer.step()``.

    Forward passes, saving, ``state_dict``, ``full_state_dict`` and the replica check do this themselves;
    call it before reading parameters directly (``model.named_parameters()``) right after a step.
    """
    sharding = state_of(model).reducer.sharding
    if sharding is not None:
        sharding.wait_params()
