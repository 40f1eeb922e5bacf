"""Hot-expert shadowing in training (``HybridEPConfig.shadow_experts``).

After every optimizer step (:func:`hf_hybrid_ep.after_optimizer_step`) each rank decides, per MoE layer, which
*remote* experts to hold as local replicas ("shadows") for the next step, then the owners send the
fresh weights. A shadow serves only its holder's own tokens: the dispatcher keeps those (token, k) pairs
on the holder (they never cross ranks), every other rank's tokens still go to the owner. At the end of
the step's gradient-reduced backward, before the expert gradient reduction, each holder returns its
shadows' gradients to their owners (step 4 of :meth:`hf_hybrid_ep.engine.backward.BackwardSequence.finish`),
which add them to their own: the owner's gradient is then exactly the sum the unshadowed run forms, and
the EDP reduction, clipping and the optimizer see the same numbers. Shadows expire at that point; the
next :func:`after_optimizer_step` (after ``optimizer.step()``) decides and fetches again.

Predictor and cost model, per rank, layer and remote expert ``e``: ``n_e`` = this rank's (token, k)
pairs routed to ``e`` during the *previous* optimizer step (all its micro-batches, from the routing
counters). Shadowing ``e`` avoids ``n_e · row_bytes · c`` token bytes (``c`` = 4 exchanges per row in
training: dispatch, combine and their backward passes) and costs ``expert_bytes`` of weights fetched
plus ``expert_bytes`` of gradients returned. The ``shadow_capacity`` experts with the largest
positive net saving are shadowed. Every rank's choice is all-gathered over its EP group (a
``[layers, E]`` mask), so owners know whom to send weights to and from whom to expect gradients.

Weights travel with one uneven ``all_to_all_single`` per layer and expert parameter over the EP group,
straight into the shadows' parameter storage, launched asynchronously after the optimizer step and
waited for by the layer's next forward; gradients go back the same way, sent from the shadows' gradient
storage. A layer in which no rank of the EP group chose a shadow moves nothing: only the mask all-gather
runs. The counters are in ``comm_stats(model)[layer]["shadow"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..dispatch.stats import ShadowCounters
from ..errors import HybridEPConfigError
from ..parallel.mesh import HybridMesh, all_gather_flat, current_device
from ..parallel.watchdog import launched, wait, watched

EXCHANGES_PER_ROW = 4  # dispatch, combine, dispatch_backward, combine_backward


@dataclass
class LayerShadows:
    """The shadows one rank holds for one layer: global ids (by owner, then id), owners, weights."""

    num_experts: int
    experts: list[int]
    owners: list[int]  # EP rank of each shadow's owner
    params: dict[str, nn.Parameter]  # parameter name -> [len(experts), ...] shadow weights (not in the model)
    held_by: dict[int, list[int]]  # every EP rank's shadows in this layer (the all-gathered decision)
    active: bool = True
    pending: list = field(default_factory=list)  # (work, send buffer) of the weight exchange in flight
    _slot_of: dict = field(default_factory=dict)  # device -> [E] int64 slot (-1: not shadowed)

    def wait(self) -> None:
        """Complete the asynchronous weight exchange (the layer's forward calls this before using them)."""
        for work, _ in self.pending:
            if work is not None:
                wait(work, "all_to_all of hot-expert shadow weights")  # over the EP group it was launched on
        self.pending = []

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
                    f"shadow_experts: the expert parameters of {layer.name} mix dtypes {dtypes}; shadows move "
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
    def step_counts(self) -> list[list[float]]:
        """Every layer's pair counts of the last optimizer step, in one host read."""
        width = max(layer.num_experts for layer in self.layers)
        rows = []
        for layer in self.layers:
            load = layer.load
            counts = load.step[: layer.num_experts] if load is not None else torch.zeros(layer.num_experts)
            rows.append(torch.nn.functional.pad(counts.double().cpu(), (0, width - layer.num_experts)))
        return torch.stack(rows).tolist()

    def choose(self, index: int, counts: list[float] | None = None) -> list[int]:
        """This rank's shadows for layer ``index``: remote experts whose predicted token bytes saved exceed
        the weight and gradient bytes, the ``capacity`` best. Predictor: the previous step's pair counts."""
        layer = self.layers[index]
        row_bytes = self.row_bytes.get(index)
        if layer.load is None or row_bytes is None:
            return []
        if counts is None:
            counts = self.step_counts()[index]
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
    def refresh(self, counts: list[list[float]] | None = None) -> None:
        """Decide this step's shadows on every rank, agree over the EP group and start fetching the weights.

        Call after ``optimizer.step()`` (``after_optimizer_step`` does), before the routing counters are reset, or
        with ``counts`` (:meth:`step_counts`, read before they were).
        Collective over the world (each EP group exchanges within itself); the weight exchanges complete
        asynchronously, before the layer's next forward uses them.
        """
        mesh = self.mesh
        if mesh.ep_group is None:
            return
        device = current_device(mesh)
        num_experts = max(layer.num_experts for layer in self.layers)
        counts = self.step_counts() if counts is None else counts
        mine = torch.zeros(len(self.layers), num_experts, dtype=torch.int32)
        for i in range(len(self.layers)):
            for e in self.choose(i, counts[i]):
                mine[i, e] = 1
        mine = mine.to(device)
        masks = torch.empty(mesh.ep_degree * mine.shape[0], mine.shape[1], dtype=mine.dtype, device=device)
        with watched("all_gather of the hot-expert shadow decisions", mesh.ep_group):
            all_gather_flat(masks, mine, mesh.ep_group)
        masks = masks.view(mesh.ep_degree, *mine.shape).cpu()
        row_bytes = mine.shape[1] * mine.element_size() * (mesh.ep_degree - 1)  # one layer's row, to each peer
        for i, layer in enumerate(self.layers):
            layer.stats.shadow.control_bytes += row_bytes
            if layer.shadows is not None:
                layer.shadows.wait()
            if not bool(masks[:, i].any()):  # nobody in the EP group shadows here: nothing moves
                layer.shadows = None
                continue
            self._fetch(layer, masks[:, i])

    def _held_by(self, layer, masks: torch.Tensor) -> dict[int, list[int]]:
        """EP rank -> the experts it shadows in this layer, ordered by (owner, id)."""
        held: dict[int, list[int]] = {}
        for rank in range(masks.shape[0]):
            chosen = [e for e in range(layer.num_experts) if masks[rank, e]]
            held[rank] = sorted(chosen, key=lambda e: (self._owner(layer, e), e))
        return held

    def _fetch(self, layer, masks: torch.Tensor) -> None:
        """One asynchronous uneven all-to-all per expert parameter, received into the shadow parameters."""
        me, ep = self.mesh.ep_rank, self.mesh.ep_degree
        held = self._held_by(layer, masks)
        slot = {e: s for s, e in enumerate(layer.local_experts)}
        requested = {rank: [e for e in held[rank] if self._owner(layer, e) == me] if rank != me else []
                     for rank in range(ep)}
        send_slots = [slot[e] for rank in range(ep) for e in requested[rank]]
        send_rows = [len(requested[rank]) for rank in range(ep)]
        wanted = held[me]
        recv_rows = [sum(1 for e in wanted if self._owner(layer, e) == rank) for rank in range(ep)]
        shadow_params, pending, sent = {}, [], 0
        for name, p in zip(layer.param_names, layer.expert_parameters(), strict=True):
            index = torch.tensor(send_slots, dtype=torch.long, device=p.device)
            send = p.detach().index_select(0, index)
            value = p.new_empty((len(wanted), *p.shape[1:]))
            work = launched(dist.all_to_all_single(value, send, recv_rows, send_rows, group=self.mesh.ep_group,
                                                   async_op=True),
                            f"all_to_all of hot-expert shadow weights of {layer.name}", self.mesh.ep_group)
            pending.append((work, send))
            shadow_params[name] = nn.Parameter(value, requires_grad=p.requires_grad)
            sent += send.numel() * send.element_size()
        owners = [self._owner(layer, e) for e in wanted]
        layer.shadows = LayerShadows(layer.num_experts, wanted, owners, shadow_params, held, pending=pending)
        counters = layer.stats.shadow
        counters.refreshes += 1
        counters.shadows_held += len(wanted)
        counters.weight_bytes_sent += sent
        counters.weight_bytes_received += sum(v.numel() * v.element_size() for v in shadow_params.values())

    # ------------------------------------------------------------------ gradients
    def returns_pending(self) -> bool:
        """Whether shadow gradients will be returned at the end of this backward (some rank of this EP group
        holds a shadow): the reducer then holds the expert buckets back until they are."""
        return any(layer.shadows is not None and layer.shadows.active and any(layer.shadows.held_by.values())
                   for layer in self.layers)

    @torch.no_grad()
    def return_gradients(self) -> None:
        """At the end of a reducing backward, before the expert buckets reduce (the backward sequence calls
        it): send every shadow's gradient to its owner, which adds it to its own; then the
        shadows expire. Runs on every rank inside the gradient reduction (collective over each EP group;
        shadows become active and expire on every rank at the same points, so all ranks agree on
        whether there is anything to exchange). One all-to-all per layer and expert parameter, sent from
        the shadows' gradients as they are (ordered by owner), all in flight together."""
        live = [layer for layer in self.layers if layer.shadows is not None and layer.shadows.active]
        if self.mesh.ep_group is None or not live:
            return
        me, ep = self.mesh.ep_rank, self.mesh.ep_degree
        exchanges = []
        for layer in live:
            shadows = layer.shadows
            shadows.wait()
            send_rows = [shadows.owners.count(rank) for rank in range(ep)]
            senders = [e for rank in range(ep) if rank != me for e in shadows.held_by[rank] if self._owner(layer, e) == me]
            recv_rows = [sum(1 for e in shadows.held_by[rank] if self._owner(layer, e) == me) if rank != me else 0
                         for rank in range(ep)]
            for name, p in zip(layer.param_names, layer.expert_parameters(), strict=True):
                shadow = shadows.params[name]
                send = shadow.grad if shadow.grad is not None else torch.zeros_like(shadow)
                recv = p.new_empty((len(senders), *p.shape[1:]))
                work = launched(dist.all_to_all_single(recv, send.to(p.dtype), recv_rows, send_rows,
                                                       group=self.mesh.ep_group, async_op=True),
                                f"all_to_all of shadow gradients of {layer.name}", self.mesh.ep_group)
                exchanges.append((layer, p, senders, send, recv, work))
        for layer, p, senders, send, recv, work in exchanges:
            wait(work, f"all_to_all of shadow gradients of {layer.name}", self.mesh.ep_group)
            slot = {e: s for s, e in enumerate(layer.local_experts)}
            if p.grad is not None:
                for row, e in enumerate(senders):  # in a fixed order: deterministic sums
                    p.grad[slot[e]] += recv[row]
            counters = layer.stats.shadow
            counters.grad_bytes_sent += send.numel() * send.element_size()
            counters.grad_bytes_received += recv.numel() * recv.element_size()
        for layer in live:
            layer.shadows.active = False
            for q in layer.shadows.params.values():
                q.grad = None


