"""Integrations with the Hugging Face training stack (Accelerate, the Trainer and its subclasses, TRL)."""

from ..model_io.save import save_hybrid_checkpoint
from .accelerator import load_state, prepare_accelerator, save_state
from .plugin import HybridEPPlugin
from .trainer import HybridEP

__all__ = ["HybridEP", "HybridEPPlugin", "load_state", "prepare_accelerator", "save_hybrid_checkpoint", "save_state"]
