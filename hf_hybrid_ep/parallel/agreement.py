"""Every rank agrees on bad MoE-layer inputs and on control-flow mismatches, without a per-layer barrier.

Each MoE layer's counts exchange (one all-to-all inside the EP group) carries two extra integers from
every rank: input flags (bit 1: NaN/inf in the router input or routing weights, bit 2: an expert id
outside ``[0, E)``) and the layer id, in a message of the same size for every layer. So at the same
exchange every member of an EP group sees whether a member has bad inputs or reached another layer
(ERNIE-4.5-VL runs its vision experts only when the local batch has vision tokens). When one does, all
of them skip the token exchange of that layer and of every later MoE layer of this forward (those layers
return NaN), so no collective is left unmatched, and the problem is recorded.

The world then agrees once: with one small all-reduce launched at the first gradient of a reducing
backward, before any gradient bucket, and waited for at its end (after every bucket completed); or at
the end of a model forward under ``no_grad``. If any rank recorded a problem, every rank raises
``FloatingPointError`` naming the layer and the ranks, at the same point: nobody raises alone or is left
waiting in a collective. A forward with gradients whose backward is never run (or runs under
``no_sync``) reports at the next reducing backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mesh import HybridMesh, current_device
from .watchdog import launched, waiting

NONFINITE, BAD_INDEX = 1, 2
CONTROL_INTS = 2  # (input flags, layer id): the control integers of every counts exchange
_AGREEMENT = "all_reduce of the input agreement"


def control_vector(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int,
                   layer_id: int, check_finite: bool) -> torch.Tensor:
    """``[CONTROL_INTS]`` int64 on the device: this rank's :func:`input_flags` (0 unless ``check_finite``) and
    ``layer_id``, the side channel of the layer's counts exchange."""
    if check_finite:
        flags = input_flags(hidden, index, weights, num_experts)
    else:
        flags = torch.zeros((), dtype=torch.long, device=hidden.device)
    return torch.stack([flags, flags.new_full((), layer_id)])


def input_flags(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """0-dim int64 on the device: :data:`NONFINITE` | :data:`BAD_INDEX` (no host synchronisation)."""
    nonfinite = ~torch.isfinite(hidden).all() | ~torch.isfinite(weights).all()
    bad_index = ((index < -1) | (index >= num_experts)).any()
    return nonfinite.long() * NONFINITE + bad_index.long() * BAD_INDEX


class InputAgreement:
    """Problems this rank's EP group saw in its counts exchanges, until the world agrees on them."""

    def __init__(self, mesh: HybridMesh, layer_names: dict[int, str]) -> None:
        self.mesh = mesh
        self.layer_names = layer_names
        self.degraded = False  # skip every MoE exchange until the agreement (the EP group saw a problem)
        self.problem: tuple[int, int, int] | None = None  # (own flags, layer id, ranks disagreed on the layer)
        self._table: torch.Tensor | None = None
        self._work = None

    def check(self, layer_id: int, peer_control: list[tuple[int, int]]) -> bool:
        """After one layer's counts exchange: record a problem of any EP rank; ``True`` if the layer must skip
        its token exchange (then every member of the EP group skips it too: they saw the same integers)."""
        flags = [f for f, _ in peer_control]
        layers = {lid for _, lid in peer_control}
        if not any(flags) and len(layers) == 1:
            return False
        if self.problem is None:
            self.problem = (flags[self.mesh.ep_rank], layer_id, int(len(layers) > 1))
        self.degraded = True
        return True

    def launch(self) -> None:
        """Start the world agreement (asynchronously on a multi-rank world)."""
        device = current_device(self.mesh)
        table = torch.zeros(self.mesh.world_size, 4, dtype=torch.long, device=device)
        if self.problem is not None:
            table[self.mesh.rank] = torch.tensor([1, *self.problem], dtype=torch.long)
        self._table = table
        if self.mesh.world_group is not None:  # the reduction group: the token exchange never queues behind it
            self._work = launched(dist.all_reduce(table, group=self.mesh.reduction_group, async_op=True),
                                  _AGREEMENT, self.mesh.reduction_group)

    def finish(self) -> None:
        """Complete the agreement; raise ``FloatingPointError`` on every rank if any rank saw a problem."""
        if self._table is None:
            return
        with waiting(self._work, _AGREEMENT, self.mesh.reduction_group):  # the read waits under NCCL
            rows = self._table.tolist()
        self._table, self._work, self.problem, self.degraded = None, None, None, False
        problems = [(rank, flags, layer, mismatch) for rank, (seen, flags, layer, mismatch) in enumerate(rows) if seen]
        if problems:
            raise FloatingPointError(self._message(problems))

    def agree_now(self) -> None:
        """Launch and finish at once (end of a forward under ``no_grad``)."""
        self.launch()
        self.finish()

    def _message(self, problems: list[tuple[int, int, int, int]]) -> str:
        name = self.layer_names.get(problems[0][2], problems[0][2])
        parts = []
        mismatched = [(rank, layer) for rank, _, layer, mismatch in problems if mismatch]
        if mismatched:
            parts.append(
                "ranks reached different MoE layers at the same point ("
                + ", ".join(f"rank {r}: {self.layer_names.get(layer, layer)}" for r, layer in mismatched)
                + "); the model's control flow depends on each rank's data (e.g. a modality-specific experts "
                "module that runs only when the local batch holds that modality), which expert parallelism "
                "cannot follow: give every rank the same mix"
            )
        nan_ranks = [rank for rank, flags, _, _ in problems if flags & NONFINITE]
        index_ranks = [rank for rank, flags, _, _ in problems if flags & BAD_INDEX]
        if nan_ranks:
            parts.append(f"non-finite values (NaN/inf) in the router input or routing weights on rank(s) {nan_ranks}")
        if index_ranks:
            parts.append(f"expert ids outside the layer's range on rank(s) {index_ranks}")
        return f"hybrid-EP layer {name}: " + "; ".join(parts)
