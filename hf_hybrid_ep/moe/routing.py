"""Router controls and expert-load accounting.

Selection happens inside each family's router. To act on it without forking model code, a router is
matched to one of a few **selection rules** keyed by its structure — softmax-then-top-k (with or
without renormalisation), top-k-then-softmax, sigmoid with correction bias and group-limited top-k —
and the match is *proven* when the controls are installed: the rule must reproduce the router's
``(logits, weights, index)`` bit for bit on a probe batch at neutral settings, or the controls are
refused for that router. Load accounting needs no rule: it reads the indices the experts receive.

Per layer, a :class:`LayerRouting` counts tokens per expert (local, since the last optimizer step),
dropped assignments and router entropy; :func:`on_optimizer_step` all-reduces them over the world
once per step (so every rank applies the same aux-loss-free update whatever the layout), updates
biases and the running device-load estimate, and accumulates the window that the metrics report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import HybridEPConfig
from ..errors import HybridEPConfigError

# ---------------------------------------------------------------------------------------------- rules


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
    parent_name, _, _ = experts_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    for name, child in parent.named_children():
        weight = getattr(child, "weight", None)
        if torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[0] == num_experts and hasattr(child, "top_k"):
            return f"{parent_name}.{name}", child
    return None


# ---------------------------------------------------------------------------------------------- per layer


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes forwards there)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class LayerRouting:
    """Routing state and load counters of one MoE layer (this rank's view until all-reduced)."""

    num_experts: int
    ep_rank_of_expert: torch.Tensor  # [E] primary EP rank of each expert
    ep_degree: int
    router_name: str | None = None
    router: nn.Module | None = None
    rule: SelectionRule | None = None
    top_k: int = 0
    selection_bias: torch.Tensor | None = None  # [E] selection-only bias (non-native)
    rank_load: torch.Tensor | None = None  # [ep] running estimate (fraction of assignments)
    # since the last optimizer step (local): counts [E], dropped, assignments, entropy sum, token count
    step: torch.Tensor = field(default=None)  # type: ignore[assignment]
    # window since the last metrics report (world totals, filled by on_optimizer_step)
    window: torch.Tensor = field(default=None)  # type: ignore[assignment]
    window_steps: int = 0
    last_active_step: torch.Tensor = field(default=None)  # type: ignore[assignment]
    total: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [E] all steps, world totals
    aux_loss: torch.Tensor | None = None

    coactivation: bool = False  # also count expert pairs chosen by the same token

    def __post_init__(self) -> None:
        size = self.num_experts + 4 + (self.num_experts**2 if self.coactivation else 0)
        self.step = torch.zeros(size, dtype=torch.float64)
        self.window = torch.zeros(size, dtype=torch.float64)
        self.last_active_step = torch.zeros(self.num_experts, dtype=torch.long)
        self.total = torch.zeros(self.num_experts, dtype=torch.float64)

    # [0:E] tokens per expert, [E] dropped assignments, [E+1] kept assignments, [E+2] entropy sum,
    # [E+3] router tokens; with coactivation, [E+4 : E+4+E²] the pair counts C[a·E + b] (a < b) of
    # tokens that chose both a and b (kept assignments only), reduced with the rest in one all-reduce
    # Counters stay on the device of the routing tensors (no host sync per layer); on_optimizer_step
    # moves them once per step.
    def _on(self, device: torch.device) -> torch.Tensor:
        if self.step.device != device:
            self.step = self.step.to(device)
        return self.step

    def count(self, index: torch.Tensor, dropped: torch.Tensor | int = 0) -> None:
        if _in_backward():
            return
        step = self._on(index.device)
        flat = index.reshape(-1).long()
        kept = (flat >= 0) & (flat < self.num_experts)  # ids outside [0, E) are reported by the agreement
        # A fixed-size scatter, not bincount: no device→host synchronisation on CUDA.
        step[: self.num_experts].scatter_add_(0, torch.where(kept, flat, 0), kept.double())
        step[self.num_experts] += dropped
        step[self.num_experts + 1] += kept.sum()
        if self.coactivation and index.dim() >= 1 and index.shape[-1] > 1:
            self._count_pairs(step, index.reshape(-1, index.shape[-1]))

    def _count_pairs(self, step: torch.Tensor, index: torch.Tensor) -> None:
        """Add the token's expert pairs (``a < b``, both kept) of ``index [T, k]`` to the E×E counter:
        one fixed-size scatter over ``T·k(k−1)/2`` keys, on the routing tensors' device."""
        E, k = self.num_experts, index.shape[1]
        first, second = torch.triu_indices(k, k, 1, device=index.device)
        a, b = index[:, first].long(), index[:, second].long()  # [T, k(k-1)/2]
        valid = (a >= 0) & (b >= 0) & (a < E) & (b < E) & (a != b)
        keys = torch.where(valid, torch.minimum(a, b) * E + torch.maximum(a, b), 0).reshape(-1)
        step[E + 4 :].scatter_add_(0, keys, valid.reshape(-1).double())

    def coactivation_matrix(self, counts: torch.Tensor) -> torch.Tensor:
        """The symmetric ``[E, E]`` pair counts (zero diagonal) from a counter vector like ``window``."""
        E = self.num_experts
        upper = counts[E + 4 : E + 4 + E * E].view(E, E)
        return upper + upper.T

    def count_entropy(self, logits: torch.Tensor) -> None:
        if _in_backward():
            return
        step = self._on(logits.device)
        with torch.no_grad():
            logp = F.log_softmax(logits.float(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
        step[self.num_experts + 2] += entropy.double().sum()
        step[self.num_experts + 3] += entropy.numel()

    def remap(self, owner: list[int], device_load_factors: float | None = None) -> None:
        """A new primary EP rank per expert (online rebalancing): the device-load estimate is re-derived
        from all steps' loads under the new owners, and the device factors from it."""
        self.ep_rank_of_expert = torch.tensor(owner, dtype=torch.long)
        if self.rank_load is not None:
            per_rank = torch.zeros(self.ep_degree, dtype=torch.float64)
            per_rank.scatter_add_(0, self.ep_rank_of_expert, self.total)
            total = per_rank.sum()
            self.rank_load = per_rank / total if total > 0 else torch.full_like(per_rank, 1.0 / self.ep_degree)
            ratio = self.rank_load / self.rank_load.mean()
            self._device_factor = (-(device_load_factors or 0.0) * (ratio - 1.0))[self.ep_rank_of_expert].float()

    def selection_adjust(self, device: torch.device) -> torch.Tensor | None:
        """[E] additive adjustment of selection scores: selection bias and device-load factors."""
        adjust = None
        if self.selection_bias is not None:
            adjust = self.selection_bias.to(device)
        if self.rank_load is not None:
            factor = self._device_factor.to(device)
            adjust = factor if adjust is None else adjust + factor
        return adjust

    _device_factor: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------- install


def install_router_controls(model: nn.Module, layers: list, config: HybridEPConfig) -> None:
    """Attach a :class:`LayerRouting` to every EP layer and, if selection controls are on, replace the
    router's forward with its proven selection rule. Raises before changing anything when a control is
    requested for a router that no rule reproduces."""
    plans = []
    for layer in layers:
        found = find_router(model, layer.name, layer.num_experts)
        owner = torch.tensor([layer.table.holders(e)[0] for e in range(layer.num_experts)])
        routing = LayerRouting(layer.num_experts, owner, layer.table.ep_degree,
                               coactivation=bool(config.coactivation_stats))
        if found is not None:
            routing.router_name, routing.router = found
            routing.top_k = int(found[1].top_k)
        if config.selection_controls_on():
            if found is None:
                raise HybridEPConfigError(f"router controls: no router found next to {layer.name}")
            hidden = found[1].weight.shape[1]
            rule = match_rule(found[1], routing.top_k, hidden)
            if rule is None:
                raise HybridEPConfigError(
                    f"router controls: {routing.router_name} ({type(found[1]).__name__}) matches no selection rule "
                    "bit for bit; router_temperature, device_load_factors, bias_update_rate and "
                    "force_balanced_routing are unavailable for this model"
                )
            routing.rule = rule
        plans.append(routing)
    for layer, routing in zip(layers, plans, strict=True):
        layer.routing = routing
        router = routing.router
        if router is not None:
            router.register_forward_hook(_make_observer(layer, config))
        if routing.rule is not None:
            if config.bias_update_rate is not None and routing.rule.kind != "sigmoid_group":
                routing.selection_bias = torch.zeros(layer.num_experts, dtype=torch.float32)
            if config.device_load_factors:
                routing.rank_load = torch.full((routing.ep_degree,), 1.0 / routing.ep_degree, dtype=torch.float64)
                routing._device_factor = torch.zeros(layer.num_experts, dtype=torch.float32)
            router.forward = _make_router_forward(router, routing, config)


def _make_router_forward(router: nn.Module, routing: LayerRouting, config: HybridEPConfig) -> Callable:
    rule, k = routing.rule, routing.top_k

    def forward(hidden_states: torch.Tensor):
        if not config.force_balanced_routing:
            adjust = routing.selection_adjust(hidden_states.device)
            return route(rule, router, hidden_states, k, adjust, config.router_temperature)
        logits = rule.logits(router, hidden_states)
        scaled = logits if config.router_temperature is None else logits / config.router_temperature
        scores = rule.scores(scaled)
        tokens = scores.shape[0]
        index = (torch.arange(tokens * k, device=scores.device) % routing.num_experts).view(tokens, k)
        return logits, rule.weights(router, scaled, scores, index), index

    return forward


def _make_observer(layer, config: HybridEPConfig) -> Callable:
    """Forward hook on the router: entropy and the auxiliary losses from its logits and choices."""

    def hook(module, args, output):
        logits, _, index = output
        routing: LayerRouting = layer.routing
        routing.count_entropy(logits)
        if not (config.aux_loss_coef or config.z_loss_coef) or not torch.is_grad_enabled():
            return
        aux = logits.new_zeros((), dtype=torch.float32)
        if config.aux_loss_coef:
            probs = F.softmax(logits.float(), dim=-1)
            tokens_per_expert = torch.zeros(routing.num_experts, device=logits.device)
            tokens_per_expert.scatter_add_(0, index.reshape(-1), torch.ones(index.numel(), device=logits.device))
            fraction = tokens_per_expert / index.numel()
            aux = aux + config.aux_loss_coef * routing.num_experts * (fraction * probs.mean(0)).sum()
        if config.z_loss_coef:
            aux = aux + config.z_loss_coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        routing.aux_loss = aux if routing.aux_loss is None else routing.aux_loss + aux

    return hook


def add_aux_losses_hook(model: nn.Module, layers: list) -> None:
    """Add the layers' auxiliary losses (if any were computed) to the model output's ``loss``."""

    def hook(module, args, kwargs, output):
        total = None
        for layer in layers:
            routing = getattr(layer, "routing", None)
            if routing is not None and routing.aux_loss is not None:
                total = routing.aux_loss if total is None else total + routing.aux_loss
                routing.aux_loss = None
        if total is not None and getattr(output, "loss", None) is not None:
            output.loss = output.loss + total.to(output.loss.dtype)
        return output

    model.register_forward_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------- capacity


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


# ---------------------------------------------------------------------------------------------- per step


def on_optimizer_step(model: nn.Module, config: HybridEPConfig, layers: list, mesh, step: int,
                      rebalancer=None) -> None:
    """Once per optimizer step: reduce the step's counters over the world, update selection biases,
    device-load estimates, the metrics window and the rebalancer's window. Collective: call on every rank."""
    routings = [layer.routing for layer in layers if getattr(layer, "routing", None) is not None]
    if not routings:
        return
    from ..parallel.mesh import current_device

    device = current_device(mesh)
    stacked = torch.cat([r.step.to(device) for r in routings])
    if mesh.world_group is not None:
        dist.all_reduce(stacked, group=mesh.world_group)
    stacked = stacked.cpu()
    if rebalancer is not None:
        rebalancer.step_done()
    offset = 0
    names = [layer.name for layer in layers if getattr(layer, "routing", None) is not None]
    for name, routing in zip(names, routings, strict=True):
        n = routing.step.numel()
        totals = stacked[offset : offset + n]
        offset += n
        if rebalancer is not None:
            rebalancer.record(name, totals)
        loads = totals[: routing.num_experts]
        routing.window += totals
        routing.total += loads
        routing.window_steps += 1
        routing.last_active_step[loads > 0] = step
        routing.step.zero_()
        if config.bias_update_rate is not None and routing.rule is not None and loads.sum() > 0:
            delta = config.bias_update_rate * torch.sign(loads.mean() - loads).float()
            if routing.selection_bias is not None:
                routing.selection_bias += delta
            else:
                with torch.no_grad():
                    bias = routing.router.e_score_correction_bias
                    bias += delta.to(bias.device, bias.dtype)
        if routing.rank_load is not None and loads.sum() > 0:
            per_rank = torch.zeros(routing.ep_degree, dtype=torch.float64)
            per_rank.scatter_add_(0, routing.ep_rank_of_expert, loads)
            routing.rank_load = 0.9 * routing.rank_load + 0.1 * per_rank / per_rank.sum()
            ratio = routing.rank_load / routing.rank_load.mean()
            factor = -(config.device_load_factors * (ratio - 1.0))
            routing._device_factor = factor[routing.ep_rank_of_expert].float()
