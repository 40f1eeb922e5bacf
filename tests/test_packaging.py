"""The built wheel is what a `pip install hf_hybrid_ep` user gets: it must carry the package data the
code reads at run time (the model-card template for Hub pushes, the known configs of the planner) and
nothing of the repository around it (tests, benchmarks, scripts)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_package_data_and_no_tests(tmp_path):
    # build from a copy of what the wheel is made of: a build/ left in the checkout by an earlier build would
    # otherwise add its stale modules to the wheel (setuptools copies into build/lib and packs all of it)
    source = tmp_path / "source"
    for tree in ("hf_hybrid_ep", "model_cards"):
        shutil.copytree(ROOT / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("hf_hybrid_ep-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "hf_hybrid_ep/model_cards/hybrid_ep_model_card.md" in names
    assert "hf_hybrid_ep/model_cards/lora_adapter_model_card.md" in names
    assert any(n.startswith("hf_hybrid_ep/known_configs/") and n.endswith(".json") for n in names)
    for sub in ("parallel", "moe", "dispatch", "checkpoint", "planning", "inference", "integrations"):
        assert f"hf_hybrid_ep/{sub}/__init__.py" in names, sub
    modules = {n for n in names if n.startswith("hf_hybrid_ep/") and n.endswith(".py")}
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "hf_hybrid_ep").rglob("*.py")}
    tree |= {f"hf_hybrid_ep/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "model_cards").rglob("*.py")}
    assert modules == tree, modules ^ tree  # a subpackage missing from pyproject's list is missing here
    strays = [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "scripts", "examples", "docs")]
    assert not strays, strays
    assert "License-Expression: Apache-2.0" in metadata


def test_model_card_template_is_the_repositorys_model_cards_directory():
    from hf_hybrid_ep import hub

    assert hub.TEMPLATE.is_file()
    assert Path(str(hub.TEMPLATE)) == ROOT / "model_cards" / "hybrid_ep_model_card.md"
