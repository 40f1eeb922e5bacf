"""Crash injection for saves: run one save in a forked child that ``os._exit``s at its k-th write point.

Run as ``python tests/crash_driver.py WORKDIR`` (a fresh process with one thread, so forking is safe);
prints one JSON object: per scenario, the write points of a complete save and, for every k, what the
target was after a crash there (``old``, ``new``, ``absent`` or ``refused: <message>``), plus the
corrupted-byte outcomes. An exception (not ``os._exit``) would run the cleanup and prove nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

import hf_hybrid_ep as hep  # noqa: E402
from hf_hybrid_ep.checkpoint import safetensors_io  # noqa: E402
from hf_hybrid_ep.checkpoint.atomic import open_checkpoint  # noqa: E402
from hf_hybrid_ep.checkpoint.manifest import NOT_LISTED  # noqa: E402
from hf_hybrid_ep.checkpoint.safetensors_io import CheckpointError  # noqa: E402
from hf_hybrid_ep.model_io.convert import convert_checkpoint  # noqa: E402

CRASH_EXIT = 17


def _instrument_trainer_writes() -> None:
    """The Trainer's own files (torch.save, trainer_state.json) and PEFT's (adapter weights and config) are write
    points too."""
    import peft.config
    import peft.peft_model
    import transformers.trainer as trainer_module
    from transformers.trainer_callback import TrainerState

    original_save, original_json = torch.save, TrainerState.save_to_json
    original_weights, original_config = peft.peft_model.safe_save_file, peft.config.PeftConfigMixin.save_pretrained

    def save_weights(tensors, filename, *args, **kwargs):
        safetensors_io.write_point(f"open {Path(filename).name}")
        original_weights(tensors, filename, *args, **kwargs)
        safetensors_io.write_point(f"close {Path(filename).name}")

    def save_config(self, save_directory, *args, **kwargs):
        safetensors_io.write_point("open adapter_config.json")
        original_config(self, save_directory, *args, **kwargs)
        safetensors_io.write_point("close adapter_config.json")

    peft.peft_model.safe_save_file = save_weights
    peft.config.PeftConfigMixin.save_pretrained = save_config

    def save(obj, f, *args, **kwargs):
        safetensors_io.write_point(f"open {Path(str(f)).name}")
        original_save(obj, f, *args, **kwargs)
        safetensors_io.write_point(f"close {Path(str(f)).name}")

    def save_to_json(self, path):
        safetensors_io.write_point(f"open {Path(path).name}")
        original_json(self, path)
        safetensors_io.write_point(f"close {Path(path).name}")

    torch.save = trainer_module.torch.save = save
    TrainerState.save_to_json = save_to_json


def digest(root: Path) -> dict[str, str] | None:
    """Tensor content of a checkpoint directory's safetensors files, save ids left out (two saves of
    one model state digest equal; pickles such as the RNG state are not byte-deterministic)."""
    if not root.is_dir():
        return None
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        out[path.name] = hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data[8 + n :]).hexdigest()
    return out


def identity(root: Path) -> tuple[str, dict[str, str]] | None:
    """``(save id, tensor digest)`` of a complete checkpoint that passes every check; ``None`` if absent.

    Complete: exactly the files its manifest lists are on disk, each with its size, sha256 and (for
    safetensors) save id — so all of them come from that one save."""
    checker = open_checkpoint(root, verify=True)  # completes or rolls back an interrupted portable commit
    if not root.is_dir():
        return None
    if checker.manifest is None:
        raise CheckpointError(f"{root}: no manifest")
    checker.check_all()
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
               and not any(part.startswith(".") for part in p.relative_to(root).parts)}
    listed = set(checker.manifest["files"])
    if on_disk - set(NOT_LISTED) != listed:
        raise CheckpointError(f"{root}: files {sorted((on_disk - set(NOT_LISTED)) ^ listed)} not in the manifest")
    return checker.save_id, digest(root)


def run_forked(action: Callable[[], None], crash_at: int | None, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run ``action`` in a forked child that exits at its ``crash_at``-th write point; return its exit
    code and the write points it passed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        os.environ.update(env or {})
        seen = 0

        def hook(name: str) -> None:
            nonlocal seen
            seen += 1
            os.write(write, (name + "\n").encode())
            if crash_at is not None and seen == crash_at:
                os._exit(CRASH_EXIT)

        safetensors_io._write_point = hook
        try:
            action()
        except CheckpointError as err:
            os.write(write, ("REFUSED " + str(err).replace("\n", " ") + "\n").encode())
            os._exit(3)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode().splitlines()


def load_in_child(load: Callable[[Path], None], path: Path) -> str | None:
    """Run a loader in a forked child (it must not change the parent's model); its refusal, if any."""
    code, lines = run_forked(lambda: load(path), None)
    if code == 0:
        return None
    refusal = next((ln for ln in lines if ln.startswith("REFUSED ")), None)
    if refusal is None:
        raise RuntimeError(f"loading {path} failed with exit code {code} (not a CheckpointError)")
    return "refused: " + refusal.removeprefix("REFUSED ")


def outcome(target: Path, old: tuple | None, new: dict, load: Callable[[Path], None]) -> str:
    """What a reader finds at ``target`` after a crash: the old checkpoint, a complete new one (a save id
    other than the old one's, the new tensors), nothing, or a refusal."""
    try:
        found = identity(target)  # completes or rolls back an interrupted portable commit first
    except CheckpointError as err:
        return f"refused: {err}"
    if found is None:
        return "absent"
    refused = load_in_child(load, target)
    if refused:
        return refused
    save_id, tensors = found
    if old is not None and save_id == old[0] and tensors == old[1]:
        return "old"
    if (old is None or save_id != old[0]) and tensors == new:
        return "new"
    return f"MIXED: save {save_id}, tensors differing in {sorted(k for k in set(tensors) | set(new) if tensors.get(k) != new.get(k))}"


def crash_every_point(name: str, target: Path, before: Callable[[], None], action: Callable[[], None],
                      old: tuple | None, new: dict, load: Callable[[Path], None],
                      env: dict[str, str] | None = None, from_point: str | None = None) -> dict:
    """Crash ``action`` at each of its write points (from ``from_point`` on, if given) and classify."""
    before()
    code, points = run_forked(action, None, env)
    assert code == 0, f"{name}: the save without a crash failed ({code})"
    got = digest(target) or {}
    assert got == new, f"{name}: a complete save does not reproduce the expected tensors: " + str(
        sorted(k for k in set(got) | set(new) if got.get(k) != new.get(k)))
    results = []
    first = points.index(from_point) + 1 if from_point else 1
    for k in range(first, len(points) + 1):
        before()
        code, passed = run_forked(action, k, env)
        results.append({"k": k, "point": points[k - 1], "exit": code,
                        "outcome": outcome(target, old, new, load)})
    before()
    run_forked(action, max(1, len(points) // 2), env)
    code, _ = run_forked(action, None, env)  # a save after a crash: stale claim and staging cleaned up
    leftovers = sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))
    return {"points": points, "crashes": results, "save_after_crash": code, "leftovers": leftovers,
            "after_crash_outcome": outcome(target, old, new, load)}


def _training_saves(work: Path, model: torch.nn.Module, portable: bool) -> dict:
    """A Trainer save of ``model`` (parallelized in a world of one) over an existing ``checkpoint-2`` of other
    weights, crashed at every write point (and, with ``portable``, through the two-rename commit); then one byte
    flipped in each file of a complete save, each copy resumed from."""
    from trainer_cases import arguments, dataset
    from transformers import Trainer

    from hf_hybrid_ep.integrations.trainer import HybridEP

    report: dict = {}
    trainer = HybridEP(Trainer)(model, arguments(str(work / "run"), 2, 2, save_steps=2), train_dataset=dataset(16))
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    trainer.state.global_step = 2
    run = work / "run"
    target = run / "checkpoint-2"
    pristine_old = work / "old-checkpoint-2"
    trained = [p for p in model.parameters() if p.requires_grad]

    with torch.no_grad():  # the old checkpoint: other weights
        for p in trained:
            p.add_(0.5)
    trainer._save_checkpoint(trainer.model, None)
    shutil.move(target, pristine_old)
    with torch.no_grad():
        for p in trained:
            p.sub_(0.5)
    old = identity(pristine_old)

    def reset_run() -> None:
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        shutil.copytree(pristine_old, target)

    def train_save() -> None:
        trainer._save_checkpoint(trainer.model, None)

    def load_training(path: Path) -> None:
        trainer._load_from_checkpoint(str(path))
        trainer._load_optimizer_and_scheduler(str(path))

    reset_run()
    _, _ = run_forked(train_save, None)
    new = digest(target)
    assert new != old[1]
    report["exchange"] = crash_every_point("train", target, reset_run, train_save, old, new, load_training)
    if portable:  # staging is the same code as above, so crash from the index write on
        report["portable"] = crash_every_point("train-portable", target, reset_run, train_save, old, new,
                                               load_training, env={"HF_HYBRID_EP_NO_RENAME_EXCHANGE": "1"},
                                               from_point="index written")

    reset_run()
    train_save()
    report["config"] = json.loads((target / "config.json").read_text()) if (target / "config.json").is_file() else {}
    corrupt = []
    for path in sorted(p for p in target.iterdir() if p.is_file() and p.name != "README.md"):  # the model card
        copy = work / "corrupt" / "checkpoint-2"
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(target, copy)
        data = bytearray((copy / path.name).read_bytes())
        data[len(data) // 2] ^= 0x10
        (copy / path.name).write_bytes(bytes(data))
        corrupt.append({"file": path.name, "outcome": load_in_child(load_training, copy) or "loaded"})
    report["corrupted_byte"] = corrupt
    return report


def main(work: Path) -> dict:
    from dist_cases.lora import lora_config
    from peft import get_peft_model
    from tiny_models import build_tiny_model

    _instrument_trainer_writes()
    report: dict = {}

    # ---------------------------------------------------------------- a training save over checkpoint-2
    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    source_use_cache = model.config.use_cache
    hep.parallelize(model, hep.HybridEPConfig())
    full = _training_saves(work / "full", model, portable=True)
    report["train_save_exchange"], report["train_save_portable"] = full["exchange"], full["portable"]
    report["use_cache"] = {"source": source_use_cache, "during_training": model.config.use_cache,
                           "saved": full["config"].get("use_cache")}
    report["corrupted_byte"] = full["corrupted_byte"]

    # ---------------------------------------------------------------- the same, of a PeftModel's adapters
    torch.manual_seed(0)
    peft_model = hep.parallelize(get_peft_model(build_tiny_model("qwen3_moe", num_experts=4),
                                                lora_config("qwen3_moe")), hep.HybridEPConfig())
    adapters = _training_saves(work / "adapters", peft_model, portable=False)
    report["adapter_save_exchange"] = adapters["exchange"]
    report["adapter_corrupted_byte"] = adapters["corrupted_byte"]

    # ---------------------------------------------------------------- convert and reshard into fresh outputs
    from checkpoint_fixtures import save_source

    source = save_source("mixtral", work / "src")
    out = work / "converted"
    resharded = work / "resharded"

    def fresh(path: Path) -> Callable[[], None]:
        def reset() -> None:
            shutil.rmtree(path, ignore_errors=True)
            for left in path.parent.glob(f".{path.name}.*"):
                shutil.rmtree(left, ignore_errors=True) if left.is_dir() else left.unlink()
        return reset

    def load_plain(path: Path) -> None:
        open_checkpoint(path).check_all()

    def convert() -> None:
        convert_checkpoint(source, out, ep_degree=2, progress=False)

    def reshard() -> None:
        convert_checkpoint(out, resharded, ep_degree=4, progress=False)

    fresh(out)()
    convert()
    new_converted = digest(out)
    report["convert"] = crash_every_point("convert", out, fresh(out), convert, None, new_converted, load_plain)
    fresh(out)()
    convert()
    fresh(resharded)()
    reshard()
    new_resharded = digest(resharded)
    report["reshard"] = crash_every_point("reshard", resharded, fresh(resharded), reshard, None, new_resharded,
                                          load_plain)
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
