"""Quantized tiny checkpoints, written the way the Hub's releases are, by quantizers this file defines.

* block-FP8 (DeepSeek-V3 / Qwen3 FP8 releases): every 2-D linear weight ``P.weight`` becomes float8
  plus ``P.weight_scale_inv``, one scale per ``bm × bn`` block, edge blocks clipped; the weight and
  scale dtypes rotate over the tensors (e4m3 / e5m2 weights; float32, bfloat16, e8m0 and uint8-e8m0
  scales) so that one checkpoint covers every combination;
* MXFP4 (GPT-OSS): the experts' ``gate_up_proj`` / ``down_proj`` become ``*_blocks`` ``[E, N, G, 16]``
  (two e2m1 values a byte, low nibble first) and ``*_scales`` ``[E, N, G]`` (e8m0 bytes), of the
  transposed ``[E, N, H]`` layout the GPT-OSS release stores.

The references (``reference_fp8``, ``reference_mxfp4``) dequantize block by block / byte by byte in
float32 and round once, as DeepSeek's ``weight_dequant`` does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_config, tiny_model_class

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu, torch.uint8)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def build(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny fp32 model of ``model_type``, its config changed by ``overrides``."""
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return tiny_model_class(model_type)._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def _scale_value(byte: int) -> float:
    return 2.0 ** (byte - 127)


def scale_float32(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: e8m0 bytes (uint8 or float8_e8m0fnu) through ``2 ** (b - 127)`` in Python."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        values = [_scale_value(int(b)) for b in scale.view(torch.uint8).flatten()]
        return torch.tensor(values, dtype=torch.float32).reshape(scale.shape)
    return scale.to(torch.float32)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], weight_dtype: torch.dtype,
                 scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` → float8 weight and scales ``[ceil(R/bm), ceil(C/bn)]``, block by block."""
    bm, bn = block
    rows, cols = w.shape
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    q = torch.empty(rows, cols, dtype=weight_dtype)
    scales = torch.empty(grid, dtype=torch.float32)
    codes = torch.empty(grid, dtype=torch.uint8)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            scale = max(float(part.abs().max()), 1e-12) / FP8_MAX[weight_dtype]
            if scale_dtype in (torch.float8_e8m0fnu, torch.uint8):
                codes[i, j] = math.ceil(math.log2(scale)) + 127
                scale = _scale_value(int(codes[i, j]))
            else:
                scale = float(torch.tensor(scale).to(scale_dtype))
            scales[i, j] = scale
            limit = FP8_MAX[weight_dtype]
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (part / scale).clamp(-limit, limit).to(weight_dtype)
    if scale_dtype == torch.uint8:
        return q, codes
    if scale_dtype == torch.float8_e8m0fnu:
        return q, codes.view(torch.float8_e8m0fnu)
    return q, scales.to(scale_dtype)


def reference_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's ``weight_dequant``: per block, float32(weight) × float32(scale), rounded once to ``dtype``."""
    bm, bn = block
    s = scale_float32(scale)
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            part = q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].to(torch.float32) * s[i, j]
            out[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = part.to(dtype)
    return out


def _is_quantized_linear(key: str, value: torch.Tensor) -> bool:
    """The keys transformers' FP8 quantizer makes FP8: ``nn.Linear`` weights, not the output embedding."""
    excluded = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
    return key.endswith(".weight") and value.dim() == 2 and not any(e in key for e in excluded)


def _write(directory: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    for old in directory.glob("*.safetensors*"):
        old.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def save_fp8(model: torch.nn.Module, directory: Path, block: tuple[int, int], *, rotate: bool = True,
             extra: dict[str, torch.Tensor] | None = None) -> dict[str, tuple]:
    """Save ``model`` as a block-FP8 checkpoint (plus ``extra`` keys, quantized the same way).

    Returns, for every quantized key, ``(float8 weight, scales)``; with ``rotate`` the weight and
    scale dtypes cycle over the keys, else e4m3 weights with float32 scales (DeepSeek's release)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    plain = {**load_file(directory / "model.safetensors"), **(extra or {})}
    out, quantized = {}, {}
    for i, key in enumerate(sorted(plain)):
        value = plain[key]
        if not _is_quantized_linear(key, value):
            out[key] = value
            continue
        dtypes = (WEIGHT_DTYPES[i % 2], SCALE_DTYPES[i % 4]) if rotate else WEIGHT_DTYPES[:1] + SCALE_DTYPES[:1]
        q, s = quantize_fp8(value, block, *dtypes)
        out[key], out[key + "_scale_inv"] = q, s
        quantized[key] = (q, s)
    _write(directory, out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(block)})
    return quantized


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPT-OSS expert tensor ``[E, H, N]`` (model layout) → blocks ``[E, N, H/32, 16]``, scales ``[E, N, H/32]``."""
    t = w.transpose(1, 2)
    experts, rows, width = t.shape
    groups = t.reshape(experts, rows, width // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.floor(torch.log2(amax)) - 2  # the largest e2m1 value is 6 = 1.5 · 2²
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte by byte: low nibble then high, each e2m1 value × 2^(s − 127) in float32, rounded once; transposed."""
    experts, rows, groups, half = blocks.shape
    values = torch.empty(experts, rows, groups, 2 * half, dtype=torch.float32)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    for k in range(half):
        byte = blocks[..., k].to(torch.int64)
        values[..., 2 * k] = lut[byte & 15]
        values[..., 2 * k + 1] = lut[byte >> 4]
    values *= scale_float32(scales)[..., None]
    return values.to(dtype).reshape(experts, rows, groups * 2 * half).transpose(1, 2).contiguous()


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def save_mxfp4(model: torch.nn.Module, directory: Path) -> dict[str, tuple]:
    """Save a GPT-OSS ``model`` as the release does: MXFP4 experts, the rest as is. Returns, for every
    expert tensor, ``(blocks, scales)``."""
    directory = Path(directory)
    model.save_pretrained(directory)
    out, quantized = {}, {}
    for key, value in load_file(directory / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(value)
            out[key + "_blocks"], out[key + "_scales"] = blocks, scales
            quantized[key] = (blocks, scales)
        else:
            out[key] = value
    _write(directory, out, MXFP4_CONFIG)
    return quantized
