"""Projections through frozen weights kept quantized: dequantized just in time, one expert group at a time.

* :func:`grouped_linear`: transformers' ``_grouped_linear`` calling convention (expert-major rows ``x [P, in]``,
  group offsets, per-row bias, ``is_transposed``) over a :class:`~hf_hybrid_ep.quant.weights.QuantizedWeight`.
  The forward dequantizes ``experts_per_group`` experts, multiplies their rows and drops them before the next
  group; the backward dequantizes them again for the input gradient. Nothing dequantized is saved for the
  backward (nor the input: the weight gets no gradient), so at most one group's dequantized weight is alive.
  Experts without rows are not dequantized.
* :class:`FP8Linear`: a frozen block-FP8 dense linear, an ``nn.Linear`` (PEFT's LoRA wraps it as it wraps any
  linear) holding ``data`` + ``scale_inv`` and no weight of its own: its forward dequantizes the layer just
  in time. Its ``weight`` is a :class:`KeptQuantizedWeight`: shape, dtype and device of the dequantized
  weight for whoever inspects them (PEFT places and casts its adapters by them), and every operation on its
  values refused with a message naming ``keep_quantized=False`` (merging an adapter, an initialisation that
  reads the weight, DoRA), never a silently wrong weight.

transformers' own ``FP8Linear`` (``FineGrainedFP8Config(dequantize=False)``) is not this: it quantizes the
activations to FP8 as well, on CUDA kernels only, so its forward is not the dequantized weight's; here the
activations stay in the model's dtype and the product equals the dequantized checkpoint's layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import HybridEPConfigError
from .weights import BlockFP8Weight, QuantizedWeight

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _row_bounds(offsets: torch.Tensor | Sequence[int], experts: int) -> list[int]:
    """``[0, offsets...]``: expert ``e``'s rows are ``bounds[e]:bounds[e + 1]`` (a device tensor is read to the
    host once: callers that have the host counts pass them)."""
    ends = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    if len(ends) != experts or any(b < a for a, b in zip([0, *ends], ends, strict=False)):
        raise ValueError(f"offsets {ends} are not the non-decreasing row ends of {experts} experts")
    return [0, *ends]


def _grouped_products(x: torch.Tensor, weight: QuantizedWeight, bounds: list[int], transposed: bool,
                      dtype: torch.dtype, group: int, out_features: int) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ (W_e if transposed else W_eᵀ)``, ``W_e`` dequantized ``group`` experts
    at a time (each group freed before the next is made); rows past the last offset are zero."""
    out = x.new_empty(x.shape[0], out_features)
    out[bounds[-1]:].zero_()
    with torch.autocast(x.device.type, enabled=False):  # the products run in x's dtype, already autocast's
        _products_into(out, x, weight, bounds, transposed, dtype, group)
    return out


def _products_into(out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bounds: list[int],
                   transposed: bool, dtype: torch.dtype, group: int) -> None:
    for start in range(0, weight.num_experts, group):
        stop = min(start + group, weight.num_experts)
        if bounds[start] == bounds[stop]:
            continue
        w = weight.dequantize_experts(start, stop, dtype)
        for i, expert in enumerate(range(start, stop)):
            lo, hi = bounds[expert], bounds[expert + 1]
            if hi > lo:
                torch.mm(x[lo:hi], w[i] if transposed else w[i].t(), out=out[lo:hi])
        del w


class _QuantizedGroupedLinear(torch.autograd.Function):
    """``x [P, in]`` through a frozen quantized weight, dequantized just in time in forward and backward."""

    @staticmethod
    def forward(ctx, x, weight, bounds, transposed, group):  # type: ignore[override]
        ctx.weight, ctx.bounds, ctx.transposed, ctx.group = weight, bounds, transposed, group
        ctx.in_features = x.shape[1]
        out_features = weight.shape[-1] if transposed else weight.shape[-2]
        return _grouped_products(x, weight, bounds, transposed, x.dtype, group, out_features)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        grad_x = _grouped_products(grad, ctx.weight, ctx.bounds, not ctx.transposed, grad.dtype,
                                   ctx.group, ctx.in_features)
        return grad_x, None, None, None, None


def grouped_linear(x: torch.Tensor, weight: QuantizedWeight, offsets: torch.Tensor | Sequence[int],
                   bias: torch.Tensor | None = None, *, is_transposed: bool = False, dtype: torch.dtype | None = None,
                   experts_per_group: int = 1) -> torch.Tensor:
    """One grouped projection of expert-major rows ``x [P, in]``: rows ``offsets[e-1]:offsets[e]`` through expert
    ``e`` of ``weight`` (``[E, in, out]`` when ``is_transposed``, else ``[E, out, in]``; a 2-D weight is one
    expert), plus ``bias`` (``[P, out]``: each row's expert's bias, gathered by the caller; or ``[out]``).

    The weight is dequantized to ``dtype`` (default its :attr:`~hf_hybrid_ep.quant.weights.QuantizedWeight.dtype`;
    autocast's compute dtype under autocast), ``x`` must be in it, and so is the result ``[P, out]``. Gradients
    reach ``x`` and ``bias``, never the weight. ``offsets`` on the host (a list) spare a device read.

    Raises:
        ValueError: for ``x`` of another dtype or width, or offsets that are not ``E`` non-decreasing row ends.
    """
    transposed, dtype = bool(is_transposed), dtype or weight.dtype
    in_features = weight.shape[-2] if transposed else weight.shape[-1]
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != dtype:
        raise ValueError(f"{weight.name}: rows {x.dtype} {tuple(x.shape)} for a weight {tuple(weight.shape)} "
                         f"(is_transposed={transposed}) computed in {dtype}: need [P, {in_features}] in {dtype}")
    bounds = _row_bounds(offsets, weight.num_experts)
    if bounds[-1] > x.shape[0]:
        raise ValueError(f"{weight.name}: offsets end at row {bounds[-1]} of {x.shape[0]}")
    out = _QuantizedGroupedLinear.apply(x, weight, bounds, transposed, max(1, int(experts_per_group)))
    return out if bias is None else out.add_(bias)  # in place, as transformers' _grouped_linear: no second [P, out]


class KeptQuantizedWeight(torch.Tensor):
    """The ``weight`` of a module whose weight is kept quantized: the dequantized weight's shape, dtype and
    device, and no values. :meth:`Tensor.detach` / ``.data`` give another such view; every other operation
    raises :class:`~hf_hybrid_ep.errors.HybridEPConfigError` naming the module and ``keep_quantized=False``."""

    @staticmethod
    def __new__(cls, owner: str, quantized: QuantizedWeight) -> KeptQuantizedWeight:
        view = torch.Tensor._make_wrapper_subclass(cls, quantized.shape, dtype=quantized.dtype,
                                                   device=quantized.device, requires_grad=False)
        view.owner, view.quantized = owner, quantized
        return view

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"KeptQuantizedWeight({self.owner}: {self.quantized.method} {tuple(self.shape)}, dequantizes to "
                f"{str(self.dtype).removeprefix('torch.')})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        views = [a for a in args if isinstance(a, KeptQuantizedWeight)]
        if func in _ALIASES and len(args) == 1:
            return KeptQuantizedWeight(views[0].owner, views[0].quantized)
        owner = views[0].owner if views else "a kept-quantized weight"
        raise HybridEPConfigError(
            f"{owner}.weight is kept quantized ({views[0].quantized.method if views else 'fp8'}; keep_quantized=True) "
            f"and has no values to read or change: {func} on it is refused (merging adapters into the base, "
            "initialising from the base weight, DoRA). Load the base with keep_quantized=False to dequantize it.")


class FP8Linear(nn.Linear):
    """A frozen block-FP8 ``nn.Linear``: ``y = x · Wᵀ + b`` with ``W`` dequantized from ``quantized`` just in time
    in the forward and again for the input gradient, in the model's dtype (autocast's when narrower).

    Args:
        quantized: the 2-D weight ``[out, in]``.
        bias: ``[out]`` or ``None`` (a frozen parameter).

    The state dict holds the checkpoint's tensors under their checkpoint names (``weight`` float8,
    ``weight_scale_inv``, ``bias``), so it loads from and saves to the shipped form.
    """

    def __init__(self, quantized: BlockFP8Weight, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        if len(quantized.shape) != 2:
            raise HybridEPConfigError(f"{quantized.name}: FP8Linear takes a 2-D weight, got {tuple(quantized.shape)}")
        self.out_features, self.in_features = quantized.shape
        self.quantized = quantized
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)
        self.register_state_dict_post_hook(_checkpoint_names)
        self.register_load_state_dict_pre_hook(_module_names)

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
                        bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                        name: str = "weight") -> FP8Linear:
        """From a checkpoint's ``P.weight`` (float8 ``[out, in]``) and ``P.weight_scale_inv``."""
        return cls(BlockFP8Weight(weight, weight_scale_inv, block, dtype, name), bias)

    @property
    def weight(self) -> KeptQuantizedWeight:  # type: ignore[override]
        return KeptQuantizedWeight(self.quantized.name, self.quantized)

    @weight.setter
    def weight(self, value) -> None:
        raise HybridEPConfigError(f"{self.quantized.name}: the weight is kept quantized (keep_quantized=True) and "
                                  "cannot be replaced; load the base with keep_quantized=False to change it")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x, self.quantized.dtype)
        rows = x.reshape(-1, self.in_features)
        if dtype != self.quantized.dtype:  # autocast: F.linear casts input and weight
            rows = rows.to(dtype)
        elif x.dtype != dtype:
            raise ValueError(f"{self.quantized.name}: input {x.dtype} for a linear in {dtype} (as nn.Linear: input and "
                             "weight share one dtype outside autocast)")
        bias = None if self.bias is None else self.bias.to(dtype)
        out = grouped_linear(rows, self.quantized, [rows.shape[0]], bias, dtype=dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A plain ``nn.Linear`` holding this layer's weight dequantized to ``dtype`` (default the model's)."""
        dtype = dtype or self.quantized.dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.quantized.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.quantized.dequantize(dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)


def _compute_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``F.linear`` computes in for ``x`` and a weight of ``dtype``: autocast's where it is on and
    narrower, else ``dtype``."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        narrow = torch.get_autocast_dtype(device_type)
        if narrow.itemsize < dtype.itemsize:
            return narrow
    return dtype


_STATE_NAMES = {"quantized.data": "weight", "quantized.scale_inv": "weight_scale_inv"}


def _checkpoint_names(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: the holder's buffers under the checkpoint's names."""
    for inner, outer in _STATE_NAMES.items():
        if prefix + inner in state_dict:
            state_dict[prefix + outer] = state_dict.pop(prefix + inner)


def _module_names(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: the checkpoint's names back to the holder's buffers."""
    for inner, outer in _STATE_NAMES.items():
        if prefix + outer in state_dict:
            state_dict[prefix + inner] = state_dict.pop(prefix + outer)


__all__ = ["FP8Linear", "KeptQuantizedWeight", "grouped_linear"]
