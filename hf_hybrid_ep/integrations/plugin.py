"""``HybridEPPlugin``: hybrid-EP settings for an Accelerate/Trainer run, from a file, the environment and flags.

Accelerate's own config file refuses unknown keys, so hybrid-EP settings live in a separate YAML
(``--hybrid_ep_config FILE``), the ``HF_HYBRID_EP_*`` environment twins, and command-line flags, with
precedence flags > environment > file. The file accepts::

    hybrid_ep:
      dp_degree: 4
      ep_degree: 2
      microbatch_size: 8            # -> TrainingArguments.per_device_train_batch_size
      gradient_accumulation: 4      # -> TrainingArguments.gradient_accumulation_steps
      optimizer: {type: AdamW, lr: 6.0e-5, weight_decay: 0.01}   # -> optim, learning_rate, weight_decay
      resume_from_checkpoint: latest  # -> TrainingArguments.resume_from_checkpoint (latest: the newest complete one)
      peft: {r: 16, lora_alpha: 32}   # LoRA (peft.LoraConfig fields); targets default to attention and experts;
                                      # on a resume of adapters the saved config, which these must not contradict

``examples/hybrid_ep.yaml`` is a commented sample holding every key. ``collective_timeout_s`` defaults to
``TrainingArguments.ddp_timeout``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.peft_files import ADAPTER_CONFIG, adapter_conflicts, saved_adapter_config
from ..config import MIN_COLLECTIVE_TIMEOUT_S, HybridEPConfig, config_fields, env_values, read_yaml_mapping
from ..errors import HybridEPConfigError
from ..moe.lora import DEFAULT_LORA_TARGETS

TRAINING_KEYS = {"microbatch_size": "per_device_train_batch_size", "gradient_accumulation": "gradient_accumulation_steps",
                 "resume_from_checkpoint": "resume_from_checkpoint"}
OPTIMIZERS = {"adamw": "adamw_torch", "adamw_torch": "adamw_torch", "sgd": "sgd", "adafactor": "adafactor"}
OPTIMIZER_KEYS = {"lr": "learning_rate", "learning_rate": "learning_rate", "weight_decay": "weight_decay",
                  "beta1": "adam_beta1", "beta2": "adam_beta2", "eps": "adam_epsilon"}


def check_optimizer_block(optimizer: Any, where: str) -> None:
    """Refuse an ``optimizer`` setting that is not a mapping, naming where it came from."""
    if optimizer is not None and not isinstance(optimizer, Mapping):
        raise HybridEPConfigError(f"{where}: key 'optimizer' must be a mapping such as "
                                  f"{{type: AdamW, lr: 6.0e-5, weight_decay: 0.01}}, got {optimizer!r}")


def check_peft_block(peft: Any, where: str) -> None:
    """Refuse a ``peft`` setting that is not a mapping, naming where it came from."""
    if peft is not None and not isinstance(peft, Mapping):
        raise HybridEPConfigError(f"{where}: key 'peft' must be a mapping of peft.LoraConfig fields such as "
                                  f"{{r: 16, lora_alpha: 32}}, got {peft!r}")


@dataclass
class HybridEPPlugin:
    """The hybrid-EP part of a training run: the engine config plus the training settings it carries."""

    config: HybridEPConfig = field(default_factory=HybridEPConfig)
    microbatch_size: int | None = None
    gradient_accumulation: int | None = None
    optimizer: dict[str, Any] | None = None
    resume_from_checkpoint: str | None = None
    peft: dict[str, Any] | None = None

    @classmethod
    def from_sources(
        cls, file: str | os.PathLike[str] | None = None, flags: Mapping[str, Any] | None = None
    ) -> HybridEPPlugin:
        """Merge file < environment < flags (``None`` flags are "not given")."""
        data: dict[str, Any] = {}
        if file is not None:
            loaded = read_yaml_mapping(file, "hybrid-EP config file")
            check_optimizer_block(loaded.get("optimizer"), f"hybrid-EP config file {str(file)!r}")
            check_peft_block(loaded.get("peft"), f"hybrid-EP config file {str(file)!r}")
            data.update(loaded)
        data.update(env_values())
        data.update({k: v for k, v in (flags or {}).items() if v is not None})
        engine_fields = set(config_fields())
        known = engine_fields | set(TRAINING_KEYS) | {"optimizer", "peft"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HybridEPConfigError(f"unknown hybrid-EP setting(s) {unknown}; known: {sorted(known)}")
        engine = {k: v for k, v in data.items() if k in engine_fields}
        config = HybridEPConfig(**engine, _env_applied=True)
        resume = data.get("resume_from_checkpoint")
        return cls(config, data.get("microbatch_size"), data.get("gradient_accumulation"), data.get("optimizer"),
                   None if resume is None else str(resume), data.get("peft"))

    def lora_config(self, overrides: Mapping[str, Any] | None = None,
                    checkpoint: str | os.PathLike[str] | None = None):
        """The ``peft.LoraConfig`` (causal LM) of the ``peft:`` section updated by ``overrides`` (``None`` values
        are "not given"), each target list :data:`DEFAULT_LORA_TARGETS`' unless given (an empty list: none);
        ``None`` when neither sets anything. Resuming from ``checkpoint``, a checkpoint of adapters: the adapter
        config saved there, whatever is given or not (the run continues the saved adapters).

        Raises:
            HybridEPConfigError: naming a field ``peft.LoraConfig`` does not have, or a given value that contradicts
                the saved config (both values, and where the given one came from).
        """
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        section = {k: v for k, v in (self.peft or {}).items() if k not in given}
        saved = None if checkpoint is None else saved_adapter_config(checkpoint)
        if saved is not None:
            conflicts = [f"{c} (command line)" for c in adapter_conflicts(saved, given)]
            conflicts += [f"{c} (the peft: section)" for c in adapter_conflicts(saved, section)]
            if conflicts:
                raise HybridEPConfigError(
                    f"resuming from {str(checkpoint)!r}, whose {ADAPTER_CONFIG} is the adapter config the run continues "
                    f"with: {'; '.join(conflicts)}. Drop those settings (or give the saved values) to resume, or "
                    "start a new run in another --output_dir")
            return saved
        fields = {**section, **given}
        if not fields:
            return None
        from peft import LoraConfig

        fields = {**DEFAULT_LORA_TARGETS, **fields}
        try:
            return LoraConfig(task_type="CAUSAL_LM", **fields)
        except TypeError as err:
            raise HybridEPConfigError(f"peft settings {sorted(fields)}: {err}") from err

    def training_overrides(self) -> dict[str, Any]:
        """The ``TrainingArguments`` fields this plugin sets."""
        out: dict[str, Any] = {}
        for key, arg in TRAINING_KEYS.items():
            if getattr(self, key) is not None:
                out[arg] = getattr(self, key)
        if self.optimizer:
            check_optimizer_block(self.optimizer, "the hybrid-EP plugin")
            opt = dict(self.optimizer)
            kind = str(opt.pop("type", "AdamW"))
            if kind.lower() not in OPTIMIZERS:
                raise HybridEPConfigError(f"optimizer type {kind!r} is not supported; use one of {sorted(OPTIMIZERS)}")
            out["optim"] = OPTIMIZERS[kind.lower()]
            for key, value in opt.items():
                if key not in OPTIMIZER_KEYS:
                    raise HybridEPConfigError(f"optimizer setting {key!r} is unknown; known: {sorted(OPTIMIZER_KEYS)}")
                out[OPTIMIZER_KEYS[key]] = value
        return out

    def apply_to(self, training_args, explicit: Iterable[str] = ()) -> None:
        """Set the plugin's training settings on ``training_args``, and ``collective_timeout_s`` to its
        ``ddp_timeout`` when the config sets none (before ``parallelize`` creates the process groups).

        Args:
            explicit: names of ``TrainingArguments`` fields the user gave explicitly; a plugin value that
                differs from one of those is an error naming both.
        """
        explicit = set(explicit)
        for arg, value in self.training_overrides().items():
            current = getattr(training_args, arg)
            if arg in explicit and current != value:
                raise HybridEPConfigError(
                    f"--{arg}={current!r} conflicts with the hybrid-EP setting that maps to it ({value!r}); "
                    "give it in one place"
                )
            setattr(training_args, arg, value)
        if self.config.collective_timeout_s is None:
            timeout = max(float(training_args.ddp_timeout), MIN_COLLECTIVE_TIMEOUT_S)
            self.config = dataclasses.replace(self.config, collective_timeout_s=timeout)


def explicit_flags(argv: Iterable[str]) -> set[str]:
    """Field names given as ``--name`` or ``--name=value`` on a command line."""
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
