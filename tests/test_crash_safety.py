"""A save killed at any write point leaves the previous checkpoint or the new one, never a mix; a
corrupted byte in any file is refused at load, naming the file.

The crashes are ``os._exit`` in forked children (``tests/crash_driver.py``, one fresh process with one
thread): at every open/close of a file, fsync, rename and index write of a Trainer checkpoint save
over an existing ``checkpoint-N`` (with ``renameat2`` exchange; the portable two-rename commit from
the index write on, the staging before it being the same code), of the same save of a ``PeftModel``'s
adapters (PEFT's adapter directory and its manifest file), of a convert and of a reshard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("crash_driver.py")
SCENARIOS = {"train_save_exchange": {"old", "new"}, "train_save_portable": {"old", "new"},
             "adapter_save_exchange": {"old", "new"}, "convert": {"absent", "new"}, "reshard": {"absent", "new"}}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("crash")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(DRIVER), str(work)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_crash_at_any_write_point_leaves_old_or_new(report, scenario):
    result = report[scenario]
    points = result["points"]
    kinds = {p.split()[0] for p in points}
    assert {"open", "close", "fsync"} <= kinds, points
    assert any(p.startswith("renamed") or p == "exchanged" for p in points), points
    assert "index" in " ".join(points)
    bad = [c for c in result["crashes"] if c["outcome"] not in SCENARIOS[scenario] or c["exit"] != 17]
    assert not bad, bad
    seen = {c["outcome"] for c in result["crashes"]}
    assert seen == SCENARIOS[scenario], f"both outcomes must occur over the write points: {seen}"
    assert result["save_after_crash"] == 0 and result["after_crash_outcome"] == "new"
    assert result["leftovers"] == [], "a save after a crash removes the stale claim and staging"


def test_the_portable_path_recovers_between_its_two_renames(report):
    points = report["train_save_portable"]["points"]
    assert "old renamed aside" in points and "exchanged" not in points
    assert "exchanged" in report["train_save_exchange"]["points"]


@pytest.mark.parametrize("kind, files", [
    ("corrupted_byte", {"model.safetensors.index.json", "config.json"}),
    ("adapter_corrupted_byte", {"hybrid_ep_manifest.json", "adapter_model.safetensors", "adapter_config.json"}),
])
def test_a_corrupted_byte_in_any_file_is_refused_naming_it(report, kind, files):
    outcomes = report[kind]
    names = {o["file"] for o in outcomes}
    assert files | {"optimizer.safetensors", "optimizer.json", "trainer_state.json", "scheduler.pt",
                    "rng_state.pth", "training_args.bin"} <= names, names
    for o in outcomes:
        if o["file"] == "model.safetensors.index.json":
            assert o["outcome"].startswith("refused"), o
            continue
        assert o["outcome"].startswith("refused") and o["file"] in o["outcome"], o


def test_a_training_checkpoint_keeps_the_source_use_cache(report):
    """The Trainer turns ``use_cache`` off for training; the saved config is the source's, for inference."""
    figures = report["use_cache"]
    assert figures["source"] is True and figures["during_training"] is False
    assert figures["saved"] is True
