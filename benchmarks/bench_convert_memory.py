"""Peak memory of streaming conversion vs loading the whole model, side by side.

Writes a Mixtral-style checkpoint several times larger than one shard, then measures in fresh
subprocesses (peak RSS from getrusage):
  * baseline: import the library and read the config (what every variant pays);
  * hf-hybrid-ep convert --ep-degree 4 (streaming);
  * the whole-model route: transformers from_pretrained + save_pretrained;
and the cost of verified loading: ``hep.from_pretrained`` of the converted checkpoint (every file,
a world of one) with the sha256 check on and off, interleaved rounds in one process (page cache warm).

    python -m benchmarks.bench_convert_memory --workdir /tmp/convert-mem
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
from hf_hybrid_ep.checkpoint.layout import model_experts
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
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    args = Args(**vars(parser.parse_args()))
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
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


if __name__ == "__main__":
    main()
