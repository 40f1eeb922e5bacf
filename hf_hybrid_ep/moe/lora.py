"""LoRA on sharded experts: PEFT's expert adapters computed on the rows this rank's experts receive.

PEFT reaches fused experts with ``LoraConfig(target_parameters=[...])``: one ``ParamWrapper`` per targeted
parameter, nested (the innermost wraps the parameter the experts module registers first), each holding
``lora_A [r·E, in]`` (expert-major rows: ``A_e = A[e·r:(e+1)·r]``) and ``lora_B [out, r·E]`` (the expert
index fastest: ``B_e = B[:, e::E]``). On every forward it parametrizes the experts' weight to
``W + scaling · B_e A_e`` for all E experts (transposed for experts stored ``[E, in, out]``). Under hybrid EP:

* the factors of this rank's slots replace PEFT's, in slot-major layout — ``A [S, r, in]`` and
  ``B [S, out, r]``, one row per local slot like the expert weights, so the gradient reducer, the global
  norm, the optimizer-state files and the freezer treat them as expert tensors — as new parameters of
  the wrapper's own ``lora_A`` / ``lora_B`` modules (the model's parameter names stay PEFT's);
  :func:`slots_from_peft` / :func:`peft_from_slots` convert between the two layouts;
* the wrappers' forward goes straight to the experts module, and :class:`LoRAExpertCompute` adds
  ``scaling · (x·A_sᵀ)·B_sᵀ`` to each grouped projection of the received rows (two rank-r grouped GEMMs;
  ``W + ΔW`` is never formed), which equals PEFT's effective weight in either storage layout;
* merging adds ``scaling · B_s A_s`` to the local slots only.

Nothing here imports PEFT: a wrapper is recognised by what it holds (``parameter_name``, ``lora_A``,
``lora_B``, ``base_layer``).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..errors import HybridEPConfigError
from .discovery import WRAPPER_SUFFIX
from .experts import ExpertCompute
from .layer import ShardedExperts

ADAPTABLE = ("gate_up_proj", "up_proj", "down_proj")  # the experts' weight matrices
# LoRA targets where a training run or a plan names none: the attention projections (replicated, trained
# data-parallel) and the routed experts' weight matrices (sharded with their experts).
DEFAULT_LORA_TARGETS = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def is_param_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT ``ParamWrapper`` (LoRA on one parameter of the module it wraps)."""
    return all(hasattr(module, a) for a in ("parameter_name", "lora_A", "lora_B", "base_layer", "scaling"))


def expert_wrappers(model: nn.Module, name: str, module: nn.Module) -> dict[str, nn.Module]:
    """The PEFT wrappers above the experts module ``name`` of ``model``, by the parameter each adapts."""
    wrappers: dict[str, nn.Module] = {}
    while name.endswith(WRAPPER_SUFFIX):
        name = name[: -len(WRAPPER_SUFFIX)]
        parent = model.get_submodule(name)
        if not is_param_wrapper(parent):
            break
        wrappers[parent.parameter_name] = parent
    return wrappers


def slots_from_peft(tensor: torch.Tensor, kind: str, num_experts: int, slots: list[int]) -> torch.Tensor:
    """PEFT's factor of ``num_experts`` experts (``"A"``: ``[r·E, in]``, ``"B"``: ``[out, r·E]``) as the
    slot-major rows of the experts ``slots`` (``[S, r, in]`` / ``[S, out, r]``)."""
    index = torch.tensor(slots, dtype=torch.long, device=tensor.device)
    if kind == "A":
        return tensor.reshape(num_experts, -1, tensor.shape[-1])[index]
    return tensor.reshape(tensor.shape[0], -1, num_experts).permute(2, 0, 1)[index]


def peft_from_slots(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """Slot-major rows of every expert in global order (``[E, r, in]`` / ``[E, out, r]``) in PEFT's layout."""
    experts = tensor.shape[0]
    if kind == "A":
        return tensor.reshape(experts * tensor.shape[1], tensor.shape[2])
    return tensor.permute(1, 2, 0).reshape(tensor.shape[1], tensor.shape[2] * experts)


def check_expert_adapters(name: str, module: nn.Module, wrappers: dict[str, nn.Module]) -> None:
    """Refuse expert adapters this engine cannot train faithfully, naming the module and the setting.

    Raises:
        HybridEPConfigError: LoRA on a parameter other than the experts' weight matrices, DoRA or another
            LoRA variant, dropout or a bias on the adapter, or factors that do not cover the module's experts.
    """
    for pname, wrapper in wrappers.items():
        where = f"LoRA on {name}.{pname}"
        if pname not in ADAPTABLE:
            raise HybridEPConfigError(f"{where}: only the experts' weight matrices {ADAPTABLE} can be adapted")
        for adapter in wrapper.lora_A:
            if wrapper.use_dora.get(adapter) or adapter in getattr(wrapper, "lora_variant", {}):
                raise HybridEPConfigError(f"{where}: adapter {adapter!r} is a LoRA variant (DoRA); only plain LoRA "
                                          "is supported on experts")
            if not isinstance(wrapper.lora_dropout[adapter], nn.Identity):
                raise HybridEPConfigError(f"{where}: adapter {adapter!r} has lora_dropout; dropout cannot be "
                                          "factored out of an expert adapter (PEFT refuses it too)")
            if wrapper.lora_bias.get(adapter) or wrapper.lora_B[adapter].bias is not None:
                raise HybridEPConfigError(f"{where}: adapter {adapter!r} has lora_bias; not supported on experts")
            a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
            r, experts = wrapper.r[adapter], module.num_experts
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r * experts or b.shape[1] != r * experts:
                raise HybridEPConfigError(
                    f"{where}: adapter {adapter!r} has factors {tuple(a.shape)} / {tuple(b.shape)}, not those of "
                    f"{experts} experts at rank {r}; apply PEFT to the whole model before parallelize")


def _bypass(experts: nn.Module):
    """A wrapper's forward under hybrid EP: straight to the experts module, whose compute adds the adapters."""

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("LoRA on sharded experts does not support mixed adapter batches (adapter_names)")
        return experts(x, *args, **kwargs)

    return forward


def _local_delta(wrapper: nn.Module, transposed: bool):
    """A wrapper's ``get_delta_weight`` under hybrid EP: ``scaling · B_s A_s`` for this rank's slots, in the
    stored layout of the experts' weight (what PEFT's merge adds to it)."""

    def get_delta_weight(self, adapter: str, *args, **kwargs) -> torch.Tensor:
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        delta = torch.bmm(b, a) * self.scaling[adapter]  # [S, out, in]
        if transposed:
            delta = delta.transpose(1, 2)
        param = self.get_param()
        return delta.to(param.device, param.dtype)

    return types.MethodType(get_delta_weight, wrapper)


def shard_expert_adapters(module: nn.Module, wrappers: dict[str, nn.Module], slots: list[int], num_experts: int
                          ) -> None:
    """Replace every adapter's factors of ``wrappers`` by fresh parameters holding only ``slots`` (global
    expert ids, in local-slot order), slot-major; route the wrappers' forward to ``module``."""
    for wrapper in wrappers.values():
        for adapter in list(wrapper.lora_A):
            for kind, linear in (("A", wrapper.lora_A[adapter]), ("B", wrapper.lora_B[adapter])):
                full = linear.weight
                local = slots_from_peft(full.detach(), kind, num_experts, slots).clone()
                linear.weight = nn.Parameter(local, requires_grad=full.requires_grad)
        wrapper.num_experts = len(slots)
        wrapper.forward = _bypass(module)
        wrapper.get_delta_weight = _local_delta(wrapper, bool(module.is_transposed))


class LoRAExpertCompute(ExpertCompute):
    """:class:`ExpertCompute` with LoRA on the experts' projections: each grouped projection of expert-major
    rows ``x`` gains ``scaling · (x·A_sᵀ)·B_sᵀ`` per active adapter (two grouped GEMMs of rank r, in the
    base projection's dtype as PEFT's effective weight is), nothing while the adapters are disabled or
    merged. Always the grouped-GEMM path (the module's own experts implementation would miss the adapters).

    Args:
        module: the experts module (this rank's slots).
        wrappers: the PEFT wrappers above it, by parameter name, their factors slot-major
            (:func:`shard_expert_adapters`).
    """

    def __init__(self, module: nn.Module, wrappers: dict[str, nn.Module], *, alignment: int = 1,
                 fused: bool = False) -> None:
        super().__init__(module, alignment=alignment, fused=fused)
        self.wrappers = wrappers

    @property
    def grouped(self) -> bool:
        return True

    def _factor_holders(self) -> list[tuple[str, nn.Module]]:
        """``(kind, linear)`` of every adapter factor, in :meth:`adapter_factors` order: the module whose
        ``weight`` it is."""
        return [(kind, holder[adapter]) for wrapper in self.wrappers.values() for adapter in wrapper.lora_A
                for kind, holder in (("A", wrapper.lora_A), ("B", wrapper.lora_B))]

    def adapter_factors(self) -> list[tuple[str, nn.Parameter]]:
        """``(kind, parameter)`` of every adapter factor: ``"A"`` ``[S, r, in]`` or ``"B"`` ``[S, out, r]``."""
        return [(kind, linear.weight) for kind, linear in self._factor_holders()]

    def use_adapter_parameters(self, params: list[nn.Parameter]) -> None:
        """Hold ``params`` (in :meth:`adapter_factors` order, slot-major, ``S'`` rows each) as the factors from now
        on: the slots of another layout (:func:`hf_hybrid_ep.engine.eval_layout.eval_layout`)."""
        for (_, linear), p in zip(self._factor_holders(), params, strict=True):
            linear.weight = p
        for wrapper in self.wrappers.values():
            if wrapper.lora_A:
                wrapper.num_experts = next(iter(wrapper.lora_A.values())).weight.shape[0]

    def added_after(self) -> list[str]:
        """Adapters PEFT added to the wrappers after parallelize (their factors are not slot-major)."""
        return sorted({a for w in self.wrappers.values() for a in w.lora_A if w.lora_A[a].weight.dim() != 3})

    def linear(self, x: torch.Tensor, projection: str, offsets: torch.Tensor, expert_of_row: torch.Tensor | None,
               compute: torch.dtype | None) -> torch.Tensor:
        from transformers.integrations.moe import _grouped_linear

        out = super().linear(x, projection, offsets, expert_of_row, compute)
        wrapper = self.wrappers.get(f"{projection}_proj")
        if wrapper is None or wrapper.disable_adapters or wrapper.merged:
            return out
        dtype = compute or getattr(self.module, f"{projection}_proj").dtype
        for adapter in wrapper.active_adapters:
            if adapter not in wrapper.lora_A:
                continue
            a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
            if a.dim() != 3:
                raise HybridEPConfigError(
                    f"adapter {adapter!r} on {wrapper.parameter_name} was added after parallelize; add every "
                    "adapter to the model before hf_hybrid_ep.parallelize")
            a, b = _aligned_rank(a.to(dtype), b.to(dtype))
            low = _grouped_linear(x, a, offsets)
            out = out + _grouped_linear(low, b, offsets) * wrapper.scaling[adapter]
        return out


def _aligned_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``A [S, r, in]`` / ``B [S, out, r]`` with the rank zero-padded to a multiple of 16 bytes, as
    ``torch._grouped_mm`` requires of every stride (``r = 2`` in fp32 would be refused); the padding adds exact
    zeros, and gradients reach the unpadded factors only."""
    pad = -a.shape[1] % (16 // a.element_size())
    if pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))
        b = torch.nn.functional.pad(b, (0, pad))
    return a, b


def attach_expert_adapters(layer: ShardedExperts, wrappers: dict[str, nn.Module], over_slots: bool = False) -> None:
    """Train PEFT's adapters of ``layer``'s experts (already sharded) under hybrid EP: their factors sharded
    to the layer's slots (:func:`shard_expert_adapters`), computed by :class:`LoRAExpertCompute`. PEFT's factors
    are over all experts, or (``over_slots``: PEFT wrapped the sharded module) over this rank's slots."""
    slots = len(layer.local_experts)
    if over_slots:
        shard_expert_adapters(layer.module, wrappers, list(range(slots)), slots)
    else:
        shard_expert_adapters(layer.module, wrappers, list(layer.local_experts), layer.num_experts)
    current = layer.experts
    layer.use_compute(LoRAExpertCompute(layer.module, wrappers, alignment=current.alignment, fused=current.fused))


def detach_expert_adapters(layer: ShardedExperts) -> None:
    """The layer's experts computed without adapters again (after PEFT unloaded its wrappers)."""
    current = layer.experts
    layer.use_compute(ExpertCompute(layer.module, alignment=current.alignment, fused=current.fused))
