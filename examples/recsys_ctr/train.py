"""Train one CTR model (MoE on hybrid EP under torchrun, or a dense baseline) and evaluate it.

    torchrun --standalone --nproc_per_node 4 train.py --kind moe --dp 1 --ep 4 --data DIR --out r.json
    python train.py --kind dense_total --data DIR --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_from_disk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import FEATURES  # noqa: E402
from model import CTRModel, parameter_counts  # noqa: E402

import hf_hybrid_ep as hep  # noqa: E402


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum (Mann-Whitney U) statistic, ties averaged."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    ranks = (sums / counts)[inverse]
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    return float(-(labels * np.log(p) + (1 - labels) * np.log(1 - p)).mean())


def predict(model, test: dict, rank: int, world: int, usable: int, per_rank: int, distributed: bool) -> np.ndarray:
    """Click probabilities for the first ``usable`` held-out examples (every rank scores an equal slice:
    the MoE layer's exchange is collective); the whole array on every rank."""
    model.eval()
    lo, hi = rank * usable // world, (rank + 1) * usable // world
    probs = []
    with torch.no_grad():
        for s in range(lo, hi, per_rank):
            e = min(s + per_rank, hi)
            probs.append(torch.sigmoid(model(*(test[k][s:e] for k in FEATURES))))
    local = torch.cat(probs)
    if distributed:
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        local = torch.cat(gathered)
    return local.numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["moe", "dense_active", "dense_total"], required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=None)
    parser.add_argument("--data", required=True)
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--curve-points", type=int, default=12,
                        help="held-out AUC this many times during training (equally spaced in samples)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)
    model = CTRModel(args.kind)
    counts = parameter_counts(model)
    if args.kind == "moe":
        hep.parallelize(model, hep.HybridEPConfig(dp_degree=args.dp, ep_degree=args.ep))
    elif world > 1:
        raise SystemExit("dense baselines run in one process")
    cols = load_from_disk(os.path.join(args.data, "train")).with_format("torch")[:]  # dict of tensors
    test = load_from_disk(os.path.join(args.data, "test")).with_format("torch")[:]
    n_train, n_test = len(cols["click"]), len(test["click"])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    per_rank = args.batch // world
    steps = n_train // args.batch
    usable = n_test // world * world
    labels = test["click"][:usable].numpy()
    total_steps = steps * args.epochs
    marks = {round(total_steps * (i + 1) / args.curve_points) for i in range(args.curve_points)}
    curve, elapsed, done = [], 0.0, 0
    for epoch in range(args.epochs):
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1000 * args.seed + epoch))
        start = time.perf_counter()
        model.train()
        for step in range(steps):
            idx = order[step * args.batch + rank * per_rank : step * args.batch + (rank + 1) * per_rank]
            logits = model(*(cols[k][idx] for k in FEATURES))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, cols["click"][idx])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done in marks:
                elapsed += time.perf_counter() - start
                probs = predict(model, test, rank, world, usable, per_rank, distributed)
                curve.append([done * args.batch, auc(labels, probs) if rank == 0 else None])
                model.train()
                start = time.perf_counter()
        elapsed += time.perf_counter() - start
    # the last curve point is taken after the last step: its probabilities are the final model's
    if rank == 0:
        result = {
            "kind": args.kind, "seed": args.seed, "dp": args.dp, "ep": args.ep, "world": world,
            "auc": auc(labels, probs), "logloss": log_loss(labels, probs), "curve": curve,
            "samples_per_s": total_steps * args.batch / elapsed, "train_examples": n_train,
            "test_examples": usable, "epochs": args.epochs, "batch": args.batch, "lr": args.lr, "parameters": counts,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
