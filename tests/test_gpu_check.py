"""`benchmarks/bench_gpu_check.py` cannot rot before a GPU runs it: its ``--dry-run`` (CPU, tiny shapes, Triton
interpreter) runs every section -- the multi-rank ones as 4 gloo processes -- and a missing dependency stops it
before any work, naming what is missing. The rule that lets 4 ranks share one GPU (a gloo world bound to a CUDA
device is a CUDA mesh) is checked here on a gloo world of one."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_gpu_check

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("a_dispatch_kernels", "b_experts_implementation", "c_engine", "d_offloaded_decoding", "e_save_resume",
            "f_autocast", "g_exchanges", "h_reducer_zero1", "i_lora", "j_eval_layout", "k_trainer", "l_sft",
            "m_sync_debug")
EXCHANGES = ("per_pair", "per_pair_triton", "dedup_one_node", "dedup_two_nodes", "overlap_degree_2",
             "activation_checkpointing")
MASKED = {"masked_permute", "masked_permute_backward", "masked_combine", "masked_combine_backward_rows",
          "masked_combine_backward_shadow", "masked_combine_backward_weights", "padded_regroup",
          "padded_regroup_backward"}


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _assert_equalities(runs: list[dict], fp32_tol: float) -> None:
    for run in runs:
        assert set(run["equality"]) == {"float32"}, run["shape"]  # the dry run compares fp32 only
        for name, figures in run["equality"]["float32"].items():
            assert figures["tol"] == fp32_tol, (run["shape"], name)
            assert 0.0 <= figures["rel_err"] <= fp32_tol, (run["shape"], name, figures)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    # a hang guard, not a speed bound: the dry run takes about a minute on two idle cores, 2-4 under load
    return _run("--dry-run", "--out-dir", str(out), timeout=900), out


def _report(dry_run) -> dict:
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.timeout(1000)
def test_dry_run_every_section_ok_within_tolerance(dry_run):
    report = _report(dry_run)
    sections = report["sections"]
    assert tuple(sections) == SECTIONS
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(SECTIONS, "ok"), {
        name: s.get("error") for name, s in sections.items()}
    assert report["meta"]["dry_run"] and any("NCCL" in note for note in report["meta"]["notes"])
    assert any("bf16" in note for note in report["meta"]["notes"])  # says the bf16 comparisons were skipped

    kernels = sections["a_dispatch_kernels"]
    _assert_equalities(kernels["runs"], 1e-6)
    assert {"permute", "permute_backward", "combine", "combine_backward_rows", "combine_backward_weights"} | MASKED == set(
        kernels["runs"][0]["equality"]["float32"])
    _assert_equalities(sections["b_experts_implementation"]["runs"], 1e-5)

    engine = sections["c_engine"]
    assert set(engine["runs"]) == {"without engine", "torch", "triton", "dedup", "auto"}
    for name, run in engine["runs"].items():
        assert run["loss_tol"] == 1e-5 and run["max_loss_rel_err"] <= 1e-5, (name, run["losses"])
    assert [engine["runs"][d]["dispatcher_selected"] for d in ("torch", "triton", "dedup", "auto")] == [
        "torch", "triton", "dedup", "torch"]
    assert all(engine["runs"][d]["optimizer"] == "ShardedAdamW" and engine["runs"][d]["fused"]
               for d in ("torch", "triton", "dedup", "auto"))
    assert "NCCL" in engine["nccl"] and engine["zero1_state_elements_ok"]
    for d in ("torch", "triton", "dedup", "auto"):  # every parameter's first-step gradient, not a loss tolerance
        grads = engine["runs"][d]["first_step_grads"]
        assert grads["parameters"] > 20 and grads["violations"] == grads["missing"] == [], grads
        assert grads["worst_rel"] <= grads["worst_bound"] == 1e-5, grads
    assert engine["runs"]["auto"]["started_on_cpu"] and engine["runs"]["auto"]["placed_on"] == ["cpu"]

    decoding = sections["d_offloaded_decoding"]
    assert decoding["budget"] == 0.25
    assert all(run["identical_to_resident"] for run in decoding["float32"].values())
    for run in ("hf_hybrid_ep offloaded", "hf_hybrid_ep offloaded (memory store, no prefetch)"):  # with, without
        cache = decoding["float32"][run]["cache"]
        assert cache["hits"] + cache["misses"] > 0 and 0.0 <= cache["hit_rate"] <= 1.0

    resume = sections["e_save_resume"]
    assert resume["placed_on"] == resume["step_devices"] == ["cpu"] and resume["max_param_rel_err"] <= 1e-5, resume
    autocast = sections["f_autocast"]
    assert autocast["grouped_gemm_dtypes"] == ["bfloat16"] and autocast["grad_dtypes"] == ["torch.float32"]
    assert autocast["dispatch_bytes_per_row"] == [2 * autocast["hidden"]] and autocast["grads"]["violations"] == []

    markdown = (dry_run[1] / "gpu_check.md").read_text()
    assert all(f"## {name}" in markdown for name in SECTIONS)
    assert "| rank 0 | rank 1 | rank 2 | rank 3 |" in markdown  # the multi-rank sections, one column per rank


@pytest.mark.timeout(1000)
def test_dry_run_runs_the_multi_rank_sections_on_four_ranks(dry_run):
    sections = _report(dry_run)["sections"]
    for name in SECTIONS[6:12]:
        ranks = sections[name]["ranks"]
        assert len(ranks) == 4 and all(r is not None for r in ranks), name

    def compared(run: dict, grads: bool = True) -> None:  # every comparison with the unsharded reference, in fp32
        assert max(run["loss_rel"]) <= 1e-5 and max(run["norm_rel"]) <= 1e-5, run
        for key in ("first_step_grads", "params") if grads else ("params",):
            assert run[key]["parameters"] > 10 and run[key]["violations"] == run[key]["missing"] == [], run[key]
            assert run[key]["worst_rel"] <= run[key]["tol"] == 1e-5, run[key]

    for rank, figures in enumerate(sections["g_exchanges"]["ranks"]):
        runs = figures["runs"]
        assert tuple(runs) == EXCHANGES
        for name, run in runs.items():
            compared(run)
            assert run["dispatch_remote_rows"] > 0, (rank, name)  # a real exchange: rows reached other ranks
            assert (run["dispatch_inter_calls"] > 0) == (name in ("dedup_two_nodes", "activation_checkpointing"))
        one = runs["per_pair"]["dispatch_calls"]
        assert one == 2 * runs["per_pair"]["layers"]  # two micro-batches, one dispatch per MoE layer each
        assert runs["overlap_degree_2"]["dispatch_calls"] == runs["activation_checkpointing"]["dispatch_calls"] == 2 * one
        assert [runs[n]["dispatcher"] for n in EXCHANGES] == ["torch", "triton", "dedup", "dedup", "torch", "dedup"]

    for figures in sections["h_reducer_zero1"]["ranks"]:
        compared(figures["reducer"])
        compared(figures["zero1"], grads=False)
        reduction = figures["reducer"]["reduction"]
        assert reduction["buckets_launched_in_backward"] > 0 and reduction["dense_bytes"] > 0, reduction
        assert reduction["expert_bytes"] > 0 and len(figures["reducer"]["buckets"]) > 2, figures["reducer"]
        assert figures["zero1"]["optimizer"] == "ShardedAdamW"
        assert figures["zero1"]["state_elements"] < figures["zero1"]["parameters"] / 2, figures["zero1"]
        assert figures["save_peak_extra_bytes"] is figures["optimizer_save_peak_extra_bytes"] is None  # CUDA only
    for figures in sections["i_lora"]["ranks"]:
        compared(figures)
        assert figures["expert_adapters"] > 0 and figures["base_grads"] == [], figures
    for figures in sections["j_eval_layout"]["ranks"]:
        assert figures["training_layout_rel"] <= 1e-5 and figures["eval_layout_rel"] <= 1e-5, figures
        assert figures["restored"] and all(s[0] == 8 for s in figures["inside_expert_shapes"]), figures
        compared(figures["after"])
    for name in ("k_trainer", "l_sft"):
        for figures in sections[name]["ranks"]:
            assert figures["wrapped"] == "DistributedDataParallel" and figures["placed_on"] == ["cpu"], figures
            assert len(figures["losses"]) == len(figures["reference"]["losses"]) == 2, figures
            for key in ("losses", "grad_norms"):
                for got, want in zip(figures[key], figures["reference"][key], strict=True):
                    assert abs(got - want) <= 1e-5 * abs(want), (name, key, figures)
    assert sections["m_sync_debug"]["mode"].startswith("skipped: the CPU has no sync-debug mode")


@pytest.mark.timeout(1000)
def test_dry_run_work_stays_tiny(dry_run):
    """What keeps the dry run cheap in the suite, counted rather than timed: its models, batches and steps."""
    sections = _report(dry_run)["sections"]
    engine = sections["c_engine"]
    assert engine["parameters"] < 200_000 and engine["tokens_per_step"] <= 32 and engine["steps"] <= 3, engine
    assert all(r["shape"]["T"] <= 48 for r in sections["a_dispatch_kernels"]["runs"])
    for figures in sections["h_reducer_zero1"]["ranks"]:
        assert figures["zero1"]["parameters"] < 200_000, figures["zero1"]


def test_without_cuda_it_refuses_before_any_work_suggesting_dry_run(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    # in a child, so that what the refusal imported can be seen: torch to ask for CUDA, nothing that builds a model
    code = ("import sys, benchmarks.bench_gpu_check as b; code = b.main(['--out-dir', sys.argv[1]]); "
            "print('imported:', sorted({'transformers', 'triton', 'accelerate', 'trl'} & set(sys.modules))); "
            "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # a hang guard only
    assert proc.returncode == 2, proc.stderr
    assert "CUDA is not available" in proc.stderr and "--dry-run" in proc.stderr, proc.stderr
    assert "imported: []" in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_gloo_world_bound_to_a_gpu_is_a_cuda_mesh(tmp_path):
    """The rule the multi-rank sections stand on: a gloo default group bound to a CUDA device
    (``init_process_group("gloo", device_id=cuda:0)``, which this CPU build refuses, so the binding is set as
    torch sets it) makes the engine's mesh a CUDA one, with gloo's group options; unbound, gloo is the CPU."""
    import torch.distributed as dist

    from hf_hybrid_ep.parallel import mesh
    from hf_hybrid_ep.parallel.devices import rank_device

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert mesh.default_device_type() == "cpu"
        dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
        assert mesh.default_device_type() == "cuda" and rank_device("cuda") == torch.device("cuda", 0)
        options = mesh._group_options("cuda", datetime.timedelta(seconds=30))
        assert isinstance(options["ep"], dist.ProcessGroupGloo._Options), options
    finally:
        dist.group.WORLD.bound_device_id = None
        dist.destroy_process_group()


def test_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    problems = bench_gpu_check.missing_dependencies(dry_run=True)
    assert problems == ["the 'accelerate' package is not installed (pip install accelerate)"]
