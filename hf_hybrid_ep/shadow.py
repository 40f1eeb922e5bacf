"""Hot-expert shadowing in training (``HybridEPConfig.expert_cache``).

After every optimizer step (:func:`hf_hybrid_ep.routing_step`) each rank decides, per MoE layer, which
*remote* experts to hold as local replicas ("shadows") for the next step, then the owners send the
fresh weights. A shadow serves only its holder's own tokens: the dispatcher keeps those (token, k) pairs
on the holder (they never cross ranks), every other rank's tokens still go to the owner. At the end of
the step's gradient-reduced backward, before the expert gradient reduction, each holder returns its
shadows' gradients to their owners (a pre-reduce hook of :class:`hf_hybrid_ep.grads.GradientReducer`),
which add them to their own: the owner's gradient is then exactly the sum the unshadowed run forms, and
the EDP reduction, clipping and the optimizer see the same numbers. Shadows expire at that point; the
next :func:`routing_step` (after ``optimizer.step()``) decides and fetches again.

Predictor and cost model, per rank, layer and remote expert ``e``: ``n_e`` = this rank's (token, k)
pairs routed to ``e`` during the *previous* optimizer step (all its micro-batches, from the routing
counters). Shadowing ``e`` avoids ``n_e · row_bytes · c`` token bytes (``c`` = 4 exchanges per row in
training: dispatch, combine and their backward passes) and costs ``expert_bytes`` of weights fetched
plus ``expert_bytes`` of gradients returned. The ``expert_cache_capacity`` experts with the largest
positive net saving are shadowed. Every rank's choice is all-gathered over its EP group (a
``[layers, E]`` mask), so owners know whom to send weights to and from whom to expect gradients.

Weights travel with one uneven ``all_to_all_single`` per layer over the EP group (and gradients back
the same way); the counters are in ``comm_stats(model)[layer]["shadow"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .config import HybridEPConfigError
from .dispatch.stats import ShadowCounters
from .mesh import HybridMesh, all_gather_flat, current_device

EXCHANGES_PER_ROW = 4  # dispatch, combine, dispatch_backward, combine_backward


@dataclass
class LayerShadows:
    """The shadows one rank holds for one layer: global ids (by owner, then id), owners, weights."""

    num_experts: int
    experts: list[int]
    owners: list[int]  # EP rank of each shadow's owner
    params: dict[str, nn.Parameter]  # parameter name -> [len(experts), ...] shadow weights (not in the model)
    plan: dict[int, list[int]]  # every EP rank's shadows in this layer (the all-gathered decision)
    active: bool = True
    _slot_of: dict = field(default_factory=dict)  # device -> [E] int64 slot (-1: not shadowed)

    def slot_of(self, device: torch.device) -> torch.Tensor | None:
        """``[E]`` shadow slot of each expert on ``device`` (-1: not shadowed), or ``None`` when inactive."""
        if not self.active or not self.experts:
            return None
        if device not in self._slot_of:
            table = torch.full((self.num_experts,), -1, dtype=torch.long)
            table[self.experts] = torch.arange(len(self.experts))
            self._slot_of[device] = table.to(device)
        return self._slot_of[device]

    def count_rows(self, counters: ShadowCounters, rows: torch.Tensor) -> None:
        """Record rows computed here instead of crossing ranks (once per forward, not on recompute)."""
        if torch._C._current_graph_task_id() != -1:  # activation checkpointing recomputes in backward
            return
        exchanges = EXCHANGES_PER_ROW if torch.is_grad_enabled() else 2
        counters.rows_local += rows.shape[0]
        counters.token_bytes_avoided += rows.shape[0] * rows[0:1].numel() * rows.element_size() * exchanges


def expert_bytes(layer) -> int:
    """Bytes of one expert's weights in ``layer`` (all per-expert parameters)."""
    return sum(p[0].numel() * p.element_size() for p in layer.expert_parameters())


class ShadowManager:
    """Decides, fetches and returns shadows for every EP layer of one model (collective methods)."""

    def __init__(self, layers: list, mesh: HybridMesh, capacity: int) -> None:
        self.layers, self.mesh, self.capacity = layers, mesh, capacity
        self.row_bytes: dict[int, int] = {}  # layer index -> bytes of one activation row (last seen)
        for layer in layers:
            dtypes = sorted({str(p.dtype) for p in layer.expert_parameters()})
            if len(dtypes) > 1:
                raise HybridEPConfigError(
                    f"expert_cache: the expert parameters of {layer.name} mix dtypes {dtypes}; shadows move "
                    "one flat buffer per layer, so load the experts in one dtype"
                )
        for i, layer in enumerate(layers):
            layer.module.register_forward_pre_hook(self._row_bytes_hook(i), with_kwargs=True)

    def _row_bytes_hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            if torch.is_tensor(hidden) and hidden.dim() == 2:
                self.row_bytes[index] = hidden.shape[1] * hidden.element_size()
        return hook

    # ------------------------------------------------------------------ decision
    def choose(self, index: int) -> list[int]:
        """This rank's shadows for layer ``index``: remote experts whose predicted token bytes saved exceed
        the weight and gradient bytes, the ``capacity`` best. Predictor: the previous step's pair counts."""
        layer = self.layers[index]
        routing = getattr(layer, "routing", None)
        row_bytes = self.row_bytes.get(index)
        if routing is None or row_bytes is None:
            return []
        counts = routing.step[: layer.num_experts].detach().cpu().tolist()
        trained = any(p.requires_grad for p in layer.expert_parameters())
        cost = expert_bytes(layer) * (2 if trained else 1)
        exchanges = EXCHANGES_PER_ROW if trained else 2
        local = set(layer.local_experts)
        gains = [(counts[e] * row_bytes * exchanges - cost, e) for e in range(layer.num_experts) if e not in local]
        best = sorted((g for g in gains if g[0] > 0), key=lambda g: (-g[0], g[1]))[: self.capacity]
        return sorted(e for _, e in best)

    def _owner(self, layer, expert: int) -> int:
        return layer.table.holders(expert)[0]

    @torch.no_grad()
    def refresh(self) -> None:
        """Decide this step's shadows on every rank, agree over the EP group and fetch the weights.

        Call after ``optimizer.step()`` (``routing_step`` does), before the routing counters are reset.
        Collective over the world (each EP group exchanges within itself).
        """
        mesh = self.mesh
        if mesh.ep_group is None:
            return
        device = current_device(mesh)
        num_experts = max(layer.num_experts for layer in self.layers)
        mine = torch.zeros(len(self.layers), num_experts, dtype=torch.int32, device=device)
        for i in range(len(self.layers)):
            for e in self.choose(i):
                mine[i, e] = 1
        masks = torch.empty(mesh.ep_degree * mine.shape[0], mine.shape[1], dtype=mine.dtype, device=device)
        all_gather_flat(masks, mine, mesh.ep_group)
        masks = masks.view(mesh.ep_degree, *mine.shape).cpu()
        row_bytes = mine.shape[1] * mine.element_size() * (mesh.ep_degree - 1)  # one layer's row, to each peer
        for i, layer in enumerate(self.layers):
            self._fetch(layer, masks[:, i], row_bytes)

    def _plan(self, layer, masks: torch.Tensor) -> dict[int, list[int]]:
        """EP rank -> the experts it shadows in this layer, ordered by (owner, id)."""
        held: dict[int, list[int]] = {}
        for rank in range(masks.shape[0]):
            chosen = [e for e in range(layer.num_experts) if masks[rank, e]]
            held[rank] = sorted(chosen, key=lambda e: (self._owner(layer, e), e))
        return held

    def _fetch(self, layer, masks: torch.Tensor, control_bytes: int) -> None:
        me, ep = self.mesh.ep_rank, self.mesh.ep_degree
        held = self._plan(layer, masks)
        params = layer.expert_parameters()
        per_expert = sum(p[0].numel() for p in params)
        slot = {e: s for s, e in enumerate(layer.local_experts)}
        send_parts, send_splits = [], []
        for rank in range(ep):
            mine = [e for e in held[rank] if self._owner(layer, e) == me] if rank != me else []
            for e in mine:
                send_parts.append(torch.cat([p.detach()[slot[e]].reshape(-1) for p in params]))
            send_splits.append(len(mine) * per_expert)
        wanted = held[me]
        recv_splits = [sum(per_expert for e in wanted if self._owner(layer, e) == rank) for rank in range(ep)]
        dtype, device = params[0].dtype, params[0].device
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.mesh.ep_group)
        rows = recv.view(len(wanted), per_expert)
        shadow_params, offset = {}, 0
        for name, p in zip(layer.param_names, params, strict=True):
            width = p[0].numel()
            value = rows[:, offset : offset + width].reshape(len(wanted), *p.shape[1:]).clone()
            shadow_params[name] = nn.Parameter(value, requires_grad=p.requires_grad)
            offset += width
        owners = [self._owner(layer, e) for e in wanted]
        layer.shadows = LayerShadows(layer.num_experts, wanted, owners, shadow_params, held)
        counters = layer.stats.shadow
        counters.refreshes += 1
        counters.shadows_held += len(wanted)
        counters.weight_bytes_sent += send.numel() * send.element_size()
        counters.weight_bytes_received += recv.numel() * recv.element_size()
        counters.control_bytes += control_bytes

    # ------------------------------------------------------------------ gradients
    def returns_pending(self) -> bool:
        """Whether shadow gradients will be returned at the end of this backward (some rank of this EP group
        holds a shadow): the reducer then holds the expert buckets back until they are."""
        return any(layer.shadows is not None and layer.shadows.active and any(layer.shadows.plan.values())
                   for layer in self.layers)

    @torch.no_grad()
    def return_gradients(self) -> None:
        """Pre-reduce hook: send every shadow's gradient to its owner, which adds it to its own; then the
        shadows expire. Runs on every rank inside the gradient reduction (collective over each EP group;
        shadows become active and expire on every rank at the same points, so all ranks agree on
        whether there is anything to exchange)."""
        live = [layer for layer in self.layers if layer.shadows is not None and layer.shadows.active]
        if self.mesh.ep_group is None or not live:
            return
        me, ep = self.mesh.ep_rank, self.mesh.ep_degree
        for layer in live:
            shadows = layer.shadows
            params = layer.expert_parameters()
            per_expert = sum(p[0].numel() for p in params)
            parts = [
                torch.cat([_grad_row(shadows.params[name], s).reshape(-1) for name in layer.param_names])
                for s in range(len(shadows.experts))  # ordered by owner, like the splits
            ]
            send_splits = [per_expert * shadows.owners.count(rank) for rank in range(ep)]
            senders = {
                rank: [e for e in shadows.plan[rank] if self._owner(layer, e) == me] if rank != me else []
                for rank in range(ep)
            }
            recv_splits = [len(senders[rank]) * per_expert for rank in range(ep)]
            dtype, device = params[0].dtype, params[0].device
            send = torch.cat(parts).to(dtype) if parts else torch.empty(0, dtype=dtype, device=device)
            recv = torch.empty(sum(recv_splits), dtype=dtype, device=device)
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.mesh.ep_group)
            slot = {e: s for s, e in enumerate(layer.local_experts)}
            rows = iter(recv.view(-1, per_expert)) if recv.numel() else iter(())
            for rank in range(ep):
                for e in senders[rank]:
                    row, inner = next(rows), 0
                    for p in params:
                        width = p[0].numel()
                        if p.grad is not None:
                            p.grad[slot[e]] += row[inner : inner + width].view_as(p.grad[slot[e]])
                        inner += width
            counters = layer.stats.shadow
            counters.grad_bytes_sent += send.numel() * send.element_size()
            counters.grad_bytes_received += recv.numel() * recv.element_size()
            shadows.active = False
            for p in shadows.params.values():
                p.grad = None


def _grad_row(shadow: nn.Parameter, slot: int) -> torch.Tensor:
    return shadow.grad[slot] if shadow.grad is not None else torch.zeros_like(shadow[slot])
