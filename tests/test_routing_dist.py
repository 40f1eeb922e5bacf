"""Routing figures across ranks: layout-independent metrics and biases, device-load-aware selection."""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest


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


@pytest.mark.parametrize(("layout", "accum"), [((4, 1), 1), ((2, 2), 2), ((1, 4), 2)], ids=lambda v: str(v))
def test_global_batch_aux_loss_equals_one_process_on_the_global_batch(pools, layout, accum):
    # The model's own load-balancing loss (transformers' load_balancing_loss_func, coefficient 0.1) with
    # aux_loss_scope="global": every micro-step's loss and every gradient equal one process's over the global batch
    # (all ranks' micro-batches together), with accumulation averaging the micro-steps as that process does. The
    # per-rank loss ("local") is another loss: the same run fails the criterion.
    results = pools(4).run(cases.train_parity, "qwen3_moe", *layout, 4, steps=2, accum=accum,
                           router_aux=(0.1, "global"))
    parity.assert_faithful(results)
    if layout == (2, 2):
        local = pools(4).run(cases.train_parity, "qwen3_moe", *layout, 4, steps=2, accum=accum,
                             router_aux=(0.1, "local"))
        parity.record(local)
        assert all({"loss", "step0_grads"} <= set(parity.failed_checks(r)) for r in local), local[0]


def test_the_engines_router_losses_over_the_global_batch(pools):
    # aux_loss_coef / z_loss_coef with aux_loss_scope="global": the value on every rank and the world-averaged
    # router gradients are the Switch and z losses over the global batch, written out in one process
    for layout in ((2, 2), (1, 4)):
        for r in pools(4).run(cases.engine_aux_global, *layout):
            assert r["value_rel"] <= parity.REL_TOL and r["grad_rel"] <= parity.REL_TOL, (layout, r)


def test_routing_recorded_in_generation_is_replayed_in_the_training_forward(pools):
    # greedy generation under EP at dp1×ep2, the ranks asking for 3 and 6 new tokens (the shorter keeps stepping)
    for r in pools(2).run(cases.routing_replay, [3, 6]):
        assert r["identity_rel"] <= parity.REL_TOL, r  # unchanged routers: replay changes nothing
        assert r["replayed_equal"] and r["router_grads"], r
        assert r["free_differs"] > 0, r  # the moved routers alone would have chosen other experts
        assert r["recorded_positions"] >= r["sequence_length"] - 1, r
