"""The deduplicated dispatcher (``dispatcher="dedup"``): one row per token and destination, faithful.

World 4 inside one node (one stage: one row per (token, rank)), as 2 "nodes" × 2 ranks (``gpus_per_node=2``)
with ep 4 (each EP group spans both nodes: stage A one row per (token, node) between the nodes, stage B one
row per (token, rank) inside them), and as 4 nodes of one rank (stage B a local copy). The reference is one
process training the unsharded model (:mod:`parity`), and the per-pair dispatcher on the same layout; rows
are checked against ``trace_traffic`` on the routing each rank sent.
"""

from __future__ import annotations

import dist_cases as cases
import parity
import pytest

from hf_hybrid_ep.dispatch import resolve_backend

FAMILIES = parity.FAMILIES
TWO_NODES = "gpus_per_node=2"


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["ep4", "dp2xep2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_parity_inside_one_node(pools, family, layout):
    dp, ep = layout
    parity.assert_faithful(pools(4).run(cases.train_parity, family, dp, ep, 8, dispatcher="dedup"))


@pytest.mark.parametrize("family", FAMILIES)
def test_training_parity_with_ep_across_two_nodes(pools, family):
    parity.assert_faithful(pools(4).run(cases.train_parity, family, 1, 4, 4, dispatcher="dedup",
                                        topology=TWO_NODES))


@pytest.mark.parametrize(("layout", "topology"), [((2, 2), "gpus_per_node=1"), ((1, 4), "gpus_per_node=1")],
                         ids=["dp2xep2-1-per-node", "ep4-1-per-node"])
def test_training_parity_one_rank_per_node(pools, layout, topology):
    dp, ep = layout
    parity.assert_faithful(pools(4).run(cases.train_parity, "qwen2_moe", dp, ep, 4, dispatcher="dedup",
                                        topology=topology))


def test_training_parity_with_replicas_across_nodes(pools):
    # every expert on two ranks, one on each node: a pair stays on its source when that holds the expert,
    # else goes to a replica chosen by position, on either node
    placement = [[0, 1], [2, 3], [3, 0], [1, 2]]
    parity.assert_faithful(pools(4).run(cases.train_parity, "mixtral", 1, 4, 4, placement=placement,
                                        dispatcher="dedup", topology=TWO_NODES))


def test_training_parity_with_shadows_chunks_checkpointing_and_rebalancing(pools):
    # hot-expert shadows kept at the source, the overlapped chunked exchange, activation checkpointing, and
    # experts moving online (the tables and the dispatchers rebuilt) — each with the exchange across the nodes
    results = pools(4).run(cases.train_parity, "gpt_oss", 1, 4, 4, dispatcher="dedup", topology=TWO_NODES,
                           shadow_capacity=1, skew=([0, 2], 4.0), seq=32)
    parity.assert_faithful(results)
    assert all(len(r["shadow_steps"]) >= 2 for r in results), results
    assert all(step["rows_local"] > 0 for r in results for step in r["shadow_steps"][1:]), results
    parity.assert_faithful(pools(4).run(cases.train_parity, "qwen3_moe", 1, 4, 4, dispatcher="dedup",
                                        topology=TWO_NODES, overlap_degree=2))
    # activation checkpointing: the forward's two-stage exchanges run again inside the backward
    parity.assert_faithful(pools(4).run(cases.train_parity, "qwen2_moe", 1, 4, 4, dispatcher="dedup",
                                        topology=TWO_NODES, gradient_checkpointing=True))
    results = pools(4).run(cases.train_parity, "mixtral", 1, 4, 4, dispatcher="dedup", topology=TWO_NODES,
                           rebalance_every=1, rebalance_replicas=4)
    for r in results:  # the criterion of the rebalancing tests (tests/test_rebalance.py)
        parity.assert_within_rel_tol(r)
        assert r["tables"][1] != r["tables"][0] and any(sent > 0 for _, sent in r["rebalances"]), r


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bf16_forward(pools, family):
    # In a low-precision dtype the partial sums are rounded once more before they cross back (the per-pair
    # dispatcher rounds and sums exactly as transformers does, and is bit-identical here: its measured
    # spread is 0). The bound: what bf16 rounding itself moves the single-process result, its distance from
    # the fp32 computation.
    import torch

    for topology in (TWO_NODES, None):
        for r in pools(4).run(cases.forward_parity, family, 8, torch.bfloat16, "dedup", topology):
            assert r["rel"] <= r["fp32_distance"], (topology, r)


@pytest.mark.parametrize(("top_k", "capacity"), [(2, None), (4, None), (2, 0.6)], ids=["top2", "top4", "top2-drops"])
@pytest.mark.parametrize("topology", [TWO_NODES, None], ids=["two-nodes", "one-node"])
def test_sends_each_token_once_per_destination(pools, top_k, capacity, topology):
    results = pools(4).run(cases.dispatcher_equivalence, "qwen3_moe", 1, 4, topology, num_experts=8, top_k=top_k,
                           capacity_factor=capacity)
    for rank, r in enumerate(results):
        assert r["kinds"] == ["DedupDispatcher"], r
        # the parity suite's per-tensor tolerance (the sums over a token's pairs are grouped by destination)
        assert r["logits_rel"] <= cases.REL_TOL and r["grad_rel"] <= cases.REL_TOL, (rank, r)
        rows = r["phase_rows"]
        # exact: without replicas the routing decides the destinations; a rank sends its own node rows
        assert rows["dispatch_inter"] == rows["combine_inter_backward"] == r["predicted"]["cross_node"], r
        assert rows["dispatch"] == rows["combine_backward"], r
        assert (rows["dispatch_inter"] > 0) == (topology is not None), r
    # what crosses back equals what crossed over; the rank rows (sent by the relays) as traced at the sources
    total = {p: sum(r["phase_rows"][p] for r in results) for p in results[0]["phase_rows"]}
    assert total["dispatch"] == total["combine"] and total["dispatch_inter"] == total["combine_inter"], total
    assert total["dispatch"] == sum(r["predicted"]["rank_rows"] for r in results) > 0, results
    if capacity is not None:
        assert sum(r["dropped"] for r in results) > 0
    if top_k == 4:  # a token's 4 experts on 4 ranks of 2 experts: far fewer rows than (token, expert) pairs
        sent = sum(r["phase_rows"]["dispatch"] + r["phase_rows"]["dispatch_inter"] for r in results)
        assert sent < 0.9 * sum(r["plain_remote_rows"] for r in results)


def test_auto_on_cuda_inside_a_node_picks_it_where_it_sends_fewer_bytes():
    """The CUDA rule, decided from the layout alone (no GPU here): top-k ≥ 2 with several experts per rank."""
    backend, why = resolve_backend("auto", "cuda", ep_degree=2, top_k=2, slots_per_rank=2)
    assert backend == "dedup" and why.startswith("auto: top-k 2 with 2 experts per rank, so a token's pairs on one "
                                                 "rank travel as one row"), why
    assert resolve_backend("auto", "cuda", ep_degree=4, top_k=2, slots_per_rank=1)[0] in ("torch", "triton")
    assert resolve_backend("auto", "cpu", ep_degree=2, top_k=2, slots_per_rank=2)[0] == "torch"


def test_auto_picks_it_where_it_sends_fewer_bytes_and_says_why(pools):
    pool = pools(4)
    results = pool.run(cases.dispatcher_choice, 1, 4, "auto", TWO_NODES)
    assert all(r["kinds"] == ["DedupDispatcher"] for r in results), results
    assert results[0]["log"] == ["dispatcher 'auto' -> dedup (auto: the EP group spans 2 nodes, so each token "
                                 "crosses to a node once and to a rank once)"], results[0]
    assert all(r["log"] == [] for r in results[1:]), results  # said once, by rank 0
    # no topology: nodes of LOCAL_WORLD_SIZE ranks, as torchrun and accelerate launch set it
    assert all(r["kinds"] == ["DedupDispatcher"] for r in pool.run(cases.dispatcher_choice, 1, 4, "auto", None, 2))
    # inside one node on the CPU: 2 experts per rank with top-2 would send fewer rows, but the per-pair exchange
    # was measured faster there (on CUDA auto picks dedup for this layout: test_auto_on_cuda_inside_a_node)
    results = pool.run(cases.dispatcher_choice, 2, 2, "auto")
    assert all(r["kinds"] == ["TorchDispatcher"] for r in results), results
    assert results[0]["log"] == ["dispatcher 'auto' -> torch (auto: one node on the CPU: the deduplicated "
                                 "exchange's packing and fan-out cost more than the bytes it saves over loopback "
                                 "(dispatcher='dedup' to compare); the per-pair exchange (no CUDA))"], results[0]
    # one expert per rank: every pair of a token goes to another rank, nothing to deduplicate
    results = pool.run(cases.dispatcher_choice, 1, 4, "auto")
    assert all(r["kinds"] == ["TorchDispatcher"] for r in results), results
    assert results[0]["log"] == ["dispatcher 'auto' -> torch (auto: top-k 2 with 1 expert(s) per rank: no token has "
                                 "two pairs on one rank; the per-pair exchange (no CUDA))"], results[0]
    assert all(r["kinds"] == ["TorchDispatcher"] for r in pool.run(cases.dispatcher_choice, 1, 4, "torch", TWO_NODES))
    for r in pool.run(cases.dispatcher_choice, 1, 4, "dedup", None, 3):
        assert r["error"] == ("ep_degree=4 spans nodes of 3 ranks but is not a multiple of 3: an EP group must "
                              "span whole nodes"), r
