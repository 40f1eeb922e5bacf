"""``parallelize(model, config)``: turn a transformers MoE model into its hybrid-EP form, in place.

The only module that knows the whole training engine: each ``_apply_*`` step wires one part (layout,
expert sharding, router controls, gradient reduction, hooks, shadowing). docs/architecture.md has the
layers and a token's path through them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .config import HybridEPConfig
from .dispatch import PlacementTable, choose_backend, resolve_backend
from .dispatch.table import layer_tables
from .errors import HybridEPConfigError
from .moe.discovery import check_shardable, find_shared_expert
from .moe.layer import EPLayerOptions, ShardedExperts, SharedExpertOverlap
from .moe.rebalance import Rebalancer
from .moe.routing import add_aux_losses_hook, install_router_controls, on_optimizer_step
from .moe.shadow import ShadowManager
from .parallel.agreement import InputAgreement
from .parallel.devices import check_devices, current_cuda_device, place_module, rank_device, use_device
from .parallel.grads import GradientReducer, expert_homes
from .parallel.heartbeat import Heartbeat
from .parallel.mesh import (
    HybridMesh,
    build_mesh,
    current_device,
    default_device_type,
    is_dtensor,
    local_tensor,
    world_size,
)
from .parallel.zero import wait_for_parameters
from .state import HybridEPState, attach, is_parallelized, state_of

logger = logging.getLogger("hf_hybrid_ep")


def _check_same_everywhere(model: nn.Module, tables: list[PlacementTable], mesh: HybridMesh) -> None:
    """Refuse models or tables that differ between ranks (different seeds, different checkpoints)."""
    if mesh.world_group is None:
        return
    with torch.no_grad():
        sums = [p.detach().sum(dtype=torch.float64).item() for p in model.parameters()]
    mine = ([t.fingerprint() for t in tables], sums)
    gathered: list = [None] * mesh.world_size
    dist.all_gather_object(gathered, mine)
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


def _agree(mesh: HybridMesh, fn: Callable[..., None], *args) -> None:
    """Run ``fn(*args)``; if it raises on any rank, raise on every rank (nobody enters a collective alone)."""
    error: BaseException | None = None
    try:
        fn(*args)
    except Exception as err:  # re-raised below, after the ranks agree
        error = err
    if mesh.world_group is not None:
        flags = torch.zeros(mesh.world_size, dtype=torch.int32, device=current_device(mesh))
        flags[mesh.rank] = int(error is not None)
        dist.all_reduce(flags, group=mesh.world_group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if failed and error is None:
            raise RuntimeError(f"hybrid-EP setup failed on rank(s) {failed}; see their errors")
    if error is not None:
        raise error


def parallelize(
    model: nn.Module,
    config: HybridEPConfig | None = None,
    *,
    materialize: Callable[[nn.Module, list[ShardedExperts]], None] | None = None,
) -> nn.Module:
    """Shard the routed experts of a transformers MoE model over EP groups and return the same model.

    The model must be built identically on every rank (same config and seed, or the same checkpoint)
    and ``torch.distributed`` initialised (or a world of one). The model moves to this rank's device
    (``cuda:LOCAL_RANK`` under NCCL, which becomes the current CUDA device; the CPU under gloo) after its
    experts are sharded, so build it on the CPU. In place: dense weights stay replicated;
    each fused experts module keeps only this rank's experts and runs through the all-to-all dispatcher;
    gradient hooks give every gradient the single-process value after ``loss.backward()``. Create the
    optimizer afterwards. Collective: call on every rank.

    Raises:
        HybridEPConfigError: before any work, for a layout that cannot work (naming the values), a model
            with no routed experts, an experts module that cannot be sharded, or parameters already on
            another GPU than this rank's (naming it, the current device and the mesh's).
    """
    if is_parallelized(model):
        raise HybridEPConfigError(f"{type(model).__name__} is already parallelized")
    config = config or HybridEPConfig()
    found = check_shardable(model)
    mesh, tables = _apply_layout(config=config, found=found)
    device = _apply_device(model=model, mesh=mesh)
    if not any(p.is_meta for p in model.parameters()):
        _check_same_everywhere(model, tables, mesh)
    layers, agreement = _apply_expert_sharding(model=model, config=config, found=found, tables=tables, mesh=mesh)
    if materialize is not None:
        _agree(mesh, materialize, model, layers)
    place_module(model, device)  # after sharding: only this rank's experts reach the device
    _apply_router_controls(model=model, config=config, layers=layers)
    if config.dense_sharding == "fsdp":
        _fully_shard_dense(model, layers, mesh)
    reducer = _apply_gradient_reduction(model=model, config=config, layers=layers, mesh=mesh)
    state = HybridEPState(config, mesh, layers, reducer, agreement=agreement)
    attach(model, state)
    _apply_hooks(model=model, state=state)
    if config.shadow_experts:
        state.shadows = _apply_shadowing(config=config, layers=layers, mesh=mesh, reducer=reducer)
    if config.rebalancing:
        state.rebalancer = Rebalancer(model)
    _wrap_save_pretrained(model)
    _wrap_generate(model)
    return model


def _apply_layout(*, config: HybridEPConfig, found: list[tuple[str, nn.Module]]) -> tuple[HybridMesh, list[PlacementTable]]:
    """Resolve dp × ep for this world, build the mesh and one placement table per experts module.

    One layout for all layers: resolved against the gcd of the layers' expert counts."""
    dp, ep = config.resolve(world_size(), math.gcd(*(m.num_experts for _, m in found)))
    resolve_backend(config.dispatcher, default_device_type())
    tables = layer_tables(config.placement, [(name, m.num_experts) for name, m in found], ep)
    mesh = build_mesh(dp, ep, topology=config.topology)
    backend, why = choose_backend(config.dispatcher, mesh)
    if mesh.rank == 0:
        logger.info("dispatcher %r -> %s (%s)", config.dispatcher, backend, why)
    return mesh, tables


def _apply_device(*, model: nn.Module, mesh: HybridMesh) -> torch.device:
    """This rank's device (``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo), made current; parameters already
    on another accelerator are refused on every rank, naming their device, the current one and the mesh's."""
    device = rank_device(mesh.device_type)
    current = current_cuda_device() if device.type == "cuda" else None
    use_device(device)  # first: the agreement below is a collective on this device
    _agree(mesh, check_devices, model, device, current)
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
                           tables: list[PlacementTable], mesh: HybridMesh,
                           ) -> tuple[list[ShardedExperts], InputAgreement]:
    """Replace every experts module's forward by an :class:`ShardedExperts` holding this rank's
    experts only; all layers share one cross-rank input agreement."""
    options = EPLayerOptions.from_config(config, _count_slots(config=config, found=found, tables=tables,
                                                              ep=mesh.ep_degree))
    names = {i: name for i, (name, _) in enumerate(found)}
    agreement = InputAgreement(mesh, names)
    layers = []
    for i, ((name, module), table) in enumerate(zip(found, tables, strict=True)):
        shared = find_shared_expert(model, name) if config.overlap_shared_expert else None
        layer = ShardedExperts(name, module, table, mesh, options, layer_id=i, layer_names=names,
                                    agreement=agreement,
                                    shared_overlap=None if shared is None else SharedExpertOverlap(*shared))
        layer.shard_()
        layers.append(layer)
    return layers, agreement


def _apply_router_controls(*, model: nn.Module, config: HybridEPConfig, layers: list[ShardedExperts]) -> None:
    """Router temperature, bias updates, device-load factors, load accounting; aux and z losses."""
    install_router_controls(model, layers, config)
    if config.aux_loss_coef or config.z_loss_coef:
        add_aux_losses_hook(model, layers)


def _apply_gradient_reduction(*, model: nn.Module, config: HybridEPConfig, layers: list[ShardedExperts],
                              mesh: HybridMesh) -> GradientReducer:
    """The reducer: dense gradients over the world, each expert's over the ranks holding it."""
    expert_ids = {id(p) for layer in layers for p in layer.expert_parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    homes, holder_groups, norm_weights = expert_homes(layers, mesh)
    reduce_dense = config.reduce_dense_gradients and config.dense_sharding != "fsdp"  # FSDP reduce-scatters them
    return GradientReducer(mesh, list(model.parameters()), dense, homes, holder_groups, norm_weights,
                           reduce_dense=reduce_dense, bucket_bytes=int(config.bucket_size_mb * 2**20),
                           overlap=config.overlap_grad_reduce)


def _apply_hooks(*, model: nn.Module, state: HybridEPState) -> None:
    """Input agreement around backward; gradient buffers before a forward; ZeRO-1 waits before reads."""
    state.reducer.on_backward_start.append(state.agreement.launch)  # before the first gradient bucket
    state.reducer.on_backward_end.append(state.agreement.finish)
    model.register_forward_pre_hook(_before_forward)
    model.register_forward_hook(_after_forward)
    model.register_state_dict_pre_hook(lambda module, *args, **kwargs: wait_for_parameters(module))


def _apply_shadowing(*, config: HybridEPConfig, layers: list[ShardedExperts], mesh: HybridMesh,
                     reducer: GradientReducer) -> ShadowManager:
    """Hot-expert shadowing: shadows' gradients go home before the expert buckets are reduced."""
    shadows = ShadowManager(layers, mesh, config.shadow_capacity)
    reducer.pre_reduce_hooks.append(shadows.return_gradients)
    reducer.hold_expert_buckets = shadows.returns_pending
    return shadows


def _before_forward(model: nn.Module, args) -> None:
    """Attach the gradient buffers before a forward that will be differentiated."""
    if torch.is_grad_enabled():
        state_of(model).reducer.attach_grads()


def _after_forward(model: nn.Module, args, output) -> None:
    """Under ``no_grad`` (evaluation, ``generate``) no backward follows: the ranks agree on the forward's
    inputs here (:mod:`hf_hybrid_ep.parallel.agreement`). A world of one has nobody to agree with: at once."""
    state = state_of(model)
    if not torch.is_grad_enabled() or state.mesh.world_group is None:
        state.agreement.agree_now()


def _fully_shard_dense(model: nn.Module, layers: list[ShardedExperts], mesh: HybridMesh) -> None:
    """FSDP2-shard the dense weights over the world: ``fully_shard`` on every decoder layer (the classes
    in the model's ``_no_split_modules``) and on the root, with the expert parameters ignored (the
    engine shards and reduces them)."""
    if mesh.world_group is None:
        return
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    world_mesh = DeviceMesh.from_group(mesh.world_group, mesh.device_type)
    experts = {p for layer in layers for p in layer.expert_parameters()}
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=world_mesh, ignored_params=experts & set(module.parameters()))
    fully_shard(model, mesh=world_mesh, ignored_params=experts)


def _wrap_generate(model: nn.Module) -> None:
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


def after_optimizer_step(model: nn.Module, optimizer=None) -> None:
    """Call once after every optimizer step (the Trainer integration does): reduces the step's expert
    loads over the world, applies aux-loss-free bias updates and device-load estimates, and feeds the
    load metrics; with online rebalancing on (``rebalance_every`` / ``rebalance_when_imbalance_over``),
    moves experts and their state of ``optimizer`` (default: the one :func:`hf_hybrid_ep.make_optimizer`
    built) when a rebalance is due; with ``shadow_experts`` on, decides the next step's shadows from this
    step's routing counts and fetches their fresh weights (so call it after ``optimizer.step()``).
    Collective: call on every rank."""
    state = state_of(model)
    state.optimizer_steps += 1
    counts = None
    if state.shadows is not None:
        wait_for_parameters(model)  # the shadows' weights are read from the updated parameters
        counts = state.shadows.step_counts()  # before on_optimizer_step resets the step's counters
    on_optimizer_step(model, state.config, state.layers, state.mesh, state.optimizer_steps, state.rebalancer)
    if state.rebalancer is not None:
        state.rebalancer.after_step(state.optimizer_steps, optimizer)
    if state.shadows is not None:
        state.shadows.refresh(counts)


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


def _expert_layers(model: nn.Module) -> dict[str, ShardedExperts]:
    """State-dict key of every expert parameter → its EP layer."""
    return {f"{layer.name}.{p}": layer for layer in state_of(model).layers for p in layer.param_names}


def gather_scratch(model: nn.Module) -> torch.Tensor:
    """A device buffer (uint8) that holds every EP rank's slots of the largest expert parameter: one
    gathered parameter at a time passes through it on its way to host memory."""
    layers = _expert_layers(model)
    params = [getattr(layer.module, name.rpartition(".")[2]) for name, layer in layers.items()]
    nbytes = max((layer.gathered_bytes(p) for p, layer in zip(params, layers.values(), strict=True)), default=0)
    return torch.empty(nbytes, dtype=torch.uint8, device=params[0].device if params else None)


@torch.no_grad()
def host_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], rank0_only: bool,
                 scratch: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """State-dict entries ``tensors`` of the unsharded model (every expert, global ids) in host memory, one
    tensor at a time: beyond the model the device holds one :func:`gather_scratch` buffer (``scratch``, or
    one made for the call).

    With ``rank0_only`` only rank 0 gets them (``{}`` elsewhere) and only rank 0's EP group gathers experts;
    otherwise every rank does. Collective: expert parameters over the EP group, FSDP2-sharded tensors over
    the world; call on every rank with the same keys.
    """
    mesh = state_of(model).mesh
    keep = mesh.rank == 0 or not rank0_only
    gathers = mesh.edp_rank == 0 or not rank0_only
    experts = _expert_layers(model)
    if gathers and scratch is None and any(name in experts for name in tensors):
        scratch = gather_scratch(model)
    out = {}
    for name, t in tensors.items():
        if name in experts:
            if gathers:
                full = experts[name].gather_to_host(t, keep, scratch)
                if keep:
                    out[name] = full
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


def _wrap_save_pretrained(model: nn.Module) -> None:
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


GRADIENT_REDUCTION = "gradient_reduction"  # the reducer's entry of comm_stats; the others are MoE layers


def comm_stats(model: nn.Module) -> dict[str, dict]:
    """Per-layer dispatcher counters and the reducer's all-reduced bytes under ``"gradient_reduction"``
    (this rank, since last reset)."""
    state = state_of(model)
    out: dict[str, dict] = {layer.name: layer.stats.as_dict() for layer in state.layers}
    r = state.reducer.stats
    out[GRADIENT_REDUCTION] = {"reductions": r.reductions, "dense_bytes": r.dense_bytes, "expert_bytes": r.expert_bytes,
                                 "buckets_launched_in_backward": r.buckets_launched_in_backward,
                                 "buckets_launched_at_end": r.buckets_launched_at_end,
                                 "ready_to_end_s": r.ready_to_end_s}
    return out


def layer_counters(stats: dict[str, dict]) -> list[dict]:
    """The per-MoE-layer dispatcher counters of a :func:`comm_stats` result, in layer order."""
    return [v for k, v in stats.items() if k != GRADIENT_REDUCTION]


def reset_comm_stats(model: nn.Module) -> None:
    state = state_of(model)
    for layer in state.layers:
        layer.stats.reset()
    state.reducer.stats.reset()
