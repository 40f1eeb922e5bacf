"""ExpertCache: a bounded set of resident experts per layer, and offloaded inference built on it.

Policies: ``lru``; ``lfu`` (fewest uses, ties by recency); ``pinned-lru`` (the experts with the
highest decayed running use count are pinned, the rest are LRU); ``belady`` (offline: evicts the
expert whose next use is farthest away; needs the future trace, for replay only).

``offload(model, capacity, policy)`` keeps every expert in a backing store (CPU memory) and only
``capacity`` experts per layer resident in the module's parameters; a forward loads the experts its
tokens need (evicting by the policy) and computes in waves of at most ``capacity`` experts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .config import HybridEPConfigError
from .experts import expert_parameter_names, find_experts_modules

POLICIES = ("lru", "lfu", "pinned-lru", "belady")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_loaded: int = 0

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


class OffloadedExperts:
    """One experts module whose experts live in a CPU store, with ``capacity`` resident slots."""

    def __init__(self, name: str, module: nn.Module, capacity: int, policy: str, device: torch.device) -> None:
        self.name, self.module, self.device = name, module, device
        self.num_experts = module.num_experts
        if capacity > self.num_experts:
            capacity = self.num_experts
        self.param_names = expert_parameter_names(name, module)
        self.store = {p: getattr(module, p).detach().to("cpu").clone() for p in self.param_names}
        expert_bytes = sum(t[0].numel() * t[0].element_size() for t in self.store.values())
        self.cache = ExpertCache(capacity, policy, expert_bytes)
        for p in self.param_names:
            full = getattr(module, p)
            setattr(module, p, nn.Parameter(full.detach()[:capacity].to(device).clone(), requires_grad=False))
        self.module.num_experts = capacity
        self._forward = type(module).forward
        module.forward = self.forward

    @torch.no_grad()
    def _load(self, loads: list[tuple[int, int]]) -> None:
        for expert, slot in loads:
            for p in self.param_names:
                getattr(self.module, p)[slot].copy_(self.store[p][expert], non_blocking=True)

    @torch.no_grad()
    def resize(self, capacity: int) -> None:
        """Change the resident slots at run time (evicting by the policy); resident experts keep their data."""
        capacity = min(capacity, self.num_experts)
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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        capacity = self.cache.capacity
        needed = torch.unique(top_k_index[top_k_index >= 0]).tolist()
        out = None
        self.module._is_expert_parallel = True  # ids >= num_experts are skipped by transformers' kernels
        try:
            for start in range(0, max(1, len(needed)), capacity):
                wave = needed[start : start + capacity]
                self._load(self.cache.request(wave))
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


def offload(model: nn.Module, capacity: int, policy: str = "lru", device: str | torch.device | None = None) -> nn.Module:
    """Keep every expert in CPU memory and only ``capacity`` experts per layer resident on ``device``.

    In place; returns the model. Logits equal the fully resident model's (bit-equal when a step's
    experts fit in one wave). ``cache_stats(model)`` reports hits, misses, evictions and bytes loaded.
    """
    found = find_experts_modules(model)
    if not found:
        raise HybridEPConfigError(f"{type(model).__name__} has no fused experts module to offload")
    if getattr(model, "_hybrid_ep", None) is not None:
        raise HybridEPConfigError("offload is for a model that was not parallelized (inference on one device)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model._hybrid_ep_offload = [OffloadedExperts(name, m, capacity, policy, device) for name, m in found]
    return model


def resize_offload(model: nn.Module, capacity: int) -> None:
    """Change every offloaded layer's resident capacity (e.g. to follow a memory budget)."""
    for layer in _offloaded(model):
        layer.resize(capacity)


def _offloaded(model: nn.Module) -> list[OffloadedExperts]:
    layers = getattr(model, "_hybrid_ep_offload", None)
    if layers is None:
        raise HybridEPConfigError(f"{type(model).__name__} was not prepared with hf_hybrid_ep.offload")
    return layers


def cache_stats(model: nn.Module) -> dict[str, dict]:
    """Per-layer cache counters of an offloaded model (plus resident experts and bytes)."""
    return {
        layer.name: {**asdict(layer.cache.stats), "hit_rate": layer.cache.stats.hit_rate,
                     "resident_experts": len(layer.cache.resident), "capacity": layer.cache.capacity,
                     "resident_bytes": layer.resident_bytes()}
        for layer in _offloaded(model)
    }
