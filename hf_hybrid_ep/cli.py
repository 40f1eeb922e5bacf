"""``hf-hybrid-ep``: convert, reshard, export and inspect expert-sharded checkpoints; plot expert load."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import export_checkpoint
from .checkpoint.inspect import format_summary, inspect_checkpoint
from .config import DISPATCHER_BACKENDS
from .errors import CheckpointError, HybridEPConfigError
from .model_io.convert import convert_checkpoint

TRUST_REMOTE_CODE_HELP = ("run code the checkpoint's config names (auto_map); off by default: never run code "
                          "from a download you have not read")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-hybrid-ep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_checkpoint_commands(sub)
    _add_plan_command(sub)
    _add_place_command(sub)
    _add_report_commands(sub)
    _add_launch_command(sub)
    return parser


def _add_checkpoint_commands(sub) -> None:
    """convert, reshard, export."""
    p = sub.add_parser("convert", help="convert a Hub repo or local checkpoint to the hybrid-EP format")
    p.add_argument("src", help="Hub repo id or local checkpoint directory")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--ep-degree", type=int, default=None, help="EP ranks to lay the experts out for "
                   "(default: the placement's row count)")
    p.add_argument("--placement", default=None, help="placement.json (from `place`: a table per MoE layer or one) or a JSON table of rows")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="dtype of the floating tensors written (default: bfloat16 for weights dequantized from a "
                   "quantized checkpoint, the source's dtype for the rest)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--max-shard-size-mb", type=int, default=5 * 1024, help="cap of dense and fused files")
    p.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the result to this repo")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)

    p = sub.add_parser("reshard", help="rewrite a hybrid-EP checkpoint for another EP degree")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--ep-degree", type=int, default=None)
    p.add_argument("--placement", default=None, help="placement.json (from `place`: a table per MoE layer or one) or a JSON table of rows")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)

    p = sub.add_parser("export", help="write a plain Hugging Face checkpoint in the original key format")
    p.add_argument("ckpt")
    p.add_argument("out")


def _add_plan_command(sub) -> None:
    from .planning.planner import __doc__ as memory_model
    from .planning.step_time import __doc__ as step_model

    p = sub.add_parser("plan", help="memory, communication and predicted step time of every dp × ep layout",
                       description=f"{memory_model}\nStep time (hf_hybrid_ep/planning/step_time.py):\n\n{step_model}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="config.json, a checkpoint directory, a Hub repo id (well-known "
                   "MoE models are shipped: mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, "
                   "deepseek-ai/DeepSeek-V3, openai/gpt-oss-120b)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU in GiB (80 for an \"80 GB\" H100)")
    p.add_argument("--topology", default=None, help="e.g. gpus_per_node=8,nvlink_gbps=300,network_gbps=25")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--optimizer-sharding", choices=["none", "zero1"], default="none",
                   help="zero1: optimizer state sharded over the world (dense) and the EDP group (experts)")
    p.add_argument("--dense-sharding", choices=["replicate", "fsdp"], default="replicate",
                   help="fsdp: dense weights, gradients and state FSDP2-sharded over the world")
    p.add_argument("--tokens-per-step", type=int, default=None, help="tokens per optimizer step over all GPUs, "
                   "a multiple of gpus × micro-batch × seq-len (default: one micro-batch per GPU)")
    p.add_argument("--device-tflops", type=float, default=None, help="peak dense TFLOP/s of one GPU in the "
                   "training dtype (default 989: H100 SXM bf16)")
    p.add_argument("--efficiency", type=float, default=None, help="achieved share of that peak, in (0, 1] "
                   "(default 0.4)")
    p.add_argument("--calibrate", action="store_true", help="measure achieved fwd+bwd GEMM FLOP/s on this machine "
                   "(instead of --device-tflops × --efficiency); link bandwidths still come from --topology")
    p.add_argument("--calibrate-seconds", type=float, default=10.0, help="time budget of --calibrate, in (0, 30]")
    p.add_argument("--memory-gbps", type=float, default=None, help="GPU memory bandwidth in GB/s for the "
                   "optimizer and the token exchange's gathers (default 3350: H100 SXM)")
    p.add_argument("--dispatcher", choices=DISPATCHER_BACKENDS, default="auto",
                   help="the token exchange to model, as HybridEPConfig.dispatcher: torch / triton (one row per token "
                   "and expert; unfused gathers / the fused kernels), dedup (one row per token and destination) or "
                   "auto (like the engine on CUDA: whichever of triton and dedup is predicted faster, links and the "
                   "gathers' memory traffic together)")
    p.add_argument("--lora-r", type=int, default=None, help="train LoRA adapters of this rank only: the base is "
                   "frozen (weights only), gradients and optimizer state are the adapters'")
    p.add_argument("--lora-target-modules", default=None, help="comma-separated dense modules (default: "
                   "q_proj,k_proj,v_proj,o_proj)")
    p.add_argument("--lora-target-parameters", default=None, help="comma-separated expert parameters (default: "
                   "mlp.experts.gate_up_proj,mlp.experts.down_proj)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)


def _names(value: str | None) -> list[str] | None:
    """A comma-separated list of names (``None``: not given; ``""``: none)."""
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _add_place_command(sub) -> None:
    from .planning.placement import __doc__ as placement_model

    p = sub.add_parser("place", help="topology- and co-activation-aware expert placement (with hot-expert replicas)",
                       description=placement_model, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stats", required=True, help="expert_load.jsonl written during training (with "
                   "coactivation_stats=True for co-activation-aware placement)")
    p.add_argument("--topology", default=None, help="e.g. racks=2,nodes_per_rack=2,gpus_per_node=8")
    p.add_argument("--ep-degree", type=int, default=None, help="EP ranks (default: every GPU of the topology, "
                   "or one node)")
    p.add_argument("--replicas", type=int, default=0, help="extra copies of the hottest experts")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed per-rank load above max(balanced, mean)")
    p.add_argument("--one-table", action="store_true", help="fit one table to all layers' summed statistics "
                   "instead of one table per layer")
    p.add_argument("--out", required=True, help="placement.json: one table per MoE layer (or --one-table)")


def _add_report_commands(sub) -> None:
    """report, inspect."""
    p = sub.add_parser("report", help="plots and a summary of an expert_load.jsonl")
    p.add_argument("stats", help="expert_load.jsonl written during training")
    p.add_argument("--out", required=True, help="directory for the PNG plots and summary.txt")

    p = sub.add_parser("inspect", help="layers, experts, ranks and bytes per file (of a PEFT adapter directory: its "
                       "adapter config and tensors)")
    p.add_argument("ckpt")
    p.add_argument("--verify", action="store_true", help="re-hash every file against its checksum and report "
                   "tensors holding NaN or inf (exit status 1 when there are any)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_launch_command(sub) -> None:
    from .integrations.launch import __doc__ as command_doc
    from .integrations.supervise import __doc__ as launch_doc

    p = sub.add_parser("launch", help="run a torchrun / accelerate launch job with torchrun's restarts on every node "
                       "(c10d rendezvous), resuming from its newest complete checkpoint",
                       description=f"{launch_doc}\n{command_doc}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of the whole job by torchrun's elastic "
                   "agent after a failure (default 3)")
    p.add_argument("--min-processes", type=int, default=None, help="one node: after the restarts are spent without "
                   "a new checkpoint, launch again at fewer processes, down to this many (the planner picks the "
                   "layout)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU for the planner (default: "
                   "the first GPU's, or the host's memory divided by the processes)")
    p.add_argument("--dry-run", action="store_true", help="print the command it would run (with its environment "
                   "variables) and start nothing")
    p.add_argument("job", nargs=argparse.REMAINDER, help="-- then the launch command (torchrun ..., accelerate "
                   "launch ...)")


def _read_placement(path: str | None) -> list[list[int]] | dict[str, list[list[int]]] | None:
    """The placement in ``placement.json`` (its ``placement`` key: per layer or one table) or a bare JSON table."""
    if path is None:
        return None
    from .planning.placement import read_placement_file

    return read_placement_file(path)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range numeric flags, naming the flag and the value, before any work."""
    positive = {"ep_degree": "--ep-degree", "max_shard_size_mb": "--max-shard-size-mb", "gpus": "--gpus",
                "micro_batch": "--micro-batch", "seq_len": "--seq-len", "min_processes": "--min-processes"}
    for name, flag in positive.items():
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise HybridEPConfigError(f"{flag} must be a positive integer, got {value}")
    if getattr(args, "gpu_memory_gib", None) is not None and not args.gpu_memory_gib > 0:
        raise HybridEPConfigError(f"--gpu-memory-gib must be a positive number, got {args.gpu_memory_gib}")
    if getattr(args, "max_restarts", None) is not None and args.max_restarts < 0:
        raise HybridEPConfigError(f"--max-restarts must be ≥ 0, got {args.max_restarts}")
    if getattr(args, "replicas", None) is not None and args.replicas < 0:
        raise HybridEPConfigError(f"--replicas must be ≥ 0 (extra copies of hot experts), got {args.replicas}")
    if getattr(args, "tolerance", None) is not None and not args.tolerance >= 0:
        raise HybridEPConfigError(f"--tolerance must be a non-negative fraction, got {args.tolerance}")
    if args.command == "plan":
        _check_plan_args(args)


def _check_plan_args(args: argparse.Namespace) -> None:
    """The step-time flags of ``plan``: positive, in range, and not contradicting ``--calibrate``."""
    import math

    if args.tokens_per_step is not None:
        unit = args.gpus * args.micro_batch * args.seq_len
        if args.tokens_per_step < 1 or args.tokens_per_step % unit:
            raise HybridEPConfigError(
                f"--tokens-per-step {args.tokens_per_step} must be a positive multiple of --gpus × --micro-batch × "
                f"--seq-len = {args.gpus} × {args.micro_batch} × {args.seq_len} = {unit} (whole micro-batches on "
                f"every GPU; nearest: {max(1, round(args.tokens_per_step / unit)) * unit})")
    for name, flag in (("device_tflops", "--device-tflops"), ("memory_gbps", "--memory-gbps")):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise HybridEPConfigError(f"{flag} must be a positive number, got {value}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise HybridEPConfigError(f"--efficiency must be in (0, 1] (achieved / peak FLOP/s), got {args.efficiency}")
    if not 0 < args.calibrate_seconds <= 30:
        raise HybridEPConfigError(f"--calibrate-seconds must be in (0, 30], got {args.calibrate_seconds}")
    if args.calibrate and (args.device_tflops is not None or args.efficiency is not None):
        raise HybridEPConfigError("--calibrate measures the achieved FLOP/s itself: leave out --device-tflops "
                                  f"{args.device_tflops} / --efficiency {args.efficiency}")


def _plan_calibration(args: argparse.Namespace) -> dict | None:
    """``--calibrate``: the measured compute rate, and where the link bandwidths come from."""
    if not args.calibrate:
        return None
    from dataclasses import asdict

    from .parallel.mesh import world_size
    from .planning.step_time import calibrate_compute

    result = asdict(calibrate_compute(args.calibrate_seconds))
    world = world_size(launched=True)
    result["links"] = ("from the topology spec, not measured: not inside a launched world" if world == 1 else
                       f"from the topology spec, not measured: inside a launched world of {world} ranks, but "
                       "measuring links is not implemented")
    return result


def _traffic_line(t: dict) -> str:
    line = (f"pair sends intra-node {t['intra_node']:.4g}, inter-node {t['inter_node']:.4g}, "
            f"cross-rack {t['cross_rack']:.4g}")
    if t["cross_node"] is not None:
        line += f"; node-deduplicated cross-node {t['cross_node']:.4g}, cross-rack {t['cross_rack_dedup']:.4g}"
    return line


def _place(args: argparse.Namespace) -> None:
    from pathlib import Path

    from .metrics import read_jsonl
    from .parallel.topology import Topology
    from .planning.placement import RoutingStats, place_layers

    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise HybridEPConfigError(f"--out {args.out!r} must be a file path in an existing directory")
    records = read_jsonl(args.stats)
    topo = Topology.parse(args.topology)
    ep = args.ep_degree if args.ep_degree is not None else topo.total_gpus or topo.gpus_per_node
    stats = RoutingStats.from_records(records)
    result = place_layers(records, ep, args.replicas, topo, args.tolerance, per_layer=not args.one_table)
    print(f"{len(records)} records, {stats.layers} MoE layers, {stats.num_experts} experts, top-{stats.top_k}; "
          f"ep {ep} on {topo.describe()}; method {result['method']}")
    print("token sends per direction (dispatch; combine mirrors it), summed over layers:")
    for name, label in (("contiguous", "contiguous"), ("one_table", "one table"), ("per_layer", "per layer")):
        r = result[name]
        print(f"  {label:10s}: rank imbalance (max/mean, summed loads) {r['imbalance']:.3f}; {_traffic_line(r['traffic'])}")
    worst = {k: max(v[f"imbalance_{k}"] for v in result["layers"].values())
             for k in ("contiguous", "one_table", "per_layer")}
    print(f"  worst single layer's rank imbalance: contiguous {worst['contiguous']:.3f}, one table "
          f"{worst['one_table']:.3f}, per layer {worst['per_layer']:.3f}")
    before = result["contiguous"]["traffic"]
    for name, label in (("one_table", "one table"), ("per_layer", "per layer")):
        after = result[name]["traffic"]
        for key, kind in (("inter_node", "inter-node pair"), ("cross_node", "cross-node deduplicated"),
                          ("cross_rack_dedup", "cross-rack deduplicated")):
            if before[key]:
                change = 100 * (after[key] / before[key] - 1)
                print(f"  {label}: {kind} traffic {abs(change):.1f}% {'less' if change <= 0 else 'more'} than contiguous")
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    kind = "one table for every MoE layer" if args.one_table else f"one table per MoE layer ({stats.layers})"
    print(f"wrote {out}: {kind} (use: HybridEPConfig(placement=...), convert/reshard --placement {out})")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_args(args)
        if args.command == "convert":
            out = convert_checkpoint(
                args.src, args.out, ep_degree=args.ep_degree, dtype=args.dtype, revision=args.revision,
                max_shard_bytes=args.max_shard_size_mb * 2**20, placement=_read_placement(args.placement),
                trust_remote_code=args.trust_remote_code,
            )
            print(f"wrote {out}")
            if args.push_to_hub:
                from .hub import push_to_hub

                print(push_to_hub(out, args.push_to_hub))
        elif args.command == "reshard":
            out = convert_checkpoint(args.ckpt, args.out, ep_degree=args.ep_degree,
                                     placement=_read_placement(args.placement),
                                     trust_remote_code=args.trust_remote_code)
            print(f"wrote {out}")
        elif args.command == "export":
            dropped = export_checkpoint(args.ckpt, args.out)
            print(f"wrote {args.out}")
            print("dropped side state: " + (", ".join(dropped) if dropped else "none"))
        elif args.command == "plan":
            from .planning.planner import format_plan, plan

            recipe = f"{args.precision}-{args.optimizer}"
            if recipe == "fp32-sgd":
                raise HybridEPConfigError("--precision fp32 --optimizer sgd is not a modelled recipe")
            calibration = _plan_calibration(args)
            result = plan(args.model, args.gpus, args.gpu_memory_gib, args.topology, args.micro_batch, args.seq_len,
                          recipe, args.optimizer_sharding, args.dense_sharding,
                          trust_remote_code=args.trust_remote_code, tokens_per_step=args.tokens_per_step,
                          device_flops=calibration["flops_per_s"] if calibration else (
                              None if args.device_tflops is None else args.device_tflops * 1e12),
                          efficiency=1.0 if calibration else args.efficiency, memory_gbps=args.memory_gbps,
                          calibration=calibration, dispatcher=args.dispatcher, lora_r=args.lora_r,
                          lora_target_modules=_names(args.lora_target_modules),
                          lora_target_parameters=_names(args.lora_target_parameters))
            print(json.dumps(result, indent=1) if args.json else format_plan(result))
        elif args.command == "place":
            _place(args)
        elif args.command == "report":
            from .metrics import write_report

            written = write_report(args.stats, args.out)
            for path in written:
                print(f"wrote {path}")
            print(written[-1].read_text(), end="")  # the summary
        elif args.command == "launch":
            from .integrations.supervise import supervise

            return supervise(args.job[1:] if args.job[:1] == ["--"] else args.job, args.max_restarts,
                             args.min_processes, args.gpu_memory_gib, dry_run=args.dry_run)
        elif args.command == "inspect":
            summary = inspect_checkpoint(args.ckpt, verify=args.verify)
            print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
            if summary.get("nonfinite"):
                return 1  # the checksums hold, but the weights are not usable
    except (CheckpointError, HybridEPConfigError, FileNotFoundError, ValueError) as err:
        print(f"hf-hybrid-ep {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
