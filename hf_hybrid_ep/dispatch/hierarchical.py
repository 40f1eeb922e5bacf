"""The hierarchical dispatcher: a token crosses to another node at most once per destination node.

An EP group of ``ep = N · G`` ranks spans N nodes of G ranks (ranks are numbered node-major: EP rank
``r`` is on node ``r // G`` with local index ``r % G``). Each rank joins two sub-groups of its EP group:
*inter* (the N ranks with its local index, one per node) and *intra* (the G ranks of its node).

Dispatch from a source rank s = (node n_s, local index l_s):

1. **plan**: every (token, k) pair is routed by the placement table exactly as the plain dispatcher
   routes it (same replica choice). A token's *node rows* are the nodes that hold at least one of its
   pairs. One counts exchange over the EP group (it also carries, to every rank of a node, the source's
   counts for the whole node, and the number of node rows it sends there), one device→host read.
2. **stage 1** (inter group): each node row — the token's activations, its k routing weights and k
   destination keys ``local index · slots + slot`` (−1 and weight 0 for the pairs not on that node),
   packed into one byte row — goes to the *relay*, the rank with local index l_s on that node (the row
   for s's own node is a local copy).
3. **stage 2** (intra group): the relay forwards every pair of the node rows it received to the rank of
   its node that holds the pair's slot: the plain dispatcher's exchange, with node rows as its tokens.

Combine reverses it: the expert outputs return to the relay inside the node, the relay forms each node
row's partial sum ``Σ_j w_j · y_j`` and sends one row per node row back across (stage 1 reversed), and
the source adds its node rows' partial sums (and its shadows' outputs). Autograd runs each exchange in
reverse, so the backward crosses nodes once per node row as well.

The cross-node rows of one direction are therefore the node-deduplicated sends that
:func:`hf_hybrid_ep.planning.placement.trace_traffic` predicts; each costs ``k · (weight bytes + 2)`` bytes of
(int16 keys while ``G · slots < 2¹⁵``) metadata beyond the activations in the dispatch, ``k`` weight
gradients in its backward, none in the combine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..parallel.watchdog import watched
from .alltoall import AsyncExchange, _exchange, all_to_all, all_to_all_async, exchange_name
from .gathers import weighted_gather
from .protocol import LocalPairs, Received, SideChannel
from .stats import CommStats
from .table import PlacementTable
from .torch_backend import TorchDispatcher, TorchPlan, host_ints, send_order_plan, span_ids


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in an EP group of ``nodes × per_node`` ranks and its two sub-groups
    (``None``: a sub-group of one rank, whose exchange is a local copy)."""

    nodes: int
    per_node: int
    node: int
    local: int
    inter_group: dist.ProcessGroup | None  # group rank = node
    intra_group: dist.ProcessGroup | None  # group rank = local index


def node_groups(mesh) -> NodeGroups:
    """Create the inter- and intra-node sub-groups of every EP group (every rank makes the same calls in the
    same order: group creation is a world collective) and return this rank's."""
    ep, nodes, per_node = mesh.ep_degree, mesh.ep_nodes, mesh.ranks_per_node
    mine: dict[str, dist.ProcessGroup | None] = {}
    for edp_rank in range(mesh.dp_degree):
        base = edp_rank * ep
        sets = [("inter", tuple(base + n * per_node + local for n in range(nodes))) for local in range(per_node)]
        sets += [("intra", tuple(base + node * per_node + local for local in range(per_node))) for node in range(nodes)]
        for kind, ranks in sets:
            # one rank per node: the inter set is the EP group itself; its own group (never the world's
            # reduction group, where the token exchange would queue behind gradient buckets)
            group = mesh.ep_group if kind == "inter" and per_node == 1 else mesh.group_of(ranks)
            if mesh.rank in ranks:
                mine[kind] = group
    return NodeGroups(nodes, per_node, mesh.ep_rank // per_node, mesh.ep_rank % per_node, mine["inter"], mine["intra"])


@dataclass
class HierarchicalPlan(TorchPlan):
    """A :class:`~hf_hybrid_ep.dispatch.torch_backend.TorchPlan` of the hierarchical dispatcher, for one token
    span.

    The base fields keep their meaning for this rank's experts and local pairs: ``recv_splits`` /
    ``received`` are the rows arriving from each relay of this node (stage 2), ``send_splits`` the pairs this
    rank forwards, as a relay, to each rank of its node (stage 2); ``order`` lists the local pairs first
    (``num_sent`` is 0: no pair is sent as itself).

    Attributes:
        node_send / node_recv: node rows sent to / received from each node (stage 1; index = node).
        token_of_row: ``[R]`` the token of each node row sent, rows ordered by node, then token.
        row_of: ``[T, N]`` the node row of (token, node), −1 when the token has no pair there.
        row_keys: ``[R, k]`` ``local index · slots + slot`` of the token's pairs on the row's node, −1
            elsewhere (int16 when it fits, else int32).
        relay / relay_weights: filled when stage 1 arrives: the relay's handle over the received node
            rows (its tokens), and their ``[R1, k]`` routing weights.
    """

    node_send: list[int] = field(default_factory=list)
    node_recv: list[int] = field(default_factory=list)
    token_of_row: torch.Tensor | None = None
    row_of: torch.Tensor | None = None
    row_keys: torch.Tensor | None = None
    relay: TorchPlan | None = None
    relay_weights: torch.Tensor | None = None


class _TokenRows(torch.autograd.Function):
    """``rows[r] = hidden[token_of_row[r]]``; the backward sums each token's node rows (a gather)."""

    @staticmethod
    def forward(ctx, hidden, token_of_row, row_of):  # type: ignore[override]
        ctx.save_for_backward(row_of)
        return hidden.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (row_of,) = ctx.saved_tensors
        return sum_node_rows(grad, row_of), None, None


class _SumNodeRows(torch.autograd.Function):
    """``out[t] = Σ_n rows[row_of[t, n]]`` (nodes in order; −1: none); the backward is ``_TokenRows``'s forward."""

    @staticmethod
    def forward(ctx, rows, row_of, token_of_row):  # type: ignore[override]
        ctx.save_for_backward(token_of_row)
        return sum_node_rows(rows, row_of)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None


def sum_node_rows(rows: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` sums of the rows ``row_of [T, N]`` points at (−1 adds nothing)."""
    tokens, nodes = row_of.shape
    padded = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])
    index = torch.where(row_of >= 0, row_of, rows.shape[0]).reshape(-1)
    return padded.index_select(0, index).view(tokens, nodes, -1).sum(1)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` → ``[R, C · element size]`` uint8, the same memory."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, columns: int) -> torch.Tensor:
    return b.contiguous().view(dtype).view(b.shape[0], columns)


class _PackedExchange(torch.autograd.Function):
    """Stage 1: node rows, their routing weights and keys in one byte row, one ``all_to_all_single``; the
    backward returns the gradients of rows and weights packed the same way, by the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, weights, keys, send_splits, recv_splits, group, stats, self_index):  # type: ignore[override]
        ctx.meta = (send_splits, recv_splits, group, stats, self_index, rows.dtype, rows.shape[1], weights.dtype,
                    weights.shape[1], rows.device)
        ctx.what = exchange_name("dispatch_inter, backward")
        packed = torch.cat([_as_bytes(rows), _as_bytes(weights), _as_bytes(keys)], dim=1)
        if stats is not None:
            stats.record("dispatch_inter", send_splits, recv_splits, self_index, packed.shape[1])
        out = _exchange(packed, send_splits, recv_splits, group, what=exchange_name("dispatch_inter"))
        cols = [rows.shape[1] * rows.element_size(), weights.shape[1] * weights.element_size()]
        keys_out = _from_bytes(out[:, cols[0] + cols[1] :], keys.dtype, keys.shape[1])
        ctx.mark_non_differentiable(keys_out)
        return (_from_bytes(out[:, : cols[0]], rows.dtype, rows.shape[1]),
                _from_bytes(out[:, cols[0] : cols[0] + cols[1]], weights.dtype, weights.shape[1]), keys_out)

    @staticmethod
    def backward(ctx, grad_rows, grad_weights, _grad_keys):  # type: ignore[override]
        send_splits, recv_splits, group, stats, self_index, row_dtype, width, w_dtype, k, device = ctx.meta
        if grad_rows is None:
            grad_rows = torch.zeros((sum(recv_splits), width), dtype=row_dtype, device=device)
        if grad_weights is None:
            grad_weights = torch.zeros((sum(recv_splits), k), dtype=w_dtype, device=device)
        packed = torch.cat([_as_bytes(grad_rows.to(row_dtype)), _as_bytes(grad_weights.to(w_dtype))], dim=1)
        if stats is not None:
            stats.record("dispatch_inter_backward", recv_splits, send_splits, self_index, packed.shape[1])
        out = _exchange(packed, recv_splits, send_splits, group, what=ctx.what)
        cut = width * row_dtype.itemsize
        return (_from_bytes(out[:, :cut], row_dtype, width), _from_bytes(out[:, cut:], w_dtype, k),
                None, None, None, None, None, None)


@dataclass(frozen=True)
class _Routes:
    """Where this rank's ``[T, k]`` pairs go: ``sent`` (not dropped, not kept local), the destination ``node``
    and ``local_key`` (``local index · slots + slot``), the local-pair mask and expert ids (``[T·k]``)."""

    sent: torch.Tensor
    node: torch.Tensor
    local_key: torch.Tensor
    local: torch.Tensor
    flat: torch.Tensor


class HierarchicalDispatcher(TorchDispatcher):
    """Node-deduplicating token exchange for an EP group that spans several nodes (see the module doc).

    A :class:`~hf_hybrid_ep.dispatch.protocol.Dispatcher`; :meth:`dispatch` uses the routing weights (the
    relays form the partial sums). One counts exchange and one host read per layer.
    """

    name = "hierarchical"

    def __init__(self, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats,
                 groups: NodeGroups, *, count_slots: int | None = None, control_ints: int = 0) -> None:
        super().__init__(table, ep_rank, ep_group, stats, count_slots=count_slots, control_ints=control_ints)
        self.groups = groups
        self.block = groups.per_node * self.count_slots + 1  # per span: a node's pair counts, then its node rows

    def plan(self, top_k_index: torch.Tensor, side: SideChannel | None = None,
             spans: Sequence[tuple[int, int]] | None = None) -> list[HierarchicalPlan]:
        """Route every pair, find each span's node rows, and exchange all counts in one message (one
        collective over the EP group, one host read)."""
        side = side or SideChannel()
        spans = list(spans) if spans is not None else [(0, top_k_index.shape[0])]
        num_tokens, k = top_k_index.shape
        g, device = self.groups, top_k_index.device
        route = self._route(top_k_index, side.local_slot_of)
        valid, dest_rank, dest_slot, local = route.valid, route.rank, route.slot, route.local
        routes = _Routes(
            sent=(valid & ~local).view(num_tokens, k), node=(dest_rank // g.per_node).view(num_tokens, k),
            # metadata bytes on the wire: int16 keys while they fit
            local_key=((dest_rank % g.per_node) * self.table.slots_per_rank + dest_slot).view(num_tokens, k).to(
                torch.int16 if g.per_node * self.table.slots_per_rank < 2**15 else torch.int32),
            local=local, flat=route.flat)
        message, grids, num_local = self._counts_message(routes, dest_rank * self.table.slots_per_rank + dest_slot,
                                                         spans, side)
        received = torch.empty(self.table.ep_degree, message.shape[1], dtype=torch.long, device=device)
        outgoing = message.repeat_interleave(g.per_node, dim=0)  # EP rank d gets its node's row
        if self.ep_group is None:
            received.copy_(outgoing)
        else:
            with watched(exchange_name("counts"), self.ep_group):
                dist.all_to_all_single(received, outgoing, group=self.ep_group)
        node_rows = message[:, self.block - 1 : len(spans) * self.block : self.block].T.reshape(-1)
        host = host_ints(torch.cat([num_local, node_rows, received.reshape(-1)]))
        chunks, nodes = len(spans), g.nodes
        recv_host = host[chunks + chunks * nodes :]
        width = message.shape[1]
        peer_control = self._peer_control(recv_host, width)
        return [self._span_plan(routes, span, c, grids[c], host[c], host[chunks + c * nodes : chunks + (c + 1) * nodes],
                                recv_host, received, width, side.local_slot_of, peer_control)
                for c, span in enumerate(spans)]

    def _counts_message(self, routes: _Routes, pair_dest: torch.Tensor, spans: list[tuple[int, int]],
                        side: SideChannel) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """``[nodes, spans · block + control_ints]`` int64: per node and span, this rank's pair counts for every
        (local index, slot) of the node (stride ``count_slots``), then the node rows it sends there; and per
        span the ``[nodes · tokens]`` node-major grid of which tokens have a pair on which node. Every rank
        of a node receives the node's row: as a relay it reads all of it, as a destination its own counts.
        Also ``[spans]`` the pairs kept local per span (their sort bin, as in the torch backend)."""
        g, device = self.groups, pair_dest.device
        ep, slots, stride = self.table.ep_degree, self.table.slots_per_rank, self.count_slots
        num_tokens, k = routes.sent.shape
        bins = ep * slots + 2
        not_sent = torch.where(routes.local, ep * slots, ep * slots + 1)
        key = (torch.where(routes.sent.reshape(-1), pair_dest, not_sent)
               + span_ids(num_tokens, spans, device).repeat_interleave(k) * bins)
        pair_count = torch.zeros(len(spans) * bins, dtype=torch.long, device=device)
        pair_count.scatter_add_(0, key, torch.ones_like(key))
        pair_count = pair_count.view(len(spans), bins)
        message = self._message(g.nodes, len(spans) * self.block - self.count_slots, side, device)
        grids = []
        for c, (a, b) in enumerate(spans):
            tokens = b - a
            cell = torch.where(routes.sent[a:b],
                               routes.node[a:b] * tokens + torch.arange(tokens, device=device).unsqueeze(1),
                               g.nodes * tokens)
            grid = torch.zeros(g.nodes * tokens + 1, dtype=torch.bool, device=device)
            grid.index_fill_(0, cell.reshape(-1), True)
            grids.append(grid[:-1])
            block = message[:, c * self.block : (c + 1) * self.block]
            block[:, : g.per_node * stride].view(g.nodes, g.per_node, stride)[:, :, :slots] = (
                pair_count[c, : ep * slots].view(g.nodes, g.per_node, slots))
            block[:, -1] = grids[-1].view(g.nodes, tokens).sum(1)
        return message, grids, pair_count[:, ep * slots]

    def _span_plan(self, routes: _Routes, span: tuple[int, int], c: int, grid: torch.Tensor, num_local: int,
                   node_send: list[int], recv_host: list[int], received: torch.Tensor, width: int,
                   local_slot_of: torch.Tensor | None, peer_control: list) -> HierarchicalPlan:
        """The plan of span ``c`` from the exchanged counts (host ints) and this rank's routes."""
        g, (a, b) = self.groups, span
        slots, stride, k = self.table.slots_per_rank, self.count_slots, routes.sent.shape[1]
        off, tokens = c * self.block, b - a

        def at(rank: int, col: int) -> int:
            return recv_host[rank * width + off + col]

        relayed = [n * g.per_node + g.local for n in range(g.nodes)]  # the sources this rank relays for
        node_recv = [at(s, self.block - 1) for s in relayed]
        relay_send = [sum(at(s, lo * stride + sl) for s in relayed for sl in range(slots)) for lo in range(g.per_node)]
        recv_counts_host = [sum(at(n * g.per_node + src, g.local * stride + sl) for n in range(g.nodes))
                            for src in range(g.per_node) for sl in range(slots)]
        recv_splits = [sum(recv_counts_host[src * slots : (src + 1) * slots]) for src in range(g.per_node)]
        col = off + g.local * stride
        recv_counts = received.view(g.nodes, g.per_node, width)[:, :, col : col + slots].sum(0).reshape(-1)
        cells = torch.sort((~grid).to(torch.int8), stable=True)[1][: sum(node_send)]  # rows: node-major, then token
        token_of_row, node_of_row = cells % tokens, cells // tokens
        row_of = torch.where(grid, torch.cumsum(grid, 0) - 1, -1).view(g.nodes, tokens).T.contiguous()
        sent, node = routes.sent[a:b][token_of_row], routes.node[a:b][token_of_row]
        on_row_node = sent & (node == node_of_row.unsqueeze(1))
        row_keys = torch.where(on_row_node, routes.local_key[a:b][token_of_row], -1)
        local_order, local = torch.arange(tokens * k, device=received.device), None
        if num_local:  # local pairs first
            local_order = torch.sort((~routes.local[a * k : b * k]).to(torch.int8), stable=True)[1]
            kept = local_order[:num_local]
            local = LocalPairs(kept // k, local_slot_of[routes.flat[kept + a * k]])
        return HierarchicalPlan(
            tokens, k, Received(g.per_node, slots, recv_counts, recv_counts_host), local=local,
            peer_control=peer_control, order=local_order, num_sent=0, send_splits=relay_send, recv_splits=recv_splits,
            node_send=node_send, node_recv=node_recv, token_of_row=token_of_row, row_of=row_of, row_keys=row_keys,
        )

    # ------------------------------------------------------------------ dispatch
    def _stage_one(self, hidden: torch.Tensor, plan: HierarchicalPlan, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Node rows to the relays; returns the pairs this rank forwards, in stage-2 send order."""
        g = self.groups
        rows = _TokenRows.apply(hidden, plan.token_of_row, plan.row_of)
        weights = torch.where(plan.row_keys >= 0, top_k_weights.index_select(0, plan.token_of_row),
                              top_k_weights.new_zeros(()))
        rows1, weights1, keys1 = _PackedExchange.apply(rows, weights, plan.row_keys, plan.node_send,
                                                       plan.node_recv, g.inter_group, self.stats, g.node)
        keys = keys1.reshape(-1).long()
        order = torch.sort(torch.where(keys >= 0, keys, g.per_node * self.table.slots_per_rank), stable=True)[1]
        plan.relay = send_order_plan(order, plan.send_splits, rows1.shape[0], plan.top_k)
        plan.relay_weights = weights1
        return self._permute(rows1, order, plan.relay.num_sent, plan.top_k)

    def dispatch(self, hidden: torch.Tensor, plan: HierarchicalPlan, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Stage 1 then stage 2; the rows this rank's experts compute."""
        return all_to_all(self._stage_one(hidden, plan, top_k_weights), plan.send_splits, plan.recv_splits,
                          self.groups.intra_group, stats=self.stats, phase="dispatch", self_index=self.groups.local)

    def dispatch_async(self, hidden: torch.Tensor, plan: HierarchicalPlan,
                       top_k_weights: torch.Tensor) -> tuple[torch.Tensor, AsyncExchange]:
        """Stage 1 (blocking), then stage 2 asynchronous in forward and backward."""
        return all_to_all_async(self._stage_one(hidden, plan, top_k_weights), plan.send_splits,
                                plan.recv_splits, self.groups.intra_group, stats=self.stats, phase="dispatch",
                                self_index=self.groups.local)

    # ------------------------------------------------------------------ combine
    def _partial_sums(self, expert_out: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
        """Stage 2 reversed, then each received node row's ``Σ_j w_j · y_j`` at this relay: ``[R1, H]``."""
        g = self.groups
        back = all_to_all(expert_out, plan.recv_splits, plan.send_splits, g.intra_group, stats=self.stats,
                          phase="combine", self_index=g.local)
        # in the rows' dtype on the wire (bf16 rows under autocast stay bf16; the sum itself is promoted)
        relay = plan.relay
        return weighted_gather(back, plan.relay_weights, relay.position, relay.order).to(expert_out.dtype)

    def _send_back(self, expert_out: torch.Tensor, plan: HierarchicalPlan, pending=None) -> torch.Tensor:
        """Partial sums at the relays, one row per node row back across (asynchronous with ``pending``)."""
        return all_to_all(self._partial_sums(expert_out, plan), plan.node_recv, plan.node_send,
                          self.groups.inter_group, stats=self.stats, phase="combine_inter",
                          self_index=self.groups.node, pending=pending)

    def _send_back_async(self, expert_out: torch.Tensor, plan: HierarchicalPlan) -> tuple[torch.Tensor, AsyncExchange]:
        """Stage 2 reversed (blocking), then the cross-node return asynchronous in forward and backward."""
        return all_to_all_async(self._partial_sums(expert_out, plan), plan.node_recv, plan.node_send,
                                self.groups.inter_group, stats=self.stats, phase="combine_inter",
                                self_index=self.groups.node)

    def _finish_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, plan: HierarchicalPlan,
                        local_out: torch.Tensor | None) -> torch.Tensor:
        """``[T, H]``: the sum of each token's node rows' partial sums, plus its local pairs' weighted outputs."""
        out = _SumNodeRows.apply(back, plan.row_of, plan.token_of_row)
        if local_out is not None:  # the local pairs lead plan.order
            out = out + weighted_gather(local_out.to(back.dtype), top_k_weights, plan.position, plan.order)
        return out
