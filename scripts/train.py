"""Train a Mixture-of-Experts model with hybrid expert parallelism and the stock transformers Trainer.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/train.py   # CPU demo
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/train.py --lora_r 8   # LoRA
    accelerate launch --num_processes 8 scripts/train.py --model_name_or_path Qwen/Qwen3-30B-A3B \
        --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --hybrid_ep_config ep.yaml \
        --output_dir runs/qwen3 --bf16 --max_steps 1000

With no arguments it runs the embedded demo: a tiny Qwen3-MoE built from
``scripts/demo_assets/config.json``, a byte-level BPE tokenizer trained on the spot, and the Python
documentation topics that ship with every Python (``pydoc_data.topics``) as the corpus, with the flags of
``DEMO_ARGS``; it writes ``runs/demo/``. With any argument ``DEMO_ARGS`` do not apply (each flag not given takes
its ordinary default), while the model, tokenizer and corpus still default to the demo's. After a failure,
``--resume_from_checkpoint latest`` resumes from the newest complete checkpoint of ``--output_dir`` (a fresh start
without one); ``hf-hybrid-ep launch -- torchrun ...`` has torchrun restart it with that flag. A run holds a lease on ``--output_dir`` from the
start: a second run on the same directory is refused while the first runs. A resume of LoRA adapters continues
with the adapter config saved in the checkpoint: ``--lora_*`` flags or a ``peft:`` section that contradict it are
refused, naming both values. Thin by design: argument parsing, data preparation,
then library calls.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

import hf_hybrid_ep as hep
from hf_hybrid_ep.checkpoint import CheckpointError
from hf_hybrid_ep.checkpoint.lease import hold_output_dir
from hf_hybrid_ep.config import HybridEPConfigError, read_yaml_mapping
from hf_hybrid_ep.integrations import HybridEP
from hf_hybrid_ep.integrations.plugin import (
    HybridEPPlugin,
    check_optimizer_block,
    check_peft_block,
    explicit_flags,
)
from hf_hybrid_ep.model_io.resume import resume_target
from hf_hybrid_ep.parallel.nccl import set_env_defaults as set_nccl_env_defaults

TRAIN_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ASSETS = Path(__file__).resolve().parent / "demo_assets"
DEMO_ARGS = [
    "--output_dir", "runs/demo", "--max_steps", "30", "--per_device_train_batch_size", "8",
    "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--warmup_steps", "3",
    "--logging_steps", "5", "--save_steps", "30", "--max_grad_norm", "1.0", "--report_to", "none",
    "--block_size", "64",
]


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id, local HF directory or hybrid-EP checkpoint; default: the tiny demo MoE"},
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "default: the model's, or a demo BPE"})
    dtype: str | None = field(default=None, metadata={"help": "bf16, fp16 or fp32 weights (default: checkpoint's)"})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "a datasets Hub dataset"})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(
        default=None, metadata={"help": "a local " + "/".join(TRAIN_FILE_BUILDERS) + " file"}
    )
    text_column: str = field(default="text")
    block_size: int = field(default=256, metadata={"help": "tokens per packed training sequence"})
    max_train_samples: int | None = field(default=None)

    def __post_init__(self) -> None:  # checked before TrainingArguments starts the process group
        if self.block_size < 1:
            raise HybridEPConfigError(f"--block_size must be a positive number of tokens, got {self.block_size}")
        if self.train_file is not None:
            train_file_builder(self.train_file)


def train_file_builder(path: str) -> str:
    """The ``datasets`` builder of a ``--train_file`` (by suffix); refuses other suffixes, missing files and files
    with nothing to train on (empty, or only whitespace)."""
    suffix = Path(path).suffix.lower()
    if suffix not in TRAIN_FILE_BUILDERS:
        raise HybridEPConfigError(f"--train_file {path!r} has the unsupported suffix {suffix or '(none)'!r}; "
                                  f"accepted: {', '.join(TRAIN_FILE_BUILDERS)}")
    if not Path(path).is_file():
        raise HybridEPConfigError(f"--train_file {path!r} does not exist or is not a file")
    if suffix != ".parquet" and not _holds_text(Path(path)):
        raise HybridEPConfigError(f"--train_file {path!r} is empty or holds only whitespace: nothing to train on")
    return TRAIN_FILE_BUILDERS[suffix]


def _holds_text(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether ``path`` holds a non-whitespace byte (read until the first one, a MiB at a time)."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return True
    return False


def check_hybrid_ep_file(path: str) -> None:
    """Refuse a ``--hybrid_ep_config`` that is missing, not YAML (naming ``file:line:column``) or whose
    ``optimizer`` or ``peft`` is not a mapping, before any process group starts (the plugin reads it again later)."""
    block = read_yaml_mapping(path, "--hybrid_ep_config")
    check_optimizer_block(block.get("optimizer"), f"--hybrid_ep_config {path!r}")
    check_peft_block(block.get("peft"), f"--hybrid_ep_config {path!r}")


@dataclass
class HybridEPArguments:
    hybrid_ep_config: str | None = field(default=None, metadata={"help": "YAML file with a hybrid_ep: block"})
    dp_degree: int | None = field(default=None)
    ep_degree: int | None = field(default=None)
    dispatcher: str | None = field(default=None)
    verify_sync_steps: int = field(
        default=0, metadata={"help": "every N steps, check that all replicas are bit-identical (0: off)"}
    )
    router_temperature: float | None = field(default=None, metadata={"help": "divide router logits by T"})
    capacity_factor: float | None = field(default=None, metadata={"help": "per-expert capacity (dropless if unset)"})
    drop_policy: str | None = field(default=None, metadata={"help": "probs | position"})
    device_load_factors: float | None = field(default=None, metadata={"help": "device-load-aware selection β"})
    aux_loss_coef: float | None = field(default=None, metadata={"help": "Switch load-balancing loss coefficient"})
    z_loss_coef: float | None = field(default=None, metadata={"help": "router z-loss coefficient"})
    bias_update_rate: float | None = field(default=None, metadata={"help": "aux-loss-free balancing rate"})
    force_balanced_routing: bool | None = field(default=None, metadata={"help": "round-robin routing (benchmarks)"})
    optimizer_sharding: str | None = field(
        default=None, metadata={"help": "none | zero1 (optimizer state sharded over the data-parallel dims)"}
    )
    shadow_experts: bool | None = field(default=None, metadata={"help": "shadow hot remote experts (see docs/expert_cache.md)"})
    shadow_capacity: int | None = field(default=None, metadata={"help": "max shadows per rank and MoE layer"})
    freeze_experts: str | None = field(
        default=None, metadata={"help": "comma-separated expert ids or 'least_used:N' to freeze"}
    )
    freeze_from_step: int = field(default=0, metadata={"help": "optimizer step from which they are frozen"})

    def __post_init__(self) -> None:
        if self.hybrid_ep_config is not None:
            check_hybrid_ep_file(self.hybrid_ep_config)


@dataclass
class LoraArguments:
    lora_r: int | None = field(default=None, metadata={"help": "train LoRA adapters of this rank (base frozen)"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA scaling numerator (PEFT's default: 8)"})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "comma-separated dense modules (default with --lora_r: q,k,v,o_proj)"})
    lora_target_parameters: str | None = field(
        default=None, metadata={"help": "comma-separated expert parameters (default with --lora_r: "
                                        "mlp.experts.gate_up_proj,mlp.experts.down_proj)"})

    def overrides(self) -> dict:
        """``peft.LoraConfig`` fields given on the command line (over the YAML's ``peft:`` section)."""
        def names(value: str | None) -> list[str] | None:
            return None if value is None else [v.strip() for v in value.split(",") if v.strip()]

        return {"r": self.lora_r, "lora_alpha": self.lora_alpha, "target_modules": names(self.lora_target_modules),
                "target_parameters": names(self.lora_target_parameters)}


def demo_corpus() -> Dataset:
    import pydoc_data.topics

    return Dataset.from_dict({"text": list(pydoc_data.topics.topics.values())})


def demo_tokenizer(corpus: Dataset, save_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the demo corpus (no download), vocabulary matching the demo config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = AutoConfig.from_pretrained(ASSETS).vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus["text"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(save_dir)
    return fast


def pack(dataset: Dataset, tokenizer, block_size: int, text_column: str) -> Dataset:
    """Tokenize and concatenate every text, then cut into ``block_size`` blocks (the remainder is dropped)."""

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch[text_column]])

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        n = len(ids) // block_size * block_size
        return {"input_ids": [ids[i : i + block_size] for i in range(0, n, block_size)]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="tokenize")
    return tokenized.map(group, batched=True, remove_columns=tokenized.column_names, desc="pack")


def build_model(args: ModelArguments, plugin: HybridEPPlugin, seed: int, lora=None):
    """The parallelized model; with ``lora`` (a ``peft.LoraConfig``) a ``PeftModel`` training only its adapters."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype or "")
    if args.model_name_or_path is None:
        torch.manual_seed(seed)  # identical on every rank
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS))
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        return hep.parallelize(model, plugin.config)
    # Hub id, local HF checkpoint or hybrid-EP checkpoint: each rank reads dense weights and its experts.
    torch.manual_seed(seed)  # fresh adapters: identical on every rank
    return hep.from_pretrained(args.model_name_or_path, plugin.config, dtype=dtype, peft_config=lora)


def summary(trainer, metrics: dict, model, block_size: int) -> None:
    """Final loss, tokens/s and peak memory per rank (printed by rank 0)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
        kind = "GPU MiB allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        kind = "MiB RSS"
    peaks = [peak]
    if dist.is_initialized():
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
    if trainer.is_world_process_zero():
        mesh = hep.state_of(model).mesh
        tokens_per_s = metrics.get("train_samples_per_second", 0.0) * block_size
        print(f"\nhybrid EP dp={mesh.dp_degree} × ep={mesh.ep_degree}; final train loss "
              f"{metrics.get('train_loss', float('nan')):.4f}; {tokens_per_s:.0f} tokens/s (all ranks)")
        print(f"peak memory per rank ({kind}): " + ", ".join(f"{p:.0f}" for p in peaks))
        totals = [layer.load.total for layer in hep.state_of(model).layers]
        imbalance = [float(t.max() / t.mean()) for t in totals if float(t.sum()) > 0]
        if imbalance:
            print("expert-load imbalance over the run (max/mean per layer): "
                  + ", ".join(f"{x:.2f}" for x in imbalance))


def _parse_freeze(spec: str | None):
    if spec is None or spec.startswith("least_used:"):
        return spec
    return [int(e) for e in spec.split(",") if e.strip()]


def main(argv: list[str]) -> None:
    argv = argv or DEMO_ARGS
    if not torch.cuda.is_available() and not any(a.split("=")[0] == "--use_cpu" for a in argv):
        argv = [*argv, "--use_cpu"]  # decided before TrainingArguments sets up the devices and the process group
    started_here = not dist.is_initialized()
    set_nccl_env_defaults()  # NCCL's flight recorder and dump on timeout, before TrainingArguments starts the group
    parser = HfArgumentParser((ModelArguments, DataArguments, HybridEPArguments, LoraArguments, TrainingArguments))
    model_args, data_args, ep_args, lora_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    engine_flags = ("dp_degree", "ep_degree", "dispatcher", "router_temperature", "capacity_factor", "drop_policy",
                    "device_load_factors", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "force_balanced_routing")
    engine_flags += ("shadow_experts", "shadow_capacity")
    engine_flags += ("optimizer_sharding",)
    plugin = HybridEPPlugin.from_sources(
        ep_args.hybrid_ep_config, {name: getattr(ep_args, name) for name in engine_flags}
    )
    plugin.apply_to(training_args, explicit=explicit_flags(argv))
    lease = hold_output_dir(training_args.output_dir)  # before the demo tokenizer or anything else is written there
    try:
        # resuming adapters: the checkpoint's adapter config, which the flags and the peft: section must not contradict
        lora = plugin.lora_config(lora_args.overrides(),
                                  resume_target(training_args.resume_from_checkpoint, training_args.output_dir))
        _train(model_args, data_args, ep_args, training_args, plugin, lora)
    finally:
        if lease is not None:  # main() returns (or raises) before the process exits when a caller runs it in-process
            lease.release()
    if dist.is_initialized() and started_here:
        dist.barrier()
        dist.destroy_process_group()  # gloo aborts at exit otherwise


def _train(model_args: ModelArguments, data_args: DataArguments, ep_args: HybridEPArguments,
           training_args: TrainingArguments, plugin: HybridEPPlugin, lora) -> None:
    """Read the data, build the model and train it (the run's lease held)."""
    if data_args.dataset_name:
        raw = load_dataset(data_args.dataset_name, data_args.dataset_config_name, split="train")
    elif data_args.train_file:
        raw = load_dataset(train_file_builder(data_args.train_file), data_files=data_args.train_file, split="train")
    else:
        raw = demo_corpus()
    if data_args.max_train_samples:
        raw = raw.select(range(min(len(raw), data_args.max_train_samples)))

    out = Path(training_args.output_dir)
    with training_args.main_process_first(desc="tokenizer and dataset"):
        if model_args.tokenizer_name or model_args.model_name_or_path:
            tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
        elif training_args.process_index == 0 or not (out / "tokenizer").is_dir():
            tokenizer = demo_tokenizer(raw, out / "tokenizer")
        else:
            tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        train = pack(raw, tokenizer, data_args.block_size, data_args.text_column)
    if len(train) == 0:
        raise HybridEPConfigError(f"the training text holds fewer tokens than one block of --block_size "
                                  f"{data_args.block_size}: give more text or a smaller --block_size")

    model = build_model(model_args, plugin, training_args.seed, lora)
    trainer = HybridEP(Trainer)(
        model=model,
        args=training_args,
        train_dataset=train,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        verify_sync_steps=ep_args.verify_sync_steps,
        freeze_experts=_parse_freeze(ep_args.freeze_experts),
        freeze_from_step=ep_args.freeze_from_step,
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)  # a path, or "latest"
    summary(trainer, result.metrics, model, data_args.block_size)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        main(sys.argv[1:])
    except (HybridEPConfigError, CheckpointError, hep.NonFiniteGradientError) as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()  # every rank raised the same error: nobody waits in a collective
        sys.exit(2)
