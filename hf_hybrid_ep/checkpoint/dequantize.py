"""Dequantization of the Hub's quantized checkpoints, one tensor (or one expert) at a time.

The method comes from ``quantization_config`` in the source's ``config.json``. Two are read:

* ``fp8`` with ``weight_block_size: [bm, bn]`` (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8 releases): a
  weight ``P`` ``[..., R, C]`` in float8_e4m3fn or float8_e5m2 beside ``P_scale_inv`` ``[...,
  ceil(R/bm), ceil(C/bn)]`` (float32, bfloat16 or float16, or e8m0 exponents as float8_e8m0fnu or
  uint8). Element (r, c) is ``float32(w[r, c]) × float32(s[r // bm, c // bn])``, one float32 product
  rounded once to the output dtype: DeepSeek's reference ``weight_dequant``, with the block size
  from the config and the last block row and column clipped where R or C is not a multiple of it
  (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 = 4.5 × 128 rows). transformers' own CPU path
  derives the block size from the scale grid instead, which fails or assigns the wrong scales there.
* ``mxfp4`` (GPT-OSS): fused expert tensors ``P_blocks`` ``[E, N, G, 16]`` (uint8, two e2m1 values a
  byte, low nibble first: 32 values a group) and ``P_scales`` ``[E, N, G]`` (e8m0: the group's scale
  is ``2^(s − 127)``) become ``P`` ``[E, 32·G, N]``, the value ``float32(e2m1) × 2^(s − 127)``
  rounded once to the output dtype, transposed to the model's layout: exactly transformers'
  ``Mxfp4Config(dequantize=True)``.

The arithmetic is :mod:`hf_hybrid_ep.quant.formats` (shared with the weights kept quantized in memory).
Every other tensor (norms, embeddings, routers, biases, ``modules_to_not_convert``) passes through
unchanged. Any other method is refused naming it and what to do instead, as is a checkpoint whose
tensors do not fit the method (naming the tensor).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import CheckpointError
from ..quant.formats import (
    E8M0_DTYPES,
    FP8_SCALE_DTYPES,
    FP8_WEIGHT_DTYPES,
    MXFP4_GROUP,
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_scale_grid,
)
from .safetensors_io import TensorSpec

DEFAULT_DTYPE = torch.bfloat16
FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_BLOCKS_SUFFIX, MXFP4_SCALES_SUFFIX = "_blocks", "_scales"

_POST_TRAINING = ("convert the unquantized model it was made from instead (the base model its card names); "
                  "dequantizing it would train on its rounding error")
_PER_CHANNEL_FP8 = ("its FP8 scales are per tensor or per channel, not per block; load it with transformers' own "
                    "dequantization and save_pretrained it in bfloat16, or convert the unquantized release")
_REFUSALS = {
    "gptq": _POST_TRAINING, "awq": _POST_TRAINING, "aqlm": _POST_TRAINING, "vptq": _POST_TRAINING,
    "hqq": _POST_TRAINING, "eetq": _POST_TRAINING, "higgs": _POST_TRAINING, "spqr": _POST_TRAINING,
    "auto-round": _POST_TRAINING, "quark": _POST_TRAINING, "sinq": _POST_TRAINING,
    "bitsandbytes": ("convert the unquantized checkpoint it was made from (bitsandbytes is a load-time format: "
                     "pass a BitsAndBytesConfig when loading the converted one if you want it)"),
    "compressed-tensors": ("compressed-tensors keeps its scales in its own layout (weight_scale per tensor, per "
                           "channel or per group), which hf_hybrid_ep does not read; load it with transformers' own "
                           "decompression and save_pretrained it in bfloat16, or convert the unquantized release"),
    "fbgemm_fp8": _PER_CHANNEL_FP8,
}


@dataclass(frozen=True)
class Quantization:
    """A quantization method this module dequantizes: ``fp8`` (with its block) or ``mxfp4``."""

    method: str
    block: tuple[int, int] | None = None  # fp8: rows × columns of the weight one scale covers

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 block {self.block[0]}×{self.block[1]}"
        return f"mxfp4 (e2m1 values, one e8m0 scale per {MXFP4_GROUP})"

    def record(self, dtype: torch.dtype) -> dict[str, Any]:
        """What the converted checkpoint's index records of its source (``source.dequantized_from``)."""
        record: dict[str, Any] = {"quant_method": self.method, "description": self.describe(),
                                  "dtype": str(dtype).removeprefix("torch.")}
        if self.block is not None:
            record["weight_block_size"] = list(self.block)
        return record


def quantization_config_of(config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a transformers config or a config.json mapping, as a dict."""
    raw = config.get("quantization_config") if isinstance(config, Mapping) else getattr(
        config, "quantization_config", None)
    if raw is None:
        return None
    return raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)


def quantization_of(config: Any, where: str) -> Quantization | None:
    """The method the checkpoint of ``config`` is quantized with; ``None`` when it is not quantized.

    Raises:
        CheckpointError: naming ``where`` and the method, for one this module does not dequantize
            exactly (and what to do instead), or an ``fp8`` config without a usable block size.
    """
    qc = quantization_config_of(config)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        return Quantization("mxfp4")
    if method == "fp8":
        return Quantization("fp8", _fp8_block(qc, where))
    advice = _REFUSALS.get(method, "load it with transformers' own dequantization and save_pretrained it in "
                                   "bfloat16, or convert the unquantized release")
    strategy = _compressed_strategy(qc)
    raise CheckpointError(
        f"{where}: the checkpoint is quantized with {method or 'an unnamed method'!r}{strategy} "
        f"(config.json quantization_config.quant_method); hf_hybrid_ep dequantizes only block-FP8 ('fp8' with "
        f"weight_block_size) and MXFP4 ('mxfp4'): {advice}")


def _fp8_block(qc: dict[str, Any], where: str) -> tuple[int, int]:
    block = qc.get("weight_block_size")
    if block is None:
        raise CheckpointError(f"{where}: quantization_config 'fp8' has no weight_block_size (one scale per tensor); "
                              f"hf_hybrid_ep dequantizes block-FP8 only: {_PER_CHANNEL_FP8}")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                              f"got {block!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: quantization_config.activation_scheme {qc['activation_scheme']!r} (a "
                              "checkpoint with activation scales) is not read; block-FP8 is read with 'dynamic' "
                              "activations, as DeepSeek's and Qwen's releases have")
    return int(block[0]), int(block[1])


def _compressed_strategy(qc: dict[str, Any]) -> str:
    """`` (weights strategy 'channel')`` for a compressed-tensors config that names one."""
    for group in (qc.get("config_groups") or {}).values():
        strategy = ((group or {}).get("weights") or {}).get("strategy")
        if strategy:
            return f" (weights strategy {strategy!r})"
    return ""


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor of the dequantized checkpoint and the two source tensors it is made from."""

    name: str
    data: str  # fp8: the weight; mxfp4: the blocks
    scale: str


class RawTensors(Protocol):
    """Source tensors by key, as stored (a checkpoint's safetensors files)."""

    def spec(self, key: str) -> TensorSpec: ...

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor: ...


def pair_keys(quantization: Quantization | None, keys: Iterable[str]) -> dict[str, QuantizedTensor]:
    """The quantized tensors among a checkpoint's keys, by their dequantized name (names only).

    Raises:
        CheckpointError: naming a scale without its weight (or blocks without scales, and the reverse).
    """
    keys = set(keys)
    if quantization is None:
        return {}
    if quantization.method == "fp8":
        pairs = {k.removesuffix(FP8_SCALE_SUFFIX): k for k in keys if k.endswith(FP8_SCALE_SUFFIX)}
        for name, scale in sorted(pairs.items()):
            if name not in keys:
                raise CheckpointError(f"the checkpoint has the scales {scale!r} but not the weight {name!r}")
        return {name: QuantizedTensor(name, name, scale) for name, scale in pairs.items()}
    names = {k.removesuffix(s) for k in keys for s in (MXFP4_BLOCKS_SUFFIX, MXFP4_SCALES_SUFFIX) if k.endswith(s)}
    out = {}
    for name in sorted(names):
        blocks, scales = name + MXFP4_BLOCKS_SUFFIX, name + MXFP4_SCALES_SUFFIX
        if blocks not in keys or scales not in keys:
            present, absent = (blocks, scales) if blocks in keys else (scales, blocks)
            raise CheckpointError(f"the checkpoint has {present!r} but not {absent!r} (mxfp4 stores both)")
        out[name] = QuantizedTensor(name, blocks, scales)
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fp8_spec(tensor: QuantizedTensor, data: TensorSpec, scale: TensorSpec, block: tuple[int, int],
             dtype: torch.dtype) -> TensorSpec:
    """The dequantized spec of a block-FP8 weight, checking its dtype and its scale grid.

    Raises:
        CheckpointError: naming the tensor, its shape, the block and the grid it needs.
    """
    if data.dtype not in FP8_WEIGHT_DTYPES:
        raise CheckpointError(f"{tensor.data}: {_name(data.dtype)} beside the scales {tensor.scale!r}; block-FP8 "
                              "weights are float8_e4m3fn or float8_e5m2")
    if scale.dtype not in FP8_SCALE_DTYPES:
        raise CheckpointError(f"{tensor.scale}: scales in {_name(scale.dtype)}; block-FP8 scales are float32, "
                              "bfloat16, float16 or e8m0 (float8_e8m0fnu or uint8)")
    if len(data.shape) < 2:
        raise CheckpointError(f"{tensor.data}: a block-FP8 weight has at least two dimensions, got {data.shape}")
    grid = fp8_scale_grid(tuple(data.shape), block)
    if tuple(scale.shape) != grid:
        raise CheckpointError(
            f"{tensor.scale}: scale grid {tuple(scale.shape)} does not match the weight {tensor.data!r} "
            f"{tuple(data.shape)} in blocks of {block[0]}×{block[1]} (weight_block_size), which needs {grid}")
    return TensorSpec(tensor.name, dtype, tuple(data.shape))


def mxfp4_spec(tensor: QuantizedTensor, blocks: TensorSpec, scales: TensorSpec, dtype: torch.dtype) -> TensorSpec:
    """The dequantized spec ``[E, 32·G, N]`` of MXFP4 ``blocks [E, N, G, 16]`` and ``scales [E, N, G]``.

    Raises:
        CheckpointError: naming the tensor and the shapes or dtypes that do not fit.
    """
    half = MXFP4_GROUP // 2
    if blocks.dtype != torch.uint8 or len(blocks.shape) != 4 or blocks.shape[-1] != half:
        raise CheckpointError(f"{tensor.data}: {_name(blocks.dtype)} {tuple(blocks.shape)}; mxfp4 expert blocks are "
                              f"uint8 [experts, rows, groups, {half}]")
    if scales.dtype not in E8M0_DTYPES or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointError(f"{tensor.scale}: {_name(scales.dtype)} {tuple(scales.shape)} does not fit the blocks "
                              f"{tensor.data!r} {tuple(blocks.shape)}: mxfp4 scales are uint8 (e8m0) "
                              f"{tuple(blocks.shape[:-1])}")
    experts, rows, groups, _ = blocks.shape
    return TensorSpec(tensor.name, dtype, (experts, groups * MXFP4_GROUP, rows))


class Dequantizer:
    """A checkpoint's tensors as the dequantized checkpoint holds them: quantized pairs become one
    tensor in ``dtype`` (named like the weight: ``P`` for ``P`` + ``P_scale_inv``, ``P`` for
    ``P_blocks`` + ``P_scales``); every other key is itself.

    Args:
        quantization: the source's method (:func:`quantization_of`); ``None``: nothing to dequantize.
        keys: every key of the source checkpoint.
        dtype: of the dequantized tensors (other tensors keep theirs).
    """

    def __init__(self, quantization: Quantization | None, keys: Iterable[str],
                 dtype: torch.dtype = DEFAULT_DTYPE) -> None:
        keys = list(keys)
        self.quantization, self.dtype = quantization, dtype
        self.tensors = pair_keys(quantization, keys)
        consumed = {k for t in self.tensors.values() for k in (t.data, t.scale)}
        self.names = sorted({k for k in keys if k not in consumed} | set(self.tensors))

    def sources(self, name: str) -> tuple[str, ...]:
        """The source keys tensor ``name`` is read from."""
        tensor = self.tensors.get(name)
        return (name,) if tensor is None else (tensor.data, tensor.scale)

    def weight_map(self, source_map: Mapping[str, str]) -> dict[str, str]:
        """Each dequantized name → the file of its first source key."""
        return {name: source_map[self.sources(name)[0]] for name in self.names}

    def spec(self, name: str, raw_spec: Any) -> TensorSpec:
        """The spec of tensor ``name``; ``raw_spec(key)`` gives a source key's spec.

        Raises:
            CheckpointError: naming the tensor, when its source tensors do not fit the method.
        """
        tensor = self.tensors.get(name)
        if tensor is None:
            spec = raw_spec(name)
            if self.quantization is not None and self.quantization.method == "fp8" and spec.dtype in FP8_WEIGHT_DTYPES:
                raise CheckpointError(f"{name}: {_name(spec.dtype)} without the scales {name + FP8_SCALE_SUFFIX!r}")
            return spec
        data, scale = raw_spec(tensor.data), raw_spec(tensor.scale)
        if self.quantization.method == "fp8":
            return fp8_spec(tensor, data, scale, self.quantization.block, self.dtype)
        return mxfp4_spec(tensor, data, scale, self.dtype)

    def specs(self, raw_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Every tensor's spec, all source tensors checked (see :meth:`spec`)."""
        return {name: self.spec(name, raw_specs.__getitem__) for name in self.names}

    def chunks(self, spec: TensorSpec) -> list[slice | None]:
        """The row ranges tensor ``spec.name`` is read and written in: one expert (leading index) at a time
        for a dequantized tensor of three or more dimensions, else the whole tensor (``None``)."""
        if spec.name not in self.tensors or len(spec.shape) < 3:
            return [None]
        return [slice(i, i + 1) for i in range(spec.shape[0])]

    def read(self, raw: RawTensors, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (rows ``rows`` of its leading dimension, or all), dequantized if quantized.

        Raises:
            CheckpointError: naming the tensor, when its sources do not fit the method or the result
                is not finite (a NaN scale, or a value beyond the output dtype's range).
        """
        tensor = self.tensors.get(name)
        if tensor is None:
            return raw.read(name, rows)
        if len(self.spec(name, raw.spec).shape) < 3 and rows is not None:
            raise CheckpointError(f"{name}: rows of a two-dimensional quantized tensor have no scales of their own")
        data, scale = raw.read(tensor.data, rows), raw.read(tensor.scale, rows)
        if self.quantization.method == "fp8":
            wide = dequantize_fp8(data, scale, self.quantization.block)
        else:
            wide = dequantize_mxfp4(data, scale)
        out = wide.to(self.dtype).contiguous()
        if not bool(torch.isfinite(out).all()):
            cause = (f"values beyond the range of {_name(self.dtype)}: choose a wider dtype" if bool(
                torch.isfinite(wide).all()) else "NaN or infinite source values or scales (a corrupt checkpoint?)")
            raise CheckpointError(f"{name}: dequantizing {tensor.data!r} with {tensor.scale!r} gives {cause}")
        return out


def checkpoint_bytes(model: nn.Module, quantization: Quantization | None, expert_tensors: Collection[str],
                     skip: Iterable[str] = (), dtype: torch.dtype = DEFAULT_DTYPE) -> tuple[int, int]:
    """Bytes of the tensors of ``model`` (built on the meta device) in a checkpoint quantized with
    ``quantization``, and once dequantized; unquantized tensors take ``dtype`` in both.

    Quantized are the tensors transformers quantizes for the method: for ``fp8`` the weights of every
    ``nn.Linear`` and the experts' tensors (1 byte an element and a float32 scale a block), for
    ``mxfp4`` the experts' tensors (half a byte an element and one per 32); never those of the output
    embedding or of a module ``skip`` names (``modules_to_not_convert`` patterns). ``expert_tensors`` names the
    experts' tensors: the parameters of three dimensions of the model's experts modules. Dequantized tensors
    take bfloat16.
    """
    plain = dtype.itemsize
    if quantization is None:
        total = sum(p.numel() for p in model.parameters()) * plain
        return total, total
    output = model.get_output_embeddings()
    patterns = [*skip, *(n for n, m in model.named_modules() if output is not None and m is output)]
    quantized = set(expert_tensors)
    if quantization.method == "fp8":
        quantized |= {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    source = converted = 0
    for name, p in model.named_parameters():
        if name not in quantized or _skipped(name.rpartition(".")[0], patterns):
            source, converted = source + p.numel() * plain, converted + p.numel() * plain
            continue
        converted += p.numel() * DEFAULT_DTYPE.itemsize
        if quantization.method == "fp8":
            source += p.numel() + 4 * math.prod(fp8_scale_grid(tuple(p.shape), quantization.block))
        else:
            source += p.numel() // 2 + p.numel() // MXFP4_GROUP
    return source, converted


def _skipped(module: str, patterns: Iterable[str]) -> bool:
    """Whether ``module`` or a module containing it matches one of ``patterns`` (``*`` a wildcard)."""
    from fnmatch import fnmatchcase

    parts = module.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatchcase(prefix, pattern) for pattern in patterns for prefix in prefixes)
