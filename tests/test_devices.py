"""What runs on a CUDA device, checked on the CPU with stand-ins: tensors on the ``meta`` device stand for
device tensors wherever the code must follow a parameter's device (a CPU test cannot tell ``cuda:3`` from
``cpu``, but it can tell ``meta`` from ``cpu``)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, tiny_inputs

import hf_hybrid_ep as hep
from hf_hybrid_ep.integrations.optimizer_state import load_optimizer_state, save_optimizer_state


def _trained(sharding: str, step: bool = True):
    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", num_experts=4)
    hep.parallelize(model, hep.HybridEPConfig(optimizer_sharding=sharding))
    optimizer = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert optimizer.defaults["fused"]
    if step:
        model(**tiny_inputs(model, 2, 6, torch.Generator().manual_seed(1))).loss.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_resumed_optimizer_state_lives_on_the_parameters_device(tmp_path, sharding):
    # A fused (or capturable) AdamW reads `step` on the parameter's device: a host `step` beside CUDA
    # parameters is an illegal memory access or a device-mismatch error at the first step after a resume.
    save_optimizer_state(*_trained(sharding), tmp_path)
    model, optimizer = _trained(sharding, step=False)
    stepped = [q for g in optimizer.param_groups for q in g["params"]]
    for q in stepped:  # the meta device stands in for the GPU (the same tensor objects, moved)
        torch.utils.swap_tensors(q, type(q)(torch.empty_like(q, device="meta")) if isinstance(q, torch.nn.Parameter)
                                 else torch.empty_like(q, device="meta"))
    load_optimizer_state(model, optimizer, tmp_path, verify=False)
    placed = [(k, v.device) for q in stepped for k, v in optimizer.state[q].items()]
    assert {k for k, _ in placed} == {"step", "exp_avg", "exp_avg_sq"}
    assert {d.type for _, d in placed} == {"meta"}, sorted({(k, str(d)) for k, d in placed})


def test_scalar_state_follows_torchs_rule():
    from hf_hybrid_ep.parallel.zero import scalar_state

    p = torch.empty(3, device="meta")
    assert scalar_state(4.0, p, {"fused": True}).device.type == "meta"
    assert scalar_state(4.0, p, {"capturable": True, "fused": None}).device.type == "meta"
    step = scalar_state(4.0, p, {"fused": None, "capturable": False})
    assert step.device.type == "cpu" and step.dtype == torch.float32 and step.item() == 4.0
