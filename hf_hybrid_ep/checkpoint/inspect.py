"""Summaries of a checkpoint directory: layers, experts, ranks and bytes per file; of a PEFT adapter directory,
its adapter config and tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .dequantize import quantization_config_of, quantization_of
from .format import INDEX_NAME, SINGLE_NAME, read_index
from .manifest import read_manifest, verify_checksums
from .peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .safetensors_io import TensorFiles, nonfinite_count, read_header

ADAPTER_SUMMARY_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "target_parameters")


def inspect_checkpoint(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """Describe a (hybrid-EP or plain) safetensors checkpoint; with ``verify``, re-hash every file and read every
    floating-point tensor, listing those that hold NaN or inf (``nonfinite``: name → how many elements).

    A PEFT adapter directory (a Trainer checkpoint of a ``PeftModel``) is summarised by its adapter config and
    ``adapter_model.safetensors`` (:func:`inspect_adapter`).

    Raises:
        CheckpointError: for a checkpoint that fails its checks (naming the file or key).
    """
    root = Path(path)
    if (root / ADAPTER_CONFIG).is_file() and not any((root / n).is_file() for n in (INDEX_NAME, SINGLE_NAME)):
        return inspect_adapter(root, verify=verify)
    index = read_index(path)
    manifest = read_manifest(index.root)
    nonfinite = None
    if verify:
        verify_checksums(index.root)
        nonfinite = nonfinite_tensors(index.root, index.weight_map)
    files: dict[str, dict[str, Any]] = {}
    for name in index.weight_map.values():
        entry = files.setdefault(name, {"tensors": 0, "bytes": (index.root / name).stat().st_size})
        entry["tensors"] += 1
    summary: dict[str, Any] = {
        "path": str(index.root),
        "hybrid_ep": index.hybrid_ep is not None,
        "tensors": len(index.weight_map),
        "bytes": sum(f["bytes"] for f in files.values()),
        "files": files,
        "checksums": manifest is not None or index.hybrid_ep is not None,
        "save_id": manifest["save_id"] if manifest else None,
        "quantization": _quantization(index.root),
        "nonfinite": nonfinite,
    }
    meta = index.hybrid_ep
    if meta is not None:
        for name, info in meta.files.items():
            files[name].update(role=info.role, ep_rank=info.ep_rank, sha256=info.sha256)
        summary.update(
            ep_degree=meta.ep_degree,
            num_experts=meta.num_experts,
            num_moe_layers=meta.num_moe_layers,
            storage=meta.storage,
            dtype=meta.dtype,
            placement=meta.placement,
            source=meta.source,
            verified=verify,
        )
        summary["dequantized_from"] = (meta.source.get("dequantized_from") or {}).get("description")
    return summary


def inspect_adapter(root: Path, *, verify: bool = False) -> dict[str, Any]:
    """Describe a PEFT adapter directory: its adapter config (``adapter``: type, rank, alpha, targets), the tensors
    of ``adapter_model.safetensors``, the manifest a hybrid-EP save wrote; with ``verify``, every file re-hashed
    against it and every tensor read for NaN or inf (as :func:`inspect_checkpoint`).

    Raises:
        CheckpointError: naming the file that fails its checks.
    """
    manifest = read_manifest(root)
    if verify:
        verify_checksums(root)
    weights = root / ADAPTER_WEIGHTS
    specs, _ = read_header(weights)
    try:
        config = json.loads((root / ADAPTER_CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(root / ADAPTER_CONFIG)!r} is not a PEFT adapter config: {err}") from err
    size = weights.stat().st_size
    return {
        "path": str(root), "hybrid_ep": False, "adapter": {k: config.get(k) for k in ADAPTER_SUMMARY_FIELDS},
        "tensors": len(specs), "bytes": size, "files": {ADAPTER_WEIGHTS: {"tensors": len(specs), "bytes": size}},
        "checksums": manifest is not None, "save_id": manifest["save_id"] if manifest else None, "quantization": None,
        "nonfinite": nonfinite_tensors(root, dict.fromkeys(specs, ADAPTER_WEIGHTS)) if verify else None,
        "verified": verify,
    }


def nonfinite_tensors(root: Path, weight_map: dict[str, str]) -> dict[str, int]:
    """Per tensor of the checkpoint that holds NaN or inf, how many of its elements do (one tensor in memory at a
    time; float8 and other narrow types are widened to check)."""
    found = {}
    with TensorFiles(weight_map, lambda name: root / name) as files:
        for key in sorted(weight_map):
            bad = nonfinite_count(files.read(key))
            if bad:
                found[key] = bad
    return found


def _names(value: Any) -> str:
    """Target names as inspect prints them: a sorted list, or PEFT's regular expression as it is."""
    return str(sorted(value)) if isinstance(value, list) else repr(value)


def _quantization(root: Path) -> str | None:
    """How ``root/config.json`` says the weights are quantized (``fp8 block 128×128``; a method convert
    refuses is named as such); ``None`` when they are not."""
    config = root / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except json.JSONDecodeError:
        return None
    qc = quantization_config_of(data)
    if qc is None:
        return None
    try:
        return quantization_of(data, str(root)).describe()
    except CheckpointError:
        return f"{qc.get('quant_method')!r}, which convert refuses"


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{summary['path']}: {summary['tensors']} tensors, {summary['bytes'] / 2**20:.2f} MiB"]
    if summary["hybrid_ep"]:
        lines.append(
            f"hybrid-EP format: ep_degree={summary['ep_degree']}, {summary['num_experts']} experts × "
            f"{summary['num_moe_layers']} MoE layers, storage={summary['storage']}, dtype={summary['dtype']}"
        )
        placement = summary["placement"]
        tables = placement.items() if isinstance(placement, dict) else [(None, placement)]
        for layer, rows in tables:
            indent = "  "
            if layer is not None:
                lines.append(f"  layer {layer}:")
                indent = "    "
            for rank, row in enumerate(rows):
                lines.append(f"{indent}EP rank {rank}: experts {row[0]}–{row[-1]}"
                             if row == list(range(row[0], row[-1] + 1)) else f"{indent}EP rank {rank}: experts {row}")
        if summary.get("dequantized_from"):
            lines.append(f"weights dequantized from {summary['dequantized_from']} to {summary['dtype']}")
    elif summary.get("adapter"):
        adapter = summary["adapter"]
        lines.append(f"PEFT adapter ({adapter['peft_type']}): r={adapter['r']}, lora_alpha={adapter['lora_alpha']}, "
                     f"target_modules {_names(adapter['target_modules'])}, "
                     f"target_parameters {_names(adapter['target_parameters'])}")
    else:
        lines.append("plain checkpoint (no hybrid_ep metadata)")
    if summary.get("verified"):
        lines.append("checksums: all files verified")
    bad = summary.get("nonfinite")
    if bad:
        lines.append(f"NON-FINITE: {len(bad)} tensor(s) hold NaN or inf: "
                     + ", ".join(f"{k} ({n} elements)" for k, n in list(bad.items())[:10])
                     + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""))
    elif bad is not None:
        lines.append("every floating-point tensor is finite")
    if summary.get("quantization"):
        lines.append(f"quantized checkpoint: {summary['quantization']}")
    if summary.get("save_id"):
        lines.append(f"save {summary['save_id']}: every file listed with its size and sha256")
    if not summary.get("checksums"):
        lines.append("no checksums recorded: the files cannot be verified (convert it to get them)")
    for name, f in sorted(summary["files"].items()):
        role = f.get("role", "")
        rank = f" rank {f['ep_rank']}" if f.get("ep_rank") is not None else ""
        lines.append(f"  {name}: {f['tensors']} tensors, {f['bytes'] / 2**20:.2f} MiB {role}{rank}".rstrip())
    return "\n".join(lines)
