"""What runs on a CUDA device, checked on the CPU with stand-ins: tensors on the ``meta`` device stand for
device tensors wherever the code must follow a parameter's device (a CPU test cannot tell ``cuda:3`` from
``cpu``, but it can tell ``meta`` from ``cpu``)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, tiny_inputs

import hf_hybrid_ep as hep
from hf_hybrid_ep.model_io.optimizer_state import load_optimizer_state, save_optimizer_state


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


def test_the_rank_device_under_nccl_is_cuda_local_rank():
    from hf_hybrid_ep.parallel.devices import cuda_device_for, rank_device

    assert cuda_device_for(3, 8) == torch.device("cuda", 3)
    assert cuda_device_for(3, 1) == torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES set per rank
    with pytest.raises(hep.HybridEPConfigError, match="LOCAL_RANK=5 but this process sees only 4 CUDA devices"):
        cuda_device_for(5, 4)
    with pytest.raises(hep.HybridEPConfigError, match="sees no CUDA device"):
        cuda_device_for(0, 0)
    assert rank_device("cpu") == torch.device("cpu")


def test_parameters_on_another_gpu_are_refused_naming_the_devices():
    # A model moved to "cuda" before parallelize lands on cuda:0 on every rank: refused before any work. A fake
    # tensor (no memory, no CUDA needed) stands in for a parameter on cuda:0; this rank's device is the CPU.
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_tiny_model("qwen3_moe", num_experts=4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.empty_like(model.lm_head.weight, device="cuda:0")
    model.lm_head.weight = torch.nn.Parameter(on_gpu)
    with pytest.raises(hep.HybridEPConfigError, match=r"parameter 'lm_head.weight' is on cuda:0, the current CUDA "
                                                      r"device is none, and this rank's device on the mesh is cpu"):
        hep.parallelize(model)


def test_placing_a_module_moves_parameters_and_buffers():
    # The meta device stands in for the rank's GPU: every parameter and buffer (a persistent one such as
    # DeepSeek's e_score_correction_bias and a non-persistent one such as rotary inv_freq) is moved.
    from hf_hybrid_ep.parallel.devices import place_module

    model = build_tiny_model("deepseek_v3", num_experts=4)
    buffers = dict(model.named_buffers())
    assert any("e_score_correction_bias" in n for n in buffers) and any("inv_freq" in n for n in buffers)
    place_module(model, torch.device("meta"))
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
