"""Bad inputs are refused before any work, with an error naming the value, key or file, and nothing written."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from checkpoint_fixtures import save_source

from hf_hybrid_ep import HybridEPConfig, HybridEPConfigError, PlacementTable
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.planning.placement import RoutingStats, read_placement_file
from hf_hybrid_ep.planning.planner import load_config

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
LAYER = "model.layers.0.mlp.experts"
LOADS = [40, 30, 20, 10]


@functools.cache
def _train_script() -> ModuleType:
    """``scripts/train.py`` imported as a module (its ``main`` parses the same argv as the command line)."""
    spec = importlib.util.spec_from_file_location("train_script", TRAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Bad:
    """One prepared bad input: a CLI argv or a call, where its output would go, what the error must name."""

    names: tuple[str, ...]
    out: Path
    argv: list[str] | None = None
    call: Callable[[], object] | None = None


def _layer(loads: list = LOADS, **extra: object) -> dict:
    return {"tokens_per_expert": loads, **extra}


def _report_layer(loads: list = LOADS) -> dict:
    return _layer(loads, tokens_per_rank=[70, 30], imbalance_expert=1.6, imbalance_rank=1.4,
                  dropped_fraction=0.0, dead_experts=0)


def _stats(tmp: Path, *layers: dict | str) -> Path:
    """An ``expert_load.jsonl`` with one record per layer dict (a str is written as the raw line)."""
    path = tmp / "expert_load.jsonl"
    lines = [x if isinstance(x, str) else json.dumps({"step": 5 * (i + 1), "layers": {LAYER: x}})
             for i, x in enumerate(layers)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _file(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _convert(tmp: Path, src: Path, *flags: str) -> Bad:
    return Bad((), tmp / "out", ["convert", str(src), str(tmp / "out"), *flags])


def _place(tmp: Path, stats: Path, *flags: str) -> Bad:
    return Bad((), tmp / "placement.json", ["place", "--stats", str(stats), "--out", str(tmp / "placement.json"),
                                            *flags])


def _naming(bad: Bad, *names: str) -> Bad:
    return Bad(names, bad.out, bad.argv, bad.call)


def _placement_case(content: str | bytes | None, *names: str) -> Callable[[Path, Path], Bad]:
    """convert --placement FILE (``None``: FILE is a directory) must name FILE and ``names``."""

    def build(tmp: Path, src: Path) -> Bad:
        if content is None:
            path = tmp / "placements"
            path.mkdir()
        else:
            path = _file(tmp, "placement.bin" if isinstance(content, bytes) else "placement.json", content)
        return _naming(_convert(tmp, src, "--ep-degree", "2", "--placement", str(path)), str(path), *names)

    return build


def _jsonl_case(layers: tuple[dict | str, ...], line: int, *names: str) -> Callable[[Path, Path], Bad]:
    """place --stats FILE must name ``FILE:line`` and ``names``."""

    def build(tmp: Path, src: Path) -> Bad:
        stats = _stats(tmp, *layers)
        return _naming(_place(tmp, stats, "--ep-degree", "2"), f"{stats}:{line}", *names)

    return build


def _script_case(argv: Callable[[Path], list[str]], *names: str) -> Callable[[Path, Path], Bad]:
    """``scripts/train.py`` must refuse ``argv(tmp)`` while parsing arguments, naming ``names`` (formatted
    with ``tmp``)."""

    def build(tmp: Path, src: Path) -> Bad:
        args = [*argv(tmp), "--output_dir", str(tmp / "run")]
        return Bad(tuple(n.format(tmp=tmp) for n in names), tmp / "run", call=lambda: _train_script().main(args))

    return build


BAD_YAML = "hybrid_ep:\n  ep_degree: 2\n  dispatcher: torch: auto\n"

CASES: dict[str, Callable[[Path, Path], Bad]] = {
    "convert-ep-degree-0": lambda tmp, src: _naming(_convert(tmp, src, "--ep-degree", "0"), "--ep-degree", "got 0"),
    "reshard-ep-degree-negative": lambda tmp, src: Bad(
        ("--ep-degree", "got -1"), tmp / "out", ["reshard", str(src), str(tmp / "out"), "--ep-degree", "-1"]),
    "table-contiguous-ep-0": lambda tmp, src: Bad(
        ("ep_degree=0",), tmp / "out", call=lambda: PlacementTable.contiguous(8, 0)),
    "table-contiguous-ep-bool": lambda tmp, src: Bad(
        ("ep_degree=True",), tmp / "out", call=lambda: PlacementTable.contiguous(8, True)),
    "table-from-rows-empty": lambda tmp, src: Bad(
        ("ep_degree=0",), tmp / "out", call=lambda: PlacementTable.from_rows(4, [])),
    "table-from-rows-bool-id": lambda tmp, src: Bad(
        ("row 1", "True"), tmp / "out", call=lambda: PlacementTable.from_rows(2, [[0], [True]])),
    "place-ep-0": lambda tmp, src: _naming(_place(tmp, _stats(tmp, _layer()), "--ep-degree", "0"),
                                           "--ep-degree", "got 0"),
    "place-ep-negative": lambda tmp, src: _naming(_place(tmp, _stats(tmp, _layer()), "--ep-degree", "-2"),
                                                  "--ep-degree", "got -2"),
    "place-replicas-negative": lambda tmp, src: _naming(
        _place(tmp, _stats(tmp, _layer()), "--ep-degree", "2", "--replicas", "-1"), "--replicas", "got -1"),
    "place-tolerance-negative": lambda tmp, src: _naming(
        _place(tmp, _stats(tmp, _layer()), "--ep-degree", "2", "--tolerance", "-0.5"), "--tolerance", "got -0.5"),
    "placement-directory": _placement_case(None, "is a directory"),
    "placement-binary": _placement_case(b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not UTF-8"),
    "placement-bool-id": _placement_case('{"placement": [[0, 1], [2, true]]}', "true", "row 1"),
    "placement-missing": lambda tmp, src: _naming(
        _convert(tmp, src, "--ep-degree", "2", "--placement", str(tmp / "nowhere.json")),
        str(tmp / "nowhere.json"), "does not exist"),
    "placement-file-library-bool-id": lambda tmp, src: Bad(
        (str(tmp / "rows.json"), "true"), tmp / "out",
        call=lambda: read_placement_file(_file(tmp, "rows.json", "[[0, true], [1, 2]]"))),
    "jsonl-missing-key": _jsonl_case((_layer(), {"tokens": LOADS}), 2, "'tokens_per_expert'", LAYER),
    "jsonl-negative-load": _jsonl_case((_layer([40, -5, 20, 10]),), 1, "tokens_per_expert[1] = -5", "negative"),
    "jsonl-non-numeric-load": _jsonl_case((_layer([40, "many", 20, 10]),), 1, "tokens_per_expert[1] = 'many'"),
    "jsonl-bool-load": _jsonl_case((_layer([40, True, 20, 10]),), 1, "tokens_per_expert[1] = True"),
    "jsonl-expert-count-mismatch": _jsonl_case((_layer(), _layer([1, 2, 3, 4, 5, 6])), 2, "6 experts",
                                               "has 4"),
    "jsonl-record-not-object": _jsonl_case((_layer(), "[1, 2]"), 2, "JSON object"),
    "jsonl-missing-step": _jsonl_case((_layer(), json.dumps({"layers": {LAYER: _layer()}})), 2, "'step'"),
    "jsonl-coactivation-shape": _jsonl_case((_layer(coactivation=[[0, 1], [1, 0]]),), 1, "'coactivation'",
                                            "4 × 4"),
    "report-missing-key": lambda tmp, src: Bad(
        (f"{tmp / 'expert_load.jsonl'}:2", "'dead_experts'"), tmp / "plots",
        ["report", str(_stats(tmp, _report_layer(), {k: v for k, v in _report_layer().items()
                                                     if k != "dead_experts"})), "--out", str(tmp / "plots")]),
    "routing-stats-negative-load": lambda tmp, src: Bad(
        ("record 1", "-3"), tmp / "out",
        call=lambda: RoutingStats.from_records([{"step": 1, "layers": {LAYER: _layer()}},
                                                {"step": 2, "layers": {LAYER: _layer([1, -3, 0, 0])}}])),
    "yaml-syntax-config": lambda tmp, src: Bad(
        (f"{tmp / 'ep.yaml'}:3", "mapping values are not allowed"), tmp / "out",
        call=lambda: HybridEPConfig.from_yaml(_file(tmp, "ep.yaml", BAD_YAML))),
    "yaml-syntax-train": _script_case(lambda tmp: ["--hybrid_ep_config", str(_file(tmp, "ep.yaml", BAD_YAML))],
                                      "{tmp}/ep.yaml:3"),
    "optimizer-list": _script_case(
        lambda tmp: ["--hybrid_ep_config", str(_file(tmp, "ep.yaml", "hybrid_ep:\n  optimizer: [adamw]\n"))],
        "{tmp}/ep.yaml", "'optimizer'", "mapping", "['adamw']"),
    "train-file-unsupported-suffix": _script_case(
        lambda tmp: ["--train_file", str(_file(tmp, "notes.md", "# notes\n"))],
        "{tmp}/notes.md", "'.md'", ".txt, .json, .jsonl, .csv, .parquet"),
    "train-file-missing": _script_case(lambda tmp: ["--train_file", str(tmp / "corpus.txt")],
                                       "{tmp}/corpus.txt", "does not exist"),
    "train-file-empty": _script_case(lambda tmp: ["--train_file", str(_file(tmp, "corpus.txt", ""))],
                                     "{tmp}/corpus.txt", "is empty or holds only whitespace"),
    "train-file-whitespace": _script_case(lambda tmp: ["--train_file", str(_file(tmp, "corpus.jsonl", " \n\t\n"))],
                                          "{tmp}/corpus.jsonl", "is empty or holds only whitespace"),
    "block-size-0": _script_case(lambda tmp: ["--block_size", "0"], "--block_size", "got 0"),
    "block-size-negative": _script_case(lambda tmp: ["--block_size", "-8"], "--block_size", "got -8"),
    "yaml-key-beside-block": _script_case(
        lambda tmp: ["--hybrid_ep_config", str(_file(tmp, "ep.yaml", "microbatch_size: 4\nhybrid_ep: {ep_degree: 2}\n"))],
        "{tmp}/ep.yaml", "['microbatch_size'] stand beside the 'hybrid_ep:' block"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny 4-expert Mixtral checkpoint, so each refusal is due to the one bad input."""
    return save_source("mixtral", tmp_path_factory.mktemp("bad_inputs") / "src")


@pytest.mark.parametrize("build", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_refused_naming_it(build: Callable[[Path, Path], Bad], tmp_path: Path, source: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 (CLI) or ``HybridEPConfigError`` (library, script), a message naming the culprit, nothing written."""
    bad = build(tmp_path, source)
    if bad.argv is not None:
        code = cli(bad.argv)
        captured = capsys.readouterr()
        assert code == 2, captured
        prefix = f"hf-hybrid-ep {bad.argv[0]}: error: "
        assert captured.err.startswith(prefix) and "Traceback" not in captured.err, captured.err
        message = captured.err
    else:
        with pytest.raises(HybridEPConfigError) as info:
            bad.call()
        message = str(info.value)
    for name in bad.names:
        assert name in message, (name, message)
    assert not bad.out.exists()
    assert not [p.name for p in bad.out.parent.iterdir() if p.name.startswith(".")]


def test_the_same_inputs_made_good_are_accepted(tmp_path: Path, source: Path) -> None:
    """The fixtures of the table are valid once the bad value is fixed (the refusals are not incidental)."""
    placement = _file(tmp_path, "placement.json", '{"placement": [[0, 3], [1, 2]]}')
    assert cli(["convert", str(source), str(tmp_path / "out"), "--ep-degree", "2", "--placement", str(placement)]) == 0
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    stats = _stats(tmp_path, _report_layer(), _report_layer([1, 2, 3, 4]))
    assert cli(["place", "--stats", str(stats), "--ep-degree", "2", "--replicas", "0", "--tolerance", "0",
                "--out", str(tmp_path / "placement.json")]) == 0
    assert RoutingStats.from_records([json.loads(line) for line in stats.read_text().splitlines()]).loads.tolist() == [
        41, 32, 23, 14]
    assert HybridEPConfig.from_yaml(_file(tmp_path, "ep.yaml", "hybrid_ep:\n  ep_degree: 2\n")).ep_degree == 2
    train = _train_script()
    for suffix, builder in {".txt": "text", ".JSON": "json", ".jsonl": "json", ".csv": "csv",
                            ".parquet": "parquet"}.items():
        text = "" if suffix == ".parquet" else "some text\n"  # a parquet file is read by datasets
        assert train.train_file_builder(str(_file(tmp_path, f"data{suffix}", text))) == builder
    train.check_hybrid_ep_file(str(_file(tmp_path, "ok.yaml", "hybrid_ep:\n  optimizer: {type: AdamW, lr: 0.1}\n")))


# Runs scripts/train.py as ``python scripts/train.py ARGS`` does, then says how much of the run's set-up happened:
# the TrainingArguments built (they set up the devices and start the process group) and the process group.
_SET_UP_COUNT = """
import runpy, sys
import torch.distributed as dist
import transformers
built, post_init = [], transformers.TrainingArguments.__post_init__
transformers.TrainingArguments.__post_init__ = lambda self: (built.append(1), post_init(self))[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print(f"set-up: {len(built)} TrainingArguments, process group {dist.is_initialized()}", file=sys.stderr)
"""


@pytest.mark.slow
def test_train_script_refuses_readme_before_distributed_work(tmp_path: Path) -> None:
    """The real command line: ``--train_file README.md`` exits 2 before any set-up (no TrainingArguments, no process
    group, nothing written), listing the accepted suffixes."""
    run = subprocess.run([sys.executable, "-c", _SET_UP_COUNT, str(TRAIN), "--train_file", "README.md", "--output_dir",
                          str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # a hang guard only
    assert run.returncode == 2, run.stderr[-2000:]
    assert "train.py: error: --train_file 'README.md' has the unsupported suffix '.md'" in run.stderr, run.stderr
    assert ".txt, .json, .jsonl, .csv, .parquet" in run.stderr and "Traceback" not in run.stderr
    assert "set-up: 0 TrainingArguments, process group False" in run.stderr, run.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def _remote_code_dir(tmp: Path) -> tuple[Path, Path]:
    """A config whose ``auto_map`` names a module that, when imported, writes a marker file."""
    marker = tmp / "remote_code_ran"
    model = tmp / "custom_moe"
    model.mkdir()
    (model / "configuration_custom.py").write_text(
        "from pathlib import Path\nfrom transformers import PretrainedConfig\n\n"
        f"Path({str(marker)!r}).write_text('ran')\n\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom_moe'\n")
    (model / "config.json").write_text(json.dumps(
        {"model_type": "custom_moe", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    return model, marker


def test_plan_runs_no_config_code_and_never_prompts_unless_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--trust-remote-code`` the ``auto_map`` module is not imported and no [y/N] prompt appears;
    with ``trust_remote_code=True`` it is."""
    import transformers.dynamic_module_utils as dynamic

    model, marker = _remote_code_dir(tmp_path)
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        monkeypatch.delitem(sys.modules, name)
    prompts: list[str] = []
    monkeypatch.setattr("builtins.input", lambda text="": prompts.append(text) or "y")
    try:
        assert cli(["plan", "--model", str(model), "--gpus", "2", "--gpu-memory-gib", "1"]) == 2
        assert "trust_remote_code=True" in capsys.readouterr().err
        assert not marker.exists() and prompts == []
        assert type(load_config(str(model), trust_remote_code=True)).__name__ == "CustomConfig"
        assert marker.read_text() == "ran" and prompts == []
    finally:
        for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
            del sys.modules[name]


@pytest.mark.parametrize("command", ["convert", "reshard", "plan"])
@pytest.mark.parametrize("flag", [False, True], ids=["default", "trust-remote-code"])
def test_trust_remote_code_flag_reaches_the_library(command: str, flag: bool, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--trust-remote-code`` is off unless given, and is passed to ``convert_checkpoint`` / ``plan``."""
    seen: dict[str, object] = {}

    def record(*args: object, trust_remote_code: bool, **kwargs: object) -> object:
        seen["trust_remote_code"] = trust_remote_code
        raise HybridEPConfigError("recorded")

    target = "hf_hybrid_ep.planning.planner.plan" if command == "plan" else "hf_hybrid_ep.cli.convert_checkpoint"
    monkeypatch.setattr(target, record)
    argv = {"convert": ["convert", "SRC", str(tmp_path / "out")], "reshard": ["reshard", "CKPT", str(tmp_path / "out")],
            "plan": ["plan", "--model", "M", "--gpus", "2", "--gpu-memory-gib", "1"]}[command]
    assert cli(argv + (["--trust-remote-code"] if flag else [])) == 2
    assert seen == {"trust_remote_code": flag}


def test_a_text_shorter_than_one_block_is_refused_by_name(tmp_path: Path) -> None:
    """Known only after tokenizing (the tokenizer is trained or loaded first): one clear error, no checkpoint."""
    text = _file(tmp_path, "corpus.txt", "a few words only\n")
    with pytest.raises(HybridEPConfigError, match="fewer tokens than one block of --block_size 512"):
        _train_script().main(["--train_file", str(text), "--block_size", "512", "--output_dir", str(tmp_path / "run"),
                              "--max_steps", "1", "--report_to", "none"])
    assert not list((tmp_path / "run").glob("checkpoint-*"))
