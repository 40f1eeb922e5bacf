"""The cluster topology: ranks → nodes → racks, with a link class and a bandwidth per level.

Ranks are numbered node-major, as ``torchrun`` and ``accelerate launch`` number them: global rank
``g`` sits on node ``g // gpus_per_node``, and node ``n`` in rack ``n // nodes_per_rack``. Three
link levels connect two ranks:

* ``intra_node``: the same node — ``nvlink`` (default, 300 GB/s per GPU) or ``pcie``;
* ``inter_node``: different nodes of the same rack — ``infiniband`` (default) or ``ethernet``,
  ``network_gbps`` per GPU (25 GB/s: one 200 Gb/s NIC per GPU);
* ``cross_rack``: different racks — the same network class through the spine, ``rack_gbps`` per
  GPU (default: equal to ``network_gbps``; set it lower for an oversubscribed spine).

A topology is read from a short spec string, e.g. ``racks=2,nodes_per_rack=2,gpus_per_node=8`` or
``gpus_per_node=8,intra_node=pcie,nvlink_gbps=32,network_gbps=50``, or from ``HybridEPConfig(topology=...)``.

EP groups follow it (see :func:`ep_group_span`): the ``ep`` consecutive ranks of an EP group lie
inside one node when ``ep ≤ gpus_per_node`` (which needs ``gpus_per_node % ep == 0``); otherwise a group
spans ``ep / gpus_per_node`` whole nodes (hierarchical: NVLink inside each node, the network between
them), inside one rack when it fits in one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import HybridEPConfigError

INTRA_LINKS = {"nvlink": 300.0, "pcie": 32.0}  # default GB/s per GPU
INTER_LINKS = {"infiniband": 25.0, "ethernet": 12.5}
LEVELS = ("local", "intra_node", "inter_node", "cross_rack")


@dataclass(frozen=True)
class Topology:
    """GPUs per node, nodes per rack, racks; link classes and bandwidths (GB/s per GPU).

    ``nodes_per_rack = 0`` means every node is in one rack; ``racks = 0`` means as many as needed
    (the cluster size then comes from the world size).
    """

    gpus_per_node: int = 8
    nodes_per_rack: int = 0
    racks: int = 0
    intra_node: str = "nvlink"
    inter_node: str = "infiniband"
    nvlink_gbps: float = 0.0  # intra-node bandwidth; 0: the link class's default
    network_gbps: float = 0.0  # inter-node bandwidth; 0: the link class's default
    rack_gbps: float = 0.0  # cross-rack bandwidth; 0: equal to network_gbps

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes_per_rack < 0 or self.racks < 0:
            raise HybridEPConfigError(
                f"topology gpus_per_node={self.gpus_per_node}, nodes_per_rack={self.nodes_per_rack}, "
                f"racks={self.racks}: gpus_per_node must be ≥ 1 and the others ≥ 0"
            )
        if self.intra_node not in INTRA_LINKS:
            raise HybridEPConfigError(f"topology intra_node={self.intra_node!r} is not one of {sorted(INTRA_LINKS)}")
        if self.inter_node not in INTER_LINKS:
            raise HybridEPConfigError(f"topology inter_node={self.inter_node!r} is not one of {sorted(INTER_LINKS)}")
        if self.racks and not self.nodes_per_rack:
            raise HybridEPConfigError(f"topology racks={self.racks} needs nodes_per_rack")
        if not self.nvlink_gbps:
            object.__setattr__(self, "nvlink_gbps", INTRA_LINKS[self.intra_node])
        if not self.network_gbps:
            object.__setattr__(self, "network_gbps", INTER_LINKS[self.inter_node])
        if not self.rack_gbps:
            object.__setattr__(self, "rack_gbps", self.network_gbps)

    # ------------------------------------------------------------------ construction
    @classmethod
    def parse(cls, spec: str | None) -> Topology:
        """Read ``"name=value,..."``; ``None`` or ``""`` gives the default (8 GPUs per NVLink node)."""
        if not spec:
            return cls()
        values: dict[str, Any] = {}
        for part in spec.split(","):
            part = part.strip()
            if not re.fullmatch(r"\w+=[\w.]+", part):
                raise HybridEPConfigError(f"topology item {part!r} must look like name=value")
            name, value = part.split("=")
            if name not in cls.__dataclass_fields__:
                raise HybridEPConfigError(
                    f"unknown topology key {name!r}; known: {sorted(cls.__dataclass_fields__)}"
                )
            kind = cls.__dataclass_fields__[name].type
            try:
                values[name] = value if kind == "str" else float(value) if kind == "float" else int(value)
            except ValueError as err:
                raise HybridEPConfigError(f"topology item {part!r}: {value!r} is not a {kind}") from err
        return cls(**values)

    @classmethod
    def of(cls, value: Topology | str | None) -> Topology:
        return value if isinstance(value, Topology) else cls.parse(value)

    # ------------------------------------------------------------------ queries
    @property
    def total_gpus(self) -> int | None:
        """GPUs of the whole cluster when ``racks`` is given, else ``None`` (any number of nodes)."""
        return self.racks * self.nodes_per_rack * self.gpus_per_node if self.racks else None

    @property
    def gpus_per_rack(self) -> int | None:
        return self.nodes_per_rack * self.gpus_per_node if self.nodes_per_rack else None

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rack_of(self, rank: int) -> int:
        return self.node_of(rank) // self.nodes_per_rack if self.nodes_per_rack else 0

    def level(self, a: int, b: int) -> str:
        """Link level between global ranks ``a`` and ``b``: one of :data:`LEVELS`."""
        if a == b:
            return "local"
        if self.node_of(a) == self.node_of(b):
            return "intra_node"
        return "inter_node" if self.rack_of(a) == self.rack_of(b) else "cross_rack"

    def bandwidth(self, level: str) -> float:
        """GB/s per GPU of a link level (``local``: infinite)."""
        return {"local": float("inf"), "intra_node": self.nvlink_gbps, "inter_node": self.network_gbps,
                "cross_rack": self.rack_gbps}[level]

    def check_world(self, world_size: int) -> None:
        """Raise if a world of ``world_size`` ranks does not fit the topology."""
        total = self.total_gpus
        if total is not None and world_size != total:
            raise HybridEPConfigError(
                f"world size {world_size} differs from the topology's {self.racks} racks × {self.nodes_per_rack} "
                f"nodes × {self.gpus_per_node} GPUs = {total}"
            )
        if world_size > self.gpus_per_node and world_size % self.gpus_per_node:
            raise HybridEPConfigError(
                f"world size {world_size} is not a whole number of nodes of gpus_per_node={self.gpus_per_node}"
            )

    def describe(self) -> str:
        racks = f"{self.racks} racks × " if self.racks else ""
        per_rack = f"{self.nodes_per_rack} nodes/rack × " if self.nodes_per_rack else ""
        return (f"{racks}{per_rack}{self.gpus_per_node} GPUs/node; {self.intra_node} {self.nvlink_gbps:g} GB/s, "
                f"{self.inter_node} {self.network_gbps:g} GB/s, cross-rack {self.rack_gbps:g} GB/s")


def ranks_per_node(topology: Topology | str | None, world_size: int) -> int:
    """Ranks of one node in a world of ``world_size``: the topology's ``gpus_per_node`` when one is given,
    else ``LOCAL_WORLD_SIZE`` (set by torchrun and accelerate launch), else the whole world; at most the world."""
    if topology:
        return min(Topology.of(topology).gpus_per_node, world_size)
    return min(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), world_size)


def nodes_spanned(ep_degree: int, per_node: int) -> int:
    """Nodes one EP group of ``ep_degree`` consecutive ranks spans on nodes of ``per_node`` ranks (1 inside one).

    Raises:
        HybridEPConfigError: when the group spans nodes without filling whole ones.
    """
    if ep_degree <= per_node:
        return 1
    if ep_degree % per_node:
        raise HybridEPConfigError(f"ep_degree={ep_degree} spans nodes of {per_node} ranks but is not a multiple "
                                  f"of {per_node}: an EP group must span whole nodes")
    return ep_degree // per_node


@dataclass(frozen=True)
class EPGroupSpan:
    """Where the EP groups of a dp × ep layout sit (global ranks ``g = edp_rank · ep + ep_rank``).

    Attributes:
        kind: ``"intra_node"`` (every EP group inside one node), ``"hierarchical"`` (an EP group spans
            ``nodes_per_group`` whole nodes of one rack) or ``"cross_rack"`` (it spans racks).
        nodes_per_group: nodes one EP group spans.
        racks_per_group: racks one EP group spans.
        edp_crosses_nodes: whether an EDP group (one EP rank of every group) spans several nodes.
    """

    kind: str
    nodes_per_group: int
    racks_per_group: int
    edp_crosses_nodes: bool


def ep_group_span(world_size: int, ep_degree: int, topology: Topology | str | None) -> EPGroupSpan:
    """Check that the EP groups of consecutive ranks follow the topology and describe them.

    Raises:
        HybridEPConfigError: when an EP group would straddle a node boundary without filling whole
            nodes (``ep < gpus_per_node`` not dividing it, or ``ep > gpus_per_node`` not a multiple of
            it), or when the world does not fit the topology.
    """
    topo = Topology.of(topology)
    topo.check_world(world_size)
    gpn = min(topo.gpus_per_node, world_size)
    if ep_degree <= gpn and gpn % ep_degree:
        raise HybridEPConfigError(
            f"ep_degree={ep_degree} does not divide gpus_per_node={topo.gpus_per_node}: an EP group would "
            f"straddle two nodes; use an ep_degree that divides {topo.gpus_per_node}"
        )
    if ep_degree > gpn and ep_degree % gpn:
        raise HybridEPConfigError(
            f"ep_degree={ep_degree} is larger than gpus_per_node={topo.gpus_per_node} but not a multiple of it: "
            "an EP group must span whole nodes"
        )
    nodes = nodes_spanned(ep_degree, gpn)
    groups = range(0, world_size, ep_degree)
    racks = max(len({topo.rack_of(g + r) for r in range(ep_degree)}) for g in groups)
    kind = "intra_node" if nodes == 1 else ("hierarchical" if racks == 1 else "cross_rack")
    edp_nodes = {topo.node_of(g) for g in groups}
    return EPGroupSpan(kind, nodes, racks, len(edp_nodes) > 1)
