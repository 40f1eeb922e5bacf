"""Quantized Hub checkpoints (block-FP8, MXFP4): converted exactly, refused clearly, sized honestly.

Tiny DeepSeek-V3 and Qwen3-MoE (block-FP8) and GPT-OSS (MXFP4) models are built from their configs
and quantized here (tests/quantized_fixtures.py). The DeepSeek one has ``kv_lora_rank = 20``, so
``kv_a_proj_with_mqa`` is 28 × 64 and ``kv_b_proj`` 96 × 20: with 16 × 16 blocks their last block
row / column is clipped, like DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` with 128 × 128 blocks.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import dist_cases as cases
import pytest
import torch
from quantized_fixtures import (
    SCALE_DTYPES,
    WEIGHT_DTYPES,
    build,
    quantize_fp8,
    reference_fp8,
    reference_mxfp4,
    save_fp8,
    save_mxfp4,
)
from safetensors.torch import load_file, save_file
from test_checkpoint import _tensors
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError, read_index
from hf_hybrid_ep.checkpoint import rewrite as rewrite_module
from hf_hybrid_ep.checkpoint.inspect import format_summary, inspect_checkpoint
from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.planning.planner import plan
from hf_hybrid_ep.quant.formats import dequantize_fp8

BLOCK = (16, 16)
MTP_KEY = "model.layers.61.eh_proj.weight"  # DeepSeek's multi-token-prediction layer: transformers skips it
CLIPPED = ("kv_a_proj_with_mqa", "kv_b_proj")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Per family: the quantized source directory and, per quantized key, its (data, scales)."""
    root = tmp_path_factory.mktemp("quantized")
    torch.manual_seed(1)
    deepseek = save_fp8(build("deepseek_v3", kv_lora_rank=20), root / "deepseek_v3", BLOCK,
                        extra={MTP_KEY: torch.randn(64, 128)})
    qwen = save_fp8(build("qwen3_moe"), root / "qwen3_moe", BLOCK, rotate=False)
    gpt_oss = save_mxfp4(build("gpt_oss"), root / "gpt_oss")
    return {"deepseek_v3": (root / "deepseek_v3", deepseek), "qwen3_moe": (root / "qwen3_moe", qwen),
            "gpt_oss": (root / "gpt_oss", gpt_oss)}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {family: hep.convert_checkpoint(src, root / family, ep_degree=2, progress=False)
            for family, (src, _) in sources.items()}


def _reference(family: str, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if family == "gpt_oss":
        return reference_mxfp4(data, scales, dtype)
    return reference_fp8(data, scales, BLOCK, dtype)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "gpt_oss"])
def test_every_tensor_equals_the_reference_dequantization(sources, converted, family):
    src, quantized = sources[family]
    out = _tensors(converted[family])
    source = load_file(src / "model.safetensors")
    assert MTP_KEY not in out  # left out: the model never loads it
    for key, (data, scales) in quantized.items():
        if key == MTP_KEY:
            continue
        assert out[key].dtype == torch.bfloat16, key
        assert torch.equal(out[key], _reference(family, data, scales, torch.bfloat16)), key
    plain = {k: v for k, v in source.items() if not k.endswith(("_scale_inv", "_blocks", "_scales"))
             and k not in quantized}
    assert plain and all(torch.equal(out[k], v) and out[k].dtype == v.dtype for k, v in plain.items())
    assert set(out) == (set(plain) | set(quantized)) - {MTP_KEY}
    if family == "deepseek_v3":  # every weight and scale dtype is read
        assert {q.dtype for q, _ in quantized.values()} == set(WEIGHT_DTYPES)
        assert {s.dtype for _, s in quantized.values()} == set(SCALE_DTYPES)


def test_fused_fp8_expert_tensors_are_dequantized_one_expert_at_a_time(tmp_path):
    """Experts stored fused (``[E, 2I, H]`` with ``[E, 2I/16, H/16]`` scales, as transformers saves FP8
    experts) are read, dequantized and written expert by expert, and equal the reference."""
    model = build("qwen3_moe")
    model.config.save_pretrained(tmp_path / "src")
    tensors, want = {}, {}
    for key, value in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            pairs = [quantize_fp8(expert, BLOCK, torch.float8_e4m3fn, torch.float32) for expert in value]
            tensors[key], tensors[key + "_scale_inv"] = (torch.stack(list(t)) for t in zip(*pairs, strict=True))
            want[key] = torch.stack([reference_fp8(q, s, BLOCK, torch.bfloat16) for q, s in pairs])
        else:
            tensors[key] = value
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    _with_config(tmp_path / "src", tmp_path, "fused", {"quant_method": "fp8", "weight_block_size": list(BLOCK)})
    out = hep.convert_checkpoint(tmp_path / "fused", tmp_path / "out", ep_degree=2, progress=False)
    assert read_index(out).hybrid_ep.storage == "fused"
    got = _tensors(out)
    assert want and all(torch.equal(got[k], v) for k, v in want.items())


def test_float32_output_is_the_exact_product(sources, tmp_path):
    src, quantized = sources["deepseek_v3"]
    out = hep.convert_checkpoint(src, tmp_path / "fp32", ep_degree=1, dtype="float32", progress=False)
    tensors = _tensors(out)
    for key, (data, scales) in quantized.items():
        if key != MTP_KEY:
            assert torch.equal(tensors[key], reference_fp8(data, scales, BLOCK, torch.float32)), key


def _differing(src: Path, config, out: Path) -> list[str]:
    """The tensors in which transformers' ``dequantize=True`` load of ``src`` (dequantized to bfloat16;
    the rest kept in float32 or cast to bfloat16, as its quantizer does) and a vanilla load of the
    converted ``out`` (float32, holding our bfloat16 values exactly) differ, ours cast to its dtype."""
    want = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.bfloat16).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert want.keys() == got.keys()
    return sorted(k for k in want if not torch.equal(want[k], got[k].to(want[k].dtype)))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_equal_to_transformers_own_dequantization(sources, converted, family):
    """Block-aligned FP8 (Qwen3-MoE) and MXFP4 (GPT-OSS, its transpose included): transformers'
    ``dequantize=True`` load and a vanilla load of the converted checkpoint give the same model."""
    config = Mxfp4Config(dequantize=True) if family == "gpt_oss" else FineGrainedFP8Config(dequantize=True)
    assert _differing(sources[family][0], config, converted[family]) == []


def test_transformers_fp8_dequantization_misassigns_clipped_blocks(sources, converted):
    """Documents where transformers 5.23 is wrong: it derives the block size from the scale grid
    (28 rows over 2 block rows: 14-row blocks; 20 columns over 2: 10-column blocks) instead of
    weight_block_size, so the clipped tensors get the wrong scales; every other tensor agrees."""
    src, quantized = sources["deepseek_v3"]
    differ = _differing(src, FineGrainedFP8Config(dequantize=True), converted["deepseek_v3"])
    assert differ == sorted(f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in CLIPPED)
    out = _tensors(converted["deepseek_v3"])
    for key in differ:  # ours is the reference dequantization (checked in full above)
        assert torch.equal(out[key], reference_fp8(*quantized[key], BLOCK, torch.bfloat16))
    # where the grid does not divide the rows (40 over 3 block rows; DeepSeek-V3's 576 over 5) it raises
    q, s = quantize_fp8(torch.randn(40, 16), BLOCK, torch.float8_e4m3fn, torch.float32)
    with pytest.raises(ValueError, match="not divisible"):
        Fp8Dequantize(None)._dequantize_one(q, s)
    assert torch.equal(dequantize_fp8(q, s, BLOCK), reference_fp8(q, s, BLOCK, torch.float32))


def test_reshard_and_export_of_a_converted_checkpoint_are_bit_exact(converted, tmp_path):
    for family in ("deepseek_v3", "gpt_oss"):
        ep1 = hep.convert_checkpoint(converted[family], tmp_path / f"{family}-ep1", ep_degree=1, progress=False)
        hep.export_checkpoint(ep1, tmp_path / f"{family}-plain", progress=False)
        want = _tensors(converted[family])
        for directory in (ep1, tmp_path / f"{family}-plain"):
            got = _tensors(directory)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items()), directory
        assert read_index(ep1).hybrid_ep.source["dequantized_from"]["quant_method"] == (
            "mxfp4" if family == "gpt_oss" else "fp8")


def test_metadata_config_model_card_and_inspect(sources, converted, tmp_path):
    out = converted["deepseek_v3"]
    record = read_index(out).hybrid_ep.source["dequantized_from"]
    assert record == {"quant_method": "fp8", "description": "fp8 block 16×16", "dtype": "bfloat16",
                      "weight_block_size": [16, 16]}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert "quantization_config" in json.loads((sources["deepseek_v3"][0] / "config.json").read_text())
    text = format_summary(inspect_checkpoint(out))
    assert "weights dequantized from fp8 block 16×16 to bfloat16" in text
    assert "quantized checkpoint: fp8 block 16×16" in format_summary(inspect_checkpoint(sources["deepseek_v3"][0]))
    assert "mxfp4" in format_summary(inspect_checkpoint(converted["gpt_oss"]))
    from hf_hybrid_ep.hub import render_model_card

    card = str(render_model_card(out, "me/deepseek-ep2"))
    assert "| weights | dequantized from fp8 block 16×16 to bfloat16 (hf-hybrid-ep convert) |" in card


def test_rank_local_loading_dequantizes_only_its_own_experts(pools, sources, converted):
    """From the quantized sources directly, at ep 2: each rank's model equals the converted checkpoint's
    tensors; the other rank's experts are poisoned in its copy (NaN scales), so reading them would fail."""
    for family in ("deepseek_v3", "gpt_oss"):
        src, _ = sources[family]
        results = pools(2).run(cases.quantized_rank_local_load, str(src), str(converted[family]))
        for r in results:
            assert r["mismatched"] == [] and r["poisoned"] > 0 and r["compared"] > 0, r
            assert "NaN or infinite" in r["refused"], r  # reading another rank's expert would have failed
            assert not r["quantization_config"], r  # the model is the dequantized one


def _refused(src: Path, out: Path, *needles: str) -> None:
    with pytest.raises(CheckpointError) as err:
        hep.convert_checkpoint(src, out, ep_degree=2, progress=False)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), "nothing is written"


def _with_config(src: Path, tmp_path: Path, name: str, quantization_config: dict) -> Path:
    copy = tmp_path / name
    shutil.copytree(src, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(("method", "extra", "needles"), [
    ("gptq", {"bits": 4}, ["'gptq'", "unquantized model it was made from"]),
    ("awq", {"bits": 4}, ["'awq'", "unquantized model it was made from"]),
    ("bitsandbytes", {"load_in_4bit": True}, ["'bitsandbytes'", "BitsAndBytesConfig"]),
    ("compressed-tensors", {"config_groups": {"group_0": {"weights": {"strategy": "channel", "num_bits": 8}}}},
     ["'compressed-tensors' (weights strategy 'channel')", "per tensor, per channel or per group"]),
    ("fp8", {}, ["no weight_block_size", "per tensor"]),
    ("fp8", {"weight_block_size": [128, 128], "activation_scheme": "static"}, ["activation_scheme 'static'"]),
])
def test_other_methods_are_refused_before_anything_is_written(sources, tmp_path, method, extra, needles):
    src = _with_config(sources["qwen3_moe"][0], tmp_path, "src", {"quant_method": method, **extra})
    _refused(src, tmp_path / "out", *needles)
    if method == "gptq":  # the CLI says the same and exits 2; loading refuses it too
        assert cli(["convert", str(src), str(tmp_path / "out"), "--ep-degree", "2"]) == 2
        with pytest.raises(CheckpointError, match="'gptq'"):
            hep.from_pretrained(src, hep.HybridEPConfig())


def test_a_hub_repo_is_refused_before_its_weights_are_downloaded(sources, tmp_path, monkeypatch):
    from hub_stub import HubStub
    from huggingface_hub import constants

    src = _with_config(sources["qwen3_moe"][0], tmp_path, "src", {"quant_method": "gptq", "bits": 4})
    hub = HubStub()
    try:
        hub.served["org/tiny-gptq"] = {p.name: p.read_bytes() for p in src.iterdir()}
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        _refused("org/tiny-gptq", tmp_path / "out", "org/tiny-gptq", "'gptq'")
        assert hub.requested and not [f for f in hub.requested if f.endswith(".safetensors")], hub.requested
    finally:
        hub.close()


def test_a_scale_grid_that_does_not_fit_is_refused_naming_the_tensor(sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(sources["deepseek_v3"][0], src)
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    tensors[key] = tensors[key][:1]  # 1 block row for 28 rows in 16-row blocks
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _refused(src, tmp_path / "out", key, "(1, 4)", "(28, 64)", "16×16", "(2, 4)")


def test_the_output_size_is_stated_and_a_full_disk_refused(sources, tmp_path, monkeypatch, capsys):
    src, _ = sources["deepseek_v3"]
    out = hep.convert_checkpoint(src, tmp_path / "ok", ep_degree=2)
    stated = capsys.readouterr().err
    written = sum(f.stat().st_size for f in out.iterdir() if f.name != "model.safetensors.index.json")
    match = re.search(rf"{out}: writing ([\d.]+) kB in 3 files from deepseek_v3 \(([\d.]+) kB, fp8 block 16×16\)",
                      stated)
    assert match, stated
    assert f"leaving out 1 key(s) the model does not load ({MTP_KEY})" in stated
    needed = float(match[1]) * 1e3
    assert written <= needed <= 1.25 * written
    monkeypatch.setattr(rewrite_module, "free_bytes", lambda directory: written // 2)
    _refused(src, tmp_path / "full", "needs", "its filesystem has", "free")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_plan_reports_source_and_converted_sizes(sources, converted, family):
    """The planner's sizes of a quantized checkpoint equal the bytes of the tensors of the real files."""
    src, _ = sources[family]
    from hf_hybrid_ep.planning.counts import load_config

    model = plan(load_config(str(src)), gpus=2, gpu_memory_gib=80)["model"]
    assert model["quantization"] == {"qwen3_moe": "fp8 block 16×16",
                                     "gpt_oss": "mxfp4 (e2m1 values, one e8m0 scale per 32)"}[family]
    assert model["checkpoint_bytes"] == sum(s.nbytes for s in read_index(src).specs.values())
    assert model["converted_bytes"] == sum(s.nbytes for s in read_index(converted[family]).specs.values())


def test_plan_of_the_hub_releases_states_both_sizes():
    from hf_hybrid_ep.planning.planner import format_plan

    text = format_plan(plan("deepseek-ai/DeepSeek-V3", gpus=256, gpu_memory_gib=80))
    assert "checkpoint: fp8 block 128×128, 673 GB" in text and "writes 1.34 TB" in text
    text = format_plan(plan("openai/gpt-oss-120b", gpus=8, gpu_memory_gib=80))
    assert "checkpoint: mxfp4 (e2m1 values, one e8m0 scale per 32), 65.2 GB" in text and "writes 234 GB" in text


def test_quantizer_round_trip_is_close():
    """The test's own quantizer is a quantizer: dequantized weights are within a block's FP8 step."""
    w = torch.randn(40, 24)
    q, s = quantize_fp8(w, BLOCK, torch.float8_e4m3fn, torch.float32)
    back = reference_fp8(q, s, BLOCK, torch.float32)
    assert (back - w).abs().max() <= w.abs().max() / 8
    assert s.shape == (3, 2)
