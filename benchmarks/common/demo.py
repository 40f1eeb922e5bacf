"""The embedded demo of ``scripts/train.py`` as the benchmarks use it: its model config (and a wider variant)
and its corpus, tokenized and packed into blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the repository
DEMO_ASSETS = ROOT / "scripts" / "demo_assets"  # the demo's config.json (tiny Qwen3-MoE: 8 experts, top-2, 2 layers)


def demo_config(wide: bool = False):
    """The demo model's transformers config; ``wide``: 32 experts, top-4, 4 layers (otherwise the same)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(DEMO_ASSETS)
    if wide:
        config.num_experts, config.num_experts_per_tok, config.num_hidden_layers = 32, 4, 4
    return config


def demo_blocks(seq_len: int, tokenizer_dir: Path) -> np.ndarray:
    """The demo corpus tokenized by a demo tokenizer trained on it (saved to ``tokenizer_dir``) and packed into
    blocks: int64 ``[blocks, seq_len]``."""
    from scripts.train import demo_corpus, demo_tokenizer, pack

    corpus = demo_corpus()
    tokenizer = demo_tokenizer(corpus, tokenizer_dir)
    return np.array(pack(corpus, tokenizer, seq_len, "text")["input_ids"], dtype=np.int64)
