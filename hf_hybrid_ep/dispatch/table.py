"""The placement table: global expert id → (EP rank, local slot), replicas allowed.

Every dispatcher routes through a :class:`PlacementTable`; placement, caching and checkpoint code
produce or consume tables and never special-case the dispatcher.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..config import check_int
from ..errors import HybridEPConfigError


def _is_list_like(value: object) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping)


@dataclass(frozen=True)
class PlacementTable:
    """Which EP rank holds which experts, in which local slot.

    Attributes:
        num_experts: global routed experts ``E`` of the layer.
        rows: one tuple per EP rank ``r``; ``rows[r][s]`` is the global expert id in local slot ``s``.
            An expert that appears on several ranks is replicated; a token from EP rank ``src`` goes to
            the replica on ``src`` when there is one, else to replica ``(position mod replicas)``.
    """

    num_experts: int
    rows: tuple[tuple[int, ...], ...]
    _replica_rank: torch.Tensor = field(init=False, repr=False, compare=False)
    _replica_slot: torch.Tensor = field(init=False, repr=False, compare=False)
    _num_replicas: torch.Tensor = field(init=False, repr=False, compare=False)
    _on_device: dict = field(init=False, repr=False, compare=False)  # device -> (ranks, slots, counts)

    def __post_init__(self) -> None:
        E, ep = self.num_experts, len(self.rows)
        if ep < 1:
            raise HybridEPConfigError("placement table has no EP ranks")
        holders: list[list[tuple[int, int]]] = [[] for _ in range(E)]
        for r, row in enumerate(self.rows):
            if len(row) == 0:
                raise HybridEPConfigError(f"placement table row {r} is empty: every EP rank must hold an expert")
            if len(set(row)) != len(row):
                raise HybridEPConfigError(f"placement table row {r} = {list(row)} lists an expert twice")
            for s, e in enumerate(row):
                if not 0 <= e < E:
                    raise HybridEPConfigError(
                        f"placement table row {r} names expert {e}, outside [0, {E}) for num_experts={E}"
                    )
                holders[e].append((r, s))
        missing = [e for e in range(E) if not holders[e]]
        if missing:
            raise HybridEPConfigError(f"placement table places no replica of expert(s) {missing}")
        max_rep = max(len(h) for h in holders)
        replica_rank = torch.full((E, max_rep), -1, dtype=torch.long)
        replica_slot = torch.full((E, max_rep), -1, dtype=torch.long)
        for e, hs in enumerate(holders):
            for i, (r, s) in enumerate(hs):
                replica_rank[e, i] = r
                replica_slot[e, i] = s
        object.__setattr__(self, "_replica_rank", replica_rank)
        object.__setattr__(self, "_replica_slot", replica_slot)
        object.__setattr__(self, "_num_replicas", torch.tensor([len(h) for h in holders], dtype=torch.long))
        object.__setattr__(self, "_on_device", {})

    # ------------------------------------------------------------------ constructors
    @classmethod
    def contiguous(cls, num_experts: int, ep_degree: int) -> PlacementTable:
        """EP rank ``r`` owns experts ``[r*E/ep, (r+1)*E/ep)``."""
        check_int("num_experts", num_experts)
        check_int("ep_degree", ep_degree)
        if num_experts % ep_degree != 0:
            raise HybridEPConfigError(
                f"num_experts={num_experts} is not divisible by ep_degree={ep_degree} for a contiguous placement"
            )
        per = num_experts // ep_degree
        return cls(num_experts, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep_degree)))

    @classmethod
    def from_rows(cls, num_experts: int, rows: Sequence[Sequence[int]]) -> PlacementTable:
        """A table from one list of global expert ids per EP rank (integers; ``True`` is not an id)."""
        check_int("num_experts", num_experts)
        if not _is_list_like(rows):
            raise HybridEPConfigError(f"placement table {rows!r} must be a list of rows (one per EP rank)")
        rows = list(rows)
        check_int("ep_degree", len(rows), detail=f" (the table has {len(rows)} rows)")
        out = []
        for r, row in enumerate(rows):
            if not _is_list_like(row):
                raise HybridEPConfigError(f"placement table row {r} = {row!r} is not a list of expert ids")
            row = list(row)
            for e in row:
                if isinstance(e, bool) or not isinstance(e, numbers.Integral):
                    raise HybridEPConfigError(f"placement table row {r} = {row!r} holds {e!r}, "
                                              "not an integer expert id")
            out.append(tuple(int(e) for e in row))
        return cls(num_experts, tuple(out))

    # ------------------------------------------------------------------ queries
    @property
    def ep_degree(self) -> int:
        return len(self.rows)

    @property
    def slots_per_rank(self) -> int:
        """Largest number of local slots on any EP rank (count tensors are padded to it)."""
        return max(len(row) for row in self.rows)

    def holders(self, expert: int) -> list[int]:
        """EP ranks that hold a replica of ``expert``, in replica order."""
        n = int(self._num_replicas[expert])
        return self._replica_rank[expert, :n].tolist()

    def local_experts(self, ep_rank: int) -> list[int]:
        """Global expert ids in the local slots of ``ep_rank``."""
        return list(self.rows[ep_rank])

    def is_contiguous(self) -> bool:
        divisible = self.num_experts % self.ep_degree == 0
        return divisible and self == PlacementTable.contiguous(self.num_experts, self.ep_degree)

    def fingerprint(self) -> str:
        """A short digest identifying the table (used to check that all ranks agree)."""
        blob = json.dumps([self.num_experts, [list(r) for r in self.rows]]).encode()
        return hashlib.sha1(blob).hexdigest()[:16]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(replica ranks [E, R], replica slots [E, R], replicas [E])`` on ``device``, copied there once (the
        layer asks when it is placed, so that no forward copies them)."""
        if device not in self._on_device:
            self._on_device[device] = tuple(t.to(device) for t in (self._replica_rank, self._replica_slot,
                                                                   self._num_replicas))
        return self._on_device[device]

    def route(self, expert_ids: torch.Tensor, src_ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Destination EP rank and local slot for each routed (token, k) pair.

        Args:
            expert_ids: ``[N]`` int64 global expert ids, in the sender's (token, k) order.
            src_ep_rank: the sender's EP rank; it keeps tokens for experts it holds itself.

        Returns:
            ``(dest_rank [N], dest_slot [N])``, int64 on ``expert_ids.device``.
        """
        device = expert_ids.device
        ranks, slots, counts = self.on(device)
        if ranks.size(1) == 1:
            return ranks[expert_ids, 0], slots[expert_ids, 0]
        num_rep = counts[expert_ids]
        own = ranks[expert_ids] == src_ep_rank  # [N, R]
        position = torch.arange(expert_ids.numel(), device=device)
        choice = torch.where(own.any(dim=1), own.long().argmax(dim=1), position % num_rep)
        return ranks[expert_ids, choice], slots[expert_ids, choice]


# ---------------------------------------------------------------------------------------------- per layer
# A placement spec, as ``HybridEPConfig(placement=...)``, a checkpoint index and ``place`` carry it:
# ``"contiguous"``; one table for every MoE layer (a list of rows); or per layer, a mapping from the
# experts module's qualified name (``"model.layers.3.mlp.experts"``) to its table (layers it does not
# name are laid out contiguously).
PlacementSpec = str | list[list[int]] | dict[str, list[list[int]]]


def layer_tables(spec: PlacementSpec, layers: Sequence[tuple[str, int]], ep_degree: int) -> list[PlacementTable]:
    """One :class:`PlacementTable` per MoE layer ``(name, num_experts)`` from a placement spec.

    Raises:
        HybridEPConfigError: naming a layer of a per-layer spec that the model does not have (with the
            names it has), or a table that does not fit its layer or the EP degree.
    """
    if isinstance(spec, Mapping):
        names = [name for name, _ in layers]
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise HybridEPConfigError(f"the per-layer placement names layer {unknown[0]!r}, which the model does "
                                      f"not have; its MoE layers are {names}")
        tables = []
        for name, num_experts in layers:
            rows = spec.get(name, "contiguous")
            try:
                tables.append(PlacementTable.contiguous(num_experts, ep_degree) if isinstance(rows, str)
                              else PlacementTable.from_rows(num_experts, rows))
            except HybridEPConfigError as err:
                raise HybridEPConfigError(f"placement of layer {name!r}: {err}") from err
        return tables
    if isinstance(spec, str):
        return [PlacementTable.contiguous(num_experts, ep_degree) for _, num_experts in layers]
    return [PlacementTable.from_rows(num_experts, spec) for _, num_experts in layers]


def spec_of(tables: Mapping[str, PlacementTable]) -> list[list[int]] | dict[str, list[list[int]]]:
    """The most compact explicit spec for these per-layer tables: one table (rows) when every layer has
    the same, else per layer (layer name → rows)."""
    rows = {name: [list(r) for r in t.rows] for name, t in tables.items()}
    distinct = {json.dumps(r) for r in rows.values()}
    if len(distinct) == 1 and len({t.num_experts for t in tables.values()}) == 1:
        return next(iter(rows.values()))
    return rows
