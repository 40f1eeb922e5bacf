"""Router load-balancing losses, over this rank's micro-batch or over the global batch of a micro-step.

Two losses read the routers:

* the engine's own (``aux_loss_coef`` / ``z_loss_coef``): the Switch load-balancing loss of every MoE layer from
  its router's logits and the experts it chose, and the router z-loss, added to the output's ``loss``;
* the model's own (``output_router_logits`` in its config): transformers' ``load_balancing_loss_func`` over the
  routers' logits of all layers together, which the model (or TRL's fused LM head) returns as ``aux_loss`` and
  adds to ``loss``. The engine recomputes it only with ``aux_loss_scope="global"``.

A forward hook on each router records what this forward's tokens contribute (:class:`RouterStats`); a forward
hook on the model forms the losses once its forward is done. ``aux_loss_scope="local"`` forms them from this
rank's statistics alone, as every data-parallel run does. ``"global"`` all-reduces every statistic over the world
first (one call for all of them), so the value on every rank is the loss of the micro-step's global batch — every
rank's micro-batch together — and each rank back-propagates ``world × `` its own tokens' share of it: every one
of these losses is linear in the probability sums once the counts are fixed, so the shares add up to the global
loss, and the world-averaged gradients (DDP's and the engine's) are exactly the global loss's gradients.
Forwards under ``no_grad`` (evaluation, generation, a reference model) keep the local losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import HybridEPConfig
from ..errors import HybridEPConfigError
from .load import in_backward

# The model's own aux loss and the engine's recomputation of it may differ by round-off only.
MODEL_AUX_REL_TOL = 1e-3


@dataclass
class RouterStats:
    """What some tokens contribute to a load-balancing loss.

    counts: ``[E]`` expert assignments (float, no gradient); probs: ``[E]`` routing probabilities summed over
    the tokens (differentiable); tokens: the token count (0-d); z: the summed squared log-partition of the
    router logits (0-d, differentiable).
    """

    counts: torch.Tensor
    probs: torch.Tensor
    tokens: torch.Tensor
    z: torch.Tensor

    def flat(self) -> torch.Tensor:
        return torch.cat([self.counts.float(), self.probs.detach().float(), self.tokens.float().reshape(1),
                          self.z.detach().float().reshape(1)])

    @classmethod
    def unflat(cls, flat: torch.Tensor, num_experts: int) -> RouterStats:
        E = num_experts
        return cls(flat[:E], flat[E : 2 * E], flat[2 * E], flat[2 * E + 1])


def form(losses: list[tuple[Callable[[RouterStats], torch.Tensor], RouterStats]],
         group: dist.ProcessGroup | None, world: int) -> torch.Tensor:
    """``Σ loss(stats)`` over this rank's tokens (``group`` ``None``), or over the world's: the value of the global
    batch on every rank, with gradients ``world ×`` this rank's share (every ``loss`` must be linear in
    ``probs`` and ``z`` for fixed ``counts`` and ``tokens``). Collective over ``group``."""
    if group is None:
        total = losses[0][1].probs.new_zeros(())
        for loss, stats in losses:
            total = total + loss(stats)
        return total
    flat = torch.cat([stats.flat() for _, stats in losses])
    dist.all_reduce(flat, group=group)
    value = share = flat.new_zeros(())
    offset = 0
    for loss, stats in losses:
        n = stats.counts.numel()
        total = RouterStats.unflat(flat[offset : offset + 2 * n + 2], n)
        offset += 2 * n + 2
        value = value + loss(total)
        share = share + loss(RouterStats(total.counts, stats.probs.float(), total.tokens, stats.z.float()))
    return value + world * (share - share.detach())


class LayerAuxLoss:
    """The engine's router losses of one MoE layer: the Switch load-balancing loss
    ``coef · E · Σ_e (counts_e / (T·k)) · (probs_e / T)`` and the z-loss ``coef_z · z / T``."""

    def __init__(self, num_experts: int, config: HybridEPConfig) -> None:
        self.num_experts, self.config = num_experts, config
        self.pending: list[RouterStats] = []

    def observe(self, module: nn.Module, args, output) -> None:
        """Router forward hook: record this forward's statistics from ``(logits [T, E], weights, index [T, k])``."""
        if not torch.is_grad_enabled() or in_backward():
            return
        logits, _, index = output
        logits = logits.float()
        counts = torch.zeros(self.num_experts, device=logits.device)
        counts.scatter_add_(0, index.reshape(-1), torch.ones(index.numel(), device=logits.device))
        z = torch.logsumexp(logits, dim=-1).pow(2).sum() if self.config.z_loss_coef else logits.new_zeros(())
        probs = F.softmax(logits, dim=-1).sum(0) if self.config.aux_loss_coef else logits.new_zeros(self.num_experts)
        tokens = logits.new_full((), float(index.shape[0]))
        self.pending.append(RouterStats(counts, probs, tokens, z))
        self.k = index.shape[-1]

    def loss(self, stats: RouterStats) -> torch.Tensor:
        config, tokens = self.config, stats.tokens.clamp(min=1)
        out = stats.z.new_zeros(())
        if config.aux_loss_coef:
            out = out + config.aux_loss_coef * self.num_experts * (stats.counts / (tokens * self.k) * stats.probs / tokens).sum()
        if config.z_loss_coef:
            out = out + config.z_loss_coef * stats.z / tokens
        return out


class ModelAuxLoss:
    """The model's own load-balancing loss, recomputed over the global batch: transformers'
    ``load_balancing_loss_func`` (every layer's router logits together; a token's k experts from the softmax of its
    logits; padding left out by the attention mask) — ``E · Σ_e (counts_e / N) · (probs_e / N)``.

    Args:
        num_experts / top_k: the model config's. coef: the coefficient the model adds ``aux_loss`` to ``loss`` with.
    """

    def __init__(self, num_experts: int, top_k: int, coef: Callable[[], float]) -> None:
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.logits: list[torch.Tensor] = []
        self.checked = False

    def observe(self, module: nn.Module, args, output) -> None:
        """Router forward hook: keep this forward's logits (``output[0]``, what transformers records)."""
        if not in_backward():
            self.logits.append(output[0])

    def stats(self, attention_mask: torch.Tensor | None) -> RouterStats:
        E, k = self.num_experts, self.top_k
        device = self.logits[0].device
        counts, probs = torch.zeros(E, device=device), torch.zeros(E, device=device)
        tokens = torch.zeros((), device=device)
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        for logits in self.logits:
            weights = F.softmax(logits, dim=-1)
            chosen = torch.topk(weights, k, dim=-1)[1].reshape(-1)
            rows = torch.ones(logits.shape[0], device=device) if mask is None else mask
            counts = counts + torch.zeros(E, device=device).scatter_add_(0, chosen, rows.repeat_interleave(k))
            probs = probs + (weights.float() * rows.unsqueeze(-1)).sum(0)
            tokens = tokens + rows.sum()
        return RouterStats(counts, probs, tokens, probs.new_zeros(()))

    def loss(self, stats: RouterStats) -> torch.Tensor:
        tokens = stats.tokens
        return self.num_experts * (stats.counts / tokens * stats.probs / tokens).sum()

    def replace(self, output, attention_mask: torch.Tensor | None, group, world: int) -> None:
        """Put the global-batch loss in ``output.aux_loss`` (and its difference, times the coefficient, in
        ``output.loss``). The first time, check that the model's own value is this formula's on the local tokens."""
        stats = self.stats(attention_mask)
        if not self.checked:
            mine, theirs = self.loss(stats).item(), float(output.aux_loss.detach())
            if not math.isclose(mine, theirs, rel_tol=MODEL_AUX_REL_TOL, abs_tol=1e-6):
                raise HybridEPConfigError(
                    f"aux_loss_scope='global': the model's aux_loss ({theirs:.6g}) is not transformers' "
                    f"load_balancing_loss_func over its routers' logits ({mine:.6g}), so the engine cannot form it "
                    "over the global batch; use aux_loss_scope='local'")
            self.checked = True
        aux = form([(self.loss, stats)], group, world).to(output.aux_loss.dtype)
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + self.coef() * (aux - output.aux_loss).to(output.loss.dtype)
        output.aux_loss = aux


def add_aux_losses(model: nn.Module, layers: list, config: HybridEPConfig, model_aux: ModelAuxLoss | None,
                   group: dist.ProcessGroup | None, world: int) -> None:
    """Record the routers' statistics (``layer.load.router``) and, after each forward of ``model``, add the
    engine's router losses to the output's ``loss`` and (``model_aux``) put the model's own over the global batch
    in its ``aux_loss``. ``group``: all-reduce over it (``aux_loss_scope="global"``), or ``None``."""
    losses = []
    for layer in layers:
        if layer.load.router is None:
            continue
        if config.aux_loss_coef or config.z_loss_coef:
            loss = LayerAuxLoss(layer.num_experts, config)
            layer.load.router.register_forward_hook(loss.observe)
            losses.append(loss)
        if model_aux is not None:
            layer.load.router.register_forward_hook(model_aux.observe)

    def before(module, args):
        for loss in losses:
            loss.pending = []
        if model_aux is not None:
            model_aux.logits = []

    def after(module, args, kwargs, output):
        pending = [(loss.loss, stats) for loss in losses for stats in loss.pending]
        if pending and torch.is_grad_enabled() and getattr(output, "loss", None) is not None:
            total = form(pending, group, world)
            output.loss = output.loss + total.to(output.loss.dtype)
        if (model_aux is not None and model_aux.logits and torch.is_grad_enabled()
                and getattr(output, "aux_loss", None) is not None):
            if len(args) > 1:
                raise HybridEPConfigError("aux_loss_scope='global' needs attention_mask passed by keyword")
            model_aux.replace(output, kwargs.get("attention_mask"), group, world)
        before(module, args)
        return output

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after, with_kwargs=True)
