"""Flat buckets: the unit in which gradients are reduced and ZeRO-1 shards are laid out.

A :class:`FlatBucket` is a virtual 1-D concatenation of parameter *pieces* (``param.view(-1)[start :
start + length]``) held by the same set of ranks, reduced by one collective over their process group.
Every member rank derives the same buckets, in the same order, with the same offsets:

* dense parameters: one set of buckets over the whole world;
* expert slots: buckets over the exact set of ranks holding them (the EDP group, plus EP replicas),
  pieces in (layer, global expert id) order — runs of local slots, so replicas held in different slots
  on different ranks still line up.

Buckets are filled in reverse registration order (the order backward produces gradients) and cut once
they reach ``bucket_bytes``. A piece that covers its whole parameter is a *view* piece: the parameter's
``.grad`` is a view into the bucket's persistent gradient buffer, so autograd accumulates straight into
it and the collective runs in place. Other pieces (a parameter whose slots belong to several holder
sets) are *staged*: copied into the buffer before the collective and back after it.

Under ZeRO-1 the buffer is split into ``size`` equal shards of ``ceil(numel / size)`` elements (the
tail padding is communicated as zeros); the parameters of view pieces also live in a flat parameter
buffer, so the all-gather after the optimizer step writes them in place.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Piece:
    """``param.view(-1)[start : start + length]`` at ``offset`` of its bucket's flat layout."""

    param: nn.Parameter
    start: int
    length: int
    offset: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.length == self.param.numel()


@dataclass
class OwnedView:
    """The part of a piece that this rank owns under ZeRO-1: ``param.view(-1)[start:stop]`` = shard ``[lo:hi]``."""

    param: nn.Parameter
    start: int
    stop: int
    lo: int  # offset inside this rank's shard
    view: torch.Tensor  # what the torch optimizer steps (shares storage with ``param``)


@dataclass(eq=False)
class FlatBucket:
    """Parameter pieces reduced together over ``ranks`` (sorted global ranks) and ``group``."""

    kind: str  # "dense" or "expert"
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    index: int  # this rank's position in ``ranks``
    pieces: list[Piece]
    numel: int
    position: int = 0  # place in the reducer's bucket order (launch order within a group)
    grad_buffer: torch.Tensor | None = None  # [padded] persistent gradient buffer (None: passive bucket)
    param_buffer: torch.Tensor | None = None  # [padded] ZeRO-1 flat parameters
    owned: list[OwnedView] = field(default_factory=list)
    param_count: int = 0  # distinct parameters among the pieces
    # per-backward state
    pending: int = 0  # parameters whose gradient is not accumulated yet in this backward
    launched: bool = False
    work: object | None = None
    shard_out: torch.Tensor | None = None  # ZeRO-1: this rank's reduced shard while in flight
    gather_work: object | None = None  # ZeRO-1: pending parameter all-gather

    # ------------------------------------------------------------------ layout
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def shard(self) -> int:
        """Elements per ZeRO-1 shard ``S = ceil(N / G)``."""
        return math.ceil(self.numel / self.size)

    @property
    def padded(self) -> int:
        return self.shard * self.size

    @property
    def owned_numel(self) -> int:
        return max(0, min(self.numel - self.index * self.shard, self.shard))

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].param.dtype

    @property
    def device(self) -> torch.device:
        return self.pieces[0].param.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.pieces[0].param.element_size()

    def params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for piece in self.pieces:
            seen.setdefault(id(piece.param), piece.param)
        return list(seen.values())

    def view_pieces(self) -> Iterator[Piece]:
        return (p for p in self.pieces if p.whole)

    def staged_pieces(self) -> Iterator[Piece]:
        return (p for p in self.pieces if not p.whole)

    def locate(self, a: int, b: int) -> Iterable[tuple[Piece, int, int]]:
        """Pieces intersecting flat range ``[a, b)``: ``(piece, lo, hi)`` in flat coordinates."""
        offsets = [p.offset for p in self.pieces]
        i = max(0, bisect.bisect_right(offsets, a) - 1)
        while i < len(self.pieces) and self.pieces[i].offset < b:
            piece = self.pieces[i]
            lo, hi = max(a, piece.offset), min(b, piece.offset + piece.length)
            if lo < hi:
                yield piece, lo, hi
            i += 1

    # ------------------------------------------------------------------ gradient buffer
    def grad_view(self, piece: Piece) -> torch.Tensor:
        """The buffer region of a whole-parameter piece, shaped like the parameter."""
        return self.grad_buffer[piece.offset : piece.offset + piece.length].view_as(piece.param)

    def allocate_grad_buffer(self) -> None:
        self.grad_buffer = torch.zeros(self.padded, dtype=self.dtype, device=self.device)

    def attach_grads(self) -> None:
        """Make every view piece's ``.grad`` its buffer region (zeroed when the gradient was unset, copied
        in when something replaced it); staged pieces keep their own gradients."""
        for piece in self.view_pieces():
            p, view = piece.param, self.grad_view(piece)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            else:
                continue
            p.grad = view

    def stage_in(self) -> None:
        """Copy staged pieces' gradients into the buffer (before the collective)."""
        for piece in self.staged_pieces():
            src = piece.param.grad.detach().view(-1)[piece.start : piece.start + piece.length]
            self.grad_buffer[piece.offset : piece.offset + piece.length].copy_(src)

    def stage_out(self, a: int = 0, b: int | None = None) -> None:
        """Copy buffer range ``[a, b)`` back into the staged pieces' gradients (after the collective)."""
        b = self.numel if b is None else min(b, self.numel)
        for piece, lo, hi in self.locate(a, b):
            if piece.whole:
                continue
            s = piece.start + lo - piece.offset
            piece.param.grad.detach().view(-1)[s : s + hi - lo].copy_(self.grad_buffer[lo:hi])

    # ------------------------------------------------------------------ ZeRO-1 parameter buffer
    def param_view(self, piece: Piece) -> torch.Tensor:
        return self.param_buffer[piece.offset : piece.offset + piece.length].view_as(piece.param)

    def allocate_param_buffer(self) -> None:
        """Copy the parameters into a flat buffer; view pieces' parameters then live in it."""
        self.param_buffer = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for piece in self.pieces:
            src = piece.param.detach().reshape(-1)[piece.start : piece.start + piece.length]
            self.param_buffer[piece.offset : piece.offset + piece.length].copy_(src)
        self.relink_params()

    def relink_params(self) -> None:
        """Point every view piece's parameter at its buffer region again (after a wrapper replaced a
        parameter's storage with ``p.data = ...``: its current values are copied in first)."""
        for piece in self.view_pieces():
            p, view = piece.param, self.param_view(piece)
            if p.data_ptr() != view.data_ptr():
                view.copy_(p.detach())
                p.data = view

    def params_in(self, a: int, b: int, out: torch.Tensor) -> None:
        """Copy flat range ``[a, b)`` of the parameters into ``out`` (zeros past ``numel``)."""
        out.zero_()
        for piece, lo, hi in self.locate(a, min(b, self.numel)):
            s = piece.start + lo - piece.offset
            out[lo - a : hi - a].copy_(piece.param.detach().view(-1)[s : s + hi - lo])

    def params_out(self) -> None:
        """Copy the gathered parameter buffer into the staged pieces' parameters."""
        for piece in self.staged_pieces():
            dst = piece.param.detach().view(-1)[piece.start : piece.start + piece.length]
            dst.copy_(self.param_buffer[piece.offset : piece.offset + piece.length])


def bucket_of(kind: str, ranks: tuple[int, ...], group, rank: int,
              pieces: list[tuple[nn.Parameter, int, int]]) -> FlatBucket:
    """Lay ``(param, start, length)`` pieces out one after the other."""
    laid, offset = [], 0
    for p, start, length in pieces:
        laid.append(Piece(p, start, length, offset))
        offset += length
    return FlatBucket(kind, ranks, group, ranks.index(rank), laid, offset,
                      param_count=len({id(p) for p, _, _ in pieces}))


def runs(slots: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``(first, count)`` of slot indices, in the given order."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out
