"""Offloaded inference: a bounded set of resident experts per layer (:mod:`.policies`), the rest in a
store (:mod:`.stores`).

Policies: ``lru``; ``lfu`` (fewest uses, ties by recency); ``pinned-lru`` (the experts with the
highest decayed running use count are pinned, the rest are LRU); ``belady`` (offline: evicts the
expert whose next use is farthest away; needs the future trace, for replay only).

``offload(model, capacity, policy, store=...)`` keeps every expert in a backing store and only
``capacity`` experts per layer resident in the module's parameters; a forward loads the experts its
tokens need (evicting by the policy) and computes in waves of at most ``capacity`` experts. Stores:
:class:`MemoryStore` (CPU memory) and :class:`SafetensorsStore` (the expert files of a checkpoint,
memory-mapped with ``safe_open``: the slow tier of a CPU-only host). On CUDA every load goes through a
few pinned staging buffers to a side stream (:class:`ExpertTransfers`). With ``prefetch=True`` each layer
applies the next layer's router to its own input hidden states and loads the predicted experts of the
next layer ahead of use; the prediction's recall is in :func:`cache_stats`. Deciding which experts to load
reads their counts to the host once per layer and forward (with the next layer's predicted counts when
prefetching); nothing else waits for the device.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..engine import is_parallelized
from ..errors import HybridEPConfigError
from ..moe.discovery import expert_parameter_names, find_experts_modules
from ..moe.router_rules import find_router
from ..parallel.devices import place_module
from .policies import ExpertCache
from .stores import MemoryStore, SafetensorsStore, make_store

STAGING_BUFFERS = 4  # pinned host buffers of one expert each, shared by every layer of an offloaded model
_ALIGN = 64  # bytes: each tensor of an expert starts at this alignment in its staging buffer


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (a CUDA copy from it runs asynchronously)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_ATTRIBUTE = "_hybrid_ep_offload"


def attach_offload(model: nn.Module, layers: list[OffloadedExperts]) -> None:
    """Attach the offloaded expert layers of :func:`offload` to ``model``."""
    setattr(model, _ATTRIBUTE, layers)


def offload_state_of(model: nn.Module) -> list[OffloadedExperts]:
    """The offloaded expert layers :func:`offload` attached to ``model``.

    Raises:
        HybridEPConfigError: for a model that was not offloaded.
    """
    layers = getattr(model, _ATTRIBUTE, None)
    if layers is None:
        raise HybridEPConfigError(f"{type(model).__name__} was not prepared with hf_hybrid_ep.offload")
    return layers


class ExpertTransfers:
    """Copies experts from a store into resident slots, for every layer of one offloaded model.

    On the CPU a load is a plain copy. On CUDA each expert is first copied on the host into one of a ring of
    :data:`STAGING_BUFFERS` pinned buffers (from the store's pageable or memory-mapped memory), then to the
    device asynchronously on a side stream. A buffer is refilled only after its previous transfer completed:
    the host waits on that transfer's event, which has usually long finished, when the ring comes round to
    it. So the pinned memory is a few experts, whatever the store holds, and the host never waits for the
    compute stream. The compute stream waits for the side stream only when it uses the slots (:meth:`wait`).

    Args:
        expert_bytes: the largest expert of the model (its tensors, each aligned to 64 bytes).
    """

    def __init__(self, device: torch.device, expert_bytes: int, buffers: int = STAGING_BUFFERS) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.expert_bytes = expert_bytes
        self.buffers: list[torch.Tensor] = []
        self.events: list = [None] * buffers
        self.turn = 0

    def load(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one expert: ``(slot row on the device, the store's row)`` per parameter."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        staged, turn = self._stage(pairs)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the slots' last readers are done
        with torch.cuda.stream(self.stream):
            for dst, src in staged:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[turn] = event

    def _stage(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """Host copies of one expert into the next staging buffer, once that buffer's last transfer is done."""
        turn = self.turn
        self.turn = (turn + 1) % len(self.events)
        if self.events[turn] is not None:
            self.events[turn].synchronize()
        if turn == len(self.buffers):
            self.buffers.append(pinned_buffer(self.expert_bytes))
        buffer, offset, staged = self.buffers[turn], 0, []
        for dst, src in pairs:
            nbytes = src.numel() * src.element_size()
            view = buffer[offset : offset + nbytes].view(src.dtype).view(src.shape)
            view.copy_(src)
            staged.append((dst, view))
            offset += _aligned(nbytes)
        return staged, turn

    def wait(self) -> None:
        """Make the compute stream wait for every load issued so far (no host synchronisation)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class OffloadedExperts:
    """One experts module whose experts live in a store, with ``capacity`` resident slots."""

    def __init__(self, name: str, module: nn.Module, capacity: int, policy: str, device: torch.device,
                 store) -> None:
        self.name, self.module, self.device, self.store = name, module, device, store
        self.transfers: ExpertTransfers | None = None  # the model's, set by offload()
        self.num_experts = module.num_experts
        if capacity > self.num_experts:
            capacity = self.num_experts
        self.param_names = expert_parameter_names(name, module)
        expert_bytes = sum(getattr(module, p)[0].numel() * getattr(module, p).element_size() for p in self.param_names)
        self.cache = ExpertCache(capacity, policy, expert_bytes)
        self.next: OffloadedExperts | None = None  # the following layer, when prefetching
        self.router: nn.Module | None = None  # this layer's router (used by the previous layer's prefetch)
        self.prediction: set[int] | None = None

    def install(self) -> None:
        for p in self.param_names:
            full = getattr(self.module, p)
            if full.is_meta:  # built without expert memory (load_offloaded): the slots start empty
                slots = torch.zeros((self.cache.capacity, *full.shape[1:]), dtype=full.dtype, device=self.device)
            else:
                slots = full.detach()[: self.cache.capacity].to(self.device).clone()
            setattr(self.module, p, nn.Parameter(slots, requires_grad=False))
        self.module.num_experts = self.cache.capacity
        self._forward = type(self.module).forward
        self.module.forward = self.forward

    def staging_bytes(self) -> int:
        """Bytes of one expert in a staging buffer (each tensor aligned)."""
        return sum(_aligned(getattr(self.module, p)[0].numel() * getattr(self.module, p).element_size())
                   for p in self.param_names)

    @torch.no_grad()
    def _load(self, loads: list[tuple[int, int]]) -> None:
        for expert, slot in loads:
            rows = self.store.expert(self.name, expert)
            self.transfers.load([(getattr(self.module, p)[slot], value) for p, value in rows.items()])

    def _routed_counts(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """``[E]`` pairs routed to each expert (ids < 0 are dropped pairs), on their device: no synchronisation."""
        ids = top_k_index.reshape(-1).long()
        counts = torch.zeros(self.num_experts + 1, dtype=torch.long, device=ids.device)
        counts.scatter_add_(0, torch.where(ids >= 0, ids, self.num_experts), torch.ones_like(ids))
        return counts[: self.num_experts]

    def predicted_counts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[E]`` pairs this layer's router sends to each expert for ``hidden_states`` (the previous layer's
        experts input), on their device: the prediction of its experts."""
        return self._routed_counts(self.router(hidden_states)[2])

    @torch.no_grad()
    def resize(self, capacity: int) -> None:
        """Change the resident slots at run time (evicting by the policy); resident experts keep their data."""
        capacity = min(capacity, self.num_experts)
        self.transfers.wait()
        moves = self.cache.resize(capacity)
        for p in self.param_names:
            old = getattr(self.module, p)
            new = old.new_zeros((capacity, *old.shape[1:]))
            for src, dst in moves.items():
                new[dst] = old[src]
            setattr(self.module, p, nn.Parameter(new, requires_grad=False))
        self.module.num_experts = capacity

    def resident_bytes(self) -> int:
        return sum(getattr(self.module, p).numel() * getattr(self.module, p).element_size() for p in self.param_names)

    @torch.no_grad()
    def prefetch(self, counts: list[int]) -> None:
        """Load up to ``capacity`` of the experts :meth:`predicted_counts` predicts (``counts``, read to the host),
        the most-routed first."""
        ranked = sorted(range(self.num_experts), key=lambda e: -counts[e])[: self.cache.capacity]  # stable
        predicted = [e for e in ranked if counts[e] > 0]
        self.prediction = set(predicted)
        self.cache.stats.predicted += len(predicted)
        self._load(self.cache.prefetch(predicted))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        capacity = self.cache.capacity
        counts = self._routed_counts(top_k_index)
        if self.next is not None:  # its prediction travels to the host with this layer's counts: one read
            counts = torch.cat([counts, self.next.predicted_counts(hidden_states)])
        counts = counts.tolist()
        needed = [e for e, n in enumerate(counts[: self.num_experts]) if n]
        if self.prediction is not None:
            stats = self.cache.stats
            stats.used += len(needed)
            stats.predicted_used += len(self.prediction.intersection(needed))
            self.prediction = None
        if self.next is not None:  # the next layer's loads overlap this layer's compute on CUDA
            self.next.prefetch(counts[self.num_experts :])
        out = None
        self.module._is_expert_parallel = True  # ids >= num_experts are skipped by transformers' kernels
        try:
            for start in range(0, max(1, len(needed)), capacity):
                wave = needed[start : start + capacity]
                self._load(self.cache.request(wave))
                self.transfers.wait()
                slots = [capacity] * (self.num_experts + 1)  # the last entry: dropped pairs (-1)
                for e in wave:
                    slots[e] = self.cache.resident[e]
                slot_of = torch.tensor(slots).to(top_k_index.device, non_blocking=True)
                index = slot_of[top_k_index.clamp(-1, self.num_experts - 1)]  # -1 -> sentinel
                weights = torch.where(index < capacity, top_k_weights, torch.zeros_like(top_k_weights))
                part = self._forward(self.module, hidden_states, index, weights)
                out = part if out is None else out + part
        finally:
            self.module._is_expert_parallel = False
        return out


def offload(model: nn.Module, capacity: int, policy: str = "lru", device: str | torch.device | None = None,
            store=None, prefetch: bool = False) -> nn.Module:
    """Keep every expert in a backing store and only ``capacity`` experts per layer resident on ``device``.

    Args:
        store: ``"memory"`` (default: CPU memory), a checkpoint directory or a
            :class:`SafetensorsStore` (experts read on demand, memory-mapped), or a :class:`MemoryStore`.
        prefetch: each layer predicts the next layer's experts with the next layer's router applied to
            its own input hidden states, and loads them ahead of use.

    In place; returns the model. Logits equal the fully resident model's (bit-equal when a step's
    experts fit in one wave). ``cache_stats(model)`` reports hits, misses, evictions, bytes loaded and
    the prefetch recall.
    """
    found = find_experts_modules(model)
    if not found:
        raise HybridEPConfigError(f"{type(model).__name__} has no fused experts module to offload")
    if is_parallelized(model):
        raise HybridEPConfigError("offload is for a model that was not parallelized (inference on one device)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "meta":
        raise HybridEPConfigError("offload needs a compute device for a model built on the meta device (device=...)")
    store = make_store(store)
    if isinstance(store, MemoryStore) and any(p.is_meta for _, m in found for p in m.parameters(recurse=False)):
        raise HybridEPConfigError("the model's experts are on the meta device: give a checkpoint store (store=path)")
    store.bind(model, [(name, m, expert_parameter_names(name, m)) for name, m in found])
    layers = [OffloadedExperts(name, m, capacity, policy, device, store) for name, m in found]
    if prefetch:
        for layer, following in zip(layers[:-1], layers[1:], strict=True):
            router = find_router(model, following.name, following.num_experts)
            if router is None:
                raise HybridEPConfigError(f"prefetch needs the router of {following.name}; none was found")
            layer.next, following.router = following, router[1]
    transfers = ExpertTransfers(device, max(layer.staging_bytes() for layer in layers))
    for layer in layers:
        layer.transfers = transfers
        layer.install()
    place_module(model, device)  # the rest of the model (dense weights, buffers) runs there too
    attach_offload(model, layers)
    return model


def load_offloaded(path: str | os.PathLike[str], capacity: int, policy: str = "lru", *,
                   device: str | torch.device = "cpu", prefetch: bool = False, verify: bool = True,
                   trust_remote_code: bool = False) -> nn.Module:
    """Build a model from a local checkpoint for inference with only ``capacity`` experts per layer ever
    in memory: the model is created on the meta device, the dense tensors are read, and the experts stay
    in the checkpoint's files (a :class:`SafetensorsStore`). Returns the model in eval mode.

    Every file is checked against the index's manifest when first opened (sha256 unless
    ``verify=False``); no code from the checkpoint runs unless ``trust_remote_code=True``."""
    from ..checkpoint.reader import CheckpointReader
    from ..model_io.rank_local import fill_tensors_, tensor_recipes
    from ..moe.architecture import build_meta_model, read_config

    root = Path(path)
    if not root.is_dir():
        raise HybridEPConfigError(f"checkpoint directory {str(root)!r} does not exist")
    store = SafetensorsStore(root, verify=verify)
    model = build_meta_model(read_config(root, trust_remote_code), trust_remote_code)
    offload(model, capacity, policy, device=device, store=store, prefetch=prefetch)
    experts = {f"{layer.name}.{p}" for layer in offload_state_of(model) for p in layer.param_names}
    reader = CheckpointReader(root, store.weight_map, verifier=store.verifier)
    model.requires_grad_(False)  # inference: the parameters filled in get no gradient
    fill_tensors_(model, tensor_recipes(model, [], store.weight_map), reader, skip=experts, device=device,
                  keep_model_dtypes=True)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise HybridEPConfigError(f"checkpoint {str(root)!r} lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
    place_module(model, torch.device(device))  # buffers (rotary frequencies, correction biases) were built on the CPU
    return model.eval()


def resize_offload(model: nn.Module, capacity: int) -> None:
    """Change every offloaded layer's resident capacity (e.g. to follow a memory budget)."""
    for layer in offload_state_of(model):
        layer.resize(capacity)


def cache_stats(model: nn.Module) -> dict[str, dict]:
    """Per-layer cache counters of an offloaded model (plus resident experts and bytes)."""
    return {
        layer.name: {**asdict(layer.cache.stats), "hit_rate": layer.cache.stats.hit_rate,
                     "prefetch_recall": layer.cache.stats.prefetch_recall,
                     "prefetch_precision": layer.cache.stats.prefetch_precision,
                     "resident_experts": len(layer.cache.resident), "capacity": layer.cache.capacity,
                     "resident_bytes": layer.resident_bytes()}
        for layer in offload_state_of(model)
    }
