"""Tiny source checkpoints written by transformers' own save_pretrained, spread over several shards."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import build_tiny_model

# Mixtral-style per-expert keys (block_sparse_moe.experts.N.w1), Qwen-style with a shared expert,
# GPT-OSS-style fused [E, ...] expert tensors with biases.
FAMILIES = ["mixtral", "qwen2_moe", "gpt_oss"]


def save_source(model_type: str, directory: str | Path, num_experts: int = 4, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = build_tiny_model(model_type, num_experts=num_experts)
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("*.safetensors"))) > 2, "the source must span several shards"
    return directory
