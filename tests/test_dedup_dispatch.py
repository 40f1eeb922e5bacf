"""The deduplicated dispatcher (``dispatcher="dedup"``): one row per token and destination, faithful.

World 4 inside one node (one stage: one row per (token, rank)), as 2 "nodes" × 2 ranks (``gpus_per_node=2``)
with ep 4 (each EP group spans both nodes: stage A one row per (token, node) between the nodes, stage B one
row per (token, rank) inside them), and as 4 nodes of one rank (stage B a local copy). The reference is one
process training the unsharded model (:mod:`parity`), and the per-pair dispatcher on the same layout; rows
are checked against ``trace_traffic`` on the routing each rank sent.
"""

from __future__ import annotations

import dataclasses

import dist_cases as cases
import parity
import pytest

from hf_hybrid_ep.dispatch import resolve_backend
from hf_hybrid_ep.dispatch.cost import MEMORY_GBPS, ExchangeShape, exchange_seconds
from hf_hybrid_ep.parallel.topology import Topology

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


QWEN3_EP8 = ExchangeShape(num_experts=128, top_k=8, ep=8, per_node=8, per_rack=8, hidden=2048, act_bytes=2)


def test_auto_on_cuda_picks_the_exchange_predicted_faster(monkeypatch):
    """The CUDA choice, from the layout and the cost model alone (no GPU here; the Triton interpreter flag makes
    the kernels importable): Qwen3-30B-A3B at EP 8 inside a node and EP 16 over two nodes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    nvlink = Topology.parse("gpus_per_node=8,nvlink_gbps=450,network_gbps=50")
    backend, why = resolve_backend("auto", "cuda", QWEN3_EP8, nvlink)
    times = {name: exchange_seconds(QWEN3_EP8, name, nvlink, MEMORY_GBPS["cuda"]) for name in ("triton", "dedup")}
    # inside a node the deduplicated rows cut the NVLink bytes by a third, but their gathers move 10x the fused
    # kernels' bytes in HBM
    assert backend == "triton" and times["triton"]["total_s"] < times["dedup"]["total_s"], times
    assert times["dedup"]["link_s"] < 0.7 * times["triton"]["link_s"], times
    assert times["dedup"]["memory_s"] > 10 * times["triton"]["memory_s"], times
    t, d = times["triton"], times["dedup"]
    assert why == (f"auto: predicted per token and MoE layer over a training step triton {t['total_s'] * 1e6:.3g} µs "
                   f"(links {t['link_s'] * 1e6:.3g}, memory {t['memory_s'] * 1e6:.3g}) vs dedup "
                   f"{d['total_s'] * 1e6:.3g} µs (links {d['link_s'] * 1e6:.3g}, memory {d['memory_s'] * 1e6:.3g}), "
                   "links 450 / 50 / 50 GB/s (intra-node / inter-node / cross-rack), memory 2680 GB/s (cuda); the "
                   "per-pair exchange (with the Triton kernels)"), why
    across = dataclasses.replace(QWEN3_EP8, ep=16)
    assert resolve_backend("auto", "cuda", across, nvlink)[0] == "triton"  # 400 Gbit/s per GPU: still per pair
    slow = Topology.parse("gpus_per_node=8,nvlink_gbps=450,network_gbps=12.5")  # 100 Gbit/s per GPU
    assert resolve_backend("auto", "cuda", across, slow)[0] == "dedup"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_backend("auto", "cuda", across, slow)[0] == "dedup"
    assert resolve_backend("auto", "cuda", QWEN3_EP8, nvlink)[0] == "torch"  # the unfused per-pair path
    assert resolve_backend("auto", "cuda", dataclasses.replace(QWEN3_EP8, ep=1))[1] == (
        "auto: one rank per EP group: nothing crosses ranks; the per-pair exchange (Triton not importable)")


def _said(backend: str, why: str) -> list[str]:
    return [f"dispatcher 'auto' -> {backend} ({why})"]


def test_auto_picks_the_exchange_predicted_faster_and_says_why(pools):
    """On the CPU, the tiny Qwen3-MoE (4 experts, top-2, hidden 64, fp32): the choice and its log line are the cost
    model's for the layout, the topology's links and the CPU's memory figure."""
    pool = pools(4)
    tiny = ExchangeShape(num_experts=4, top_k=2, ep=4, per_node=2, per_rack=4, hidden=64, act_bytes=4)
    # EP over two nodes at the default links (25 GB/s between nodes): the fan-out costs more than it saves
    results = pool.run(cases.dispatcher_choice, 1, 4, "auto", TWO_NODES)
    assert all(r["kinds"] == ["TorchDispatcher"] for r in results), results
    assert results[0]["log"] == _said(*resolve_backend("auto", "cpu", tiny, Topology.parse(TWO_NODES))), results[0]
    assert all(r["log"] == [] for r in results[1:]), results  # said once, by rank 0
    # a slow link between the nodes: a token crosses to the other node once instead of once per expert there
    slow = TWO_NODES + ",network_gbps=0.01"
    backend, why = resolve_backend("auto", "cpu", tiny, Topology.parse(slow))
    assert backend == "dedup" and why.endswith("; the deduplicated exchange"), why
    results = pool.run(cases.dispatcher_choice, 1, 4, "auto", slow)
    assert all(r["kinds"] == ["DedupDispatcher"] for r in results) and results[0]["log"] == _said(backend, why)
    # no topology: nodes of LOCAL_WORLD_SIZE ranks, as torchrun and accelerate launch set it; the default links
    assert all(r["kinds"] == ["TorchDispatcher"] for r in pool.run(cases.dispatcher_choice, 1, 4, "auto", None, 2))
    # inside one node (2 experts per rank: a token's two experts share a rank 1 time in 3)
    results = pool.run(cases.dispatcher_choice, 2, 2, "auto")
    assert all(r["kinds"] == ["TorchDispatcher"] for r in results), results
    inside = dataclasses.replace(tiny, ep=2, per_node=2, per_rack=2)
    assert results[0]["log"] == _said(*resolve_backend("auto", "cpu", inside)), results[0]
    assert "the per-pair exchange (no CUDA)" in results[0]["log"][0]
    assert all(r["kinds"] == ["TorchDispatcher"] for r in pool.run(cases.dispatcher_choice, 1, 4, "torch", TWO_NODES))
    for r in pool.run(cases.dispatcher_choice, 1, 4, "dedup", None, 3):
        assert r["error"] == ("ep_degree=4 spans nodes of 3 ranks but is not a multiple of 3: an EP group must "
                              "span whole nodes"), r


@pytest.mark.parametrize("topology", [None, TWO_NODES], ids=["one-node", "two-nodes"])
def test_gather_bytes_are_what_the_step_time_model_says(pools, topology):
    """The bytes the gathers around one layer's exchange read and write (forward and backward, counted per ATen op
    on every rank, ``tests/memory_counting.py``) against ``dispatch.cost.memory_bytes``, which the step-time model
    and ``auto`` use: within 10% for both exchanges (the integer bookkeeping the model leaves out: 1–3% at hidden
    256 fp32), and the part that grows with the hidden size (256 against 64) within 3% (the model prices the
    expected rows of uniform routing, each rank routes 512 tokens)."""
    wide, narrow = (pools(4).run(cases.exchange_memory, topology, hidden) for hidden in (256, 64))
    for rank, (w, n) in enumerate(zip(wide, narrow, strict=True)):
        for backend in ("torch", "dedup"):
            measured, predicted = w[backend]["measured"], w[backend]["predicted"]
            assert abs(predicted / measured - 1) <= 0.10, (rank, backend, w[backend])
            growth = (predicted - n[backend]["predicted"]) / (measured - n[backend]["measured"])
            assert abs(growth - 1) <= 0.03, (rank, backend, growth)
        assert w["dedup"]["measured"] > 3 * w["torch"]["measured"], w  # top-4 of 16 experts at EP 4


@pytest.mark.parametrize("topology", [None, TWO_NODES], ids=["one-node", "two-nodes"])
def test_fan_out_and_partial_sums_hold_at_most_the_chunk_bound(pools, topology):
    """With a 64 KiB bound, the largest tensor the deduplicated exchange creates is one of its row buffers (rows
    sent, received or returned): the fan-out's backward, the partial sums, their weight gradients and the node sums
    never hold their ``k`` (or ``M``) picked rows per row for the whole layer at once."""
    chunk = 64 * 2**10
    for r in pools(4).run(cases.exchange_memory, topology, 256, chunk):
        dedup = r["dedup"]
        assert dedup["largest"] <= max(chunk, dedup["row_buffer"]), dedup
        # the per-pair exchange's largest is a row buffer too, at the default bound
        assert r["torch"]["largest"] <= r["torch"]["row_buffer"], r["torch"]
