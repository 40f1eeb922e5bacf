"""Building: tiny configs, tiny models and their inputs (the public API re-exported by :mod:`tiny_models`).

:func:`tiny_config` finds the family's experts config class (:mod:`tiny_models.discovery`), shrinks its
defaults (:mod:`tiny_models.shrinking`) and applies the family's fixes (:mod:`tiny_models.fixes`);
:func:`build_tiny_model` instantiates it and checks that the experts are there; :func:`tiny_inputs`
draws a text batch for it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import PretrainedConfig

from .discovery import (
    SkipModel,
    _check_model_type,
    _default_config,
    _experts_config_class,
    _experts_count_attr,
    experts_modules,
    tiny_model_class,
)
from .fixes import _ALL_EXPERTS_INPUTS, _FIXES
from .shrinking import _generic_overrides, _Shrink


def tiny_config(
    model_type: str,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    num_layers: int = 2,
    hidden: int = 64,
    seed: int | None = None,
) -> PretrainedConfig:
    """Build a tiny config for ``model_type`` (a directory name in ``transformers.models``).

    For multimodal composites this is the text sub-config (the one whose model holds the experts), i.e. always the
    config that :func:`build_tiny_model` instantiates. ``seed`` is accepted for API symmetry; building a config is
    deterministic. ZAYA only supports one expert per token, so ``top_k`` is ignored (forced to 1) for ``zaya``.
    """
    del seed
    _check_model_type(model_type)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > num_experts={num_experts}")
    config_cls = _experts_config_class(model_type)
    default = _default_config(config_cls)
    shrink = _Shrink(model_type, num_experts, top_k, num_layers, hidden)
    overrides = _generic_overrides(default, shrink)
    for fix in _FIXES.get(model_type, []):
        fix(overrides, default, shrink)
    try:
        config = config_cls(**overrides)
    except Exception as exc:
        raise RuntimeError(f"{model_type}: {config_cls.__name__}(**{overrides}) failed: {exc}") from exc
    return config


def _check_experts(model_type: str, model: torch.nn.Module, num_experts: int) -> None:
    found = experts_modules(model)
    if not found:
        raise SkipModel(f"{model_type}: the tiny model contains no decorated experts module")
    for name, module in found:
        params = dict(module.named_parameters(recurse=False))
        if not any(p.dim() == 3 for p in params.values()):
            raise SkipModel(f"{model_type}: experts module {name} has no 3-D parameters")
        # 3-D weights and 2-D biases are all per expert
        bad = {k: tuple(p.shape) for k, p in params.items() if p.dim() >= 2 and p.shape[0] != num_experts}
        if bad:
            raise SkipModel(f"{model_type}: experts module {name} does not hold {num_experts} experts: {bad}")


def build_tiny_model(model_type: str, **kw: Any) -> torch.nn.Module:
    """Build a tiny fp32 model (eager attention, eval mode) for ``model_type``.

    Keyword arguments are those of :func:`tiny_config`. The weights are initialised from the global torch RNG (or
    from ``seed`` when given), so two builds after the same ``torch.manual_seed`` are identical.
    """
    seed = kw.get("seed")
    config = tiny_config(model_type, **kw)
    num_experts = getattr(config, _experts_count_attr(config) or "num_experts")
    model_cls = tiny_model_class(model_type)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    except ImportError as exc:  # a kernel / optional package the family insists on
        raise SkipModel(
            f"{model_type}: {model_cls.__name__} needs a package that is not installed: {exc}"
        ) from exc
    model = model.float().eval()
    _check_experts(model_type, model, num_experts)
    return model


def _is_causal_lm(model: torch.nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM")


def tiny_inputs(
    model: torch.nn.Module,
    batch: int,
    seq: int,
    generator: torch.Generator,
    *,
    exercise_all_experts: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs)`` running a plain text forward (``labels`` for causal LMs).

    Token ids are drawn from ``[3, vocab_size)`` with ``generator`` (ids 0-2 are the tiny pad/bos/eos ids).
    With ``exercise_all_experts=True``, families whose layers hold several experts modules selected by token
    modality (ERNIE-4.5-VL: text and vision experts) also get modality ids that route the second half of every
    sequence to the non-text experts, so that every experts module runs forward and backward.
    """
    config = model.config
    vocab = int(config.vocab_size)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    inputs: dict[str, Any] = {"input_ids": input_ids}
    if exercise_all_experts:
        extra = _ALL_EXPERTS_INPUTS.get(_model_type_of(model))
        if extra is not None:
            inputs.update(extra(input_ids))
    if _is_causal_lm(model):
        inputs["labels"] = input_ids.clone()
    return inputs


def _model_type_of(model: torch.nn.Module) -> str:
    module = type(model).__module__
    match = re.match(r"transformers\.models\.([^.]+)\.", module)
    return match.group(1) if match else ""
