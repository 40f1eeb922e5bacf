"""Pushing a converted checkpoint: real HTTP from huggingface_hub to a loopback stub of the Hub."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from checkpoint_fixtures import save_source
from hub_stub import HubStub

TOKEN = "hf_testtoken_do_not_print_123"


@pytest.fixture()
def hub():
    stub = HubStub()
    yield stub
    stub.close()


@pytest.mark.slow
def test_convert_and_push_with_model_card(hub, tmp_path):
    src = save_source("mixtral", tmp_path / "src")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN,
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "hf_hybrid_ep.cli", "convert", str(src), str(tmp_path / "ep2"), "--ep-degree", "2",
         "--push-to-hub", "tester/tiny-mixtral-ep2"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert TOKEN not in run.stdout + run.stderr, "the token must never be printed"
    assert hub.repos == ["tester/tiny-mixtral-ep2"]
    files = hub.files["tester/tiny-mixtral-ep2"]
    on_disk = {p.name for p in (tmp_path / "ep2").iterdir()}
    assert set(files) == on_disk
    assert {"model-experts-rank000-of-002.safetensors", "model-experts-rank001-of-002.safetensors",
            "model.safetensors.index.json", "config.json", "README.md"} <= set(files)
    assert files["config.json"] == (tmp_path / "ep2" / "config.json").read_bytes()
    card = files["README.md"].decode()
    front = yaml.safe_load(card.split("---")[1])
    assert {"moe", "hybrid-ep"} <= set(front["tags"]) and front["library_name"] == "transformers"
    assert "EP degree of the file layout | 2" in card and "contiguous, 2 experts per EP rank" in card
    assert hub.authorizations and all(a == f"Bearer {TOKEN}" for a in hub.authorizations)


@pytest.mark.slow
def test_convert_from_a_hub_repo_downloads_only_what_it_needs(hub, tmp_path):
    src = save_source("qwen3_moe", tmp_path / "src")
    served = {p.name: p.read_bytes() for p in src.iterdir()}
    served["pytorch_model.bin"] = b"pickle weights must never be fetched"
    served["original/consolidated.safetensors"] = b"not needed"
    hub.served["org/tiny-qwen3-moe"] = served
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "hf_hybrid_ep.cli", "convert", "org/tiny-qwen3-moe", str(tmp_path / "out"),
         "--ep-degree", "2"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pytorch_model.bin" not in hub.requested and "original/consolidated.safetensors" not in hub.requested
    assert sorted(hub.requested) == sorted(p.name for p in src.iterdir())
    from hf_hybrid_ep.checkpoint import read_index

    meta = read_index(tmp_path / "out").hybrid_ep
    assert meta.source == {"repo_id": "org/tiny-qwen3-moe", "revision": "b" * 40}


def test_rank_local_load_from_a_hub_repo_fetches_only_own_files(hub, pools, tmp_path):
    import dist_cases as cases

    import hf_hybrid_ep as hep

    src = save_source("mixtral", tmp_path / "src")
    ep2 = hep.convert_checkpoint(src, tmp_path / "ep2", ep_degree=2, progress=False)
    hub.served["org/tiny-mixtral-ep2"] = {p.name: p.read_bytes() for p in ep2.iterdir()}
    results = pools(2).run(
        cases.hub_rank_local_load, hub.url, "org/tiny-mixtral-ep2", str(tmp_path / "cache"), str(src), 1, 2
    )
    assert all(r["logits_rel"] <= cases.REL_TOL for r in results), results
    # every rank has its own cache: each rank file was fetched once, by its own rank only
    assert hub.requested.count("model-experts-rank000-of-002.safetensors") == 1
    assert hub.requested.count("model-experts-rank001-of-002.safetensors") == 1
    assert hub.requested.count("model-dense-00001-of-00001.safetensors") == 2


@pytest.mark.slow
def test_push_a_lora_adapter_with_a_model_card(hub, tmp_path):
    # save_pretrained of a parallelized PeftModel, pushed: PEFT's files and a card naming the base model and
    # the LoRA targets.
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import dist_cases as cases
import hf_hybrid_ep as hep
model, _ = cases.lora_pair("qwen3_moe", 4)
model.get_base_model().name_or_path = "org/tiny-qwen3-moe"  # what from_pretrained records
hep.parallelize(model)
model.save_pretrained({str(tmp_path / "adapter")!r})
hep.push_to_hub({str(tmp_path / "adapter")!r}, "tester/tiny-qwen3-moe-lora")
"""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN,
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert TOKEN not in run.stdout + run.stderr
    files = hub.files["tester/tiny-qwen3-moe-lora"]
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(files)
    card = files["README.md"].decode()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "org/tiny-qwen3-moe" and front["library_name"] == "peft"
    assert "`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`" in card or "`mlp.experts.down_proj`, `mlp.experts.gate_up_proj`" in card
    assert "`q_proj`, `v_proj`" in card and "rank / alpha | 4 / 8" in card
