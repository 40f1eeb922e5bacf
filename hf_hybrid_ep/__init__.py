"""hf_hybrid_ep: hybrid expert parallelism for Hugging Face MoE models.

Dense weights are replicated and trained data-parallel on every rank; routed experts are sharded over
expert-parallel groups and reached by all-to-all. See README.md and docs/architecture.md.
"""

from .checkpoint import CheckpointError, export_checkpoint
from .checkpoint.lease import hold_output_dir
from .config import HybridEPConfig
from .dispatch import PlacementTable
from .engine import (
    ExpertFreezer,
    after_optimizer_step,
    clip_grad_norm_,
    comm_stats,
    eval_layout,
    full_state_dict,
    layer_counters,
    make_optimizer,
    no_sync,
    parallelize,
    record_routing,
    replay_routing,
    reset_comm_stats,
    shard_optimizer,
    state_of,
    wait_for_parameters,
)
from .errors import HybridEPConfigError, NonFiniteGradientError
from .hub import push_to_hub
from .inference.offload import cache_stats, load_offloaded, offload, resize_offload
from .inference.policies import ExpertCache
from .inference.stores import MemoryStore, SafetensorsStore
from .memory import memory_report
from .model_io.convert import convert_checkpoint
from .model_io.save import save_hybrid_checkpoint
from .moe.discovery import find_experts_modules, is_fused_experts
from .moe.experts import register_experts_implementation
from .parallel.mesh import HybridMesh, build_mesh
from .parallel.zero import ShardedOptimizer
from .pretrained import from_pretrained

register_experts_implementation()  # model.set_experts_implementation("hybrid_ep_triton")

__version__ = "0.1.0"


__all__ = [
    "build_mesh",
    "cache_stats",
    "CheckpointError",
    "clip_grad_norm_",
    "comm_stats",
    "convert_checkpoint",
    "ExpertCache",
    "ExpertFreezer",
    "eval_layout",
    "export_checkpoint",
    "find_experts_modules",
    "from_pretrained",
    "full_state_dict",
    "HybridEPConfig",
    "HybridEPConfigError",
    "hold_output_dir",
    "HybridMesh",
    "is_fused_experts",
    "layer_counters",
    "make_optimizer",
    "memory_report",
    "load_offloaded",
    "MemoryStore",
    "NonFiniteGradientError",
    "no_sync",
    "offload",
    "parallelize",
    "PlacementTable",
    "push_to_hub",
    "record_routing",
    "replay_routing",
    "reset_comm_stats",
    "save_hybrid_checkpoint",
    "resize_offload",
    "after_optimizer_step",
    "shard_optimizer",
    "ShardedOptimizer",
    "SafetensorsStore",
    "state_of",
    "wait_for_parameters",
]
