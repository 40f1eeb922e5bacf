"""LoRA on the experts: this library's path against PEFT's, and LoRA against full fine-tuning.

``--block`` (one process): one MoE block of the training benchmark's model (``benchmarks/training``'s
``ModelArgs``: Qwen3-MoE, hidden 512, 16 experts of width 512, top-2; ``batch_per_rank × seq_len`` = 2 × 256
tokens), forward and backward, LoRA rank ``--r`` on both expert projections. PEFT's ``ParamWrapper`` path
(``W + scaling · ΔW`` for all experts, parametrized on every forward, then transformers' ``grouped_mm``)
against the parallelized block (world 1: the rank-r products on the received rows by grouped GEMMs), rounds
interleaved; the outputs and every gradient compared first. The frozen block without adapters is timed too.

``--whole-model`` (under ``torchrun``, world 4, dp 2 × ep 2): the same model trained with LoRA (attention and
experts) and fully, side by side (median of interleaved steps): samples/s, and per rank the bytes of weights, gradients and optimizer state
(:func:`hf_hybrid_ep.memory_report`) and the process's peak RSS (LoRA runs first, so its figure is its own; the
full run's is the larger of the two).

    python -m benchmarks.bench_lora --block
    torchrun --standalone --nproc_per_node 4 -m benchmarks.bench_lora --whole-model
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time

import torch

from benchmarks.training.runs import ModelArgs, StepArgs

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_config(r: int, dense: bool):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, target_parameters=EXPERT_TARGETS,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] if dense else [])


def model_of(layers: int | None = None) -> torch.nn.Module:
    """The training benchmark's model (fp32, eval-free training mode), optionally with fewer layers."""
    from transformers import AutoModelForCausalLM

    config = ModelArgs().hf_config()
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _block_step(block: torch.nn.Module, hidden: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = hidden.detach().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach()


def _block_variants(r: int) -> dict[str, tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]]:
    """The MoE block three ways: PEFT's path, this library's (world 1), and this library's without adapters."""
    from peft import get_peft_model

    import hf_hybrid_ep as hep

    peft = get_peft_model(model_of(layers=1), lora_config(r, dense=False))
    with torch.no_grad():  # a trained adapter: lora_B away from its zero start
        g = torch.Generator().manual_seed(1)
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    ours = hep.parallelize(copy.deepcopy(peft))
    plain = hep.parallelize(model_of(layers=1))
    for p in plain.parameters():
        p.requires_grad_(False)
    out = {}
    for name, model in (("peft", peft), ("hybrid_ep", ours), ("no_adapter", plain)):
        block = model.get_base_model().model.layers[0].mlp if name != "no_adapter" else model.model.layers[0].mlp
        out[name] = (block, {n: p for n, p in model.named_parameters() if "lora_" in n})
    return out


def block_benchmark(r: int, rounds: int, iters: int) -> dict:
    """Forward + backward of one MoE block, PEFT's ParamWrapper path vs this library's, interleaved rounds."""
    from hf_hybrid_ep.moe.lora import peft_from_slots

    step = StepArgs()
    tokens, hidden_size = step.batch_per_rank * step.seq_len, ModelArgs().hidden_size
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, tokens, hidden_size, generator=g)
    grad = torch.randn(1, tokens, hidden_size, generator=g)
    variants = _block_variants(r)
    outs = {name: _block_step(block, hidden, grad) for name, (block, _) in variants.items()}
    want = variants["peft"][1]
    grads = [_rel(peft_from_slots(p.grad, "A" if ".lora_A." in n else "B"), want[n].grad)
             for n, p in variants["hybrid_ep"][1].items()]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (block, params) in variants.items():
            start = time.perf_counter()
            for _ in range(iters):
                for p in params.values():
                    p.grad = None
                _block_step(block, hidden, grad)
            times[name].append((time.perf_counter() - start) / iters)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"tokens": tokens, "hidden": hidden_size, "experts": ModelArgs().num_experts, "r": r,
            "output_rel": _rel(outs["hybrid_ep"], outs["peft"]), "max_grad_rel": max(grads),
            "ms": {k: 1e3 * v for k, v in median.items()}, "speedup_vs_peft": median["peft"] / median["hybrid_ep"],
            "lora_overhead_vs_no_adapter": median["hybrid_ep"] / median["no_adapter"]}


def _step(model, optimizer, ids: torch.Tensor, max_grad_norm: float) -> None:
    import hf_hybrid_ep as hep

    model(input_ids=ids, labels=ids).loss.backward()
    hep.clip_grad_norm_(model, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()


def _built(name: str, r: int, config, step: StepArgs, ids: torch.Tensor) -> dict:
    """The model of run ``name`` parallelized, its optimizer, one warm-up step taken; its per-rank state bytes and
    the process's peak RSS after it."""
    from peft import get_peft_model

    import hf_hybrid_ep as hep

    model = model_of() if name == "full" else get_peft_model(model_of(), lora_config(r, dense=True))
    hep.parallelize(model, config)
    optimizer = hep.make_optimizer(model, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad],
                                   lr=step.lr)
    _step(model, optimizer, ids, step.max_grad_norm)
    report = hep.memory_report(model, optimizer)
    return {"model": model, "optimizer": optimizer, "times": [],
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            **{k: report[k] for k in ("weight_bytes", "grad_bytes", "optimizer_bytes")},
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def whole_model_benchmark(r: int, rounds: int) -> dict | None:
    """LoRA vs full fine-tuning of the training benchmark's model at dp 2 × ep 2 (under torchrun, world 4):
    built one after the other (LoRA first: the peak RSS after it is its own), then timed in interleaved rounds
    of one optimizer step each."""
    import torch.distributed as dist

    import hf_hybrid_ep as hep

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = StepArgs()
    ids = torch.randint(0, ModelArgs().vocab_size, (step.batch_per_rank, step.seq_len),
                        generator=torch.Generator().manual_seed(rank))
    config = hep.HybridEPConfig(dp_degree=2, ep_degree=world // 2)
    runs = {name: _built(name, r, config, step, ids) for name in ("lora", "full")}
    for _ in range(rounds):
        for run in runs.values():
            dist.barrier()
            start = time.perf_counter()
            _step(run["model"], run["optimizer"], ids, step.max_grad_norm)
            dist.barrier()
            run["times"].append(time.perf_counter() - start)
    rows = {}
    for name, run in runs.items():
        seconds = statistics.median(run.pop("times"))
        del run["model"], run["optimizer"]
        rows[name] = {"samples_per_s": world * step.batch_per_rank / seconds, "step_s": seconds, **run}
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"layout": f"dp2 x ep{world // 2}", "r": r, "tokens_per_rank": step.batch_per_rank * step.seq_len,
            "ranks": gathered,
            "samples_per_s_ratio_lora_vs_full": gathered[0]["lora"]["samples_per_s"] / gathered[0]["full"]["samples_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", action="store_true", help="one MoE block: this library's path vs PEFT's")
    parser.add_argument("--whole-model", action="store_true", help="LoRA vs full fine-tuning (under torchrun)")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3, help="block forward+backward passes per round")
    parser.add_argument("--steps", type=int, default=5, help="interleaved timed optimizer steps of each whole-model run")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    if not (args.block or args.whole_model):
        parser.error("choose --block and/or --whole-model")
    report = {}
    if args.block:
        report["block"] = block_benchmark(args.r, args.rounds, args.iters)
    if args.whole_model:
        whole = whole_model_benchmark(args.r, args.steps)
        if whole is None:
            return
        report["whole_model"] = whole
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
