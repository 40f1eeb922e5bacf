"""TRL cases: ``HybridEP(SFTTrainer)``, ``HybridEP(DPOTrainer)`` and ``HybridEP(GRPOTrainer)`` on a parallelized
tiny Qwen3-MoE against the same TRL trainer in one process (:mod:`trl_cases`), by :mod:`parity`'s criterion:
the logged losses and gradient norms, the first step's gradients and the final trainable parameters of this
rank (its expert slots against the reference's same slots), and the trainer's own metrics.

The model's own router aux loss is on and formed over the global batch (``aux_loss_scope="global"``), as the
single process forms it over its whole batch.
"""

from __future__ import annotations

import parity
import torch
import torch.distributed as dist

import hf_hybrid_ep as hep

from .common import _local_view

PER_RANK = 2
_KEPT: dict = {}  # a GRPO run kept between its generating job and its comparison


def _hybrid_trainer(kind: str, dp: int, ep: int, output_dir: str, *, lora: bool = False,
                    full_reference: bool = False, aux_loss_scope: str = "global", **opts):
    import trl_cases as tc

    from hf_hybrid_ep.integrations import HybridEP

    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, aux_loss_scope=aux_loss_scope)
    kwargs = tc.trainer_kwargs(kind, output_dir, PER_RANK, lora=lora, **opts)
    if full_reference:  # itself parallelized: experts sharded, no gradients
        kwargs["ref_model"] = hep.parallelize(tc.model(), config)
    trainer = HybridEP(tc.trainer_class(kind))(model=hep.parallelize(tc.model(), config), **kwargs)
    first = tc.FirstGradients()
    first.model = trainer.model
    trainer.add_callback(first)
    return trainer, first


def _load_adapters_(model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """The reference's initial adapters, this rank's expert slots of them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in adapters:
                p.copy_(_local_view(model, adapters[name], p))


def _report(model: torch.nn.Module, want: dict, logged: dict, grads: dict, max_norm: float) -> dict:
    """:mod:`parity`'s checks of this rank (and the trainer's metrics) against the reference's record."""
    def rels(key):
        mine, ref = logged[key], want["logged"][key]
        assert len(mine) == len(ref), (key, mine, ref)
        return [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(mine, ref, strict=True)]

    params = dict(model.named_parameters())
    grad_rels = [parity.rel(g, _local_view(model, want["grads"][n], params[n])) for n, g in grads.items()]
    assert set(grads) == set(want["grads"]), sorted(set(grads) ^ set(want["grads"]))
    triples = ((n, params[n].detach(), _local_view(model, t, params[n])) for n, t in want["params"].items())
    report = parity.compare_params(triples)
    metrics = {k: max(rels(k)) for k in want["logged"] if k not in ("loss", "grad_norm")}
    return {**report, "max_loss_rel": max(rels("loss")), "max_norm_rel": max(rels("grad_norm")),
            "max_grad_rel_step0": max(grad_rels), "clipped": any(n > max_norm for n in logged["grad_norm"]),
            "metric_rels": metrics, "logged": logged, "reference_logged": want["logged"], "zero_initialised": []}


def trl_parity(kind: str, dp: int, ep: int, output_dir: str, record_path: str, **opts) -> dict:
    """A TRL trainer of ``kind`` (``"sft"`` / ``"dpo"``) on hybrid EP against the single-process record
    (``aux_loss_scope="local"`` in ``opts``: the per-rank aux loss, which the record does not equal)."""
    import trl_cases as tc

    want = torch.load(record_path, weights_only=True)
    trainer, first = _hybrid_trainer(kind, dp, ep, output_dir, **opts)
    _load_adapters_(trainer.model, want["adapters"])
    trainer.train()
    return _report(trainer.model, want, tc.logged(trainer), first.grads, trainer.args.max_grad_norm)


def trl_resume(kind: str, dp: int, ep: int, output_dir: str, resume_from: str | None = None, **opts) -> dict:
    """A TRL trainer of ``kind`` checkpointing after every step (or resuming ``resume_from``); its logged losses."""
    import trl_cases as tc

    settings = {"save_strategy": "steps", "save_steps": 1}
    trainer, _ = _hybrid_trainer(kind, dp, ep, output_dir, settings=settings, **opts)
    trainer.train(resume_from_checkpoint=resume_from)
    return {"loss": tc.logged(trainer)["loss"]}


def grpo_generate(dp: int, ep: int, output_dir: str, **opts) -> dict:
    """GRPO with transformers generation under EP (every rank stepping until all are done), end to end; the
    completions each rank scored, in order, for the single-process replay. The run is kept for
    :func:`grpo_compare`."""
    import trl_cases as tc

    scored: list[list[list[int]]] = []

    def reward(completion_ids, **kwargs):
        scored.append([list(ids) for ids in completion_ids])
        return tc.reward_len(completion_ids)

    trainer, first = _hybrid_trainer("grpo", dp, ep, output_dir, reward_funcs=reward, **opts)
    trainer.train()
    _KEPT.update(model=trainer.model, logged=tc.logged(trainer), grads=first.grads,
                 max_norm=trainer.args.max_grad_norm)
    lengths = [max(len(ids) for ids in batch) for batch in scored]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, lengths)
    return {"completions": scored, "longest_per_rank": every}


def grpo_compare(record_path: str) -> dict:
    """The kept GRPO run against the single process that replayed its completions."""
    kept = dict(_KEPT)
    _KEPT.clear()
    return _report(kept["model"], torch.load(record_path, weights_only=True), kept["logged"], kept["grads"],
                   kept["max_norm"])


def grpo_routing_replay(dp: int, ep: int, output_dir: str, num_iterations: int) -> dict:
    """GRPO with ``routing_replay=True``: per step, the share of replayed token choices the router would have made
    otherwise (``moe/replay_changed_fraction``), and the logged losses."""
    import trl_cases as tc

    from hf_hybrid_ep.integrations import HybridEP

    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, aux_loss_scope="global")
    kwargs = tc.trainer_kwargs("grpo", output_dir, PER_RANK)
    kwargs["args"].num_iterations = num_iterations
    trainer = HybridEP(tc.trainer_class("grpo"))(model=hep.parallelize(tc.model(), config), routing_replay=True,
                                                 **kwargs)
    trainer.train()
    history = [e for e in trainer.state.log_history if "loss" in e]
    return {"changed": [e.get("moe/replay_changed_fraction") for e in history],
            "loss": [e["loss"] for e in history]}


def _draw_adapters_(model: torch.nn.Module, seed: int) -> None:
    """Every LoRA factor drawn anew and non-zero (PEFT starts ``lora_B`` at zero, where a misplaced expert factor
    would change nothing), an expert factor as this rank's slots of a draw over all experts."""
    factors = {id(p): layer for layer in hep.state_of(model).layers for p in layer.experts.adapter_parameters()}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" not in name:
                continue
            layer = factors.get(id(p))
            shape = p.shape if layer is None else (layer.num_experts, *p.shape[1:])
            full = torch.randn(shape, generator=g) * (0.05 if "lora_B" in name else 0.2)
            p.copy_(full if layer is None else full[layer.local_experts])


def sft_lora_eval_layout(output_dir: str, eval_ep_degree: int | None, evaluate_each_step: bool) -> dict:
    """``HybridEP(SFTTrainer)(peft_config=..., eval_ep_degree=...)`` at dp 2 × ep 2, expert adapters drawn non-zero,
    evaluating after each of its 2 steps (``evaluate_each_step``) and once after training, at ``eval_ep_degree``
    and at the training layout: the training and evaluation losses, each layer's slot-parameter shapes after, and
    the memory check's bytes at ep 1 against what the layout held (its added slots and one gathered parameter)."""
    import trl_cases as tc

    from hf_hybrid_ep.engine.eval_layout import extra_bytes

    settings = {"eval_strategy": "steps" if evaluate_each_step else "no", "eval_steps": 1,
                "per_device_eval_batch_size": 4}
    trainer, _ = _hybrid_trainer("sft", 2, 2, output_dir, lora=True, settings=settings,
                                 eval_dataset=tc.sft_dataset(True, 16), eval_ep_degree=eval_ep_degree)
    _draw_adapters_(trainer.model, seed=7)
    trainer.train()
    during = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    after = trainer.evaluate()["eval_loss"]
    trainer.eval_ep_degree = None
    at_training_layout = trainer.evaluate()["eval_loss"]
    state = hep.state_of(trainer.model)
    training = sum(p.nbytes for layer in state.layers for p in layer.slot_parameters())
    with hep.eval_layout(trainer.model, 1):
        held = sum(p.nbytes for layer in state.layers for p in layer.slot_parameters())
    gathered = max(layer.num_experts * p[0].nbytes for layer in state.layers for p in layer.slot_parameters())
    return {"losses": tc.logged(trainer)["loss"], "eval_losses": during, "eval_after": after,
            "eval_after_training_layout": at_training_layout, "extra_bytes": extra_bytes(state, 1),
            "held_extra": held - training + gathered,
            "layout": [(layer.mesh.ep_degree, [tuple(p.shape) for p in layer.slot_parameters()])
                       for layer in hep.state_of(trainer.model).layers]}
