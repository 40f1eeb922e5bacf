"""Which checkpoint keys are routed experts, read from the keys themselves: per-expert keys (``….experts.<id>.…``,
global expert ids), fused ``[E, ...]`` tensors directly under an experts module, and dense ones."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..errors import CheckpointError
from .format import PER_EXPERT_KEY
from .safetensors_io import TensorSpec


@dataclass(frozen=True)
class KeyRole:
    """How one key is stored: ``dense``, ``per_expert`` (with its global expert id) or ``fused`` ([E, ...])."""

    kind: str
    expert: int | None = None


def classify_keys(specs: dict[str, TensorSpec], num_experts: int) -> dict[str, KeyRole]:
    """Classify every key and check that per-expert keys cover every expert of every tensor family.

    A tensor directly under an ``experts`` module is fused and must be ``[num_experts, ...]``.

    Raises:
        CheckpointError: naming a key whose expert id is out of range, a tensor under an experts
            module without the leading expert dimension (with its shape), or a missing expert.
    """
    roles: dict[str, KeyRole] = {}
    families: dict[tuple[str, str], set[int]] = defaultdict(set)
    for key, spec in specs.items():
        match = PER_EXPERT_KEY.match(key)
        if match:
            expert = int(match["expert"])
            if expert >= num_experts:
                raise CheckpointError(f"key {key!r} names expert {expert}, but the model has {num_experts} experts")
            roles[key] = KeyRole("per_expert", expert)
            families[(match["prefix"], match["rest"])].add(expert)
        elif key.split(".")[-2:-1] == ["experts"]:
            if not spec.shape or spec.shape[0] != num_experts:
                raise CheckpointError(
                    f"key {key!r} of shape {tuple(spec.shape)} is under an experts module, but its leading "
                    f"dimension is not the model's expert count {num_experts}"
                )
            roles[key] = KeyRole("fused")
        else:
            roles[key] = KeyRole("dense")
    for (prefix, rest), experts in sorted(families.items()):
        missing = sorted(set(range(num_experts)) - experts)
        if missing:
            raise CheckpointError(f"checkpoint lacks {prefix}.{missing[0]}.{rest} (expert {missing[0]} of {num_experts})")
    if not any(r.kind != "dense" for r in roles.values()):
        raise CheckpointError("the checkpoint holds no routed-expert tensors (per-expert or fused keys)")
    return roles
