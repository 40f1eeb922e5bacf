"""The deduplicated dispatcher: a token crosses to each destination rank at most once, and to each destination
node at most once.

Per (token, expert) pair exchanges send a token to a rank once for every one of its k experts there. Here a
token travels once per destination, carrying its k routing weights and k destination keys (−1 and weight 0
for the pairs not there), packed into one byte row with its activations; the destination fans the row out
to its local experts and returns one partial sum ``Σ_j w_j · y_j`` per row. An EP group of ``ep = N · G``
ranks spans N nodes of G ranks (node-major numbering: EP rank ``r`` is local index ``r % G`` on node
``r // G``; N = 1 inside one node), and each rank joins two sub-groups of its EP group: *inter* (the N ranks
with its local index, one per node) and *intra* (the G ranks of its node).

Dispatch from a source rank s = (node n_s, local index l_s):

1. **plan**: every pair is routed by the placement table exactly as the per-pair dispatcher routes it (same
   replica choice). One counts exchange over the EP group carries, to every rank of a destination node, the
   source's per-(rank, slot) pair counts for the node, its rows per rank of the node and its rows for the
   node; one device→host read.
2. **stage A** (inter group; only when the EP group spans nodes): one *node row* per (token, node) goes to
   the *relay*, the rank with local index l_s on that node, keys ``local index · slots + slot``.
3. **stage B** (intra group): the relay sends one *rank row* per (node row, rank of its node) holding a
   pair, keys ``slot``.
4. **fan-out**: the destination expands its rank rows into pairs ordered by slot — the rows its experts
   compute (``plan.received``: one source, per-slot counts).

Combine reverses it: the destination forms each rank row's partial sum, stage B returns one row per rank
row, the relay adds a node row's rank rows, stage A returns one row per node row, and the source adds its
node rows' partial sums (and its local pairs' weighted outputs). Autograd runs each exchange in reverse, so
the backward crosses once per row too, and the routing-weight gradients are computed where the expert
outputs are. Each row costs ``k · (weight bytes + 2)`` bytes of metadata (int16 keys while they fit)
beyond the activations in the dispatch, ``k`` weight gradients in its backward, none in the combine.
:func:`hf_hybrid_ep.planning.placement.trace_traffic` predicts the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.watchdog import label, wait, watched
from .alltoall import AsyncExchange, all_to_all, all_to_all_async, exchange_name
from .gathers import CHUNK_BYTES, GatherTokens, picked_rows, row_bytes, row_chunks, weighted_gather
from .protocol import LocalPairs, Received, SideChannel
from .stats import CommStats
from .table import PlacementTable
from .torch_backend import TorchDispatcher, TorchPlan, host_ints, send_order_plan, span_ids


@dataclass(frozen=True)
class DedupGroups:
    """This rank's place in an EP group of ``nodes × per_node`` ranks and its two sub-groups
    (``None``: a sub-group of one rank, whose exchange is a local copy)."""

    nodes: int
    per_node: int
    node: int
    local: int
    inter_group: dist.ProcessGroup | None  # group rank = node
    intra_group: dist.ProcessGroup | None  # group rank = local index


def dedup_groups(mesh) -> DedupGroups:
    """Create the inter- and intra-node sub-groups of every EP group (every rank makes the same calls in the
    same order: group creation is a world collective) and return this rank's. Inside one node the intra
    group is the EP group and there is no inter group."""
    ep, nodes = mesh.ep_degree, mesh.ep_nodes
    per_node = ep // nodes
    if nodes == 1:
        return DedupGroups(1, ep, 0, mesh.ep_rank, None, mesh.ep_group)
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
    return DedupGroups(nodes, per_node, mesh.ep_rank // per_node, mesh.ep_rank % per_node, mine["inter"],
                       mine["intra"])


@dataclass
class RowStage:
    """One deduplicating stage seen from one rank: rows sent (one per (row, member) with a pair there) and
    received, within one group.

    Attributes:
        send / recv: rows sent to / received from each member of the group (host).
        src_of_row: ``[R_out]`` the input row of each row sent, ordered by member, then input row.
        row_of: ``[R_in, M]`` the sent row of (input row, member), −1 when the input row has no pair there.
        keys: ``[R_out, k]`` the sub-keys of each sent row's pairs on its member, −1 elsewhere.
    """

    send: list[int]
    recv: list[int]
    src_of_row: torch.Tensor | None = None
    row_of: torch.Tensor | None = None
    keys: torch.Tensor | None = None


@dataclass
class DedupPlan(TorchPlan):
    """A :class:`~hf_hybrid_ep.dispatch.torch_backend.TorchPlan` of the deduplicated dispatcher, for one token
    span. ``order`` lists the local pairs first (``num_sent`` is 0: no pair is sent as itself);
    ``received`` is the fan-out's pairs by slot.

    Attributes:
        stage_a: node rows (``None`` inside one node); ``stage_b``: rank rows (``src_of_row`` etc. filled at
            the relay, after stage A arrives).
        token_keys: ``[T, k]`` ``local index · slots + slot`` of every sent pair (−1: not sent).
        fan / fan_weights: filled at the destination: the fan-out's plan over the received rank rows (their
            pairs by slot) and those rows' ``[R, k]`` routing weights.
    """

    stage_a: RowStage | None = None
    stage_b: RowStage | None = None
    token_keys: torch.Tensor | None = None
    fan: TorchPlan | None = None
    fan_weights: torch.Tensor | None = None


class _RowsOf(torch.autograd.Function):
    """``rows[r] = src[src_of_row[r]]``; the backward sums each source row's rows (a gather)."""

    @staticmethod
    def forward(ctx, src, src_of_row, row_of, chunk_bytes):  # type: ignore[override]
        ctx.save_for_backward(row_of)
        ctx.chunk_bytes = chunk_bytes
        return src.index_select(0, src_of_row)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (row_of,) = ctx.saved_tensors
        return sum_rows(grad, row_of, ctx.chunk_bytes), None, None, None


class _SumRows(torch.autograd.Function):
    """``out[i] = Σ_m rows[row_of[i, m]]`` (members in order; −1: none); the backward is ``_RowsOf``'s forward."""

    @staticmethod
    def forward(ctx, rows, row_of, src_of_row, chunk_bytes):  # type: ignore[override]
        ctx.save_for_backward(src_of_row)
        return sum_rows(rows, row_of, chunk_bytes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (src_of_row,) = ctx.saved_tensors
        return grad.index_select(0, src_of_row), None, None, None


def sum_rows(rows: torch.Tensor, row_of: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``[R_in, H]`` sums of the rows ``row_of [R_in, M]`` points at (−1 adds nothing), gathered ``chunk_bytes``
    of rows at a time."""
    count, members = row_of.shape
    out = rows.new_empty((count, *rows.shape[1:]))
    for a, b in row_chunks(count, members * row_bytes(rows), chunk_bytes):
        index = row_of[a:b].reshape(-1)
        picked = picked_rows(rows, torch.where(index >= 0, index, rows.shape[0]), rows.dtype, zero_missing=True)
        torch.sum(picked.view(b - a, members, *rows.shape[1:]), dim=1, out=out[a:b])
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` → ``[R, C · element size]`` uint8, the same memory."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, columns: int) -> torch.Tensor:
    return b.contiguous().view(dtype).view(b.shape[0], columns)


class PackedExchange:
    """Rows, their routing weights and keys packed into one byte row each and exchanged with one
    ``all_to_all_single`` per direction, asynchronous in forward and backward like
    :class:`~hf_hybrid_ep.dispatch.alltoall.AsyncExchange`: ``carrier = exchange.launch(rows, weights, keys)``
    starts it, ``rows, weights, keys = exchange.wait(carrier)`` completes it. In backward the gradient of the
    wait launches the reverse exchange of the rows' and weights' gradients and the gradient of the launch
    waits for it. Keys carry no gradient."""

    def __init__(self, send: list[int], recv: list[int], group, stats: CommStats | None, self_index: int,
                 phase: str) -> None:
        self.send, self.recv, self.group, self.stats = send, recv, group, stats
        self.self_index, self.phase = self_index, phase
        self.layer = label()
        self.work = self.out = self.backward_work = self.backward_out = self.backward_in = None
        self.shapes: tuple = ()

    def launch(self, rows: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return _LaunchPacked.apply(rows, weights, keys, self)

    def wait(self, carrier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _WaitPacked.apply(carrier, self)

    def start(self, packed: torch.Tensor, send: list[int], recv: list[int], phase: str) -> tuple[torch.Tensor, object]:
        """``packed`` to the members (``send`` rows each), into a fresh buffer; the work handle (``None`` when
        the group is this rank alone: a copy)."""
        if self.stats is not None:
            self.stats.record(phase, send, recv, self.self_index, packed.shape[1])
        out = packed.new_empty((sum(recv), packed.shape[1]))
        if self.group is None:
            out.copy_(packed)
            return out, None
        return out, dist.all_to_all_single(out, packed, recv, send, group=self.group, async_op=True)

    def unpack(self, out: torch.Tensor, with_keys: bool) -> list[torch.Tensor]:
        cuts, parts = 0, []
        for dtype, columns in self.shapes[: 3 if with_keys else 2]:
            width = columns * dtype.itemsize
            parts.append(_from_bytes(out[:, cuts : cuts + width], dtype, columns))
            cuts += width
        return parts


class _LaunchPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, keys, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        exchange.shapes = ((rows.dtype, rows.shape[1]), (weights.dtype, weights.shape[1]), (keys.dtype, keys.shape[1]))
        packed = torch.cat([_as_bytes(rows), _as_bytes(weights), _as_bytes(keys)], dim=1)
        exchange.out, exchange.work = exchange.start(packed, exchange.send, exchange.recv, exchange.phase)
        return rows.new_empty(0)  # carries the autograd edge from the launch to the wait

    @staticmethod
    def backward(ctx, _grad):  # type: ignore[override]
        e = ctx.exchange  # the gradient of the wait launched the reverse exchange
        if e.backward_work is not None:
            wait(e.backward_work, exchange_name(e.phase + ", backward", e.layer), e.group)
        grad_rows, grad_weights = e.unpack(e.backward_out, with_keys=False)
        e.backward_work = e.backward_out = e.backward_in = None
        return grad_rows, grad_weights, None, None


class _WaitPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, exchange):  # type: ignore[override]
        if exchange.work is not None:
            wait(exchange.work, exchange_name(exchange.phase, exchange.layer), exchange.group)
        rows, weights, keys = exchange.unpack(exchange.out, with_keys=True)
        exchange.work = exchange.out = None
        ctx.exchange, ctx.device = exchange, rows.device
        ctx.mark_non_differentiable(keys)
        return rows, weights, keys

    @staticmethod
    def backward(ctx, grad_rows, grad_weights, _grad_keys):  # type: ignore[override]
        e = ctx.exchange
        (row_dtype, width), (w_dtype, k) = e.shapes[0], e.shapes[1]
        if grad_rows is None:
            grad_rows = torch.zeros((sum(e.recv), width), dtype=row_dtype, device=ctx.device)
        if grad_weights is None:
            grad_weights = torch.zeros((sum(e.recv), k), dtype=w_dtype, device=ctx.device)
        e.backward_in = torch.cat([_as_bytes(grad_rows.to(row_dtype)), _as_bytes(grad_weights.to(w_dtype))], dim=1)
        e.backward_out, e.backward_work = e.start(e.backward_in, e.recv, e.send, e.phase + "_backward")
        return grad_rows.new_empty(0), None


def row_grid(member: torch.Tensor, members: int) -> torch.Tensor:
    """``[M · R_in]`` bool, member-major: which (member, input row) cells hold a pair; ``member [R_in, k]`` is
    each pair's member (−1: none). A cell becomes one row of a deduplicating stage."""
    rows_in = member.shape[0]
    cell = torch.where(member >= 0, member * rows_in + torch.arange(rows_in, device=member.device).unsqueeze(1),
                       members * rows_in)
    grid = torch.zeros(members * rows_in + 1, dtype=torch.bool, device=member.device)
    grid.index_fill_(0, cell.reshape(-1), True)
    return grid[:-1]


def stage_rows(member: torch.Tensor, members: int, sub_keys: torch.Tensor, stage: RowStage) -> RowStage:
    """Fill ``stage`` (whose ``send`` counts are known on the host) with its rows: one per (input row, member)
    holding a pair, member-major, then input row; ``member [R_in, k]`` is each pair's member (−1: none) and
    ``sub_keys [R_in, k]`` its key at the member."""
    rows_in = member.shape[0]
    grid = row_grid(member, members)
    cells = torch.sort((~grid).to(torch.int8), stable=True)[1][: sum(stage.send)]
    src, member_of_row = cells % rows_in, cells // rows_in
    stage.src_of_row = src
    stage.row_of = torch.where(grid, torch.cumsum(grid, 0) - 1, -1).view(members, rows_in).T.contiguous()
    on_member = member.index_select(0, src) == member_of_row.unsqueeze(1)
    stage.keys = torch.where(on_member, sub_keys.index_select(0, src), -1).to(sub_keys.dtype)
    return stage


def _launch_stage(rows: torch.Tensor, weights: torch.Tensor, stage: RowStage, group, stats: CommStats,
                  self_index: int, phase: str, chunk_bytes: int) -> tuple[torch.Tensor, PackedExchange]:
    """Start one stage's rows (with their weights and keys, packed) to their members: ``(carrier, exchange)``,
    ``exchange.wait(carrier)`` gives ``(rows, weights, keys)`` as received."""
    out_rows = _RowsOf.apply(rows, stage.src_of_row, stage.row_of, chunk_bytes)
    out_weights = torch.where(stage.keys >= 0, weights.index_select(0, stage.src_of_row), weights.new_zeros(()))
    exchange = PackedExchange(stage.send, stage.recv, group, stats, self_index, phase)
    return exchange.launch(out_rows, out_weights, stage.keys), exchange


class DedupDispatcher(TorchDispatcher):
    """The deduplicated token exchange (see the module docstring): a
    :class:`~hf_hybrid_ep.dispatch.protocol.Dispatcher` whose :meth:`dispatch` sends the routing weights with
    the rows (the destinations form the partial sums). One counts exchange and one host read per layer.
    """

    name = "dedup"

    def __init__(self, table: PlacementTable, ep_rank: int, ep_group: dist.ProcessGroup | None, stats: CommStats,
                 groups: DedupGroups, *, count_slots: int | None = None, control_ints: int = 0) -> None:
        super().__init__(table, ep_rank, ep_group, stats, count_slots=count_slots, control_ints=control_ints)
        self.groups = groups
        self.chunk_bytes = CHUNK_BYTES  # the most bytes of picked rows a fan-out or partial-sum gather holds at once
        g = groups
        # per span and destination node: pair counts per (local index, slot), rows per rank, rows for the node
        self.block = g.per_node * self.count_slots + g.per_node + 1
        self.key_dtype = torch.int16 if g.per_node * table.slots_per_rank < 2**15 else torch.int32

    # ------------------------------------------------------------------ plan
    def plan(self, top_k_index: torch.Tensor, side: SideChannel | None = None,
             spans: Sequence[tuple[int, int]] | None = None) -> list[DedupPlan]:
        """Route every pair, count each span's pairs, rank rows and node rows, and exchange all counts in one
        message (one collective over the EP group, one host read)."""
        side = side or SideChannel()
        spans = list(spans) if spans is not None else [(0, top_k_index.shape[0])]
        num_tokens, k = top_k_index.shape
        g, slots, device = self.groups, self.table.slots_per_rank, top_k_index.device
        route = self._route(top_k_index, side.local_slot_of)
        sent = (route.valid & ~route.local).view(num_tokens, k)
        rank = route.rank.view(num_tokens, k)
        token_keys = torch.where(sent, (rank % g.per_node) * slots + route.slot.view(num_tokens, k), -1).to(self.key_dtype)
        message, num_local = self._counts_message(route, sent, rank, spans, side)
        received = torch.empty(self.table.ep_degree, message.shape[1], dtype=torch.long, device=device)
        outgoing = message.repeat_interleave(g.per_node, dim=0)  # EP rank d gets its node's row
        if self.ep_group is None:
            received.copy_(outgoing)
        else:
            with watched(exchange_name("counts"), self.ep_group):
                dist.all_to_all_single(received, outgoing, group=self.ep_group)
        host = host_ints(torch.cat([num_local, message[:, : len(spans) * self.block].reshape(-1),
                                    received.reshape(-1)]))
        chunks, width = len(spans), message.shape[1]
        own = host[chunks : chunks + g.nodes * chunks * self.block]
        recv_host = host[chunks + g.nodes * chunks * self.block :]
        peer_control = self._peer_control(recv_host, width)
        return [self._span_plan(route, sent, rank, token_keys, span, c, host[c], own, recv_host, received, width,
                                side.local_slot_of, peer_control) for c, span in enumerate(spans)]

    def _counts_message(self, route, sent: torch.Tensor, rank: torch.Tensor, spans: list[tuple[int, int]],
                        side: SideChannel) -> tuple[torch.Tensor, torch.Tensor]:
        """``[nodes, spans · block + control_ints]`` int64: per destination node and span, this rank's pair
        counts for every (local index, slot) of the node (stride ``count_slots``), its rank rows for every
        local index and its node rows; every rank of a node receives the node's row. Also ``[spans]`` the
        pairs kept local per span (their sort bin, as in the per-pair dispatcher)."""
        g, device = self.groups, sent.device
        ep, slots, stride = self.table.ep_degree, self.table.slots_per_rank, self.count_slots
        num_tokens, k = sent.shape
        bins = ep * slots + 2
        not_sent = torch.where(route.local, ep * slots, ep * slots + 1)
        key = (torch.where(sent.reshape(-1), route.rank * slots + route.slot, not_sent)
               + span_ids(num_tokens, spans, device).repeat_interleave(k) * bins)
        pair_count = torch.zeros(len(spans) * bins, dtype=torch.long, device=device)
        pair_count.scatter_add_(0, key, torch.ones_like(key))
        pair_count = pair_count.view(len(spans), bins)
        message = self._message(g.nodes, len(spans) * self.block - self.count_slots, side, device)
        for c, (a, b) in enumerate(spans):
            block = message[:, c * self.block : (c + 1) * self.block]
            block[:, : g.per_node * stride].view(g.nodes, g.per_node, stride)[:, :, :slots] = (
                pair_count[c, : ep * slots].view(g.nodes, g.per_node, slots))
            rank_grid = row_grid(torch.where(sent[a:b], rank[a:b], -1), ep)
            block[:, g.per_node * stride : g.per_node * stride + g.per_node] = (
                rank_grid.view(ep, b - a).sum(1).view(g.nodes, g.per_node))
            node_grid = row_grid(torch.where(sent[a:b], rank[a:b] // g.per_node, -1), g.nodes)
            block[:, -1] = node_grid.view(g.nodes, b - a).sum(1)
        return message, pair_count[:, ep * slots]

    def _span_plan(self, route, sent: torch.Tensor, rank: torch.Tensor, token_keys: torch.Tensor,
                   span: tuple[int, int], c: int, num_local: int, own: list[int], recv_host: list[int],
                   received: torch.Tensor, width: int, local_slot_of: torch.Tensor | None,
                   peer_control: list) -> DedupPlan:
        """The plan of span ``c`` from the exchanged counts (host ints) and this rank's routes."""
        g, (a, b) = self.groups, span
        slots, stride, k = self.table.slots_per_rank, self.count_slots, sent.shape[1]
        off, tokens, own_width = c * self.block, b - a, len(own) // g.nodes
        rows_col, node_col = g.per_node * stride, self.block - 1

        def at(source: int, col: int) -> int:
            return recv_host[source * width + off + col]

        relayed = [m * g.per_node + g.local for m in range(g.nodes)]  # the sources this rank relays for
        stage_b = RowStage(send=[sum(at(s, rows_col + lo) for s in relayed) for lo in range(g.per_node)],
                           recv=[sum(at(m * g.per_node + j, rows_col + g.local) for m in range(g.nodes))
                                 for j in range(g.per_node)])
        stage_a = None
        if g.nodes > 1:
            stage_a = stage_rows(torch.where(sent[a:b], rank[a:b] // g.per_node, -1), g.nodes, token_keys[a:b],
                                 RowStage(send=[own[m * own_width + off + node_col] for m in range(g.nodes)],
                                          recv=[at(s, node_col) for s in relayed]))
        counts_host = [sum(at(s, g.local * stride + sl) for s in range(self.table.ep_degree)) for sl in range(slots)]
        col = off + g.local * stride
        counts = received[:, col : col + slots].sum(0)
        local_order, local = torch.arange(tokens * k, device=received.device), None
        if num_local:  # local pairs first
            local_order = torch.sort((~route.local[a * k : b * k]).to(torch.int8), stable=True)[1]
            kept = local_order[:num_local]
            local = LocalPairs(kept // k, local_slot_of[route.flat[kept + a * k]])
        return DedupPlan(tokens, k, Received(1, slots, counts, counts_host), local=local, peer_control=peer_control,
                         order=local_order, num_sent=0, send_splits=[], recv_splits=[], stage_a=stage_a,
                         stage_b=stage_b, token_keys=token_keys[a:b])

    # ------------------------------------------------------------------ dispatch
    def _relay_input(self, hidden: torch.Tensor, plan: DedupPlan, top_k_weights: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, weights, keys)`` this rank forwards in stage B: the node rows stage A brought it (stage A
        blocking), or, inside one node, its own tokens."""
        g = self.groups
        if plan.stage_a is None:
            keys = plan.token_keys
            return hidden, torch.where(keys >= 0, top_k_weights, top_k_weights.new_zeros(())), keys
        carrier, exchange = _launch_stage(hidden, top_k_weights, plan.stage_a, g.inter_group, self.stats, g.node,
                                          "dispatch_inter", self.chunk_bytes)
        return exchange.wait(carrier)

    def _launch_stage_b(self, hidden: torch.Tensor, plan: DedupPlan, top_k_weights: torch.Tensor
                        ) -> tuple[torch.Tensor, PackedExchange]:
        g, slots = self.groups, self.table.slots_per_rank
        rows1, weights1, keys1 = self._relay_input(hidden, plan, top_k_weights)
        long_keys = keys1.long()
        member = torch.where(long_keys >= 0, long_keys // slots, -1)
        stage_rows(member, g.per_node, torch.where(long_keys >= 0, long_keys % slots, -1).to(keys1.dtype), plan.stage_b)
        return _launch_stage(rows1, weights1, plan.stage_b, g.intra_group, self.stats, g.local, "dispatch",
                             self.chunk_bytes)

    def _fan_out(self, received: tuple[torch.Tensor, torch.Tensor, torch.Tensor], plan: DedupPlan) -> torch.Tensor:
        """The received rank rows expanded into this rank's pairs, by slot."""
        rows, weights, keys = received
        fan_keys = keys.reshape(-1).long()
        slots = self.table.slots_per_rank
        order = torch.sort(torch.where(fan_keys >= 0, fan_keys, slots), stable=True)[1]
        plan.fan = send_order_plan(order, [plan.received.num_rows], rows.shape[0], plan.top_k)
        plan.fan_weights = weights
        return GatherTokens.apply(rows, order, plan.fan.num_sent, plan.top_k, self.chunk_bytes)

    def dispatch(self, hidden: torch.Tensor, plan: DedupPlan, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Stage A, stage B, fan-out: the pairs this rank's experts compute, by slot."""
        carrier, exchange = self._launch_stage_b(hidden, plan, top_k_weights)
        return self._fan_out(exchange.wait(carrier), plan)

    def dispatch_async(self, hidden: torch.Tensor, plan: DedupPlan,
                       top_k_weights: torch.Tensor) -> tuple[torch.Tensor, _FanOut]:
        """Stage A (blocking), then stage B asynchronous in forward and backward; ``exchange.wait(carrier)``
        completes it and fans out."""
        carrier, exchange = self._launch_stage_b(hidden, plan, top_k_weights)
        return carrier, _FanOut(self, plan, exchange)

    # ------------------------------------------------------------------ combine
    def _rank_partials(self, expert_out: torch.Tensor, plan: DedupPlan) -> torch.Tensor:
        """Each received rank row's ``Σ_j w_j · y_j``: ``[R2, H]`` in the outputs' dtype (bf16 rows under
        autocast stay bf16 on the wire)."""
        fan = plan.fan
        return weighted_gather(expert_out, plan.fan_weights, fan.position, fan.order,
                               self.chunk_bytes).to(expert_out.dtype)

    def _node_sums(self, back: torch.Tensor, plan: DedupPlan) -> torch.Tensor:
        """Stage B returned: each relayed row's sum of its rank rows."""
        return _SumRows.apply(back, plan.stage_b.row_of, plan.stage_b.src_of_row, self.chunk_bytes)

    def _token_sums(self, back: torch.Tensor, plan: DedupPlan) -> torch.Tensor:
        """Stage A returned: each token's sum of its node rows."""
        return _SumRows.apply(back, plan.stage_a.row_of, plan.stage_a.src_of_row, self.chunk_bytes)

    def _send_back(self, expert_out: torch.Tensor, plan: DedupPlan, pending=None) -> torch.Tensor:
        """Stage B back to the relays and summed, then (across nodes) stage A back, asynchronous with
        ``pending``; :meth:`_finish_combine` completes it."""
        g, b, a = self.groups, plan.stage_b, plan.stage_a
        back = all_to_all(self._rank_partials(expert_out, plan), b.recv, b.send, g.intra_group, stats=self.stats,
                          phase="combine", self_index=g.local, pending=pending if a is None else None)
        if a is None:
            return back
        return all_to_all(self._node_sums(back, plan), a.recv, a.send, g.inter_group, stats=self.stats,
                          phase="combine_inter", self_index=g.node, pending=pending)

    def _finish_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, plan: DedupPlan,
                        local_out: torch.Tensor | None) -> torch.Tensor:
        """``[T, H]``: each token's sum of what :meth:`_send_back` returned, plus its local pairs' outputs."""
        out = self._node_sums(back, plan) if plan.stage_a is None else self._token_sums(back, plan)
        return self._add_local(out, top_k_weights, plan, local_out)

    @staticmethod
    def _add_local(out: torch.Tensor, top_k_weights: torch.Tensor, plan: DedupPlan,
                   local_out: torch.Tensor | None) -> torch.Tensor:
        if local_out is None:
            return out
        # the local pairs lead plan.order
        return out + weighted_gather(local_out.to(out.dtype), top_k_weights, plan.position, plan.order)

    def combine_async(self, expert_out: torch.Tensor, plan: DedupPlan) -> _DedupCombine:
        """The last return exchange asynchronous in forward and backward (stage B inside one node; across
        nodes stage B blocking, then stage A); ``.wait(top_k_weights, local_out)``."""
        g, b, a = self.groups, plan.stage_b, plan.stage_a
        partials = self._rank_partials(expert_out, plan)
        if a is None:
            back, exchange = all_to_all_async(partials, b.recv, b.send, g.intra_group, stats=self.stats,
                                              phase="combine", self_index=g.local)
            return _DedupCombine(self, plan, back, exchange, self._node_sums)
        node = self._node_sums(all_to_all(partials, b.recv, b.send, g.intra_group, stats=self.stats, phase="combine",
                                          self_index=g.local), plan)
        back, exchange = all_to_all_async(node, a.recv, a.send, g.inter_group, stats=self.stats, phase="combine_inter",
                                          self_index=g.node)
        return _DedupCombine(self, plan, back, exchange, self._token_sums)


class _FanOut:
    """Stage B in flight (:meth:`DedupDispatcher.dispatch_async`): ``wait(carrier)`` completes it and fans out."""

    def __init__(self, dispatcher: DedupDispatcher, plan: DedupPlan, exchange: PackedExchange) -> None:
        self.dispatcher, self.plan, self.exchange = dispatcher, plan, exchange

    def wait(self, carrier: torch.Tensor) -> torch.Tensor:
        return self.dispatcher._fan_out(self.exchange.wait(carrier), self.plan)


class _DedupCombine:
    """A combine whose last return exchange is in flight (:meth:`DedupDispatcher.combine_async`)."""

    def __init__(self, dispatcher: DedupDispatcher, plan: DedupPlan, back: torch.Tensor, exchange: AsyncExchange,
                 sums) -> None:
        self.dispatcher, self.plan, self.back, self.exchange, self.sums = dispatcher, plan, back, exchange, sums

    def wait(self, top_k_weights: torch.Tensor, local_out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.sums(self.exchange.wait(self.back), self.plan)
        return self.dispatcher._add_local(out, top_k_weights, self.plan, local_out)
