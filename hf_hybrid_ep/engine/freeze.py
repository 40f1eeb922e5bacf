"""Expert specialization schedule: from a given optimizer step on, chosen experts stop changing.

A frozen expert's slice of every fused expert parameter stays bit for bit unchanged, and so does its
optimizer state: the gradient rows are zeroed before ``optimizer.step()`` and the parameter and
state rows are restored after it (weight decay and momentum would move them otherwise). The rows' index
tensors are made on the parameters' device once per frozen set and layout (at construction for a list of ids;
when freezing starts for ``"least_used:N"``; after a rebalance moves experts), not at every step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import HybridEPConfigError
from .state import state_of


class ExpertFreezer:
    """Freeze ``experts`` of every MoE layer from optimizer step ``from_step`` (0-based count of steps taken).

    Args:
        experts: global expert ids (every layer), a dict ``{layer name: ids}``, or ``"least_used:N"``
            (per layer, the N experts with the fewest assignments so far, chosen when freezing starts).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, experts, from_step: int = 0) -> None:
        self.model, self.optimizer, self.from_step = model, optimizer, from_step
        self.spec = experts
        self.steps_taken = 0
        self.frozen: dict[str, list[int]] | None = None
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._indices: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self._validate()
        if not isinstance(experts, str):  # known now: the rows' indices are made here, outside any step
            self.frozen = self._resolve()
            list(self._rows())
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _validate(self) -> None:
        layers = state_of(self.model).layers
        if isinstance(self.spec, str):
            if not self.spec.startswith("least_used:") or not self.spec.split(":", 1)[1].isdigit():
                raise HybridEPConfigError(f"freeze_experts={self.spec!r}: use a list of ids or 'least_used:N'")
            return
        per_layer = self.spec if isinstance(self.spec, dict) else {layer.name: list(self.spec) for layer in layers}
        for layer in layers:
            bad = [e for e in per_layer.get(layer.name, []) if not 0 <= e < layer.num_experts]
            if bad:
                raise HybridEPConfigError(f"freeze_experts: {bad} out of range for {layer.name} ({layer.num_experts} experts)")

    def _resolve(self) -> dict[str, list[int]]:
        layers = state_of(self.model).layers
        if isinstance(self.spec, str):
            n = int(self.spec.split(":", 1)[1])
            return {layer.name: torch.argsort(layer.load.total, stable=True)[:n].tolist() for layer in layers}
        if isinstance(self.spec, dict):
            return {k: list(v) for k, v in self.spec.items()}
        return {layer.name: list(self.spec) for layer in layers}

    def _rows(self):
        """(parameter, local slots) for every frozen expert this rank holds."""
        for layer in state_of(self.model).layers:
            frozen = set(self.frozen.get(layer.name, []))
            slots = tuple(s for s, e in enumerate(layer.local_experts) if e in frozen)
            if slots:
                for p in layer.slot_parameters():
                    yield p, self._index(slots, p.device)

    def _index(self, slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``[len(slots)]`` int64 on ``device``, made once for these slots."""
        key = (slots, device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(slots, dtype=torch.long, device=device)
        return self._indices[key]

    def _pre(self, optimizer, args, kwargs) -> None:
        self._saved = []
        if self.steps_taken < self.from_step:
            return
        if self.frozen is None:
            self.frozen = self._resolve()
        for p, index in self._rows():
            if p.grad is not None:
                p.grad[index] = 0
            state = {k: v[index].clone() for k, v in optimizer.state.get(p, {}).items()
                     if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == p.shape[0]}
            self._saved.append((p, index, p.detach()[index].clone(), state))

    def _post(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            for p, index, value, state in self._saved:
                p[index] = value
                for k, v in state.items():
                    optimizer.state[p][k][index] = v
        self._saved = []
        self.steps_taken += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
