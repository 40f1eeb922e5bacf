"""HybridEPConfig: defaults, refusals naming the values, dict/YAML/env construction."""

from __future__ import annotations

import pytest

from hf_hybrid_ep import HybridEPConfig, HybridEPConfigError


def test_default_layout_keeps_ep_inside_the_node():
    # 16 ranks on 2 nodes of 8, 64 experts: EP = 8 (one node), DP = 2 (across nodes)
    assert HybridEPConfig().resolve(16, 64, local_world_size=8) == (2, 8)
    # expert count limits EP: 6 experts on 4 ranks -> ep 2
    assert HybridEPConfig().resolve(4, 6, local_world_size=4) == (2, 2)
    assert HybridEPConfig().resolve(3, 6, local_world_size=3) == (1, 3)
    assert HybridEPConfig().resolve(1, 8) == (1, 1)


def test_one_degree_derives_the_other():
    assert HybridEPConfig(ep_degree=2).resolve(4, 8) == (2, 2)
    assert HybridEPConfig(dp_degree=4).resolve(4, 8) == (4, 1)


@pytest.mark.parametrize(
    ("kwargs", "world", "experts", "needle"),
    [
        ({"dp_degree": 3, "ep_degree": 2}, 4, 8, "3 × 2 = 6 does not equal the world size 4"),
        ({"ep_degree": 3}, 4, 6, "ep_degree=3 does not divide the world size 4"),
        ({"ep_degree": 4}, 4, 6, "num_experts=6 is not divisible by ep_degree=4"),
        ({"ep_degree": 2, "placement": [[0, 1]]}, 2, 2, "placement table has 1 rows but ep_degree=2"),
    ],
)
def test_bad_layouts_are_refused_naming_the_values(kwargs, world, experts, needle):
    with pytest.raises(HybridEPConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        HybridEPConfig(**kwargs).resolve(world, experts)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dp_degree": 0}, "dp_degree=0 must be a positive integer"),
        ({"dispatcher": "deepep"}, "dispatcher='deepep' is not available"),
        ({"placement": "striped"}, "placement='striped' is unknown"),
        ({"placement": [[0, "a"]]}, "must be a list of lists of integer expert ids"),
        ({"shadow_experts": "yes"}, "shadow_experts='yes' must be true or false"),
        ({"shadow_capacity": 0}, "shadow_capacity=0 must be a positive integer"),
    ],
)
def test_bad_values_are_refused_at_construction(kwargs, needle):
    with pytest.raises(HybridEPConfigError, match=needle):
        HybridEPConfig(**kwargs)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(HybridEPConfigError, match=r"unknown HybridEPConfig key\(s\) \['ep_size'\]"):
        HybridEPConfig.from_dict({"ep_size": 2})


def test_from_yaml(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("hybrid_ep:\n  ep_degree: 2\n  placement: [[0, 3], [1, 2]]\n")
    config = HybridEPConfig.from_yaml(path)
    assert config.ep_degree == 2 and config.placement == [[0, 3], [1, 2]]
    assert HybridEPConfig.from_dict(config.to_dict()) == config
    with pytest.raises(HybridEPConfigError, match="does not exist"):
        HybridEPConfig.from_yaml(tmp_path / "missing.yaml")


def test_env_twins(monkeypatch):
    monkeypatch.setenv("HF_HYBRID_EP_EP_DEGREE", "2")
    monkeypatch.setenv("HF_HYBRID_EP_CHECK_FINITE", "false")
    config = HybridEPConfig()
    assert config.ep_degree == 2 and config.check_finite is False
    assert HybridEPConfig(ep_degree=4).ep_degree == 4  # an explicit value wins
    monkeypatch.setenv("HF_HYBRID_EP_DP_DEGREE", "two")
    with pytest.raises(HybridEPConfigError, match="HF_HYBRID_EP_DP_DEGREE='two' is not an integer"):
        HybridEPConfig()
    assert HybridEPConfig(dp_degree=2).dp_degree == 2  # a twin is read only for a field left at its default


def test_shadow_env_twins(monkeypatch):
    monkeypatch.setenv("HF_HYBRID_EP_SHADOW_EXPERTS", "true")
    monkeypatch.setenv("HF_HYBRID_EP_SHADOW_CAPACITY", "3")
    config = HybridEPConfig()
    assert config.shadow_experts is True and config.shadow_capacity == 3
