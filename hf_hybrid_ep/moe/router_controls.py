"""Router controls that act on expert *selection*: temperature, aux-loss-free bias updates, device-load
factors and forced balanced routing (all off by default).

A router with controls on has its forward replaced by its proven selection rule
(:mod:`hf_hybrid_ep.moe.router_rules`) with the adjustments applied; the combine weights stay the router's.
After every optimizer step :meth:`RouterControls.after_step` moves the selection biases by the step's world
loads (every rank applies the same update whatever the layout) and updates the running per-rank load
estimate behind the device-load factors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import HybridEPConfig
from ..errors import HybridEPConfigError
from .router_rules import SelectionRule, find_router, match_rule, route


@dataclass
class RouterControls:
    """The selection controls of one MoE layer's router. Every tensor lives on the router's device, from
    :func:`install_router_controls` on: a forward and an update read and write them there, with no host copy.

    Attributes:
        ep_rank_of_expert: ``[E]`` primary EP rank of each expert (the device-load factors act per rank).
        selection_bias: ``[E]`` selection-only bias (routers without a native correction bias).
        rank_load: ``[ep]`` float64 running estimate of each EP rank's share of the assignments.
        device_factor: ``[E]`` the device-load adjustment of each expert's selection score.
    """

    router: nn.Module
    rule: SelectionRule
    top_k: int
    num_experts: int
    ep_rank_of_expert: torch.Tensor
    ep_degree: int
    selection_bias: torch.Tensor | None = None
    rank_load: torch.Tensor | None = None
    device_factor: torch.Tensor | None = None

    def selection_adjust(self) -> torch.Tensor | None:
        """``[E]`` additive adjustment of selection scores: selection bias and device-load factors."""
        adjust = self.selection_bias
        if self.rank_load is not None:
            adjust = self.device_factor if adjust is None else adjust + self.device_factor
        return adjust

    def _set_device_factor(self, device_load_factors: float | None) -> None:
        ratio = self.rank_load / self.rank_load.mean()
        self.device_factor = (-((device_load_factors or 0.0) * (ratio - 1.0)))[self.ep_rank_of_expert].float()

    def _per_rank(self, loads: torch.Tensor) -> torch.Tensor:
        """``[ep]`` float64: ``loads [E]`` summed per primary EP rank."""
        per_rank = torch.zeros(self.ep_degree, dtype=torch.float64, device=self.ep_rank_of_expert.device)
        return per_rank.scatter_add_(0, self.ep_rank_of_expert, loads.to(torch.float64))

    def after_step(self, loads: torch.Tensor, config: HybridEPConfig) -> None:
        """Apply one optimizer step's world loads ``[E]`` (on the router's device): bias update
        (``bias_update_rate``) and the running per-rank load estimate (``device_load_factors``). A step without
        assignments changes nothing (its bias delta is zero, the estimate is kept), decided on the device."""
        if config.bias_update_rate is not None:
            delta = config.bias_update_rate * torch.sign(loads.mean() - loads).float()
            if self.selection_bias is not None:
                self.selection_bias += delta
            else:
                with torch.no_grad():
                    bias = self.router.e_score_correction_bias
                    bias += delta.to(bias.device, bias.dtype)
        if self.rank_load is not None:
            per_rank = self._per_rank(loads)
            total = per_rank.sum()
            self.rank_load = torch.where(total > 0, 0.9 * self.rank_load + 0.1 * per_rank / total, self.rank_load)
            self._set_device_factor(config.device_load_factors)

    def remap(self, owner: list[int], total: torch.Tensor, device_load_factors: float | None = None) -> None:
        """A new primary EP rank per expert (online rebalancing): the device-load estimate is re-derived from
        all steps' loads ``total [E]`` under the new owners, and the device factors from it."""
        device = self.ep_rank_of_expert.device
        self.ep_rank_of_expert = torch.tensor(owner, dtype=torch.long, device=device)
        if self.rank_load is not None:
            per_rank = self._per_rank(total.to(device))
            all_steps = per_rank.sum()
            self.rank_load = torch.where(all_steps > 0, per_rank / all_steps,
                                         torch.full_like(per_rank, 1.0 / self.ep_degree))
            self._set_device_factor(device_load_factors)


def install_router_controls(model: nn.Module, layers: list, config: HybridEPConfig) -> None:
    """With selection controls on (:meth:`HybridEPConfig.selection_controls_on`), give every EP layer its
    :class:`RouterControls` (``layer.controls``) and replace its router's forward with the proven selection
    rule. Raises before changing anything when a router is missing or no rule reproduces it."""
    if not config.selection_controls_on():
        return
    controls = []
    for layer in layers:
        found = find_router(model, layer.name, layer.num_experts)
        if found is None:
            raise HybridEPConfigError(f"router controls: no router found next to {layer.name}")
        name, router = found
        rule = match_rule(router, int(router.top_k), router.weight.shape[1])
        if rule is None:
            raise HybridEPConfigError(
                f"router controls: {name} ({type(router).__name__}) matches no selection rule "
                "bit for bit; router_temperature, device_load_factors, bias_update_rate and "
                "force_balanced_routing are unavailable for this model"
            )
        owner = torch.tensor([layer.table.holders(e)[0] for e in range(layer.num_experts)], device=router.weight.device)
        controls.append(RouterControls(router, rule, int(router.top_k), layer.num_experts, owner,
                                       layer.table.ep_degree))
    for layer, c in zip(layers, controls, strict=True):
        device = c.ep_rank_of_expert.device
        if config.bias_update_rate is not None and c.rule.kind != "sigmoid_group":
            c.selection_bias = torch.zeros(layer.num_experts, dtype=torch.float32, device=device)
        if config.device_load_factors:
            c.rank_load = torch.full((c.ep_degree,), 1.0 / c.ep_degree, dtype=torch.float64, device=device)
            c.device_factor = torch.zeros(layer.num_experts, dtype=torch.float32, device=device)
        c.router.forward = _router_forward(c, config)
        layer.controls = c


def _router_forward(controls: RouterControls, config: HybridEPConfig) -> Callable:
    rule, router, k = controls.rule, controls.router, controls.top_k

    def forward(hidden_states: torch.Tensor):
        if not config.force_balanced_routing:
            adjust = controls.selection_adjust()
            return route(rule, router, hidden_states, k, adjust, config.router_temperature)
        logits = rule.logits(router, hidden_states)
        scaled = logits if config.router_temperature is None else logits / config.router_temperature
        scores = rule.scores(scaled)
        tokens = scores.shape[0]
        index = (torch.arange(tokens * k, device=scores.device) % controls.num_experts).view(tokens, k)
        return logits, rule.weights(router, scaled, scores, index), index

    return forward
