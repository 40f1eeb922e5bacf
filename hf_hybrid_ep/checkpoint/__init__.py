"""Expert-sharded safetensors checkpoints that stay ordinary Hugging Face checkpoints."""

from .convert import convert_checkpoint, export_checkpoint
from .format import CheckpointIndex, HybridEPMetadata, read_index
from .manifest import verify_checksums
from .safetensors_io import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "HybridEPMetadata",
    "convert_checkpoint",
    "export_checkpoint",
    "read_index",
    "verify_checksums",
]
