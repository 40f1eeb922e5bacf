"""LoRA cases: PEFT adapters on dense modules and on sharded experts, against one process running PEFT's own
code path (its ``ParamWrapper`` parametrizing ``W + ΔW`` for every expert on every forward).

:func:`lora_parity` trains both for a few steps (accumulation, clipping, AdamW) and applies :mod:`parity`'s
criterion to every adapter gradient and parameter; the other cases save, load, merge and refuse.
"""

from __future__ import annotations

import copy

import parity
import torch
import torch.distributed as dist
from tiny_models import build_tiny_model

import hf_hybrid_ep as hep

from .common import ADAM_EPS, _global_inputs, _rank_slice, _rel
from .training import _parity_report, _train_steps

# Dense targets per family: attention projections (DeepSeek-V3's low-rank query and key-value projections).
# Not gate_proj / up_proj / down_proj: PEFT converts those names to the fused experts' parameters for
# families whose checkpoints transformers converts (shared experts and dense MLPs included).
DENSE_TARGETS = {"deepseek_v3": ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]}
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_config(family: str, r: int = 4, **kwargs):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, task_type="CAUSAL_LM", target_modules=DENSE_TARGETS.get(family, ["q_proj", "v_proj"]),
                      target_parameters=EXPERT_TARGETS, **kwargs)


def lora_pair(family: str, num_experts: int, r: int = 4, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same ``PeftModel`` twice (identical on every rank): LoRA on dense modules and on the experts, every
    ``lora_B`` drawn non-zero (PEFT starts it at zero, which would leave ``lora_A`` without a gradient at the
    first step)."""
    from peft import get_peft_model

    torch.manual_seed(0)
    base = build_tiny_model(family, num_experts=num_experts)
    base.train()
    model = get_peft_model(base, lora_config(family, r, **kwargs))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model, copy.deepcopy(model)


def lora_parity(family: str, dp: int, ep: int, num_experts: int, steps: int = 3, accum: int = 2,
                max_norm: float = 0.05, lr: float = 1e-3, placement=None) -> dict:
    """AdamW on the adapters (accumulation, clipping), hybrid vs PEFT in one process on the global batch."""
    world = dist.get_world_size()
    model, ref = lora_pair(family, num_experts)
    initial = copy.deepcopy(ref)
    measured_names = parity.zero_initialised(initial)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, placement=placement or "contiguous"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = hep.make_optimizer(model, torch.optim.AdamW, trainable, lr=lr, eps=ADAM_EPS)
    implementation = {k: v for k, v in opt.defaults.items() if k in ("fused", "foreach") and v}

    def ref_optimizer(params):
        return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, eps=ADAM_EPS, **implementation)

    batches = [[_global_inputs(ref.get_base_model(), world, seed=1000 * step + micro) for micro in range(accum)]
               for step in range(steps)]
    run = _train_steps(model, ref, (opt, ref_optimizer(ref.parameters())), batches, max_norm, False, False)
    params = dict(model.named_parameters())

    def view(name, t):
        from .common import _local_view

        return _local_view(model, t, params[name])

    def spread_of(names):
        return parity.measured_spread(initial, ref, names, ref_optimizer, batches, max_norm, world, view)

    report = _parity_report(model, ref, run, max_norm, measured_names, spread_of, step_budget=2 * steps * lr)
    state = {id(p) for p in opt.state}
    report["optimizer_state_only_adapters"] = all(
        ("lora_" in n) == (id(p) in state) for n, p in model.named_parameters())
    report["base_grads"] = [n for n, p in model.named_parameters() if "lora_" not in n and p.grad is not None]
    report["expert_bucket_elements"] = sum(b.numel for b in hep.state_of(model).reducer.active_buckets()
                                           if b.kind == "expert")
    return report


def lora_forward(family: str, ep: int, num_experts: int) -> dict:
    """Logits of the parallelized PeftModel vs PEFT in one process, with adapters on, disabled and merged."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = lora_pair(family, num_experts)
    model.eval()
    ref.eval()
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep))
    batch = _global_inputs(ref.get_base_model(), world, seed=5)
    mine = _rank_slice(batch, rank)
    with torch.no_grad():
        out = {"on": _rel(model(**mine).logits, _rank_slice({"x": ref(**batch).logits}, rank)["x"])}
        with model.disable_adapter(), ref.disable_adapter():
            out["disabled"] = _rel(model(**mine).logits, _rank_slice({"x": ref(**batch).logits}, rank)["x"])
        adapted = ref(**batch).logits
        base_changed = _rel(adapted, _rank_slice({"x": adapted}, rank)["x"])
    out["base_changed"] = base_changed
    return out
