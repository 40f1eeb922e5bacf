"""Frozen weights kept in their quantized checkpoint form (block-FP8, MXFP4) and the projections that
dequantize them just in time: the arithmetic (:mod:`.formats`), the in-memory holders (:mod:`.weights`),
the grouped expert projection and the PEFT-wrappable dense ``FP8Linear`` (:mod:`.linear`). Model-free: it
knows tensors and ``nn.Module``\\ s, not the model, process groups or checkpoint files.
"""

from .linear import FP8Linear, KeptQuantizedWeight, grouped_linear
from .weights import BlockFP8Weight, MXFP4Weight, QuantizedWeight

__all__ = ["BlockFP8Weight", "FP8Linear", "KeptQuantizedWeight", "MXFP4Weight", "QuantizedWeight", "grouped_linear"]
