"""The CTR model: feature embeddings → (MoE with 128 experts | dense MLP) → shared interaction layers → logit.

The 7 fields (domain, user group, category, 3 context features, the real feature) are embedded (dim 8)
and projected linearly to ``h`` (dim 32, layer-normalised); the bottom mixture adds ``mixture(h)`` to
it. The shared interaction layers on top see ``h`` and the 21 pairwise inner products of the field
embeddings (a factorisation-machine term), through an MLP of width 64.
"""

from __future__ import annotations

import torch
from data import CONTEXT_VALUES, N_CATEGORIES, N_CONTEXT, N_DOMAINS, N_GROUPS
from torch import nn

from hf_hybrid_ep.moe.standalone import MoE, MoEConfig

EMBED, HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 8, 32, 32, 128, 2
FIELDS = 4 + N_CONTEXT
PAIRS = torch.triu_indices(FIELDS, FIELDS, 1)  # [2, 21]: the field pairs of the factorisation-machine term


class GatedMLP(nn.Module):
    """The dense counterpart of one expert: ``down(act(x W_g) * (x W_u))``."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def dense_width(kind: str) -> int:
    """Width of the dense baseline whose parameters equal the MoE layer's active or total ones."""
    per_expert = 3 * HIDDEN * EXPERT_WIDTH
    router = NUM_EXPERTS * HIDDEN
    budget = TOP_K * per_expert + router if kind == "dense_active" else NUM_EXPERTS * per_expert + router
    return round(budget / (3 * HIDDEN))


class CTRModel(nn.Module):
    def __init__(self, kind: str = "moe") -> None:
        super().__init__()
        self.domain = nn.Embedding(N_DOMAINS, EMBED)
        self.group = nn.Embedding(N_GROUPS, EMBED)
        self.category = nn.Embedding(N_CATEGORIES, EMBED)
        self.ctx = nn.Embedding(N_CONTEXT * CONTEXT_VALUES, EMBED)
        self.real = nn.Linear(1, EMBED)
        self.proj = nn.Linear(FIELDS * EMBED, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        if kind == "moe":
            self.mixture = MoE(MoEConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, top_k=TOP_K,
                                         intermediate_size=EXPERT_WIDTH))
        else:
            self.mixture = GatedMLP(HIDDEN, dense_width(kind))
        self.interaction = nn.Sequential(nn.Linear(HIDDEN + PAIRS.shape[1], 2 * HIDDEN), nn.ReLU(),
                                         nn.Linear(2 * HIDDEN, 1))

    def forward(self, domain, group, category, ctx, real):
        """Inputs ``[B]`` (``ctx``: ``[B, 3]``; ``real``: ``[B]`` float) → click logits ``[B]``."""
        offsets = torch.arange(N_CONTEXT, device=ctx.device) * CONTEXT_VALUES
        fields = torch.cat([torch.stack([self.domain(domain), self.group(group), self.category(category),
                                         self.real(real[:, None])], 1), self.ctx(ctx + offsets)], 1)  # [B, 7, EMBED]
        h = self.norm(self.proj(fields.flatten(1)))
        h = h + self.mixture(h)
        dots = (fields[:, PAIRS[0]] * fields[:, PAIRS[1]]).sum(-1)  # [B, 21]
        return self.interaction(torch.cat([h, dots], -1)).squeeze(-1)


def parameter_counts(model: CTRModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    mix = model.mixture
    if isinstance(mix, MoE):
        per_expert = mix.experts.gate_up_proj[0].numel() + mix.experts.down_proj[0].numel()
        active_mix = mix.gate.weight.numel() + TOP_K * per_expert
        return {"total": total, "mixture_total": sum(p.numel() for p in mix.parameters()), "mixture_active": active_mix}
    n = sum(p.numel() for p in mix.parameters())
    return {"total": total, "mixture_total": n, "mixture_active": n}
