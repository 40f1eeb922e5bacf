"""Trainer checkpoints of LoRA adapters are found, checked and resumed like full ones, and the adapter config saved
in them is the one a resume continues with.

One LoRA run of ``scripts/train.py`` (2 CPU ranks of the worker pool: real processes and gloo, the script's
``main``; the demo's tiny Qwen3-MoE, 8 experts at ep 2) saves ``checkpoint-2``, ``-4`` and ``-6``; the tests resume
copies of it, ``checkpoint-6`` removed (a run stopped after step 4): under ``torchrun`` with
``--resume_from_checkpoint latest``, and in the pool for each damaged file and each contradicting adapter setting.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dist_cases as cases
import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WEIGHTS = "adapter_model.safetensors"


def _train_args(out: Path, text: Path, *extra: str, lora: tuple[str, ...] = ("--lora_r", "4")) -> list[str]:
    return ["--train_file", str(text), "--output_dir", str(out), "--max_steps", "6", "--save_steps", "2",
            "--logging_steps", "1", "--block_size", "32", "--per_device_train_batch_size", "2", "--report_to", "none",
            "--ep_degree", "2", "--disable_tqdm", "true", "--learning_rate", "3e-3", *lora, *extra]


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(ROOT / "scripts" / "train.py"), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)


def _losses(checkpoint: Path) -> dict[int, float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


@pytest.fixture(scope="module")
def lora_run(pools, tmp_path_factory) -> dict:
    """The run's directory as it was after step 4 (``checkpoint-6`` removed), and the losses of all 6 steps."""
    import random

    root = tmp_path_factory.mktemp("lora_run")
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    text = root / "train.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(300)))
    results = pools(2).run(cases.train_script, _train_args(root / "run", text))
    assert all(r["error"] == "" for r in results), results
    losses = _losses(root / "run" / "checkpoint-6")
    shutil.rmtree(root / "run" / "checkpoint-6")
    return {"dir": root / "run", "text": text, "losses": losses}


def _copy(lora_run: dict, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(lora_run["dir"], out)
    return out


def _records(out: Path) -> list[str]:
    return (out / "expert_load.jsonl").read_text().splitlines()


@pytest.mark.slow
def test_latest_resumes_a_lora_run_from_its_newest_adapter_checkpoint(lora_run, tmp_path):
    """``--resume_from_checkpoint latest`` finds ``checkpoint-4`` (its manifest lists every file), the resumed
    steps 5 and 6 equal the uninterrupted run's and every step is logged once; ``inspect --verify`` checks it and
    ``PeftModel.from_pretrained`` loads the directory with the manifest file in it."""
    from hf_hybrid_ep.model_io.resume import latest_checkpoint

    out = _copy(lora_run, tmp_path)
    assert latest_checkpoint(out) == out / "checkpoint-4"  # what hf-hybrid-ep launch resumes from, too
    run = _torchrun(*_train_args(out, lora_run["text"], "--resume_from_checkpoint", "latest"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"resume_from_checkpoint=latest: resuming from {out / 'checkpoint-4'}" in run.stderr, run.stderr[-3000:]
    resumed = _losses(out / "checkpoint-6")
    assert sorted(resumed) == list(range(1, 7))
    for step in (5, 6):
        assert abs(resumed[step] - lora_run["losses"][step]) <= cases.REL_TOL * abs(lora_run["losses"][step])
    assert [json.loads(r)["step"] for r in _records(out)] == list(range(1, 7))

    from hf_hybrid_ep.cli import main as cli

    summary = subprocess.run([str(BIN / "hf-hybrid-ep"), "inspect", str(out / "checkpoint-4"), "--verify"],
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert "PEFT adapter (LORA): r=4, lora_alpha=8" in summary.stdout and "checksums: all files verified" in summary.stdout
    assert "every floating-point tensor is finite" in summary.stdout, summary.stdout
    assert cli(["inspect", str(out / "checkpoint-4")]) == 0

    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "scripts" / "demo_assets"))
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, out / "checkpoint-4"))
    with safe_open(out / "checkpoint-4" / WEIGHTS, "pt") as f:
        assert sorted(f.keys()) == sorted(loaded)
        assert all(torch.equal(f.get_tensor(k), loaded[k]) for k in f.keys())


def _flip(path: Path, offset_in_value: int, bit: int) -> None:
    """Flip ``bit`` of byte ``offset_in_value`` of the float32 in the middle of the file's data."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    at = start + (len(data) - start) // 2
    data[at - (at - start) % 4 + offset_in_value] ^= bit
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {  # what is done to checkpoint-4, and what the refusal must say
    "mantissa": (lambda c: _flip(c / WEIGHTS, 0, 0x01), f"{WEIGHTS}: checksum mismatch"),
    "exponent": (lambda c: _flip(c / WEIGHTS, 3, 0x40), f"{WEIGHTS}: checksum mismatch"),
    "truncated": (lambda c: _truncate(c / WEIGHTS), f"{WEIGHTS} ("),
    "no adapter_config.json": (lambda c: (c / "adapter_config.json").unlink(), "adapter_config.json"),
    "no weights": (lambda c: (c / WEIGHTS).unlink(), WEIGHTS),
    "no optimizer state": (lambda c: (c / "optimizer.safetensors").unlink(), "optimizer.safetensors"),
    "no trainer state": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json"),
}


def test_a_damaged_adapter_checkpoint_is_refused_before_any_step_naming_the_file(pools, lora_run, tmp_path):
    """Resuming from ``checkpoint-4`` explicitly: a flipped mantissa or exponent byte of the adapter weights, a
    truncated weights file, a missing adapter config, weights, optimizer or trainer state file is refused on every
    rank, naming the file, and no step runs (``expert_load.jsonl`` gains no record)."""
    pool = pools(2)
    for case, (damage, named) in DAMAGE.items():
        out = _copy(lora_run, tmp_path / case.replace(" ", "_"))
        before = _records(out)
        damage(out / "checkpoint-4")
        results = pool.run(cases.train_script, _train_args(out, lora_run["text"], "--resume_from_checkpoint",
                                                           str(out / "checkpoint-4")))
        for r in results:
            assert named in r["error"], (case, r)
        after = _records(out)
        assert after == before[: len(after)], (case, "a step ran")


def test_latest_skips_an_incomplete_adapter_checkpoint_naming_what_it_lacks(pools, lora_run, tmp_path, caplog):
    """A truncated ``checkpoint-4``: ``latest`` resumes from ``checkpoint-2`` and says why it skipped the newer one."""
    import logging

    from hf_hybrid_ep.checkpoint.manifest import is_complete
    from hf_hybrid_ep.model_io.resume import resolve_resume

    out = _copy(lora_run, tmp_path)
    _truncate(out / "checkpoint-4" / WEIGHTS)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid_ep"):
        found = resolve_resume("latest", out, main_process=True)
    assert found == str(out / "checkpoint-2")
    assert f"skipping {out / 'checkpoint-4'}, which is not complete: {WEIGHTS} has" in caplog.text, caplog.text
    results = pools(2).run(cases.train_script, _train_args(out, lora_run["text"], "--max_steps", "4",
                                                           "--resume_from_checkpoint", "latest"))
    assert all(r["error"] == "" and sorted(r["losses"]) == [1, 2, 3, 4] for r in results), results
    assert is_complete(out / "checkpoint-4"), "written again, whole"


CONTRADICTIONS = {  # flags (or a peft: section) that contradict the saved r=4, lora_alpha=8, default targets
    "alpha": (["--lora_alpha", "32"], "lora_alpha: 32 given, 8 saved (command line)"),
    "rank": (["--lora_r", "8"], "r: 8 given, 4 saved (command line)"),
    "targets": (["--lora_target_modules", "q_proj"],
                "target_modules: ['q_proj'] given, ['k_proj', 'o_proj', 'q_proj', 'v_proj'] saved (command line)"),
    "peft section": (["--hybrid_ep_config", "{yaml}"], "lora_alpha: 32 given, 8 saved (the peft: section)"),
}


def test_the_saved_adapter_config_is_the_truth_on_resume(pools, lora_run, tmp_path):
    """A command line or a ``peft:`` section that contradicts the checkpoint's adapter config is refused on every
    rank, naming both values, before any step; without LoRA flags at all the resume takes the saved config."""
    pool = pools(2)
    (tmp_path / "peft.yaml").write_text("hybrid_ep:\n  peft: {lora_alpha: 32}\n")
    for case, (flags, message) in CONTRADICTIONS.items():
        out = _copy(lora_run, tmp_path / case.replace(" ", "_"))
        before = _records(out)
        flags = [f.format(yaml=tmp_path / "peft.yaml") for f in flags]
        results = pool.run(cases.train_script, _train_args(out, lora_run["text"], "--resume_from_checkpoint",
                                                           "latest", *flags))
        for r in results:
            assert message in r["error"] and str(out / "checkpoint-4") in r["error"], (case, r)
        assert _records(out) == before, (case, "a step ran")
    out = _copy(lora_run, tmp_path / "no_flags")
    for r in pool.run(cases.train_script, _train_args(out, lora_run["text"], "--resume_from_checkpoint", "latest",
                                                      lora=())):
        assert r["error"] == "" and sorted(r["losses"]) == list(range(1, 7)), r
        for step in (5, 6):
            assert abs(r["losses"][step] - lora_run["losses"][step]) <= cases.REL_TOL * abs(lora_run["losses"][step])


def test_a_trainer_refuses_to_resume_adapters_of_another_config(pools, tmp_path):
    """The library's own checks, for models built by hand: ``HybridEP(Trainer).train(resume_from_checkpoint=...)`` of
    a PeftModel with ``lora_alpha`` 16 on a checkpoint saved at 8, of a model without adapters, or from a directory
    whose manifest is gone, is refused before any step."""
    from worker_pool import RankError

    pool = pools(2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    pool.run(cases.trainer_lora_run, 1, 2, str(tmp_path / "run"), 2, 2)
    for r in pool.run(cases.trainer_lora_run, 1, 2, str(tmp_path / "run"), 4, None, str(checkpoint), lora_alpha=16):
        assert "lora_alpha: 16 in the model, 8 saved" in r["error"] and r["steps"] == 0, r
    with pytest.raises(RankError, match="is a checkpoint of PEFT adapters; the model is not a PeftModel"):
        pool.run(cases.trainer_run, 1, 2, str(tmp_path / "full"), 4, None, str(checkpoint))
    (checkpoint / "hybrid_ep_manifest.json").unlink()
    for r in pool.run(cases.trainer_lora_run, 1, 2, str(tmp_path / "run"), 4, None, str(checkpoint)):
        assert "has no manifest" in r["error"] and r["steps"] == 0, r


def test_the_launcher_plans_a_smaller_world_from_an_adapter_checkpoint(lora_run):
    """``hf-hybrid-ep launch --min-processes`` plans from the newest checkpoint: of adapters, from the base model the
    saved adapter config names, with the adapters' rank and targets."""
    from hf_hybrid_ep.integrations.supervise import smaller_world

    world, layout = smaller_world(4, 2, lora_run["dir"] / "checkpoint-4", 8.0)
    assert world == 3 and layout == (3, 1), (world, layout)  # 8 experts: ep 1 is the only layout of 3
