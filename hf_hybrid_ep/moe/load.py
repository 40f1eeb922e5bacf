"""Expert-load accounting: tokens per expert, dropped assignments, router entropy, expert pairs.

Per layer, an :class:`ExpertLoad` counts on the device (no host synchronisation per layer) what this rank's
tokens chose since the last optimizer step; :func:`reduce_step_loads` all-reduces every layer's counters over
the world once per step, so the metrics, the router controls and the rebalancer see the same numbers
whatever the layout. It reads the indices the experts receive, so it needs no selection rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.mesh import HybridMesh, current_device
from ..parallel.watchdog import watched


def in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes forwards there)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class ExpertLoad:
    """Load counters of one MoE layer: this rank's since the last optimizer step (``step``), and world totals
    since the last metrics report (``window``) and over all steps (``total``).

    Counter layout of ``step`` and ``window``: ``[0:E]`` tokens per expert, ``[E]`` dropped assignments,
    ``[E+1]`` kept assignments, ``[E+2]`` entropy sum, ``[E+3]`` router tokens; with ``coactivation``,
    ``[E+4 : E+4+E²]`` the pair counts ``C[a·E + b]`` (``a < b``) of tokens that chose both a and b (kept
    assignments only), reduced with the rest in one all-reduce.

    ``step`` lives on ``device`` (where the routing runs), the world totals on the host (read once a step).

    Attributes:
        router_name / router / top_k: the router beside the experts module (``None`` / 0 when none was found).
    """

    num_experts: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    router_name: str | None = None
    router: nn.Module | None = None
    top_k: int = 0
    coactivation: bool = False  # also count expert pairs chosen by the same token
    step: torch.Tensor = field(default=None)  # type: ignore[assignment]
    window: torch.Tensor = field(default=None)  # type: ignore[assignment]
    window_steps: int = 0
    last_active_step: torch.Tensor = field(default=None)  # type: ignore[assignment]
    total: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [E] all steps, world totals

    def __post_init__(self) -> None:
        size = self.num_experts + 4 + (self.num_experts**2 if self.coactivation else 0)
        self.step = torch.zeros(size, dtype=torch.float64, device=self.device)
        self.window = torch.zeros(size, dtype=torch.float64)
        self.last_active_step = torch.zeros(self.num_experts, dtype=torch.long)
        self.total = torch.zeros(self.num_experts, dtype=torch.float64)

    def _on(self, device: torch.device) -> torch.Tensor:
        """The step counters, on ``device`` (where they were made; moved once if the routing runs elsewhere)."""
        if self.step.device != device:
            self.step = self.step.to(device)
        return self.step

    def count(self, index: torch.Tensor, dropped: torch.Tensor | int = 0) -> None:
        """Count the ``[T, k]`` expert ids a layer received (-1: dropped) and ``dropped`` assignments."""
        if in_backward():
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
        """Add the router entropy of ``logits [T, E]`` (the router's forward hook calls this)."""
        if in_backward():
            return
        step = self._on(logits.device)
        with torch.no_grad():
            logp = F.log_softmax(logits.float(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
        step[self.num_experts + 2] += entropy.double().sum()
        step[self.num_experts + 3] += entropy.numel()


def attach_load_accounting(model: nn.Module, layers: list, coactivation: bool) -> None:
    """Give every EP layer an :class:`ExpertLoad` (``layer.load``) and count router entropy on its router."""
    from .router_rules import find_router

    for layer in layers:
        load = ExpertLoad(layer.num_experts, layer.expert_parameters()[0].device, coactivation=coactivation)
        found = find_router(model, layer.name, layer.num_experts)
        if found is not None:
            load.router_name, load.router = found
            load.top_k = int(found[1].top_k)
            load.router.register_forward_hook(lambda module, args, output, load=load: load.count_entropy(output[0]))
        layer.load = load


def reduce_step_loads(layers: list, mesh: HybridMesh, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Once per optimizer step: every layer's step counters summed over the world (one all-reduce, one host
    read), added to its window and totals, then reset. Returns each layer's world counters of the step, float64,
    on the host (what the metrics and the rebalancer read) and on the device (what the router controls update
    from). Collective: call on every rank."""
    loads = [layer.load for layer in layers]
    device = current_device(mesh)
    stacked = torch.cat([load.step.to(device) for load in loads])
    if mesh.world_group is not None:
        with watched("all_reduce of the step's expert loads", mesh.world_group):
            dist.all_reduce(stacked, group=mesh.world_group)
    on_host = stacked.cpu()
    host, on_device, offset = [], [], 0
    for load in loads:
        n = load.step.numel()
        totals = on_host[offset : offset + n]
        on_device.append(stacked[offset : offset + n])
        offset += n
        experts = totals[: load.num_experts]
        load.window += totals
        load.total += experts
        load.window_steps += 1
        load.last_active_step[experts > 0] = step
        load.step.zero_()
        host.append(totals)
    return host, on_device
