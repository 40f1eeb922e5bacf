"""Where every rank is, as the watchdog threads publish it, and which ranks a hung collective waits for.

Each rank's watchdog thread writes its *position* (a JSON object) to the c10d store under
``hf_hybrid_ep/watchdog/<rank>`` every half interval: a heartbeat count, the collective it waits in (what, the
group's ranks, its sequence number on the group), how many collectives it entered on each group, and, once its
watchdog ends it, why. :func:`diagnose` reads two snapshots of the group's positions an interval apart and names
the ranks that did not arrive: those whose heartbeat stopped (stopped, dead or hung outside Python) and those
running elsewhere, still before the collective. A rank waiting in another collective (inside it, or with it in
flight for :data:`STUCK_S` or more) is not one of them: it waits for someone too; nor is a rank whose own
watchdog ended it.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta

import torch.distributed as dist

STORE_TIMEOUT_S = 5.0  # a store operation of the watchdog thread gives up after this long
STUCK_S = 1.0  # a rank whose oldest collective has been in flight this long waits in it
_PREFIX = "hf_hybrid_ep/watchdog/"


def describe(ranks: tuple[int, ...], world: int) -> str:
    """``"the world (ranks 0–3)"`` or ``"ranks [0, 2]"``."""
    if len(ranks) == world and world > 1:
        return f"the world (ranks 0–{world - 1})"
    return f"ranks {list(ranks)}"


def group_key(ranks: tuple[int, ...]) -> str:
    """The key of a group's count in a published position: ``"0,1,2,3"``."""
    return ",".join(map(str, ranks))


class Board:
    """The positions of every rank in the c10d store, through a client of its own (so that a slow store never
    blocks the main thread) with a short timeout; ``store=None``: nothing is published or read."""

    def __init__(self, store: dist.Store | None) -> None:
        self.store = store

    @classmethod
    def of_default_group(cls) -> Board:
        try:
            store = dist.distributed_c10d._get_default_store().clone()
            store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
            return cls(store)
        except Exception:  # noqa: BLE001 - a store without a client of its own: publish nothing
            return cls(None)

    def publish(self, rank: int, position: dict) -> None:
        if self.store is None:
            return
        with contextlib.suppress(Exception):  # a store that does not answer is reported when it matters
            self.store.set(_PREFIX + str(rank), json.dumps(position))

    def read(self, ranks: list[int]) -> dict[int, dict] | str:
        """The published positions of ``ranks`` (a rank that never published is missing), or why they could not
        be read."""
        if self.store is None:
            return "no c10d store to read them from"
        try:
            keys = [_PREFIX + str(r) for r in ranks]
            present = [k for k in keys if self.store.check([k])]
            values = self.store.multi_get(present) if present else []
        except Exception as err:  # noqa: BLE001 - the store host may be the stopped rank
            return (f"the c10d store did not answer ({type(err).__name__}); the process that hosts it (the launcher, "
                    "or rank 0) may be stopped or dead")
        out = {}
        for key, value in zip(present, values, strict=True):
            with contextlib.suppress(ValueError):
                out[int(key.rsplit("/", 1)[1])] = json.loads(bytes(value).decode())
        return out


def where(position: dict) -> str:
    """A published position in words: the collective the rank waits in, or what it last completed."""
    if position.get("ended"):
        return f"its watchdog ended it: {position['ended']}"
    if position.get("in"):
        what, ranks, _ = position["in"]
        return f"waiting in {what} over ranks {ranks} for {position['idle_s']:g} s"
    if waits(position):
        what, ranks, _, age = position["pending"]
        return f"waiting for {what} over ranks {ranks}, in flight for {age:g} s"
    region = f" inside {position['region']}" if position.get("region") else ""
    return f"running{region}, {position['idle_s']:g} s since its last collective ({position['last']})"


def waits(position: dict) -> bool:
    """Whether the rank waits in a collective: inside one, or with one in flight for :data:`STUCK_S` or more."""
    pending = position.get("pending")
    return bool(position.get("in")) or (pending is not None and pending[3] >= STUCK_S)


def silent_ranks(others: list[int], first: dict[int, dict], second: dict[int, dict]) -> list[int]:
    """The ranks of ``others`` whose heartbeat did not move between the two snapshots (or that never published one),
    leaving out those their own watchdog ended."""
    def silent(r: int) -> bool:
        now, before = second.get(r), first.get(r)
        return not (now is not None and now.get("ended")) and (now is None or before is None
                                                               or now["beat"] == before["beat"])
    return [r for r in others if silent(r)]


def diagnose(others: list[int], ranks: tuple[int, ...], seq: int, first: dict[int, dict],
             second: dict[int, dict]) -> str:
    """Which of ``others`` (the other ranks of the group ``ranks``) did not arrive at this rank's collective
    number ``seq`` on the group (0: not a collective), from two snapshots of their positions taken an interval
    apart; the message's tail, one line per rank."""
    key = group_key(ranks)
    silent, behind, elsewhere, lines = silent_ranks(others, first, second), [], [], []
    for r in others:
        now = second.get(r)
        if now is not None and now.get("ended"):
            lines.append(f"rank {r}: {where(now)}")
        elif r in silent:
            seen = ("never published a position" if now is None else
                    f"last seen {time.time() - now['at']:.0f} s ago: {where(now)}")
            lines.append(f"rank {r} (host {now['host'] if now else '?'}, PID {now['pid'] if now else '?'}): "
                         f"no heartbeat; {seen}")
        elif seq and now["counts"].get(key, 0) < seq:
            (elsewhere if waits(now) else behind).append(r)
            lines.append(f"rank {r}: has not reached it; {where(now)}")
        else:
            lines.append(f"rank {r}: {where(now)}")
    parts = [f"rank(s) {silent} (no heartbeat: stopped, dead or hung outside Python)"] if silent else []
    parts += [f"rank(s) {behind} (running, still before it)"] if behind else []
    if not parts and elsewhere:  # nobody silent or running: they wait in different collectives
        parts = [f"rank(s) {elsewhere} (waiting in another collective: the ranks issued collectives in different "
                 "orders)"]
    head = (f"; did not arrive: {', '.join(parts)}" if parts else
            "; every rank of the group is running (a desynchronised collective order, or the network)")
    return head + "".join(f"\n  {line}" for line in lines)
