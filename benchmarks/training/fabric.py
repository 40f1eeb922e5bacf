"""Emulated fabrics: where each rank process runs and how it reaches the others.

* :class:`FlatFabric`: every rank on loopback, in one private network namespace (root) or the host's;
* :class:`TwoNodeFabric`: two network namespaces ("nodes") joined by a veth pair shaped by ``tc``.

Namespaces and links are named ``PREFIX<pid>…`` and removed on exit, or by :func:`remove_stale_namespaces`
after a killed run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

PREFIX = "hbep-"  # every namespace and link this script creates starts with this


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` (no shell), capturing its output as text; raise on a non-zero exit when ``check``."""
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Fabric:
    """Where each rank runs and how it reaches the others. A context manager: namespaces live inside it."""

    name = "flat"
    ranks_per_node: int = 0
    info: dict[str, Any]

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def prefix(self, rank: int) -> list[str]:
        """Command words put before rank ``rank``'s process (e.g. ``ip netns exec <ns>``)."""
        return []

    def env(self, rank: int) -> dict[str, str]:
        """Environment variables for rank ``rank`` (gloo's interface, the byte counters to read)."""
        return {}

    def master_addr(self) -> str:
        """Address of rank 0's rendezvous store."""
        return "127.0.0.1"

    def master_port(self) -> int:
        """TCP port of rank 0's rendezvous store (here: a free one on the host)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


class _Namespaces:
    """Creates network namespaces (and records them) so that they are always deleted, even on failure."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def add(self, name: str) -> None:
        assert name.startswith(PREFIX)
        _sh("ip", "netns", "add", name)
        self.created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def cleanup(self) -> None:
        while self.created:
            _sh("ip", "netns", "del", self.created.pop(), check=False)  # deletes the veth ends inside it too


class FlatFabric(Fabric):
    """All ranks on loopback; inside one private namespace (so its loopback counters are ours) when
    ``netns`` (root), else in the host namespace (no byte counters)."""

    def __init__(self, world: int, netns: bool = True) -> None:
        self.world, self.netns, self.ranks_per_node = world, netns, world
        self._ns = _Namespaces()
        self.ns = f"{PREFIX}{os.getpid()}-flat"
        self.info = {"kind": "flat", "namespace": netns, "ranks_per_node": world}

    def __enter__(self) -> FlatFabric:
        if self.netns:
            try:
                self._ns.add(self.ns)
            except BaseException:
                self._ns.cleanup()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._ns.cleanup()

    def prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns] if self.netns else []

    def env(self, rank: int) -> dict[str, str]:
        env = {"GLOO_SOCKET_IFNAME": "lo"}
        if self.netns:
            env["HBEP_COUNTERS"] = "lo:intra"
        return env

    def master_port(self) -> int:
        return 29500 if self.netns else super().master_port()  # a fresh namespace has every port free


class TwoNodeFabric(Fabric):
    """Two namespaces of ``world / 2`` ranks joined by a rate-limited veth pair.

    Addressing: node n's veth end has 10.213.0.(n+1)/24; every rank binds gloo to its node's veth
    (``GLOO_SOCKET_IFNAME``). A connection to a local address is carried over loopback by the kernel,
    so intra-node pairs never touch the veth; only the other node's address routes over the veth.
    """

    name = "two-node"

    def __init__(self, world: int, gbit: float, latency_ms: float) -> None:
        if world % 2:
            raise ValueError(f"two-node fabric needs an even world size, got {world}")
        self.world, self.gbit, self.latency_ms = world, gbit, latency_ms
        self.ranks_per_node = world // 2
        tag = f"{PREFIX}{os.getpid() % 10**7}"
        self.ns = [f"{tag}-n0", f"{tag}-n1"]
        self.veth = [f"{tag}a", f"{tag}b"]  # <= 15 characters (IFNAMSIZ)
        self.addr = ["10.213.0.1", "10.213.0.2"]
        self._ns = _Namespaces()
        self.info = {"kind": "two-node", "ranks_per_node": self.ranks_per_node, "inter_node_gbit": gbit,
                     "inter_node_latency_ms_requested": latency_ms}

    def __enter__(self) -> TwoNodeFabric:
        try:
            self._setup()
        except BaseException:
            self._ns.cleanup()
            _sh("ip", "link", "del", self.veth[0], check=False)
            raise
        return self

    def _setup(self) -> None:
        for ns in self.ns:
            self._ns.add(ns)
        _sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        for ns, dev, addr in zip(self.ns, self.veth, self.addr, strict=True):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        rate = f"{self.gbit}gbit"
        burst = max(64 * 1024, int(self.gbit * 1e9 / 8 / 1000))  # >= one timer tick (1 ms) of traffic
        latency = "unavailable"
        for ns, dev in zip(self.ns, self.veth, strict=True):  # shape both directions
            tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
            netem = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                        "netem", "delay", f"{self.latency_ms}ms", check=False) if self.latency_ms > 0 else None
            if netem is not None and netem.returncode == 0:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "10:", *tbf)
                latency = f"netem delay {self.latency_ms}ms"
            else:
                if netem is not None:
                    latency = f"not emulated: netem failed ({netem.stderr.strip()})"
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)
        self.info["latency_emulation"] = latency
        self.info["tc"] = _sh("ip", "netns", "exec", self.ns[0], "tc", "qdisc", "show", "dev", self.veth[0]).stdout.strip()
        self.info.update(self._measure_link())

    def _measure_link(self) -> dict[str, float]:
        """Bulk TCP throughput and round-trip time from node 1 to node 0 over the shaped veth."""
        server = subprocess.Popen(["ip", "netns", "exec", self.ns[0], sys.executable, "-c", _LINK_SERVER, self.addr[0]],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            out = _sh("ip", "netns", "exec", self.ns[1], sys.executable, "-c", _LINK_CLIENT, self.addr[0]).stdout
            return json.loads(out)
        finally:
            server.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        self._ns.cleanup()

    def node(self, rank: int) -> int:
        """The node (0 or 1) that rank ``rank`` runs on."""
        return rank // self.ranks_per_node

    def prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[self.node(rank)]]

    def env(self, rank: int) -> dict[str, str]:
        dev = self.veth[self.node(rank)]
        return {"GLOO_SOCKET_IFNAME": dev, "HBEP_COUNTERS": f"lo:intra,{dev}:inter"}

    def master_addr(self) -> str:
        return self.addr[0]

    def master_port(self) -> int:
        return 29500


_LINK_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 29400)); print("ready", flush=True)
c, _ = s.accept()
for _ in range(20):
    c.recv(1); c.sendall(b"x")
n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b"k"); c.close()
"""
_LINK_CLIENT = """
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 29400))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtt.append(time.perf_counter() - t)
data = b"\\0" * (1 << 20); n = 32
t = time.perf_counter()
for _ in range(n): c.sendall(data)
c.shutdown(socket.SHUT_WR); c.recv(1)
dt = time.perf_counter() - t
print(json.dumps({"measured_gbit": n * len(data) * 8 / dt / 1e9, "measured_rtt_ms": statistics.median(rtt) * 1e3}))
"""


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces this script left behind in an earlier run that was killed (``hbep-<pid>-…`` whose
    process no longer exists). Never touches a name without the prefix or of a live process."""
    removed = []
    listing = _sh("ip", "netns", "list", check=False).stdout.split()
    for name in listing:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed
