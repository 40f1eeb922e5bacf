"""One MoE layer = one counts exchange + the token exchanges, inside the EP group, and one host read.

Counted for one layer's forward and backward at (dp, ep) = (2, 2) with each dispatcher (and the deduplicated one
with EP over two nodes):
collectives per process group (``torch.distributed`` wrapped), and the ATen ops that synchronise the host
with a CUDA device (under a ``TorchDispatchMode``; tests/sync_counting.py). Neither direction runs a
collective over the world; the forward reads the host once (the counts), the backward never.
"""

from __future__ import annotations

import pytest
import sync_counting


@pytest.mark.parametrize("overlap_degree", [1, 2])
@pytest.mark.parametrize("dispatcher", ["torch", "triton"])
def test_one_counts_exchange_and_one_host_read_per_layer(pools, dispatcher, overlap_degree):
    for r in pools(4).run(sync_counting.layer_costs, dispatcher, 2, overlap_degree):
        assert r["grads"]
        chunks = overlap_degree
        assert r["forward"]["collectives"] == {"all_to_all_single@ep": 1 + 2 * chunks}, r  # counts + tokens
        assert r["backward"]["collectives"] == {"all_to_all_single@ep": 2 * chunks}, r
        assert r["forward"]["syncs"] == {"Tensor.tolist": 1}, r  # the counts, once
        assert r["backward"]["syncs"] == {}, r


@pytest.mark.parametrize("overlap_degree", [1, 2])
def test_deduplicated_layer_keeps_one_counts_exchange_and_one_host_read(pools, overlap_degree):
    # ep 4 over 2 nodes: the counts over the EP group; per chunk and direction one exchange between the
    # nodes (stage A) and one inside the node (stage B); inside one node the same as one row per pair
    for r in pools(4).run(sync_counting.layer_costs, "dedup", 2, overlap_degree):
        assert r["grads"]
        assert r["forward"]["collectives"] == {"all_to_all_single@ep": 1 + 2 * overlap_degree}, r
        assert r["backward"]["collectives"] == {"all_to_all_single@ep": 2 * overlap_degree}, r
        assert r["forward"]["syncs"] == {"Tensor.tolist": 1}, r
        assert r["backward"]["syncs"] == {}, r
    for r in pools(4).run(sync_counting.layer_costs, "dedup", 1, overlap_degree, "gpus_per_node=2"):
        assert r["grads"]
        chunks = overlap_degree
        assert r["forward"]["collectives"] == {"all_to_all_single@ep": 1, "all_to_all_single@inter": 2 * chunks,
                                               "all_to_all_single@intra": 2 * chunks}, r
        assert r["backward"]["collectives"] == {"all_to_all_single@inter": 2 * chunks,
                                                "all_to_all_single@intra": 2 * chunks}, r
        assert r["forward"]["syncs"] == {"Tensor.tolist": 1}, r
        assert r["backward"]["syncs"] == {}, r


@pytest.mark.parametrize("dispatcher", ["torch", "triton"])
def test_pure_dp_layer_makes_no_collective(pools, dispatcher):
    # ep = 1: every rank holds every expert, so the exchanges are local copies, not collectives on a one-rank
    # group (on gloo those cost pure DP 0.35–0.84 s per step in the regime benchmarks)
    for r in pools(4).run(sync_counting.layer_costs, dispatcher, 4):
        assert r["grads"]
        assert r["forward"]["collectives"] == {} and r["backward"]["collectives"] == {}, r
        assert r["forward"]["syncs"] == {"Tensor.tolist": 1}, r


def test_shadow_refresh_moves_nothing_when_no_rank_chose_a_shadow(pools):
    # after_optimizer_step: the loads' world all-reduce, the shadow-mask all-gather, and per layer and expert
    # parameter one weight exchange only where some rank of the EP group holds a shadow
    for r in pools(4).run(sync_counting.shadow_refresh_costs, False):
        assert r["held"] == 0 and {k: v for k, v in r["collectives"].items() if "all_to_all" in k} == {}, r
        assert r["collectives"].get("all_gather_single@ep") == 1, r
    for r in pools(4).run(sync_counting.shadow_refresh_costs, True):
        exchanges = sum(v for k, v in r["collectives"].items() if "all_to_all" in k)
        assert exchanges == r["params_per_layer"] * r["layers"], r


def test_chunked_layer_overlaps_its_backward_exchanges(pools):
    # overlap_degree=3: every chunk's combine gradient is launched before the first is waited for, and a
    # chunk's dispatch gradient travels while the previous chunk's experts run their backward
    for events in pools(2).run(sync_counting.pipelined_backward_order, 3):
        assert events[:3] == ["launch combine 2", "launch combine 1", "launch combine 0"], events
        assert events.index("launch dispatch 2") < events.index("wait combine 1") < events.index("wait dispatch 2"), events
        assert sorted(events) == sorted(f"{k} {p} {c}" for k in ("launch", "wait") for p in ("combine", "dispatch")
                                        for c in range(3)), events
