"""The save manifest: size, sha256 and save id of every file a save wrote.

It lives in the file that indexes the save: ``model.safetensors.index.json`` → ``metadata.hybrid_ep_manifest``
for a save of model weights; ``hybrid_ep_manifest.json`` (:data:`MANIFEST_NAME`, the same ``metadata`` mapping
and nothing else) for a save without a weight index — a Trainer checkpoint of a ``PeftModel``, whose adapter
directory PEFT reads by its two file names only, so the file is ignored by ``PeftModel.from_pretrained``::

    {"save_id": "3f2a…", "files": {"model-dense-00001-of-00001.safetensors": {"bytes": 123, "sha256": "…"},
                                    "optimizer.safetensors": {…}, "trainer_state.json": {…}, …},
     "file_sha256": "…"}

``file_sha256`` is the digest of the holding file's content without itself, so an edited index or manifest is
refused. ``README.md`` (the model card, which ``push_to_hub`` rewrites) is not listed, nor the files of a nested
directory with a weight index or manifest file of its own (a save inside the save, which that file covers). Every safetensors file a save writes also carries
``hybrid_ep_save_id`` in its header metadata, so a directory whose files come from different saves is refused,
naming them, even where sizes agree. Vanilla transformers ignores both (it reads only ``weight_map`` and
``total_size``).

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
from .format import INDEX_NAME
from .safetensors_io import read_header, sha256_file, write_point

logger = logging.getLogger("hf_hybrid_ep")

MANIFEST_KEY = "hybrid_ep_manifest"
MANIFEST_NAME = "hybrid_ep_manifest.json"  # the manifest of a save without a weight index
SAVE_ID_KEY = "hybrid_ep_save_id"
NOT_LISTED = (INDEX_NAME, MANIFEST_NAME, "README.md")  # the files holding the manifest; the model card
_DIGEST_KEY = "file_sha256"


def save_metadata(save_id: str | None) -> dict[str, str]:
    """Header metadata for a safetensors file written by save ``save_id``."""
    return {"format": "pt", **({SAVE_ID_KEY: save_id} if save_id else {})}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise CheckpointError(f"{str(path)!r} is not a JSON object")
    return body


def content_digest(body: dict[str, Any]) -> str:
    """sha256 of the content (canonical JSON) of the file holding a manifest, without the digest itself."""
    import copy
    import hashlib

    body = copy.deepcopy(body)
    body.get("metadata", {}).get(MANIFEST_KEY, {}).pop(_DIGEST_KEY, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_path(root: Path) -> Path | None:
    """The file that holds (or will hold) the manifest of the save in ``root``: its weight index when it has one,
    else :data:`MANIFEST_NAME`; ``None`` when neither is there."""
    for name in (INDEX_NAME, MANIFEST_NAME):
        if (root / name).is_file():
            return root / name
    return None


def _listed_files(root: Path) -> list[Path]:
    """The files of the save in ``root`` a manifest lists: all but :data:`NOT_LISTED`, hidden ones and those of a
    nested directory with a weight index or manifest file of its own."""
    nested = [d for d in root.rglob("*") if d.is_dir() and manifest_path(d) is not None]
    return [p for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() not in NOT_LISTED
            and not p.name.startswith(".") and not any(d in p.parents for d in nested)]


def write_manifest(root: Path, save_id: str) -> dict[str, Any]:
    """Hash every file of the save in ``root`` into its manifest — in the weight index when there is one
    (rewritten through a temporary name), else a new :data:`MANIFEST_NAME`. Returns the manifest."""
    files = {path.relative_to(root).as_posix(): {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
             for path in _listed_files(root)}
    manifest = {"save_id": save_id, "files": files}
    path = root / INDEX_NAME
    body = _read_json(path) if path.is_file() else {}
    if not path.is_file():
        path = root / MANIFEST_NAME
    body.setdefault("metadata", {})[MANIFEST_KEY] = manifest
    manifest[_DIGEST_KEY] = content_digest(body)
    tmp = root / f".{path.name}.tmp"
    write_point("open index")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    write_point("close index")
    tmp.replace(path)
    write_point("index written")
    return manifest


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of the save in ``root`` (``None``: it records none).

    Raises:
        CheckpointError: naming the file holding it when that is not valid, or was edited since the save.
    """
    path = manifest_path(root)
    if path is None:
        return None
    body = _read_json(path)
    manifest = (body.get("metadata") or {}).get(MANIFEST_KEY)
    if manifest is None:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "save_id" not in manifest:
        raise CheckpointError(f"{str(path)!r}: malformed {MANIFEST_KEY}")
    if manifest.get(_DIGEST_KEY) != content_digest(body):
        raise CheckpointError(f"{str(path)!r}: its content does not match its recorded digest (the file was edited "
                              "or is corrupt)")
    return manifest


def incompleteness(root: Path) -> str | None:
    """Why ``root`` is not a complete save (no manifest, a listed file missing or of another size); ``None`` when
    it is: every file its manifest lists on disk with its size (contents are not hashed here)."""
    try:
        manifest = read_manifest(root)
    except CheckpointError as err:
        return str(err)
    if manifest is None:
        return f"no manifest ({INDEX_NAME} or {MANIFEST_NAME} with {MANIFEST_KEY}): not a complete hybrid-EP save"
    for name, info in sorted(manifest["files"].items()):
        path = root / name
        if not path.is_file():
            return f"the manifest lists {name}, not on disk"
        if path.stat().st_size != info["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest records {info['bytes']}"
    return None


def is_complete(root: Path) -> bool:
    """A directory whose manifest lists only files that exist with their sizes (:func:`incompleteness`)."""
    return incompleteness(root) is None


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
                f"{where!r} mixes files of different saves: the manifest is from save {self.save_id}, but "
                f"{', '.join(foreign)}; an interrupted save? restore the directory from a complete copy"
            )
        restore = "restore the checkpoint from a complete copy, or resume from an earlier one"
        if missing:
            raise CheckpointError(f"{where!r} is incomplete: the manifest lists {', '.join(missing)}, not on disk; "
                                  f"{restore}")
        if sized:
            raise CheckpointError(f"{where!r} has files of the wrong size (truncated or changed): {', '.join(sized)}; "
                                  f"{restore}")

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
        if not path.is_file():
            raise CheckpointError(f"{name}: listed in the manifest of {str(self.root)!r}, not on disk (deleted or "
                                  "never copied); restore it from a complete copy of the checkpoint")
        if name not in self._sized:
            self._check_size_and_save(name, path, info, metadata)
        if self.verify and info.get("sha256") and sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{name}: checksum mismatch in {str(self.root)!r} (the file changed or is corrupt); "
                                  "restore it from a complete copy of the checkpoint, or resume from an earlier one; "
                                  "pass verify=False only to skip hashing, never to load a corrupt file")
        self._checked.add(name)

    def _check_size_and_save(self, name: str, path: Path, info: dict[str, Any],
                             metadata: dict[str, str] | None) -> None:
        size = path.stat().st_size
        if info.get("bytes") is not None and size != info["bytes"]:
            raise CheckpointError(f"{name}: {size} bytes on disk, the manifest records {info['bytes']}")
        if self.manifest and name.endswith(".safetensors"):
            meta = read_header(path)[1] if metadata is None else metadata
            if meta.get(SAVE_ID_KEY) != self.save_id:
                raise CheckpointError(f"{name}: written by save {meta.get(SAVE_ID_KEY)}, the manifest by save "
                                      f"{self.save_id} (a mixed checkpoint)")

    def check_all(self) -> None:
        """Every listed file present with its size and save id (all problems named in one error), then
        :meth:`check` each (sha256)."""
        if self.manifest is not None:
            self._check_listed()
        for name in sorted(self.manifest["files"] if self.manifest else ()):
            self.check(name)


def verify_checksums(root: Path) -> None:
    """Re-hash every file the manifest of the checkpoint in ``root`` lists; raise naming the first that differs.

    Raises:
        CheckpointError: also for a plain checkpoint, which records no checksums.
    """
    verifier = CheckpointVerifier(root, verify=True)
    if verifier.manifest is None:
        raise CheckpointError(f"{str(root)!r} is not a hybrid-EP checkpoint: it has no checksums")
    verifier.check_all()
