"""`HybridEPConfig`: the one validated description of a hybrid-EP layout.

Every field has an environment twin (``HF_HYBRID_EP_<FIELD>``) that is read when the field is left
at its default, in the style of accelerate's plugins. A config can also be read from a dict or a
YAML file. Validation against a world size and a model happens in :meth:`HybridEPConfig.resolve`,
before any process group or tensor is touched.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import HybridEPConfigError
from .parallel.topology import Topology, ranks_per_node

ENV_PREFIX = "HF_HYBRID_EP_"

DISPATCHER_BACKENDS = ("auto", "torch", "triton", "dedup")
PLACEMENTS = ("contiguous",)
DROP_POLICIES = ("probs", "position")
OPTIMIZER_SHARDINGS = ("none", "zero1")
NONFINITE_GRAD_POLICIES = ("skip", "stop")
# keys a hybrid-EP YAML file may hold beside the config's fields (HybridEPPlugin maps them onto TrainingArguments)
TRAINING_SETTINGS = ("microbatch_size", "gradient_accumulation", "optimizer", "resume_from_checkpoint")
MIN_COLLECTIVE_TIMEOUT_S = 10.0  # above two beats of a rank-0-only write (parallel/heartbeat.py, 5 s apart)
DENSE_SHARDINGS = ("replicate", "fsdp")
# Which tokens a router load-balancing loss is formed over (docs/trl.md, "The load-balancing loss").
AUX_LOSS_SCOPES = ("local", "global")


def read_yaml_mapping(path: str | os.PathLike[str], label: str) -> Mapping[str, Any]:
    """The mapping a YAML file holds (its ``hybrid_ep:`` block if it has one).

    Raises:
        HybridEPConfigError: naming ``label`` and the file — missing, not UTF-8, a syntax error (with
            ``file:line:column``), not a mapping, or keys beside the ``hybrid_ep:`` block (nothing reads them).
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise HybridEPConfigError(f"{label} {str(path)!r} does not exist or is not a file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise HybridEPConfigError(f"{label} {str(path)!r} is not UTF-8 text (byte {err.start})") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise HybridEPConfigError(f"{label} {where}: YAML syntax error: {problem}") from err
    if isinstance(data, Mapping) and "hybrid_ep" in data:
        beside = sorted(str(k) for k in data if k != "hybrid_ep")
        if beside:
            raise HybridEPConfigError(f"{label} {str(path)!r}: key(s) {beside} stand beside the 'hybrid_ep:' block, "
                                      "where nothing reads them; move them inside it")
        data = data["hybrid_ep"] or {}
    if not isinstance(data, Mapping):
        raise HybridEPConfigError(f"{label} {str(path)!r} must hold a mapping (optionally under 'hybrid_ep:'), "
                                  f"got {type(data).__name__}")
    return data


def _env_value(name: str, default: Any) -> Any:
    """The environment twin ``HF_HYBRID_EP_<NAME>`` parsed like YAML ("2", "0.5", "true", "[[0, 1]]"),
    or ``None`` when unset. Typed by the field's default where that is a bool or a number."""
    raw = os.environ.get(ENV_PREFIX + name.upper())
    if raw is None or raw == "":
        return None
    import yaml

    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise HybridEPConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} cannot be parsed: {err}") from err
    if isinstance(default, bool) and not isinstance(value, bool):
        raise HybridEPConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean (use true/false)")
    if name in ("dp_degree", "ep_degree") and not isinstance(value, int):
        raise HybridEPConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not an integer")
    return value


@dataclass
class HybridEPConfig:
    """Layout and behaviour of hybrid expert parallelism.

    Attributes:
        dp_degree: data-parallel replicas of every expert (the EDP group size). ``None``: derived.
        ep_degree: ranks an expert layer is sharded over (consecutive ranks). ``None``: the largest
            divisor of the world size that also divides the expert count and fits in one node
            (``LOCAL_WORLD_SIZE``).
        dispatcher: token-exchange backend. ``"torch"`` (one row per (token, expert) pair with
            all_to_all_single; gloo and NCCL), ``"triton"`` (the same exchange with fused permute /
            unpermute-combine kernels; CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``),
            ``"dedup"`` (one row per token and destination rank, carrying its routing weights; the
            destination returns one partial sum per row; when an EP group spans nodes, a token crosses to
            each node once, to the rank with its local index there, and is relayed inside the node the
            same way) or ``"auto"`` (whichever of dedup and the per-pair exchange — Triton on CUDA when
            importable, else torch — a cost model predicts faster for the layout and device: the bytes on the
            topology's links and the bytes the gathers move in memory, ``hf_hybrid_ep.dispatch.cost``; the
            choice and both predicted times are logged). A requested backend that cannot run is an error with
            the reason.
        placement: ``"contiguous"`` (EP rank ``r`` owns experts ``[r*E/ep, (r+1)*E/ep)``), or an explicit
            table: a list over EP ranks of the global expert ids each rank holds, e.g.
            ``[[0, 3], [1, 2]]``; an expert listed on several ranks is replicated. One table serves every
            MoE layer; for a table per layer give a mapping from the experts module's qualified name to
            its table (``{"model.layers.0.mlp.experts": [[0, 3], [1, 2]], ...}``, as ``place`` writes
            it); layers the mapping does not name are contiguous. All tables have one row per EP rank.
        check_finite: detect NaN/inf in router inputs and raise on every rank at once, naming the layer.
            Costs one scalar all-reduce over the world per MoE layer and step.
        reduce_dense_gradients: average dense gradients over the world after ``backward()``. Turn it off
            when torch DDP (e.g. under Accelerate) already reduces the dense parameters.
        overlap_degree: split each MoE layer's tokens into this many chunks so the token exchange of
            chunk i+1 overlaps the experts of chunk i (asynchronous all-to-all). 1: no pipelining.
        expert_alignment: with the Triton dispatcher, pad each local expert's group of received rows
            to a multiple of this (for GEMM kernels that need aligned groups); padding is never sent.
        overlap_shared_expert: for blocks that run their shared expert after the routed experts
            (DeepSeek-V3, GLM-4-MoE), compute it while the return all-to-all is in flight.
        overlap_grad_reduce: launch each gradient bucket's collective (all-reduce, or reduce-scatter under
            ZeRO-1) asynchronously during ``backward`` as soon as its gradients are accumulated, and the
            ZeRO-1 parameter all-gathers after ``optimizer.step()`` (waited for by the first forward that
            needs them). ``False``: the same buckets, blocking, at the end of ``backward`` / in ``step()``.
        bucket_size_mb: gradient bucket size in MiB (a bucket closes once it holds this much); buckets
            are filled in reverse registration order, per process group and dtype.

    Router controls (all off by default, so the model routes exactly as its transformers code does):

        router_temperature: divide router logits by T before scoring. For softmax-then-top-k routers
            this changes the combine weights and the router gradients, not which experts are chosen.
        capacity_factor: per expert and per source rank, keep at most ``ceil(T·k/E · factor)`` of the
            rank's T tokens (as Megatron-Core does); the rest pass through the residual, are counted
            as dropped and never sent. With capacity on, results depend on the layout.
        drop_policy: which tokens an over-capacity expert keeps: ``"probs"`` (highest routing
            weight) or ``"position"`` (earliest tokens).
        device_load_factors: strength β of device-load-aware selection: ``β · (load_r / mean_load − 1)``
            is subtracted from the selection scores of the experts on EP rank r, from a running
            estimate of per-rank load (selection only; the combine weights stay the router's).
        aux_loss_coef / z_loss_coef: add a Switch load-balancing loss / router z-loss with these
            coefficients to the training loss (over the tokens ``aux_loss_scope`` says).
        aux_loss_scope: which tokens the router losses are formed over — the engine's (``aux_loss_coef``,
            ``z_loss_coef``) and the model's own (transformers' ``load_balancing_loss_func``, returned as the
            output's ``aux_loss`` when the config has ``output_router_logits``; TRL's trainers add it).
            ``"local"``: this rank's micro-batch, as every data-parallel run computes it. ``"global"``: every
            rank's micro-batch of the micro-step together — the expert counts, router-probability sums and token
            counts are all-reduced over the world before the loss is formed, so its value and gradients equal
            one process's loss over that global batch (one small all-reduce per differentiated forward; forwards
            under ``no_grad`` keep the local value). Gradient accumulation averages the micro-steps' losses, as
            one process with the same accumulation does.
        bias_update_rate: aux-loss-free balancing (DeepSeek-V3): after every optimizer step each
            expert's selection bias moves by ``rate · sign(mean_load − load)`` from the loads of the
            step's micro-batches, all-reduced over the world. Uses the router's own correction bias
            where it has one (a native checkpoint key), a selection-only bias elsewhere.
        force_balanced_routing: for benchmarking, token t's j-th choice is expert ``(t·k + j) mod E``.
        dead_expert_steps: an expert that received no token for this many optimizer steps is
            reported dead by the load metrics.

    Memory scaling (docs/memory.md):

        optimizer_sharding: ``"none"`` (every rank keeps the optimizer state of everything it holds) or
            ``"zero1"``: the state of dense parameters is sharded over the world and that of each expert
            over its EDP group; gradients are reduce-scattered, each rank steps its shard and the
            updated parameters are all-gathered. Build the optimizer with
            :func:`hf_hybrid_ep.make_optimizer` (the Trainer does).
        dense_sharding: ``"replicate"`` (dense weights on every rank, the default and fastest) or
            ``"fsdp"``: dense weights FSDP2-sharded over the world (``fully_shard`` per decoder layer and
            the root), experts left to the engine.

    Hot-expert shadowing (off by default; see ``hf_hybrid_ep/moe/shadow.py`` and docs/expert_cache.md):

        shadow_experts: after every optimizer step (``after_optimizer_step``), each rank holds local replicas
            ("shadows") of the remote experts its own tokens used most in the previous step, when the
            token bytes saved exceed the weight bytes fetched plus gradient bytes returned. Its own
            tokens for those experts are computed locally; gradients go back to the owners before the
            expert gradient reduction, so training stays faithful.
        shadow_capacity: at most this many shadows per rank and MoE layer.

    Topology and placement statistics:

        topology: the cluster as a spec string (:mod:`hf_hybrid_ep.parallel.topology`), e.g.
            ``"racks=2,nodes_per_rack=2,gpus_per_node=8"``. EP groups are then checked to lie inside a
            node (or to span whole nodes when ``ep_degree > gpus_per_node``), and the default
            ``ep_degree`` fits in one of its nodes. ``None``: ``LOCAL_WORLD_SIZE`` GPUs per node.
        coactivation_stats: also count, per MoE layer, the expert pairs chosen by the same token (an
            ``E × E`` counter, all-reduced with the loads once per optimizer step and written to
            ``expert_load.jsonl`` as ``coactivation``) for co-activation-aware placement.

    Failures (docs/troubleshooting.md, "When things go wrong"):

        collective_timeout_s: seconds a collective may take. Every process group the engine creates gets it (under
            NCCL plus 30 s, and the default group too: NCCL's own watchdog backs the package's), and
            the watchdog (:mod:`hf_hybrid_ep.parallel.watchdog`) ends every surviving rank with one message
            naming the collective, its group's ranks and the ranks that did not arrive when a collective (or a
            Trainer run that holds DDP's) makes no progress for this long. ``None``: the default process group's
            timeout (``TrainingArguments.ddp_timeout`` under ``scripts/train.py``; torch's default, 30 minutes
            for gloo and 10 for NCCL, otherwise). At least 10.
        on_nonfinite_grad: when the global gradient norm is NaN or inf: ``"skip"`` the optimizer step on every
            rank (counted, logged with the layers whose gradients were non-finite) or ``"stop"`` the run with
            ``hf_hybrid_ep.NonFiniteGradientError``.
        max_consecutive_skips: stop the run after this many optimizer steps skipped in a row.

    Online rebalancing (off by default; :mod:`hf_hybrid_ep.moe.rebalance`, docs/placement.md): after an
    optimizer step (``after_optimizer_step``) experts move between EP ranks, with their optimizer state, to
    per-layer tables fitted to the loads since the last rebalance; training stays faithful.

        rebalance_every: rebalance every this many optimizer steps.
        rebalance_when_imbalance_over: rebalance when the worst layer's rank imbalance (max/mean
            expected tokens per EP rank under its current table) exceeds this (> 1).
        rebalance_replicas: extra copies of the hottest experts per layer in the fitted tables
            (``num_experts + rebalance_replicas`` must be a multiple of the EP degree).
        rebalance_tolerance: per-rank load allowed above the balanced packing when the co-activation
            refinement keeps experts chosen together on one node.
    """

    dp_degree: int | None = None
    ep_degree: int | None = None
    dispatcher: str = "auto"
    placement: str | list[list[int]] | dict[str, list[list[int]]] = "contiguous"
    check_finite: bool = True
    reduce_dense_gradients: bool = True
    overlap_degree: int = 1
    overlap_shared_expert: bool = False
    overlap_grad_reduce: bool = True
    bucket_size_mb: float = 8.0
    expert_alignment: int = 1
    router_temperature: float | None = None
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    device_load_factors: float | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    aux_loss_scope: str = "local"
    bias_update_rate: float | None = None
    force_balanced_routing: bool = False
    dead_expert_steps: int = 100
    optimizer_sharding: str = "none"
    dense_sharding: str = "replicate"
    shadow_experts: bool = False
    shadow_capacity: int = 1
    topology: str | None = None
    coactivation_stats: bool = False
    verify_checksums: bool = True
    collective_timeout_s: float | None = None
    on_nonfinite_grad: str = "skip"
    max_consecutive_skips: int = 5
    rebalance_every: int | None = None
    rebalance_when_imbalance_over: float | None = None
    rebalance_replicas: int = 0
    rebalance_tolerance: float = 0.05
    _env_applied: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self._env_applied:
            self._apply_env()
            self._env_applied = True
        self._check_static()

    # ------------------------------------------------------------------ construction
    def _apply_env(self) -> None:
        """Fill every field still at its default from its environment twin."""
        for name, default in config_fields().items():
            if getattr(self, name) == default:
                value = _env_value(name, default)
                if value is not None:
                    setattr(self, name, value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HybridEPConfig:
        """Build from a mapping; unknown keys are an error that names them."""
        known = set(config_fields())
        unknown = sorted(set(data) - known)
        if unknown:
            training = sorted(set(unknown) & set(TRAINING_SETTINGS))
            hint = (f"; {training} are training settings, read by HybridEPPlugin (scripts/train.py "
                    "--hybrid_ep_config; examples/hybrid_ep.yaml)") if training else ""
            raise HybridEPConfigError(f"unknown HybridEPConfig key(s) {unknown}; known keys: {sorted(known)}{hint}")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> HybridEPConfig:
        """Read a YAML file holding a mapping of config keys (optionally under a ``hybrid_ep:`` key)."""
        return cls.from_dict(read_yaml_mapping(path, "config file"))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in config_fields()}

    # ------------------------------------------------------------------ validation
    def _check_static(self) -> None:
        for name in ("dp_degree", "ep_degree"):
            check_int(name, getattr(self, name), optional=True)
        if self.dispatcher not in DISPATCHER_BACKENDS:
            raise HybridEPConfigError(
                f"dispatcher={self.dispatcher!r} is not available; choose one of {list(DISPATCHER_BACKENDS)}"
            )
        self._check_placement()
        for name in ("router_temperature", "capacity_factor"):
            _check_number(name, getattr(self, name), positive=True, optional=True)
        for name in ("device_load_factors", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            _check_number(name, getattr(self, name), positive=False, optional=True)
        _check_choice("drop_policy", self.drop_policy, DROP_POLICIES)
        _check_choice("aux_loss_scope", self.aux_loss_scope, AUX_LOSS_SCOPES)
        for name in ("expert_alignment", "overlap_degree", "dead_expert_steps", "shadow_capacity", "max_consecutive_skips"):
            check_int(name, getattr(self, name))
        for name in ("overlap_grad_reduce", "shadow_experts", "coactivation_stats", "verify_checksums"):
            _check_bool(name, getattr(self, name))
        _check_number("bucket_size_mb", self.bucket_size_mb, positive=True, unit=" of MiB")
        _check_choice("optimizer_sharding", self.optimizer_sharding, OPTIMIZER_SHARDINGS)
        _check_choice("dense_sharding", self.dense_sharding, DENSE_SHARDINGS)
        _check_choice("on_nonfinite_grad", self.on_nonfinite_grad, NONFINITE_GRAD_POLICIES)
        timeout = self.collective_timeout_s
        _check_number("collective_timeout_s", timeout, positive=True, optional=True, unit=" of seconds")
        if timeout is not None and timeout < MIN_COLLECTIVE_TIMEOUT_S:
            raise HybridEPConfigError(f"collective_timeout_s={timeout!r} must be at least {MIN_COLLECTIVE_TIMEOUT_S:g} "
                                      "seconds (ranks wait up to 5 s between two beats while rank 0 writes alone)")
        check_int("rebalance_every", self.rebalance_every, optional=True)
        over = self.rebalance_when_imbalance_over
        if over is not None and (isinstance(over, bool) or not isinstance(over, int | float) or not over > 1):
            raise HybridEPConfigError(f"rebalance_when_imbalance_over={over!r} must be a number above 1 (max/mean) "
                                      "or None")
        check_int("rebalance_replicas", self.rebalance_replicas, minimum=0)
        _check_number("rebalance_tolerance", self.rebalance_tolerance, positive=False)
        if self.topology is not None:
            if not isinstance(self.topology, str):
                raise HybridEPConfigError(f"topology={self.topology!r} must be a spec string such as 'gpus_per_node=8'")
            Topology.parse(self.topology)

    def _check_placement(self) -> None:
        if isinstance(self.placement, str):
            if self.placement not in PLACEMENTS:
                raise HybridEPConfigError(
                    f"placement={self.placement!r} is unknown; use one of {list(PLACEMENTS)} "
                    "or an explicit table (a list over EP ranks of global expert ids)"
                )
        elif isinstance(self.placement, Mapping):
            for layer, rows in self.placement.items():
                if not isinstance(layer, str):
                    raise HybridEPConfigError(f"per-layer placement key {layer!r} must be an experts module's "
                                              "qualified name (a string)")
                if not (isinstance(rows, str) and rows in PLACEMENTS):
                    _check_rows(rows, f"placement table of layer {layer!r}")
            placement_row_count(self.placement)
        elif isinstance(self.placement, Sequence):
            _check_rows(self.placement, "placement table")
        else:
            raise HybridEPConfigError(f"placement={self.placement!r} must be a name, a table or a mapping "
                                      "from layer name to table")

    @property
    def rebalancing(self) -> bool:
        """Whether online rebalancing is on."""
        return self.rebalance_every is not None or self.rebalance_when_imbalance_over is not None

    def selection_controls_on(self) -> bool:
        """Whether any control needs the router's selection rule to be replaced."""
        return bool(
            self.router_temperature is not None
            or self.device_load_factors
            or self.bias_update_rate is not None
            or self.force_balanced_routing
        )

    def resolve(self, world_size: int, num_experts: int, local_world_size: int | None = None) -> tuple[int, int]:
        """The validated layout ``(dp_degree, ep_degree)`` for this world and expert count, or raise naming the
        values (:func:`hf_hybrid_ep.build_mesh` then builds the one object that owns the degrees and the mesh).

        Args:
            world_size: number of ranks ``W``.
            num_experts: routed experts per MoE layer ``E``.
            local_world_size: ranks per node; defaults to ``LOCAL_WORLD_SIZE`` or the world size.
        """
        if local_world_size is None:

            local_world_size = ranks_per_node(self.topology, world_size)
        dp, ep = self.dp_degree, self.ep_degree
        rows = placement_row_count(self.placement)
        if dp is None and ep is None:
            if rows is not None:
                ep = rows
            else:
                ep = max(
                    d
                    for d in range(1, world_size + 1)
                    if world_size % d == 0 and num_experts % d == 0 and local_world_size % d == 0
                )
        if ep is None:
            if world_size % dp != 0:
                raise HybridEPConfigError(f"dp_degree={dp} does not divide the world size {world_size}")
            ep = world_size // dp
        if dp is None:
            if world_size % ep != 0:
                raise HybridEPConfigError(f"ep_degree={ep} does not divide the world size {world_size}")
            dp = world_size // ep
        if dp * ep != world_size:
            raise HybridEPConfigError(
                f"dp_degree × ep_degree = {dp} × {ep} = {dp * ep} does not equal the world size {world_size}"
            )
        if rows is not None:
            if rows != ep:
                raise HybridEPConfigError(
                    f"placement table has {rows} rows but ep_degree={ep}; give one row per EP rank"
                )
        elif num_experts % ep != 0:
            raise HybridEPConfigError(
                f"num_experts={num_experts} is not divisible by ep_degree={ep} under placement="
                f"{self.placement!r}; pick an ep_degree that divides {num_experts} or give an explicit table"
            )
        return dp, ep


def _check_rows(rows: object, what: str) -> None:
    if not isinstance(rows, Sequence) or isinstance(rows, str) or not all(
        isinstance(row, Sequence) and not isinstance(row, str)
        and all(isinstance(e, int) and not isinstance(e, bool) for e in row)
        for row in rows
    ):
        raise HybridEPConfigError(f"{what} {rows!r} must be a list of lists of integer expert ids")


def placement_row_count(placement: object) -> int | None:
    """Rows (EP ranks) an explicit placement fixes; ``None`` for a named one. A per-layer mapping's
    tables must agree (a layer it maps to ``"contiguous"`` takes any EP degree)."""
    if isinstance(placement, str):
        return None
    if isinstance(placement, Mapping):
        counts = {layer: len(rows) for layer, rows in placement.items() if not isinstance(rows, str)}
        if len(set(counts.values())) > 1:
            raise HybridEPConfigError(f"per-layer placement tables have different row counts {counts}; every "
                                      "layer needs one row per EP rank of the same EP group")
        return next(iter(counts.values()), None)
    return len(placement)


def check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False, detail: str = "") -> None:
    """Raise unless ``value`` is an integer ≥ ``minimum`` (1: positive, 0: non-negative), or ``None``
    when ``optional``; a bool is not an integer here. ``detail`` ends the message."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "positive integer" if minimum == 1 else "non-negative integer"
        raise HybridEPConfigError(f"{name}={value!r} must be a {kind}" + (" or None" if optional else "") + detail)


def _check_number(name: str, value: Any, *, positive: bool, optional: bool = False, unit: str = "") -> None:
    """Raise unless ``value`` is a real number > 0 (``positive``) or ≥ 0, or ``None`` when ``optional``."""
    if optional and value is None:
        return
    ok = not isinstance(value, bool) and isinstance(value, int | float) and (value > 0 if positive else value >= 0)
    if not ok:
        kind = "positive number" if positive else "non-negative number"
        raise HybridEPConfigError(f"{name}={value!r} must be a {kind}{unit}" + (" or None" if optional else ""))


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise HybridEPConfigError(f"{name}={value!r} must be true or false")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise HybridEPConfigError(f"{name}={value!r} must be one of {list(choices)}")


def config_fields() -> dict[str, Any]:
    """Every public field of :class:`HybridEPConfig` and its default (``None`` for a factory default)."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else None
            for f in dataclasses.fields(HybridEPConfig) if not f.name.startswith("_")}


def env_values() -> dict[str, Any]:
    """The set environment twins ``HF_HYBRID_EP_<FIELD>`` of the config's fields, parsed and type-checked
    (the one environment parser: :class:`HybridEPConfig` and the Accelerate plugin both read it)."""
    values = {}
    for name, default in config_fields().items():
        value = _env_value(name, default)
        if value is not None:
            values[name] = value
    return values


RUN_ID_ENV = ENV_PREFIX + "RUN_ID"  # not a config field: the job a process belongs to


def run_id_from_env() -> str | None:
    """The id of the job this process belongs to (``HF_HYBRID_EP_RUN_ID``; ``None`` when unset): every attempt of
    one job has the same — ``hf-hybrid-ep launch`` sets it for all of its attempts, a scheduler's job id serves
    too — so that a restarted attempt takes over the leases and save claims of its own job at once
    (:mod:`hf_hybrid_ep.checkpoint.lease`)."""
    return os.environ.get(RUN_ID_ENV) or None
