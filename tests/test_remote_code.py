"""No code from a checkpoint runs unless asked: every loader ignores a config's ``auto_map``.

The checkpoint's config names classes in an ``evil.py`` beside it whose import writes a marker file.
Every loader (convert, rank-local ``from_pretrained``, ``load_offloaded``, the planner) must never
import it and never prompt (``input`` answers "y" here, and records that it was asked); it either
works with transformers' built-in class for the config's ``model_type`` or, when transformers has
none, refuses with an error that says custom code would be needed.
"""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_fixtures import save_source

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError
from hf_hybrid_ep.planning.planner import plan

MARKER_ENV = "HEP_EVIL_MARKER"
AUTO_MAP = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
EVIL = f"""
import os
import pathlib

pathlib.Path(os.environ[{MARKER_ENV!r}]).write_text("pwned")

from transformers import MixtralConfig, MixtralForCausalLM


class EvilConfig(MixtralConfig):
    model_type = "evil_moe"


class EvilModel(MixtralForCausalLM):
    config_class = EvilConfig
"""


def _booby_trap(directory: Path, model_type: str | None = None) -> Path:
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = AUTO_MAP
    if model_type is not None:
        config["model_type"] = model_type
    config_path.write_text(json.dumps(config))
    (directory / "evil.py").write_text(EVIL)
    return directory


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return save_source("mixtral", tmp_path_factory.mktemp("remote") / "src")


@pytest.fixture()
def trapped(clean, tmp_path, monkeypatch) -> tuple[Path, Path, list[str]]:
    """A copy of the tiny Mixtral checkpoint with the booby trap; the marker path; the prompts asked."""
    import shutil

    src = _booby_trap(Path(shutil.copytree(clean, tmp_path / "trapped")))
    marker = tmp_path / "pwned"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    prompts: list[str] = []

    def answer_yes(prompt: str = "") -> str:
        prompts.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", answer_yes)
    return src, marker, prompts


LOADERS: dict[str, Callable[[Path, Path], object]] = {
    "convert_checkpoint": lambda src, tmp: hep.convert_checkpoint(src, tmp / "out", ep_degree=2,
                                                                 progress=False),
    "from_pretrained": lambda src, tmp: hep.from_pretrained(src),
    "load_offloaded": lambda src, tmp: hep.load_offloaded(src, capacity=2),
    "plan": lambda src, tmp: plan(str(src), gpus=2, gpu_memory_gib=80),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_builtin_class_is_used_and_no_checkpoint_code_runs(loader, trapped, tmp_path):
    src, marker, prompts = trapped
    result = LOADERS[loader](src, tmp_path)
    assert not marker.exists(), f"{loader} imported code from the checkpoint"
    assert prompts == [], f"{loader} asked whether to run the checkpoint's code"
    if loader in ("from_pretrained", "load_offloaded"):
        assert type(result).__name__ == "MixtralForCausalLM"
    elif loader == "plan":
        assert result["model"]["model_type"] == "mixtral" and result["model"]["num_experts"] == 4
    else:
        assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_unknown_model_type_is_refused_without_running_code(loader, trapped, tmp_path):
    src, marker, prompts = trapped
    _booby_trap(src, model_type="evil_moe")
    with pytest.raises((CheckpointError, hep.HybridEPConfigError, ValueError), match="trust_remote_code"):
        LOADERS[loader](src, tmp_path)
    assert not marker.exists(), f"{loader} imported code from the checkpoint"
    assert prompts == [], f"{loader} asked whether to run the checkpoint's code"
    assert not (tmp_path / "out").exists()


DRIVER = """
import json, os, pathlib, sys
from hf_hybrid_ep.moe.architecture import read_config
from hf_hybrid_ep.cli import main

src, out, marker = sys.argv[1:4]
marker = pathlib.Path(marker)
report = {}
for name, argv in {"convert": ["convert", src, out, "--ep-degree", "2"],
                   "plan": ["plan", "--model", src, "--gpus", "2", "--gpu-memory-gib", "80"]}.items():
    report[name] = {"rc": main(argv), "marker": marker.exists()}
read_config(src, trust_remote_code=True)
report["opt_in_marker"] = marker.exists()
print("REPORT" + json.dumps(report))
"""


@pytest.mark.slow
def test_cli_never_prompts_and_opting_in_does_run_the_code(clean, tmp_path):
    """The CLI (stdin answering "y" to any prompt) refuses without running code; with the opt-in the
    same checkpoint's code does run, so the trap above is live."""
    import os
    import shutil

    src = _booby_trap(Path(shutil.copytree(clean, tmp_path / "trapped")), model_type="evil_moe")
    marker, out = tmp_path / "pwned", tmp_path / "out"
    env = {**os.environ, MARKER_ENV: str(marker), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), str(marker)], input="y\n" * 4,
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.split("REPORT", 1)[1])
    for command in ("convert", "plan"):
        assert report[command] == {"rc": 2, "marker": False}, (command, run.stderr)
    assert "Do you wish to run the custom code" not in run.stdout + run.stderr
    assert run.stderr.count("trust_remote_code") >= 2, run.stderr
    assert not out.exists()
    assert report["opt_in_marker"], "with trust_remote_code=True the checkpoint's code runs: the trap is live"
