"""TRL runs shared by the distributed workers and the single-process reference.

A word-level tokenizer built in memory, tiny datasets for SFT (prompt-completion or plain text), DPO (preference
pairs) and GRPO (prompts of one length, so no prompt is padded and positions do not depend on the batch), the
trainers' arguments (fp32, sequential data, clipping that acts, the model's own router aux loss on), and what a
run records for the parity criterion: the logged losses, gradient norms and metrics, the first step's gradients
and the final trainable parameters.

The reference trains the same model in one process on the global batch (per-device batch × world); its record is
saved with ``torch.save`` and read by the workers with ``weights_only=True``.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from tiny_models import build_tiny_model
from transformers import PreTrainedTokenizerFast, TrainerCallback

MODEL_TYPE = "qwen3_moe"
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(100)]
PAD, EOS = 0, 1
STEPS = 2
AUX_COEF = 0.1  # the model's own router aux loss, weighted so that its batch scope shows in every check
LORA_TARGETS = {"target_modules": ["q_proj", "v_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "aux_loss", "reward", "reward_std")
DPO_BETA = 0.1  # DPOConfig's default
EOS_BIAS = 3.0


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_tiny_model(MODEL_TYPE, num_experts=4)
    m.config.pad_token_id, m.config.eos_token_id, m.config.bos_token_id = PAD, EOS, None
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = PAD, EOS
    m.generation_config.bos_token_id = None
    m.train()
    return m


def _words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi + 1, (), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 100, (n,), generator=g))


def sft_dataset(completion_only: bool, num: int) -> Dataset:
    g = torch.Generator().manual_seed(11)
    rows = [(_words(g, 2, 6), _words(g, 2, 6)) for _ in range(num)]
    if completion_only:
        return Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [" " + c for _, c in rows]})
    return Dataset.from_dict({"text": [f"{p} {c}" for p, c in rows]})


def dpo_dataset(num: int = 8 * STEPS * 2) -> Dataset:
    g = torch.Generator().manual_seed(12)
    rows = [(_words(g, 2, 5), _words(g, 1, 4), _words(g, 1, 4)) for _ in range(num)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [" " + r[1] for r in rows],
                              "rejected": [" " + r[2] for r in rows]})


def grpo_dataset(num: int = 16) -> Dataset:
    g = torch.Generator().manual_seed(13)
    return Dataset.from_dict({"prompt": [_words(g, 4, 4) for _ in range(num)]})


def reward_len(completion_ids, **kwargs) -> list[float]:
    """Shorter completions with more low-numbered words score higher (varied within a group)."""
    return [sum(i < 50 for i in ids) / max(len(ids), 1) - 0.1 * len(ids) for ids in completion_ids]


def _common(output_dir: str, per_device: int) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=1e-3,
                adam_epsilon=1e-6, max_grad_norm=0.5, logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
                report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,
                router_aux_loss_coef=AUX_COEF, train_sampling_strategy="sequential")


def arguments(kind: str, output_dir: str, per_device: int, packing: bool = False, **extra):
    """The TRL config of ``kind``; ``extra`` overrides any setting."""
    if kind == "sft":
        from trl import SFTConfig

        own = {"gradient_accumulation_steps": 2, "packing": packing, "max_length": 24}
        return SFTConfig(**{**_common(output_dir, per_device), **own, **extra})
    if kind == "dpo":
        from trl import DPOConfig

        return DPOConfig(**{**_common(output_dir, per_device), "gradient_accumulation_steps": 2, **extra})
    from trl import GRPOConfig

    # EOS favoured while sampling (only there), so that completions end at different steps on different ranks
    own = {"num_generations": 4, "max_completion_length": 6, "beta": 0.0, "shuffle_dataset": False,
           "generation_kwargs": {"sequence_bias": [[[EOS], EOS_BIAS]]}}
    return GRPOConfig(**{**_common(output_dir, per_device), **own, **extra})


def peft_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **LORA_TARGETS)


def trainer_kwargs(kind: str, output_dir: str, per_device: int, *, lora: bool = False, packing: bool = False,
                   completion_only: bool = True, settings: dict | None = None, **extra) -> dict:
    """The keyword arguments of the TRL trainer of ``kind`` (``model`` and ``ref_model`` left to the caller);
    ``settings`` override the config's."""
    args = arguments(kind, output_dir, per_device, packing, **({"completion_only_loss": completion_only}
                                                               if kind == "sft" else {}), **(settings or {}))
    if lora:  # the adapters' gradients are smaller: clipping must still act
        args.max_grad_norm = 0.1
    # packing: enough examples that every step's rows are whole packed rows (none repeated to even out batches)
    data = {"sft": lambda: sft_dataset(completion_only, 128 if packing else 32), "dpo": dpo_dataset,
            "grpo": grpo_dataset}[kind]()
    kwargs = {"args": args, "train_dataset": data, "processing_class": tokenizer(), **extra}
    if kind == "grpo":
        kwargs["reward_funcs"] = kwargs.pop("reward_funcs", reward_len)
    if lora:
        kwargs["peft_config"] = peft_config()
    return kwargs


def trainer_class(kind: str):
    import trl

    return {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "grpo": trl.GRPOTrainer}[kind]


class FirstGradients(TrainerCallback):
    """The trainable parameters' gradients before the first optimizer step (reduced and clipped)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.model = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 0 and not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def seed_adapters_(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every LoRA factor drawn anew, ``lora_B`` non-zero (PEFT starts it at zero, which leaves ``lora_A`` without a
    first gradient and the policy equal to the adapter-disabled reference); returns them."""
    g = torch.Generator().manual_seed(5)
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.05 if "lora_B" in name else 0.2))
                out[name] = p.detach().clone()
    return out


def logged(trainer) -> dict[str, list[float]]:
    """Per-step logged losses, gradient norms and the trainer's metrics."""
    history = [e for e in trainer.state.log_history if "loss" in e]
    out = {"loss": [e["loss"] for e in history], "grad_norm": [e["grad_norm"] for e in history]}
    for key in METRICS:
        if all(key in e for e in history):
            out[key] = [e[key] for e in history]
    return out


def replay(completions: list[list[list[int]]]):
    """A GRPO ``rollout_func`` (TRL's hook for custom generation) that returns the recorded completions, one
    generation batch per call, in order."""
    pending = list(completions)

    def rollout(prompts: list[str], trainer) -> dict:
        batch = pending.pop(0)
        assert len(batch) == len(prompts), (len(batch), len(prompts))
        return {"prompt_ids": trainer.processing_class(prompts)["input_ids"], "completion_ids": batch,
                "logprobs": None}

    return rollout


def reference(kind: str, output_dir: str, world: int, per_rank: int, record_path: str, *, lora: bool = False,
              full_reference: bool = False, completions: list | None = None, **opts) -> dict:
    """One process training on the global batch; its record (logs, first gradients, initial adapters, final
    trainable parameters) saved to ``record_path``. GRPO replays ``completions`` (each generation batch of the
    world, rank after rank)."""
    kwargs = trainer_kwargs(kind, output_dir, world * per_rank, lora=lora, **opts)
    if completions is not None:
        kwargs["rollout_func"] = replay(completions)
    if full_reference:
        kwargs["ref_model"] = model()
    trainer = trainer_class(kind)(model=model(), **kwargs)
    first = FirstGradients()
    first.model = trainer.model
    trainer.add_callback(first)
    adapters = seed_adapters_(trainer.model) if lora else {}
    trainer.train()
    record = {"logged": logged(trainer), "grads": first.grads, "adapters": adapters,
              "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}}
    torch.save(record, record_path)
    return record
