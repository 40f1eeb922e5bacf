"""Fault drills with real processes and real signals: a stopped rank is named and every other rank exits; a killed
rank of two nodes is restarted by torchrun's elastic agent on both, the resumed run equal to an uninterrupted one;
the launcher ends what a dead agent leaves and launches again at a smaller world on one node.

The hang drill starts 4 ranks bare (as srun would: RANK, WORLD_SIZE, MASTER_ADDR/PORT; rank 0 hosts the c10d store)
running ``tests/fault_worker.py``; the recovery drill runs ``hf-hybrid-ep launch -- torchrun --nnodes 2 ...
scripts/train.py`` twice on this host, as two nodes meeting at one rendezvous endpoint, on the CPU (gloo).
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


@pytest.mark.slow
def test_a_stopped_worker_of_torchrun_does_not_hold_the_job_past_the_timeout():
    """The same stop under torchrun: its agent ends a failed job's workers with SIGTERM, which a stopped worker takes
    only once continued (the agent would wait out its 30 s grace, then SIGKILL it); the survivor that names it, a
    worker of the same agent, continues it, so that torchrun exits within the timeout + 30 s of the stop."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    job = subprocess.Popen([torchrun, "--standalone", "--nproc_per_node", "4", str(ROOT / "tests" / "fault_worker.py"),
                            str(TIMEOUT_S), "100000", "2", "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if "stopping" in line:
                break
        start = time.monotonic()
        reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
        reader.start()
        job.wait(timeout=TIMEOUT_S + 120)
        took = time.monotonic() - start
        reader.join(timeout=10)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text = "".join(lines)
    assert job.returncode != 0 and "continued the stopped worker PID" in text, text[-6000:]
    assert took < TIMEOUT_S + 30, (took, text[-6000:])


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


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


def _two_nodes(tmp_path: Path, restarts: int, *command: str) -> list[subprocess.Popen]:
    """``hf-hybrid-ep launch`` on two "nodes" of this host: two torchrun agents, ``--nnodes 2 --node_rank 0/1``,
    meeting at one rendezvous endpoint, each with 2 workers."""
    endpoint = f"127.0.0.1:{_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "LOGLEVEL": "INFO"}  # the agents' restarts
    env.pop("ACCELERATE_USE_CPU", None)
    return [subprocess.Popen([str(BIN / "hf-hybrid-ep"), "launch", "--max-restarts", str(restarts), "--",
                              str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node",
                              "2", "--rdzv-endpoint", endpoint, *command], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=tmp_path) for node in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rank_of_two_nodes_is_restarted_by_torchrun_on_both(pools, tmp_path):
    """``kill -9`` of rank 2 of 4 (2 nodes × 2) once checkpoint-10 exists: the agent of its node ends its workers
    and opens a new rendezvous round, the other node's agent joins it, both start their workers again (one restart
    of ``--max-restarts 1``), which resume from the newest complete checkpoint and finish; every logged loss equals
    an uninterrupted run's (the data order resumed) and expert_load.jsonl holds each step once."""
    import psutil

    text, out = _corpus(tmp_path), tmp_path / "run"
    reference = pools(4).run(cases.train_script, _train_args(tmp_path / "reference", text))[0]["losses"]
    fronts = _two_nodes(tmp_path, 1, str(ROOT / "scripts" / "train.py"), *_train_args(out, text))
    logs: list[list[str]] = [[], []]
    readers = [threading.Thread(target=lambda f=front, x=lines: x.extend(f.stdout), daemon=True)
               for front, lines in zip(fronts, logs, strict=True)]
    for reader in readers:
        reader.start()
    killed, agents = False, [set(), set()]
    try:
        while any(f.poll() is None for f in fronts):
            for front, pids in zip(fronts, agents, strict=True):
                pids.update(c.pid for c in _children(front.pid))
            if not killed and (out / "checkpoint-10").is_dir():
                ranks = [c for f in fronts if f.poll() is None for c in psutil.Process(f.pid).children(recursive=True)
                         if c.environ().get("RANK") == "2" and "train.py" in " ".join(c.cmdline())]
                if ranks:
                    os.kill(ranks[0].pid, signal.SIGKILL)
                    killed = not (out / "checkpoint-40").exists()
            time.sleep(0.05)
    finally:
        for front in fronts:
            if front.poll() is None:
                front.kill()
    for reader in readers:
        reader.join(timeout=30)
    log = "".join(logs[0] + logs[1])
    assert killed and [f.returncode for f in fronts] == [0, 0], log[-6000:]
    # one launch and one agent per node for the whole job; each agent restarted its workers (the failed rank's for
    # the failure, the other's for the new rendezvous round)
    assert [len(pids) for pids in agents] == [1, 1], agents
    for lines in logs:
        node = "".join(lines)
        assert node.count("hf-hybrid-ep launch: running") == 1 and "--rdzv-backend c10d" in node, node[-6000:]
        assert node.count("will restart worker group") == 1, node[-6000:]
    assert "failed (exitcode: -9)" in log, log[-6000:]
    assert "resume_from_checkpoint=latest: no complete checkpoint in" in log  # the first round: a fresh start
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
    path.write_text("import os, sys, time\nfrom pathlib import Path\n" + body)
    return path


def _front(tmp_path: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(BIN / "hf-hybrid-ep"), "launch", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)


def _running(process) -> bool:
    """Alive and not a zombie (an orphan's parent may be slow to reap it)."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_front_ends_the_workers_a_killed_agent_leaves(tmp_path):
    """torchrun starts each worker in a session of its own: ``kill -9`` of the agent leaves them running, out of
    reach of its process group. The front ends them and returns the agent's status; it does not launch again."""
    import psutil

    pids = tmp_path / "pids"
    pids.mkdir()
    worker = _script(tmp_path, f"Path({str(pids)!r}, str(os.getpid())).touch()\ntime.sleep(600)\n")
    front = _front(tmp_path, "--max-restarts", "2", "--", str(BIN / "torchrun"), "--nproc_per_node", "2", str(worker))
    try:
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline and front.poll() is None:
            time.sleep(0.1)
        workers = [psutil.Process(int(p.name)) for p in pids.iterdir()]
        assert len(workers) == 2 and all(w.ppid() != front.pid for w in workers), front.poll()
        agent = workers[0].parent()
        assert "torchrun" in " ".join(agent.cmdline()) and agent.ppid() == front.pid
        assert all(os.getsid(w.pid) != os.getsid(agent.pid) for w in workers)  # their own sessions
        agent.kill()
        front.wait(timeout=60)
        alive = [w for w in workers if _running(w)]  # the front returns once they are gone
    finally:
        for p in [front, *(psutil.Process(int(p.name)) for p in pids.iterdir() if psutil.pid_exists(int(p.name)))]:
            p.kill()
    log = front.stdout.read()
    assert not alive, (alive, log[-3000:])
    assert front.returncode == 128 + signal.SIGKILL, log[-3000:]
    assert f"ended 2 process(es) the launch left running (PIDs {sorted(w.pid for w in workers)})" in log, log
    assert log.count("hf-hybrid-ep launch: running") == 1, log  # the agent's restarts are the restarts


def test_the_front_launches_again_at_a_smaller_world_on_one_node(tmp_path):
    """A job that cannot start at 3 processes (a lost GPU, played by the worker) fails through torchrun's restarts
    without a checkpoint: the front launches it again at 2 (--min-processes 2) and it finishes."""
    worker = _script(tmp_path, "sys.exit(3 if os.environ['WORLD_SIZE'] == '3' else 0)\n")
    front = _front(tmp_path, "--max-restarts", "1", "--min-processes", "2", "--", str(BIN / "torchrun"),
                   "--nproc_per_node", "3", str(worker))
    log = front.communicate(timeout=240)[0]
    assert front.returncode == 0, log[-3000:]
    runs = [line for line in log.splitlines() if line.startswith("hf-hybrid-ep launch: running")]
    assert [r.split("--nproc_per_node ")[1].split()[0] for r in runs] == ["3", "2"], runs
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r and "--max-restarts 1 --standalone" in r for r in runs)
    assert "launching again at 2 processes instead of 3, the engine's default layout" in log, log
    assert "the launch ended with exit status 1 (torchrun's restarts: --max-restarts 1)" in log, log


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
