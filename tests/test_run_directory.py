"""A run's output directory, with real processes (``torchrun scripts/train.py``, 2 CPU ranks, the tiny demo MoE): one
run at a time (its lease), save claims that a reused PID or another host cannot fake, the start-up summary a user
sees with default settings, and what ``export`` and ``convert`` make of its checkpoints."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_hybrid_ep.checkpoint.lease import (
    RUN_LEASE_NAME,
    STALE_AFTER_S,
    Holder,
    holder_record,
    judge,
    read_holder,
)
from hf_hybrid_ep.checkpoint.manifest import is_complete
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.integrations.launch import Job, run_id
from hf_hybrid_ep.integrations.supervise import supervise

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ARGS = ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--report_to", "none", "--block_size", "32",
        "--ep_degree", "2"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    env.pop("ACCELERATE_USE_CPU", None)
    env.pop("HF_HYBRID_EP_RUN_ID", None)
    env.update(extra)
    return env


def _command(out: Path, *args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(ROOT / "scripts" / "train.py"),
            "--output_dir", str(out), *ARGS, *args]


def _train(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, *args), env=_env(**env), capture_output=True, text=True, timeout=600,
                          cwd=out.parent)


def _log(run: subprocess.CompletedProcess) -> str:
    return run.stderr.replace("\r", "\n")  # tqdm's bars share lines with the log


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _leftover_locks(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.endswith((".lock", ".lease")) or ".taken-" in p.name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run of 2 steps (checkpoint-2) into an output directory whose lease a killed run left behind."""
    out = tmp_path_factory.mktemp("trained") / "run"
    out.mkdir()
    (out / RUN_LEASE_NAME).write_text(json.dumps({**holder_record(output_dir=str(out)), "pid": _dead_pid()}))
    return out, _train(out, "--max_steps", "2", "--save_steps", "2")


@pytest.mark.slow
def test_a_run_takes_over_the_lease_of_a_run_that_is_gone_and_leaves_no_lease_or_claim(trained):
    out, run = trained
    assert run.returncode == 0, _log(run)[-3000:]
    log = _log(run)
    assert f"taking over the output directory {str(out)!r} from PID" in log and "is not running" in log, log[-3000:]
    assert _leftover_locks(out) == [], "the run lease is released at exit, each save claim when its save is in place"


@pytest.mark.slow
def test_the_start_up_summary_is_shown_once_with_default_settings(trained):
    out, run = trained
    log = _log(run)
    assert log.count("hybrid EP: 2 rank(s) = dp 1 × ep 2 on 1 node(s) of 2 rank(s); an EP group spans 1 node(s)") == 1, log
    assert "  dispatcher 'auto' -> torch (auto: predicted per token and MoE layer" in log
    assert f"  starting fresh (output directory {out})" in log


@pytest.mark.slow
def test_export_writes_the_model_files_only(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    checkpoint = trained[0] / "checkpoint-2"
    assert {"trainer_state.json", "optimizer.json", "tokenizer.json"} <= {p.name for p in checkpoint.iterdir()}
    assert cli(["export", str(checkpoint), str(tmp_path / "plain")]) == 0
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert "trainer_state.json" not in names and "optimizer.json" not in names, names
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(names), names
    dropped = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dropped"))
    assert "optimizer.json, " in dropped and "trainer_state.json, " in dropped and "training state" in dropped, dropped
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "plain") is not None


@pytest.mark.slow
def test_convert_and_export_refuse_an_output_inside_a_checkpoint(trained, capsys):
    checkpoint = trained[0] / "checkpoint-2"
    before = sorted(p.name for p in checkpoint.iterdir())
    for command in (["convert", "--ep-degree", "2"], ["export"]):
        assert cli([*command, str(checkpoint), str(checkpoint / "inner")]) == 2
        err = capsys.readouterr().err
        assert f"is inside the checkpoint {str(checkpoint)!r}: write it outside any checkpoint" in err, err
    assert sorted(p.name for p in checkpoint.iterdir()) == before and is_complete(checkpoint)


@pytest.mark.slow
def test_a_second_run_on_the_same_output_directory_is_refused_naming_the_first(tmp_path):
    """Run A trains; run B on the same --output_dir stops at start with a message naming A (host, PID) and writes
    nothing there: every step of expert_load.jsonl is logged once, by A."""
    out = tmp_path / "run"
    first = subprocess.Popen(_command(out, "--max_steps", "100000", "--save_steps", "100000"), env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not ((out / "expert_load.jsonl").is_file() and (out / "expert_load.jsonl").read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "run A did not start training"
            time.sleep(0.5)
        second = _train(out, "--max_steps", "2", "--save_steps", "2")
        holder = read_holder(out / RUN_LEASE_NAME)
        steps = [json.loads(line)["step"] for line in (out / "expert_load.jsonl").read_text().splitlines()]
        assert first.poll() is None, "run A is still training"
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=120)
    assert second.returncode != 0, _log(second)[-3000:]
    assert holder is not None
    assert (f"train.py: error: output directory {str(out)!r} is in use by another run: PID {holder.record['pid']} on "
            f"this host {holder.record['host']!r}") in second.stderr, second.stderr[-3000:]
    assert "give this run another --output_dir, or wait for PID" in second.stderr
    assert len(steps) == len(set(steps)) and not (out / "checkpoint-2").exists(), steps


@pytest.mark.slow
def test_claims_of_a_reused_pid_of_another_host_or_of_a_finished_save_do_not_block_a_run(tmp_path):
    """Claims left behind: checkpoint-2's names a PID that now belongs to another live process (it started at
    another time), checkpoint-4's another host whose heartbeat stopped long ago, checkpoint-9's a process that ended;
    the run lease is held on another host by an earlier attempt of this job (same HF_HYBRID_EP_RUN_ID, fresh
    heartbeat). The run saves both checkpoints, says what it cleared and why, and leaves no lock behind."""
    out = tmp_path / "run"
    out.mkdir()
    me = holder_record()
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # alive, not the writer
    try:
        claims = {"checkpoint-2": {**me, "pid": reused.pid, "start_time": 1},
                  "checkpoint-4": {**me, "host": "node-17", "pid": 4242, "run_id": "an-old-job"},
                  "checkpoint-9": {**me, "pid": _dead_pid()}}
        for name, record in claims.items():
            (out / f".{name}.lock").write_text(json.dumps({**record, "save_id": "left"}))
        stale = time.time() - STALE_AFTER_S - 30
        os.utime(out / ".checkpoint-4.lock", (stale, stale))
        (out / RUN_LEASE_NAME).write_text(json.dumps({**me, "host": "node-17", "pid": 77, "run_id": "job-7"}))
        run = _train(out, "--max_steps", "4", "--save_steps", "2", HF_HYBRID_EP_RUN_ID="job-7")
    finally:
        reused.kill()
        reused.wait()
    log = _log(run)
    assert run.returncode == 0, log[-3000:]
    assert (f"taking over the save claim of checkpoint-2 from PID {reused.pid} on this host {me['host']!r}" in log
            and f"PID {reused.pid} is now another process" in log), log[-3000:]
    assert (f"removing the save claim {str(out / '.checkpoint-4.lock')!r} of PID 4242 on host 'node-17'" in log and
            f"over the {STALE_AFTER_S:.0f} s after which a holder on host 'node-17' counts as gone" in log), log[-3000:]
    assert f"removing the save claim {str(out / '.checkpoint-9.lock')!r}" in log and "is not running" in log
    assert ("from PID 77 on host 'node-17' (run job-7" in log
            and "it is an earlier attempt of this job (run id job-7)" in log), log[-3000:]
    assert is_complete(out / "checkpoint-2") and is_complete(out / "checkpoint-4")
    assert _leftover_locks(out) == []


def test_every_round_of_a_launched_job_has_the_same_run_id(tmp_path, monkeypatch):
    """``hf-hybrid-ep launch`` gives every round torchrun restarts one HF_HYBRID_EP_RUN_ID (drawn once on one node
    unless it was given): the interface by which a restarted rank 0 takes over its own run's lease and claims."""
    monkeypatch.delenv("HF_HYBRID_EP_RUN_ID", raising=False)
    seen = tmp_path / "seen.txt"
    job = tmp_path / "job.py"
    job.write_text(f"import os, sys\nwith open({str(seen)!r}, 'a') as f:\n"
                   f"    f.write(os.environ.get('HF_HYBRID_EP_RUN_ID', '(unset)') + '\\n')\n"
                   f"sys.exit(0 if len(open({str(seen)!r}).readlines()) == 2 else 3)\n")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    assert supervise([torchrun, "--nproc_per_node", "1", str(job)], 1) == 0
    ids = seen.read_text().split()
    assert len(ids) == 2 and ids[0] == ids[1] != "(unset)", ids
    assert "HF_HYBRID_EP_RUN_ID" not in os.environ, "the launcher's own environment is left as it was"


def test_the_nodes_of_a_launched_job_derive_one_run_id(monkeypatch):
    """Every node's front derives the same run id without being told one: torchrun's --rdzv-id when given, else the
    endpoint and the output directory; a given HF_HYBRID_EP_RUN_ID wins."""
    monkeypatch.delenv("HF_HYBRID_EP_RUN_ID", raising=False)

    def of(rank: int, *extra: str) -> str:
        return run_id(Job.of(["torchrun", "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "2",
                              "--rdzv-endpoint", "head:29500", *extra, "train.py", "--output_dir", "runs/x"]))

    assert of(0) == of(1)
    assert of(0, "--rdzv-id", "job-7") == of(1, "--rdzv-id", "job-7") == "job-7"
    monkeypatch.setenv("HF_HYBRID_EP_RUN_ID", "given")
    assert of(0) == of(1) == "given"


def _holder(record: dict, age_s: float = 0.0) -> Holder:
    raw = json.dumps(record).encode()
    return Holder(Path("lease"), record, raw, age_s)


def test_a_holder_is_alive_only_if_its_pid_and_start_time_match_or_its_heartbeat_is_fresh(monkeypatch):
    """The verdicts on real processes: this one (alive), a live process under a recorded PID with another start time
    (gone: the PID was reused), an ended one (gone); a holder on another host by its heartbeat, and at once when it
    is an earlier attempt of this process's own job; a live holder of the same job on this host stays alive."""
    monkeypatch.delenv("HF_HYBRID_EP_RUN_ID", raising=False)
    me = holder_record()
    assert judge(_holder(me)).alive and judge(_holder(me)).exact
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reused = judge(_holder({**me, "pid": other.pid}))  # the PID runs, but it is not the process that wrote this
    finally:
        other.kill()
        other.wait()
    assert not reused.alive and f"PID {other.pid} is now another process" in reused.why
    assert not judge(_holder({**me, "pid": _dead_pid()})).alive
    remote = {**me, "host": "node-17", "pid": 1, "run_id": "job-1"}
    assert judge(_holder(remote, STALE_AFTER_S / 2)).alive
    gone = judge(_holder(remote, STALE_AFTER_S + 1))
    assert not gone.alive and "counts as gone" in gone.why and not gone.exact
    assert judge(_holder({}, 1.0)).alive and not judge(_holder({}, STALE_AFTER_S + 1)).alive  # a half-written lease
    monkeypatch.setenv("HF_HYBRID_EP_RUN_ID", "job-1")
    earlier = judge(_holder(remote, 1.0))
    assert not earlier.alive and "earlier attempt of this job" in earlier.why
    assert judge(_holder({**me, "run_id": "job-1"})).alive  # checked on its process first: the same job twice


def test_the_trainers_verbosity_decides_whether_the_summary_is_shown(tmp_path, caplog):
    """Under the Trainer the summary is logged at warning, once, unless transformers' verbosity is above it
    (``--log_level error``)."""
    import torch
    from datasets import Dataset
    from tiny_models import build_tiny_model
    from transformers import Trainer, TrainingArguments

    import hf_hybrid_ep as hep
    from hf_hybrid_ep.integrations import HybridEP

    def summaries(out: Path, log_level: str) -> list[str]:
        torch.manual_seed(0)
        model = hep.parallelize(build_tiny_model("qwen3_moe", num_experts=4))
        rows = [list(range(1, 9))] * 4
        data = Dataset.from_dict({"input_ids": rows, "labels": rows})
        args = TrainingArguments(str(out), max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True,
                                 save_strategy="no", log_level=log_level, disable_tqdm=True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_hybrid_ep"):
            HybridEP(Trainer)(model=model, args=args, train_dataset=data).train()
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("hybrid EP:")]

    shown = summaries(tmp_path / "a", "passive")
    assert len(shown) == 1 and "starting fresh" in shown[0], shown
    assert not (tmp_path / "a" / RUN_LEASE_NAME).exists(), "train() releases the lease it took when it returns"
    assert summaries(tmp_path / "b", "error") == []


def test_a_lease_taken_over_meanwhile_is_reported_by_its_old_holder_and_never_removed_by_it(tmp_path, caplog):
    from hf_hybrid_ep.checkpoint.lease import hold_output_dir

    lease = hold_output_dir(tmp_path)
    assert lease is not None and hold_output_dir(tmp_path) is None, "a second call in the same process: a no-op"
    other = {**holder_record(output_dir=str(tmp_path)), "host": "node-17", "pid": 1}
    (tmp_path / RUN_LEASE_NAME).write_text(json.dumps(other))  # as a process that took it over would
    with caplog.at_level(logging.ERROR, logger="hf_hybrid_ep"):
        lease.beat()
    assert "is no longer its own (now held by PID 1 on host 'node-17'" in caplog.text
    lease.release()
    assert json.loads((tmp_path / RUN_LEASE_NAME).read_text()) == other
