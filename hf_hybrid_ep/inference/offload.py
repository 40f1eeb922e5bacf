"""ExpertCache: a bounded set of resident experts per layer, and offloaded inference built on it.

Policies: ``lru``; ``lfu`` (fewest uses, ties by recency); ``pinned-lru`` (the experts with the
highest decayed running use count are pinned, the rest are LRU); ``belady`` (offline: evicts the
expert whose next use is farthest away; needs the future trace, for replay only).

``offload(model, capacity, policy, store=...)`` keeps every expert in a backing store and only
``capacity`` experts per layer resident in the module's parameters; a forward loads the experts its
tokens need (evicting by the policy) and computes in waves of at most ``capacity`` experts. Stores:
:class:`MemoryStore` (CPU memory, pinned on CUDA hosts) and :class:`SafetensorsStore` (the expert
files of a checkpoint, memory-mapped with ``safe_open``: the slow tier of a CPU-only host). With
``prefetch=True`` each layer applies the next layer's router to its own input hidden states and loads
the predicted experts of the next layer ahead of use (on CUDA on a side stream from pinned memory;
untested on GPU); the prediction's recall is in :func:`cache_stats`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import HybridEPConfigError
from ..moe.discovery import expert_parameter_names, find_experts_modules
from ..moe.routing import find_router
from ..state import attach_offload, is_parallelized, offload_state_of

POLICIES = ("lru", "lfu", "pinned-lru", "belady")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_loaded: int = 0
    prefetched: int = 0  # experts loaded ahead of use by a prefetch (their bytes are in bytes_loaded)
    predicted_used: int = 0  # experts a layer used that the prefetch had predicted
    used: int = 0  # experts a layer used, over forwards that had a prediction
    predicted: int = 0  # experts predicted (at most ``capacity`` per forward)

    @property
    def prefetch_recall(self) -> float:
        """Share of the experts a layer used that the previous layer's prediction named."""
        return self.predicted_used / self.used if self.used else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.predicted_used / self.predicted if self.predicted else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache:
    """Which experts of one layer are resident, in which slot; decides evictions.

    Args:
        capacity: resident slots (experts).
        policy: one of :data:`POLICIES`.
        expert_bytes: bytes one expert occupies (for the byte counters and byte budgets).
        pin_fraction: share of the capacity pinned by ``pinned-lru``.
        decay: per-step decay of ``pinned-lru``'s running counts.
        future: for ``belady``, the whole access trace (one list of experts per step).
    """

    def __init__(self, capacity: int, policy: str = "lru", expert_bytes: int = 0, pin_fraction: float = 0.25,
                 decay: float = 0.9, future: Sequence[Sequence[int]] | None = None) -> None:
        if policy not in POLICIES:
            raise HybridEPConfigError(f"cache policy {policy!r} is not one of {list(POLICIES)}")
        if policy == "belady" and future is None:
            raise HybridEPConfigError("the belady policy needs the future trace (offline replay only)")
        self.policy, self.expert_bytes = policy, expert_bytes
        self.pin_fraction, self.decay = pin_fraction, decay
        self.future = [list(step) for step in future] if future is not None else None
        self.step = 0
        self.resident: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.uses: dict[int, float] = {}
        self.stats = CacheStats()
        self.capacity = 0
        self.resize(capacity)

    # ------------------------------------------------------------------ sizing
    def resize(self, capacity: int) -> dict[int, int]:
        """Change the number of slots, evicting by the policy to fit. Slots are compacted; returns
        ``{old slot: new slot}`` for the experts that stay (the caller moves their data)."""
        if capacity < 1:
            raise HybridEPConfigError(f"cache capacity {capacity} must be at least 1 expert")
        while len(self.resident) > capacity:
            self._evict(protect=set())
        self.capacity = capacity
        moves = {slot: new for new, slot in enumerate(self.resident.values())}
        self.resident = OrderedDict((e, new) for new, e in enumerate(self.resident))
        return moves

    def resize_bytes(self, budget: int) -> dict[int, int]:
        """Capacity that fits in ``budget`` bytes (at least one expert)."""
        if self.expert_bytes <= 0:
            raise HybridEPConfigError("resize_bytes needs expert_bytes")
        return self.resize(max(1, budget // self.expert_bytes))

    # ------------------------------------------------------------------ access
    def request(self, experts: Sequence[int]) -> list[tuple[int, int]]:
        """Make ``experts`` (at most ``capacity`` distinct ids, one step's working set) resident.

        Returns the ``(expert, slot)`` pairs that must be loaded (misses), in order.
        """
        wanted = list(dict.fromkeys(experts))
        if len(wanted) > self.capacity:
            raise HybridEPConfigError(f"{len(wanted)} experts requested at once, capacity is {self.capacity}")
        for e in wanted:
            self.uses[e] = self.uses.get(e, 0.0) + 1.0
        loads = []
        for e in wanted:
            if e in self.resident:
                self.stats.hits += 1
                self.resident.move_to_end(e)
                continue
            self.stats.misses += 1
            if len(self.resident) >= self.capacity:
                self._evict(protect=set(wanted))
            slot = self._free_slot()
            self.resident[e] = slot
            loads.append((e, slot))
            self.stats.bytes_loaded += self.expert_bytes
        self.step += 1
        if self.policy == "pinned-lru":
            for e in self.uses:
                self.uses[e] *= self.decay
        return loads

    def prefetch(self, experts: Sequence[int]) -> list[tuple[int, int]]:
        """Make up to ``capacity`` predicted experts resident ahead of use, without counting hits or
        misses (evicting by the policy, never one of ``experts``). Returns the ``(expert, slot)`` loads."""
        wanted = list(dict.fromkeys(experts))[: self.capacity]
        loads = []
        for e in wanted:
            if e in self.resident:
                continue
            if len(self.resident) >= self.capacity:
                self._evict(protect=set(wanted))
            slot = self._free_slot()
            self.resident[e] = slot
            loads.append((e, slot))
            self.stats.prefetched += 1
            self.stats.bytes_loaded += self.expert_bytes
        return loads

    def _free_slot(self) -> int:
        taken = set(self.resident.values())
        return next(s for s in range(self.capacity) if s not in taken)

    def _pinned(self) -> set[int]:
        n = int(self.capacity * self.pin_fraction)
        ranked = sorted(self.resident, key=lambda e: -self.uses.get(e, 0.0))
        return set(ranked[:n])

    def _evict(self, protect: set[int]) -> int:
        candidates = [e for e in self.resident if e not in protect]
        if self.policy == "pinned-lru":
            pinned = self._pinned()
            candidates = [e for e in candidates if e not in pinned] or candidates
        if self.policy == "lfu":
            order = list(self.resident)
            victim = min(candidates, key=lambda e: (self.uses.get(e, 0.0), order.index(e)))
        elif self.policy == "belady":
            victim = max(candidates, key=self._next_use)
        else:
            victim = candidates[0]  # least recently used first
        del self.resident[victim]
        self.stats.evictions += 1
        return victim

    def _next_use(self, expert: int) -> float:
        for distance, step in enumerate(self.future[self.step + 1 :], 1):
            if expert in step:
                return distance
        return float("inf")


def replay(trace: Sequence[Sequence[int]], capacity: int, policy: str, expert_bytes: int = 0) -> CacheStats:
    """Replay a routing trace (distinct experts per step) through a cache; return its counters."""
    cache = ExpertCache(capacity, policy, expert_bytes, future=trace if policy == "belady" else None)
    for step in trace:
        step = list(dict.fromkeys(step))
        for start in range(0, len(step), capacity):
            cache.request(step[start : start + capacity])
    return cache.stats


# ---------------------------------------------------------------------------------------------- offload


class MemoryStore:
    """Every expert in CPU memory (pinned when CUDA is available, so loads can be asynchronous)."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}

    def bind(self, model: nn.Module, layers: list[tuple[str, nn.Module, list[str]]]) -> None:
        pin = torch.cuda.is_available()
        for name, module, param_names in layers:
            self.tensors[name] = {}
            for p in param_names:
                t = getattr(module, p).detach().to("cpu").clone()
                self.tensors[name][p] = t.pin_memory() if pin else t

    def expert(self, layer: str, expert: int) -> dict[str, torch.Tensor]:
        """``{parameter: [...]}`` rows of ``expert`` (one expert, no leading dimension), on the CPU."""
        return {p: t[expert] for p, t in self.tensors[layer].items()}


class SafetensorsStore:
    """Experts read on demand from a checkpoint's safetensors files through ``safe_open`` (memory-mapped):
    a hybrid-EP checkpoint (per-rank expert files or fused tensors) or a plain Hugging Face one. Keys are
    mapped to the fused parameters with transformers' own conversion mapping (as rank-local loading
    does), so one expert is one small read per source key."""

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        from ..checkpoint.atomic import open_checkpoint
        from ..checkpoint.load import _weight_map

        self.root = Path(path)
        if not self.root.is_dir():
            raise HybridEPConfigError(f"expert store {str(self.root)!r} is not a checkpoint directory")
        self.verifier = open_checkpoint(self.root, verify=verify)  # each file checked when first opened
        self.weight_map = _weight_map(self.root)
        self.targets: dict = {}
        self.model: nn.Module | None = None
        self.reader = None

    def bind(self, model: nn.Module, layers: list[tuple[str, nn.Module, list[str]]]) -> None:
        from ..checkpoint.load import _Reader, plan_rank_local

        views = [SimpleNamespace(name=n, param_names=ps, local_experts=list(range(m.num_experts))) for n, m, ps in layers]
        self.targets = plan_rank_local(model, views, self.weight_map)
        self.model, self.reader = model, _Reader(self.root, self.weight_map, verifier=self.verifier)
        self.param_names = {name: param_names for name, _, param_names in layers}
        for name, module, param_names in layers:  # a checkpoint of another model fails here, naming the key
            for p in param_names:
                if f"{name}.{p}" not in self.targets:
                    raise HybridEPConfigError(f"expert store {str(self.root)!r} has no tensor for {name}.{p}")
            for p, value in self.expert(name, 0).items():
                want = tuple(getattr(module, p).shape[1:])
                if tuple(value.shape) != want:
                    raise HybridEPConfigError(
                        f"expert store {str(self.root)!r}: {name}.{p} has expert shape {tuple(value.shape)}, "
                        f"the model expects {want}"
                    )

    def expert(self, layer: str, expert: int) -> dict[str, torch.Tensor]:
        from ..checkpoint.load import _assemble, _Target

        out = {}
        for p in self.param_names[layer]:
            key = f"{layer}.{p}"
            target = self.targets[key]
            if target.converter is None:
                if target.rows is None:
                    raise HybridEPConfigError(f"expert store {str(self.root)!r}: {key} is not an expert tensor")
                value = self.reader.rows(target.direct, [expert])
            else:
                one = _Target(target.converter, {pat: [keys[expert]] for pat, keys in target.sources.items()})
                value = _assemble(key, one, self.reader, self.model)
            out[p] = value[0]
        return out


class _Loader:
    """Copies expert rows into resident slots: synchronously on the CPU; on CUDA on a side stream from
    pinned memory, the compute stream waiting only when it uses the slots (untested on GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        if not src.is_pinned():
            src = src.pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the slot's last readers are done
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)

    def wait(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class OffloadedExperts:
    """One experts module whose experts live in a store, with ``capacity`` resident slots."""

    def __init__(self, name: str, module: nn.Module, capacity: int, policy: str, device: torch.device,
                 store) -> None:
        self.name, self.module, self.device, self.store = name, module, device, store
        self.num_experts = module.num_experts
        if capacity > self.num_experts:
            capacity = self.num_experts
        self.param_names = expert_parameter_names(name, module)
        expert_bytes = sum(getattr(module, p)[0].numel() * getattr(module, p).element_size() for p in self.param_names)
        self.cache = ExpertCache(capacity, policy, expert_bytes)
        self.loader = _Loader(device)
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

    @torch.no_grad()
    def _load(self, loads: list[tuple[int, int]]) -> None:
        for expert, slot in loads:
            for p, value in self.store.expert(self.name, expert).items():
                self.loader.copy(getattr(self.module, p)[slot], value)

    @torch.no_grad()
    def resize(self, capacity: int) -> None:
        """Change the resident slots at run time (evicting by the policy); resident experts keep their data."""
        capacity = min(capacity, self.num_experts)
        self.loader.wait()
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
    def prefetch_from(self, hidden_states: torch.Tensor) -> None:
        """Predict this layer's experts by applying its router to ``hidden_states`` (the previous layer's
        experts input) and load up to ``capacity`` of them, the most-routed first."""
        index = self.router(hidden_states)[2]
        counts = torch.bincount(index[index >= 0].reshape(-1), minlength=self.num_experts)
        ranked = torch.argsort(counts, descending=True, stable=True)[: self.cache.capacity]
        predicted = [e for e in ranked.tolist() if counts[e] > 0]
        self.prediction = set(predicted)
        self.cache.stats.predicted += len(predicted)
        self._load(self.cache.prefetch(predicted))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        capacity = self.cache.capacity
        needed = torch.unique(top_k_index[top_k_index >= 0]).tolist()
        if self.prediction is not None:
            stats = self.cache.stats
            stats.used += len(needed)
            stats.predicted_used += len(self.prediction.intersection(needed))
            self.prediction = None
        if self.next is not None:  # the next layer's loads overlap this layer's compute on CUDA
            self.next.prefetch_from(hidden_states)
        out = None
        self.module._is_expert_parallel = True  # ids >= num_experts are skipped by transformers' kernels
        try:
            for start in range(0, max(1, len(needed)), capacity):
                wave = needed[start : start + capacity]
                self._load(self.cache.request(wave))
                self.loader.wait()
                slot_of = torch.full((self.num_experts + 1,), capacity, dtype=torch.long, device=top_k_index.device)
                for e in wave:
                    slot_of[e] = self.cache.resident[e]
                index = slot_of[top_k_index.clamp(-1, self.num_experts - 1)]  # -1 -> sentinel
                weights = torch.where(index < capacity, top_k_weights, torch.zeros_like(top_k_weights))
                part = self._forward(self.module, hidden_states, index, weights)
                out = part if out is None else out + part
        finally:
            self.module._is_expert_parallel = False
        return out


def _make_store(store) -> MemoryStore | SafetensorsStore:
    if store is None or store == "memory":
        return MemoryStore()
    if isinstance(store, MemoryStore | SafetensorsStore):
        return store
    if isinstance(store, str | os.PathLike):
        return SafetensorsStore(store)
    raise HybridEPConfigError(f"store={store!r} must be 'memory', a checkpoint directory or an expert store")


def offload(model: nn.Module, capacity: int, policy: str = "lru", device: str | torch.device | None = None,
            store=None, prefetch: bool = False) -> nn.Module:
    """Keep every expert in a backing store and only ``capacity`` experts per layer resident on ``device``.

    Args:
        store: ``"memory"`` (default: CPU memory, pinned on CUDA hosts), a checkpoint directory or a
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
    store = _make_store(store)
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
    for layer in layers:
        layer.install()
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
    from ..checkpoint.layout import build_meta_model, read_config
    from ..checkpoint.load import _assemble, _Reader, plan_rank_local

    root = Path(path)
    if not root.is_dir():
        raise HybridEPConfigError(f"checkpoint directory {str(root)!r} does not exist")
    store = SafetensorsStore(root, verify=verify)
    model = build_meta_model(read_config(root, trust_remote_code), trust_remote_code)
    offload(model, capacity, policy, device=device, store=store, prefetch=prefetch)
    experts = {f"{layer.name}.{p}" for layer in offload_state_of(model) for p in layer.param_names}
    weight_map = store.weight_map
    reader = _Reader(root, weight_map, verifier=store.verifier)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, target in sorted(plan_rank_local(model, [], weight_map).items()):
            if name in experts or (name not in params and name not in buffers):
                continue
            value = _assemble(name, target, reader, model)
            if name in buffers:
                buffers[name].copy_(value.to(buffers[name].dtype))
                continue
            module_name, _, leaf = name.rpartition(".")
            current = params[name]
            model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(
                value.to(device, current.dtype), requires_grad=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise HybridEPConfigError(f"checkpoint {str(root)!r} lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
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
