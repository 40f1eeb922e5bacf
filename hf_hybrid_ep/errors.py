"""Every exception type hf_hybrid_ep raises on purpose (a leaf module: it imports nothing of the package).

Each is a subclass of the built-in error a caller would already catch (``ValueError`` for bad input,
``RuntimeError`` for a state that went wrong), and its message names the offending value, file or key.
"""

from __future__ import annotations


class HybridEPConfigError(ValueError):
    """A hybrid-EP configuration that cannot work; the message names the offending values."""


class CheckpointError(ValueError):
    """A checkpoint file, index or key that cannot be used; the message names it."""


class ReplicaDivergenceError(RuntimeError):
    """Replicas of a parameter differ; the message names the parameter and the ranks."""


class NonFiniteGradientError(FloatingPointError):
    """The global gradient norm was NaN or inf and the run is asked to stop (``on_nonfinite_grad="stop"``, or
    ``max_consecutive_skips`` steps skipped in a row); the message names the layers and the ranks."""


__all__ = ["CheckpointError", "HybridEPConfigError", "NonFiniteGradientError", "ReplicaDivergenceError"]
