"""Integrations with the Hugging Face training stack (Accelerate, Trainer)."""

from .trainer import HybridEPTrainer, save_hybrid_checkpoint

__all__ = ["HybridEPTrainer", "save_hybrid_checkpoint"]
