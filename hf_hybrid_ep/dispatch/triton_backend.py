"""The Triton dispatcher: the torch backend's exchange with fused permute and unpermute-combine.

Runs on CUDA, or on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .torch_backend import TorchDispatcher, TorchPlan


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
    """The torch backend's exchange with the permute before it and the unpermute-combine after it fused
    into one kernel each (:mod:`hf_hybrid_ep.dispatch.triton_kernels`). The experts' fused regroup is
    :class:`hf_hybrid_ep.moe.experts.ExpertCompute`'s, with the same kernels."""

    name = "triton"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from . import triton_kernels  # imported here: the interpreter flag is read at import

        self._kernels = triton_kernels

    def _permute(self, hidden: torch.Tensor, order: torch.Tensor, num_sent: int, top_k: int) -> torch.Tensor:
        return self._kernels.fused_permute(hidden, order, num_sent, top_k)

    def _unpermute_combine(self, back: torch.Tensor, top_k_weights: torch.Tensor, plan: TorchPlan) -> torch.Tensor:
        return self._kernels.fused_unpermute_combine(back, top_k_weights, plan.order, plan.num_tokens)
