"""The DP×EP device mesh and its process groups.

Rank ``g = edp_rank * ep_degree + ep_rank``. EP groups are the ``ep_degree`` consecutive ranks of one
row; EDP (expert-data-parallel) groups are the strided columns ``{ep_rank + i*ep}``. Launchers number
ranks node-major, so with a :class:`~hf_hybrid_ep.parallel.topology.Topology` an EP group lies inside one node
(NVLink) when ``ep ≤ gpus_per_node`` and spans whole nodes otherwise (hierarchical: NVLink inside,
the network between); ``build_mesh(..., topology=...)`` checks that and refuses a group that would
straddle a node boundary (:func:`hf_hybrid_ep.parallel.topology.ep_group_span`).
Meshes are cached per ``(dp, ep, device type, world group)`` so repeated ``parallelize`` calls in one process reuse
their groups (creating a group is a collective over the whole world).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import nccl
from .topology import EPGroupSpan, Topology, ep_group_span, nodes_spanned, ranks_per_node
from .watchdog import watched

_MESH_CACHE: dict[tuple, HybridMesh] = {}
_GROUP_CACHE: dict[tuple, dist.ProcessGroup] = {}


@dataclass(frozen=True)
class HybridMesh:
    """The one dp × ep object: the validated degrees of the world's layout, this rank's place in it, and the
    process groups (mesh axes ``edp`` × ``ep``).

    Words: ``dp_degree`` is the layout's data-parallel degree, the number of ranks holding the same experts
    (an EDP group: ``edp_group``, this rank's index in it ``edp_rank``); ``ep_degree`` the ranks one layer's
    experts are sharded over (an EP group). Dense weights are replicated on every rank and reduced over the
    world (``world_size = dp_degree × ep_degree``). ``device_mesh`` and the groups are ``None`` for a world
    of one process with no process group.
    """

    dp_degree: int
    ep_degree: int
    rank: int
    device_type: str
    device_mesh: DeviceMesh | None
    topology: Topology | None = None
    ep_span: EPGroupSpan | None = None  # where the EP groups sit, when a topology is known
    # A process group over the whole world of its own, for the asynchronous dense-gradient buckets: gloo runs
    # one group's collectives in order, so the token exchange (whose group is the world when ep = W) must not
    # queue behind a bucket in flight.
    reduction_group: dist.ProcessGroup | None = None
    timeout: timedelta | None = None  # the run's collective timeout (see ``group_timeout``)

    @property
    def group_timeout(self) -> timedelta | None:
        """The timeout of every group the mesh creates: :attr:`timeout`, plus ``nccl.GRACE_S`` under NCCL (its
        watchdog backs the package's, which names the hang first)."""
        return nccl.group_timeout(self.timeout, self.device_type)

    @property
    def world_size(self) -> int:
        return self.dp_degree * self.ep_degree

    @property
    def ranks_per_node(self) -> int:
        """Ranks of one node: the topology's ``gpus_per_node``, else ``LOCAL_WORLD_SIZE``, at most the world."""
        return ranks_per_node(self.topology, self.world_size)

    @property
    def ep_nodes(self) -> int:
        """Nodes one EP group spans (1 when it fits in a node).

        Raises:
            HybridEPConfigError: when the EP group spans nodes without filling whole nodes.
        """
        return nodes_spanned(self.ep_degree, self.ranks_per_node)

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_degree

    @property
    def edp_rank(self) -> int:
        """This rank's index in its expert-data-parallel (EDP) group: the ranks holding the same experts."""
        return self.rank // self.ep_degree

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return None if self.device_mesh is None else self.device_mesh.get_group("ep")

    @property
    def edp_group(self) -> dist.ProcessGroup | None:
        return None if self.device_mesh is None else self.device_mesh.get_group("edp")

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        return None if self.device_mesh is None else dist.group.WORLD

    def gather_objects(self, obj, what: str) -> list:
        """Every rank's ``obj`` (picklable) in rank order, ``[obj]`` for a world of one; ``what`` names the
        all-gather for the watchdog. Collective over the world."""
        if self.world_group is None:
            return [obj]
        everyone: list = [None] * self.world_size
        with watched(what, self.world_group):
            dist.all_gather_object(everyone, obj, group=self.world_group)
        return everyone

    def global_rank(self, edp_rank: int, ep_rank: int) -> int:
        return edp_rank * self.ep_degree + ep_rank

    def group_of(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """A process group over ``ranks`` (sorted global ranks); ``None`` when it is this rank alone.

        Every rank must ask for the same groups in the same order (group creation is a world
        collective); :func:`hf_hybrid_ep.parallelize` and online rebalancing do so from the placement
        tables. Whether a new group is created depends only on ``ranks`` (never on this rank), so that
        every rank makes the same ``new_group`` calls; for a set this rank is not in, the result is not
        a group to use.
        """
        if len(ranks) == 1:
            return None
        if all(r % self.ep_degree == ranks[0] % self.ep_degree for r in ranks) and len(ranks) == self.dp_degree:
            return self.edp_group if self.rank in ranks else None  # an EDP group: built with the mesh
        if len(ranks) == self.world_size:
            return self.reduction_group
        key = (id(dist.group.WORLD), self.timeout, *ranks)  # a group is reused only at the same timeout
        if key not in _GROUP_CACHE:
            _GROUP_CACHE[key] = dist.new_group(list(ranks), timeout=self.group_timeout)
        return _GROUP_CACHE[key]


def default_device_type() -> str:
    """``"cuda"`` when the default process group runs NCCL, or runs gloo bound to a CUDA device
    (``init_process_group("gloo", device_id=torch.device("cuda", i))``: gloo carries CUDA tensors through host
    memory, so several ranks can share one GPU, which NCCL refuses); else ``"cpu"`` (gloo)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "cpu"
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return "cuda" if dist.get_backend() == "nccl" or (bound is not None and bound.type == "cuda") else "cpu"


def world_size(*, launched: bool = False) -> int:
    """Ranks of the initialised default process group; else, with ``launched``, ``WORLD_SIZE`` of a job
    started by a launcher that has not initialised ``torch.distributed`` yet; else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1) if launched else 1


def world_timeout() -> timedelta:
    """The timeout of the default process group (the launcher's or the user's ``init_process_group``), else
    torch's default for its backend."""
    from torch.distributed import constants

    if dist.is_available() and dist.is_initialized():
        device = torch.device(default_device_type())
        try:
            return dist.group.WORLD._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            pass
    nccl = default_device_type() == "cuda" and constants.default_pg_nccl_timeout is not None
    return constants.default_pg_nccl_timeout if nccl else constants.default_pg_timeout


def _group_options(device_type: str, timeout: timedelta | None) -> dict:
    """``init_device_mesh``'s ``backend_override`` giving both mesh dimensions' groups ``timeout``."""
    if timeout is None:
        return {}
    nccl = device_type == "cuda" and dist.get_backend() == "nccl"
    options = dist.ProcessGroupNCCL.Options() if nccl else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return {"edp": options, "ep": options}


def build_mesh(dp_degree: int, ep_degree: int, device_type: str | None = None,
               topology: Topology | str | None = None, timeout: timedelta | None = None) -> HybridMesh:
    """Build (or reuse) the ``("edp", "ep")`` mesh for the current world (``edp``: the ranks holding the
    same experts, ``dp_degree`` of them; ``ep``: one EP group). Every group it creates (the mesh's, the
    reduction group, holder-set groups of :meth:`HybridMesh.group_of`) gets ``timeout`` (``None``: the
    backend's default), under NCCL plus ``nccl.GRACE_S``, and so does the default group under NCCL; NCCL's
    watchdog and flight recorder get :func:`hf_hybrid_ep.parallel.nccl.set_env_defaults`.

    Raises:
        ValueError: if ``dp_degree * ep_degree`` differs from the world size.
        HybridEPConfigError: with a ``topology``, if the world does not fit it or an EP group would
            straddle a node boundary.
    """
    initialized = dist.is_available() and dist.is_initialized()
    world = world_size()
    if dp_degree * ep_degree != world:
        raise ValueError(
            f"dp_degree × ep_degree = {dp_degree} × {ep_degree} does not equal the world size {world}"
        )
    topo = None if topology is None else Topology.of(topology)
    ep_span = None if topo is None else ep_group_span(world, ep_degree, topo)
    device_type = device_type or default_device_type()
    if not initialized:
        return HybridMesh(1, 1, 0, device_type, None, topo, ep_span)
    key = (dp_degree, ep_degree, device_type, id(dist.group.WORLD), topo, timeout)  # a new world gets new groups
    if key not in _MESH_CACHE:
        nccl.set_env_defaults()  # read by every NCCL group created from here on
        group_timeout = nccl.group_timeout(timeout, device_type)
        if group_timeout is not None and device_type == "cuda":
            nccl.set_world_timeout(group_timeout)
        mesh = init_device_mesh(device_type, (dp_degree, ep_degree), mesh_dim_names=("edp", "ep"),
                                backend_override=_group_options(device_type, group_timeout))
        reduction = dist.new_group(list(range(world)), timeout=group_timeout)
        _MESH_CACHE[key] = HybridMesh(dp_degree, ep_degree, dist.get_rank(), device_type, mesh, topo, ep_span, reduction,
                                      timeout)
    return _MESH_CACHE[key]


def current_device(mesh: HybridMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """``out`` = the group's ``inp`` tensors concatenated in rank order (``all_gather_single`` where this
    torch has it, ``all_gather_into_tensor`` otherwise; looked up per call, so wrappers such as the
    benchmarks' byte meters see it). Returns the work handle with ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp.contiguous(), group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """``out`` = this rank's chunk of the group-wide sum of ``inp`` (``reduce_scatter_single`` where this torch
    has it, ``reduce_scatter_tensor`` otherwise; looked up per call). Returns the work handle with ``async_op``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, inp, group=group, async_op=async_op)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2-sharded parameter or gradient under ``dense_sharding="fsdp"``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t
