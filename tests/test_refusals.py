"""parallelize refuses models it cannot shard, naming the model or module, before changing anything."""

from __future__ import annotations

import parity
import pytest
import torch
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM, Llama4TextConfig, LlamaConfig

import hf_hybrid_ep as hep


def test_model_without_routed_experts():
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2)
    )
    with pytest.raises(hep.HybridEPConfigError, match="LlamaForCausalLM has no routed experts"):
        hep.parallelize(model)


def test_undecorated_experts_module_is_named():
    config = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                              num_local_experts=2, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(hep.HybridEPConfigError, match=r"Llama4TextExperts.*not decorated"):
        hep.parallelize(model)


def test_experts_module_that_cannot_be_sharded():
    model = build_tiny_model("mixtral", num_experts=4)
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = torch.nn.Parameter(torch.zeros(3, 64, 32))
    with pytest.raises(hep.HybridEPConfigError, match=r"cannot shard model.layers.1.mlp.experts \(MixtralExperts\)"):
        hep.parallelize(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # nothing was changed


def test_world_of_one_is_the_identity():
    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    ids = torch.randint(3, 100, (2, 6))
    want = model(input_ids=ids).logits
    hep.parallelize(model)
    # the same computation; the grouped GEMM sees the rows in another order (fp32 round-off only)
    assert parity.rel(model(input_ids=ids).logits, want) <= parity.REL_TOL
    with pytest.raises(hep.HybridEPConfigError, match="already parallelized"):
        hep.parallelize(model)
