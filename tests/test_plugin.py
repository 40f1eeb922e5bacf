"""HybridEPPlugin: file < environment < flags, and the TrainingArguments it carries."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from hf_hybrid_ep import HybridEPConfigError
from hf_hybrid_ep.integrations.plugin import HybridEPPlugin, explicit_flags

YAML = """
hybrid_ep:
  dp_degree: 4
  ep_degree: 2
  microbatch_size: 8
  gradient_accumulation: 4
  optimizer: {type: AdamW, lr: 6.0e-5, weight_decay: 0.01}
"""


@pytest.fixture()
def yaml_file(tmp_path):
    path = tmp_path / "ep.yaml"
    path.write_text(YAML)
    return path


def test_file_shape_users_write(yaml_file, tmp_path):
    plugin = HybridEPPlugin.from_sources(yaml_file)
    assert (plugin.config.dp_degree, plugin.config.ep_degree) == (4, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    plugin.apply_to(args)
    assert args.per_device_train_batch_size == 8 and args.gradient_accumulation_steps == 4
    assert args.learning_rate == 6.0e-5 and args.weight_decay == 0.01 and args.optim == "adamw_torch"


def test_precedence_flags_over_env_over_file(yaml_file, monkeypatch):
    monkeypatch.setenv("HF_HYBRID_EP_EP_DEGREE", "4")
    monkeypatch.setenv("HF_HYBRID_EP_DP_DEGREE", "2")
    assert HybridEPPlugin.from_sources(yaml_file).config.ep_degree == 4  # env beats file
    plugin = HybridEPPlugin.from_sources(yaml_file, {"ep_degree": 1, "dp_degree": 8, "dispatcher": None})
    assert (plugin.config.dp_degree, plugin.config.ep_degree) == (8, 1)  # flags beat env


def test_conflict_with_an_explicit_training_argument_names_both(yaml_file, tmp_path):
    argv = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "4"]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[])
    with pytest.raises(HybridEPConfigError, match=r"--per_device_train_batch_size=4 conflicts .*\(8\)"):
        HybridEPPlugin.from_sources(yaml_file).apply_to(args, explicit=explicit_flags(argv))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("hybrid_ep:\n  ep_size: 2\n", r"unknown hybrid-EP setting\(s\) \['ep_size'\]"),
        ("hybrid_ep:\n  optimizer: {type: Lion}\n", "optimizer type 'Lion' is not supported"),
        ("hybrid_ep:\n  optimizer: {type: AdamW, momentum: 0.9}\n", "optimizer setting 'momentum' is unknown"),
        # keys beside the block (the training settings, or typos of them) would be read by nobody
        ("microbatch_size: 4\nhybrid_ep:\n  ep_degree: 2\n", r"\['microbatch_size'\] stand beside the 'hybrid_ep:'"),
        ("optimiser: {lr: 1.0}\nhybrid_ep: {}\n", r"\['optimiser'\] stand beside"),
        ("hybrid_ep:\n  microbach_size: 4\n", r"unknown hybrid-EP setting\(s\) \['microbach_size'\]"),
    ],
)
def test_bad_files(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(HybridEPConfigError, match=needle):
        HybridEPPlugin.from_sources(path).training_overrides()


def test_the_sample_file_parses_and_names_every_key(tmp_path):
    """``examples/hybrid_ep.yaml``: every key of HybridEPConfig and every training key, each one read by the
    plugin; the values it sets reach TrainingArguments; ``collective_timeout_s`` follows ``ddp_timeout``."""
    from pathlib import Path

    import yaml

    from hf_hybrid_ep.config import config_fields
    from hf_hybrid_ep.integrations.plugin import TRAINING_KEYS

    sample = Path(__file__).resolve().parents[1] / "examples" / "hybrid_ep.yaml"
    keys = set(yaml.safe_load(sample.read_text())["hybrid_ep"])
    assert keys == set(config_fields()) | set(TRAINING_KEYS) | {"optimizer"}
    plugin = HybridEPPlugin.from_sources(sample)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], ddp_timeout=120)
    plugin.apply_to(args)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.learning_rate) == (8, 2, 3e-3)
    assert args.resume_from_checkpoint == "latest" and plugin.config.collective_timeout_s == 120
