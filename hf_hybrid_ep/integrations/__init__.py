"""Integrations with the Hugging Face training stack (Accelerate, Trainer)."""

from ..checkpoint.save import save_hybrid_checkpoint
from .accelerator import load_state, prepare_accelerator, save_state
from .plugin import HybridEPPlugin
from .trainer import HybridEPTrainer

__all__ = ["HybridEPPlugin", "HybridEPTrainer", "load_state", "prepare_accelerator", "save_hybrid_checkpoint", "save_state"]
