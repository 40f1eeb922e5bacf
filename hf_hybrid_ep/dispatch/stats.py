"""Counters of what a dispatcher moves, read by metrics and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PHASES = ("dispatch", "combine", "dispatch_backward", "combine_backward")


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
class CommStats:
    """Per-layer counters of the token exchange, one :class:`PhaseCounters` per phase."""

    phases: dict[str, PhaseCounters] = field(default_factory=lambda: {p: PhaseCounters() for p in PHASES})

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

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {p: asdict(c) for p, c in self.phases.items()}
