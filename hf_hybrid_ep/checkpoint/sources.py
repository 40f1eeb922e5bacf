"""Where a rewrite reads from: a local checkpoint directory, or a Hub repo id, of which only the files a
conversion needs are downloaded (config, side files and index first; the weights once the quantization method
is known to be readable)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import CheckpointError
from .dequantize import quantization_of
from .format import INDEX_NAME, SINGLE_NAME, WEIGHT_SUFFIXES

_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def hub_metadata(repo_id: str, revision: str | None = None) -> tuple[Path, dict[str, Any], list[str]]:
    """Download a Hub repo's config, side files and index (no weights); return the snapshot directory,
    the source record (repo id and resolved commit) and the weight files the checkpoint consists of."""
    if not _REPO_ID.match(repo_id):
        raise CheckpointError(f"{repo_id!r} is neither a checkpoint directory nor a Hub repo id")
    from huggingface_hub import HfApi, hf_hub_download

    info = HfApi().model_info(repo_id, revision=revision, files_metadata=False)
    files = [s.rfilename for s in (info.siblings or [])]
    side = [f for f in files if "/" not in f and not f.endswith(WEIGHT_SUFFIXES) and f != INDEX_NAME]
    if INDEX_NAME in files:
        index_path = Path(hf_hub_download(repo_id, INDEX_NAME, revision=info.sha))
        weights = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    elif SINGLE_NAME in files:
        weights = [SINGLE_NAME]
    else:
        raise CheckpointError(f"Hub repo {repo_id!r} has no safetensors weights ({INDEX_NAME} or {SINGLE_NAME})")
    root = None
    for name in side or ["config.json"]:
        root = Path(hf_hub_download(repo_id, name, revision=info.sha)).parent
    return root, {"repo_id": repo_id, "revision": info.sha}, weights


def resolve_source(src: str | os.PathLike[str], revision: str | None = None) -> tuple[Path, dict[str, Any]]:
    """A local checkpoint directory, or a Hub repo id downloaded with only the files conversion needs."""
    path = Path(src)
    if path.is_dir():
        return path, {"folder": path.resolve().name}
    from huggingface_hub import hf_hub_download

    root, source, weights = hub_metadata(str(src), revision)
    _check_quantization(root, str(src))  # before downloading any weights
    for name in tqdm(weights, desc=f"download {src}", unit="file"):
        hf_hub_download(source["repo_id"], name, revision=source["revision"])
    return root, source


def _check_quantization(root: Path, where: str) -> None:
    """Refuse a quantization method that cannot be dequantized, reading only ``config.json``."""
    config = root / "config.json"
    if config.is_file():
        try:
            quantization_of(json.loads(config.read_text()), where)
        except json.JSONDecodeError:
            pass  # read_config names the file with transformers' own error
