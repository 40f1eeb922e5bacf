"""The reference deployment of the CTR model, run for real: 128 experts at 16 per rank (dp 1 × ep 8), the
hybrid dp 2 × ep 4 and pure DP (dp 8 × ep 1, every rank holding all experts), side by side in one launch
of 8 processes at the same global batch.

    torchrun --standalone --nproc_per_node 8 deploy.py --out deploy.json

Per layout: the one-step parity against one process (for the two EP layouts), this rank's exact bytes
of parameters, gradients and Adam state (``hep.memory_report``), the token-exchange bytes one rank
sends to other ranks per step (measured by the dispatcher's counters), the gradient bytes the reducer all-reduced per step (measured)
and what a ring all-reduce of them sends per rank (dense gradients over all 8 ranks, a rank's expert
gradients over its dp EDP ranks: ``2 (n − 1) / n · bytes``), and samples/s — not indicative: 8 processes share 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import FEATURES, ClickWorld  # noqa: E402
from model import CTRModel  # noqa: E402
from step_parity import one_step_parity  # noqa: E402

import hf_hybrid_ep as hep  # noqa: E402

LAYOUTS = ((1, 8), (2, 4), (8, 1))


def _ring(nbytes: int, members: int) -> int:
    return 2 * (members - 1) * nbytes // members if members > 1 else 0


def measure(dp: int, ep: int, batch: int, steps: int, warmup: int, lr: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CTRModel("moe")
    hep.parallelize(model, hep.HybridEPConfig(dp_degree=dp, ep_degree=ep))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    per_rank = batch // world
    data = ClickWorld().sample(batch * (steps + warmup), seed=4).with_format("torch")[:]
    expert_ids = {id(p) for layer in hep.state_of(model).layers for p in layer.expert_parameters()}
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in expert_ids)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_ids)

    def step(i: int) -> None:
        lo = i * batch + rank * per_rank
        logits = model(*(data[k][lo : lo + per_rank] for k in FEATURES))
        torch.nn.functional.binary_cross_entropy_with_logits(logits, data["click"][lo : lo + per_rank]).backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(warmup):
        step(i)
    hep.reset_comm_stats(model)
    dist.barrier()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    hep.wait_for_parameters(model)
    dist.barrier()
    elapsed = time.perf_counter() - start
    stats = hep.comm_stats(model)
    reduced = stats.pop("gradient_reduction")
    exchanged = sum(c["remote_bytes_sent"] for layer in stats.values() for phase, c in layer.items() if phase != "shadow")
    mem = hep.memory_report(model, optimizer)
    return {
        "dp": dp, "ep": ep, "rank": rank, "local_experts": len(hep.state_of(model).layers[0].local_experts),
        "parameter_bytes": mem["weight_bytes"], "grad_bytes": mem["grad_bytes"], "optimizer_bytes": mem["optimizer_bytes"],
        "state_bytes": mem["weight_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"],
        "expert_parameter_bytes": expert_bytes, "dense_parameter_bytes": dense_bytes,
        "token_exchange_bytes_per_step": exchanged // steps,
        "grad_allreduced_bytes_per_step": (reduced["dense_bytes"] + reduced["expert_bytes"]) // steps,
        "grad_allreduce_wire_bytes_per_step": (_ring(reduced["dense_bytes"], world) + _ring(reduced["expert_bytes"], dp)) // steps,
        "samples_per_s": steps * batch / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=256, help="global batch (the training runs' batch)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 8:
        raise SystemExit(f"deploy.py runs on 8 processes (dp × ep of 8), not {dist.get_world_size()}")
    out = {"parity": [], "layouts": []}
    for dp, ep in LAYOUTS:
        if ep > 1:
            results = [None] * 8
            dist.all_gather_object(results, one_step_parity(dp, ep))
            out["parity"].append({"dp": dp, "ep": ep, "passed": all(r["passed"] for r in results),
                                  "loss_rel": max(r["loss_rel"] for r in results),
                                  "max_param_rel": max(r["max_param_rel"] for r in results)})
        ranks = [None] * 8
        dist.all_gather_object(ranks, measure(dp, ep, args.batch, args.steps, args.warmup, args.lr))
        out["layouts"].append({"dp": dp, "ep": ep, "ranks": ranks})
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    if not all(p["passed"] for p in out["parity"]):
        raise SystemExit(f"one-step parity failed: {out['parity']}")


if __name__ == "__main__":
    main()
