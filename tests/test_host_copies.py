"""No host→device copy in a training step: everything a step reads lives on the parameters' device from
``parallelize`` on, and stays there after online rebalancing and a ZeRO-1 reshard.

:class:`host_copies.HostCopies` tells host tensors from device tensors on the CPU (see its module) and records
every library line that would copy one to the device on a GPU. Forward, backward, clipping, the optimizer
step (also with an expert frozen) and ``after_optimizer_step`` (bias updates, device-load factors) must record
nothing; a rebalance, which moves experts and rebuilds their tables, may copy (it is not a training step's
steady state), and the steps after it must again record nothing.
"""

from __future__ import annotations

import dist_cases as cases
import pytest

CONTROLS = {"bias_update_rate": 0.01, "device_load_factors": 0.5}
REBALANCING = {"rebalance_every": 2, **CONTROLS}


@pytest.mark.parametrize(("family", "config"), [
    ("gpt_oss", {"skew": True, **REBALANCING}),  # selection-only bias
    ("deepseek_v3", {"optimizer_sharding": "zero1", **REBALANCING}),  # the router's native correction bias
    # an expert frozen from the second step (its rows' indices are made again after a rebalance: not here)
    ("qwen3_moe", {"freeze": [1], **CONTROLS}),
], ids=["gpt_oss-selection-bias", "deepseek_v3-zero1", "qwen3_moe-frozen-expert"])
def test_training_steps_copy_nothing_from_the_host(pools, family, config):
    for r in pools(2).run(cases.host_copies, family, 1, 2, 4, **config):
        if "rebalance_every" in config:
            assert any(sent > 0 for _, sent in r["rebalances"]), r  # experts moved between the checked steps
        assert r["bias_moved"] > 0, r
        steady = {phase: found for phase, found in r["found"].items() if not phase.startswith("rebalance")}
        assert steady == {}, steady
