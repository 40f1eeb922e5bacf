"""Selection rules: how a router turns hidden states into ``(logits, weights, index)``, proven per router.

Selection happens inside each family's router. To act on it without forking model code, a router is
matched to one of a few **selection rules** keyed by its structure — softmax-then-top-k (with or
without renormalisation), top-k-then-softmax, sigmoid with correction bias and group-limited top-k —
and the match is *proven*: the rule must reproduce the router's ``(logits, weights, index)`` bit for bit on
a probe batch at neutral settings (:func:`match_rule`). :func:`find_router` finds the router beside an
experts module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .discovery import block_name


@dataclass(frozen=True)
class SelectionRule:
    """How a router turns hidden states into ``(logits, weights, index)``.

    kind: ``softmax_topk`` | ``topk_softmax`` | ``sigmoid_group``.
    fp32_logits: compute the router linear in fp32 (DeepSeek-V3 does).
    renormalize: divide the k selected weights by their sum (softmax_topk, sigmoid_group).
    cast_back: cast the weights to the logits' dtype (softmax_topk).
    """

    kind: str
    fp32_logits: bool = False
    renormalize: bool = False
    cast_back: bool = False

    def logits(self, router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = router.weight, getattr(router, "bias", None)
        hidden = hidden.reshape(-1, weight.shape[1])
        if self.fp32_logits:
            return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
        return F.linear(hidden, weight, bias)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert scores that weights are gathered from (probabilities, sigmoid, or the logits)."""
        if self.kind == "softmax_topk":
            return F.softmax(logits, dim=-1, dtype=torch.float)
        if self.kind == "sigmoid_group":
            return logits.sigmoid()
        return logits

    def choose(self, router: nn.Module, scores: torch.Tensor, adjust: torch.Tensor | None, k: int) -> torch.Tensor:
        """Top-k expert ids from ``scores`` (+ native correction bias) adjusted by ``adjust`` [E]."""
        if self.kind == "sigmoid_group":
            choice = scores + router.e_score_correction_bias
            if adjust is not None:
                choice = choice + adjust
            groups, experts = router.num_group, choice.shape[-1]
            group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
            return torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        choice = scores if adjust is None else scores + adjust.to(scores.dtype)
        return torch.topk(choice, k, dim=-1)[1]

    def weights(self, router: nn.Module, logits: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        selected = scores.gather(1, index)
        if self.kind == "topk_softmax":
            return F.softmax(selected, dim=1, dtype=selected.dtype)
        if self.kind == "sigmoid_group":
            if self.renormalize:
                selected = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
            return selected * router.routed_scaling_factor
        if self.renormalize:
            selected = selected / selected.sum(dim=-1, keepdim=True)
        return selected.to(logits.dtype) if self.cast_back else selected


def _candidates(router: nn.Module) -> list[SelectionRule]:
    if all(hasattr(router, a) for a in ("e_score_correction_bias", "num_group", "topk_group", "routed_scaling_factor")):
        return [SelectionRule("sigmoid_group", fp32_logits=True, renormalize=r) for r in (True, False)]
    rules = [SelectionRule("topk_softmax", fp32_logits=f) for f in (False, True)]
    for fp32 in (False, True):
        for renorm in (True, False):
            for cast in (False, True):
                rules.append(SelectionRule("softmax_topk", fp32_logits=fp32, renormalize=renorm, cast_back=cast))
    return rules


def route(rule: SelectionRule, router: nn.Module, hidden: torch.Tensor, k: int, adjust=None, temperature=None):
    """``(logits, weights, index)`` of ``router`` under ``rule``; neutral when adjust/temperature are None."""
    logits = rule.logits(router, hidden)
    scaled = logits if temperature is None else logits / temperature
    scores = rule.scores(scaled)
    index = rule.choose(router, scores, adjust, k)
    return logits, rule.weights(router, scaled, scores, index), index


def match_rule(router: nn.Module, top_k: int, hidden_size: int, probe_tokens: int = 64) -> SelectionRule | None:
    """The selection rule that reproduces ``router`` bit for bit on a random probe batch, if any."""
    weight = router.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(probe_tokens, hidden_size, generator=g).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            want = router(probe)
        except (TypeError, RuntimeError, ValueError):  # e.g. a hash router that needs input_ids
            return None
        if not (isinstance(want, tuple) and len(want) == 3 and all(torch.is_tensor(t) for t in want)):
            return None
        for rule in _candidates(router):
            try:
                got = route(rule, router, probe, top_k)
            except (AttributeError, RuntimeError, TypeError, ValueError):
                continue
            if all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                return rule
    return None


def find_router(model: nn.Module, experts_name: str, num_experts: int) -> tuple[str, nn.Module] | None:
    """The router next to an experts module: a sibling whose 2-D ``weight`` has ``num_experts`` rows."""
    parent_name = block_name(experts_name)
    parent = model.get_submodule(parent_name)
    for name, child in parent.named_children():
        weight = getattr(child, "weight", None)
        if torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[0] == num_experts and hasattr(child, "top_k"):
            return f"{parent_name}.{name}", child
    return None
