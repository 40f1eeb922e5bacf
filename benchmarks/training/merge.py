"""Per-rank records of one run → the run's record: throughput (median step of the slowest rank), bytes per rank
(max over ranks), collective and wire bytes per step (mean over ranks, or summed over node leads), exposed
communication, and for a failed run the failing rank's error."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from .fabric import Fabric
from .meters import PREDICTED_ROWS
from .runs import RunSpec, StepArgs

# fields of a measured run that a failed one records as None
UNMEASURED = ("samples_per_s", "tokens_per_s", "comm_fraction", "a2a_bytes_per_step", "allreduce_bytes_per_step",
              "inter_node_bytes_per_step", "exposed_comm_fraction", "exposed_comm_s_per_step")


def merge(spec: RunSpec, fabric: Fabric, ranks: list[dict], step: StepArgs) -> dict:
    """Per-rank records → one run record (the fields of the report's table, plus their breakdowns)."""
    ok = all(r.get("status") == "ok" for r in ranks)
    oom = [r for r in ranks if r.get("status") == "out_of_memory"]
    rec: dict[str, Any] = {
        "name": spec.name, "fabric": fabric.name, "engine": spec.engine, "dp": spec.dp, "ep": spec.ep,
        "config": spec.config, "feasible": ok, "mem_limited": spec.mem_limit,
        "status": "ok" if ok else ("out_of_memory" if oom else "error"),
        "mem_limit_bytes": (ranks[0].get("mem_limit_bytes") if ranks else None) if spec.mem_limit else None,
    }
    if not ok:
        return rec | _failure(ranks, oom)
    rec |= _measured(ranks, fabric, step)
    if ranks[0].get("engine_counters"):  # every rank's token-exchange rows and bytes by phase, summed
        phases = [r["engine_counters"]["phases_per_step"] for r in ranks]
        rec["phases_per_step_all_ranks"] = {p: {k: sum(x[p][k] for x in phases) for k in phases[0][p]}
                                            for p in phases[0]}
    if all("routing" in r for r in ranks):
        steps = len(ranks[0]["step_times"])
        rec["routing"] = {"predicted_rows_per_step": {key: sum(r["routing"]["predicted_rows"][key] for r in ranks) / steps
                                                      for key in PREDICTED_ROWS},
                          "trace_files": [r["routing"]["trace_file"] for r in ranks],
                          "tables": ranks[0]["routing"]["tables"]}
    return rec


def _failure(ranks: list[dict], oom: list[dict]) -> dict[str, Any]:
    """A failed run's fields: the first out-of-memory (else failing) rank's error, traceback tail and phase, the
    measured fields as None, and the parameter bytes and peak RSS of the ranks that got that far."""
    bad = oom[0] if oom else next(r for r in ranks if r.get("status") != "ok")
    rec: dict[str, Any] = {"error": f"rank {bad.get('rank')}: {bad.get('error')}",
                           "traceback_tail": (bad.get("traceback") or "")[-1500:], "failed_phase": bad.get("phase")}
    rec |= dict.fromkeys(UNMEASURED)
    known = [r for r in ranks if "param_bytes" in r]
    rec["param_bytes_per_rank"] = max(r["param_bytes"] for r in known) if known else None
    rss = [r.get("peak_rss_bytes") for r in ranks if r.get("peak_rss_bytes")]
    rec["peak_rss_bytes_per_rank"] = max(rss) if rss else None
    return rec


def _wire_bytes(ranks: list[dict]) -> tuple[dict[str, int], bool]:
    """Interface bytes over the timed steps by kind (``intra`` / ``inter``), summed over the node leads (the
    ranks that read the counters), and whether any rank read them."""
    node_leads = [r for r in ranks if r.get("counters")]
    wire: dict[str, int] = defaultdict(int)
    for r in node_leads:
        for kind, value in r["counters"].items():
            wire[kind] += value
    return wire, bool(node_leads)


def _measured(ranks: list[dict], fabric: Fabric, step: StepArgs) -> dict[str, Any]:
    """A feasible run's figures: per second, per rank (max), per step (mean over ranks unless said)."""
    step_s = statistics.median(max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"])))
    samples = len(ranks) * step.batch_per_rank * step.grad_accum  # every rank reads its own micro-batches
    mean = lambda key: sum(r[key] for r in ranks) / len(ranks)  # noqa: E731
    wire, counted = _wire_bytes(ranks)
    steps = len(ranks[0]["step_times"])
    inter = wire.get("inter") if fabric.name == "two-node" else 0
    return {
        "samples_per_s": samples / step_s, "tokens_per_s": samples * step.seq_len / step_s, "step_s": step_s,
        "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
        "grad_bytes_per_rank": max(r["grad_bytes"] for r in ranks),
        "optimizer_bytes_per_rank": max(r["optimizer_bytes"] for r in ranks),
        "param_bytes_each_rank": [r["param_bytes"] for r in ranks],
        "peak_rss_bytes_per_rank": max(r["peak_rss_bytes"] for r in ranks),
        "peak_rss_bytes_each_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_data_bytes_above_setup_per_rank": max(r["peak_data_above_setup"] for r in ranks),
        "rss_bytes_at_setup": max(r["rss_at_setup"] for r in ranks),
        "a2a_bytes_per_step": round(mean("a2a_remote_bytes") / steps),
        "a2a_intra_node_bytes_per_step": round(mean("a2a_intra_bytes") / steps),
        "a2a_inter_node_bytes_per_step": round(mean("a2a_inter_bytes") / steps),
        "allreduce_bytes_per_step": round(mean("reduce_bytes") / steps),
        "collective_bytes_by_op_per_step": {k: round(sum(r["bytes_by_op"].get(k, 0) for r in ranks) / len(ranks) / steps)
                                            for k in sorted({k for r in ranks for k in r["bytes_by_op"]})},
        "inter_node_bytes_per_step": round(inter / steps) if inter is not None else None,
        "intra_node_wire_bytes_per_step": round(wire["intra"] / steps) if counted else None,
        # cross-node wire bytes not explained by token rows: gradient / parameter collectives, counts, framing
        "inter_node_non_a2a_wire_bytes_per_step": (round((inter - sum(r["a2a_inter_bytes"] for r in ranks)) / steps)
                                                   if inter is not None else None),
        "comm_fraction": max(r["comm_fraction"] for r in ranks),
        # exposed communication: the training thread blocked in collectives or Work.wait(), per step, over the
        # step time of the slowest rank (the worst rank's figure)
        "exposed_comm_s_per_step": max(r["blocked_s"] for r in ranks) / steps,
        "exposed_comm_fraction": max(r["blocked_s"] for r in ranks) / steps / step_s,
        "exposed_comm_by_op_s_per_step": {k: round(max(r["blocked_by_op"].get(k, 0.0) for r in ranks) / steps, 4)
                                          for k in sorted({k for r in ranks for k in r["blocked_by_op"]})},
        "backward_after_first_bucket_s": (statistics.median(r["engine_counters"]["ready_to_end_s_per_step"]
                                                            for r in ranks) if ranks[0].get("engine_counters") else None),
        "comm_seconds_by_op": ranks[0]["comm_seconds_by_op"],
        "profiled_step_s": ranks[0]["profiled_step_s"],
        "profile_top_ops": ranks[0]["profile_top_ops"],
        "engine_counters": ranks[0].get("engine_counters"),
        "notes": sorted({n for r in ranks for n in r.get("notes", [])}),
    }
