"""LoRA cases: PEFT adapters on dense modules and on sharded experts, against one process running PEFT's own
code path (its ``ParamWrapper`` parametrizing ``W + ΔW`` for every expert on every forward).

:func:`lora_parity` trains both for a few steps (accumulation, clipping, AdamW) and applies :mod:`parity`'s
criterion to every adapter gradient and parameter; the other cases save, load, merge and refuse.
"""

from __future__ import annotations

import copy
from typing import Any

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

    kwargs = {"target_modules": DENSE_TARGETS.get(family, ["q_proj", "v_proj"]), "target_parameters": EXPERT_TARGETS,
              "lora_alpha": 2 * r, **kwargs}
    return LoraConfig(r=r, task_type="CAUSAL_LM", **kwargs)


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
                max_norm: float = 0.05, lr: float = 1e-3, placement=None, optimizer_sharding: str = "none") -> dict:
    """AdamW on the adapters (accumulation, clipping), hybrid vs PEFT in one process on the global batch."""
    world = dist.get_world_size()
    model, ref = lora_pair(family, num_experts)
    initial = copy.deepcopy(ref)
    measured_names = parity.zero_initialised(initial)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, placement=placement or "contiguous",
                                              optimizer_sharding=optimizer_sharding))
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
    """Logits of the parallelized PeftModel against PEFT in one process: with the adapter, under
    ``disable_adapter()``, and with a second adapter on the same targets made active by ``set_adapter``."""
    from peft import get_peft_model

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = build_tiny_model(family, num_experts=num_experts)
    model = get_peft_model(base, lora_config(family))
    model.add_adapter("second", lora_config(family, r=2))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ref = copy.deepcopy(model)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=ep))
    inputs = {"input_ids": _rank_slice(_global_inputs(base, world, seed=5), rank)["input_ids"]}
    out = {}
    with torch.no_grad():
        out["default"] = _rel(model(**inputs).logits, ref(**inputs).logits)
        with model.disable_adapter(), ref.disable_adapter():
            out["disabled"] = _rel(model(**inputs).logits, ref(**inputs).logits)
        adapted = ref(**inputs).logits
        for m in (model, ref):
            m.set_adapter("second")
        out["second"] = _rel(model(**inputs).logits, ref(**inputs).logits)
        out["second_differs"] = _rel(ref(**inputs).logits, adapted)
    return out


def lora_save_merge(family: str, dp: int, ep: int, num_experts: int, root: str) -> dict:
    """``save_pretrained`` of the parallelized PeftModel, loaded by vanilla ``PeftModel.from_pretrained`` in one
    process; then ``merge_and_unload`` under EP, written as a hybrid-EP checkpoint and loaded back (vanilla
    transformers and rank-locally), against PEFT's merge in one process. Logits per rank slice."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hf_hybrid_ep.integrations import save_hybrid_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = lora_pair(family, num_experts)
    model.eval()
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    torch.manual_seed(0)
    vanilla = build_tiny_model(family, num_experts=num_experts)  # the base model, as lora_pair built it
    batch = _global_inputs(vanilla, world, seed=7)
    local = {"input_ids": _rank_slice(batch, rank)["input_ids"]}
    model.save_pretrained(f"{root}/adapter")
    loaded = PeftModel.from_pretrained(vanilla, f"{root}/adapter").eval()
    with torch.no_grad():
        out = {"saved": _rel(model(**local).logits, loaded(**local).logits)}
        full = hep.full_state_dict(model)  # every expert's factors in PEFT's layout, as the file holds them
        with safe_open(f"{root}/adapter/adapter_model.safetensors", "pt") as f:
            out["shapes"] = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
            out["full_state_dict_equal"] = all(
                torch.equal(full[k.replace(".weight", ".default.weight")], f.get_tensor(k)) for k in f.keys())
        merged = model.merge_and_unload()
        merged_ref = loaded.merge_and_unload()
        want = merged_ref(**local).logits
        out["merged"] = _rel(merged(**local).logits, want)
        save_hybrid_checkpoint(merged, f"{root}/merged")
        out["merged_vanilla_load"] = _rel(AutoModelForCausalLM.from_pretrained(f"{root}/merged")(**local).logits, want)
        again = hep.from_pretrained(f"{root}/merged", hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
        out["merged_rank_local_load"] = _rel(again(**local).logits, want)
    out["merged_type"] = type(merged).__name__
    return out


def _sabotaged_adapter(source: str, target: str, local: dict[str, list[int]], num_experts: int) -> None:
    """A copy of the adapter directory ``source`` in which every expert factor's rows (``lora_A``) and columns
    (``lora_B``) of experts not in ``local`` (by the experts module's unwrapped name prefix) are NaN."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    Path(target).mkdir(parents=True, exist_ok=True)
    shutil.copy(f"{source}/adapter_config.json", target)
    tensors = load_file(f"{source}/adapter_model.safetensors")
    for key, t in tensors.items():
        module = next((m for m in local if key.startswith(f"base_model.model.{m}.")), None)
        if module is None:
            continue
        others = [e for e in range(num_experts) if e not in local[module]]
        for e in others:
            if ".lora_A." in key:
                r = t.shape[0] // num_experts
                t[e * r : (e + 1) * r] = float("nan")
            else:
                t[:, e::num_experts] = float("nan")
    save_file(tensors, f"{target}/adapter_model.safetensors")


def lora_from_pretrained(family: str, dp: int, ep: int, num_experts: int, root: str) -> dict:
    """Rank-local loading with PEFT: ``from_pretrained(base, adapter=dir)`` (each rank given a copy of the adapter
    whose other ranks' expert factors are NaN) against PEFT in one process; ``from_pretrained(base,
    peft_config=...)``: fresh adapters that leave the base model's logits unchanged, its dense adapters identical
    on every rank, saved by every rank and compared by the test across layouts."""
    from hf_hybrid_ep.engine.replicas import verify_model_replicas
    from hf_hybrid_ep.moe.discovery import unwrapped_name

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    vanilla = build_tiny_model(family, num_experts=num_experts).eval()  # the base model, as lora_pair builds it
    model, ref = lora_pair(family, num_experts)
    ref.eval()
    if rank == 0:
        vanilla.save_pretrained(f"{root}/base")
        ref.save_pretrained(f"{root}/adapter")
    dist.barrier()
    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep)
    hep.parallelize(model, config)  # only to learn this rank's experts for the sabotaged copy
    local = {unwrapped_name(layer.name): list(layer.local_experts) for layer in hep.state_of(model).layers}
    _sabotaged_adapter(f"{root}/adapter", f"{root}/adapter-rank{rank}", local, num_experts)
    loaded = hep.from_pretrained(f"{root}/base", config, adapter=f"{root}/adapter-rank{rank}")
    batch = _global_inputs(vanilla, world, seed=9)
    inputs = {"input_ids": _rank_slice(batch, rank)["input_ids"]}
    torch.manual_seed(1234)
    fresh = hep.from_pretrained(f"{root}/base", config, peft_config=lora_config(family))
    verify_model_replicas(fresh)  # raises when a replicated tensor differs between ranks
    fresh.save_pretrained(f"{root}/fresh-{dp}x{ep}")
    with torch.no_grad():
        return {
            "adapter": _rel(loaded(**inputs).logits, ref(**inputs).logits),
            "fresh_is_base": _rel(fresh(**inputs).logits, vanilla(**inputs).logits),
            "trainable_loaded": sum(p.numel() for p in loaded.parameters() if p.requires_grad),
            "trainable_fresh": sum(p.numel() for p in fresh.parameters() if p.requires_grad),
        }


def trainer_lora_run(dp: int, ep: int, output_dir: str, max_steps: int = 6, save_steps: int | None = None,
                     resume_from: str | None = None, **lora: Any) -> dict:
    """The stock Trainer on a parallelized PeftModel (trainer_cases' model, LoRA on attention and experts; ``lora``:
    other LoraConfig fields). A refusal (``error``) is returned, not raised."""
    import trainer_cases as tc
    from peft import get_peft_model
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    model = hep.parallelize(get_peft_model(tc.model(), lora_config(tc.MODEL_TYPE, **lora)),
                            hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    trainer = HybridEP(Trainer)(model=model, args=tc.arguments(output_dir, 2, max_steps, save_steps),
                              train_dataset=tc.dataset())
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    except (hep.HybridEPConfigError, hep.CheckpointError) as err:
        return {"error": str(err), "steps": trainer.state.global_step}
    state = {n.split("::")[0] for n in _optimizer_keys(output_dir, save_steps)} if save_steps else set()
    return {"losses": tc.losses(trainer), "optimizer_names": sorted(state)}


def _optimizer_keys(output_dir: str, save_steps: int) -> list[str]:
    from safetensors import safe_open

    with safe_open(f"{output_dir}/checkpoint-{save_steps}/optimizer.safetensors", "pt") as f:
        return list(f.keys())


def lora_hub_adapter(endpoint: str, repo_id: str, cache_base: str, base_dir: str, ep: int) -> dict:
    """``from_pretrained(base, adapter=<Hub repo id>)`` through the loopback Hub stub (real HTTP), against PEFT in
    one process (the adapter is ``lora_pair``'s, served by the stub)."""
    from huggingface_hub import constants

    rank, world = dist.get_rank(), dist.get_world_size()
    constants.ENDPOINT = endpoint  # this worker's Hub client → the stub (the env twins are read at import time)
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_DISABLE_XET = True
    constants.HF_HUB_CACHE = f"{cache_base}/rank{rank}"
    _, ref = lora_pair("qwen3_moe", 4)
    ref.eval()
    model = hep.from_pretrained(base_dir, hep.HybridEPConfig(ep_degree=ep), adapter=repo_id)
    inputs = {"input_ids": _rank_slice(_global_inputs(ref.get_base_model(), world, seed=3), rank)["input_ids"]}
    with torch.no_grad():
        return {"logits_rel": _rel(model(**inputs).logits, ref(**inputs).logits)}


def trainer_refuses_expert_only_lora(output_dir: str) -> dict:
    """The Trainer's DDP needs a trainable dense parameter: LoRA on the experts alone is refused, naming why."""
    import trainer_cases as tc
    from peft import get_peft_model
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    model = hep.parallelize(get_peft_model(tc.model(), lora_config(tc.MODEL_TYPE, target_modules=[])),
                            hep.HybridEPConfig(ep_degree=2))
    try:
        HybridEP(Trainer)(model=model, args=tc.arguments(output_dir, 2, 1), train_dataset=tc.dataset())
    except hep.HybridEPConfigError as err:
        return {"message": str(err)}
    return {"message": ""}
