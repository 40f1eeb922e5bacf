"""Counters of what a dispatcher moves, read by metrics and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The deduplicated dispatcher's cross-node stage is counted apart ("*_inter"); its stage inside a node, and
# the per-pair backends' one exchange, under the plain names.
PHASES = ("dispatch", "combine", "dispatch_backward", "combine_backward",
          "dispatch_inter", "combine_inter", "dispatch_inter_backward", "combine_inter_backward")
INTER_PHASES = PHASES[4:]


@dataclass
class PhaseCounters:
    """Rows and bytes one rank sent and received in one phase, summed over calls.

    ``remote_*`` excludes the rows a rank sends to itself (they never touch the network).
    """

    calls: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    remote_rows_sent: int = 0
    remote_rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    remote_bytes_sent: int = 0
    remote_bytes_received: int = 0


@dataclass
class ShadowCounters:
    """What hot-expert shadowing (``HybridEPConfig.shadow_experts``) kept off and put on the network.

    ``rows_local``: routed (token, k) rows of this rank computed on a local shadow instead of crossing to
    the owner; ``token_bytes_avoided``: their bytes in every exchange they skipped (dispatch and combine,
    plus both backward exchanges when autograd records the forward). ``weight_bytes_*`` / ``grad_bytes_*``:
    shadow weights fetched from owners after an optimizer step and shadow gradients returned to them;
    ``control_bytes``: this rank's row of the shadow-mask all-gather, sent to each EP peer. ``shadows_held``: shadows held,
    summed over refreshes.
    """

    refreshes: int = 0
    shadows_held: int = 0
    rows_local: int = 0
    token_bytes_avoided: int = 0
    weight_bytes_sent: int = 0
    weight_bytes_received: int = 0
    grad_bytes_sent: int = 0
    grad_bytes_received: int = 0
    control_bytes: int = 0

    @property
    def net_bytes_saved(self) -> int:
        """Token bytes avoided minus the weight, gradient and control bytes this rank sent."""
        return self.token_bytes_avoided - self.weight_bytes_sent - self.grad_bytes_sent - self.control_bytes


@dataclass
class CommStats:
    """Per-layer counters of the token exchange, one :class:`PhaseCounters` per phase, and the shadow
    counters of hot-expert shadowing."""

    phases: dict[str, PhaseCounters] = field(default_factory=lambda: {p: PhaseCounters() for p in PHASES})
    shadow: ShadowCounters = field(default_factory=ShadowCounters)

    def record(
        self, phase: str, send_splits: list[int], recv_splits: list[int], self_index: int, row_bytes: int
    ) -> None:
        c = self.phases[phase]
        sent, recv = sum(send_splits), sum(recv_splits)
        remote_sent, remote_recv = sent - send_splits[self_index], recv - recv_splits[self_index]
        c.calls += 1
        c.rows_sent += sent
        c.rows_received += recv
        c.remote_rows_sent += remote_sent
        c.remote_rows_received += remote_recv
        c.bytes_sent += sent * row_bytes
        c.bytes_received += recv * row_bytes
        c.remote_bytes_sent += remote_sent * row_bytes
        c.remote_bytes_received += remote_recv * row_bytes

    def reset(self) -> None:
        for p in PHASES:
            self.phases[p] = PhaseCounters()
        self.shadow = ShadowCounters()

    def as_dict(self) -> dict[str, dict[str, int]]:
        out = {p: asdict(c) for p, c in self.phases.items()}
        out["shadow"] = {**asdict(self.shadow), "net_bytes_saved": self.shadow.net_bytes_saved}
        return out
