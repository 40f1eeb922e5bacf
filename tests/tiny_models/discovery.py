"""Discovery: which transformers families use the experts decorator, and their config and model classes.

Scans ``transformers/models`` for ``@use_experts_implementation``, resolves the (text) config class that
holds the experts (following sub-configs of multimodal composites), the model class to build, and reads
attributes off config classes by canonical name (``attribute_map`` included). :class:`SkipModel` is the
one-line reason a family cannot be built tiny and offline.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

_MODELS_DIR = Path(transformers.__file__).parent / "models"
_DECORATOR = "@use_experts_implementation"


def _discover_decorated_model_types() -> list[str]:
    """Scan ``transformers/models/*/modeling_*.py`` for the experts decorator and return the directory names."""
    found: set[str] = set()
    for path in _MODELS_DIR.glob("*/modeling_*.py"):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if _DECORATOR in text:
            found.add(path.parent.name)
    return sorted(found)


DECORATED_MODEL_TYPES: list[str] = _discover_decorated_model_types()


class SkipModel(Exception):
    """Raised (with a one-line reason) when a model type cannot be built tiny and offline."""


_EXPERT_COUNT_NAMES = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
    "n_experts",
)


# --------------------------------------------------------------------------------------------------------------------
# config class resolution
# --------------------------------------------------------------------------------------------------------------------


def _check_model_type(model_type: str) -> None:
    if model_type not in DECORATED_MODEL_TYPES:
        raise ValueError(f"{model_type!r} is not a model type using {_DECORATOR} (see DECORATED_MODEL_TYPES)")


def _import_family_module(model_type: str, prefix: str) -> list[Any]:
    """Import every ``<prefix>_*.py`` module of a model directory."""
    modules = []
    for path in sorted((_MODELS_DIR / model_type).glob(f"{prefix}_*.py")):
        modules.append(importlib.import_module(f"transformers.models.{model_type}.{path.stem}"))
    return modules


@functools.cache
def _top_config_class(model_type: str) -> type[PretrainedConfig]:
    """The top-level config class of a model directory (the composite one for multimodal families)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    classes: list[type[PretrainedConfig]] = []
    for module in _import_family_module(model_type, "configuration"):
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, PretrainedConfig)
                and obj.__module__ == module.__name__
            ):
                classes.append(obj)
    if not classes:
        raise SkipModel(f"{model_type}: no configuration class found")
    # the composite is the class that is nobody's sub-config
    nested = {c for cls in classes for c in getattr(cls, "sub_configs", {}).values()}
    top = [c for c in classes if c not in nested]
    return (top or classes)[0]


def _fields(config_cls: type[PretrainedConfig]) -> set[str]:
    if dataclasses.is_dataclass(config_cls):
        return {f.name for f in dataclasses.fields(config_cls)}
    return set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}


def _resolve(default: PretrainedConfig, name: str) -> str | None:
    """Canonical attribute name for ``name`` on a config (following ``attribute_map``), or None if absent."""
    fields = _fields(type(default))
    if name in fields:
        return name
    mapped = getattr(type(default), "attribute_map", {}).get(name)
    if mapped is not None and mapped in fields:
        return mapped
    return None


def _experts_count_attr(default: PretrainedConfig) -> str | None:
    for name in _EXPERT_COUNT_NAMES:
        resolved = _resolve(default, name)
        if resolved is not None:
            return resolved
    return None


def _sub_config_names(config: PretrainedConfig) -> list[str]:
    names = [
        n
        for n in getattr(config, "sub_configs", {})
        if isinstance(getattr(config, n, None), PretrainedConfig)
    ]

    def rank(name: str) -> tuple[int, str]:
        if "text" in name:
            return (0, name)
        if "thinker" in name:
            return (1, name)
        if "talker" in name:
            return (3, name)
        return (2, name)

    return sorted(names, key=rank)


def _find_experts_path(config: PretrainedConfig) -> list[str] | None:
    """Path of sub-config attribute names from ``config`` to the config that owns the experts (depth first)."""
    if _experts_count_attr(config) is not None and not _sub_config_names(config):
        return []
    for name in _sub_config_names(config):
        sub_path = _find_experts_path(getattr(config, name))
        if sub_path is not None:
            return [name, *sub_path]
    if _experts_count_attr(config) is not None:
        return []
    return None


def _default_config(config_cls: type[PretrainedConfig]) -> PretrainedConfig:
    """Default instance whose (possibly per-layer) attributes can all be read globally."""
    default = config_cls()
    if hasattr(default, "allow_global_per_layer_attribute_access"):
        default.allow_global_per_layer_attribute_access = True
    return default


@functools.cache
def _experts_config_class(model_type: str) -> type[PretrainedConfig]:
    """Config class of the (text) model that holds the decorated experts."""
    top_cls = _top_config_class(model_type)
    top = _default_config(top_cls)
    path = _find_experts_path(top)
    if path is None:
        raise SkipModel(f"{model_type}: no config in {top_cls.__name__} defines a number of experts")
    config = top
    for name in path:
        config = getattr(config, name)
    return type(config)


# --------------------------------------------------------------------------------------------------------------------
# model classes and experts modules
# --------------------------------------------------------------------------------------------------------------------


def tiny_model_class(model_type: str) -> type[PreTrainedModel]:
    """The model class :func:`build_tiny_model` uses: causal LM if there is one, else the (text) base model."""
    _check_model_type(model_type)
    config_cls = _experts_config_class(model_type)
    candidates: list[type[PreTrainedModel]] = []
    for module in _import_family_module(model_type, "modeling"):
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, PreTrainedModel)
                and obj.__module__ == module.__name__
                and obj.config_class is config_cls
                and not obj.__name__.endswith("PreTrainedModel")
            ):
                candidates.append(obj)

    def rank(cls: type[PreTrainedModel]) -> tuple[int, str]:
        name = cls.__name__
        if name.endswith("ForCausalLM"):
            return (0, name)
        if name.endswith("TextModel"):
            return (1, name)
        if name.endswith("Model"):
            return (2, name)
        return (3, name)

    candidates = [c for c in candidates if rank(c)[0] < 3]
    if not candidates:
        raise SkipModel(f"{model_type}: no causal-LM / base model class for {config_cls.__name__}")
    return sorted(candidates, key=rank)[0]


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every ``@use_experts_implementation`` experts module in ``model``."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "_is_expert_parallel") and hasattr(module, "is_transposed")
    ]
