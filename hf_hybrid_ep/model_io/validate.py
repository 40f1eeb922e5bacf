"""Checkpoint keys checked against the model they load into, before a conversion writes anything.

Each key is mapped to the model tensor it fills the way transformers' ``from_pretrained`` maps it
(the model's conversion mapping: every renaming, then at most one converter, e.g. "stack per-expert
``experts.{i}.w1/w3.weight`` into ``experts.gate_up_proj``"; the base-model prefix added or
stripped as needed; a key that names a model tensor as it is kept as it is). Checked, all at once:

* shape: exactly that of the model's parameter or persistent buffer. A key a converter combines is
  checked against its own part of the model tensor: what the converter's reverse (the one
  ``save_pretrained`` writes checkpoints with) makes of the model tensor, run on meta tensors (for
  Mixtral ``w1``: ``gate_up_proj`` without its leading expert dimension, halved along the
  concatenated one); and the converter run on meta tensors of the keys' shapes must give the model
  tensor's shape;
* dtype: floating point or not, like the model tensor (precisions may differ: fp32 biases beside
  bf16 weights, and ``--dtype`` casts);
* missing: model parameters that no key fills, except tied parameters (transformers'
  ``_tied_weights_keys``, as the config enables them) with a filled partner, and names matching
  ``_keys_to_ignore_on_load_missing``; for a converter, every part its reverse expects (each expert
  of each source pattern);
* unexpected: keys that fill no model tensor (also an expert id beyond the model's expert count),
  except names matching ``_keys_to_ignore_on_load_unexpected`` and the stale rotary ``inv_freq`` and
  ``position_ids`` buffers transformers ignores too.

Every problem goes into one :class:`CheckpointError`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint.format import PER_EXPERT_KEY
from ..checkpoint.safetensors_io import DTYPE_TO_ST, TensorSpec
from ..errors import CheckpointError

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter

Shape = tuple[int, ...]
LIST_CAP = 10
_PLAIN_PATTERN = re.compile(r"^[\w.*]+$")


@dataclass
class _Findings:
    """Problems found so far, as message entries, and the model tensors some key fills."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)
    wrong_dtype: list[str] = field(default_factory=list)
    filled: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)  # keys filling nothing that transformers ignores too


@dataclass
class _Group:
    """The keys one converter combines into the model tensor ``name`` (first target), by source pattern."""

    converter: WeightConverter
    keys: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def validate_against_model(model: nn.Module, specs: dict[str, TensorSpec], where: str) -> list[str]:
    """Check every checkpoint key of ``specs`` against ``model`` (built on the meta device from the
    checkpoint's config): shapes exactly, floating point or not, no model parameter missing, no key
    left over (see the module docstring for the rules).

    Returns the keys that fill no model tensor but are ignored by rule (DeepSeek-V3's
    multi-token-prediction layer ``model.layers.61.*``, stale rotary buffers), sorted.

    Raises:
        CheckpointError: one error listing every missing, unexpected, mis-shaped and mis-typed key
            (each list capped at ten names and a count), naming ``where`` and the model class.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    tensors: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    ignore_unexpected = _ignore_unexpected_patterns(model)
    found = _Findings()
    groups: dict[str, _Group] = {}
    for key in sorted(specs, key=_natural):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, tensors)
        if name not in tensors and key in tensors:
            name, pattern = key, None
        if pattern is None:
            _check_direct(key, specs[key], name, tensors, found, ignore_unexpected)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        group = groups.setdefault(name, _Group(converter))
        group.keys[pattern].append(key)
    for name, group in groups.items():
        _check_group(name, group, specs, model, tensors, found, ignore_unexpected)
    missing = _missing_parameters(model, found.filled)
    found.missing.extend(_saved_as(model, name, tensors[name]) if i < LIST_CAP else name
                         for i, name in enumerate(missing))
    _raise(found, type(model).__name__, where)
    return sorted(found.ignored, key=_natural)


def _natural(key: str) -> list[tuple[int, str]]:
    return [(int(part), "") if part.isdigit() else (-1, part) for part in key.split(".")]


def _shape(shape: Iterable[int]) -> str:
    return str(tuple(int(d) for d in shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_TO_ST.get(dtype, str(dtype).removeprefix("torch."))


def _ignore_unexpected_patterns(model: nn.Module) -> list[re.Pattern[str]]:
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return [re.compile(p) for p in sorted(patterns)]


def _unexpected(found: _Findings, key: str, names: Iterable[str], ignore: list[re.Pattern[str]],
                why: str = "") -> None:
    if any(p.search(n) for p in ignore for n in (key, *names)):
        found.ignored.append(key)
        return
    found.unexpected.append(key + why)


def _check_kind(key: str, spec: TensorSpec, name: str, target: torch.Tensor, found: _Findings) -> None:
    if spec.dtype.is_floating_point == target.dtype.is_floating_point:
        return
    want = "a floating-point" if target.dtype.is_floating_point else f"a {_dtype_name(target.dtype)}"
    model_name = "" if name == key else f" for {name}"
    found.wrong_dtype.append(
        f"{key}: {_dtype_name(spec.dtype)} in the file, the model expects {want} tensor{model_name}")


def _check_direct(key: str, spec: TensorSpec, name: str, tensors: dict[str, torch.Tensor], found: _Findings,
                  ignore: list[re.Pattern[str]]) -> None:
    target = tensors.get(name)
    if target is None:
        _unexpected(found, key, [name], ignore)
        return
    found.filled.add(name)
    _check_kind(key, spec, name, target, found)
    if tuple(spec.shape) != tuple(target.shape):
        model_name = "" if name == key else f" for {name}"
        found.wrong_shape.append(
            f"{key}: {_shape(spec.shape)} in the file, the model expects {_shape(target.shape)}{model_name}")


def _target_names(name: str, converter: WeightConverter) -> list[str]:
    """Full model names of every target of a converter whose first target is ``name``."""
    first = converter.target_patterns[0]
    if first not in name:
        return [name]
    prefix, _, suffix = name.partition(first)
    return [prefix + pattern + suffix for pattern in converter.target_patterns]


def _run_ops(converter: WeightConverter, data: dict[str, list[torch.Tensor]], name: str,
             model: nn.Module) -> dict[str, torch.Tensor]:
    for op in converter.operations:
        data = op.convert(data, source_patterns=converter.source_patterns,
                          target_patterns=converter.target_patterns, full_layer_name=name, model=model,
                          config=model.config, missing_keys=None)
    return {k: v[0] if isinstance(v, list) else v for k, v in data.items()}


def _expected_parts(name: str, converter: WeightConverter, targets: list[torch.Tensor],
                    model: nn.Module) -> list[list[Shape]] | None:
    """Per source pattern of ``converter``, the shapes of the keys it combines into the model tensors
    ``targets`` (in combining order), found by running its reverse on meta tensors; ``None`` when the
    converter has no usable reverse."""
    try:
        reverse = converter.reverse_transform()
        data = {pattern: [torch.empty(t.shape, dtype=t.dtype, device="meta")]
                for pattern, t in zip(reverse.source_patterns, targets, strict=True)}
        parts = _run_ops(reverse, data, name, model)
    except Exception:  # an op without a reverse, or one this target's shape does not suit
        return None
    expected: list[list[Shape]] = []
    for template in reverse.target_patterns:
        if "*" in template:
            shapes = []
            while (part := parts.get(template.replace("*", str(len(shapes))))) is not None:
                shapes.append(tuple(part.shape))
        else:
            shapes = [tuple(parts[template].shape)] if template in parts else []
        if not shapes:
            return None
        expected.append(shapes)
    return expected


def _slot(key: str, position: int) -> int:
    match = PER_EXPERT_KEY.match(key)
    return int(match["expert"]) if match else position


def _missing_key(name: str, group: _Group, pattern_index: int, slot: int) -> str:
    """The checkpoint name of a missing part of the model tensor ``name``, derived from a present key
    of the same tensor: by expert id, or by swapping the source pattern it matched for the missing one."""
    pattern = group.converter.source_patterns[pattern_index]
    for key in group.keys.get(pattern) or []:
        match = PER_EXPERT_KEY.match(key)
        if match:
            return f"{match['prefix']}.{slot}.{match['rest']}"
    wanted = pattern.replace("*", str(slot))
    if _PLAIN_PATTERN.match(pattern):
        for other_pattern, keys in group.keys.items():
            if not _PLAIN_PATTERN.match(other_pattern):
                continue
            for key in keys:
                match = PER_EXPERT_KEY.match(key)
                present = other_pattern.replace("*", match["expert"] if match else str(slot))
                if key.count(present) == 1 and (match is None or int(match["expert"]) == slot):
                    return key.replace(present, wanted)
    return f"{name} (no key for {pattern!r}, part {slot})"


def _check_group(name: str, group: _Group, specs: dict[str, TensorSpec], model: nn.Module,
                 tensors: dict[str, torch.Tensor], found: _Findings, ignore: list[re.Pattern[str]]) -> None:
    converter = group.converter
    all_keys = sorted((k for keys in group.keys.values() for k in keys), key=_natural)
    names = _target_names(name, converter)
    if any(n not in tensors for n in names):
        for key in all_keys:
            _unexpected(found, key, names, ignore)
        return
    found.filled.update(names)
    targets = [tensors[n] for n in names]
    for key in all_keys:
        _check_kind(key, specs[key], name, targets[0], found)
    expected = _expected_parts(name, converter, targets, model)
    ordered: dict[str, list[str]] = {}
    problems = 0
    for i, pattern in enumerate(converter.source_patterns):
        keys = sorted(group.keys.get(pattern, []), key=lambda k: (_slot(k, 0), _natural(k)))
        if expected is None:
            if keys:
                ordered[pattern] = keys
            continue
        wanted = expected[i]
        by_slot: dict[int, str] = {}
        for position, key in enumerate(keys):
            slot = _slot(key, position)
            if slot >= len(wanted) or slot in by_slot:
                why = f" (the model has {len(wanted)} experts)" if PER_EXPERT_KEY.match(key) else ""
                _unexpected(found, key, [name], ignore, why)
                problems += 1
                continue
            by_slot[slot] = key
            if tuple(specs[key].shape) != wanted[slot]:
                found.wrong_shape.append(
                    f"{key}: {_shape(specs[key].shape)} in the file, the model expects "
                    f"{_shape(wanted[slot])} (part of {name} {_shape(targets[0].shape)})")
                problems += 1
        for slot in range(len(wanted)):
            if slot not in by_slot:
                found.missing.append(_missing_key(name, group, i, slot))
                problems += 1
        if by_slot:
            ordered[pattern] = [by_slot[s] for s in sorted(by_slot)]
    if problems:
        return
    data = {p: [torch.empty(specs[k].shape, dtype=specs[k].dtype, device="meta") for k in keys]
            for p, keys in ordered.items()}
    try:
        produced = _run_ops(converter, data, name, model)
    except Exception as err:  # what the loader would fail on: say so for these keys
        found.wrong_shape.append(f"{_keys_text(all_keys)} cannot be combined into {name}: {err}")
        return
    got = _produced_shapes(name, produced)
    for target_name, target in zip(names, targets, strict=True):
        shape = got.get(target_name)
        if shape != tuple(target.shape):
            made = "nothing" if shape is None else _shape(shape)
            found.wrong_shape.append(
                f"{_keys_text(all_keys)} combine into {made} for {target_name}, the model expects "
                f"{_shape(target.shape)}")


def _produced_shapes(name: str, produced: dict[str, torch.Tensor]) -> dict[str, Shape]:
    """Full model names of a converter's outputs (expanded like transformers' ``WeightConverter.convert``)."""
    for pattern in produced:
        if pattern in name:
            prefix, _, suffix = name.partition(pattern)
            return {prefix + k + suffix: tuple(v.shape) for k, v in produced.items()}
    return {k: tuple(v.shape) for k, v in produced.items()}


def _keys_text(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{keys[0]} and {len(keys) - 1} more key(s)"


def _tie_groups(model: nn.Module) -> list[set[str]]:
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    try:
        tied = expand(all_submodels=True) if expand is not None else {}
    except ValueError:
        tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    groups: list[set[str]] = []
    for target, source in tied.items():
        joined = [g for g in groups if target in g or source in g]
        merged = {target, source}.union(*joined)
        groups = [g for g in groups if g not in joined] + [merged]
    return groups


def _missing_parameters(model: nn.Module, filled: set[str]) -> list[str]:
    """Model parameters no key fills, less tied ones with a filled partner and ignorable names."""
    ignore = [re.compile(p) for p in sorted(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())]
    ties = _tie_groups(model)
    missing = []
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name in filled or any(p.search(name) for p in ignore):
            continue
        if any(name in group and group & filled for group in ties):
            continue
        missing.append(name)
    return sorted(set(missing), key=_natural)


def _saved_as(model: nn.Module, name: str, tensor: torch.Tensor) -> str:
    """``name``, and the checkpoint key(s) ``save_pretrained`` would write it as where they differ."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        keys = sorted(revert_weight_conversion(model, {name: torch.empty(tensor.shape, device="meta")}),
                      key=_natural)
    except Exception:  # a conversion without a reverse: the model's name alone
        return name
    if not keys or keys == [name]:
        return name
    more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return f"{name} (saved as {keys[0]}{more})"


def _capped(items: list[str], sep: str = ", ") -> str:
    shown = sep.join(items[:LIST_CAP])
    return shown if len(items) <= LIST_CAP else f"{shown}{sep}... and {len(items) - LIST_CAP} more"


def _raise(found: _Findings, model_name: str, where: str) -> None:
    parts = []
    if found.missing:
        parts.append(f"{len(found.missing)} missing ({_capped(found.missing)})")
    if found.unexpected:
        parts.append(f"{len(found.unexpected)} unexpected ({_capped(found.unexpected)})")
    if found.wrong_shape:
        parts.append(f"{len(found.wrong_shape)} with the wrong shape ({_capped(found.wrong_shape, '; ')})")
    if found.wrong_dtype:
        parts.append(f"{len(found.wrong_dtype)} with the wrong dtype ({_capped(found.wrong_dtype, '; ')})")
    if parts:
        raise CheckpointError(f"checkpoint {where!r} does not match {model_name}: " + ", ".join(parts))
