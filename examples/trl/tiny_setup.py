"""What the three TRL examples share: a tiny Qwen3-MoE built from its config, a word-level tokenizer of the
examples' vocabulary, the local datasets (``data/*.jsonl``, a toy task: reverse a few letters), the hybrid-EP
layout and the training arguments every example uses.

Nothing is downloaded: the model is random, the tokenizer is built in memory.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_hybrid_ep as hep

DATA = Path(__file__).parent / "data"
WORDS = ["<pad>", "<eos>", "<unk>", "reverse", ":", "=", *"abcdefgh"]


def parse(kind: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"{kind.upper()} with TRL on a tiny Qwen3-MoE under hybrid EP")
    parser.add_argument("--ep_degree", type=int, default=2, help="expert-parallel degree (divides the world)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (attention and experts)")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--output_dir", default=f"runs/trl-{kind}")
    return parser.parse_args()


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def parallelized_model(args: argparse.Namespace) -> torch.nn.Module:
    """The tiny model (the same random weights on every rank), parallelized: experts sharded over
    ``--ep_degree`` ranks, dense weights replicated, the router aux loss formed over the global batch."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.01, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    return hep.parallelize(model, hep.HybridEPConfig(ep_degree=args.ep_degree, aux_loss_scope="global"))


def dataset(kind: str):
    return load_dataset("json", data_files=str(DATA / f"{kind}.jsonl"), split="train")


def lora(args: argparse.Namespace):
    """LoRA on attention and on the routed experts (PEFT's ``target_parameters``), or ``None``."""
    if not args.lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def training_arguments(args: argparse.Namespace) -> dict:
    """What every example's TRL config shares: CPU-friendly fp32, a checkpoint at the end."""
    return dict(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
                learning_rate=1e-3 if args.lora else 3e-4, logging_steps=1, save_strategy="steps",
                save_steps=args.max_steps, bf16=False, report_to=[], gradient_checkpointing=False,
                use_cpu=os.environ.get("ACCELERATE_USE_CPU") == "1", dataloader_num_workers=0)


def finish() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # gloo aborts at exit otherwise
