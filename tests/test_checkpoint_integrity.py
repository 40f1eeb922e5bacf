"""Claims, manifests and verified loads: a checkpoint is whole, from one save, and unchanged — or refused.

Crash injection is in ``test_crash_safety.py``; these are the refusals and checks a user meets.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import save_source

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError
from hf_hybrid_ep.checkpoint.atomic import open_checkpoint
from hf_hybrid_ep.checkpoint.inspect import format_summary, inspect_checkpoint
from hf_hybrid_ep.checkpoint.lease import STALE_AFTER_S, holder_record
from hf_hybrid_ep.checkpoint.manifest import MANIFEST_KEY, SAVE_ID_KEY
from hf_hybrid_ep.checkpoint.safetensors_io import read_header
from hf_hybrid_ep.inference.offload import load_offloaded
from hf_hybrid_ep.integrations import save_hybrid_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sources")
    return save_source("mixtral", root / "a", seed=0), save_source("mixtral", root / "b", seed=1)


def _convert(src: Path, out: Path, ep: int = 2) -> Path:
    return hep.convert_checkpoint(src, out, ep_degree=ep, progress=False)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_every_file_is_in_the_manifest_and_every_safetensors_file_carries_the_save_id(sources, tmp_path):
    out = _convert(sources[0], tmp_path / "out")
    manifest = json.loads((out / INDEX).read_text())["metadata"][MANIFEST_KEY]
    on_disk = sorted(p.name for p in out.iterdir() if p.name != INDEX)
    assert sorted(manifest["files"]) == on_disk
    for name in on_disk:
        if name.endswith(".safetensors"):
            assert read_header(out / name)[1][SAVE_ID_KEY] == manifest["save_id"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no claim or staging left"


def test_the_index_records_a_folder_name_never_a_local_path(sources, tmp_path):
    out = _convert(sources[0], tmp_path / "out")
    index = (out / INDEX).read_text()
    assert json.loads(index)["metadata"]["hybrid_ep"]["source"] == {"folder": sources[0].name}
    assert str(sources[0].parent) not in index
    again = _convert(out, tmp_path / "resharded", ep=4)  # a reshard keeps the record
    assert json.loads((again / INDEX).read_text())["metadata"]["hybrid_ep"]["source"] == {"folder": "a"}


def test_an_existing_output_is_refused_before_the_source_is_read(sources, tmp_path, monkeypatch):
    import hf_hybrid_ep.model_io.convert as convert

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the source was read before the output was checked")

    monkeypatch.setattr(convert, "resolve_source", must_not_run)
    with pytest.raises(CheckpointError, match="already exists"):
        _convert(sources[0], out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_live_claim_fails_a_second_writer_at_once_naming_it_and_what_to_do(sources, tmp_path, caplog):
    """A claim of a running process on this host (this test's own: PID and start time match) and one of another
    host with a fresh heartbeat refuse a second writer; the other host's, once its heartbeat is older than
    STALE_AFTER_S, is cleared with a warning."""
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    lock.write_text(json.dumps(holder_record(save_id="x")))
    with pytest.raises(CheckpointError, match=f"PID {os.getpid()} on this host .*wait for PID {os.getpid()} to "
                                              "finish, or stop it"):
        _convert(sources[0], out)
    lock.write_text(json.dumps({**holder_record(save_id="x"), "host": "node-17", "pid": 1, "run_id": "other"}))
    with pytest.raises(CheckpointError, match=f"PID 1 on host 'node-17'.*once its heartbeat is {STALE_AFTER_S:.0f} "
                                              "s old"):
        _convert(sources[0], out)
    assert not out.exists() and lock.is_file(), "another host's claim with a fresh heartbeat is left"
    os.utime(lock, (time.time() - STALE_AFTER_S - 5,) * 2)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid_ep"):
        _convert(sources[0], out)
    assert "taking over the save claim of out from PID 1 on host 'node-17'" in caplog.text
    assert f"over the {STALE_AFTER_S:.0f} s after which a holder on host 'node-17' counts as gone" in caplog.text
    assert not lock.exists()


def test_a_dead_writers_claim_and_staging_are_removed_and_reported(sources, tmp_path, caplog):
    out, pid = tmp_path / "out", _dead_pid()
    claim = {**holder_record(save_id="dead"), "pid": pid}  # its process ended: /proc/PID is gone
    (tmp_path / ".out.lock").write_text(json.dumps(claim))
    container = tmp_path / ".out.new-dead"
    (container / "out").mkdir(parents=True)
    (container / "claim.json").write_text(json.dumps(claim))
    (container / "out" / "half.safetensors").write_bytes(b"\0" * 2**20)
    foreign = tmp_path / ".out.new-other"  # another host's, but that host holds no claim of out: it is gone
    foreign.mkdir()
    (foreign / "claim.json").write_text(json.dumps({**claim, "host": "node-17"}))
    with caplog.at_level(logging.WARNING, logger="hf_hybrid_ep"):
        _convert(sources[0], out)
    assert not container.exists() and not foreign.exists()
    assert f"PID {pid} on host {socket.gethostname()!r}, no longer running" in caplog.text and "1.0 MiB" in caplog.text
    assert "host 'node-17'" in caplog.text


def test_staging_of_other_targets_without_a_live_claim_is_removed_by_the_next_save_into_the_directory(
        sources, tmp_path, caplog):
    """A full disk can leave a container with no claim file and no lock (the save of checkpoint-5, say); the next
    save into the same directory, of any target, removes it and says so. Containers whose target is claimed by a
    live writer (this host) or by another host are left."""
    orphan = tmp_path / ".checkpoint-5.new-0123"
    (orphan / "checkpoint-5").mkdir(parents=True)
    (orphan / "checkpoint-5" / "model.safetensors").write_bytes(b"\0" * 2**20)
    live, remote = tmp_path / ".checkpoint-6.new-4567", tmp_path / ".checkpoint-7.new-89ab"
    for container, claim in ((live, holder_record()), (remote, {**holder_record(), "host": "node-17", "pid": 1, "run_id": None})):
        container.mkdir()
        (tmp_path / f".{container.name.split('.')[1]}.lock").write_text(json.dumps({**claim, "save_id": "x"}))
    with caplog.at_level(logging.WARNING, logger="hf_hybrid_ep"):
        _convert(sources[0], tmp_path / "out")
    assert not orphan.exists() and live.exists() and remote.exists()
    assert "removing" in caplog.text and "checkpoint-5 (a writer that recorded no claim (a full disk?))" in caplog.text
    assert "1.0 MiB" in caplog.text
    assert f"checkpoint-6 is being written by PID {os.getpid()}" in caplog.text and "'node-17'" in caplog.text


def test_files_of_two_saves_are_refused_naming_them(sources, tmp_path):
    a = _convert(sources[0], tmp_path / "a")
    b = _convert(sources[1], tmp_path / "b")
    rank_file = "model-experts-rank001-of-002.safetensors"
    shutil.copy2(b / rank_file, a / rank_file)  # same size, other save
    with pytest.raises(CheckpointError, match=f"{rank_file}: written by save .*a mixed checkpoint"):
        hep.from_pretrained(a)
    with pytest.raises(CheckpointError, match=f"mixes files of different saves.*{rank_file}"):
        hep.convert_checkpoint(a, tmp_path / "c", ep_degree=4, progress=False)


def test_a_flipped_byte_is_refused_by_every_loader_naming_the_file(sources, tmp_path):
    out = _convert(sources[0], tmp_path / "out")
    reference = hep.from_pretrained(out)
    victim = "model-experts-rank000-of-002.safetensors"
    data = bytearray((out / victim).read_bytes())
    data[-5] ^= 0x40
    (out / victim).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim}: checksum mismatch"):
        hep.from_pretrained(out)
    with pytest.raises(CheckpointError, match=f"{victim}: checksum mismatch"):
        load_offloaded(out, capacity=2)
    unverified = hep.from_pretrained(out, verify=False)  # size and save id still checked; the hash skipped
    changed = [n for n, p in unverified.named_parameters()
               if not torch.equal(p, dict(reference.named_parameters())[n])]
    assert changed, "verify=False loads the flipped byte: the check it skips is real"


def test_a_changed_index_is_refused(sources, tmp_path):
    out = _convert(sources[0], tmp_path / "out")
    body = json.loads((out / INDEX).read_text())
    body["metadata"]["hybrid_ep"]["placement"] = body["metadata"]["hybrid_ep"]["placement"][::-1]
    (out / INDEX).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="does not match its recorded digest"):
        hep.from_pretrained(out)


def test_inspect_says_when_a_checkpoint_records_no_checksums(sources, tmp_path):
    plain = format_summary(inspect_checkpoint(sources[0]))
    assert "no checksums recorded" in plain
    converted = format_summary(inspect_checkpoint(_convert(sources[0], tmp_path / "out"), verify=True))
    assert "no checksums recorded" not in converted and "every file listed" in converted


def _tiny_parallel_model(seed: int):
    from tiny_models import build_tiny_model

    torch.manual_seed(seed)
    model = build_tiny_model("mixtral", num_experts=4)
    return hep.parallelize(model, hep.HybridEPConfig())


def test_save_hybrid_checkpoint_replaces_an_earlier_one_whole_and_merges_into_a_run_directory(tmp_path):
    out = tmp_path / "ckpt"
    save_hybrid_checkpoint(_tiny_parallel_model(0), out)
    first = json.loads((out / INDEX).read_text())["metadata"][MANIFEST_KEY]["save_id"]
    save_hybrid_checkpoint(_tiny_parallel_model(1), out)
    manifest = json.loads((out / INDEX).read_text())["metadata"][MANIFEST_KEY]
    assert manifest["save_id"] != first
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], INDEX])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no staging, claim or old copy left"
    open_checkpoint(out).check_all()

    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "expert_load.jsonl").write_text("{}\n")
    save_hybrid_checkpoint(_tiny_parallel_model(0), run)
    assert (run / "checkpoint-2").is_dir() and (run / "expert_load.jsonl").is_file()
    open_checkpoint(run).check_all()
    hep.from_pretrained(run)
