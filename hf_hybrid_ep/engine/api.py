"""What the layers above the engine read of a parallelized model, by name: its config, its mesh, its EP layers.

The engine's state stays inside ``engine/`` (:mod:`.state`); model I/O, inference and the integrations ask these
functions instead of reaching into it. Each raises ``ValueError`` naming the model's class for a model
:func:`hf_hybrid_ep.parallelize` did not prepare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .state import is_parallelized, state_of

if TYPE_CHECKING:
    from ..config import HybridEPConfig
    from ..moe.layer import ShardedExperts
    from ..parallel.mesh import HybridMesh


def config_of(model: nn.Module) -> HybridEPConfig:
    """The config ``model`` was parallelized with."""
    return state_of(model).config


def mesh_of(model: nn.Module) -> HybridMesh:
    """The dp × ep mesh ``model`` runs over: its process groups and this rank's place in them."""
    return state_of(model).mesh


def expert_layers(model: nn.Module) -> list[ShardedExperts]:
    """The EP layers of ``model`` (one per experts module), in model order."""
    return state_of(model).layers


__all__ = ["config_of", "expert_layers", "is_parallelized", "mesh_of"]
