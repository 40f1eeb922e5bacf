"""State that vanilla transformers has no place for, in a namespaced side file next to the weights.

``hybrid_ep_state.safetensors`` holds, per MoE layer, the selection-only bias of aux-loss-free
balancing on routers without a native correction bias (``<experts module>.selection_bias``). It is
not in the weight index, so vanilla ``from_pretrained`` ignores it; ``export`` drops it and says so.
Routers with a native correction bias (DeepSeek-V3, GLM-4) keep it in the weights themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from ..checkpoint.format import SIDE_FILE
from ..checkpoint.manifest import CheckpointVerifier, save_metadata
from ..engine import expert_layers


def _biased_layers(model: nn.Module) -> list:

    return [layer for layer in expert_layers(model)
            if layer.controls is not None and layer.controls.selection_bias is not None]


def save_side_state(model: nn.Module, directory: str | os.PathLike[str], save_id: str | None = None) -> Path | None:
    """Write the side file (call on one rank; the state is identical on every rank), tagged with the
    save id of the checkpoint it belongs to."""
    layers = _biased_layers(model)
    if not layers:
        return None
    path = Path(directory) / SIDE_FILE
    tmp = path.with_name(f".{SIDE_FILE}.tmp")
    save_file({f"{layer.name}.selection_bias": layer.controls.selection_bias.contiguous() for layer in layers},
              tmp, metadata={**save_metadata(save_id), "namespace": "hf_hybrid_ep"})
    tmp.replace(path)
    return path


def load_side_state(model: nn.Module, directory: str | os.PathLike[str],
                    verifier: CheckpointVerifier | None = None) -> list[str]:
    """Load the side file if present (checked by ``verifier`` first); return the keys restored."""
    path = Path(directory) / SIDE_FILE
    if not path.is_file():
        return []
    if verifier is not None:
        verifier.check(SIDE_FILE, path)
    tensors = load_file(path)
    restored = []
    for layer in _biased_layers(model):
        key = f"{layer.name}.selection_bias"
        if key in tensors:
            layer.controls.selection_bias.copy_(tensors[key])
            restored.append(key)
    return restored
