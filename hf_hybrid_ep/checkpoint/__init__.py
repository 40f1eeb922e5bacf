"""Expert-sharded safetensors checkpoints that stay ordinary Hugging Face checkpoints: the file format, read and
written without a model (:mod:`hf_hybrid_ep.model_io` puts a model into them and reads it back)."""

from .format import CheckpointIndex, HybridEPMetadata, read_index
from .manifest import verify_checksums
from .rewrite import export_checkpoint
from .safetensors_io import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "HybridEPMetadata",
    "export_checkpoint",
    "read_index",
    "verify_checksums",
]
