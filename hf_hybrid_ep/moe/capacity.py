"""Token capacity per expert: over-capacity (token, expert) pairs are dropped before the exchange."""

from __future__ import annotations

import math

import torch


def apply_capacity(
    index: torch.Tensor, weights: torch.Tensor, num_experts: int, factor: float, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop assignments beyond ``ceil(T·k/E · factor)`` per expert on this rank; dropped ids become -1.

    ``policy="probs"`` keeps the highest weights, ``"position"`` the earliest tokens.
    Returns the new index ``[T, k]`` and the number of dropped assignments (a 0-dim tensor).
    """
    tokens, k = index.shape
    capacity = math.ceil(tokens * k / num_experts * factor)
    flat = index.reshape(-1)
    if policy == "probs":
        order = torch.argsort(weights.reshape(-1).detach().float(), descending=True, stable=True)
    else:
        order = torch.arange(flat.numel(), device=flat.device)
    experts = flat[order]
    sorted_experts, by_expert = torch.sort(experts, stable=True)
    starts = torch.searchsorted(sorted_experts, sorted_experts, right=False)
    rank_in_expert = torch.empty_like(by_expert)
    rank_in_expert[by_expert] = torch.arange(flat.numel(), device=flat.device) - starts
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    dropped = (~keep).sum()
    return torch.where(keep, flat, torch.full_like(flat, -1)).view(tokens, k), dropped
