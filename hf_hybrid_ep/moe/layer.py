"""The expert-parallel layer: one fused experts module's forward as route → plan → dispatch → compute → combine.

The module keeps only this rank's experts (:meth:`ShardedExperts.shard_`). Its forward applies capacity and
counts the load (route), plans the exchange with one counts exchange that also carries the input-agreement
integers and the local copies (plan), sends each (token, expert) pair to the rank holding the expert
(dispatch, :mod:`hf_hybrid_ep.dispatch`), runs this rank's experts on the received rows (compute,
:class:`~hf_hybrid_ep.moe.experts.ExpertCompute`) and returns the outputs weighted by the routing weights
(combine). See docs/architecture.md, "A token's path".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..dispatch import CommStats, DispatchPlan, PlacementTable, SideChannel, make_dispatcher
from ..errors import HybridEPConfigError
from ..parallel.agreement import CONTROL_INTS, InputAgreement, control_vector
from ..parallel.mesh import HybridMesh, all_gather_flat
from ..parallel.watchdog import set_label, watched
from .capacity import apply_capacity
from .discovery import expert_parameter_names
from .experts import ExpertCompute, autocast_dtype

if TYPE_CHECKING:
    from ..config import HybridEPConfig


@dataclass(frozen=True)
class EPLayerOptions:
    """How an :class:`ShardedExperts` runs (from :class:`~hf_hybrid_ep.HybridEPConfig`).

    Attributes:
        dispatcher: the concrete backend (``"torch"``, ``"triton"``, ``"dedup"``; ``parallelize`` resolves
            ``"auto"`` once for the model).
        check_finite: raise on every rank when a layer's input holds NaN or inf.
        alignment: rows per expert padded to a multiple of this (the Triton backend's tile).
        count_slots: slots per EP rank in every counts message (equal for every layer, see ``parallelize``).
        capacity_factor / drop_policy: token capacity per expert and which pairs are dropped over it.
        overlap_degree: token chunks whose exchanges overlap the experts' compute.
    """

    dispatcher: str = "auto"
    check_finite: bool = False
    alignment: int = 1
    count_slots: int | None = None
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    overlap_degree: int = 1

    @classmethod
    def from_config(cls, config: HybridEPConfig, count_slots: int | None = None) -> EPLayerOptions:
        return cls(config.dispatcher, config.check_finite, config.expert_alignment, count_slots,
                   config.capacity_factor, config.drop_policy, config.overlap_degree)


class ShardedExperts:
    """The experts of one fused experts module, sharded over its EP group: the replacement of its forward
    (not an ``nn.Module``: it owns no parameters of its own; the module keeps this rank's experts).

    Keeps this rank's experts as plain parameters (local slots in placement-table order) and runs
    ``forward(hidden [T,H], top_k_index [T,k], top_k_weights [T,k]) -> [T,H]`` as route → plan → dispatch →
    compute (:attr:`experts`, unit weights) → combine with the routing weights.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        table: PlacementTable,
        mesh: HybridMesh,
        options: EPLayerOptions,
        *,
        layer_id: int = 0,
        layer_names: dict[int, str] | None = None,
        agreement: InputAgreement | None = None,
        shared_overlap: SharedExpertOverlap | None = None,
    ) -> None:
        """``layer_id``: position among the model's EP layers (in every counts message);
        ``layer_names``: all of them by id (for error messages); ``agreement``: the model's cross-rank
        input check; ``shared_overlap``: the block's shared expert, run during the combine exchange."""
        self.name = name
        self.module = module
        self.table = table
        self.mesh = mesh
        self.options = options
        self.num_experts = table.num_experts
        self.local_experts = table.local_experts(mesh.ep_rank)
        self.param_names = expert_parameter_names(name, module)
        self.stats = CommStats()
        self.load = None  # a load.ExpertLoad, attached by attach_load_accounting
        self.controls = None  # a router_controls.RouterControls while selection controls are on
        self.shared_overlap = shared_overlap
        self.layer_id = layer_id
        self.layer_names: dict[int, str] = layer_names or {layer_id: name}
        self.shadows = None  # a shadow.LayerShadows while hot-expert shadowing holds remote experts here
        self.agreement = agreement
        self.dispatcher = self._make_dispatcher(table)
        fused = self.dispatcher.name == "triton"  # the same kernels regroup the received rows
        self.experts = ExpertCompute(module, alignment=options.alignment if fused else 1, fused=fused)

    def _make_dispatcher(self, table: PlacementTable):
        o = self.options
        return make_dispatcher(o.dispatcher, table, self.mesh, self.stats, count_slots=o.count_slots,
                               control_ints=CONTROL_INTS)

    def shard_(self) -> None:
        """Replace each per-expert parameter by a fresh parameter holding only this rank's slots."""
        index = torch.tensor(self.local_experts, dtype=torch.long)
        for pname in self.param_names:
            full = getattr(self.module, pname)
            local = full.detach()[index.to(full.device)].clone()
            setattr(self.module, pname, nn.Parameter(local, requires_grad=full.requires_grad))
        self.module.num_experts = len(self.local_experts)
        self.module.forward = self.forward

    def set_table(self, table: PlacementTable) -> None:
        """Route by ``table`` from now on (online rebalancing; the expert parameters already hold its
        slots): local experts, the module's expert count, the dispatcher."""
        if table.num_experts != self.num_experts or table.ep_degree != self.table.ep_degree:
            raise HybridEPConfigError(f"{self.name}: a new table must keep {self.num_experts} experts over "
                                      f"{self.table.ep_degree} EP ranks")
        self.table = table
        self.local_experts = table.local_experts(self.mesh.ep_rank)
        self.module.num_experts = len(self.local_experts)
        self.dispatcher = self._make_dispatcher(table)
        self.place_routing()

    def place_routing(self) -> None:
        """Copy the routing table to the experts' device now (``parallelize`` calls this once the model is
        placed; every table change does), so that no forward copies it there."""
        self.table.on(self.expert_parameters()[0].device)

    def use_layout(self, mesh: HybridMesh, table: PlacementTable, options: EPLayerOptions) -> None:
        """Route over ``mesh``'s EP groups by ``table`` from now on, with ``options`` (its counts messages are as
        wide as the new slots): another EP degree, whose experts the caller has put in the module
        (:func:`hf_hybrid_ep.engine.eval_layout.eval_layout`)."""
        self.mesh, self.table, self.options = mesh, table, options
        self.local_experts = table.local_experts(mesh.ep_rank)
        self.module.num_experts = len(self.local_experts)
        self.dispatcher = self._make_dispatcher(table)
        self.place_routing()

    @torch.no_grad()
    def gather_full(self, pname: str) -> torch.Tensor:
        """The unsharded ``[E, ...]`` tensor of parameter ``pname``, assembled over the EP group.

        Collective over the EP group (every EP group holds every expert; replicas are identical).
        """
        return self.gather_rows(getattr(self.module, pname))

    @torch.no_grad()
    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Assemble per-slot rows ``[S_local, ...]`` (a parameter, its gradient or optimizer state) into
        ``[E, ...]`` in global expert order. Collective over the EP group."""
        return self._by_expert(self._all_slots(local))

    def gathered_bytes(self, local: torch.Tensor) -> int:
        """Bytes of every EP rank's slots of ``local`` (what :meth:`gather_to_host` receives on the device)."""
        return self.table.ep_degree * self.table.slots_per_rank * local[0].numel() * local.element_size()

    @torch.no_grad()
    def gather_to_host(self, local: torch.Tensor, keep: bool, scratch: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """:meth:`gather_rows` assembled in host memory where ``keep`` (else ``None``). The slots arrive on the
        device in ``scratch`` (uint8, at least :meth:`gathered_bytes`; reused for every tensor of a save) or a
        fresh buffer. Collective over the EP group."""
        gathered = self._all_slots(local, scratch)
        return self._by_expert(gathered, torch.device("cpu")) if keep else None

    def _all_slots(self, local: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``[ep, slots_per_rank, ...]``: every EP rank's slots (a rank with fewer slots padded with zeros),
        in ``scratch`` when given."""
        local = local.detach()
        ep, slots = self.table.ep_degree, self.table.slots_per_rank
        if local.shape[0] == slots:
            padded = local
        else:
            padded = local.new_zeros((slots, *local.shape[1:]))
            padded[: local.shape[0]] = local
        shape = (ep * slots, *local.shape[1:])
        if scratch is None:
            gathered = local.new_empty(shape)
        else:
            gathered = scratch[: self.gathered_bytes(local)].view(local.dtype).view(shape)
        if self.mesh.ep_group is None:
            gathered.copy_(padded)
        else:
            with watched(f"all_gather of the experts of {self.name}", self.mesh.ep_group):
                all_gather_flat(gathered, padded, self.mesh.ep_group)
        return gathered.view(ep, slots, *local.shape[1:])

    def _by_expert(self, gathered: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """``[E, ...]`` in global expert order from every rank's slots, on ``device`` (default: where they are)."""
        full = torch.empty((self.num_experts, *gathered.shape[2:]), dtype=gathered.dtype, device=device or gathered.device)
        for rank, row in enumerate(self.table.rows):
            full[list(row)] = gathered[rank, : len(row)].to(full.device)
        return full

    def expert_parameters(self) -> list[nn.Parameter]:
        """The experts module's per-expert parameters (``[S, ...]``, this rank's slots)."""
        return [getattr(self.module, pname) for pname in self.param_names]

    def slot_parameters(self) -> list[nn.Parameter]:
        """Every parameter held per local slot: the expert parameters and their adapters' factors (reduced
        over the ranks holding each expert, counted once in the norm, saved by global expert id)."""
        return self.expert_parameters() + self.experts.adapter_parameters()

    def use_slot_parameters(self, params: list[nn.Parameter]) -> None:
        """Hold ``params`` (in :meth:`slot_parameters` order) as the per-slot parameters from now on: the expert
        parameters in the module, the factors in their adapters (another layout's slots, or the training ones back)."""
        experts = len(self.param_names)
        for pname, p in zip(self.param_names, params[:experts], strict=True):
            setattr(self.module, pname, p)
        self.experts.use_adapter_parameters(params[experts:])

    def use_compute(self, compute: ExpertCompute) -> None:
        """Compute the received rows with ``compute`` from now on (an adapter's :class:`ExpertCompute`)."""
        self.experts = compute

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` outputs of this layer's experts for ``hidden_states [T, H]`` routed by ``top_k_index`` /
        ``top_k_weights [T, k]``: route → plan → dispatch → compute → combine. One counts exchange and the token
        exchanges, all inside the EP group; NaN outputs and no exchange once the EP group has seen bad
        inputs or a layer mismatch in this forward (:mod:`hf_hybrid_ep.parallel.agreement` raises on every rank).
        Under autocast over wider weights the rows travel and the experts compute in autocast's dtype (as
        ``F.linear`` would); the output returns in the input's dtype."""
        set_label(self.name)  # names this layer's collectives for the watchdog
        if self.agreement is not None and self.agreement.degraded:
            return self._skipped(hidden_states)
        control = control_vector(hidden_states, top_k_index, top_k_weights, self.num_experts, self.layer_id,
                                 self.options.check_finite)
        top_k_index = self._route(top_k_index, top_k_weights)
        side = SideChannel(control=control, local_slot_of=self._local_slot_of(top_k_index.device))
        compute = autocast_dtype(hidden_states)
        x = hidden_states if compute is None else hidden_states.to(compute)
        if self.options.overlap_degree > 1:
            return self._forward_pipelined(x, top_k_index, top_k_weights, side).to(hidden_states.dtype)
        plan = self.dispatcher.plan(top_k_index, side)[0]
        if self._disagreed(plan):
            return self._skipped(hidden_states)
        rows = self.dispatcher.dispatch(x, plan, top_k_weights)
        overlap = None
        if self.shared_overlap is not None:
            self.shared_overlap.experts_ran = True
            if self.shared_overlap.after_experts:
                overlap = lambda: self.shared_overlap.precompute(hidden_states)  # noqa: E731
        expert_out = self.experts(rows, plan.received)
        out = self.dispatcher.combine(expert_out, top_k_weights, plan, local_out=self._local_out(x, plan),
                                      overlap_with=overlap)
        return out.to(hidden_states.dtype)

    def _route(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The pairs this layer exchanges: over-capacity pairs dropped (expert id -1), the load counted."""
        dropped = 0
        o = self.options
        if o.capacity_factor is not None:
            top_k_index, dropped = apply_capacity(
                top_k_index, top_k_weights, self.num_experts, o.capacity_factor, o.drop_policy
            )
        if self.load is not None:
            self.load.count(top_k_index, dropped)
        return top_k_index

    def _local_slot_of(self, device: torch.device) -> torch.Tensor | None:
        """``[E]`` this rank's shadow slot of each expert (-1: none), or ``None`` without shadows."""
        if self.shadows is None:
            return None
        self.shadows.wait()  # the weights fetched after the last optimizer step
        return self.shadows.slot_of(device)

    def _disagreed(self, plan: DispatchPlan) -> bool:
        """Whether the EP group saw bad inputs or a layer mismatch in this plan's counts exchange."""
        return self.agreement is not None and self.agreement.check(self.layer_id, plan.peer_control)

    @staticmethod
    def _skipped(hidden: torch.Tensor) -> torch.Tensor:
        return torch.full_like(hidden, float("nan"))

    def _local_out(self, hidden: torch.Tensor, plan: DispatchPlan) -> torch.Tensor | None:
        """This rank's shadows (local replicas of remote experts) on its own pairs for them, through the
        module's own experts implementation with the shadow weights swapped in; ``None`` when none."""
        if plan.local is None:
            return None
        rows = hidden[plan.local.tokens]
        self.shadows.count_rows(self.stats.shadow, rows)
        return self.experts.local(rows, plan.local.slots, self.shadows.params)

    def _forward_pipelined(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                           side: SideChannel) -> torch.Tensor:
        """Split the tokens into ``overlap_degree`` chunks, all planned by one counts exchange. The token
        exchange of chunk i+1 runs while the experts of chunk i compute, and every chunk's return exchange
        is waited for only after the last chunk's experts. Both directions of every exchange are asynchronous
        (:class:`~hf_hybrid_ep.dispatch.alltoall.AsyncExchange`), so in backward the experts of one chunk run
        while the other chunks' gradients travel. Every rank runs the same number of chunks (a chunk may be
        empty), so the collectives pair up in the same order everywhere. Returns the combine's dtype."""
        chunks = self.options.overlap_degree
        bounds = [hidden.shape[0] * i // chunks for i in range(chunks + 1)]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        plans = self.dispatcher.plan(index, side, spans)
        if self._disagreed(plans[0]):
            return self._skipped(hidden)
        pending = self.dispatcher.dispatch_async(hidden[spans[0][0] : spans[0][1]], plans[0],
                                                 weights[spans[0][0] : spans[0][1]])
        in_flight = []
        for i, (a, b) in enumerate(spans):
            following = None
            if i + 1 < chunks:
                na, nb = spans[i + 1]
                following = self.dispatcher.dispatch_async(hidden[na:nb], plans[i + 1], weights[na:nb])
            rows, exchange = pending
            expert_out = self.experts(exchange.wait(rows), plans[i].received)
            in_flight.append((self.dispatcher.combine_async(expert_out, plans[i]), self._local_out(hidden[a:b], plans[i])))
            pending = following
        return torch.cat([combine.wait(weights[a:b], local_out)
                          for (a, b), (combine, local_out) in zip(spans, in_flight, strict=True)])


class SharedExpertOverlap:
    """Run a block's shared expert while the routed experts' return exchange is in flight.

    Only for blocks that call the shared expert *after* the routed experts on the same input
    (DeepSeek-V3, GLM-4-MoE): observed on the first forward, then the shared expert's output is
    computed inside the experts call, during the combine all-to-all, and handed back when the block
    asks for it with that same input. Blocks that call it first (Qwen2-MoE) are left as they are.
    Results are bit-identical: the same computation, reordered.
    """

    def __init__(self, block: nn.Module, shared: nn.Module) -> None:
        self.shared = shared
        self.after_experts: bool | None = None
        self.experts_ran = False
        self._stash: tuple[tuple, torch.Tensor] | None = None
        self._forward = shared.forward
        block.register_forward_pre_hook(self._block_starts)
        shared.forward = self._shared_forward

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (x.data_ptr(), x.numel(), x.dtype, x._version)

    def _block_starts(self, module, args) -> None:
        self.experts_ran = False
        self._stash = None

    def precompute(self, hidden: torch.Tensor) -> None:
        self._stash = (self._key(hidden), self._forward(hidden))

    def _shared_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.after_experts is None:
            self.after_experts = self.experts_ran
        stash, self._stash = self._stash, None
        if stash is not None and not args and not kwargs and stash[0] == self._key(x):
            return stash[1].view(*x.shape[:-1], stash[1].shape[-1])
        return self._forward(x, *args, **kwargs)
