"""Count what one MoE layer's forward and backward cost in collectives and in host synchronisations.

:class:`CollectiveCounter` wraps the ``torch.distributed`` collectives (the library looks them up per
call) and labels each call with its process group (``world``, ``ep``, ``edp`` or ``other``).
:class:`SyncCounter` is a ``TorchDispatchMode`` that counts the ATen ops that synchronise the host with
a CUDA device (``_local_scalar_dense`` — ``.item()``/``int()`` —, ``nonzero``, ``bincount``,
``repeat_interleave`` without ``output_size``, boolean-mask indexing, ``masked_select``, ``unique``),
plus explicit host reads (``Tensor.tolist``/``.cpu``/``.numpy``), which on CPU dispatch no op.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_gather",
               "all_gather_object", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "barrier",
               "all_to_all")
SYNC_OPS = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim"}
HOST_READS = ("tolist", "cpu", "numpy")


class CollectiveCounter:
    """``counts[(collective, group label)]`` of the calls made inside :meth:`active`."""

    def __init__(self, groups: dict[str, object]) -> None:
        self.groups = groups
        self.counts: Counter = Counter()

    def _label(self, group) -> str:
        group = dist.group.WORLD if group is None else group
        named = next((name for name, g in self.groups.items() if g is group), None)
        if named is not None:
            return named
        return "world" if group is dist.group.WORLD else "other"

    @contextlib.contextmanager
    def active(self) -> Iterator[CollectiveCounter]:
        saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, real in saved.items():
            def wrapper(*args, _real=real, _name=name, **kwargs):
                self.counts[(_name, self._label(kwargs.get("group")))] += 1
                return _real(*args, **kwargs)
            setattr(dist, name, wrapper)
        try:
            yield self
        finally:
            for name, real in saved.items():
                setattr(dist, name, real)


class SyncCounter(TorchDispatchMode):
    """``counts[op]`` of the host-synchronising ATen ops (and host reads) inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self._saved: dict[str, object] = {}
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts[name] += 1
        elif name == "repeat_interleave" and func._overloadname.startswith("Tensor") and kwargs.get("output_size") is None:
            if not (len(args) > 2 and args[2] is not None):
                self.counts["repeat_interleave(no output_size)"] += 1
        elif name in ("index", "index_put", "index_put_") and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None
        ):
            self.counts[f"{name}(bool mask)"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for attr in HOST_READS:
            real = getattr(torch.Tensor, attr)
            self._saved[attr] = real

            def wrapper(t, *args, _real=real, _attr=attr, **kwargs):
                if not self._paused:
                    self.counts[f"Tensor.{_attr}"] += 1
                return _real(t, *args, **kwargs)
            setattr(torch.Tensor, attr, wrapper)
        self._pause_inside_triton_interpreter()
        return super().__enter__()

    def _pause_inside_triton_interpreter(self) -> None:
        """A Triton kernel launch does not synchronise on CUDA; on CPU the interpreter runs it with tensor and
        NumPy calls of its own, which are not the library's and are not counted."""
        try:
            from triton.runtime.interpreter import GridExecutor
        except ImportError:
            return
        real = GridExecutor.__call__
        self._saved["GridExecutor"] = real
        counter = self

        def call(executor, *args, **kwargs):
            from torch.utils._python_dispatch import _disable_current_modes

            counter._paused += 1
            try:
                with _disable_current_modes():
                    return real(executor, *args, **kwargs)
            finally:
                counter._paused -= 1

        GridExecutor.__call__ = call

    def __exit__(self, *exc):
        for attr, real in self._saved.items():
            if attr == "GridExecutor":
                from triton.runtime.interpreter import GridExecutor

                GridExecutor.__call__ = real
            else:
                setattr(torch.Tensor, attr, real)
        return super().__exit__(*exc)


def layer_costs(dispatcher: str = "torch", dp: int = 1, overlap_degree: int = 1, topology: str | None = None) -> dict:
    """One MoE layer's forward and backward on world ``W`` (ep = W / dp): collectives per group (the
    hierarchical dispatcher's sub-groups labelled ``inter`` / ``intra``) and host syncs of each pass. Runs on
    every rank of a worker pool."""
    import os

    from tiny_models import build_tiny_model

    import hf_hybrid_ep as hep

    if dispatcher == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    model.train()
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=world // dp, dispatcher=dispatcher,
                                              overlap_degree=overlap_degree, topology=topology))
    state = hep.state_of(model)
    layer = state.layers[0]
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(16, hidden, generator=g, requires_grad=True)
    logits = torch.randn(16, 4, generator=g, requires_grad=True)
    weights, index = torch.softmax(logits, -1).topk(2, dim=-1)
    groups = {"ep": state.mesh.ep_group, "edp": state.mesh.edp_group}
    node_groups = getattr(layer.dispatcher, "groups", None)
    if node_groups is not None:
        groups |= {"inter": node_groups.inter_group, "intra": node_groups.intra_group}
    out = {}
    with hep.no_sync(model):  # the layer's own costs; gradient reduction is counted elsewhere
        for phase in ("forward", "backward"):
            collectives, syncs = CollectiveCounter(groups), SyncCounter()
            with collectives.active(), syncs:
                if phase == "forward":
                    y = layer.module(x, index, weights)
                else:
                    y.backward(torch.ones_like(y))
            out[phase] = {"collectives": {f"{k[0]}@{k[1]}": v for k, v in sorted(collectives.counts.items())},
                          "syncs": dict(sorted(syncs.counts.items()))}
    out["grads"] = bool(x.grad is not None and logits.grad is not None)
    return out


def shadow_refresh_costs(skew: bool) -> dict:
    """Collectives of ``after_optimizer_step`` with hot-expert shadowing on, after one training step (tiny GPT-OSS,
    world 4 at (1, 4)): with ``skew`` experts 0 and 2 draw nearly every token and get shadowed."""
    from dist_cases.common import _global_inputs, _rank_slice, _skew_routers
    from tiny_models import build_tiny_model

    import hf_hybrid_ep as hep

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_tiny_model("gpt_oss", num_experts=4)
    model.train()
    if skew:
        _skew_routers(model, [0, 2], 4.0)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=world, shadow_experts=True, shadow_capacity=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq = 32 if skew else 4  # few tokens and no skew: no remote expert is worth its weight bytes
    model(**_rank_slice(_global_inputs(model, world, seed=1, seq=seq), rank)).loss.backward()
    opt.step()
    state = hep.state_of(model)
    counter = CollectiveCounter({"ep": state.mesh.ep_group, "edp": state.mesh.edp_group})
    with counter.active():
        hep.after_optimizer_step(model)
    held = sum(len(layer.shadows.experts) for layer in state.layers if layer.shadows is not None)
    return {"collectives": {f"{k[0]}@{k[1]}": v for k, v in sorted(counter.counts.items())}, "held": held,
            "params_per_layer": len(state.layers[0].param_names), "layers": len(state.layers)}


def pipelined_backward_order(degree: int = 3) -> list[str]:
    """The order of the chunked layer's backward exchanges: ``launch <phase> <chunk>`` when a reverse
    exchange starts, ``wait <phase> <chunk>`` when its result is needed (world 2, ep 2)."""
    from tiny_models import build_tiny_model

    import hf_hybrid_ep as hep
    from hf_hybrid_ep.dispatch import alltoall

    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=dist.get_world_size(), overlap_degree=degree,
                                              dispatcher="torch"))
    layer = hep.state_of(model).layers[0]
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(24, model.config.hidden_size, generator=g, requires_grad=True)
    weights, index = torch.softmax(torch.randn(24, 4, generator=g), -1).topk(2, dim=-1)
    names: dict[int, str] = {}
    events: list[str] = []
    launch_bwd, wait_bwd, launch_fwd = (alltoall._LaunchExchange.backward, alltoall._WaitExchange.backward,
                                        alltoall._LaunchExchange.forward)

    def name(e) -> str:
        return names.setdefault(id(e), f"{e.phase} {sum(1 for n in names.values() if n.startswith(e.phase))}")

    def forward(ctx, x, exchange):
        name(exchange)
        return launch_fwd(ctx, x, exchange)

    def on_wait_grad(ctx, grad):  # the gradient of the wait launches the reverse exchange
        events.append("launch " + name(ctx.exchange))
        return wait_bwd(ctx, grad)

    def on_launch_grad(ctx, grad):
        events.append("wait " + name(ctx.exchange))
        return launch_bwd(ctx, grad)

    alltoall._LaunchExchange.forward = staticmethod(forward)
    alltoall._WaitExchange.backward, alltoall._LaunchExchange.backward = staticmethod(on_wait_grad), staticmethod(on_launch_grad)
    try:
        layer.module(x, index, weights).square().sum().backward()
    finally:
        alltoall._LaunchExchange.forward = staticmethod(launch_fwd)
        alltoall._WaitExchange.backward, alltoall._LaunchExchange.backward = staticmethod(wait_bwd), staticmethod(launch_bwd)
    return events
