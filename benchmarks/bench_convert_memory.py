"""Peak memory of streaming conversion vs loading the whole model, side by side.

Writes a Mixtral-style checkpoint several times larger than one shard, then measures in fresh
subprocesses (peak RSS from getrusage):
  * baseline: import the library and read the config (what every variant pays);
  * hf-hybrid-ep convert --ep-degree 4 (streaming);
  * the whole-model route: transformers from_pretrained + save_pretrained;
and the cost of verified loading: ``hep.from_pretrained`` of the converted checkpoint (every file,
a world of one) with the sha256 check on and off, interleaved rounds in one process (page cache warm).

With ``--quantized``, the cost of dequantizing instead: a Qwen3-MoE-style model (per-expert keys)
as bfloat16 and as block-FP8 (128 × 128, float32 scales: DeepSeek's and Qwen's release format), a
GPT-OSS-style model (fused experts) as bfloat16 and as MXFP4 (the release format), each converted
for ep 4 in a fresh process; the extra peak RSS of a quantized source is its convert's peak above
that of the same model's bfloat16 source.

    python -m benchmarks.bench_convert_memory --workdir /tmp/convert-mem
    python -m benchmarks.bench_convert_memory --workdir /tmp/convert-mem-q --quantized
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

BASELINE = """
import hf_hybrid_ep
from hf_hybrid_ep.moe.architecture import model_experts
model_experts({src!r})
"""
CONVERT = """
from hf_hybrid_ep import convert_checkpoint
convert_checkpoint({src!r}, {out!r}, ep_degree=4, progress=False)
"""
MAKE = """
import torch
from transformers import AutoModelForCausalLM, MixtralConfig
torch.manual_seed(0)
config = MixtralConfig(vocab_size=1024, hidden_size={hidden}, intermediate_size={intermediate},
                       num_hidden_layers={layers}, num_attention_heads=8, num_key_value_heads=4,
                       num_local_experts={experts}, num_experts_per_tok=2)
AutoModelForCausalLM.from_config(config).save_pretrained({src!r}, max_shard_size="{shard_mb}MB")
"""
SIZES = """
from hf_hybrid_ep.checkpoint import read_index
print("BIGGEST", max(s.nbytes for s in read_index({src!r}).specs.values()))
"""
LOAD_TIME = """
import statistics, time
import hf_hybrid_ep as hep
times = {{True: [], False: []}}
hep.from_pretrained({out!r}, hep.HybridEPConfig(), verify=False)  # warm the page cache
for _ in range({rounds}):
    for verify in (True, False):
        start = time.perf_counter()
        hep.from_pretrained({out!r}, hep.HybridEPConfig(), verify=verify)
        times[verify].append(time.perf_counter() - start)
print("LOAD", statistics.median(times[True]), statistics.median(times[False]))
"""
MAKE_QWEN3 = """
import sys, torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
hidden, intermediate, experts, layers, shard_mb, out = sys.argv[1:]
torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=1024, hidden_size=int(hidden), intermediate_size=int(hidden),
                        moe_intermediate_size=int(intermediate), num_hidden_layers=int(layers), num_attention_heads=8,
                        num_key_value_heads=4, head_dim=128, num_experts=int(experts), num_experts_per_tok=2)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out, max_shard_size=shard_mb + "MB")
"""
MAKE_GPT_OSS = """
import sys, torch
from transformers import AutoModelForCausalLM, GptOssConfig
hidden, intermediate, experts, layers, shard_mb, out = sys.argv[1:]
torch.manual_seed(0)
config = GptOssConfig(vocab_size=1024, hidden_size=int(hidden), intermediate_size=int(intermediate),
                      num_hidden_layers=int(layers), num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      num_local_experts=int(experts), num_experts_per_tok=2, layer_types=None)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out, max_shard_size=shard_mb + "MB")
"""
# The release formats, written shard by shard: block-FP8 with 128 x 128 float32 scales for every linear
# weight (not embeddings, norms, routers, the head); MXFP4 for GPT-OSS's expert tensors (stored
# transposed, two e2m1 values a byte, low nibble first, an e8m0 exponent per 32 values).
QUANTIZE = """
import json, shutil, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst, method = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between the e2m1 magnitudes

def fp8(w):
    rows, cols = w.shape
    blocks = w.float().reshape(rows // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale

def mxfp4(w):
    blocks, scales = [], []
    for expert in w:  # [H, N] -> [N, H / 32, 32]
        t = expert.float().t().reshape(expert.shape[1], -1, 32)
        exponent = torch.floor(torch.log2(t.abs().amax(-1).clamp(min=2.0 ** -100))) - 2
        x = t / torch.exp2(exponent)[..., None]
        codes = torch.bucketize(x.abs().contiguous(), MIDPOINTS).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)
        blocks.append(codes[..., 0::2] | (codes[..., 1::2] << 4))
        scales.append((exponent + 127).to(torch.uint8))
    return torch.stack(blocks), torch.stack(scales)

dst.mkdir(parents=True)
index = json.loads((src / "model.safetensors.index.json").read_text())
weight_map = {}
for shard in sorted(set(index["weight_map"].values())):
    out = {}
    for key, value in load_file(src / shard).items():
        skip = any(s in key for s in ("embed_tokens", "lm_head", "norm", "mlp.gate.", "router"))
        if method == "fp8" and key.endswith(".weight") and value.dim() == 2 and not skip:
            out[key], out[key + "_scale_inv"] = fp8(value)
        elif method == "mxfp4" and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[key + "_blocks"], out[key + "_scales"] = mxfp4(value)
        else:
            out[key] = value
    save_file(out, dst / shard, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(out, shard))
(dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
config = json.loads((src / "config.json").read_text())
config["quantization_config"] = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]} if method == "fp8" else {"quant_method": "mxfp4"})
(dst / "config.json").write_text(json.dumps(config, indent=2))
"""
WHOLE = """
import hf_hybrid_ep
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({src!r}).save_pretrained({out!r})
"""


@dataclass
class Args:
    workdir: str = field(default="/tmp/convert-mem")
    hidden: int = field(default=1024)
    intermediate: int = field(default=2048)
    experts: int = field(default=8)
    layers: int = field(default=4)
    shard_mb: int = field(default=100)
    rounds: int = field(default=5)
    quantized: bool = field(default=False)


REPORT = "\nimport resource; print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"


def peak_rss_mib(code: str) -> float:
    """Peak resident memory of a fresh Python process running ``code`` (its own getrusage)."""
    run = subprocess.run([sys.executable, "-c", code + REPORT], check=True, capture_output=True, text=True)
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("PEAK_KIB"))
    return int(line.split()[1]) / 1024


def main() -> None:
    # The parent stays small (no torch): Linux carries a process's peak RSS across fork+exec into
    # its children, so a large parent would inflate every measurement.
    parser = argparse.ArgumentParser(description=__doc__)
    for f in dataclasses.fields(Args):
        if isinstance(f.default, bool):
            parser.add_argument(f"--{f.name}", action="store_true", help="measure dequantizing conversion")
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    args = Args(**vars(parser.parse_args()))
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    if args.quantized:
        quantized(args, work)
        return
    src = work / "src"
    subprocess.run([sys.executable, "-c", MAKE.format(src=str(src), **dataclasses.asdict(args))], check=True)
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards) / 2**20
    largest = max(p.stat().st_size for p in shards) / 2**20
    base = peak_rss_mib(BASELINE.format(src=str(src)))
    conv = peak_rss_mib(CONVERT.format(src=str(src), out=str(work / "ep4")))
    whole = peak_rss_mib(WHOLE.format(src=str(src), out=str(work / "whole")))
    sizes = subprocess.run([sys.executable, "-c", SIZES.format(src=str(src))], check=True, capture_output=True,
                           text=True).stdout
    biggest = int(next(ln for ln in sizes.splitlines() if ln.startswith("BIGGEST")).split()[1]) / 2**20
    print(f"checkpoint: {total:.1f} MiB in {len(shards)} shards (largest shard {largest:.1f} MiB, "
          f"largest tensor {biggest:.1f} MiB)")
    print("| variant | peak RSS MiB | above baseline MiB | × largest shard |")
    print("|---|---|---|---|")
    print(f"| baseline (imports + config) | {base:.0f} | 0 | 0 |")
    print(f"| hf-hybrid-ep convert --ep-degree 4 | {conv:.0f} | {conv - base:.0f} | {(conv - base) / largest:.2f} |")
    print(f"| from_pretrained + save_pretrained | {whole:.0f} | {whole - base:.0f} | {(whole - base) / largest:.2f} |")
    load = subprocess.run([sys.executable, "-c", LOAD_TIME.format(out=str(work / "ep4"), rounds=args.rounds)],
                          check=True, capture_output=True, text=True).stdout
    verified, unverified = map(float, next(ln for ln in load.splitlines() if ln.startswith("LOAD")).split()[1:])
    print(f"\nhep.from_pretrained of the {total:.0f} MiB checkpoint (world of one, median of {args.rounds}, "
          f"page cache warm): verify=True {verified:.2f} s, verify=False {unverified:.2f} s; the sha256 check "
          f"costs {verified - unverified:.2f} s ({verified / unverified:.2f}x, "
          f"{total / max(verified - unverified, 1e-9):.0f} MiB/s)")


def _sizes(src: Path) -> tuple[float, float, float]:
    """Total and largest-shard MiB of a checkpoint directory, and its largest tensor's MiB."""
    shards = sorted(src.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-c", SIZES.format(src=str(src))], check=True, capture_output=True,
                         text=True).stdout
    biggest = int(next(ln for ln in out.splitlines() if ln.startswith("BIGGEST")).split()[1])
    return (sum(p.stat().st_size for p in shards) / 2**20, max(p.stat().st_size for p in shards) / 2**20,
            biggest / 2**20)


def quantized(args: Args, work: Path) -> None:
    """Peak RSS of converting bfloat16 and quantized sources of the same two models (``--quantized``)."""
    import time

    rows = []
    for family, make, method in (("Qwen3-MoE", MAKE_QWEN3, "fp8"), ("GPT-OSS", MAKE_GPT_OSS, "mxfp4")):
        plain, packed = work / f"{family}-bf16", work / f"{family}-{method}"
        intermediate = args.intermediate if family == "GPT-OSS" else args.intermediate // 2
        subprocess.run([sys.executable, "-c", make, str(args.hidden), str(intermediate), str(args.experts),
                        str(args.layers), str(args.shard_mb), str(plain)], check=True)
        subprocess.run([sys.executable, "-c", QUANTIZE, str(plain), str(packed), method], check=True)
        base = peak_rss_mib(BASELINE.format(src=str(plain)))
        for src in (plain, packed):
            start = time.perf_counter()
            peak = peak_rss_mib(CONVERT.format(src=str(src), out=str(work / f"{src.name}-ep4")))
            rows.append((src.name, *_sizes(src), base, peak, time.perf_counter() - start))
    print("| source | MiB | largest shard MiB | largest tensor MiB | baseline MiB | convert peak RSS MiB | "
          "above baseline MiB | convert s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, total, shard, tensor, base, peak, seconds in rows:
        print(f"| {name} | {total:.0f} | {shard:.1f} | {tensor:.1f} | {base:.0f} | {peak:.0f} | {peak - base:.0f} | "
              f"{seconds:.1f} |")
    for plain, packed in (rows[0:2], rows[2:4]):
        print(f"{packed[0]}: extra peak RSS over its bfloat16 source {packed[5] - plain[5]:+.0f} MiB")


if __name__ == "__main__":
    main()
