"""The CTR model: feature embeddings → (MoE with 128 experts | dense MLP) → interaction MLP → logit."""

from __future__ import annotations

import torch
from data import CONTEXT_VALUES, N_CATEGORIES, N_CONTEXT, N_DOMAINS, N_GROUPS, N_ITEMS
from torch import nn

from hf_hybrid_ep.nn import MoE, MoEConfig

EMBED, HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 8, 32, 32, 128, 2


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
        self.item = nn.Embedding(N_ITEMS, EMBED)
        self.category = nn.Embedding(N_CATEGORIES, EMBED)
        self.ctx = nn.Embedding(N_CONTEXT * CONTEXT_VALUES, EMBED)
        self.real = nn.Linear(1, EMBED)
        self.proj = nn.Linear((5 + N_CONTEXT) * EMBED, HIDDEN)
        if kind == "moe":
            self.mixture = MoE(MoEConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, top_k=TOP_K,
                                         intermediate_size=EXPERT_WIDTH))
        else:
            self.mixture = GatedMLP(HIDDEN, dense_width(kind))
        self.interaction = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, domain, group, item, category, ctx, real):
        offsets = torch.arange(N_CONTEXT, device=ctx.device) * CONTEXT_VALUES
        fields = [self.domain(domain), self.group(group), self.item(item), self.category(category),
                  self.real(real[:, None])]
        fields += list(self.ctx(ctx + offsets).unbind(1))
        h = torch.relu(self.proj(torch.cat(fields, dim=-1)))
        h = h + self.mixture(h)
        return self.interaction(h).squeeze(-1)


def parameter_counts(model: CTRModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    mix = model.mixture
    if isinstance(mix, MoE):
        per_expert = mix.experts.gate_up_proj[0].numel() + mix.experts.down_proj[0].numel()
        active_mix = mix.gate.weight.numel() + TOP_K * per_expert
        return {"total": total, "mixture_total": sum(p.numel() for p in mix.parameters()), "mixture_active": active_mix}
    n = sum(p.numel() for p in mix.parameters())
    return {"total": total, "mixture_total": n, "mixture_active": n}
