"""The CTR example end to end on a tiny run (`examples/recsys_ctr/run.py --smoke`): the MoE model trains on
hybrid EP under torchrun (dp 1 × ep 2), the dense baselines in one process, and every model learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "recsys_ctr"


@pytest.mark.slow
def test_smoke_run_learns_and_reports_the_oracle(tmp_path):
    out = tmp_path / "ctr.json"
    subprocess.run([sys.executable, str(EXAMPLE / "run.py"), "--smoke", "--moe-layout", "1x2", "--no-deployment",
                    "--json", str(out), "--plot", str(tmp_path / "auc.png"), "--workdir", str(tmp_path / "work")],
                   check=True, cwd=ROOT, timeout=300)
    s = json.loads(out.read_text())
    sys.path.insert(0, str(EXAMPLE))
    from datasets import load_from_disk
    from train import auc

    test = load_from_disk(str(tmp_path / "work" / "data" / "test")).with_format("numpy")
    assert s["auc_oracle"] == auc(test["click"][:], test["prob"][:]) > 0.8
    assert s["moe_layout"] == "1x2" and s["seeds"] == 1
    for kind in ("moe", "dense_active", "dense_total"):
        assert 0.55 < s[f"auc_{kind}"] < s["auc_oracle"], (kind, s[f"auc_{kind}"])  # learned something, not all
        assert len(s[f"curve_{kind}"]) == 12 and s[f"curve_{kind}"][-1][1] == s[f"auc_{kind}"]
    # the dense baselines match the MoE layer's active and total parameter counts to within one width unit
    moe, active, total = (s[f"parameters_{k}"] for k in ("moe", "dense_active", "dense_total"))
    assert abs(active["mixture_total"] - moe["mixture_active"]) <= 96
    assert abs(total["mixture_total"] - moe["mixture_total"]) <= 96
    assert np.isfinite(s["auc_moe_minus_dense_active"]["mean"])
    assert (tmp_path / "auc.png").stat().st_size > 10_000
