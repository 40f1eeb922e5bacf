"""hf-hybrid-ep plan: exact parameter and byte counts, fit decisions, advice when nothing fits."""

from __future__ import annotations

import json

import pytest
from transformers import MixtralConfig

from hf_hybrid_ep.cli import main as cli
from hf_hybrid_ep.planning.planner import Topology, count_parameters, plan

TINY = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     tie_word_embeddings=False)


def test_parameter_counts_match_a_hand_computation():
    counts = count_parameters(TINY)
    embeddings = 2 * 128 * 64  # input embeddings + lm_head
    attention = 64 * 64 + 2 * (64 * 32) + 64 * 64  # q, k, v (2 kv heads × 16), o
    per_layer_dense = attention + 2 * 64 + 4 * 64  # + two norms + router
    experts = 2 * (4 * 64 * 64 + 4 * 64 * 32)  # 2 layers × (gate_up [4,64,64] + down [4,64,32])
    assert counts.expert_params == experts
    assert counts.dense_params == embeddings + 2 * per_layer_dense + 64  # + final norm
    assert counts.total_params == 90944 == counts.dense_params + counts.expert_params


def test_layout_bytes_follow_the_recipe_exactly():
    result = plan(TINY, gpus=4, gpu_memory_gib=1, micro_batch=1, seq_len=8)
    counts = result["model"]
    by_layout = {(p["dp"], p["ep"]): p for p in result["layouts"]}
    assert set(by_layout) == {(4, 1), (2, 2), (1, 4)}
    for (_dp, ep), p in by_layout.items():
        held = counts["dense_params"] + counts["expert_params"] // ep
        assert p["params_per_gpu"] == held
        assert (p["weight_bytes"], p["grad_bytes"], p["optimizer_bytes"]) == (2 * held, 2 * held, 12 * held)
        assert p["memory_per_gpu_bytes"] == 16 * held + p["activation_bytes"]
    assert by_layout[(1, 4)]["a2a_bytes_per_step"] > by_layout[(2, 2)]["a2a_bytes_per_step"] > 0
    assert by_layout[(4, 1)]["a2a_bytes_per_step"] == 0
    assert result["recommended"] is not None


def test_mixtral_8x7b_parameter_count_is_the_published_one():
    result = plan("mistralai/Mixtral-8x7B-v0.1", gpus=8, gpu_memory_gib=141)
    assert abs(result["model"]["total_params"] - 46.7e9) / 46.7e9 <= 0.005
    assert result["recommended"] == {"dp": 1, "ep": 8, "activation_checkpointing": False}


def test_nothing_fits_says_what_would(capsys):
    assert cli(["plan", "--model", "mistralai/Mixtral-8x7B-v0.1", "--gpus", "8", "--gpu-memory-gib", "40",
                "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"] is None and not any(p["fits"] for p in result["layouts"])
    assert "more GPUs of this size do not help" in result["advice"]["message"]
    assert "nothing fits on 8 × 40 GiB" in result["advice"]["message"]  # the unit of --gpu-memory-gib
    for key in ("dp", "ep", "memory_per_gpu_bytes", "fits", "comm_bytes_per_step", "est_step_comm_s"):
        assert key in result["layouts"][0]
    # a model whose experts can be spread thinner: more GPUs do help
    more = plan(TINY, gpus=1, gpu_memory_gib=0.0013, seq_len=8)
    assert more["recommended"] is None and more["advice"]["gpus_needed"] in (2, 4)


def test_the_text_states_its_units_and_the_gpus_per_node_it_assumes():
    from hf_hybrid_ep.planning.planner import format_plan

    text = format_plan(plan(TINY, gpus=4, gpu_memory_gib=1, seq_len=8))
    assert "4 GPUs × 1 GiB" in text
    assert "assumed: 8 GPUs per node (the default; give --topology gpus_per_node=N" in text
    assert "memory in GiB (2^30 bytes), bandwidths in GB/s (10^9 bytes/s)" in text
    given = format_plan(plan(TINY, gpus=4, gpu_memory_gib=1, seq_len=8, topology="gpus_per_node=2"))
    assert "assumed: 2 GPUs per node (--topology gpus_per_node=2)" in given


def test_topology_spec():
    assert Topology.parse("gpus_per_node=4,network_gbps=50").gpus_per_node == 4
    with pytest.raises(ValueError, match="unknown topology key 'gpu'"):
        Topology.parse("gpu=4")


def test_sharded_bytes_follow_the_formula():
    import math

    from hf_hybrid_ep.planning.planner import rank_state_bytes

    m = count_parameters(TINY)
    dense, experts = m.dense_params, m.expert_params // 2  # dp 2 × ep 2 on 4 ranks
    for rank in range(4):
        base = rank_state_bytes(m, 2, 2, rank, "fp32-adamw")
        assert base == {"params": dense + experts, "weight_bytes": 4 * (dense + experts),
                        "grad_bytes": 4 * (dense + experts), "optimizer_bytes": 8 * (dense + experts)}
        z = rank_state_bytes(m, 2, 2, rank, "fp32-adamw", "zero1")
        shard = lambda n, g, i: max(0, min(n - i * math.ceil(n / g), math.ceil(n / g)))  # noqa: E731
        assert z["weight_bytes"] == base["weight_bytes"]
        assert z["optimizer_bytes"] == 8 * (shard(dense, 4, rank) + shard(experts, 2, rank // 2))
        f = rank_state_bytes(m, 2, 2, rank, "fp32-adamw", "none", "fsdp")
        fsdp_dense = sum(shard(s[0], 4, rank) * math.prod(s[1:]) for s in m.dense_shapes)
        assert f["weight_bytes"] == 4 * (fsdp_dense + experts) < base["weight_bytes"]
    # every dense element is held by exactly one rank under FSDP, and its state by one rank under zero1
    assert sum(rank_state_bytes(m, 2, 2, r, "fp32-adamw", "none", "fsdp")["params"] for r in range(4)) == \
        m.dense_params + 2 * m.expert_params
    assert sum(rank_state_bytes(m, 2, 2, r, "fp32-adamw", "zero1")["optimizer_bytes"] for r in range(4)) == \
        8 * (m.dense_params + m.expert_params)


def test_bytes_split_by_link_level_follow_the_topology():
    # 4 GPUs, 2 per node, one node per rack (so the network hop between the nodes is cross-rack)
    result = plan(TINY, gpus=4, gpu_memory_gib=1, topology="gpus_per_node=2,nodes_per_rack=1", seq_len=8)
    D, X = result["model"]["dense_params"], result["model"]["expert_params"]
    layouts = {(p["dp"], p["ep"]): p for p in result["layouts"]}
    p = layouts[(2, 2)]
    assert p["ep_group"] == "intra_node"
    # dense all-reduce (2·D bf16 bytes) over both nodes, hierarchically: inside the node 2·(2−1)/2 · 2D = 2D,
    # between the nodes 2·(2−1)/2 · 2D / 2 = D. Expert all-reduce (X/2 params × 2 B = X bytes) over the EDP
    # group {0, 2} (one rank per node): 2·(2−1)/2 · X = X across. All-to-all inside the node: routed bytes
    # k·B·S·H·2·layers = 2·1·8·64·2·2 = 4096, ×4 (dispatch/combine, fwd/bwd), half to the other rank: 8192.
    assert p["comm_bytes_intra_node"] == 2 * D + 8192
    assert p["comm_bytes_inter_node"] == 0
    assert p["comm_bytes_cross_rack"] == D + X
    q = layouts[(1, 4)]  # ep 4 > 2 GPUs per node: the EP group spans both nodes (and both racks)
    assert q["ep_group"] == "cross_rack"
    # all-to-all: 1/4 stays, 1/4 to the node's other rank, 2/4 to the other node: 16384·(1/4), 16384·(2/4)
    assert q["comm_bytes_intra_node"] == 2 * D + 4096 and q["comm_bytes_cross_rack"] == D + 8192
