"""The hybrid-EP checkpoint format: a standard Hugging Face checkpoint directory plus metadata.

Layout of a converted directory (keys keep the source's format and use **global** expert ids)::

    config.json, generation_config.json, tokenizer files ...      copied from the source
    model.safetensors.index.json                                 weight_map + metadata.hybrid_ep
    model-dense-00001-of-0000D.safetensors                       dense tensors (size-capped shards)
    model-experts-rank000-of-004.safetensors                     per-expert keys of EP rank 0 ...
    model-experts-fused-00001-of-0000F.safetensors               fused [E, ...] expert tensors, whole

Vanilla ``from_pretrained`` reads it like any sharded checkpoint. A rank of a hybrid-EP run reads the
dense files, its own ``rank`` file (per-expert families) or its slice of the fused tensors.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .safetensors_io import TensorSpec, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FORMAT_VERSION = 2  # 2: ``placement`` may be per layer; 1 (one table for every layer) still loads
READABLE_VERSIONS = (1, 2)
OPTIMIZER_TENSORS_NAME = "optimizer.safetensors"  # a Trainer checkpoint's optimizer state (model_io.optimizer_state)
OPTIMIZER_META_NAME = "optimizer.json"
SIDE_FILE = "hybrid_ep_state.safetensors"  # state vanilla transformers has no place for (model_io.side_state)
# What a Trainer checkpoint holds besides the model: the optimizer state above and the Trainer's own files
# (transformers.trainer's TRAINER_STATE_NAME, TRAINING_ARGS_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME,
# rng_state*.pth) — never part of a plain model directory.
TRAINING_STATE = re.compile(r"^(trainer_state\.json|training_args\.bin|optimizer\.(json|safetensors|pt)|scheduler\.pt"
                            r"|scaler\.pt|rng_state(_\d+)?\.pth)$")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")  # weight files, any format
PER_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<rest>.+)$")


def format_bytes(n: float) -> str:
    """A size in decimal units, three significant digits: ``689 GB``, ``1.34 TB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def dense_file(i: int, n: int) -> str:
    return f"model-dense-{i:05d}-of-{n:05d}.safetensors"


def rank_file(rank: int, ep: int) -> str:
    return f"model-experts-rank{rank:03d}-of-{ep:03d}.safetensors"


def fused_file(i: int, n: int) -> str:
    return f"model-experts-fused-{i:05d}-of-{n:05d}.safetensors"


@dataclass
class FileInfo:
    """One weight file of a hybrid-EP checkpoint: its role, size and checksum."""

    role: str  # "dense" | "experts" | "fused"
    bytes: int
    sha256: str
    ep_rank: int | None = None


@dataclass
class HybridEPMetadata:
    """The ``hybrid_ep`` block of ``model.safetensors.index.json``."""

    ep_degree: int
    num_experts: int
    num_moe_layers: int
    storage: str  # "per_expert" | "fused"
    # one table (rows over EP ranks) for every MoE layer, or per layer: experts module name -> rows
    placement: list[list[int]] | dict[str, list[list[int]]]
    dtype: str
    source: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileInfo] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def per_layer(self) -> bool:
        return isinstance(self.placement, dict)

    def layer_rows(self, layer: str) -> list[list[int]]:
        """The placement table (rows over EP ranks) of MoE layer ``layer`` (its experts module's name)."""
        if not self.per_layer:
            return self.placement
        if layer not in self.placement:
            raise CheckpointError(f"the checkpoint's per-layer placement has no layer {layer!r}; it has "
                                  f"{sorted(self.placement)}")
        return self.placement[layer]

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> HybridEPMetadata:
        try:
            files = {name: FileInfo(**info) for name, info in data["files"].items()}
            meta = cls(**{**data, "files": files})
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{where}: malformed hybrid_ep metadata ({err})") from err
        if meta.format_version not in READABLE_VERSIONS:
            raise CheckpointError(f"{where}: hybrid_ep format_version {meta.format_version} is not supported "
                                  f"(this version of hf_hybrid_ep reads {list(READABLE_VERSIONS)}); upgrade it")
        if meta.format_version < 2 and meta.per_layer:
            raise CheckpointError(f"{where}: a per-layer placement needs format_version 2, the index says "
                                  f"{meta.format_version}")
        return meta


@dataclass
class CheckpointIndex:
    """A checkpoint directory's tensors: key → file, specs, and hybrid-EP metadata if present."""

    root: Path
    weight_map: dict[str, str]
    specs: dict[str, TensorSpec]
    hybrid_ep: HybridEPMetadata | None

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def path(self, name: str) -> Path:
        return self.root / name


def safe_member(root: Path, name: str, index_path: Path | str) -> Path:
    """``root / name``, refusing a file name that reaches outside the checkpoint directory."""
    if os.path.isabs(name) or ".." in Path(name).parts or "/" in name or "\\" in name:
        raise CheckpointError(f"{str(index_path)!r} names file {name!r} outside the checkpoint directory")
    return root / name


def read_weight_map(root: Path) -> dict[str, str]:
    """Key → file of the checkpoint directory ``root``: its index's ``weight_map``, or every key of its single
    file. Reads only the index (or the single file's header), checks nothing else.

    Raises:
        CheckpointError: naming the index when it is not valid JSON, or ``root`` when it has neither.
    """
    index = root / INDEX_NAME
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{str(index)!r} is not a valid safetensors index: {err}") from err
    if (root / SINGLE_NAME).is_file():
        specs, _ = read_header(root / SINGLE_NAME)
        return {k: SINGLE_NAME for k in specs}
    raise CheckpointError(f"{str(root)!r} has neither {INDEX_NAME} nor {SINGLE_NAME} (weights load from safetensors only)")


def read_index(root: str | os.PathLike[str]) -> CheckpointIndex:
    """Read a checkpoint directory's index (or single file) and every file's header, checking them.

    Raises:
        CheckpointError: naming the file or key for a missing or truncated shard, a file outside the
            directory, a key the index names but its file lacks (or the reverse), or metadata that
            disagrees with the files.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    index_path = root / INDEX_NAME
    hybrid = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = dict(index["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{str(index_path)!r} is not a valid safetensors index: {err}") from err
        meta = (index.get("metadata") or {}).get("hybrid_ep")
        if meta is not None:
            hybrid = HybridEPMetadata.from_json(meta, str(index_path))
    elif (root / SINGLE_NAME).is_file():
        specs, _ = read_header(root / SINGLE_NAME)
        return CheckpointIndex(root, {k: SINGLE_NAME for k in specs}, specs, None)
    else:
        if any(root.glob("*.bin")) or any(root.glob("*.pt")):
            raise CheckpointError(
                f"{str(root)!r} holds only pickle weights (*.bin/*.pt); model weights are read from safetensors only"
            )
        raise CheckpointError(f"{str(root)!r} has neither {INDEX_NAME} nor {SINGLE_NAME}")
    specs: dict[str, TensorSpec] = {}
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(name, []).append(key)
    for name, keys in sorted(by_file.items()):
        file_specs, _ = read_header(safe_member(root, name, index_path))
        for key in keys:
            if key not in file_specs:
                raise CheckpointError(f"{name}: the index maps key {key!r} to this file, but the file lacks it")
            specs[key] = file_specs[key]
        extra = sorted(set(file_specs) - set(keys))
        if extra:
            raise CheckpointError(f"{name}: holds key {extra[0]!r} that the index does not map to it")
    if hybrid is not None:
        listed, present = set(hybrid.files), set(by_file)
        if listed != present:
            raise CheckpointError(
                f"{str(index_path)!r}: hybrid_ep metadata lists files {sorted(listed ^ present)} that disagree "
                "with the weight_map"
            )
        for name, info in hybrid.files.items():
            size = (root / name).stat().st_size
            if size != info.bytes:
                raise CheckpointError(f"{name}: {size} bytes on disk, metadata says {info.bytes}")
    return CheckpointIndex(root, weight_map, specs, hybrid)


def write_index(root: Path, weight_map: dict[str, str], total_size: int, hybrid: HybridEPMetadata | None) -> None:
    metadata: dict[str, Any] = {"total_size": total_size}
    if hybrid is not None:
        metadata["hybrid_ep"] = hybrid.to_json()
    body = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX_NAME).write_text(json.dumps(body, indent=2) + "\n")
