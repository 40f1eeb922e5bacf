"""Supervised fine-tuning with TRL's ``SFTTrainer`` on hybrid EP (completion-only loss on prompt-completion pairs).

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 4 examples/trl/sft.py [--lora] [--ep_degree 4]
"""

from __future__ import annotations

import tiny_setup as ts
from trl import SFTConfig, SFTTrainer

from hf_hybrid_ep.integrations import HybridEP


def main() -> None:
    args = ts.parse("sft")
    config = SFTConfig(**ts.training_arguments(args), max_length=32, completion_only_loss=True)
    trainer = HybridEP(SFTTrainer)(model=ts.parallelized_model(args), args=config, train_dataset=ts.dataset("sft"),
                                   processing_class=ts.tokenizer(), peft_config=ts.lora(args))
    trainer.train()
    ts.finish()


if __name__ == "__main__":
    main()
