"""`accelerate launch scripts/train.py` end to end: the real launcher, 2 CPU processes, gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_accelerate_launch_trains_and_saves(tmp_path):
    out = tmp_path / "run"
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train.py"),
        "--output_dir", str(out), "--max_steps", "12", "--per_device_train_batch_size", "8",
        "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--logging_steps", "3",
        "--save_steps", "12", "--report_to", "none", "--block_size", "64", "--ep_degree", "2",
        "--verify_sync_steps", "4", "--bias_update_rate", "0.001", "--freeze_experts", "least_used:1",
        "--freeze_from_step", "8",
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    # no needless DDP graph traversal (nothing dense is unused) and no pinned-memory warning without CUDA
    assert "find_unused_parameters=True was specified" not in run.stderr, run.stderr[-3000:]
    assert "'pin_memory' argument is set as true" not in run.stderr, run.stderr[-3000:]
    assert "hybrid EP dp=1 × ep=2" in run.stdout and "peak memory per rank" in run.stdout
    state = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-12")
    assert torch.isfinite(model(input_ids=torch.randint(3, 500, (1, 16))).logits).all()
    assert "moe/imbalance_expert_max" in state["log_history"][0]
    records = (out / "expert_load.jsonl").read_text().splitlines()
    assert len(records) == len(losses)
    from hf_hybrid_ep.cli import main as cli

    assert cli(["report", str(out / "expert_load.jsonl"), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "expert_load_heatmap.png").stat().st_size > 1000


@pytest.mark.slow
def test_accelerate_launch_trains_lora_adapters(tmp_path):
    # --lora_r on the command line, lora_alpha and the dense targets from the YAML's peft: section, the expert
    # targets by default: checkpoints hold PEFT's adapter files (every expert) and the adapters' optimizer state.
    from safetensors import safe_open

    out = tmp_path / "run"
    (tmp_path / "ep.yaml").write_text("hybrid_ep:\n  ep_degree: 2\n  peft: {lora_alpha: 16, target_modules: [q_proj, v_proj]}\n")
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train.py"),
        "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--learning_rate", "1e-2", "--logging_steps", "1", "--save_steps", "4", "--report_to", "none",
        "--block_size", "32", "--hybrid_ep_config", str(tmp_path / "ep.yaml"), "--lora_r", "4",
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = out / "checkpoint-4"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 16)
    assert set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert set(config["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert not list(checkpoint.glob("model*.safetensors"))
    with safe_open(checkpoint / "adapter_model.safetensors", "pt") as f:
        shape = f.get_slice("base_model.model.model.layers.0.mlp.experts.lora_A.weight").get_shape()
    assert shape == [8 * 4, 32]  # every expert of the demo's 8 (down_proj: in = moe_intermediate_size)
    with safe_open(checkpoint / "optimizer.safetensors", "pt") as f:
        assert all(".lora_" in key for key in f.keys())
