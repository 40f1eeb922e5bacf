"""Functions that run on every rank of a :class:`worker_pool.WorkerPool` (one gloo process group).

Each builds a tiny real transformers model identically on every rank, keeps an unsharded copy as
the single-process reference (trained on the global batch), parallelizes the other copy and returns
plain numbers for the test to assert on.

This package is the registry tests use (``import dist_cases as cases``; ``pool.run(cases.train_parity, ...)``):
it re-exports every case by name. ``WorkerPool.run`` sends each rank the case's defining module and
name (``fn.__module__``, e.g. ``dist_cases.training``, and ``fn.__name__``), so a case must stay a
module-level function of one of these modules:

- :mod:`dist_cases.common`: tolerances, tiny model pairs, global batches and comparison helpers.
- :mod:`dist_cases.training`: optimizer steps against the reference (:func:`train_parity` and others).
- :mod:`dist_cases.inference`: forward passes and generation against the reference.
- :mod:`dist_cases.dispatch`: the dispatcher choice and exchange paths that must agree.
- :mod:`dist_cases.checkpoint`: saving, and rank-local loading from disk and the Hub.
- :mod:`dist_cases.placement`: what each rank holds, placement tables, rebalancing, routing load.
- :mod:`dist_cases.failures`: misbehaving ranks and impossible layouts, reported on every rank.
- :mod:`dist_cases.integrations`: the stock Trainer and Accelerate loops.
- :mod:`dist_cases.lora`: PEFT adapters on dense modules and sharded experts against PEFT in one process.
- :mod:`dist_cases.trl`: TRL's SFT, DPO and GRPO trainers against the same trainer in one process.
- :mod:`dist_cases.runtime`: the runtime's own work, counted (the reducer per gradient hook, host→device copies).
"""

from __future__ import annotations

from .checkpoint import (
    hub_rank_local_load,
    load_with_a_missing_file,
    quantized_rank_local_load,
    rank_local_load,
    resume_another_model,
    save_costs,
    save_generate_reload,
    save_right_after_step,
)
from .common import ADAM_EPS, BATCH_PER_RANK, REL_TOL, SEQ, _rel
from .dispatch import (
    dispatcher_choice,
    dispatcher_equivalence,
    exchange_memory,
    overlap_equivalence,
    shared_overlap_equivalence,
)
from .failures import (
    bad_layout_refused,
    fp16_overflow_agreement,
    modality_mismatch,
    nan_in_router_input,
    nonfinite_steps,
    replica_check,
    save_refuses_nonfinite,
)
from .inference import forward_parity, generate_uneven, routing_replay
from .integrations import (
    accelerate_loop,
    distinct_inputs,
    eval_layout_refusals,
    fsdp_under_accelerate,
    train_script,
    trainer_eval,
    trainer_eval_layout,
    trainer_resume_latest,
    trainer_run,
    trainer_shadow_run,
)
from .lora import (
    lora_config,
    lora_forward,
    lora_from_pretrained,
    lora_hub_adapter,
    lora_pair,
    lora_parity,
    lora_save_merge,
    trainer_lora_run,
    trainer_refuses_expert_only_lora,
)
from .placement import (
    group_creation_calls,
    group_timeouts,
    mesh_layout,
    parameter_bytes,
    rebalance_then_save,
    rebalance_without_optimizer,
    routing_metrics,
    save_and_reload_placement,
)
from .runtime import host_copies, reducer_work, trainable_set_changes
from .training import (
    autocast_parity,
    bucket_launch_order,
    ctr_parity,
    ddp_composition,
    engine_aux_global,
    inf_norm,
    one_hot_expert_training,
    train_parity,
)
from .trl import (
    grpo_compare,
    grpo_generate,
    grpo_routing_replay,
    sft_lora_eval_layout,
    trl_parity,
    trl_resume,
)

__all__ = [
    # constants and the comparison helper tests use directly
    "ADAM_EPS",
    "BATCH_PER_RANK",
    "REL_TOL",
    "SEQ",
    "_rel",
    # checkpoint
    "hub_rank_local_load",
    "load_with_a_missing_file",
    "quantized_rank_local_load",
    "rank_local_load",
    "resume_another_model",
    "save_costs",
    "save_generate_reload",
    "save_right_after_step",
    # dispatch
    "dispatcher_choice",
    "dispatcher_equivalence",
    "exchange_memory",
    "overlap_equivalence",
    "shared_overlap_equivalence",
    # failures
    "bad_layout_refused",
    "fp16_overflow_agreement",
    "modality_mismatch",
    "nan_in_router_input",
    "nonfinite_steps",
    "replica_check",
    "save_refuses_nonfinite",
    # runtime
    "host_copies",
    "reducer_work",
    "trainable_set_changes",
    # inference
    "forward_parity",
    "generate_uneven",
    "routing_replay",
    # integrations
    "accelerate_loop",
    "distinct_inputs",
    "eval_layout_refusals",
    "fsdp_under_accelerate",
    "train_script",
    "trainer_eval",
    "trainer_eval_layout",
    "trainer_resume_latest",
    "trainer_run",
    "trainer_shadow_run",
    # lora
    "lora_config",
    "lora_forward",
    "lora_from_pretrained",
    "lora_hub_adapter",
    "lora_pair",
    "lora_parity",
    "lora_save_merge",
    "trainer_lora_run",
    "trainer_refuses_expert_only_lora",
    # placement
    "group_creation_calls",
    "group_timeouts",
    "mesh_layout",
    "parameter_bytes",
    "rebalance_then_save",
    "rebalance_without_optimizer",
    "routing_metrics",
    "save_and_reload_placement",
    # training
    "autocast_parity",
    "bucket_launch_order",
    "ctr_parity",
    "ddp_composition",
    "engine_aux_global",
    "inf_norm",
    "one_hot_expert_training",
    "train_parity",
    # trl
    "grpo_compare",
    "grpo_generate",
    "grpo_routing_replay",
    "sft_lora_eval_layout",
    "trl_parity",
    "trl_resume",
]
