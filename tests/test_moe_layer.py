"""hf_hybrid_ep.moe.standalone.MoE: a transformers-layout MoE layer for any PyTorch model."""

from __future__ import annotations

import copy

import dist_cases as cases
import pytest
import torch
from torch import nn

import hf_hybrid_ep as hep
from hf_hybrid_ep.moe.router_rules import match_rule
from hf_hybrid_ep.moe.standalone import MoE, MoEConfig


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_layer_is_a_transformers_style_moe(scoring):
    torch.manual_seed(0)
    moe = MoE(hidden_size=16, num_experts=8, top_k=2, intermediate_size=8, scoring=scoring, shared_expert_size=8)
    assert hep.is_fused_experts(moe.experts)
    assert match_rule(moe.gate, 2, 16) is not None  # router controls apply
    x = torch.randn(3, 5, 16)
    eager = copy.deepcopy(moe)
    eager.experts.config._experts_implementation = "eager"
    assert torch.allclose(moe(x), eager(x), rtol=1e-6, atol=1e-6)  # grouped_mm == the reference loop
    model = nn.Sequential(nn.Linear(16, 16), moe)
    reference = copy.deepcopy(model)
    hep.parallelize(model)
    assert torch.equal(model(x), reference(x))


def test_bad_layer_settings():
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        MoEConfig(hidden_size=8, num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="scoring='relu'"):
        MoEConfig(hidden_size=8, num_experts=8, scoring="relu")


@pytest.mark.parametrize("layout", [(2, 2), (1, 4)], ids=["dp2xep2", "dp1xep4"])
def test_ctr_model_step_equals_single_process(pools, layout):
    for r in pools(4).run(cases.ctr_parity, *layout):
        assert r["loss_rel"] <= cases.REL_TOL and r["max_param_rel"] <= cases.REL_TOL and r["passed"], r
        assert r["local_experts"] == 128 // layout[1]
