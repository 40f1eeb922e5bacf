"""Forward parity for every transformers model type whose experts module uses the decorator.

The list is discovered from transformers' source, so "structural, not a class list" is enforced:
a new family with the same experts module is covered without touching the library. A family that
cannot be built tiny and offline must be listed in :data:`UNBUILDABLE` with its reason; any other
failure to build (or an unexpected exception) fails the sweep.
"""

from __future__ import annotations

import dist_cases as cases
import pytest
from tiny_models import DECORATED_MODEL_TYPES

# model type -> why it cannot be built tiny and offline (SkipModel's reason). Every decorated family of the
# pinned transformers builds today.
UNBUILDABLE: dict[str, str] = {}
MAX_UNBUILDABLE = 3  # more than this and the sweep no longer stands for "every decorated family"
MIN_TESTED = 60


def test_sweep_covers_the_decorated_families():
    tested = set(DECORATED_MODEL_TYPES) - set(UNBUILDABLE)
    assert len(tested) >= MIN_TESTED, sorted(tested)
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= tested
    assert len(UNBUILDABLE) <= MAX_UNBUILDABLE, UNBUILDABLE
    assert set(UNBUILDABLE) <= set(DECORATED_MODEL_TYPES), "a listed family is no longer decorated"


@pytest.mark.parametrize("model_type", DECORATED_MODEL_TYPES)
def test_forward_parity(pools, model_type):
    results = pools(2).run(cases.forward_parity, model_type)
    if "skipped" in results[0]:
        if model_type in UNBUILDABLE:
            pytest.skip(f"{model_type}: {UNBUILDABLE[model_type]}")
        pytest.fail(f"{model_type} cannot be built: {results[0]['skipped']} (list it in UNBUILDABLE with the "
                    "reason, or teach tests/tiny_models to build it)")
    assert model_type not in UNBUILDABLE, f"{model_type} builds now: remove it from UNBUILDABLE"
    for r in results:
        assert r["layers"] >= 1
        assert r["rel"] <= cases.REL_TOL, (model_type, r)
    assert sum(r["remote_rows"] for r in results) > 0, "tokens must cross ranks"
