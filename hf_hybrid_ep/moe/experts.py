"""This rank's experts on the rows a dispatch delivered: the expert compute beside the dispatcher.

:class:`ExpertCompute` runs one fused experts module's local slots on rows grouped by source rank, then by
slot (:class:`~hf_hybrid_ep.dispatch.protocol.Received`), with unit weights (the sender applies the routing
weights in the combine):

* with transformers' ``grouped_mm`` experts implementation (or the Triton kernels): one regroup to
  expert-major order (each slot's rows padded to ``alignment``), the grouped GEMMs (:meth:`ExpertCompute.linear`
  for ``gate_up`` then ``down``, the gate or activation between, the post-expert norm after), one regroup back;
* otherwise the module's own experts implementation, which groups rows itself.

An adapter extends :meth:`ExpertCompute.linear` (one grouped projection of expert-major rows) and nothing in
:mod:`hf_hybrid_ep.dispatch` changes. ``hybrid_ep_triton``, the single-device experts implementation with the
same kernels, is registered with transformers here too.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dispatch.protocol import Received


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes matrix products in on ``t``'s device, when autocast is on there and
    ``t`` is a wider float (fp32 weights or activations under ``autocast(dtype=torch.bfloat16)``); else ``None``."""
    device_type = t.device.type
    if not (t.is_floating_point() and torch.is_autocast_enabled(device_type)):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if torch.finfo(dtype).bits < torch.finfo(t.dtype).bits else None


class _PermuteRows(torch.autograd.Function):
    """``out = src[index]`` for a permutation ``index``; the backward is the gather by ``inverse``."""

    @staticmethod
    def forward(ctx, src, index, inverse):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def regroup_index(received: Received, local_slots: int, alignment: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Where each received row goes in expert-major order, each local slot's group padded to ``alignment``
    rows; on the device, with sizes from the host counts (no synchronisation).

    Returns ``(index [P], destination [M], sizes [local_slots], sizes_host)``: ``index[j]`` is the received
    row placed at padded position j (-1: padding), ``destination[i]`` the padded position of row i, ``sizes``
    the padded group sizes.
    """
    sources, slots, host = received.sources, received.slots, received.counts_host
    per_slot = [sum(host[r * slots + s] for r in range(sources)) for s in range(local_slots)]
    sizes_host = [(n + alignment - 1) // alignment * alignment for n in per_slot]
    total, padded_total = received.num_rows, sum(sizes_host)
    device = received.counts.device
    counts = received.counts.view(sources, slots)[:, :local_slots]
    sizes = (counts.sum(0) + alignment - 1) // alignment * alignment
    slot_start = torch.cumsum(sizes, 0) - sizes
    within = torch.cumsum(counts, 0) - counts  # rows from earlier sources in the same slot
    source_major_start = (torch.cumsum(received.counts, 0) - received.counts).view(sources, slots)[:, :local_slots]
    delta = (slot_start.unsqueeze(0) + within - source_major_start).reshape(-1)
    arange = torch.arange(total, device=device)
    destination = arange + torch.repeat_interleave(delta, counts.reshape(-1), output_size=total)
    index = torch.full((padded_total,), -1, dtype=torch.long, device=device)
    index[destination] = arange
    return index, destination, sizes, sizes_host


class ExpertCompute:
    """One fused experts module's local slots, computed on received rows (see the module docstring).

    Args:
        module: the experts module (its parameters hold this rank's slots; ``num_experts`` their count).
        alignment: pad each slot's expert-major group to a multiple of this many rows (Triton GEMM tiles).
        fused: regroup with the Triton kernels and always take the grouped-GEMM path.
    """

    def __init__(self, module: nn.Module, *, alignment: int = 1, fused: bool = False) -> None:
        self.module = module
        self.alignment = alignment
        self.fused = fused
        self._module_forward = type(module).forward  # the decorated forward: honours config._experts_implementation
        if fused:
            from ..dispatch import triton_kernels  # imported here: the interpreter flag is read at import

            self._kernels = triton_kernels

    @property
    def grouped(self) -> bool:
        """Whether the experts run as grouped GEMMs on expert-major rows (``grouped_mm`` or the Triton kernels)."""
        implementation = getattr(getattr(self.module, "config", None), "_experts_implementation", None)
        return self.fused or implementation == "grouped_mm"

    def __call__(self, rows: torch.Tensor, received: Received) -> torch.Tensor:
        """``[M, H]`` outputs of this rank's experts for the received ``rows [M, H]`` (same order), unit weights."""
        module = self.module
        if not self.grouped:
            unit = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return self._module_forward(module, rows, received.slot_of_rows().unsqueeze(1), unit)
        if received.sources == 1 and self.alignment == 1 and not self.fused:  # already expert-major
            return self.grouped_forward(rows, received.counts[: module.num_experts])
        index, destination, sizes, _ = regroup_index(received, module.num_experts, self.alignment)
        out = self.grouped_forward(self._gather(rows, index, destination), sizes)
        return self._gather(out, destination, index)

    def adapter_factors(self) -> list[tuple[str, nn.Parameter]]:
        """``(kind, parameter)`` of every factor an adapter adds to the projections, one row per local slot
        (none here; see :class:`hf_hybrid_ep.moe.lora.LoRAExpertCompute`)."""
        return []

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.adapter_factors()]

    def use_adapter_parameters(self, params: list[nn.Parameter]) -> None:
        """Hold ``params`` (in :meth:`adapter_factors` order) as the adapters' factors from now on (none here)."""
        if params:
            raise ValueError(f"{len(params)} adapter factors given to experts without adapters")

    def added_after(self) -> list[str]:
        """Adapters added to the module's wrappers after it was sharded, which it cannot compute (none here)."""
        return []

    def local(self, rows: torch.Tensor, slots: torch.Tensor, params: dict[str, nn.Parameter]) -> torch.Tensor:
        """``[n, H]``: the module's own experts implementation on ``rows`` routed to ``slots`` of ``params`` (local
        copies of other ranks' experts, in place of the module's parameters for this call), unit weights."""
        module = self.module
        saved, saved_count = {p: module._parameters[p] for p in params}, module.num_experts
        try:
            module._parameters.update(params)
            module.num_experts = next(iter(params.values())).shape[0]
            unit = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return self._module_forward(module, rows, slots.unsqueeze(1), unit)
        finally:
            module._parameters.update(saved)
            module.num_experts = saved_count

    def _gather(self, src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``src[index]``, differentiable; ``inverse`` its inverse. Padding (``index`` -1, with ``alignment`` > 1)
        reads zero rows: only the fused kernels pad (the torch path runs with alignment 1)."""
        if self.fused:
            return self._kernels.fused_gather_rows(src, index, inverse)
        return _PermuteRows.apply(src, index, inverse)

    # ------------------------------------------------------------------ grouped GEMMs
    def grouped_forward(self, rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """transformers' grouped-GEMM path of the module on expert-major ``rows`` whose local slot ``s`` owns
        ``sizes[s]`` consecutive rows (honouring the gate / bias / transposed / post-norm flags).

        Under ``torch.autocast`` with wider weights the GEMMs run in autocast's dtype, as ``F.linear`` does
        there: transformers' ``_grouped_linear`` casts its input to the weight dtype and is not autocast-aware,
        which would run them in fp32 (and on ATen's per-group fallback). Gradients reach the fp32 weights
        through the cast."""
        module = self.module
        compute = autocast_dtype(module.down_proj)
        if compute is not None:
            rows = rows.to(compute)
        offsets = torch.cumsum(sizes, 0).to(torch.int32)
        expert_of_row = None
        if module.has_bias:
            expert_of_row = torch.repeat_interleave(torch.arange(module.num_experts, device=rows.device), sizes,
                                                    output_size=rows.shape[0])
        out = self.linear(rows, "gate_up" if module.has_gate else "up", offsets, expert_of_row, compute)
        out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
        out = self.linear(out, "down", offsets, expert_of_row, compute)
        if module.has_post_expert_norm:
            out = module.post_expert_norm(out)
        return out

    def linear(self, x: torch.Tensor, projection: str, offsets: torch.Tensor, expert_of_row: torch.Tensor | None,
               compute: torch.dtype | None) -> torch.Tensor:
        """One grouped projection (``"gate_up"``, ``"up"`` or ``"down"``) of expert-major rows ``x [P, in]``:
        rows ``offsets[s-1]:offsets[s]`` through slot ``s``'s weight (and bias), in ``compute`` dtype when set.
        Returns ``[P, out]``. The extension point of adapters."""
        from transformers.integrations.moe import _grouped_linear

        module = self.module
        weight = getattr(module, f"{projection}_proj")
        bias = getattr(module, f"{projection}_proj_bias")[expert_of_row] if module.has_bias else None
        if compute is not None:
            weight = weight.to(compute)
            bias = None if bias is None else bias.to(compute)
        return _grouped_linear(x, weight, offsets, bias=bias, is_transposed=module.is_transposed)


def hybrid_ep_triton_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts implementation ``"hybrid_ep_triton"`` (single device): fused permute →
    transformers' grouped GEMM on expert-sorted rows → fused unpermute-combine."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from ..dispatch.triton_backend import triton_unavailable_reason
    from ..errors import HybridEPConfigError

    reason = triton_unavailable_reason(hidden_states.device.type)
    if reason is not None:
        raise HybridEPConfigError(f"experts implementation 'hybrid_ep_triton' cannot run: {reason}")
    from ..dispatch import triton_kernels

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
