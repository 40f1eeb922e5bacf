"""`accelerate launch scripts/train.py` end to end (the real launcher, 2 CPU processes, gloo), and the command
`hf-hybrid-ep launch` builds from a torchrun or accelerate launch command, on one node and several."""

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


# The command `hf-hybrid-ep launch` builds: torchrun's elastic agent restarts every node's workers (c10d rendezvous
# at one endpoint, a fresh store per round), the script resumes from the newest complete checkpoint.
STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RESUMING = ["--resume_from_checkpoint", "latest"]


def _built(command: str, restarts: int = 3):
    """The command and environment the front builds, less the run id (tests/test_run_directory.py checks it)."""
    from hf_hybrid_ep.integrations.launch import Job, restart_command

    argv, env = restart_command(Job.of(command.split()), restarts)
    assert env.pop("HF_HYBRID_EP_RUN_ID")
    return argv, env


def test_the_front_builds_torchruns_restart_command():
    from hf_hybrid_ep.errors import HybridEPConfigError

    assert _built("torchrun --nproc_per_node 4 train.py --output_dir o") == (
        ["torchrun", "--max-restarts", "3", "--standalone", "--nproc_per_node", "4", "train.py", "--output_dir", "o",
         *RESUMING], STORE)
    # one node at a port of the user's: c10d at it; a restart count given is replaced, a resume flag given is kept
    assert _built("torchrun --max_restarts=9 --master_port 29600 --nproc-per-node 2 train.py "
                  "--resume_from_checkpoint runs/x/checkpoint-5", 1)[0] == [
        "torchrun", "--rdzv-backend", "c10d", "--max_restarts", "1", "--rdzv-endpoint", "127.0.0.1:29600",
        "--nproc-per-node", "2", "train.py", "--resume_from_checkpoint", "runs/x/checkpoint-5"]
    # every node: the same command but its --node_rank, one endpoint
    for rank in (0, 1):
        assert _built(f"torchrun --nnodes 2 --node_rank {rank} --nproc_per_node 8 --rdzv-endpoint head:29500 "
                      "train.py") == (
            ["torchrun", "--max-restarts", "3", "--rdzv-backend", "c10d", "--nnodes", "2", "--node_rank", str(rank),
             "--nproc_per_node", "8", "--rdzv-endpoint", "head:29500", "train.py", *RESUMING], STORE)
    assert _built("python -m torch.distributed.run --nnodes 2 --nproc_per_node 8 --master_addr head "
                  "--master_port 29500 --rdzv_backend static train.py")[0] == [
        "python", "-m", "torch.distributed.run", "--max-restarts", "3", "--nnodes", "2", "--nproc_per_node", "8",
        "--rdzv-endpoint", "head:29500", "--rdzv_backend", "c10d", "train.py", *RESUMING]
    refused = {"torchrun --nnodes 2 --nproc_per_node 8 train.py": "--nnodes 2 needs the rendezvous endpoint",
               "torchrun --standalone --nnodes 2 train.py": "--standalone is one node",
               "torchrun --nnodes 2 --master_port 1 train.py": "--master_port 1 without --master_addr on 2 nodes",
               "torchrun --rdzv-backend etcd --rdzv-endpoint e:2379 train.py": "--rdzv-backend etcd",
               "python train.py": "is neither torchrun nor accelerate launch",
               "torchrun --nproc_per_node 2 -m train": "names no Python script"}
    for command, message in refused.items():
        with pytest.raises(HybridEPConfigError, match=message):
            _built(command)


def test_the_front_builds_accelerates_restart_command(tmp_path):
    from hf_hybrid_ep.errors import HybridEPConfigError
    from hf_hybrid_ep.integrations.launch import Job

    assert _built("accelerate launch --multi_gpu --num_processes 4 train.py") == (
        ["accelerate", "launch", "--max_restarts", "3", "--rdzv_backend", "c10d", "--multi_gpu", "--num_processes",
         "4", "train.py", *RESUMING], {**STORE, "PET_STANDALONE": "1"})  # torchrun's --standalone on one machine
    two = ("accelerate launch --multi_gpu --num_processes 16 --num_machines 2 --machine_rank {} --main_process_ip head "
           "--main_process_port 29500 train.py")
    for rank in (0, 1):
        assert _built(two.format(rank), 2) == (
            ["accelerate", "launch", "--max_restarts", "2", "--rdzv_backend", "c10d", "--multi_gpu",
             "--num_processes", "16", "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "head",
             "--main_process_port", "29500", "train.py", *RESUMING], STORE)
    job = Job.of(two.format(0).split())
    assert (job.nodes, job.processes) == (2, 16)  # --num_processes is the total over the machines
    torchrun = Job.of("torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint h:1 train.py".split())
    assert (torchrun.nodes, torchrun.processes) == (2, 16)  # --nproc_per_node is per node
    # values the command line leaves out come from Accelerate's config file, as accelerate launch takes them
    config = tmp_path / "cluster.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 2\n"
                      "num_processes: 16\nmachine_rank: 0\nmain_process_ip: head\nmain_process_port: 29500\n")
    job = Job.of(f"accelerate launch --config_file {config} train.py".split())
    assert (job.nodes, job.processes) == (2, 16)
    assert _built(f"accelerate launch --config_file {config} train.py")[1] == STORE  # several machines: no standalone
    refused = {"accelerate launch --multi_gpu --num_processes 15 --num_machines 2 --main_process_ip h "
               "--main_process_port 1 train.py": r"starts 15 // 2 = 7 on each \(14 ranks\)",
               "accelerate launch --multi_gpu --num_processes 16 --num_machines 2 --main_process_port 1 train.py":
               "needs --main_process_ip",
               "accelerate launch --multi_gpu --num_processes 16 --num_machines 2 --same_network --main_process_ip h "
               "--main_process_port 1 train.py": "--same_network rendezvouses statically",
               "accelerate launch --num_processes 2 train.py": "without --multi_gpu does not run torchrun's elastic",
               "accelerate launch --multi_gpu --use_deepspeed train.py": "--use_deepspeed does not run torchrun's"}
    for command, message in refused.items():
        with pytest.raises(HybridEPConfigError, match=message):
            _built(command)


def test_the_front_shrinks_to_the_planners_layout_on_one_node(capsys, monkeypatch):
    from hf_hybrid_ep.cli import main as cli
    from hf_hybrid_ep.errors import HybridEPConfigError
    from hf_hybrid_ep.integrations.launch import Job, restart_command
    from hf_hybrid_ep.integrations.supervise import shrunk, smaller_world, supervise

    demo = ROOT / "scripts" / "demo_assets"  # 8 experts: the largest world below 4 the planner fits is 3, dp 3 × ep 1
    assert smaller_world(4, 2, demo, 4.0) == (3, (3, 1))
    assert smaller_world(4, 2, None, None) == (3, None)
    assert smaller_world(4, 2, demo, 1e-6) is None  # nothing fits
    job = Job.of("accelerate launch --multi_gpu --num_processes=4 train.py --ep_degree 4 --output_dir o".split())
    assert restart_command(shrunk(job, 2, demo, 4.0), 1, "r") == (
        ["accelerate", "launch", "--max_restarts", "1", "--rdzv_backend", "c10d", "--multi_gpu", "--num_processes",
         "3", "train.py", "--ep_degree", "1", "--output_dir", "o", "--dp_degree", "3", *RESUMING],
        {**STORE, "PET_STANDALONE": "1", "HF_HYBRID_EP_RUN_ID": "r"})
    job = Job.of("torchrun --nproc_per_node 4 train.py".split())
    assert restart_command(shrunk(job, 2, None, None), 0)[0] == [
        "torchrun", "--max-restarts", "0", "--standalone", "--nproc_per_node", "3", "train.py", *RESUMING]
    assert shrunk(job, 4, None, None) is None and "no layout of fewer than 4" in capsys.readouterr().err
    # on several nodes each node's count is per node (torchrun) or the total (Accelerate)
    assert Job.of("torchrun --nnodes 2 --nproc_per_node 8 train.py".split()).with_processes(14).flags == (
        "--nnodes", "2", "--nproc_per_node", "7")
    # but the nodes' launchers cannot agree on a smaller world: refused, naming what to do instead
    for command in ("torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint h:1 train.py",
                    "accelerate launch --multi_gpu --num_processes 16 --num_machines 2 --main_process_ip h "
                    "--main_process_port 1 train.py"):
        with pytest.raises(HybridEPConfigError, match="works on one node; the command runs on 2.*requeue the job"):
            supervise(command.split(), 1, min_processes=8)
    with pytest.raises(HybridEPConfigError, match="needs the command to give --nproc_per_node"):
        supervise("torchrun --nproc_per_node gpu train.py".split(), 1, min_processes=1)
    monkeypatch.setenv("HF_HYBRID_EP_RUN_ID", "r")
    assert cli(["launch", "--dry-run", "--max-restarts", "2", "--", "torchrun", "--nproc_per_node", "2", "t.py"]) == 0
    assert capsys.readouterr().out == ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 HF_HYBRID_EP_RUN_ID=r torchrun "
                                       "--max-restarts 2 --standalone --nproc_per_node 2 t.py "
                                       "--resume_from_checkpoint latest\n")
