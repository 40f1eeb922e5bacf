"""``hf-hybrid-ep``: convert, reshard, export and inspect expert-sharded checkpoints; plot expert load."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import CheckpointError, convert_checkpoint, export_checkpoint
from .checkpoint.inspect import format_summary, inspect_checkpoint
from .config import HybridEPConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-hybrid-ep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a Hub repo or local checkpoint to the hybrid-EP format")
    p.add_argument("src", help="Hub repo id or local checkpoint directory")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--ep-degree", type=int, required=True, help="EP ranks to lay the experts out for")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating tensors")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--max-shard-size-mb", type=int, default=5 * 1024, help="cap of dense and fused files")
    p.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the result to this repo")

    p = sub.add_parser("reshard", help="rewrite a hybrid-EP checkpoint for another EP degree")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--ep-degree", type=int, required=True)

    p = sub.add_parser("export", help="write a plain Hugging Face checkpoint in the original key format")
    p.add_argument("ckpt")
    p.add_argument("out")

    from .planner import __doc__ as memory_model

    p = sub.add_parser("plan", help="memory and communication of every dp × ep layout for a cluster",
                       description=memory_model, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="config.json, a checkpoint directory, a Hub repo id (well-known "
                   "MoE models are shipped: mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, "
                   "deepseek-ai/DeepSeek-V3, openai/gpt-oss-120b)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory-gb", type=float, required=True)
    p.add_argument("--topology", default=None, help="e.g. gpus_per_node=8,nvlink_gbps=300,network_gbps=25")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--optimizer-sharding", choices=["none", "zero1"], default="none",
                   help="zero1: optimizer state sharded over the world (dense) and the EDP group (experts)")
    p.add_argument("--dense-sharding", choices=["replicate", "fsdp"], default="replicate",
                   help="fsdp: dense weights, gradients and state FSDP2-sharded over the world")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("place", help="load-balanced expert placement (with hot-expert replicas) from load stats")
    p.add_argument("--stats", required=True, help="expert_load.jsonl written during training")
    p.add_argument("--ep-degree", type=int, required=True)
    p.add_argument("--replicas", type=int, default=0, help="extra copies of the hottest experts per layer")
    p.add_argument("--out", required=True, help="placement.json (one table per MoE layer)")

    p = sub.add_parser("report", help="plots and a summary of an expert_load.jsonl")
    p.add_argument("stats", help="expert_load.jsonl written during training")
    p.add_argument("--out", required=True, help="directory for the PNG plots and summary.txt")

    p = sub.add_parser("inspect", help="layers, experts, ranks and bytes per file")
    p.add_argument("ckpt")
    p.add_argument("--verify", action="store_true", help="re-hash every file against its checksum")
    p.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "convert":
            out = convert_checkpoint(
                args.src, args.out, ep_degree=args.ep_degree, dtype=args.dtype, revision=args.revision,
                max_shard_bytes=args.max_shard_size_mb * 2**20,
            )
            print(f"wrote {out}")
            if args.push_to_hub:
                from .hub import push_to_hub

                print(push_to_hub(out, args.push_to_hub))
        elif args.command == "reshard":
            print(f"wrote {convert_checkpoint(args.ckpt, args.out, ep_degree=args.ep_degree)}")
        elif args.command == "export":
            dropped = export_checkpoint(args.ckpt, args.out)
            print(f"wrote {args.out}")
            print("dropped side state: " + (", ".join(dropped) if dropped else "none"))
        elif args.command == "plan":
            from .planner import format_plan, plan

            recipe = f"{args.precision}-{args.optimizer}"
            if recipe == "fp32-sgd":
                raise HybridEPConfigError("--precision fp32 --optimizer sgd is not a modelled recipe")
            result = plan(args.model, args.gpus, args.gpu_memory_gb, args.topology, args.micro_batch, args.seq_len,
                          recipe, args.optimizer_sharding, args.dense_sharding)
            print(json.dumps(result, indent=1) if args.json else format_plan(result))
        elif args.command == "place":
            from .metrics import read_jsonl
            from .placement import place_report

            records = read_jsonl(args.stats)
            layers = {}
            for name in records[0]["layers"]:
                loads = [sum(r["layers"][name]["tokens_per_expert"][e] for r in records if name in r["layers"])
                         for e in range(len(records[0]["layers"][name]["tokens_per_expert"]))]
                layers[name] = place_report(loads, args.ep_degree, args.replicas)
                print(f"{name}: rank imbalance (max/mean) contiguous {layers[name]['imbalance_contiguous']:.3f} -> "
                      f"balanced {layers[name]['imbalance_balanced']:.3f}")
            with open(args.out, "w") as f:
                json.dump({"ep_degree": args.ep_degree, "replicas": args.replicas, "layers": layers}, f, indent=1)
            print(f"wrote {args.out}")
        elif args.command == "report":
            from .metrics import write_report

            for path in write_report(args.stats, args.out):
                print(f"wrote {path}")
        elif args.command == "inspect":
            summary = inspect_checkpoint(args.ckpt, verify=args.verify)
            print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    except (CheckpointError, HybridEPConfigError, FileNotFoundError, ValueError) as err:
        print(f"hf-hybrid-ep {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
