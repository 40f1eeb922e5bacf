"""Integration cases: the stock Trainer and hand-written Accelerate loops on hybrid-EP models.

Trainer training, resuming and evaluation, hot-expert shadowing (and rebalancing) through the
Trainer's step-end callback, an Accelerate loop with save/load state, and FSDP refused under
Accelerate's DDP. The Trainer's model, arguments and data come from :mod:`trainer_cases`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tiny_models import build_tiny_model

import hf_hybrid_ep as hep

from .common import ADAM_EPS, _build, _global_inputs, _rank_slice, _rel, _skew_routers


def trainer_run(
    dp: int, ep: int, output_dir: str, max_steps: int = 6, save_steps: int | None = None,
    resume_from: str | None = None, verify_sync_steps: int = 0, optimizer_sharding: str = "none",
    rebalance_every: int | None = None, rebalance_replicas: int = 0, **extra_args: Any,
) -> dict:
    """The stock Trainer loop on a hybrid-EP model (Accelerate wraps it in DDP on every rank)."""
    import trainer_cases as tc
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    config = hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding=optimizer_sharding,
                                rebalance_every=rebalance_every, rebalance_replicas=rebalance_replicas)
    model = hep.parallelize(tc.model(), config)
    args = tc.arguments(output_dir, 2, max_steps, save_steps, **extra_args)
    trainer = HybridEP(Trainer)(
        model=model, args=args, train_dataset=tc.dataset(), verify_sync_steps=verify_sync_steps
    )
    output = trainer.train(resume_from_checkpoint=resume_from)
    stats = hep.comm_stats(model)["gradient_reduction"]
    wrapped = type(trainer.model_wrapped).__name__
    return {"losses": tc.losses(trainer), "dense_bytes": stats["dense_bytes"], "wrapped": wrapped,
            "memory": {k: v for k, v in output.metrics.items() if k.startswith("hybrid_ep_")},
            "optimizer_class": type(trainer.optimizer.optimizer).__name__,
            "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]}


def trainer_eval(dp: int, ep: int, output_dir: str, num: int, hybrid: bool = True) -> dict:
    """Evaluation on a set that does not split evenly over the ranks (every rank runs as many passes).

    ``hybrid=False`` runs the plain Trainer (DDP) on the unsharded model, for comparison.
    """
    import trainer_cases as tc
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    args = tc.arguments(output_dir, 2, 1, per_device_eval_batch_size=2)
    if hybrid:
        model = hep.parallelize(tc.model(), hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
        trainer = HybridEP(Trainer)(model=model, args=args, eval_dataset=tc.dataset(num))
    else:
        trainer = Trainer(model=tc.model(), args=args, eval_dataset=tc.dataset(num))
    return {"eval_loss": trainer.evaluate()["eval_loss"]}


def trainer_shadow_run(output_dir: str, shadow_experts: bool, max_steps: int = 4, rebalance: bool = False,
                       hot: tuple[int, int] = (0, 2)) -> dict:
    """The stock Trainer on a skewed GPT-OSS (experts ``hot`` draw nearly every token), with hot-expert
    shadowing off or on: the Trainer's step-end callback (after_optimizer_step) must refresh the shadows (and, with
    ``rebalance``, move experts after every step, before the shadows are decided)."""
    import trainer_cases as tc
    from datasets import Dataset
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    torch.manual_seed(0)
    model = build_tiny_model("gpt_oss", num_experts=4)
    model.train()
    _skew_routers(model, list(hot), 4.0)
    world = dist.get_world_size()
    config = hep.HybridEPConfig(dp_degree=1, ep_degree=world, shadow_experts=shadow_experts, shadow_capacity=1,
                                rebalance_every=1 if rebalance else None)
    hep.parallelize(model, config)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 100, (64, 32), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = HybridEP(Trainer)(model=model, args=tc.arguments(output_dir, 2, max_steps), train_dataset=data)
    trainer.train()
    layers = hep.layer_counters(hep.comm_stats(model))
    rebalancer = hep.state_of(model).rebalancer
    return {"losses": tc.losses(trainer), "shadows_held": sum(v["shadow"]["shadows_held"] for v in layers),
            "rows_local": sum(v["shadow"]["rows_local"] for v in layers),
            "rebalances": [] if rebalancer is None else [e.step for e in rebalancer.events if e.bytes_sent]}


def accelerate_loop(dp: int, ep: int, state_dir: str, steps: int, save_at: int | None = None,
                    resume: bool = False, optimizer_sharding: str = "none") -> dict:
    """A hand-written Accelerate loop (accumulate 2, clipping, a scheduler) with save_state/load_state."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    from hf_hybrid_ep.integrations.accelerator import load_state, prepare_accelerator, save_state

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep, optimizer_sharding=optimizer_sharding))
    prepare_accelerator(accelerator, model)
    opt = hep.make_optimizer(model, torch.optim.AdamW, model.parameters(), lr=1e-3, eps=ADAM_EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    wrapped, opt, sched = accelerator.prepare(model, opt, sched)
    start = 0
    if resume:
        load_state(accelerator, wrapped, opt, state_dir, schedulers=[sched])
        start = save_at
    set_seed(0)
    losses = []
    for step in range(start, steps):
        for micro in range(2):
            batch = _rank_slice(_global_inputs(ref, world, seed=100 * step + micro), rank)
            with accelerator.accumulate(wrapped):
                loss = wrapped(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    hep.clip_grad_norm_(model, 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        if save_at is not None and not resume and step + 1 == save_at:
            save_state(accelerator, wrapped, opt, state_dir, schedulers=[sched])
    return {"losses": losses, "dense_bytes": hep.comm_stats(model)["gradient_reduction"]["dense_bytes"]}


def fsdp_under_accelerate() -> dict:
    """Accelerate wraps a multi-process model in DDP, which cannot hold FSDP2-sharded weights: refused."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from hf_hybrid_ep.integrations.accelerator import prepare_accelerator

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dense_sharding="fsdp"))
    try:
        prepare_accelerator(accelerator, model)
    except hep.HybridEPConfigError as err:
        return {"message": str(err)}
    return {"message": ""}


def train_script(argv: list[str]) -> dict:
    """``scripts/train.py``'s ``main`` on this rank of the pool (whose process group it leaves alone): the logged
    losses and the rank's exit (``error``: a refusal's message, the script's exit status 2)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    path = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
    spec = importlib.util.spec_from_file_location("train_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    try:
        module.main(argv)
    except (hep.HybridEPConfigError, hep.CheckpointError) as err:
        return {"error": str(err)}
    out = Path(argv[argv.index("--output_dir") + 1])
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return {"error": "", "losses": {e["step"]: e["loss"] for e in history if "loss" in e}}


def distinct_inputs(same: bool) -> dict:
    """The start-up data check on batches that differ per rank, or are the same on every rank."""
    from hf_hybrid_ep.engine.inputs import check_distinct_inputs

    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(ep_degree=dist.get_world_size()))
    batch = _rank_slice(_global_inputs(model, dist.get_world_size(), seed=5), 0 if same else dist.get_rank())
    try:
        check_distinct_inputs(model, batch)
    except hep.HybridEPConfigError as err:
        return {"message": str(err)}
    return {"message": ""}


def trainer_resume_latest(output_dir: str, max_steps: int, drop: str | None = None) -> dict:
    """:func:`trainer_run` resuming with ``"latest"``; first, rank 0 removes file ``drop`` of the newest checkpoint
    (an incomplete one must be skipped)."""
    from pathlib import Path

    if drop is not None and dist.get_rank() == 0:
        newest = max(Path(output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
        (newest / drop).unlink()
    dist.barrier()
    return trainer_run(1, dist.get_world_size(), output_dir, max_steps, 2, "latest")


def trainer_eval_layout(output_dir: str, eval_ep_degree: int | None) -> dict:
    """The stock Trainer at dp 2 × ep 2 evaluating after each of 2 steps, at ``eval_ep_degree`` (``None``: the
    training layout): training and evaluation losses, and the layout after the run."""
    import trainer_cases as tc
    from transformers import Trainer

    from hf_hybrid_ep.integrations import HybridEP

    model = hep.parallelize(tc.model(), hep.HybridEPConfig(dp_degree=2, ep_degree=2))
    args = tc.arguments(output_dir, 2, 2, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer = HybridEP(Trainer)(model=model, args=args, train_dataset=tc.dataset(), eval_dataset=tc.dataset(16),
                                eval_ep_degree=eval_ep_degree)
    trainer.train()
    state = hep.state_of(model)
    return {"losses": tc.losses(trainer),
            "eval_losses": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e],
            "layout": [(layer.mesh.ep_degree, [list(r) for r in layer.table.rows],
                        tuple(layer.expert_parameters()[0].shape)) for layer in state.layers]}


def eval_layout_refusals() -> dict:
    """At ep 1 every rank holds all 4 experts and the logits equal the training layout's; an EP degree that does not
    divide the training one, and a memory budget too small, are refused on every rank before anything moves."""
    model, _ = _build("qwen3_moe", 4)
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=1, ep_degree=dist.get_world_size()))
    shapes = [tuple(p.shape) for p in model.parameters()]
    batch = _rank_slice(_global_inputs(model, dist.get_world_size(), seed=7), dist.get_rank())
    with torch.no_grad():
        reference = model(**batch).logits
        with hep.eval_layout(model, 1):
            inside = [tuple(layer.expert_parameters()[0].shape) for layer in hep.state_of(model).layers]
            logits = model(**batch).logits
    messages = []
    for ep, budget in ((3, None), (1, 1024)):
        try:
            with hep.eval_layout(model, ep, budget_bytes=budget):
                pass
        except hep.HybridEPConfigError as err:
            messages.append(str(err))
    return {"messages": messages, "unchanged": shapes == [tuple(p.shape) for p in model.parameters()],
            "inside": inside, "logits_rel": _rel(logits, reference)}
