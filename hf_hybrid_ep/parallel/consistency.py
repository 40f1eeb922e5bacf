"""Replica consistency check: every replicated tensor must be bit-identical across its replicas.

Dense parameters are replicated on every rank; each expert on the ranks of its EDP group (and on EP
ranks holding replicas). A divergence (a reduction skipped on one rank, a non-deterministic kernel,
an optimizer step taken by some ranks only) is named with the first differing parameter and ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ReplicaDivergenceError
from .grads import HolderSet
from .mesh import HybridMesh, current_device
from .watchdog import watched

_CHUNK = 1 << 22


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of the raw bits of ``t`` (the second position-weighted, so a permutation
    differs), computed in chunks so the temporary memory stays bounded."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=t.device) % 65521
        total[0] += chunk.sum()
        total[1] += (chunk * weights).sum()
    return total


def verify_replicas(mesh: HybridMesh, dense: list[tuple[str, torch.Tensor]], holder_groups: list[HolderSet],
                    names: dict[int, str]) -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank if a replicated tensor differs between its replicas:
    ``dense`` (name, parameter) over the world, then each expert slot of ``holder_groups`` over its holders
    (named ``names[id(parameter)][expert e]``). Collective: the world, each holder group's ranks, then the
    world again so that every rank raises together.
    """
    if mesh.world_group is None:
        return
    device = current_device(mesh)
    problems = _compare([n for n, _ in dense], torch.stack([_fingerprint(p) for _, p in dense]).to(device),
                        mesh.world_group, list(range(mesh.world_size)), "dense")
    for bucket in holder_groups:
        if bucket.group is None:
            continue
        labels, prints = [], []
        for holding, idx in bucket.entries:
            for slot in idx.tolist():
                labels.append(f"{names[id(holding.param)]}[expert {holding.experts[slot]}]")
                prints.append(_fingerprint(holding.param[slot]))
        problems += _compare(labels, torch.stack(prints).to(device), bucket.group, list(bucket.ranks), "expert")
    everyone = mesh.gather_objects(problems[:1], "all_gather of the replica check's findings")
    found = sorted({m for msgs in everyone for m in msgs})
    if found:
        raise ReplicaDivergenceError("; ".join(found))


def _compare(labels: list[str], prints: torch.Tensor, group, ranks: list[int], kind: str) -> list[str]:
    gathered = [torch.empty_like(prints) for _ in ranks]
    with watched(f"all_gather of {kind} replica fingerprints", group):
        dist.all_gather(gathered, prints, group=group)
    reference = gathered[0]
    for i, label in enumerate(labels):
        differing = [ranks[j] for j, g in enumerate(gathered) if not torch.equal(g[i], reference[i])]
        if differing:
            return [f"{kind} parameter {label} differs between rank {ranks[0]} and rank(s) {differing}"]
    return []
