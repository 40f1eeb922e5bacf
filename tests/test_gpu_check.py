"""`benchmarks/bench_gpu_check.py` cannot rot before a GPU runs it: its ``--dry-run`` (CPU, tiny shapes, Triton
interpreter) runs every section, and a missing dependency stops it within seconds, naming what is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import bench_gpu_check

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("a_dispatch_kernels", "b_experts_implementation", "c_engine", "d_offloaded_decoding", "e_save_resume",
            "f_autocast")
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
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, float]:
    out = tmp_path_factory.mktemp("gpu_check")
    start = time.perf_counter()
    proc = _run("--dry-run", "--out-dir", str(out), timeout=600)
    return proc, out, time.perf_counter() - start


def test_dry_run_every_section_ok_within_tolerance(dry_run):
    proc, out, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
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

    markdown = (out / "gpu_check.md").read_text()
    assert all(f"## {name}" in markdown for name in SECTIONS)


def test_dry_run_fits_its_time_budget(dry_run):
    proc, _, seconds = dry_run
    assert proc.returncode == 0
    assert seconds <= 120, seconds  # 60 s on an idle 2-core machine; slack for a loaded one


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_fails_fast_suggesting_dry_run(tmp_path):
    start = time.perf_counter()
    proc = _run("--out-dir", str(tmp_path), timeout=60)
    assert time.perf_counter() - start <= 20
    assert proc.returncode != 0
    assert "CUDA is not available" in proc.stderr and "--dry-run" in proc.stderr, proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    problems = bench_gpu_check.missing_dependencies(dry_run=True)
    assert problems == ["the 'accelerate' package is not installed (pip install accelerate)"]
