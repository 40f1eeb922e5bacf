"""Routing statistics a placement is computed from: per-expert loads and the co-activation matrix,
read from ``expert_load.jsonl`` records or a placement file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import HybridEPConfigError


@dataclass
class RoutingStats:
    """Routing statistics of one or several MoE layers (summed).

    Attributes:
        loads: ``[E]`` routed assignments per expert.
        coactivation: ``[E, E]`` symmetric pair counts (zero diagonal), or ``None`` when not recorded.
        top_k: experts per token (``Σ loads / k`` tokens).
    """

    loads: np.ndarray
    coactivation: np.ndarray | None
    top_k: int
    layers: int = 1

    @property
    def num_experts(self) -> int:
        return len(self.loads)

    @classmethod
    def from_records(cls, records: Sequence[Mapping], layers: Sequence[str] | None = None) -> RoutingStats:
        """Sum ``expert_load.jsonl`` records over ``layers`` (all by default) and steps.

        Raises:
            HybridEPConfigError: for malformed records (:func:`hf_hybrid_ep.metrics.check_records`), naming
                the record, layer and key, or a layer the first record lacks.
        """
        if isinstance(records, str | bytes | Mapping) or not isinstance(records, Sequence):
            raise HybridEPConfigError(f"expert-load records must be a list of records, got {type(records).__name__}")
        names = list(layers) if layers is not None else None
        E = check_records(records, layers=names)
        names = names if names is not None else list(records[0]["layers"])
        missing = [n for n in names if n not in records[0]["layers"]]
        if missing or not names:
            raise HybridEPConfigError(f"expert-load records have no layer {missing[0]!r}" if missing
                                      else "no MoE layer selected from the expert-load records")
        loads = np.zeros(E)
        coact = np.zeros((E, E))
        has_coact = True
        pairs = 0.0
        for record in records:
            for name in names:
                layer = record["layers"].get(name)
                if layer is None:
                    continue
                loads += np.asarray(layer["tokens_per_expert"], dtype=float)
                if "coactivation" in layer:
                    coact += np.asarray(layer["coactivation"], dtype=float)
                else:
                    has_coact = False
        if has_coact:
            pairs = coact.sum() / 2
        # Σ_e N_e = T·k and Σ_{a<b} C_ab = T·k(k−1)/2 (no drops): k − 1 = 2·pairs / assignments
        top_k = int(round(2 * pairs / loads.sum())) + 1 if has_coact and loads.sum() > 0 else 1
        return cls(loads, coact if has_coact else None, top_k, len(names))

    @classmethod
    def from_indices(cls, indices: Sequence[np.ndarray], num_experts: int) -> RoutingStats:
        """From recorded top-k indices, one ``[T, k]`` int array per layer (``-1``: dropped)."""
        loads = np.zeros(num_experts)
        coact = np.zeros((num_experts, num_experts))
        k = 1
        for index in indices:
            index = np.asarray(index).reshape(len(index), -1)
            k = index.shape[1]
            kept = index[index >= 0]
            loads += np.bincount(kept, minlength=num_experts)
            for i in range(k):
                for j in range(i + 1, k):
                    a, b = index[:, i], index[:, j]
                    ok = (a >= 0) & (b >= 0) & (a != b)
                    np.add.at(coact, (a[ok], b[ok]), 1)
                    np.add.at(coact, (b[ok], a[ok]), 1)
        return cls(loads, coact, k, len(indices))


def read_placement_file(path: str | os.PathLike[str]) -> list[list[int]] | dict[str, list[list[int]]]:
    """The placement in ``placement.json`` (its ``placement`` key, as ``place`` writes it: per layer, a
    mapping from experts module name to table, or one table) or a file holding a bare JSON table.

    Raises:
        HybridEPConfigError: naming the file (and the bad value) when it is missing, a directory, not
            UTF-8 JSON, or holds no table (a list of lists of integer expert ids; ``true`` is not an id)
            or mapping of layer names to tables.
    """
    name = str(path)
    path = Path(path)
    if path.is_dir():
        raise HybridEPConfigError(f"placement file {name!r} is a directory; give the placement.json inside it")
    if not path.is_file():
        raise HybridEPConfigError(f"placement file {name!r} does not exist")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise HybridEPConfigError(f"placement file {name!r} is not UTF-8 JSON text (undecodable byte at "
                                  f"offset {err.start}); is it a binary file?") from err
    except json.JSONDecodeError as err:
        raise HybridEPConfigError(f"placement file {name!r} is not JSON: {err}") from err
    except OSError as err:
        raise HybridEPConfigError(f"placement file {name!r} cannot be read: {err.strerror}") from err
    placement = data.get("placement") if isinstance(data, dict) else data
    if isinstance(placement, dict) and placement:
        return {layer: _table_rows(rows, f"placement file {name!r}, layer {layer!r}")
                for layer, rows in placement.items()}
    return _table_rows(placement, f"placement file {name!r}")


def _table_rows(rows: object, where: str) -> list[list[int]]:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise HybridEPConfigError(f"{where} holds no table (a non-empty list of lists of expert ids, or an "
                                  "object with such a 'placement' key, or one per layer)")
    for r, row in enumerate(rows):
        for e in row:
            if isinstance(e, bool) or not isinstance(e, int):
                raise HybridEPConfigError(f"{where}: row {r} = {json.dumps(row)} holds {json.dumps(e)}, not an "
                                          "integer expert id")
    return rows


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_counts(where: str, key: str, value: Any) -> int:
    """A non-empty list of non-negative finite numbers; returns its length."""
    if not isinstance(value, list) or not value:
        raise HybridEPConfigError(f"{where}: {key} must be a non-empty list of token counts, got {value!r:.80}")
    for i, x in enumerate(value):
        if not _is_number(x):
            raise HybridEPConfigError(f"{where}: {key}[{i}] = {x!r} is not a number")
        if x < 0:
            raise HybridEPConfigError(f"{where}: {key}[{i}] = {x!r} is negative; loads are token counts (≥ 0)")
    return len(value)


def check_records(records: Sequence[Any], where: Sequence[str] | None = None, layers: Iterable[str] | None = None,
                  require: Iterable[str] = ()) -> int:
    """Refuse malformed ``expert_load.jsonl`` records before anything is computed from them.

    Every record needs a non-negative integer ``step`` and a non-empty ``layers`` mapping; every layer
    (of ``layers``, all by default) a ``tokens_per_expert`` list of non-negative numbers of the same
    length everywhere, an ``E × E`` non-negative ``coactivation`` if present, and the keys in
    ``require``. Errors name the record (``where[i]``, e.g. ``file:line``), the layer and the key.

    Returns:
        The expert count ``E``.
    """
    if not records:
        raise HybridEPConfigError("expert-load statistics hold no records")
    where = list(where) if where is not None else [f"record {i}" for i in range(len(records))]
    selected = None if layers is None else list(layers)
    require = tuple(require)
    experts: tuple[int, str] | None = None
    ranks: tuple[int, str] | None = None
    for record, at in zip(records, where, strict=True):
        if not isinstance(record, Mapping):
            raise HybridEPConfigError(f"{at}: a record must be a JSON object, got {type(record).__name__}")
        for key in ("step", "layers"):
            if key not in record:
                raise HybridEPConfigError(f"{at}: key {key!r} is missing")
        step = record["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise HybridEPConfigError(f"{at}: key 'step' must be a non-negative integer, got {step!r}")
        if not isinstance(record["layers"], Mapping) or not record["layers"]:
            raise HybridEPConfigError(f"{at}: key 'layers' must map MoE layer names to their statistics, "
                                      f"got {record['layers']!r:.80}")
        names = record["layers"] if selected is None else [n for n in selected if n in record["layers"]]
        for name in names:
            layer = record["layers"][name]
            here = f"{at}: layer {name!r}"
            if not isinstance(layer, Mapping):
                raise HybridEPConfigError(f"{here}: statistics must be a JSON object, got {type(layer).__name__}")
            for key in ("tokens_per_expert", *require):
                if key not in layer:
                    raise HybridEPConfigError(f"{here}: key {key!r} is missing")
            E = _check_counts(here, "tokens_per_expert", layer["tokens_per_expert"])
            if experts is None:
                experts = (E, f"{at} (layer {name!r})")
            elif E != experts[0]:
                raise HybridEPConfigError(f"{here}: tokens_per_expert has {E} experts, but {experts[1]} has "
                                          f"{experts[0]}; every record and layer must count the same experts")
            if "coactivation" in layer:
                try:
                    matrix = np.asarray(layer["coactivation"], dtype=float)
                except (TypeError, ValueError):
                    matrix = None
                if matrix is None or matrix.shape != (E, E) or not np.isfinite(matrix).all() or (matrix < 0).any():
                    raise HybridEPConfigError(f"{here}: key 'coactivation' must be a {E} × {E} matrix of "
                                              "non-negative counts")
            if "tokens_per_rank" in require:
                R = _check_counts(here, "tokens_per_rank", layer["tokens_per_rank"])
                if ranks is None:
                    ranks = (R, f"{at} (layer {name!r})")
                elif R != ranks[0]:
                    raise HybridEPConfigError(f"{here}: tokens_per_rank has {R} ranks, but {ranks[1]} has {ranks[0]}")
            for key in require:
                if key != "tokens_per_rank" and (not _is_number(layer[key]) or layer[key] < 0):
                    raise HybridEPConfigError(f"{here}: key {key!r} must be a non-negative number, got {layer[key]!r}")
    if experts is None:
        raise HybridEPConfigError(f"expert-load statistics have no layer {selected[0]!r}" if selected
                                  else "expert-load statistics hold no layers")
    return experts[0]
