"""Routing replay: the experts every token was sent to in one pass (generation) chosen again in a later pass over
the same sequences (the training forward), whatever the router would choose then.

In RL on an MoE policy the completions are sampled with one routing and trained with another: the router sees
hidden states that differ by round-off (KV-cached decoding against one full forward) or by the updates made since
sampling, a token near a tie goes to other experts, and the importance ratio compares two different networks —
the instability Megatron and NeMo-RL fix by replaying the sampled routing. Here::

    with hep.record_routing(model) as routing:
        sequences = model.generate(input_ids, attention_mask=mask, ...)
    with hep.replay_routing(model, routing):
        out = model(input_ids=sequences, attention_mask=...)   # same rows, a prefix of the generated positions

Recording keeps each MoE layer's choices ``[B, S, k]`` per forward and joins them along the sequence (a prompt
pass, then one position per decoding step), so position ``t`` of row ``b`` of the replayed forward gets the
experts recorded for position ``t`` of row ``b``. Positions the record lacks (the last generated token, which no
decoding step fed back) are routed by the router. The routing weights are the router's own at the replayed experts
(:mod:`hf_hybrid_ep.moe.router_rules`' proven selection rule), so the router still gets gradients. Rank-local:
each rank replays its own tokens' choices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import HybridEPConfigError
from ..moe.router_rules import match_rule
from .adapters import is_peft_model
from .state import state_of


class RoutingRecord:
    """The experts each MoE layer chose while recording: ``choices(name)`` → ``[B, L, k]`` (int64)."""

    def __init__(self) -> None:
        self._passes: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, index: torch.Tensor) -> None:
        self._passes.setdefault(name, []).append(index.detach())

    def choices(self, name: str) -> torch.Tensor:
        passes = self._passes.get(name)
        if not passes:
            raise HybridEPConfigError(f"routing replay: nothing was recorded for {name}")
        rows = {p.shape[0] for p in passes}
        if len(rows) != 1:
            raise HybridEPConfigError(f"routing replay: {name} was recorded over batches of {sorted(rows)} rows; "
                                      "record one generation at a time")
        return torch.cat(passes, dim=1)

    @property
    def layers(self) -> list[str]:
        return sorted(self._passes)

    def rows(self) -> torch.Tensor:
        """Every layer's choices as one tensor ``[B, L, layers, k]`` (layers in :attr:`layers` order), to travel
        with the rows of a batch."""
        return torch.stack([self.choices(name) for name in self.layers], dim=2)

    @classmethod
    def from_rows(cls, layers: list[str], rows: torch.Tensor) -> RoutingRecord:
        """The record :meth:`rows` made, of the rows ``rows`` holds (any subset, in any order)."""
        record = cls()
        for i, name in enumerate(layers):
            record.add(name, rows[:, :, i])
        return record


@dataclass
class ReplayStats:
    """What a replay did: token choices (position × layer) routed to recorded experts, and how many of those the
    router alone would have sent elsewhere (a 0-d device tensor once counted: no host sync per layer)."""

    replayed: int = 0
    changed: int | torch.Tensor = 0


def _routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = state_of(model).layers
    missing = [layer.name for layer in layers if layer.load.router is None]
    if missing:
        raise HybridEPConfigError(f"routing replay: no router found next to {missing[0]}")
    return [(layer.name, layer.load.router) for layer in layers]


@contextlib.contextmanager
def _batch_shape(model: nn.Module) -> Iterator[list[tuple[int, int]]]:
    """``[(B, S)]`` of the model's forward in progress (from ``input_ids`` or ``inputs_embeds``)."""
    shape: list[tuple[int, int]] = []
    model = model.get_base_model() if is_peft_model(model) else model  # the module generate and PEFT call

    def before(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        shape[:] = [(x.shape[0], x.shape[1])]

    handle = model.register_forward_pre_hook(before, with_kwargs=True)
    try:
        yield shape
    finally:
        handle.remove()


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Record the experts every MoE layer of ``model`` (parallelized) chooses during the block's forwards."""
    record = RoutingRecord()
    with _batch_shape(model) as shape:
        def hook(name):
            def observe(module, args, output):
                rows, positions = shape[0]
                record.add(name, output[2].reshape(rows, positions, -1))
            return observe

        handles = [router.register_forward_hook(hook(name)) for name, router in _routers(model)]
        try:
            yield record
        finally:
            for h in handles:
                h.remove()


@contextlib.contextmanager
def replay_routing(model: nn.Module, record: RoutingRecord, sequential: bool = False,
                   stats: ReplayStats | None = None) -> Iterator[ReplayStats]:
    """During the block's forwards of ``model``, route every position ``record`` covers to its recorded experts,
    with the router's weights at those experts; yields the :class:`ReplayStats` the block counts into (``stats``,
    or fresh ones). Every forward covers
    all the record's rows, or (``sequential``) the next rows of the record in order (a batch scored in chunks).

    Raises:
        HybridEPConfigError: a router no selection rule reproduces, a layer the record lacks, or a forward whose
            rows the record does not have.
    """
    temperature = state_of(model).config.router_temperature
    stats = ReplayStats() if stats is None else stats
    hooks = []
    for name, router in _routers(model):
        rule = match_rule(router, int(router.top_k), router.weight.shape[1])
        if rule is None:
            raise HybridEPConfigError(f"routing replay: the router of {name} ({type(router).__name__}) matches no "
                                      "selection rule, so its weights at replayed experts cannot be formed")
        hooks.append((router, _replay_hook(name, rule, record.choices(name), temperature, stats,
                                                   sequential)))
    with _batch_shape(model) as shape:
        # first among the router's hooks, so that load accounting and the router losses see the replayed choices
        handles = [router.register_forward_hook(hook(shape), prepend=True) for router, hook in hooks]
        try:
            yield stats
        finally:
            for h in handles:
                h.remove()


def _replay_hook(name: str, rule, recorded: torch.Tensor, temperature: float | None, stats: ReplayStats,
                 sequential: bool):
    def make(shape):
        offset = 0

        def replace(module, args, output):
            nonlocal offset
            logits, _, index = output
            rows, positions = shape[0]
            first = offset if sequential else 0
            if first + rows > recorded.shape[0] or (not sequential and rows != recorded.shape[0]):
                raise HybridEPConfigError(f"routing replay: {name} recorded {recorded.shape[0]} rows, the forward "
                                          f"asks for rows {first}..{first + rows - 1}")
            offset += rows
            index = index.reshape(rows, positions, -1).clone()
            covered = min(positions, recorded.shape[1])
            replayed = recorded[first : first + rows, :covered].to(index.device)
            stats.replayed += rows * covered
            stats.changed = stats.changed + (index[:, :covered].sort(-1)[0] != replayed.sort(-1)[0]).any(-1).sum()
            index[:, :covered] = replayed
            index = index.reshape(rows * positions, -1)
            scaled = logits if temperature is None else logits / temperature
            return logits, rule.weights(module, scaled, rule.scores(scaled), index), index
        return replace
    return make
