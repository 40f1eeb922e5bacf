"""The Triton dispatcher: the torch backend's exchange with fused permute and unpermute-combine.

Runs on CUDA, or on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..errors import HybridEPConfigError
from .torch_backend import DispatchHandle, TorchDispatcher, grouped_experts


def triton_unavailable_reason(device_type: str) -> str | None:
    """Why the Triton kernels cannot run for ``device_type`` (``None`` when they can)."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install 'hf_hybrid_ep[triton]')"
    if device_type == "cuda" and torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"no CUDA device for device type {device_type!r}; set TRITON_INTERPRET=1 to run the kernels on "
            "the CPU interpreter (slow: for tests)")


class TritonDispatcher(TorchDispatcher):
    """Fused permute / unpermute-combine around the exchange, and a fused regroup of the received rows
    from rank-major to expert-major order (each expert's group padded to ``alignment`` rows) feeding
    transformers' grouped GEMM directly."""

    name = "triton"

    def __init__(self, *args, alignment: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from . import triton_kernels  # imported here: the interpreter flag is read at import

        self._kernels = triton_kernels
        self.alignment = alignment

    def run_experts(self, module, local_forward, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Always the grouped GEMM path, with the regroups as fused gathers (padding rows are zeros)."""
        index, destination, sizes, _ = self.regroup_plan(handle, module.num_experts)
        grouped = self._kernels.fused_gather_rows(rows, index, destination)  # expert-major, padded
        out = grouped_experts(module, grouped, sizes)
        return self._kernels.fused_gather_rows(out, destination, index)  # back to rank-major order

    def _permute(self, hidden: torch.Tensor, order: torch.Tensor, num_sent: int, top_k: int) -> torch.Tensor:
        return self._kernels.fused_permute(hidden, order, num_sent, top_k)

    def _unpermute_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self._kernels.fused_unpermute_combine(back, top_k_weights, handle.order, handle.num_tokens)


def hybrid_ep_triton_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts implementation ``"hybrid_ep_triton"`` (single device): fused permute →
    transformers' grouped GEMM on expert-sorted rows → fused unpermute-combine."""
    reason = triton_unavailable_reason(hidden_states.device.type)
    if reason is not None:
        raise HybridEPConfigError(f"experts implementation 'hybrid_ep_triton' cannot run: {reason}")
    from transformers.integrations.moe import grouped_mm_experts_forward

    from . import triton_kernels

    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1).long()
    valid = (flat >= 0) & (flat < self.num_experts)
    key = torch.where(valid, flat, self.num_experts)
    sorted_ids, order = torch.sort(key, stable=True)
    num_rows = int(valid.sum())
    rows = triton_kernels.fused_permute(hidden_states, order, num_rows, top_k)
    unit = torch.ones(num_rows, 1, dtype=rows.dtype, device=rows.device)
    expert_out = grouped_mm_experts_forward(self, rows, sorted_ids[:num_rows, None], unit)
    out = triton_kernels.fused_unpermute_combine(expert_out, top_k_weights, order, tokens)
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register ``"hybrid_ep_triton"`` in transformers' experts-implementation registry."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("hybrid_ep_triton", hybrid_ep_triton_experts_forward)
