"""PEFT adapter directories as files: their two files, the adapter config saved in them, and what a resume or a
fresh initialisation may take from a config.

A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) holds every expert's factors
in PEFT's layout: ``lora_A [r·E, in]`` (expert-major rows) and ``lora_B [out, r·E]`` (the expert index
fastest); :mod:`hf_hybrid_ep.model_io.adapters` reads them into a model rank-locally.

A directory a hybrid-EP save wrote (a Trainer checkpoint of a ``PeftModel``) also holds ``hybrid_ep_manifest.json``
(:mod:`.manifest`), which PEFT ignores: its files are checked against it before they are read, and the adapter
config it saved is the one a resume continues with (:func:`adapter_conflicts`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, HybridEPConfigError
from .manifest import CheckpointVerifier, save_metadata
from .safetensors_io import set_metadata

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FRESH_INITS = (True, "gaussian")  # init_lora_weights that rank-local initialisation reproduces
# the LoraConfig fields that decide an adapter's tensors and what they compute: a resume keeps the saved ones
ADAPTER_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "target_parameters", "exclude_modules",
                  "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora",
                  "lora_bias", "bias", "fan_in_fan_out", "modules_to_save")


def adapter_directory(source: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local directory holding a PEFT adapter: ``source`` itself, or its two files fetched from the Hub.

    Raises:
        CheckpointError: naming the path when a file is missing (adapters load from safetensors only).
    """
    path = Path(source)
    if not path.is_dir() and not os.path.isabs(str(source)) and str(source).count("/") == 1:
        from huggingface_hub import hf_hub_download

        config = hf_hub_download(str(source), ADAPTER_CONFIG, revision=revision)
        hf_hub_download(str(source), ADAPTER_WEIGHTS, revision=revision)
        path = Path(config).parent
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        _present(path, name)
    return path


def _present(directory: Path, name: str) -> Path:
    """``directory / name``, one of an adapter directory's two files, refused naming it when it is not there."""
    if not (directory / name).is_file():
        hint = ("a checkpoint of a whole model, not of adapters?" if name == ADAPTER_CONFIG else
                "adapters load from safetensors only")
        raise CheckpointError(f"{str(directory)!r} is not a PEFT adapter directory: it has no {name} ({hint})")
    return directory / name


def checked_adapter_file(directory: Path, name: str, verifier: CheckpointVerifier | None) -> Path:
    """``directory / name``, checked by ``verifier`` (default: against the directory's manifest, when it has one —
    a plain PEFT adapter has none) and present.

    Raises:
        CheckpointError: naming the file.
    """
    (verifier if verifier is not None else CheckpointVerifier(directory)).check(name)
    return _present(directory, name)


def read_adapter_config(directory: str | os.PathLike[str], verifier: CheckpointVerifier | None = None):
    """The ``peft.PeftConfig`` saved in adapter directory ``directory`` (checked first), for training:
    ``inference_mode`` off.

    Raises:
        CheckpointError: naming the file when it is missing, changed or not a PEFT config.
    """
    from peft import PeftConfig

    directory = Path(directory)
    path = checked_adapter_file(directory, ADAPTER_CONFIG, verifier)
    try:
        config = PeftConfig.from_pretrained(str(directory))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:  # json's errors are ValueErrors
        raise CheckpointError(f"{str(path)!r} is not a PEFT adapter config: {err}") from err
    config.inference_mode = False
    return config


def saved_adapter_config(checkpoint: str | os.PathLike[str]):
    """The adapter config of a checkpoint of adapters (it holds ``adapter_config.json`` or its manifest lists it),
    checked against the manifest; ``None`` for a checkpoint of a whole model."""
    checkpoint = Path(checkpoint)
    verifier = CheckpointVerifier(checkpoint)
    listed = ADAPTER_CONFIG in (verifier.manifest or {}).get("files", {})
    if not listed and not (checkpoint / ADAPTER_CONFIG).is_file():
        return None
    return read_adapter_config(checkpoint, verifier)


def _comparable(value: Any) -> Any:
    """A config value as it compares: collections of names as sorted lists (JSON saves sets as lists)."""
    if isinstance(value, list | tuple | set | frozenset):
        return sorted(value, key=str)
    return value


def adapter_conflicts(saved, given: Mapping[str, Any], label: str = "given") -> list[str]:
    """``"field: <given> <label>, <saved> saved"`` for each field of ``given`` (``LoraConfig`` field → value) whose
    value the saved config ``saved`` holds otherwise."""
    conflicts = []
    for field, value in sorted(given.items()):
        if not hasattr(saved, field):
            conflicts.append(f"{field}: not a field of {type(saved).__name__}")
            continue
        held = getattr(saved, field)
        if _comparable(value) != _comparable(held):
            conflicts.append(f"{field}: {_comparable(value)!r} {label}, {_comparable(held)!r} saved")
    return conflicts


def tag_adapter_weights(directory: str | os.PathLike[str], save_id: str) -> None:
    """Mark the ``adapter_model.safetensors`` PEFT wrote in ``directory`` as a file of save ``save_id`` (its header
    metadata; the tensors unchanged), as every safetensors file of a hybrid-EP save is."""
    set_metadata(Path(directory) / ADAPTER_WEIGHTS, save_metadata(save_id))


def check_fresh_init(peft_config, where: str = "from_pretrained(peft_config=...)") -> None:
    """Refuse an ``init_lora_weights`` that rank-local initialisation does not reproduce, naming it and ``where``
    the adapters were asked for."""
    init = getattr(peft_config, "init_lora_weights", True)
    if getattr(peft_config, "use_dora", False):
        raise HybridEPConfigError(f"{where} cannot initialise DoRA (it reads the base weights); "
                                  "apply get_peft_model to a model in memory and parallelize it")
    if init not in FRESH_INITS:
        raise HybridEPConfigError(
            f"{where} initialises adapters with init_lora_weights in {FRESH_INITS}, not "
            f"{init!r}; apply get_peft_model to a model in memory and parallelize it, or pass adapter=PATH")
