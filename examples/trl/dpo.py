"""Preference optimisation with TRL's ``DPOTrainer`` on hybrid EP.

With ``--lora`` the reference is the policy with its adapters disabled (TRL's own choice); without it a second
copy of the model, parallelized the same way (experts sharded, no gradients), is the reference.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 4 examples/trl/dpo.py [--lora]
"""

from __future__ import annotations

import tiny_setup as ts
from trl import DPOConfig, DPOTrainer

from hf_hybrid_ep.integrations import HybridEP


def main() -> None:
    args = ts.parse("dpo")
    config = DPOConfig(**ts.training_arguments(args))  # first: it starts the process group parallelize uses
    ref_model = None if args.lora else ts.parallelized_model(args)
    trainer = HybridEP(DPOTrainer)(model=ts.parallelized_model(args), ref_model=ref_model, args=config,
                                   train_dataset=ts.dataset("dpo"), processing_class=ts.tokenizer(),
                                   peft_config=ts.lora(args))
    trainer.train()
    ts.finish()


if __name__ == "__main__":
    main()
