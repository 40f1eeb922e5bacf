"""Forward parity for every transformers model type whose experts module uses the decorator.

The list is discovered from transformers' source, so "structural, not a class list" is enforced:
a new family with the same experts module is covered without touching the library.
"""

from __future__ import annotations

import dist_cases as cases
import pytest
from tiny_models import DECORATED_MODEL_TYPES


def test_sweep_covers_the_decorated_families():
    assert len(DECORATED_MODEL_TYPES) >= 60
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= set(DECORATED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", DECORATED_MODEL_TYPES)
def test_forward_parity(pools, model_type):
    results = pools(2).run(cases.forward_parity, model_type)
    if "skipped" in results[0]:
        pytest.skip(results[0]["skipped"])
    for r in results:
        assert r["layers"] >= 1
        assert r["rel"] <= cases.REL_TOL, (model_type, r)
    assert sum(r["remote_rows"] for r in results) > 0, "tokens must cross ranks"
