"""Named benchmark regimes for ``python -m benchmarks.bench_training --regime``, and the step-time model checked
against them.

Two dimensionless ratios decide whether hybrid EP (dp 2 × ep 2 on two nodes of two ranks) beats pure EP
(ep 4 across both nodes); hidden size and layer count cancel out of both:

* ``T / T*``: tokens per rank per optimizer step over the crossover ``T*`` at which the hybrid's
  cross-node expert-gradient all-reduce sends as many bytes as pure EP's cross-node token exchange,
  ``T* = (E/ep_h) · 3I · b_g · 2(d−1)/d ÷ (4 · k · b_a · f_x)`` (here ep_h = d = 2, f_x = 1/2,
  b_g = b_a = 4 in fp32, so ``T* = 3·E·I / (4·k)``);
* ``r_x``: pure EP's cross-node exchange time over its compute time.

Each regime scales a tiny Qwen3-MoE so that ``T / T*`` matches a reference run (the shapes give it
exactly), and the emulated link's rate is chosen from a calibration run on the flat fabric so that
``r_x`` matches too (``link_gbit_for``). Reference values come from :mod:`hf_hybrid_ep.planning.step_time` at 40%
MFU on H100s (``tests/test_step_time.py`` checks them by hand): Qwen3-30B-A3B on 2 × 8 GPUs, dp2×ep8 vs
ep16, 2²² tokens per step: ``T/T* = 113.8``, ``r_x = 0.89``; Mixtral-8x7B on 2 × 4 GPUs, dp2×ep4 vs ep8:
``T/T* = 24.4``, ``r_x = 0.100``. The toy regime is the training benchmark's default shape, far below any real
cluster's ``T/T*``.

The step-time model is calibrated on one designated run per regime — pure EP on the flat fabric (no
shaped link). From it come the device rate (model FLOPs per second per rank = FLOPs / (step time −
exposed communication − the model's time for the exchange's gathers: their bytes at the machine's measured
memory rate), efficiency 1), the fixed cost of one exchange collective (time blocked in the
counts exchange, which carries almost no bytes, per call) and the loopback rate (token-exchange bytes /
the rest of the time blocked in token exchanges). The inter-node bandwidth per rank is the fabric's
measured bulk TCP rate divided by the ranks of a node, which share the link. Every other run is a
validation run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

MIB = 2**20
RUNTIME_ALLOWANCE_BYTES = 128 * MIB  # gloo buffers, allocator slack, autograd temporaries the formula omits
STATE_SLACK = 1.5  # peak data above setup / planner state, measured 1.47 (hybrid) – 1.74 (ep4) in the toy runs
PREDICTION_TOLERANCE = 0.25  # |predicted − measured| / measured samples/s
ORDER_MARGIN = 0.15  # pairs of layouts further apart than this must be predicted in the measured order
CALIBRATION_RUN = "ep4"  # on the flat fabric


@dataclass(frozen=True)
class Regime:
    """Model shape, workload and targets of one regime (world 4, two nodes of two ranks)."""

    name: str
    reference: str
    model: dict[str, int]  # ModelArgs fields
    batch_per_rank: int
    seq_len: int
    grad_accum: int
    target_t_over_t_star: float
    target_r_x: float
    runs: tuple[str, ...] = ("dp4", "hybrid-dp2-ep2", "ep4", "hybrid-dp2-ep2-dedup", "ep4-dedup",
                             "hybrid-dp2-ep2-zero1", "hybrid-dp2-ep2-fsdp-zero1", "hf-native-fsdp4-ep4",
                             "hf-native-hsdp2x2-ep2")

    @property
    def tokens_per_rank(self) -> int:
        return self.batch_per_rank * self.seq_len * self.grad_accum


REGIMES = {
    "fine-grained": Regime(
        name="fine-grained",
        reference="Qwen3-30B-A3B (128 experts, top-8) on 2 nodes × 8 H100, 400 Gbit/s per GPU, 2²² tokens per step; "
                  "hybrid dp2×ep8 vs pure EP ep16",
        model={"vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 4, "num_experts": 32,
               "moe_intermediate_size": 16, "num_experts_per_tok": 8, "num_attention_heads": 4, "num_key_value_heads": 2},
        batch_per_rank=2, seq_len=256, grad_accum=11, target_t_over_t_star=113.8, target_r_x=0.89,
    ),
    "coarse": Regime(
        name="coarse",
        reference="Mixtral-8x7B (8 experts, top-2) on 2 nodes × 4 GPUs, 400 Gbit/s per GPU, 2²² tokens per step; "
                  "hybrid dp2×ep4 vs pure EP ep8",
        model={"vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 4, "num_experts": 8,
               "moe_intermediate_size": 64, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
        batch_per_rank=2, seq_len=256, grad_accum=9, target_t_over_t_star=24.4, target_r_x=0.100,
    ),
    "toy": Regime(
        name="toy",
        reference="the training benchmark's default shape (no real cluster runs here)",
        model={"vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 4, "num_experts": 16,
               "moe_intermediate_size": 512, "num_experts_per_tok": 2, "num_attention_heads": 8, "num_key_value_heads": 4},
        batch_per_rank=2, seq_len=256, grad_accum=1, target_t_over_t_star=0.17, target_r_x=0.14,
    ),
}


def t_over_t_star(regime: Regime) -> dict[str, float]:
    """``T``, ``T*`` and their ratio from the shapes (world 4: hybrid dp2×ep2 vs pure EP ep4, two nodes)."""
    m = regime.model
    e, i, k = m["num_experts"], m["moe_intermediate_size"], m["num_experts_per_tok"]
    ep_h, d, f_x, b_g, b_a = 2, 2, 0.5, 4, 4
    t_star = (e / ep_h) * 3 * i * b_g * 2 * (d - 1) / d / (4 * k * b_a * f_x)
    return {"T": regime.tokens_per_rank, "T_star": t_star, "T_over_T_star": regime.tokens_per_rank / t_star}


def memory_budget(counts, regime: Regime) -> dict[str, int]:
    """The per-rank memory budget, fixed before any run: ``1.5 ×`` the planner's per-rank memory of the hybrid
    dp2×ep2 layout (fp32 AdamW state + fp32 activations of one micro-batch) ``+ 128 MiB`` for the runtime."""
    from hf_hybrid_ep.planning.counts import activation_bytes, rank_state_bytes

    state = rank_state_bytes(counts, 2, 2, 0, "fp32-adamw")
    state_bytes = state["weight_bytes"] + state["grad_bytes"] + state["optimizer_bytes"]
    activations = 2 * activation_bytes(counts, regime.batch_per_rank, regime.seq_len)[0]  # the formula is in bf16 bytes
    planned = state_bytes + activations
    return {"planner_hybrid_bytes": planned, "budget_bytes": int(STATE_SLACK * planned + RUNTIME_ALLOWANCE_BYTES)}


def link_gbit_for(target_r_x: float, cross_bytes_per_rank: float, ranks_per_node: int, compute_s: float) -> float:
    """The link rate (Gbit/s per direction, shared by a node's ranks) at which pure EP's cross-node exchange
    takes ``target_r_x × compute_s``."""
    return cross_bytes_per_rank * ranks_per_node * 8 / (target_r_x * compute_s) / 1e9


def flops_per_token(counts, seq_len: int) -> float:
    """The step-time model's forward + backward FLOPs per token (``hf_hybrid_ep.planning.step_time``)."""
    from hf_hybrid_ep.planning.step_time import predict_step_time

    st = predict_step_time(counts, 1, 1, "gpus_per_node=1", tokens_per_step=seq_len, micro_batch=1, seq_len=seq_len,
                           recipe="fp32-adamw")
    return st.flops_per_token


def qwen3_moe_config(model: dict[str, int]):
    """The benchmark's Qwen3-MoE config (every layer MoE) from its shape fields."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=model["vocab_size"], hidden_size=model["hidden_size"], intermediate_size=4 * model["hidden_size"],
        moe_intermediate_size=model["moe_intermediate_size"], num_hidden_layers=model["num_hidden_layers"],
        num_attention_heads=model["num_attention_heads"], num_key_value_heads=model["num_key_value_heads"],
        head_dim=model["hidden_size"] // model["num_attention_heads"], num_experts=model["num_experts"],
        num_experts_per_tok=model["num_experts_per_tok"], norm_topk_prob=True, attn_implementation="sdpa",
        tie_word_embeddings=False,
    )


def calibrate(run: dict, counts, regime: Regime, memory_gbps: float) -> dict[str, float]:
    """Device rate, per-exchange overhead and loopback rate from the calibration run (pure EP, flat fabric).
    ``compute_s`` is the time not blocked in collectives; the device rate counts the FLOPs over it less the model's
    time for the per-pair exchange's gathers (their bytes at ``memory_gbps``), which the model adds back to every
    run."""
    from hf_hybrid_ep.planning.step_time import predict_step_time

    per_token = flops_per_token(counts, regime.seq_len)
    gathers = predict_step_time(counts, 1, run["ep"], f"gpus_per_node={run['ep']}",
                                tokens_per_step=run["ep"] * regime.tokens_per_rank, micro_batch=regime.batch_per_rank,
                                seq_len=regime.seq_len, recipe="fp32-adamw", memory_gbps=memory_gbps,
                                dispatcher="torch").exchange_memory_s
    compute_s = run["step_s"] - run["exposed_comm_s_per_step"]
    blocked = run["exposed_comm_by_op_s_per_step"]
    calls = counts.moe_layers * regime.grad_accum  # per step: one counts exchange per layer and micro-batch
    overhead = blocked.get("all_to_all_counts", 0.0) / calls
    data_s = blocked.get("all_to_all", 0.0) - 4 * calls * overhead
    return {"run": run["name"], "fabric": run["fabric"], "compute_s": compute_s, "gathers_s": gathers,
            "flops_per_s": per_token * regime.tokens_per_rank / (compute_s - gathers), "exchange_overhead_s": overhead,
            "intra_gbps": run["a2a_bytes_per_step"] / data_s / 1e9 if data_s > 0 else 100.0}


def predict(run: dict, counts, regime: Regime, calibration: dict, fabric: dict, memory_gbps: float):
    """The step-time model's prediction for one run of this library or DDP (transformers' native EP: ``None``)."""
    from hf_hybrid_ep.planning.step_time import predict_step_time

    if run["engine"] == "hf-native":
        return None
    cfg = run.get("config", {})
    dp, ep = run["dp"], 1 if run["engine"] == "ddp" else run["ep"]
    ranks_per_node = fabric["ranks_per_node"]
    inter = (fabric.get("measured_gbit", 1.0) / 8 / ranks_per_node if fabric["kind"] == "two-node"
             else calibration["intra_gbps"])
    topo = f"gpus_per_node={ranks_per_node},nvlink_gbps={calibration['intra_gbps']:.6g},network_gbps={inter:.6g}"
    return predict_step_time(counts, dp, ep, topo, tokens_per_step=4 * regime.tokens_per_rank,
                             micro_batch=regime.batch_per_rank, seq_len=regime.seq_len,
                             device_flops=calibration["flops_per_s"], efficiency=1.0, memory_gbps=memory_gbps,
                             optimizer_sharding=cfg.get("optimizer_sharding", "none"),
                             dense_sharding=cfg.get("dense_sharding", "replicate"), recipe="fp32-adamw",
                             # a report whose config names no dispatcher ran the plain all-to-all
                             dispatcher=cfg.get("dispatcher", "torch"),
                             exchange_overhead_s=calibration["exchange_overhead_s"])


def validate(runs: list[dict], predictions: dict[str, Any]) -> dict[str, Any]:
    """Prediction error per validation run and the order of every pair of layouts more than 15% apart."""
    rows, checked = [], [r for r in runs if r["feasible"] and predictions.get(r["key"]) is not None
                         and not predictions[r["key"]]["calibration"]]
    for r in checked:
        p = predictions[r["key"]]
        err = (p["samples_per_s"] - r["samples_per_s"]) / r["samples_per_s"]
        rows.append({"run": r["key"], "measured": r["samples_per_s"], "predicted": p["samples_per_s"], "error": err,
                     "within_tolerance": abs(err) <= PREDICTION_TOLERANCE})
    pairs = []
    for a, b in itertools.combinations(checked, 2):
        ma, mb = a["samples_per_s"], b["samples_per_s"]
        if max(ma, mb) / min(ma, mb) <= 1 + ORDER_MARGIN:
            continue
        pa, pb = predictions[a["key"]]["samples_per_s"], predictions[b["key"]]["samples_per_s"]
        pairs.append({"pair": [a["key"], b["key"]], "measured_ratio": ma / mb, "predicted_ratio": pa / pb,
                      "order_ok": (ma > mb) == (pa > pb)})
    return {"rows": rows, "pairs": pairs, "max_abs_error": max((abs(r["error"]) for r in rows), default=math.nan),
            "all_within_tolerance": all(r["within_tolerance"] for r in rows),
            "all_orders_ok": all(p["order_ok"] for p in pairs)}


def evaluate(report: dict[str, Any]) -> dict[str, Any]:
    """Calibration, achieved ratios, a prediction per run and the validation, from a regime report alone
    (so a committed JSON can be checked again by the current model)."""
    from hf_hybrid_ep.planning.planner import count_parameters

    regime = REGIMES[report["regime"]["name"]]
    counts = count_parameters(qwen3_moe_config(regime.model))
    runs = report["runs"]
    for r in runs:
        r["key"] = f"{r['fabric']}/{r['name']}"
    cal_run = next(r for r in runs if r["fabric"] == "flat" and r["name"] == CALIBRATION_RUN)
    calibration = calibrate(cal_run, counts, regime, report["regime"]["memory_gbps"])
    two = report["fabrics"]["two-node"]
    achieved: dict[str, Any] = {"T_over_T_star": t_over_t_star(regime)["T_over_T_star"]}
    ep_run = next((r for r in runs if r["key"] == "two-node/ep4" and r["feasible"]), None)
    if ep_run is not None:
        link_s = ep_run["a2a_inter_node_bytes_per_step"] * two["ranks_per_node"] * 8 / (two["measured_gbit"] * 1e9)
        achieved |= {"r_x": link_s / calibration["compute_s"], "r_x_link_s": link_s}
    for key, target in (("T_over_T_star", regime.target_t_over_t_star), ("r_x", regime.target_r_x)):
        if key in achieved:
            achieved[f"{key}_vs_target"] = achieved[key] / target
            achieved[f"{key}_within_25pct"] = abs(achieved[key] / target - 1) <= 0.25
    predictions = {}
    for r in runs:
        st = predict(r, counts, regime, calibration, report["fabrics"][r["fabric"]], report["regime"]["memory_gbps"])
        if st is not None:
            predictions[r["key"]] = prediction_record(st, calibration_run=r is cal_run)
    ratios = {}
    for suffix in ("", "-dedup"):  # per-pair arms, deduplicated arms
        hybrid, pure = predictions.get(f"two-node/hybrid-dp2-ep2{suffix}"), predictions.get(f"two-node/ep4{suffix}")
        ratios[f"predicted_hybrid_vs_pure_ep{suffix.replace('-', '_')}"] = (
            hybrid["samples_per_s"] / pure["samples_per_s"] if hybrid and pure else None)
    return {"calibration": calibration, "achieved": achieved, "predictions": predictions, **ratios,
            "validation": validate(runs, predictions)}


def prediction_record(st, calibration_run: bool) -> dict[str, Any]:
    keys = ("step_s", "samples_per_s", "compute_s", "a2a_s", "a2a_exposed_s", "grad_reduce_s", "grad_reduce_exposed_s",
            "zero1_gather_s", "fsdp_gather_s", "optimizer_s", "exposed_comm_s")
    out = {k: v for k, v in asdict(st).items() if k in keys}
    # the exchange modelled (the run config's dispatcher) and its bytes per rank and step, all link levels
    out |= {"dispatcher": st.dispatcher, "a2a_bytes": sum(st.a2a_bytes.values()), "calibration": calibration_run}
    return out


def _mib(b: float | None) -> str:
    return "–" if b is None else f"{b / MIB:.1f}"


def _run_row(r: dict[str, Any]) -> str:
    """One two-node run's row of :func:`markdown`."""
    if not r["feasible"]:
        return (f"| {r['name']} | {r['dp']}×{r['ep']} | **{r['status']}** | – | – | "
                f"{_mib(r.get('peak_rss_bytes_per_rank'))} | – | – | – |")
    p = r.get("predicted")
    pred = "outside the model" if p is None else (
        f"{p['samples_per_s']:.2f} ({100 * (p['samples_per_s'] / r['samples_per_s'] - 1):+.0f}%)")
    token = _mib(r["a2a_bytes_per_step"]) + ("" if p is None or "a2a_bytes" not in p else f" ({_mib(p['a2a_bytes'])})")
    state = r["param_bytes_per_rank"] + r["grad_bytes_per_rank"] + r["optimizer_bytes_per_rank"]
    return (f"| {r['name']} | {r['dp']}×{r['ep']} | {r['samples_per_s']:.2f} | {pred} | {_mib(state)} | "
            f"{_mib(r['peak_rss_bytes_per_rank'])} | {token} | {_mib(r['inter_node_bytes_per_step'])} | "
            f"{r['exposed_comm_s_per_step']:.2f} ({r['exposed_comm_fraction']:.2f}) |")


def markdown(report: dict[str, Any]) -> str:
    """The regime's table (two-node runs) with predictions, and the per-pair against the deduplicated exchange
    per layout, for docs/benchmarks.md."""
    reg = report["regime"]
    lines = [f"**{reg['name']}** — {reg['reference']}. Link {reg['link_gbit_chosen']:.3f} Gbit/s (measured "
             f"{report['fabrics']['two-node']['measured_gbit']:.3f}); T/T* {reg['achieved']['T_over_T_star']:.2f} "
             f"(target {reg['targets']['T_over_T_star']}), r_x {reg['achieved'].get('r_x', float('nan')):.3f} "
             f"(target {reg['targets']['r_x']}); memory budget {reg['memory_budget']['budget_bytes'] / MIB:.0f} MiB "
             f"per rank; {report['elapsed_s'] / 60:.1f} min.", "",
             "| run | dp×ep | samples/s | predicted (error) | param+grad+opt MiB/rank | peak RSS MiB/rank | "
             "token exchange MiB/step/rank (predicted) | cross-node wire MiB/step | exposed comm s/step (fraction) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [_run_row(r) for r in report["runs"] if r["fabric"] == "two-node"]
    exchange = reg.get("goals", {}).get("exchange")
    if exchange:
        lines += ["", "| layout | token exchange MiB/step/rank, per-pair → dedup | cross-node part | samples/s | "
                      "exposed comm s/step |", "|---|---|---|---|---|"]
        for layout, e in exchange.items():
            cells = [f"{_mib(v['per_pair'])} → {_mib(v['dedup'])} "
                     + ("(none crosses)" if v["dedup_over_per_pair"] is None else f"({v['dedup_over_per_pair']:.3f}×)")
                     for v in (e["a2a_bytes_per_step"], e["a2a_inter_node_bytes_per_step"])]
            cells += [f"{v['per_pair']:.2f} → {v['dedup']:.2f} ({v['dedup_over_per_pair']:.2f}×)"
                      for v in (e["samples_per_s"], e["exposed_comm_s_per_step"])]
            lines.append(f"| {layout.replace('x', '×')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(reports: list[dict[str, Any]], path: str) -> None:
    """Left: every two-node layout's samples/s over pure EP's, per regime. Right: predicted against measured
    samples/s (each over the regime's pure EP) with the ±25% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(dict.fromkeys(r["name"] for rep in reports for r in rep["runs"] if r["fabric"] == "two-node"))
    width = 0.8 / len(reports)
    for k, rep in enumerate(reports):
        by = {r["name"]: r for r in rep["runs"] if r["fabric"] == "two-node"}
        base = by["ep4"]["samples_per_s"]
        xs = [i + k * width for i in range(len(names))]
        ys = [by[n]["samples_per_s"] / base if n in by and by[n]["feasible"] else 0 for n in names]
        label = f"{rep['regime']['name']} (T/T* {rep['regime']['achieved']['T_over_T_star']:.2g}, " \
                f"r_x {rep['regime']['achieved'].get('r_x', 0):.2g})"
        left.bar(xs, ys, width, label=label)
        for x, n in zip(xs, names, strict=True):
            if n in by and not by[n]["feasible"]:
                left.text(x, 0.02, "OOM", rotation=90, ha="center", va="bottom", fontsize=7)
        pts = [(r["samples_per_s"] / base, r["predicted"]["samples_per_s"] / base)
               for r in by.values() if r["feasible"] and r.get("predicted")]
        right.scatter(*zip(*pts, strict=True), label=rep["regime"]["name"])
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xticks([i + width * (len(reports) - 1) / 2 for i in range(len(names))])
    left.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("samples/s ÷ pure EP (ep4)")
    left.set_title("two-node fabric, world 4", fontsize=10)
    left.legend(fontsize=8)
    lo, hi = 0.0, max(2.2, *(c.get_offsets()[:, :].max() for c in right.collections))
    grid = [lo, hi]
    right.plot(grid, grid, color="grey", linewidth=0.8)
    right.fill_between(grid, [0.75 * g for g in grid], [1.25 * g for g in grid], color="grey", alpha=0.15,
                       label="±25%")
    right.set_xlabel("measured samples/s ÷ pure EP")
    right.set_ylabel("predicted samples/s ÷ pure EP")
    right.set_title("step-time model (calibrated on flat ep4 only)", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Tables (and a chart) of regime reports from bench_training.")
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--chart", default=None)
    cli = parser.parse_args()
    loaded = [json.loads(open(p).read()) for p in cli.reports]
    for rep in loaded:
        print(markdown(rep) + "\n")
    if cli.chart:
        chart(loaded, cli.chart)
