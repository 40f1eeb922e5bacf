"""Replica consistency check: every replicated tensor must be bit-identical across its replicas.

Dense parameters are replicated on every rank; each expert on the ranks of its EDP group (and on EP
ranks holding replicas). A divergence (a reduction skipped on one rank, a non-deterministic kernel,
an optimizer step taken by some ranks only) is named with the first differing parameter and ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ReplicaDivergenceError
from ..state import state_of
from .mesh import current_device
from .zero import wait_for_parameters

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


def verify_replicas(model: nn.Module) -> None:
    """Raise :class:`ReplicaDivergenceError` on every rank if any replicated parameter differs between
    its replicas. Collective: the world (dense), each expert bucket's group (experts), then the world
    again so that every rank raises together.
    """
    state = state_of(model)
    mesh = state.mesh
    if mesh.world_group is None:
        return
    wait_for_parameters(model)
    device = current_device(mesh)
    expert_ids = {id(p) for layer in state.layers for p in layer.expert_parameters()}
    dense = [(n, p) for n, p in model.named_parameters() if id(p) not in expert_ids]
    problems = _compare([n for n, _ in dense], torch.stack([_fingerprint(p) for _, p in dense]).to(device),
                        mesh.world_group, list(range(mesh.world_size)), "dense")
    names = {id(p): n for n, p in model.named_parameters()}
    layer_of = {id(p): layer for layer in state.layers for p in layer.expert_parameters()}
    for bucket in state.reducer.holder_groups:
        if bucket.group is None:
            continue
        labels, prints = [], []
        for p, idx in bucket.entries:
            for slot in idx.tolist():
                labels.append(f"{names[id(p)]}[expert {layer_of[id(p)].local_experts[slot]}]")
                prints.append(_fingerprint(p[slot]))
        problems += _compare(labels, torch.stack(prints).to(device), bucket.group, list(bucket.ranks), "expert")
    everyone: list = [None] * mesh.world_size
    dist.all_gather_object(everyone, problems[:1], group=mesh.world_group)
    found = sorted({m for msgs in everyone for m in msgs})
    if found:
        raise ReplicaDivergenceError("; ".join(found))


def _compare(labels: list[str], prints: torch.Tensor, group, ranks: list[int], kind: str) -> list[str]:
    gathered = [torch.empty_like(prints) for _ in ranks]
    dist.all_gather(gathered, prints, group=group)
    reference = gathered[0]
    for i, label in enumerate(labels):
        differing = [ranks[j] for j, g in enumerate(gathered) if not torch.equal(g[i], reference[i])]
        if differing:
            return [f"{kind} parameter {label} differs between rank {ranks[0]} and rank(s) {differing}"]
    return []
