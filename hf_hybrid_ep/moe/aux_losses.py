"""Router losses added to the training loss: the Switch load-balancing loss and the router z-loss
(``aux_loss_coef`` / ``z_loss_coef``), computed on each rank's micro-batch from its router's logits and choices.

A forward hook on each router forms the layer's loss; a forward hook on the model adds the layers' losses to
the output's ``loss``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HybridEPConfig


class LayerAuxLoss:
    """The router loss of one MoE layer since the model's last forward (``None``: none yet)."""

    def __init__(self, num_experts: int, config: HybridEPConfig) -> None:
        self.num_experts, self.config = num_experts, config
        self.pending: torch.Tensor | None = None

    def observe(self, module: nn.Module, args, output) -> None:
        """Router forward hook: add this forward's loss from ``(logits [T, E], weights, index [T, k])``."""
        if not torch.is_grad_enabled():
            return
        logits, _, index = output
        config = self.config
        aux = logits.new_zeros((), dtype=torch.float32)
        if config.aux_loss_coef:
            probs = F.softmax(logits.float(), dim=-1)
            tokens_per_expert = torch.zeros(self.num_experts, device=logits.device)
            tokens_per_expert.scatter_add_(0, index.reshape(-1), torch.ones(index.numel(), device=logits.device))
            fraction = tokens_per_expert / index.numel()
            aux = aux + config.aux_loss_coef * self.num_experts * (fraction * probs.mean(0)).sum()
        if config.z_loss_coef:
            aux = aux + config.z_loss_coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        self.pending = aux if self.pending is None else self.pending + aux


def add_aux_losses(model: nn.Module, layers: list, config: HybridEPConfig) -> None:
    """Compute the router losses of every layer whose router was found (``layer.load.router``) and add them
    to the model output's ``loss``."""
    losses = []
    for layer in layers:
        if layer.load.router is not None:
            loss = LayerAuxLoss(layer.num_experts, config)
            layer.load.router.register_forward_hook(loss.observe)
            losses.append(loss)

    def hook(module, args, kwargs, output):
        total = None
        for loss in losses:
            if loss.pending is not None:
                total = loss.pending if total is None else total + loss.pending
                loss.pending = None
        if total is not None and getattr(output, "loss", None) is not None:
            output.loss = output.loss + total.to(output.loss.dtype)
        return output

    model.register_forward_hook(hook, with_kwargs=True)
