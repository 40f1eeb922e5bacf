"""The save manifest: size, sha256 and save id of every file a save wrote, kept in the index.

``model.safetensors.index.json`` → ``metadata.hybrid_ep_manifest``::

    {"save_id": "3f2a…", "files": {"model-dense-00001-of-00001.safetensors": {"bytes": 123, "sha256": "…"},
                                    "optimizer.safetensors": {…}, "trainer_state.json": {…}, …}}

Every safetensors file a save writes also carries ``hybrid_ep_save_id`` in its header metadata, so
a directory whose files come from different saves is refused, naming them, even where sizes agree.
Vanilla transformers ignores both (it reads only ``weight_map`` and ``total_size``).

:class:`CheckpointVerifier` is what every loader uses: on construction it checks that every listed
file exists with its recorded size and save id (headers only: cheap); :meth:`~CheckpointVerifier.check`
re-hashes a file a rank is about to read (on by default; ``verify=False`` skips the hash).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .format import INDEX_NAME, CheckpointIndex
from .safetensors_io import read_header, sha256_file, write_point

logger = logging.getLogger("hf_hybrid_ep")

MANIFEST_KEY = "hybrid_ep_manifest"
SAVE_ID_KEY = "hybrid_ep_save_id"
_NOT_LISTED = (INDEX_NAME,)


def save_metadata(save_id: str | None) -> dict[str, str]:
    """Header metadata for a safetensors file written by save ``save_id``."""
    return {"format": "pt", **({SAVE_ID_KEY: save_id} if save_id else {})}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(path)!r} is not a valid safetensors index: {err}") from err


def _index_digest(body: dict[str, Any]) -> str:
    """sha256 of the index's content (canonical JSON) without the digest itself."""
    import copy
    import hashlib

    body = copy.deepcopy(body)
    body.get("metadata", {}).get(MANIFEST_KEY, {}).pop("index_sha256", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(root: Path, save_id: str) -> dict[str, Any]:
    """Hash every file under ``root`` (but the index) into the index's manifest; rewrite the index
    through a temporary name. Returns the manifest."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name in _NOT_LISTED or path.name.startswith("."):
            continue
        files[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"save_id": save_id, "files": files}
    index_path = root / INDEX_NAME
    body = _read_json(index_path)
    body.setdefault("metadata", {})[MANIFEST_KEY] = manifest
    manifest["index_sha256"] = _index_digest(body)
    tmp = root / f".{INDEX_NAME}.tmp"
    write_point("open index")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    write_point("close index")
    tmp.replace(index_path)
    write_point("index written")
    return manifest


def read_manifest(root: Path) -> dict[str, Any] | None:
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        return None
    body = _read_json(index_path)
    manifest = (body.get("metadata") or {}).get(MANIFEST_KEY)
    if manifest is None:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "save_id" not in manifest:
        raise CheckpointError(f"{str(index_path)!r}: malformed {MANIFEST_KEY}")
    if manifest.get("index_sha256") != _index_digest(body):
        raise CheckpointError(f"{str(index_path)!r}: its content does not match its recorded digest (the index "
                              "was edited or is corrupt)")
    return manifest


def is_complete(root: Path) -> bool:
    """A directory whose index has a manifest and whose listed files all exist with their sizes."""
    try:
        manifest = read_manifest(root)
    except CheckpointError:
        return False
    if manifest is None:
        return False
    return all((root / n).is_file() and (root / n).stat().st_size == f["bytes"] for n, f in manifest["files"].items())


class CheckpointVerifier:
    """The integrity checks of one checkpoint directory, for a loader.

    A loader calls :meth:`check` on each file before it reads it, so a rank checks only the files it
    reads (rank-local loading works from a copy holding only this rank's files); :meth:`check_all`
    checks every listed file (convert and reshard sources, the Trainer files on resume).

    Args:
        root: the checkpoint directory (:func:`hf_hybrid_ep.checkpoint.atomic.open_checkpoint` first
            completes or rolls back an interrupted save of it).
        verify: also re-hash each checked file against the manifest (sha256).

    Raises:
        CheckpointError: naming the missing or mis-sized files, or the files of another save.
    """

    def __init__(self, root: Path, verify: bool = True) -> None:
        self.root, self.verify = Path(root), verify
        self.manifest = read_manifest(self.root) if self.root.is_dir() else None
        self._checked: set[str] = set()  # every check done
        self._sized: set[str] = set()  # size and save id checked (by _check_listed)

    @property
    def save_id(self) -> str | None:
        return self.manifest["save_id"] if self.manifest else None

    def _check_listed(self) -> None:
        missing, sized, foreign = [], [], []
        for name, info in sorted(self.manifest["files"].items()):
            path = self.root / name
            if not path.is_file():
                missing.append(name)
                continue
            size = path.stat().st_size
            if size != info["bytes"]:
                sized.append(f"{name} ({size} bytes, the manifest says {info['bytes']})")
                continue
            if name.endswith(".safetensors"):
                _, meta = read_header(path)
                if meta.get(SAVE_ID_KEY) != self.save_id:
                    foreign.append(f"{name} (save {meta.get(SAVE_ID_KEY)})")
                    continue
            self._sized.add(name)
        where = str(self.root)
        if foreign:
            raise CheckpointError(
                f"{where!r} mixes files of different saves: the index is from save {self.save_id}, but "
                f"{', '.join(foreign)}; an interrupted save? restore the directory from a complete copy"
            )
        if missing:
            raise CheckpointError(f"{where!r} is incomplete: the manifest lists {', '.join(missing)}, not on disk")
        if sized:
            raise CheckpointError(f"{where!r} has files of the wrong size: {', '.join(sized)}")

    def check(self, name: str, path: Path | None = None, metadata: dict[str, str] | None = None) -> None:
        """Check file ``name`` (at ``path``, default ``root / name``) before it is read: size and save id
        always (``metadata``: its safetensors header metadata, if the caller has read it), sha256 when
        verifying. Each file is checked once."""
        if name in self._checked:
            return
        path = self.root / name if path is None else Path(path)
        info = self.manifest["files"].get(name) if self.manifest else None
        if info is None:
            self._checked.add(name)
            return
        if name not in self._sized:
            self._check_size_and_save(name, path, info, metadata)
        if self.verify and info.get("sha256") and sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{name}: checksum mismatch (the file changed or is corrupt); "
                                  "pass verify=False only to skip hashing, never to load a corrupt file")
        self._checked.add(name)

    def _check_size_and_save(self, name: str, path: Path, info: dict[str, Any],
                             metadata: dict[str, str] | None) -> None:
        size = path.stat().st_size
        if info.get("bytes") is not None and size != info["bytes"]:
            raise CheckpointError(f"{name}: {size} bytes on disk, the index records {info['bytes']}")
        if self.manifest and name.endswith(".safetensors"):
            meta = read_header(path)[1] if metadata is None else metadata
            if meta.get(SAVE_ID_KEY) != self.save_id:
                raise CheckpointError(f"{name}: written by save {meta.get(SAVE_ID_KEY)}, the index by save "
                                      f"{self.save_id} (a mixed checkpoint)")

    def check_all(self) -> None:
        """Every listed file present with its size and save id (all problems named in one error), then
        :meth:`check` each (sha256)."""
        if self.manifest is not None:
            self._check_listed()
        for name in sorted(self.manifest["files"] if self.manifest else ()):
            self.check(name)


def verify_checksums(index: CheckpointIndex) -> None:
    """Re-hash every file a checkpoint's index lists; raise naming the first that differs.

    Raises:
        CheckpointError: also for a plain checkpoint, which records no checksums.
    """
    verifier = CheckpointVerifier(index.root, verify=True)
    if verifier.manifest is None:
        raise CheckpointError(f"{str(index.root)!r} is not a hybrid-EP checkpoint: it has no checksums")
    verifier.check_all()
