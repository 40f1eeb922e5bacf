"""Routing figures across ranks: layout-independent metrics and biases, device-load-aware selection."""

from __future__ import annotations

import dist_cases as cases
import parity


def test_metrics_and_biases_do_not_depend_on_the_layout(pools):
    pool = pools(4)
    runs = {layout: pool.run(cases.routing_metrics, *layout, bias_update_rate=0.05, coactivation_stats=True)
            for layout in [(1, 4), (2, 2), (4, 1)]}
    reference = runs[(4, 1)][0]
    for layout, results in runs.items():
        for r in results:
            for name, layer in r["report"].items():
                want = reference["report"][name]
                assert layer["tokens_per_expert"] == want["tokens_per_expert"], (layout, name)
                assert layer["coactivation"] == want["coactivation"], (layout, name)
                assert sum(map(sum, layer["coactivation"])) > 0
                # Loads are integers and equal exactly; the entropy, like the loss, is a mean over tokens of an
                # fp32 function of router inputs that differ by round-off between layouts (the previous layer's
                # experts run in other groupings), so it is held to the parity criterion's loss bound.
                assert abs(layer["router_entropy"] - want["router_entropy"]) <= parity.REL_TOL * want["router_entropy"]
            assert r["biases"] == reference["biases"], layout


def test_device_load_factors_move_selection_off_the_overloaded_rank(pools):
    pool = pools(2)
    plain = pool.run(cases.routing_metrics, 1, 2, 12)[0]["rank0_share"]
    aware = pool.run(cases.routing_metrics, 1, 2, 12, device_load_factors=2.0)[0]["rank0_share"]
    assert plain[0] == aware[0] > 0.55  # the first step routes alike: no load estimate yet
    assert sum(aware[-4:]) / 4 < sum(plain[-4:]) / 4 - 0.05, (plain, aware)
