"""Which experts stay resident: an ``ExpertCache`` per layer with a bounded capacity and an eviction policy
(``lru``, ``lfu``, ``pinned-lru``, ``belady``), its counters, and the offline replay of a routing trace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import HybridEPConfigError

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
