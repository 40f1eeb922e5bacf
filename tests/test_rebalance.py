"""Online rebalancing: experts move between EP ranks after optimizer steps, with their optimizer state,
and training stays that of one process training the full model."""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest

import hf_hybrid_ep as hep
from hf_hybrid_ep.dispatch import PlacementTable
from hf_hybrid_ep.model_io.rank_local import checkpoint_placement
from hf_hybrid_ep.planning.placement import align_rows

LAYOUTS = [(2, 2), (1, 4)]
FAMILIES = ["mixtral", "gpt_oss", "deepseek_v3"]  # per-expert keys; fused, biased and transposed; sigmoid, shared


@pytest.mark.parametrize("optimizer_sharding", ["none", "zero1"])
@pytest.mark.parametrize("dp,ep", LAYOUTS, ids=[f"{dp}x{ep}" for dp, ep in LAYOUTS])
def test_training_with_rebalances_is_faithful(pools, dp, ep, optimizer_sharding):
    """Rebalances after steps 1 and 2 of 3 (and after 3), with ``ep`` replicas per layer: the slot counts
    change, so parameters, gradient buckets, process groups of holder sets and ZeRO-1 shards are rebuilt."""
    pool = pools(4)
    for family in FAMILIES:
        results = pool.run(cases.train_parity, family, dp, ep, 4, rebalance_every=1, rebalance_replicas=ep,
                           optimizer_sharding=optimizer_sharding)
        for rank, r in enumerate(results):
            parity.assert_within_rel_tol(r)
            assert [step for step, _ in r["rebalances"]] == [1, 2, 3], (family, rank)
            tables = r["tables"]  # before each after_optimizer_step, and at the end
            assert tables[1] != tables[0], (family, tables)  # the first rebalance changed the placement
            assert any(sent > 0 for _, sent in r["rebalances"]), (family, rank)  # experts moved


def test_rebalancing_follows_an_optimizer_built_by_hand(pools):
    """``torch.optim.AdamW(model.parameters())``, the README's loop shape, and ``after_optimizer_step(model)`` with no
    optimizer: the experts move with their state (the optimizer is found stepping them), faithful after 4 steps."""
    for r in pools(4).run(cases.train_parity, "mixtral", 2, 2, 4, steps=4, rebalance_every=1, plain_optimizer=True):
        parity.assert_within_rel_tol(r)
        assert any(sent > 0 for _, sent in r["rebalances"]), r["rebalances"]


def test_a_rebalance_with_no_optimizer_is_refused_before_any_move(pools):
    for r in pools(2).run(cases.rebalance_without_optimizer):
        assert "no optimizer holding the expert parameters has stepped" in r["message"], r
        assert "hf_hybrid_ep.make_optimizer" in r["message"] and r["unmoved"], r


@pytest.mark.parametrize("optimizer_sharding", ["none", "zero1"])
def test_rebalances_with_fsdp2_dense_weights_are_faithful(pools, optimizer_sharding):
    """Dense weights FSDP2-sharded: their optimizer state lives outside the flat buckets and must survive the
    ZeRO-1 re-sharding of a rebalance (it was wiped once)."""
    for family in ("mixtral", "deepseek_v3"):
        for r in pools(4).run(cases.train_parity, family, 2, 2, 4, rebalance_every=1, rebalance_replicas=2,
                              dense_sharding="fsdp", optimizer_sharding=optimizer_sharding):
            parity.assert_within_rel_tol(r)
            assert r["tables"][1] != r["tables"][0], (family, r["tables"])


def test_a_rebalance_without_replicas_keeps_the_parameters(pools):
    """Equal slot counts: the same Parameter objects get the moved rows (the optimizer is untouched)."""
    for r in pools(2).run(cases.train_parity, "mixtral", 1, 2, 4, rebalance_every=1):
        parity.assert_within_rel_tol(r)
        assert r["tables"][1] != r["tables"][0], r["tables"]


def test_the_imbalance_threshold_decides(pools):
    """Routers skewed to experts 0 and 1 (both on EP rank 0 of the contiguous table; GPT-OSS routers have
    a bias) trigger a rebalance over 1.1; an unreachable threshold never does."""
    pool = pools(2)
    skew = ([0, 1], 4.0)
    for over, want in ((1.1, True), (50.0, False)):
        for r in pool.run(cases.train_parity, "gpt_oss", 1, 2, 4, steps=2, skew=skew, rebalance_every=None,
                          rebalance_over=over):
            parity.assert_within_rel_tol(r)
            assert bool(r["rebalances"]) is want, (over, r["rebalances"])
            if want:
                first = r["tables"][1]["model.layers.0.mlp.experts"]
                assert {0, 1} not in [set(row) for row in first], first  # the hot pair was split


def test_saves_after_a_rebalance_write_the_current_tables_and_resume_at_another_ep(pools, tmp_path):
    for r in pools(2).run(cases.rebalance_then_save, str(tmp_path / "ckpt")):
        assert r["events"] == 2 and r["equal"], r
        assert checkpoint_placement(tmp_path / "ckpt") in (r["tables"], next(iter(r["tables"].values())))
        assert all(rows == [[0, 1, 2, 3]] for rows in r["loaded_tables"].values())  # EP 1: contiguous


def test_every_rank_creates_the_same_process_groups(pools):
    """Holder sets of replicas: whether a set needs a new group must not depend on the asking rank (an EDP
    group is one rank's own and another's foreign; a rank-dependent shortcut made ranks call ``new_group``
    a different number of times, and the world hung at the first rebalance with replicas)."""
    sets = [(0, 2), (1, 3), (0, 1, 2), (0, 2), (1, 2, 3), (0, 1, 2, 3), (2,), (0, 1, 2)]
    calls = pools(4).run(cases.group_creation_calls, 2, 2, sets)
    assert all(c == calls[0] for c in calls), calls
    # EDP groups, the world and singletons need none; each other set at most once (the pool may hold it already)
    assert calls[0] in ([[0, 1, 2], [1, 2, 3]], [[0, 1, 2]], [[1, 2, 3]], []), calls[0]


def test_align_rows_moves_fewest_experts_and_respects_nodes():
    old = PlacementTable.from_rows(8, [[0, 1], [2, 3], [4, 5], [6, 7]])
    fitted = PlacementTable.from_rows(8, [[6, 7], [4, 5], [2, 3], [0, 1]])  # the same table, ranks relabelled
    assert align_rows(fitted, old).rows == old.rows
    # 2 nodes of 2: nodes swap whole, ranks inside a node swap; a rank never changes node for free
    aligned = align_rows(fitted, old, "gpus_per_node=2")
    assert aligned.rows == old.rows
    mixed = PlacementTable.from_rows(8, [[0, 7], [1, 6], [2, 5], [3, 4]])
    assert sorted(map(sorted, align_rows(mixed, old, "gpus_per_node=2").rows)) == sorted(map(sorted, mixed.rows))


def test_rebalance_settings_are_checked():
    for bad, match in (({"rebalance_every": 0}, "rebalance_every=0"),
                       ({"rebalance_when_imbalance_over": 1.0}, "above 1"),
                       ({"rebalance_replicas": -1}, "rebalance_replicas=-1"),
                       ({"rebalance_tolerance": "x"}, "rebalance_tolerance='x'")):
        with pytest.raises(hep.HybridEPConfigError, match=match):
            hep.HybridEPConfig(**bad)
    assert hep.HybridEPConfig(rebalance_every=5).rebalancing and not hep.HybridEPConfig().rebalancing


def test_the_benchmark_replay_follows_drifting_routing():
    """``bench_rebalance.replay`` on traces whose hot experts change halfway: tables fitted on the first half go
    stale, online rebalancing (the library's own refit) follows; contiguous is the reference of the traffic."""
    import numpy as np

    from benchmarks import bench_rebalance as bench

    rng = np.random.default_rng(0)

    def step(hot):
        first = rng.choice(hot, size=(256, 1))
        second = rng.integers(0, 16, size=(256, 1))
        second = np.where(second == first, (second + 1) % 16, second)
        return np.concatenate([first, second], axis=1)

    traces = {"model.layers.0.mlp.experts": [step([0, 1, 2, 3] if s < 10 else [12, 13, 14, 15]) for s in range(20)]}
    out = bench.replay(traces, 16, 2, every=2, ep=8, topology=bench.SIM_TOPOLOGY, replicas=8)
    assert set(out) == {"contiguous", "one static table", "static per layer", "online", "in-sample floor"}
    assert out["in-sample floor"]["second_half_worst_imbalance_mean"] <= out["online"]["second_half_worst_imbalance_mean"]
    online, static = out["online"], out["static per layer"]
    assert online["second_half_worst_imbalance_mean"] < static["second_half_worst_imbalance_mean"], out
    assert online["second_half_worst_imbalance_mean"] < out["contiguous"]["second_half_worst_imbalance_mean"]
    assert out["contiguous"]["cross_node_vs_contiguous"] == 1.0


def test_device_load_accounting_follows_the_new_owners():
    """After a move the per-rank load estimate is re-derived from all steps' loads under the new primary
    holders, and the device factors from it (so device-load-aware selection penalises the right ranks)."""
    import torch

    from hf_hybrid_ep.moe.router_controls import RouterControls
    from hf_hybrid_ep.moe.router_rules import SelectionRule

    controls = RouterControls(torch.nn.Linear(8, 4), SelectionRule("softmax_topk"), 2, 4, torch.tensor([0, 0, 1, 1]), 2)
    controls.rank_load = torch.tensor([0.5, 0.5], dtype=torch.float64)
    total = torch.tensor([60.0, 20.0, 10.0, 10.0], dtype=torch.float64)
    controls.remap([0, 1, 1, 0], total, device_load_factors=0.5)  # experts 0 and 3 on rank 0: 70 of 100
    assert controls.ep_rank_of_expert.tolist() == [0, 1, 1, 0]
    assert controls.rank_load.tolist() == pytest.approx([0.7, 0.3])
    # factor = −β (load_r / mean − 1) of each expert's rank: rank 0 at 1.4× the mean, rank 1 at 0.6×
    assert controls.device_factor.tolist() == pytest.approx([-0.2, 0.2, 0.2, -0.2])
