"""Find transformers' fused experts modules and read their storage format (no process group is touched).

A fused experts module is recognised structurally: transformers' ``use_experts_implementation``
decorator gives every instance the format flags ``has_gate``, ``has_bias``, ``is_transposed``,
``is_concatenated``, ``has_post_expert_norm`` and ``_is_expert_parallel``, and the module holds 3-D
parameters whose leading dimension is ``num_experts``. No class names are listed anywhere, so a new
model family usually needs nothing here (docs/architecture.md, "Where to add …").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import HybridEPConfigError

FORMAT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
# PEFT's names: a PeftModel holds the wrapped model under this prefix, a wrapper its wrapped module under this suffix.
PEFT_PREFIX = "base_model.model."
WRAPPER_SUFFIX = ".base_layer"


@dataclass(frozen=True)
class ExpertsFormat:
    """How one fused experts module stores its weights (the decorator's flags).

    Standard format: ``gate_up_proj [E, 2I, H]`` (gate then up), ``down_proj [E, H, I]``. Transposed
    (GPT-OSS): ``[E, H, 2I]`` / ``[E, I, H]``; not concatenated: gate and up interleaved along 2I.
    """

    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    has_post_expert_norm: bool

    @classmethod
    def of(cls, module: nn.Module) -> ExpertsFormat:
        return cls(**{flag: bool(getattr(module, flag)) for flag in FORMAT_FLAGS})


def is_fused_experts(module: nn.Module) -> bool:
    """True for an instance of a class decorated with transformers' ``use_experts_implementation``."""
    return all(hasattr(module, flag) for flag in (*FORMAT_FLAGS, "_is_expert_parallel"))


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """All fused experts modules of ``model``, as ``(qualified name, module)`` in module order."""
    return [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]


def _undecorated_expert_like(model: nn.Module) -> list[str]:
    """Class names of modules that look like experts but lack the decorator (for error messages)."""
    found = set()
    for m in model.modules():
        if "expert" in type(m).__name__.lower() and any(p.dim() == 3 for p in m.parameters(recurse=False)):
            found.add(type(m).__name__)
    return sorted(found)


def expert_parameter_names(name: str, module: nn.Module) -> list[str]:
    """Names of the per-expert parameters of ``module`` (direct parameters with leading dim ``num_experts``).

    Raises:
        HybridEPConfigError: when the module cannot be sharded (no integer ``num_experts``, a missing or
            non-3-D projection, a direct parameter or buffer without a leading expert dimension).
    """
    num_experts = getattr(module, "num_experts", None)
    cls = type(module).__name__
    if not isinstance(num_experts, int) or num_experts < 1:
        raise HybridEPConfigError(f"cannot shard {name} ({cls}): it has no integer attribute num_experts")
    fmt = ExpertsFormat.of(module)
    required = ["gate_up_proj" if fmt.has_gate else "up_proj", "down_proj"]
    params = dict(module.named_parameters(recurse=False))
    for req in required:
        p = params.get(req)
        if p is None or p.dim() != 3 or p.shape[0] != num_experts:
            shape = None if p is None else tuple(p.shape)
            raise HybridEPConfigError(
                f"cannot shard {name} ({cls}): expected a 3-D parameter {req!r} with leading dimension "
                f"num_experts={num_experts}, found shape {shape}"
            )
    for pname, p in params.items():
        if p.dim() == 0 or p.shape[0] != num_experts:
            raise HybridEPConfigError(
                f"cannot shard {name} ({cls}): parameter {pname!r} of shape {tuple(p.shape)} has no leading "
                f"expert dimension (num_experts={num_experts})"
            )
    for bname, b in module.named_buffers(recurse=False):
        if b is not None and b.dim() > 0 and b.shape[0] == num_experts:
            raise HybridEPConfigError(
                f"cannot shard {name} ({cls}): per-expert buffer {bname!r} (shape {tuple(b.shape)}) is not supported "
                "(quantized experts are not supported; load the model in a floating dtype)"
            )
    return list(params)


def check_shardable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the experts modules of ``model``, or raise before any work naming what is wrong."""
    found = find_experts_modules(model)
    if not found:
        extra = _undecorated_expert_like(model)
        hint = (
            f" It has expert-like modules {extra}, but their classes are not decorated with transformers' "
            "use_experts_implementation, so they cannot be sharded."
            if extra
            else ""
        )
        raise HybridEPConfigError(
            f"{type(model).__name__} has no routed experts (no transformers fused experts module).{hint}"
        )
    for name, module in found:
        expert_parameter_names(name, module)
    return found


def block_name(experts_name: str) -> str:
    """The MoE block holding the experts module ``experts_name``, above any PEFT wrappers of it (LoRA on the
    experts' parameters nests the module as ``experts.base_layer[.base_layer]``)."""
    while experts_name.endswith(WRAPPER_SUFFIX):
        experts_name = experts_name[: -len(WRAPPER_SUFFIX)]
    return experts_name.rpartition(".")[0]


def unwrapped_name(name: str) -> str:
    """``name`` without PEFT's wrapper components: the name in the model PEFT wrapped
    (``base_model.model.model.layers.0.mlp.experts.base_layer.base_layer`` → ``model.layers.0.mlp.experts``)."""
    name = name.removeprefix(PEFT_PREFIX)
    return ".".join(part for part in name.split(".") if part != WRAPPER_SUFFIX[1:])


def find_shared_expert(model: nn.Module, experts_name: str) -> tuple[nn.Module, nn.Module] | None:
    """The block and its shared expert (a child named ``shared_experts`` or ``shared_expert``), if any."""
    block = model.get_submodule(block_name(experts_name))
    for name in ("shared_experts", "shared_expert"):
        shared = getattr(block, name, None)
        if isinstance(shared, nn.Module):
            return block, shared
    return None
