"""The orchestration layer: ``parallelize`` wires the layers below into a training engine (:mod:`.setup`),
attaches its state (:mod:`.state`) and runs it at every step (:mod:`.step`, :mod:`.backward`); model-level
entry points for gradients, optimizers, replicas, the unsharded model and counters. See
docs/architecture.md."""

from .api import config_of, expert_layers, is_parallelized, mesh_of
from .eval_layout import eval_layout
from .freeze import ExpertFreezer
from .gradients import clip_grad_norm_, no_sync
from .model_io import full_state_dict
from .optimizers import make_optimizer, shard_optimizer, wait_for_parameters
from .replicas import verify_model_replicas
from .routing_replay import RoutingRecord, record_routing, replay_routing
from .setup import parallelize
from .state import state_of
from .stats import comm_stats, layer_counters, reset_comm_stats
from .step import after_optimizer_step

__all__ = [
    "RoutingRecord",
    "record_routing",
    "replay_routing",
    "ExpertFreezer",
    "after_optimizer_step",
    "clip_grad_norm_",
    "comm_stats",
    "config_of",
    "eval_layout",
    "expert_layers",
    "full_state_dict",
    "is_parallelized",
    "layer_counters",
    "make_optimizer",
    "mesh_of",
    "no_sync",
    "parallelize",
    "reset_comm_stats",
    "shard_optimizer",
    "state_of",
    "verify_model_replicas",
    "wait_for_parameters",
]
