"""A Mixture-of-Experts layer for any PyTorch model, in transformers' fused-experts layout.

``MoE`` = a router + a fused experts module decorated with transformers' ``use_experts_implementation``
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, ``forward(hidden [T,H], top_k_index [T,k],
top_k_weights [T,k])``) + an optional shared expert. Because it has exactly the structure of a
transformers MoE block, everything in this library applies unchanged: ``parallelize(model, config)``
finds and shards it, the router controls match its selection rule, the metrics count its load.

    moe = MoE(hidden_size=64, num_experts=128, top_k=2, intermediate_size=64)
    model = nn.Sequential(embedding, moe, head)          # any model
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=4))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation


@dataclass
class MoEConfig:
    """Shapes and behaviour of an :class:`MoE` layer.

    Attributes:
        hidden_size: H, the width of the tokens entering and leaving the layer.
        num_experts: E routed experts.
        top_k: experts per token.
        intermediate_size: I, the width inside each expert (gated: ``act(x W_g) * (x W_u)``).
        scoring: ``"softmax"`` (softmax, top-k, optional renormalisation) or ``"sigmoid"`` (sigmoid
            scores, top-k over scores + a correction bias, renormalised; DeepSeek-V3 style).
        norm_topk_prob: renormalise the k selected weights to sum to 1 (softmax scoring).
        activation: name in transformers' ``ACT2FN`` (``"silu"``, ``"gelu"``, ``"relu"``, ...).
        shared_expert_size: width of an always-on shared expert MLP (0: none).
    """

    hidden_size: int
    num_experts: int
    top_k: int = 2
    intermediate_size: int = 0
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    activation: str = "silu"
    shared_expert_size: int = 0
    _experts_implementation: str = "grouped_mm"

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0:
            self.intermediate_size = self.hidden_size
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring={self.scoring!r} must be 'softmax' or 'sigmoid'")
        if self.activation not in ACT2FN:
            raise ValueError(f"activation={self.activation!r} is not in transformers' ACT2FN")


@use_experts_implementation
class FusedExperts(nn.Module):
    """E gated MLP experts in fused 3-D parameters (transformers' standard experts layout)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * config.intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, config.intermediate_size))
        self.act_fn = ACT2FN[config.activation]
        std = 1.0 / config.hidden_size**0.5
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=1.0 / config.intermediate_size**0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Reference loop (the ``"eager"`` implementation); ``grouped_mm`` is transformers' own."""
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if expert < 0 or expert >= self.num_experts:
                continue
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class TopKRouter(nn.Module):
    """Linear router returning ``(logits [T,E], weights [T,k], index [T,k])`` like transformers' routers."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.scoring = config.scoring
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=1.0 / config.hidden_size**0.5)
        if config.scoring == "sigmoid":  # DeepSeek-V3 structure with a single group
            self.e_score_correction_bias = nn.Buffer(torch.zeros(config.num_experts))
            self.num_group, self.topk_group, self.routed_scaling_factor = 1, 1, 1.0

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if self.scoring == "softmax":
            logits = F.linear(hidden_states, self.weight)
            probs = F.softmax(logits, dtype=torch.float, dim=-1)
            top, index = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), index
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, 1, self.num_experts).topk(min(2, self.num_experts), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=1, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, 1, self.num_experts).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, index


class MoE(nn.Module):
    """Router → fused experts (→ + shared expert). ``forward(x [..., H]) -> [..., H]``."""

    def __init__(self, config: MoEConfig | None = None, **kwargs) -> None:
        super().__init__()
        config = config or MoEConfig(**kwargs)
        self.config = config
        self.gate = TopKRouter(config)
        self.experts = FusedExperts(config)
        self.shared_expert = None
        if config.shared_expert_size:
            self.shared_expert = nn.Sequential(
                nn.Linear(config.hidden_size, config.shared_expert_size),
                ACT2FN[config.activation],
                nn.Linear(config.shared_expert_size, config.hidden_size),
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.reshape(shape)
