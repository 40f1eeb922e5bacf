"""Trainer runs shared by the distributed workers and the single-process reference."""

from __future__ import annotations

import torch
from datasets import Dataset
from tiny_models import build_tiny_model
from transformers import Trainer, TrainingArguments

SEQ = 8
MODEL_TYPE = "qwen3_moe"


def dataset(num: int = 128) -> Dataset:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 120, (num, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def arguments(
    output_dir: str, per_device: int, max_steps: int, save_steps: int | None = None, **extra
) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        adam_epsilon=1e-6,  # see dist_cases.ADAM_EPS
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=True,
        report_to=[],
        train_sampling_strategy="sequential",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def model():
    torch.manual_seed(0)
    m = build_tiny_model(MODEL_TYPE, num_experts=4)
    m.train()
    return m


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def reference_losses(output_dir: str, world: int, per_rank: int = 2, max_steps: int = 6, **extra) -> list[float]:
    """One process training the full model on the global batches (per-device batch = world × per_rank)."""
    args = arguments(output_dir, world * per_rank, max_steps, **extra)
    trainer = Trainer(model=model(), args=args, train_dataset=dataset())
    trainer.train()
    return losses(trainer)


def reference_eval_loss(output_dir: str, num: int) -> float:
    trainer = Trainer(model=model(), args=arguments(output_dir, 2, 1, per_device_eval_batch_size=2),
                      eval_dataset=dataset(num))
    return trainer.evaluate()["eval_loss"]


def reference_lora_losses(output_dir: str, world: int, peft_config, per_rank: int = 2, max_steps: int = 6) -> list[float]:
    """One process training the same PeftModel with PEFT's own code path on the global batches."""
    from peft import get_peft_model

    args = arguments(output_dir, world * per_rank, max_steps)
    trainer = Trainer(model=get_peft_model(model(), peft_config), args=args, train_dataset=dataset())
    trainer.train()
    return losses(trainer)
