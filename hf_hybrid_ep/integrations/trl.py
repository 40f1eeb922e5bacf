"""What a trainer's own construction does that hybrid EP must follow or refuse — TRL's ``SFTTrainer``,
``DPOTrainer`` and ``GRPOTrainer`` above all (docs/trl.md).

* ``peft_config``: the trainer wraps the parallelized model with PEFT itself (each expert adapter drawn over this
  rank's slots): :func:`take_over` holds the expert factors with their experts, rebuilds the gradient reduction
  and draws fresh adapters that do not depend on the layout (from ``args.seed``, the same on every rank), on the
  device of the weights they adapt. DPO's reference is then the adapter-disabled policy, as TRL makes it. A
  ``PeftModel`` given to DPO without a ``ref_model`` is refused: TRL would add a ``ref`` copy of its adapter after
  parallelize.
* a reference model (DPO's ``ref_model``; TRL prepares it without DDP): parallelized or not, it takes no
  gradients.
* TRL forms its loss from the fused LM head's per-token log-probabilities and adds the model's own router aux
  loss (``output_router_logits`` / ``router_aux_loss_coef``; ``aux_loss_scope`` says over which tokens): the
  engine's own router losses, which go into the output's ``loss``, would be dropped, so they are refused.
* generation under EP is collective: the engine makes ``generate`` keep every rank stepping (``synced_gpus``);
  paths that bypass it (vLLM, transformers' continuous batching) are refused.
* GRPO with ``routing_replay=True`` (:class:`GRPORoutingReplay`): the experts chosen while generating are
  recorded per row, travel with the rows through TRL's buffer, shuffling and splitting, and are replayed in the
  training forwards.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.peft_files import check_fresh_init
from ..engine.adapters import is_peft_model
from ..engine.routing_replay import RoutingRecord, record_routing, replay_routing
from ..engine.setup import parallelize_peft_model
from ..engine.state import carries_state, state_of
from ..errors import HybridEPConfigError
from ..model_io.adapters import init_adapters_


def is_trl_trainer(trainer_class: type) -> bool:
    """Whether ``trainer_class`` derives from one of TRL's trainers."""
    return any(c.__module__.split(".")[0] == "trl" for c in trainer_class.__mro__)


def _is_trl(trainer_class: type, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("trl.") for c in trainer_class.__mro__)


def _is_dpo(trainer_class: type) -> bool:
    return _is_trl(trainer_class, "DPOTrainer")


def is_grpo(trainer_class: type) -> bool:
    """Whether ``trainer_class`` derives from TRL's ``GRPOTrainer``."""
    return _is_trl(trainer_class, "GRPOTrainer")


ROUTING_KEY = "hybrid_ep_routing"  # the recorded experts' entry in GRPO's batches: [B, L, layers, k]


class GRPORoutingReplay:
    """``GRPOTrainer`` methods that record the routing of each generation and replay it in the training forward
    (``routing_replay=True``; :mod:`hf_hybrid_ep.engine.routing_replay`). The recorded choices ride in the batch
    dict under :data:`ROUTING_KEY`, so TRL's shuffling and splitting keep them with their rows; the logs carry
    ``moe/replay_changed_fraction``: the share of replayed token choices the router would have made otherwise."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        if not (self.routing_replay and self.model.training):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with record_routing(self.hybrid_model) as record:
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._routing_record = record
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        record = self.__dict__.pop("_routing_record", None)
        if record is not None:
            out[ROUTING_KEY] = record.rows()
            self._routing_layers = record.layers
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        """Scoring the generation batch (old and reference log-probabilities, in chunks of rows, in order) right
        after generating it: the recorded routing, row by row."""
        record = self.__dict__.get("_routing_record")
        if record is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        with replay_routing(self.hybrid_model, record, sequential=True, stats=self.routing_replay_stats):
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        rows = inputs.get(ROUTING_KEY)
        if rows is None:
            return super()._compute_loss(model, inputs)
        record = RoutingRecord.from_rows(self._routing_layers, rows)
        with replay_routing(self.hybrid_model, record, stats=self.routing_replay_stats):
            return super()._compute_loss(model, inputs)


def check_construction(trainer_class: type, model: nn.Module, kwargs: dict) -> None:
    """Refuse, before the trainer is built, what it would do that hybrid EP cannot train faithfully (``kwargs``:
    the construction's arguments by name)."""
    name = trainer_class.__name__
    peft_config = kwargs.get("peft_config")
    if peft_config is not None and not is_peft_model(model):
        check_fresh_init(peft_config, where=f"{name}(peft_config=...)")
        if getattr(peft_config, "modules_to_save", None):
            raise HybridEPConfigError(f"{name}(peft_config=...) with modules_to_save: the copies PEFT makes after "
                                      "parallelize are not handled; apply get_peft_model before parallelize")
    if not is_trl_trainer(trainer_class):
        return
    if is_peft_model(model) and kwargs.get("ref_model") is None and _is_dpo(trainer_class):
        raise HybridEPConfigError(
            f"{name} given a PeftModel and no ref_model adds a 'ref' copy of the adapter, which the experts' "
            "sharded adapters cannot take: pass the parallelized base model with peft_config=... (the reference "
            "is then the adapter-disabled policy) or a ref_model")
    config = state_of(model).config
    if config.aux_loss_coef or config.z_loss_coef:
        raise HybridEPConfigError(
            f"aux_loss_coef / z_loss_coef add the engine's router losses to the model output's loss, which {name} "
            "does not use (TRL forms its loss from per-token log-probabilities); use the model's own router aux "
            "loss (router_aux_loss_coef in the TRL config), over the global batch with aux_loss_scope='global'")
    args = kwargs.get("args")
    if getattr(args, "use_vllm", False):
        raise HybridEPConfigError(f"{name}(use_vllm=True): vLLM generates from its own copy of the weights, which "
                                  "the engine cannot sync from sharded experts; use transformers generation")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise HybridEPConfigError(f"{name}: transformers' continuous batching does not keep every rank stepping "
                                  "(synced_gpus), which generation under EP needs; turn it off")


def take_over(trainer) -> None:
    """After the trainer's own construction: the adapters PEFT added to the parallelized model, the reference
    model's gradients, an adapter added after parallelize refused (naming what to do instead)."""
    model = trainer.model
    if is_peft_model(model) and not carries_state(model):
        parallelize_peft_model(model)
        with torch.random.fork_rng(devices=[]):  # identical dense draws on every rank, whatever their RNG states
            torch.manual_seed(trainer.args.seed)
            init_adapters_(model, state_of(model).layers)
    late = [(layer.name, adapter) for layer in state_of(model).layers for adapter in layer.experts.added_after()]
    if late:
        where, adapter = late[0]
        raise HybridEPConfigError(
            f"adapter {adapter!r} on {where} was added after parallelize (DPOTrainer adds a 'ref' copy of the "
            "adapter of a PeftModel it is given): pass the parallelized base model with peft_config=... (the "
            "reference is then the adapter-disabled policy) or a ref_model")
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        trainer.accelerator.unwrap_model(ref).requires_grad_(False)
