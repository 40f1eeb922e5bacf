"""Fault drills with real processes and real signals: a stopped rank is named and every other rank exits; a killed
rank is recovered from by the launcher, the resumed run equal to an uninterrupted one; the launcher's restarts.

The hang drill starts 4 ranks bare (as srun would: RANK, WORLD_SIZE, MASTER_ADDR/PORT; rank 0 hosts the c10d store)
running ``tests/fault_worker.py``; the recovery drill runs ``hf-hybrid-ep launch -- torchrun ... scripts/train.py``
on the CPU (so it also shows that a plain torchrun of the script trains data-parallel).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import dist_cases as cases
import pytest

from hf_hybrid_ep.integrations.launch import Job, smaller_world, supervise
from hf_hybrid_ep.parallel.watchdog import EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 15


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bare_ranks(world: int, argv: list[str]) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_worker.py"), *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return procs


def _stopped_drill(argv: list[str], stopped: int, survivors: tuple[int, ...]) -> tuple[dict, dict[int, str], int, str]:
    """Start 4 bare ranks of ``fault_worker.py argv``; once rank ``stopped`` prints ``stopping`` (it stops itself),
    wait up to TIMEOUT_S + 60 s for the survivors to exit, then continue it. Returns the seconds from the stop to
    each survivor's exit (each exited with the watchdog's code), every rank's stderr from the watchdog's message on,
    the stopped rank's exit status and its stdout."""
    procs = _bare_ranks(4, argv)
    victim = procs[stopped]
    exits = {}
    try:
        for line in victim.stdout:
            if line.startswith("stopping"):
                break
        start = time.monotonic()
        while len(exits) < len(survivors) and time.monotonic() - start < TIMEOUT_S + 60:
            for rank in survivors:
                if rank not in exits and procs[rank].poll() is not None:
                    exits[rank] = time.monotonic() - start
            time.sleep(0.2)
        os.kill(victim.pid, signal.SIGCONT)
        victim.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = {}
    for rank, p in enumerate(procs):
        err = p.stderr.read()
        at = err.find("hf_hybrid_ep watchdog")
        reports[rank] = err[at:] if at >= 0 else f"(no message; rc {p.returncode}) {err[-3000:]}"
        assert rank not in survivors or p.returncode == EXIT_CODE, (rank, p.returncode, reports[rank])
    return exits, reports, victim.returncode, victim.stdout.read()


def _names_only(report: str, stopped: int) -> bool:
    """The message blames exactly ``stopped``: no other rank did not arrive."""
    return f"did not arrive: rank(s) [{stopped}] (no heartbeat: stopped, dead or hung outside Python)\n" in report


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_every_other_rank_exits():
    """Rank 2 of 4 stops itself (SIGSTOP, collective_timeout_s=15) before the gradient norm's all-reduce over the
    world, whose group has no timeout of its own: ranks 0, 1 and 3 time out together, each exits with the watchdog's
    code within the timeout + 30 s, with one message naming that all-reduce, the world and rank 2 alone as the rank
    that did not arrive (they go on beating while they look); SIGCONT afterwards only ends rank 2 the same way."""
    exits, reports, code, out = _stopped_drill([str(TIMEOUT_S), "100000", "2", "3"], 2, (0, 1, 3))
    assert sorted(exits) == [0, 1, 3] and max(exits.values()) < TIMEOUT_S + 30, (exits, reports)
    for rank in (0, 1, 3):
        report = reports[rank]
        assert report.count("hf_hybrid_ep watchdog") == 1, report
        assert f"rank {rank} " in report and _names_only(report, 2), report
        assert "all_reduce of the global gradient norm over the world (ranks 0–3) has not completed" in report, report
        assert "flight recorder: oldest collective not completed on this rank: gloo:all_reduce" in report, report
    assert code == EXIT_CODE and "rank 2 did not run for" in reports[2], reports[2]
    assert "step" not in out, "a stopped rank resumes no training"


def test_a_collective_waited_for_later_is_named_wherever_the_host_waits():
    """NCCL's pattern on gloo: every rank launches layer 1's dispatch exchange asynchronously and waits for it
    later; rank 2 stopped before launching it. Ranks 0 and 1 meanwhile wait in another collective of the package
    (the loss's all-reduce over ranks [0, 1, 2]), rank 3 in a barrier the package does not see; no group times out by
    itself. Every one of them names the exchange of layer 1 over the world and rank 2 alone, and exits within the
    timeout + 30 s."""
    timeout_s = 10
    exits, reports, _, _ = _stopped_drill(["async", str(timeout_s), "2"], 2, (0, 1, 3))
    assert sorted(exits) == [0, 1, 3] and max(exits.values()) < timeout_s + 30, (exits, reports)
    for rank in (0, 1, 3):
        report = reports[rank]
        assert report.count("hf_hybrid_ep watchdog") == 1, report
        assert ("all_to_all (dispatch) of model.layers.1.mlp.experts over the world (ranks 0–3) has not completed"
                in report and _names_only(report, 2)), report
        assert "flight recorder: oldest collective not completed on this rank: gloo:all_to_all" in report, report
    for rank in (0, 1):
        assert "this rank waits in all_reduce of the loss;" in reports[rank], reports[rank]
    assert "this rank's main thread is outside the package's collectives" in reports[3], reports[3]


def test_only_ranks_that_stopped_or_run_elsewhere_did_not_arrive():
    """Two snapshots of the positions, an interval apart, around rank 0's all-reduce over the world (its 5th
    collective there): rank 1 waits in it too, rank 2 stopped (its beat did not move), rank 3 waits in the counts
    exchange with rank 2 (behind on the world, but waiting for someone), rank 4 ended by its own watchdog. Only rank
    2 is named; with rank 2 running elsewhere instead, it is named as running, still before it."""
    from hf_hybrid_ep.parallel.positions import diagnose

    world = (0, 1, 2, 3, 4)

    def position(beat, counts, within=None, ended=None):
        return {"beat": beat, "at": time.time(), "host": "h", "pid": 7, "in": within, "pending": None,
                "idle_s": 1.0, "last": "x", "counts": {"0,1,2,3,4": counts}, "region": None, "ended": ended}

    norm = ["all_reduce of the global gradient norm", list(world), 5]
    first = {1: position(3, 5, norm), 2: position(9, 4), 3: position(4, 4, ["all_to_all (counts)", [2, 3], 8]),
             4: position(2, 5, norm)}
    second = {**first, 1: position(5, 5, norm), 3: position(6, 4, first[3]["in"]), 4: position(3, 5, norm, "hang")}
    text = diagnose([1, 2, 3, 4], world, 5, first, second)
    assert text.startswith("; did not arrive: rank(s) [2] (no heartbeat: stopped, dead or hung outside Python)\n"), text
    assert "rank 3: has not reached it; waiting in all_to_all (counts)" in text and "rank 4: its watchdog ended" in text
    second[2] = position(11, 4)
    text = diagnose([1, 2, 3, 4], world, 5, first, second)
    assert text.startswith("; did not arrive: rank(s) [2] (running, still before it)\n"), text


def test_nccl_settings_are_defaults_and_its_groups_time_out_after_the_package(monkeypatch):
    from datetime import timedelta

    from hf_hybrid_ep.parallel import nccl

    for name in (*nccl.ENV_DEFAULTS, "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nccl.set_env_defaults()
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ  # its newer name is set: the user's size holds
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    minute = timedelta(seconds=60)
    assert nccl.group_timeout(minute, "cuda") == minute + timedelta(seconds=nccl.GRACE_S) and nccl.GRACE_S > 0
    assert nccl.group_timeout(minute, "cpu") == minute and nccl.group_timeout(None, "cuda") is None


def _train_args(out: Path, text: Path, *extra: str) -> list[str]:
    return ["--train_file", str(text), "--output_dir", str(out), "--max_steps", "40", "--save_steps", "10",
            "--logging_steps", "1", "--block_size", "32", "--per_device_train_batch_size", "2", "--report_to", "none",
            "--ep_degree", "2", "--disable_tqdm", "true", "--learning_rate", "3e-3", *extra]


def _corpus(tmp_path: Path) -> Path:
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    path = tmp_path / "train.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(300)))
    return path


@pytest.mark.slow
def test_a_killed_rank_is_recovered_by_the_launcher(pools, tmp_path):
    """``kill -9`` of rank 2 of 4 once checkpoint-10 exists: torchrun ends the job, ``hf-hybrid-ep launch`` runs it
    again, it resumes from the newest complete checkpoint and finishes by itself; every logged loss equals an
    uninterrupted run's (the data order resumed) and expert_load.jsonl holds each step once."""
    import psutil

    text, out = _corpus(tmp_path), tmp_path / "run"
    reference = pools(4).run(cases.train_script, _train_args(tmp_path / "reference", text))[0]["losses"]
    command = [str(BIN / "hf-hybrid-ep"), "launch", "--max-restarts", "1", "--", str(BIN / "torchrun"),
               "--nproc_per_node", "4", str(ROOT / "scripts" / "train.py"),
               *_train_args(out, text, "--resume_from_checkpoint", "latest")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True).start()
    killed = False
    try:
        while job.poll() is None:
            if not killed and (out / "checkpoint-10").is_dir():
                ranks = [c for c in psutil.Process(job.pid).children(recursive=True)
                         if c.environ().get("LOCAL_RANK") == "2" and "train.py" in " ".join(c.cmdline())]
                if ranks:
                    os.kill(ranks[0].pid, signal.SIGKILL)
                    killed = not (out / "checkpoint-40").exists()
            time.sleep(0.05)
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    log = "".join(lines)
    assert killed and job.returncode == 0, log[-4000:]
    assert "attempt 1 failed with exit status" in log and "restarting the whole job" in log, log[-4000:]
    assert "resume_from_checkpoint=latest: no complete checkpoint in" in log  # the first attempt: a fresh start
    resumed = next(line for line in log.splitlines() if "resume_from_checkpoint=latest: resuming from" in line)
    step = int(resumed.rsplit("checkpoint-", 1)[1])
    assert step >= 10, resumed
    history = json.loads((out / "checkpoint-40" / "trainer_state.json").read_text())["log_history"]
    losses = {e["step"]: e["loss"] for e in history if "loss" in e}
    assert sorted(losses) == list(range(1, 41))
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(step + 1, 41))
    assert worst <= cases.REL_TOL, (worst, losses, reference)
    records = [json.loads(line)["step"] for line in (out / "expert_load.jsonl").read_text().splitlines()]
    assert records == list(range(1, 41)), records


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text("import os, subprocess, sys, time\nfrom pathlib import Path\n" + body)
    return path


def test_the_launcher_restarts_the_whole_job_and_ends_its_leftovers(tmp_path, capsys):
    """A job that fails once (leaving a child that would run for a minute) and succeeds the second time: one restart,
    the child of the failed attempt ended; a job that always fails: the restarts run out, its status is returned."""
    marker, child = tmp_path / "attempted", tmp_path / "child.pid"
    job = _script(tmp_path, f"""
if not Path({str(marker)!r}).exists():
    Path({str(marker)!r}).write_text("1")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path({str(child)!r}).write_text(str(sleeper.pid))
    sys.exit(3)
""")
    start = time.monotonic()
    assert supervise([sys.executable, str(job), "--resume_from_checkpoint", "latest"], 2) == 0
    assert time.monotonic() - start < 20
    pid = int(child.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended with the attempt (SIGTERM to its process group)
    err = capsys.readouterr().err
    assert "attempt 1 failed with exit status 3; restarting the whole job (1 of 2 restarts)" in err, err
    failing = _script(tmp_path, "sys.exit(5)\n")
    assert supervise([sys.executable, str(failing)], 1) == 5
    err = capsys.readouterr().err
    assert "passes no --resume_from_checkpoint" in err and "no restart left (--max-restarts 1)" in err, err


def test_the_launcher_rewrites_a_command_for_a_smaller_world(tmp_path):
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes=4", "scripts/train.py", "--ep_degree", "4",
               "--output_dir", "runs/x"]
    job = Job.of(command)
    assert (job.processes, job.output_dir) == (4, "runs/x")
    assert job.command(29600)[:4] == ["accelerate", "launch", "--main_process_port", "29600"]
    smaller = job.at_world(2, (2, 1))
    assert smaller.launcher == ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "scripts/train.py"]
    assert smaller.script == ["--ep_degree", "1", "--output_dir", "runs/x", "--dp_degree", "2"]
    torchrun = Job.of(["torchrun", "--nproc_per_node", "8", "train.py"]).at_world(6, None)
    assert torchrun.launcher == ["torchrun", "--nproc_per_node", "6", "train.py"] and torchrun.script == []
    # the planner lays the demo model (8 experts) out on the largest world below 4 it fits: 3 GPUs, dp 3 × ep 1
    assert smaller_world(4, 2, ROOT / "scripts" / "demo_assets", 4.0) == (3, (3, 1))
    assert smaller_world(4, 2, None, None) == (3, None)
    assert smaller_world(4, 2, ROOT / "scripts" / "demo_assets", 1e-6) is None  # nothing fits


def test_every_group_the_engine_creates_gets_the_collective_timeout(pools):
    for r in pools(4).run(cases.group_timeouts, 1, 4, 45.0):  # each expert on 2 ranks: groups of holder sets
        assert set(r["timeouts"].values()) == {45.0}, r
        assert {"ep", "edp", "reduction", "holders"} <= set(r["timeouts"]), r
        assert r["watchdog"] == 45.0, r


def test_report_prints_its_summary_and_flags_steps_logged_twice(tmp_path, capsys):
    from hf_hybrid_ep.cli import main as cli

    layer = {"tokens_per_expert": [3, 1], "tokens_per_rank": [3, 1], "imbalance_expert": 1.5, "imbalance_rank": 1.5,
             "dropped_fraction": 0.0, "dead_experts": 0}
    log = tmp_path / "expert_load.jsonl"
    log.write_text("".join(json.dumps({"step": s, "layers": {"model.layers.0.mlp.experts": layer}}) + "\n"
                           for s in (1, 2, 3, 2, 3, 4)))
    assert cli(["report", str(log), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "6 records, steps 1–4, 1 MoE layers" in out and "model.layers.0.mlp.experts: 1.50 → 1.50" in out, out
    assert "WARNING: step(s) [2, 3] logged more than once" in out, out
