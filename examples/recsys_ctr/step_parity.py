"""One Adam step of the CTR model's MoE variant on hybrid EP against one process on the global batch.

Run inside an initialised process group (every rank calls it): the hybrid model trains on this rank's
slice of a global batch, a reference copy on the whole batch; both start from the same weights. The
result carries the relative loss difference and the largest per-tensor relative parameter difference
(‖a − b‖ / ‖b‖, this rank's expert slots against the reference's same slots).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from data import FEATURES, ClickWorld
from model import CTRModel

import hf_hybrid_ep as hep

REL_TOL = 1e-5  # fp32 round-off: the library's parity criterion for tensors that do not start at zero
ADAM_EPS = 1e-6  # well above the gradients' round-off, so Adam's normalisation does not amplify it


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def one_step_parity(dp: int, ep: int, per_rank: int = 64, lr: float = 1e-3) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CTRModel("moe")
    ref = copy.deepcopy(model)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    data = ClickWorld().sample(per_rank * world, seed=3).with_format("torch")[:]  # dict of tensors
    local = {k: data[k][rank * per_rank : (rank + 1) * per_rank] for k in (*FEATURES, "click")}
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
    opts = [torch.optim.Adam(m.parameters(), lr=lr, eps=ADAM_EPS) for m in (model, ref)]
    loss = loss_fn(model(*(local[k] for k in FEATURES)), local["click"])
    loss.backward()
    ref_loss = loss_fn(ref(*(data[k] for k in FEATURES)), data["click"])
    ref_loss.backward()
    for o in opts:
        o.step()
    hep.wait_for_parameters(model)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    local_experts = hep.state_of(model).layers[0].local_experts
    expert_params = {id(p) for layer in hep.state_of(model).layers for p in layer.expert_parameters()}
    ref_params = dict(ref.named_parameters())
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        want = ref_params[name].detach()
        diff = _rel(p.detach(), want[local_experts] if id(p) in expert_params else want)
        if diff > worst:
            worst, worst_name = diff, name
    return {"dp": dp, "ep": ep, "loss_rel": abs(mean.item() / world - ref_loss.item()) / ref_loss.item(),
            "max_param_rel": worst, "worst_param": worst_name, "local_experts": len(local_experts),
            "passed": worst <= REL_TOL and abs(mean.item() / world - ref_loss.item()) / ref_loss.item() <= REL_TOL}
