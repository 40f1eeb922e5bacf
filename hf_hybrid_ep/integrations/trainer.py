"""The ``transformers.Trainer`` loop — or any subclass's, TRL's trainers included — on a hybrid-EP model.

:func:`HybridEP` makes a trainer class that changes only what hybrid EP needs; the training loop is the trainer
class's own:

* Accelerate wraps the model in torch DDP, which reduces the dense gradients; the experts are on
  DDP's ignore list and the engine reduces them over their EDP groups, only on steps where
  ``accelerator.sync_gradients`` is true. Nothing is reduced twice.
* gradient clipping and the logged gradient norm are the true global norm over all shards;
* checkpoints: the model as an expert-sharded hybrid-EP checkpoint (vanilla-loadable) — of a ``PeftModel`` only
  its adapters, as PEFT's adapter directory (every expert's factors) — the optimizer state keyed by parameter
  name and global expert id, so ``resume_from_checkpoint`` works at the same or another EP degree; scheduler
  and RNG state as the Trainer writes them; each staged whole and put in place with a manifest of every file
  (:mod:`hf_hybrid_ep.checkpoint.atomic`), checked before a resume reads any of it;
* with ``optimizer_sharding="zero1"`` the optimizer is built sharded (:func:`hf_hybrid_ep.parallel.zero.reshard_optimizer`):
  DDP still all-reduces the dense gradients, each rank steps its shard and the shards are all-gathered;
  the engine reduce-scatters expert gradients over their EDP groups. Checkpoints are interchangeable
  with unsharded runs;
* per-rank bytes of weights, gradients and optimizer state are logged when the optimizer is created and
  added to the ``train()`` summary metrics;
* a step whose global gradient norm is not finite is skipped on every rank, the scheduler with it
  (:mod:`hf_hybrid_ep.engine.nonfinite`; ``skipped_steps`` in the logs);
* ``train(resume_from_checkpoint="latest")`` (or ``True``) resumes from the newest complete checkpoint of the output
  directory and starts fresh when there is none; ``expert_load.jsonl`` loses the records of later steps, which
  the resumed run logs again (:mod:`hf_hybrid_ep.model_io.resume`);
* ``train()`` holds the output directory's run lease (:func:`hf_hybrid_ep.checkpoint.lease.hold_output_dir`) from
  its start to its end: a second run on a directory that a live run holds is refused on every rank, naming it; it logs the
  start-up summary on rank 0 (:mod:`hf_hybrid_ep.engine.summary`), shown at transformers' default verbosity;
* ``train()`` runs under the watchdog (:mod:`hf_hybrid_ep.parallel.watchdog`): no progress for the collective
  timeout (``collective_timeout_s``, else ``--ddp_timeout``) ends every rank with one message naming where.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging as hf_logging

from ..checkpoint.atomic import open_checkpoint, staged_save
from ..checkpoint.lease import hold_output_dir
from ..checkpoint.manifest import MANIFEST_NAME
from ..checkpoint.peft_files import ADAPTER_CONFIG, tag_adapter_weights
from ..engine.adapters import is_peft_model
from ..engine.eval_layout import eval_layout
from ..engine.freeze import ExpertFreezer
from ..engine.gradients import clip_grad_norm_
from ..engine.inputs import check_distinct_inputs
from ..engine.nonfinite import record_norm
from ..engine.optimizers import reshard_optimizer
from ..engine.replicas import verify_model_replicas
from ..engine.routing_replay import ReplayStats
from ..engine.state import state_of
from ..engine.step import after_optimizer_step
from ..engine.summary import log_startup_summary
from ..errors import CheckpointError, HybridEPConfigError
from ..memory import log_memory_report
from ..metrics import JSONL_NAME, append_jsonl, load_report, rebalance_report, summary_scalars
from ..model_io.adapters import check_adapter_config, load_adapter_
from ..model_io.optimizer_state import META_NAME, load_optimizer_state, save_optimizer_state
from ..model_io.rank_local import load_checkpoint_into_
from ..model_io.resume import resolve_resume
from ..model_io.save import rank_zero_save, save_hybrid_checkpoint, write_model_files
from ..model_io.side_state import load_side_state, save_side_state
from ..moe.discovery import find_experts_modules
from ..parallel import watchdog
from ..parallel.amp import agree_found_inf_
from .accelerator import prepare_accelerator
from .trl import GRPORoutingReplay, check_construction, is_grpo, take_over

logger = logging.getLogger("hf_hybrid_ep")


def may_leave_parameters_unused(model: nn.Module) -> str | None:
    """Why some dense parameters may get no gradient in a step (``None``: none can): experts modules chosen
    per token modality (several in one block, ERNIE-4.5-VL), or a vision/audio tower a text batch skips."""
    blocks: dict[str, int] = {}
    for name, _ in find_experts_modules(model):
        parent = name.rpartition(".")[0].rpartition(".")[0]
        blocks[parent] = blocks.get(parent, 0) + 1
    multi = sorted(b for b, n in blocks.items() if n > 1)
    if multi:
        return f"{multi[0]} holds several experts modules chosen by token modality"
    config = getattr(model, "config", None)
    towers = sorted(k for k in (config.to_dict() if config is not None else {})
                    if k.endswith(("vision_config", "audio_config", "speech_config")))
    if towers:
        return f"the model has a {towers[0].removesuffix('_config')} tower that batches without it leave unused"
    return None


def _no_pinned_memory_without_cuda(training_args) -> None:
    """``dataloader_pin_memory`` off when no CUDA device exists (pinning would only warn on every rank)."""
    if training_args is not None and getattr(training_args, "dataloader_pin_memory", False) and not torch.cuda.is_available():
        training_args.dataloader_pin_memory = False


class _HybridEPCallback(TrainerCallback):
    """fp16 overflow agreement before every optimizer step; the replica check every N steps."""

    def __init__(self, trainer: Trainer, verify_sync_steps: int) -> None:
        self.trainer = trainer
        self.verify_sync_steps = verify_sync_steps

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._agree_overflow()

    def on_optimizer_step(self, args, state, control, **kwargs):
        """A step skipped for non-finite gradients skips the scheduler too, as an fp16 overflow does."""
        skipped = state_of(self.trainer.hybrid_model).skipped.allowed is False
        optimizer = self.trainer.optimizer
        if hasattr(optimizer, "_is_overflow"):  # Accelerate's wrapper: what optimizer_step_was_skipped reads
            optimizer._is_overflow = skipped or (optimizer.scaler is not None and optimizer._is_overflow)

    def on_step_end(self, args, state, control, **kwargs):
        after_optimizer_step(self.trainer.hybrid_model, self.trainer.optimizer)
        if self.verify_sync_steps and state.global_step % self.verify_sync_steps == 0:
            verify_model_replicas(self.trainer.hybrid_model)


@functools.cache
def HybridEP(trainer_class: type[Trainer]) -> type[Trainer]:  # noqa: N802 - a class factory, named like the class it makes
    """``trainer_class`` (``transformers.Trainer`` or any subclass: TRL's ``SFTTrainer``, ``DPOTrainer``,
    ``GRPOTrainer``, ...) for a model prepared with :func:`hf_hybrid_ep.parallelize`.

    The class made keeps everything ``trainer_class`` does — its loss, metrics, data handling, its own overrides of
    Trainer methods — and adds hybrid EP's: the experts on DDP's ignore list and reduced by the engine, clipping
    and the logged norm over the global gradient, expert-sharded checkpoints that resume at any EP degree, the
    expert-load metrics. Its methods sit below ``trainer_class``'s in the method resolution order, so an override
    of ``trainer_class`` reaches them through ``super()``. Constructed with ``trainer_class``'s arguments and:

    Args:
        verify_sync_steps: every this many optimizer steps, check that every replicated tensor is
            bit-identical across its replicas (0: never); a divergence names the parameter and ranks.
        freeze_experts / freeze_from_step: the expert specialization schedule
            (:class:`hf_hybrid_ep.ExpertFreezer`): expert ids or ``"least_used:N"``, from that step on.
        eval_ep_degree: run ``evaluate()`` with the experts laid out at this smaller EP degree (more experts per
            rank: pair it with a larger ``per_device_eval_batch_size``), training continuing at the full degree
            afterwards (:func:`hf_hybrid_ep.eval_layout`; memory checked first). ``None``: the training layout.
        routing_replay: (TRL's ``GRPOTrainer``) route each training forward to the experts its completions were
            generated with (:class:`hf_hybrid_ep.integrations.trl.GRPORoutingReplay`).

    A trainer that wraps the model with PEFT itself (TRL's, given ``peft_config``) gets its adapters taken over
    (:func:`hf_hybrid_ep.integrations.trl.take_over`); what TRL does that the engine cannot follow is refused.
    The same class is returned for the same ``trainer_class``.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"HybridEP takes transformers.Trainer or a subclass of it, not {trainer_class!r}")
    if issubclass(trainer_class, _EngineMethods):
        raise TypeError(f"{trainer_class.__name__} is already a hybrid-EP trainer")
    bases = (_Construction, _EngineMethods) if trainer_class is Trainer else (_Construction, trainer_class, _EngineMethods)
    if is_grpo(trainer_class):
        bases = (_Construction, GRPORoutingReplay, trainer_class, _EngineMethods)
    name = f"HybridEP{trainer_class.__name__}"
    return type(name, bases, {"__module__": __name__, "__qualname__": name, "__doc__": HybridEP.__doc__})


class _Construction:
    """A hybrid-EP trainer's ``__init__``: the engine's arguments taken out, the model checked before the trainer
    touches it, and after the trainer's own construction the take-over, the callback and DDP's ignore list."""

    def __init__(
        self, model: nn.Module, *args, verify_sync_steps: int = 0, freeze_experts=None, freeze_from_step: int = 0,
        eval_ep_degree: int | None = None, routing_replay: bool = False, **kwargs,
    ) -> None:
        state_of(model)  # refuse a model that was not parallelized, before the Trainer touches it
        if routing_replay and not is_grpo(type(self)):
            raise HybridEPConfigError(f"routing_replay=True replays the routing of generated completions: "
                                      f"{type(self).__name__} is not a GRPOTrainer")
        self.routing_replay, self.routing_replay_stats = routing_replay, ReplayStats()
        named = inspect.signature(super().__init__).bind_partial(model, *args, **kwargs).arguments
        check_construction(type(self), model, named)
        # the Trainer sets config.use_cache from its args (False); checkpoints keep the source's
        self._inference_use_cache = getattr(getattr(model, "config", None), "use_cache", None)
        self._staging: tuple[Path, str] | None = None
        self._freeze = (freeze_experts, freeze_from_step)
        self._inputs_checked = False
        self.eval_ep_degree = eval_ep_degree
        self.freezer: ExpertFreezer | None = None
        super().__init__(model, *args, **kwargs)
        _no_pinned_memory_without_cuda(self.args)
        take_over(self)
        self.add_callback(_HybridEPCallback(self, verify_sync_steps))
        prepare_accelerator(self.accelerator, self.model)


class _EngineMethods(Trainer):
    """The Trainer methods hybrid EP replaces (:func:`HybridEP` places them under the trainer class's own)."""

    def create_optimizer(self, *args, **kwargs):
        """The Trainer's optimizer; ZeRO-1-sharded when the config says ``optimizer_sharding="zero1"``."""
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(*args, **kwargs)
        config = state_of(self.hybrid_model).config
        experts, from_step = self._freeze
        if config.optimizer_sharding == "zero1" and fresh:
            if experts is not None:
                raise HybridEPConfigError("freeze_experts is not supported with optimizer_sharding='zero1'")
            optimizer = self.optimizer = reshard_optimizer(self.hybrid_model, optimizer)
        if experts is not None and self.freezer is None:
            self.freezer = ExpertFreezer(self.hybrid_model, optimizer, experts, from_step)
        if fresh:
            self.memory_report = log_memory_report(self.hybrid_model, optimizer)
        return optimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``, holding the output directory's run lease throughout (a directory another live run
        holds is refused, naming it); ``resume_from_checkpoint="latest"`` or ``True``: the newest complete checkpoint
        of the output directory, or a fresh start when there is none. The summary metrics also carry this rank's
        bytes of weights, gradients and optimizer state (``hybrid_ep_*_bytes``, as
        :func:`hf_hybrid_ep.memory.memory_report` measures)."""
        taken = hold_output_dir(self.args.output_dir)  # before anything is read or written there
        try:
            return self._train_holding_the_lease(resume_from_checkpoint, *args, **kwargs)
        finally:
            if taken is not None:  # a lease the script took before (scripts/train.py) stays until it exits
                taken.release()

    def _train_holding_the_lease(self, resume_from_checkpoint: str | bool | None, *args, **kwargs):
        resume_from_checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir,
                                                main_process=self.args.should_save)
        start = f"resuming from {resume_from_checkpoint}" if resume_from_checkpoint else "starting fresh"
        log_startup_summary(self.hybrid_model, f"{start} (output directory {self.args.output_dir})",
                            shown=hf_logging.get_verbosity() <= logging.WARNING)
        config = state_of(self.hybrid_model).config
        watchdog.start(config.collective_timeout_s or self.args.ddp_timeout)
        with watchdog.region(f"{type(self).__name__}.train (DDP's all-reduce and buffer broadcast, Accelerate's gathers)"):
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        report = log_memory_report(self.hybrid_model, self.optimizer)
        self.memory_report = report
        for key in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
            output.metrics[f"hybrid_ep_{key}"] = report[key]
        return output

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``, at ``eval_ep_degree`` when given (the training layout comes back afterwards)."""
        if self.eval_ep_degree is None:
            return super().evaluate(*args, **kwargs)
        with eval_layout(self.hybrid_model, self.eval_ep_degree):
            return super().evaluate(*args, **kwargs)

    def training_step(self, model: nn.Module, inputs: dict, *args, **kwargs):
        """``Trainer.training_step``; the first one checks that the ranks received different batches
        (:func:`hf_hybrid_ep.engine.inputs.check_distinct_inputs`)."""
        if not self._inputs_checked:
            check_distinct_inputs(self.hybrid_model, inputs)
            self._inputs_checked = True
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the expert-load summary to training logs and append the per-layer figures to
        ``<output_dir>/expert_load.jsonl`` (rank 0)."""
        if "loss" in logs:
            skipped = state_of(self.hybrid_model).skipped.total
            if skipped:
                logs["skipped_steps"] = float(skipped)
            report = load_report(self.hybrid_model)
            rebalances = rebalance_report(self.hybrid_model)
            logs.update(summary_scalars(report))
            if rebalances:
                logs["moe/rebalances"] = float(sum(e["moved"] for e in rebalances))
            replay = self.routing_replay_stats
            if replay.replayed:  # this rank's, since the last log
                logs["moe/replay_changed_fraction"] = float(replay.changed) / replay.replayed
                replay.replayed = replay.changed = 0
            if report and self.args.should_save:
                os.makedirs(self.args.output_dir, exist_ok=True)
                append_jsonl(os.path.join(self.args.output_dir, JSONL_NAME), self.state.global_step, report,
                             rebalances)
        super().log(logs, *args, **kwargs)

    def _build_accelerator_args(self, **kwargs):
        """DDP's ``find_unused_parameters`` only when the model can leave dense parameters unused (the
        experts are on DDP's ignore list); transformers turns it on for every model, which costs an extra
        traversal of the autograd graph each step. ``--ddp_find_unused_parameters`` still decides when given."""
        args = super()._build_accelerator_args(**kwargs)
        if self.args.ddp_find_unused_parameters is None:
            reason = may_leave_parameters_unused(self.model)
            for handler in args.get("kwargs_handlers", []):
                if type(handler).__name__ == "DistributedDataParallelKwargs":
                    handler.find_unused_parameters = reason is not None
            logger.info("DDP find_unused_parameters=%s (%s)", reason is not None,
                        reason or "every dense parameter takes part in every forward")
        return args

    @property
    def hybrid_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    # ------------------------------------------------------------------ gradients
    def _agree_overflow(self) -> None:
        """With fp16 loss scaling, skip the step on every rank if any rank overflowed."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            agree_found_inf_(scaler, getattr(self.optimizer, "optimizer", self.optimizer), state_of(self.hybrid_model).mesh)

    def _clip_grad_norm(self, model):
        self._agree_overflow()  # unscales first, as accelerator.clip_grad_norm_ would
        return clip_grad_norm_(self.hybrid_model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = state_of(self.hybrid_model).reducer.global_grad_norm()
            record_norm(self.hybrid_model, grad_norm)
        return grad_norm

    # ------------------------------------------------------------------ checkpoints
    def _get_output_dir(self, trial) -> str:
        if self._staging is not None:  # inside _save_checkpoint: the Trainer writes into the staged copy
            return str(self._staging[0].parent)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """The Trainer's checkpoint, written whole into a staged ``checkpoint-N`` (model, optimizer,
        scheduler, RNG and Trainer state, tokenizer) and put in place atomically with a manifest of
        every file (:mod:`hf_hybrid_ep.checkpoint.atomic`); a crash leaves the previous checkpoint."""
        run_dir = Path(super()._get_output_dir(trial))
        target = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        with rank_zero_save(self.hybrid_model, lambda: staged_save(target)) as staged:
            self._staging = staged
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging = None
            best = self.state.best_model_checkpoint
            if best is not None and Path(best).parent == staged[0].parent:
                self.state.best_model_checkpoint = str(run_dir / Path(best).name)
                if self.args.should_save:
                    self.state.save_to_json(os.path.join(staged[0], TRAINER_STATE_NAME))
            if self.accelerator.num_processes > 1:
                torch.distributed.barrier()  # every rank's RNG file is in the staged copy
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        config = getattr(self.hybrid_model, "config", None)
        training_use_cache = getattr(config, "use_cache", None)
        if config is not None and self._inference_use_cache is not None:
            config.use_cache = self._inference_use_cache
        save_id = self._staging[1] if self._staging is not None and Path(output_dir) == self._staging[0] else None
        try:
            if is_peft_model(self.hybrid_model):  # the adapters only, as PEFT writes them (collective)
                self.hybrid_model.save_pretrained(output_dir)
                if self.args.should_save:
                    if save_id is not None:
                        tag_adapter_weights(output_dir, save_id)
                    save_side_state(self.hybrid_model, output_dir, save_id)
            elif save_id is not None:
                write_model_files(self.hybrid_model, Path(output_dir), save_id)
            else:
                save_hybrid_checkpoint(self.hybrid_model, output_dir)
        finally:
            if config is not None:
                config.use_cache = training_use_cache
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_id = self._staging[1] if self._staging is not None else None
        save_optimizer_state(self.hybrid_model, self.optimizer, output_dir, save_id)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Resume: every file of the checkpoint is checked against its manifest before use (the
        Trainer's own files and the optimizer state included; sha256 unless ``verify_checksums=False``); of a
        ``PeftModel``, the saved adapter config must be the model's."""
        model = self.hybrid_model if model is None else self.accelerator.unwrap_model(model)
        verify = state_of(model).config.verify_checksums
        checker = open_checkpoint(resume_from_checkpoint, verify=verify)
        if checker.manifest is None:
            raise CheckpointError(
                f"{resume_from_checkpoint!r} has no manifest (model.safetensors.index.json or {MANIFEST_NAME}), so "
                "its files cannot be checked: it is not a checkpoint a hybrid-EP Trainer save completed")
        peft = is_peft_model(model)
        if not peft and ADAPTER_CONFIG in checker.manifest["files"]:
            raise HybridEPConfigError(f"{resume_from_checkpoint!r} is a checkpoint of PEFT adapters; the model is not "
                                      "a PeftModel: build it with the saved adapter config (PeftConfig.from_pretrained)")
        if peft:  # an adapter checkpoint: every file is read whole by every rank
            checker.check_all()
            check_adapter_config(model, resume_from_checkpoint, verifier=checker)
            load_adapter_(model, state_of(model).layers, resume_from_checkpoint, verifier=checker)
            load_side_state(model, resume_from_checkpoint, checker)
            return
        for name in sorted(checker.manifest["files"]):
            if not name.startswith("model"):  # weight files: checked by the loader, this rank's only
                checker.check(name)
        load_checkpoint_into_(resume_from_checkpoint, model, verify=verify)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, META_NAME)):
            raise FileNotFoundError(f"{checkpoint} has no hybrid-EP optimizer state ({META_NAME})")
        load_optimizer_state(self.hybrid_model, self.optimizer, checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
