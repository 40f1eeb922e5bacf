"""``parallelize(model, config)``: turn a transformers MoE model into its hybrid-EP form, in place.

Setup only: each ``_apply_*`` step wires one part (layout, device, expert sharding, router controls,
gradient reduction and its per-backward sequence, hooks, shadowing, rebalancing); what runs at every step
lives in :mod:`hf_hybrid_ep.engine.step` and :mod:`hf_hybrid_ep.engine.backward`. docs/architecture.md has
the layers and a token's path through them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from ..config import HybridEPConfig
from ..dispatch import PlacementTable, choose_backend, resolve_backend
from ..dispatch.table import layer_tables
from ..errors import HybridEPConfigError
from ..moe.aux_losses import ModelAuxLoss, add_aux_losses
from ..moe.discovery import (
    ExpertsFormat,
    check_shardable,
    find_experts_modules,
    find_shared_expert,
    unwrapped_name,
)
from ..moe.holdings import expert_holdings
from ..moe.layer import EPLayerOptions, ShardedExperts, SharedExpertOverlap
from ..moe.load import attach_load_accounting
from ..moe.lora import attach_expert_adapters, check_expert_adapters, detach_expert_adapters, expert_wrappers
from ..moe.rebalance import Rebalancer
from ..moe.router_controls import install_router_controls
from ..moe.router_rules import find_router
from ..moe.shadow import ShadowManager
from ..parallel import watchdog
from ..parallel.agreement import InputAgreement
from ..parallel.devices import check_devices, current_cuda_device, place_module, rank_device, use_device
from ..parallel.grads import GradientReducer
from ..parallel.mesh import (
    HybridMesh,
    build_mesh,
    default_device_type,
    world_size,
    world_timeout,
)
from .adapters import is_peft_model, wrap_adapter_methods
from .backward import BackwardSequence
from .failures import agree_on_failure
from .model_io import wrap_generate, wrap_save_pretrained
from .nonfinite import watch_optimizers
from .optimizers import wait_for_parameters
from .state import HybridEPState, attach, carries_state, is_parallelized, state_of
from .step import after_forward, before_forward


def _check_same_everywhere(model: nn.Module, tables: list[PlacementTable], mesh: HybridMesh) -> None:
    """Refuse models or tables that differ between ranks (different seeds, different checkpoints)."""
    if mesh.world_group is None:
        return
    with torch.no_grad():
        sums = [p.detach().sum(dtype=torch.float64).item() for p in model.parameters()]
    mine = ([t.fingerprint() for t in tables], sums)
    gathered = mesh.gather_objects(mine, "all_gather of every rank's placement tables and parameter sums (set-up "
                                   "check)")
    names = [n for n, _ in model.named_parameters()]
    for rank, (fps, other) in enumerate(gathered):
        if fps != mine[0]:
            raise HybridEPConfigError(f"rank {rank} uses a different placement table than rank {mesh.rank}")
        for name, a, b in zip(names, other, sums, strict=True):
            if not (a == b or abs(a - b) <= 1e-6 * max(abs(a), abs(b))):
                raise HybridEPConfigError(
                    f"parameter {name!r} differs between rank {rank} and rank {mesh.rank}: build the model "
                    "identically on every rank (same seed or the same checkpoint) before parallelize"
                )


def parallelize(
    model: nn.Module,
    config: HybridEPConfig | None = None,
    *,
    materialize: Callable[[nn.Module, list[ShardedExperts]], None] | None = None,
    source: str | None = None,
) -> nn.Module:
    """Shard the routed experts of a transformers MoE model over EP groups and return the same model.

    The model must be built identically on every rank (same config and seed, or the same checkpoint)
    and ``torch.distributed`` initialised (or a world of one). The model moves to this rank's device
    (``cuda:LOCAL_RANK`` under NCCL, which becomes the current CUDA device; the CPU under gloo) after its
    experts are sharded, so build it on the CPU. In place: dense weights stay replicated;
    each fused experts module keeps only this rank's experts and runs through the all-to-all dispatcher;
    gradient hooks give every gradient the single-process value after ``loss.backward()``. Create the
    optimizer afterwards. Collective: call on every rank. ``source`` names where the weights come from (a
    checkpoint directory or Hub id; the start-up summary says it).

    Raises:
        HybridEPConfigError: before any work, for a layout that cannot work (naming the values), a model
            with no routed experts, an experts module that cannot be sharded, or parameters already on
            another GPU than this rank's (naming it, the current device and the mesh's).
    """
    if is_parallelized(model):
        raise HybridEPConfigError(f"{type(model).__name__} is already parallelized")
    config = config or HybridEPConfig()
    found = check_shardable(model)
    adapters = _check_adapters(model=model, config=config, found=found)
    mesh, tables, backend, choice = _apply_layout(model=model, config=config, found=found)
    device = _apply_device(model=model, mesh=mesh)
    if not any(p.is_meta for p in model.parameters()):
        _check_same_everywhere(model, tables, mesh)
    layers, agreement = _apply_expert_sharding(model=model, config=config, found=found, tables=tables, mesh=mesh,
                                               backend=backend, adapters=adapters)
    if materialize is not None:
        agree_on_failure(mesh, materialize, model, layers)
    place_module(model, device)  # after sharding: only this rank's experts reach the device
    for layer in layers:
        layer.place_routing()
    _apply_router_controls(model=model, config=config, layers=layers, mesh=mesh)
    if config.dense_sharding == "fsdp":
        _fully_shard_dense(model, layers, mesh)
    reducer = _apply_gradient_reduction(model=model, config=config, layers=layers, mesh=mesh)
    shadows = ShadowManager(layers, mesh, config.shadow_capacity) if config.shadow_experts else None
    backward = BackwardSequence(reducer, agreement, shadows)
    attach(model, HybridEPState(config, mesh, layers, reducer, backward, agreement, shadows=shadows,
                                dispatcher_choice=choice, weights_from=source))
    _apply_hooks(model=model)
    if config.rebalancing:
        state_of(model).rebalancer = Rebalancer(model, layers, mesh, reducer, config)
    watch_optimizers(model)
    if is_peft_model(model):
        wrap_adapter_methods(model, _unloaded)
    else:
        wrap_save_pretrained(model)
    wrap_generate(model)
    return model


def _check_adapters(*, model: nn.Module, config: HybridEPConfig, found: list[tuple[str, nn.Module]]
                    ) -> dict[str, dict[str, nn.Module]]:
    """PEFT's LoRA wrappers above each experts module (by module name, then adapted parameter), checked
    before any work: what the adapters need that the engine does not do is refused, naming it."""
    adapters = {}
    for name, module in found:
        wrappers = expert_wrappers(model, name, module)
        check_expert_adapters(name, module, wrappers)
        if wrappers:
            adapters[name] = wrappers
    if adapters and config.rebalancing:
        raise HybridEPConfigError("online rebalancing (rebalance_every / rebalance_when_imbalance_over) moves expert "
                                  "weights between ranks but not their LoRA adapters; turn it off to train expert adapters")
    if adapters and config.shadow_experts:
        raise HybridEPConfigError("shadow_experts copies expert weights to other ranks but not their LoRA adapters; "
                                  "turn it off to train expert adapters")
    if is_peft_model(model) and config.dense_sharding == "fsdp":
        raise HybridEPConfigError("dense_sharding='fsdp' is not supported for PEFT models (adapters are small: "
                                  "use dense_sharding='replicate')")
    return adapters


def _unloaded(peft_model: nn.Module, model: nn.Module) -> None:
    """PEFT unloaded its wrappers (``merge_and_unload`` / ``unload``) and returned ``model``: the hybrid-EP state
    moves to it — layer names without PEFT's, experts computed without adapters, a reducer of its parameters —
    and it saves and generates like a parallelized model (it already did if it was parallelized before PEFT
    wrapped it)."""
    state = state_of(peft_model)
    for layer in state.layers:
        layer.name = unwrapped_name(layer.name)
        layer.layer_names = {i: unwrapped_name(n) for i, n in layer.layer_names.items()}
        detach_expert_adapters(layer)
    reducer = _apply_gradient_reduction(model=model, config=state.config, layers=state.layers, mesh=state.mesh)
    backward = BackwardSequence(reducer, state.agreement, state.shadows)
    parallelized_before = is_parallelized(model)
    attach(model, dataclasses.replace(state, reducer=reducer, backward=backward), replace=parallelized_before)
    if not parallelized_before:
        _apply_hooks(model=model)
        wrap_save_pretrained(model)
        wrap_generate(model)


def parallelize_peft_model(peft_model: nn.Module) -> nn.Module:
    """Take over a ``PeftModel`` that PEFT made around an already parallelized model (``get_peft_model`` after
    :func:`parallelize`, as TRL's trainers do when given ``peft_config``), and return it.

    PEFT drew each expert adapter over this rank's slots (the experts module holds only those): the factors are
    held slot-major and computed with their experts, the gradient reducer is rebuilt for the adapters (PEFT froze
    the base weights), and the PeftModel carries the engine's state — it saves PEFT's adapter directory
    collectively and hands the state back on ``merge_and_unload``. The factors keep PEFT's values, which depend on
    the layout; :func:`hf_hybrid_ep.model_io.adapters.init_adapters_` draws fresh ones that do not. Collective.

    Raises:
        HybridEPConfigError: as :func:`parallelize` does for adapters the engine cannot train.
    """
    base = peft_model.get_base_model()
    state = state_of(base)
    if carries_state(peft_model):
        raise HybridEPConfigError(f"{type(peft_model).__name__} is already parallelized")
    found = find_experts_modules(peft_model)
    adapters = _check_adapters(model=peft_model, config=state.config, found=found)
    peft_name = {unwrapped_name(name): name for name, _ in found}
    for layer in state.layers:
        layer.name = peft_name[unwrapped_name(layer.name)]
        layer.layer_names = {i: peft_name.get(unwrapped_name(n), n) for i, n in layer.layer_names.items()}
        if layer.name in adapters:
            attach_expert_adapters(layer, adapters[layer.name], over_slots=True)
    reducer = _apply_gradient_reduction(model=peft_model, config=state.config, layers=state.layers, mesh=state.mesh)
    taken_over = dataclasses.replace(state, reducer=reducer, backward=BackwardSequence(reducer, state.agreement,
                                                                                      state.shadows))
    attach(base, taken_over, replace=True)  # its hooks run every forward of the PeftModel
    attach(peft_model, taken_over)
    wrap_adapter_methods(peft_model, _unloaded)
    return peft_model


def _apply_layout(*, model: nn.Module, config: HybridEPConfig, found: list[tuple[str, nn.Module]],
                  ) -> tuple[HybridMesh, list[PlacementTable], str, str]:
    """Resolve dp × ep for this world, build the mesh and one placement table per experts module, and choose
    the dispatcher backend (once for the model: its name and the choice said with its reason, for the start-up
    summary).

    One layout for all layers: resolved against the gcd of the layers' expert counts."""
    dp, ep = config.resolve(world_size(), math.gcd(*(m.num_experts for _, m in found)))
    resolve_backend(config.dispatcher, default_device_type())
    # a per-layer placement names the experts modules as the model PEFT wrapped does (as `place` writes them)
    tables = layer_tables(config.placement, [(unwrapped_name(name), m.num_experts) for name, m in found], ep)
    timeout = watchdog.timeout_of(config.collective_timeout_s) or world_timeout()
    mesh = build_mesh(dp, ep, topology=config.topology, timeout=timeout)
    watchdog.start(timeout.total_seconds())
    routers = [find_router(model, name, m.num_experts) for name, m in found]
    top_k = max((int(r[1].top_k) for r in routers if r is not None), default=1)
    backend, why = choose_backend(config.dispatcher, mesh, top_k, max(t.slots_per_rank for t in tables),
                                  *_row_width(found[0][1]))
    return mesh, tables, backend, f"{config.dispatcher!r} -> {backend} ({why})"


def _row_width(experts: nn.Module) -> tuple[int, int]:
    """The hidden size and element bytes of the rows an experts module exchanges (its down projection's output
    width and dtype)."""
    down = experts.down_proj
    return (down.shape[2] if ExpertsFormat.of(experts).is_transposed else down.shape[1]), down.element_size()


def _apply_device(*, model: nn.Module, mesh: HybridMesh) -> torch.device:
    """This rank's device (``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo), made current; parameters already
    on another accelerator are refused on every rank, naming their device, the current one and the mesh's."""
    device = rank_device(mesh.device_type)
    current = current_cuda_device() if device.type == "cuda" else None
    use_device(device)  # first: the agreement below is a collective on this device
    agree_on_failure(mesh, check_devices, model, device, current)
    return device


def _count_slots(*, config: HybridEPConfig, found: list[tuple[str, nn.Module]], tables: list[PlacementTable],
                 ep: int) -> int:
    """Slots per EP rank in every counts message, equal for every layer so that ranks in different layers still
    exchange equal sizes (wide enough for the tables online rebalancing may fit later)."""
    slots = max(t.slots_per_rank for t in tables)
    if config.rebalancing:
        for name, module in found:
            if (module.num_experts + config.rebalance_replicas) % ep:
                raise HybridEPConfigError(
                    f"rebalancing: {name} has {module.num_experts} experts + rebalance_replicas="
                    f"{config.rebalance_replicas}, not a multiple of ep_degree={ep} (every rank holds as many slots)")
            slots = max(slots, (module.num_experts + config.rebalance_replicas) // ep)
    return slots


def _apply_expert_sharding(*, model: nn.Module, config: HybridEPConfig, found: list[tuple[str, nn.Module]],
                           tables: list[PlacementTable], mesh: HybridMesh, backend: str,
                           adapters: dict[str, dict[str, nn.Module]] | None = None,
                           ) -> tuple[list[ShardedExperts], InputAgreement]:
    """Replace every experts module's forward by an :class:`ShardedExperts` holding this rank's
    experts only (and their LoRA adapters' factors, from ``adapters``), exchanging through ``backend``; all
    layers share one cross-rank input agreement."""
    count_slots = _count_slots(config=config, found=found, tables=tables, ep=mesh.ep_degree)
    options = dataclasses.replace(EPLayerOptions.from_config(config, count_slots), dispatcher=backend)
    names = {i: name for i, (name, _) in enumerate(found)}
    agreement = InputAgreement(mesh, names)
    layers = []
    for i, ((name, module), table) in enumerate(zip(found, tables, strict=True)):
        shared = find_shared_expert(model, name) if config.overlap_shared_expert else None
        layer = ShardedExperts(name, module, table, mesh, options, layer_id=i, layer_names=names,
                                    agreement=agreement,
                                    shared_overlap=None if shared is None else SharedExpertOverlap(*shared))
        layer.shard_()
        if adapters and name in adapters:
            attach_expert_adapters(layer, adapters[name])
        layers.append(layer)
    return layers, agreement


def _apply_router_controls(*, model: nn.Module, config: HybridEPConfig, layers: list[ShardedExperts],
                           mesh: HybridMesh) -> None:
    """Router temperature, bias updates, device-load factors; load accounting; aux and z losses (the model's own
    too, over the global batch, with ``aux_loss_scope="global"``)."""
    install_router_controls(model, layers, config)
    attach_load_accounting(model, layers, bool(config.coactivation_stats))
    model_aux = _model_aux_loss(model, layers) if config.aux_loss_scope == "global" else None
    if config.aux_loss_coef or config.z_loss_coef or model_aux is not None:
        group = mesh.world_group if config.aux_loss_scope == "global" else None
        add_aux_losses(model, layers, config, model_aux, group, mesh.world_size)


def _model_aux_loss(model: nn.Module, layers: list[ShardedExperts]) -> ModelAuxLoss | None:
    """The model's own load-balancing loss, for a model whose config can ask for it (``output_router_logits``)."""
    base = model.get_base_model() if is_peft_model(model) else model
    config = getattr(base, "config", None)
    text = config.get_text_config() if config is not None else None
    if text is None or not hasattr(text, "output_router_logits") or not layers:
        return None
    top_k = getattr(text, "num_experts_per_tok", None) or max(layer.load.top_k for layer in layers)
    coef = lambda: getattr(base, "router_aux_loss_coef", getattr(text, "router_aux_loss_coef", 0.0))  # noqa: E731
    return ModelAuxLoss(layers[0].num_experts, int(top_k), coef)


def _apply_gradient_reduction(*, model: nn.Module, config: HybridEPConfig, layers: list[ShardedExperts],
                              mesh: HybridMesh) -> GradientReducer:
    """The reducer: dense gradients over the world, each expert's over the ranks holding it."""
    expert_ids = {id(p) for layer in layers for p in layer.slot_parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    holder_sets, holdings = expert_holdings(layers, mesh)
    reduce_dense = config.reduce_dense_gradients and config.dense_sharding != "fsdp"  # FSDP reduce-scatters them
    return GradientReducer(mesh, list(model.parameters()), dense, holdings, holder_sets, reduce_dense=reduce_dense,
                           bucket_bytes=int(config.bucket_size_mb * 2**20), overlap=config.overlap_grad_reduce)


def _apply_hooks(*, model: nn.Module) -> None:
    """Gradient buffers before a differentiated forward, the input agreement after one under ``no_grad``;
    ZeRO-1 waits before a state dict is read."""
    model.register_forward_pre_hook(before_forward)
    model.register_forward_hook(after_forward)
    model.register_state_dict_pre_hook(lambda module, *args, **kwargs: wait_for_parameters(module))


def _fully_shard_dense(model: nn.Module, layers: list[ShardedExperts], mesh: HybridMesh) -> None:
    """FSDP2-shard the dense weights over the world: ``fully_shard`` on every decoder layer (the classes
    in the model's ``_no_split_modules``) and on the root, with the expert parameters ignored (the
    engine shards and reduces them)."""
    if mesh.world_group is None:
        return
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    world_mesh = DeviceMesh.from_group(mesh.world_group, mesh.device_type)
    experts = {p for layer in layers for p in layer.slot_parameters()}
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=world_mesh, ignored_params=experts & set(module.parameters()))
    fully_shard(model, mesh=world_mesh, ignored_params=experts)


