"""Online RL with TRL's ``GRPOTrainer`` on hybrid EP, generating with transformers (``use_vllm=False``).

Generation runs the experts' all-to-all at every decoding step, so every rank keeps stepping until the last one
is done (the engine's ``generate`` passes ``synced_gpus=True``). The reward: how many letters of the reversed
sequence the completion has in the right place, minus a little per extra word.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 4 examples/trl/grpo.py [--lora]
"""

from __future__ import annotations

import tiny_setup as ts
from trl import GRPOConfig, GRPOTrainer

from hf_hybrid_ep.integrations import HybridEP


def reversal_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    scores = []
    for text, want in zip(completions, answer, strict=True):
        got, target = text.split(), want.split()
        hits = sum(a == b for a, b in zip(got, target, strict=False))
        scores.append(hits / len(target) - 0.1 * max(len(got) - len(target), 0))
    return scores


def main() -> None:
    args = ts.parse("grpo")
    config = GRPOConfig(**ts.training_arguments(args), num_generations=4, max_completion_length=8,
                        use_vllm=False)
    trainer = HybridEP(GRPOTrainer)(model=ts.parallelized_model(args), reward_funcs=reversal_reward, args=config,
                                    train_dataset=ts.dataset("grpo"), processing_class=ts.tokenizer(),
                                    peft_config=ts.lora(args))
    trainer.train()
    ts.finish()


if __name__ == "__main__":
    main()
