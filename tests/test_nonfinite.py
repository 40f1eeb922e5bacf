"""No step poisons the model or a checkpoint: a non-finite global gradient norm skips the optimizer step on every
rank (whatever optimizer the user built), counted and named; the run stops when asked or after K skips in a row;
a save refuses non-finite weights; ``inspect --verify`` reports them."""

from __future__ import annotations

import math

import dist_cases as cases
import pytest
import torch

EXPERTS = "model.layers.0.mlp.experts"


def test_a_nonfinite_step_is_skipped_everywhere_then_the_run_stops(pools):
    results = pools(4).run(cases.nonfinite_steps, "skip", 2)
    for rank, r in enumerate(results):
        # steps 1 and 3 train; 2 and 4 are skipped (parameters and AdamW's step count untouched); 5 is the second
        # skip in a row: the run stops on every rank with the same message
        assert r["changed"] == [True, False, True, False], (rank, r)
        assert r["steps"] == [1, 1, 2, 2], (rank, r)
        assert r["total"] == 3 and r["finite"], r
        assert "2 optimizer steps in a row were skipped" in r["error"] and f"{EXPERTS} (rank(s) [1])" in r["error"]
        assert r["error"] == results[0]["error"]
    warnings = results[0]["warnings"]
    assert any("optimizer step 2: the global gradient norm is nan" in w and f"{EXPERTS} (rank(s) [1])" in w
               and "skipped on every rank (1 skipped" in w for w in warnings), warnings
    assert not results[1]["warnings"], "rank 0 logs"


def test_a_nonfinite_step_stops_the_run_when_asked(pools):
    for r in pools(4).run(cases.nonfinite_steps, "stop", 5):
        assert r["changed"] == [True] and "the run stops (on_nonfinite_grad='stop')" in r["error"], r


def test_a_save_refuses_nonfinite_weights_on_every_rank(pools, tmp_path):
    for r in pools(2).run(cases.save_refuses_nonfinite, str(tmp_path / "ckpt")):
        assert "refusing to save ckpt: 1 tensor(s) hold NaN or inf" in r["message"], r
        assert "model.layers.1.mlp.experts" in r["message"], r
        assert r["unchanged"] and r["leftovers"] == [], r


def test_inspect_verify_reports_nonfinite_tensors(tmp_path, capsys):
    from checkpoint_fixtures import save_source
    from safetensors.torch import load_file, save_file

    from hf_hybrid_ep.cli import main as cli
    from hf_hybrid_ep.model_io.convert import convert_checkpoint

    source = save_source("qwen3_moe", tmp_path / "src")
    shard = sorted(source.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(k for k, t in tensors.items() if t.is_floating_point())
    tensors[name].view(-1)[:3] = torch.tensor([math.nan, math.inf, 1.0])
    save_file(tensors, shard, metadata={"format": "pt"})
    convert_checkpoint(source, tmp_path / "out", ep_degree=2, progress=False)
    assert cli(["inspect", str(tmp_path / "out")]) == 0  # without --verify nothing is read
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "out"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"NON-FINITE: 1 tensor(s) hold NaN or inf: {name} (2 elements)" in out, out
    convert_checkpoint(save_source("qwen3_moe", tmp_path / "good"), tmp_path / "good-out", ep_degree=2, progress=False)
    assert cli(["inspect", str(tmp_path / "good-out"), "--verify"]) == 0
    assert "every floating-point tensor is finite" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [{"on_nonfinite_grad": "ignore"}, {"max_consecutive_skips": 0},
                                 {"collective_timeout_s": 5}, {"collective_timeout_s": "60"}])
def test_failure_settings_are_checked(bad):
    import hf_hybrid_ep as hep

    with pytest.raises(hep.HybridEPConfigError, match=next(iter(bad))):
        hep.HybridEPConfig(**bad)
