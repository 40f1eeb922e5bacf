"""Tiny, randomly initialised transformers models for every ``@use_experts_implementation`` family.

Nothing is downloaded: configurations are built from the config classes' defaults, shrunk generically
(hidden size, heads, layers, vocabulary, experts, ...) and then fixed up per family where the generic
rules are not enough (hybrid layer patterns, MoE layer placement, multimodal composites, ...).

For multimodal composites only the text decoder (the part holding the decorated experts module) is built,
so :func:`tiny_config` returns the text sub-config for those families.

The package, by job:

- :mod:`tiny_models.discovery`: which families use the decorator; their config and model classes.
- :mod:`tiny_models.shrinking`: the generic overrides that make a default config tiny.
- :mod:`tiny_models.fixes`: per-family config fixes, and inputs that exercise every experts module.
- :mod:`tiny_models.build`: :func:`tiny_config`, :func:`build_tiny_model` and :func:`tiny_inputs`.
"""

from __future__ import annotations

from .build import build_tiny_model, tiny_config, tiny_inputs
from .discovery import DECORATED_MODEL_TYPES, SkipModel, experts_modules, tiny_model_class

__all__ = [
    "DECORATED_MODEL_TYPES",
    "SkipModel",
    "build_tiny_model",
    "experts_modules",
    "tiny_config",
    "tiny_inputs",
    "tiny_model_class",
]
