"""LoRA with PEFT under hybrid EP: adapters on dense modules replicated, adapters on the routed experts sharded
with them, base weights frozen; faithful to one process running PEFT's own code path; saved, loaded, merged
and pushed as ordinary PEFT adapters.

Real gloo process groups (the shared worker pools), tiny real transformers models, PEFT 0.21.2 itself as the
reference.
"""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest

LORA_FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]
# every dp × ep layout of world 4, and world 3 (six experts)
LORA_LAYOUTS = [(4, (4, 1), 4), (4, (2, 2), 4), (4, (1, 4), 4), (3, (3, 1), 6), (3, (1, 3), 6)]


@pytest.mark.parametrize(("world", "layout", "experts"), LORA_LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_lora_training_parity(pools, family, world, layout, experts):
    # Three AdamW steps of two accumulated micro-batches with clipping, on dense and expert adapters, equal
    # PEFT's ParamWrapper path in one process on the global batch: losses, global norm, every adapter gradient
    # and parameter. Base weights get no gradient, no bucket and no optimizer state.
    dp, ep = layout
    results = pools(world).run(cases.lora_parity, family, dp, ep, experts)
    parity.assert_faithful(results)
    for r in results:
        assert r["optimizer_state_only_adapters"] and r["base_grads"] == [], r
        assert r["expert_bucket_elements"] > 0


def test_lora_parity_with_per_layer_tables_and_replicas(pools):
    placement = {"model.layers.0.mlp.experts": [[0, 1, 2], [2, 3, 0]], "model.layers.1.mlp.experts": [[3, 0], [1, 2]]}
    parity.assert_faithful(pools(4).run(cases.lora_parity, "qwen3_moe", 2, 2, 4, placement=placement))
