"""The CTR experiment end to end: the world, three models × N seeds, the reference deployment, a plot.

    python examples/recsys_ctr/run.py --quick --json ctr.json --plot docs/img/recsys_ctr_auc.png
    python examples/recsys_ctr/run.py --json ctr.json          # the full run: 2M / 200k examples, 5 seeds

1. Data from the fixed generator (``data.py``), the oracle AUC (the generator's own probabilities) on the
   held-out set.
2. MoE (the library's ``MoE`` layer, 128 experts, top-2) vs dense with the same *active* parameters vs
   dense with the same *total* parameters, each with the same seeds, data order and optimizer; held-out
   AUC and log-loss, and paired differences (per seed) with 95% t-intervals. The models train in one
   process each (``--jobs`` at a time; ``--moe-layout DPxEP`` trains the MoE model on hybrid EP under
   torchrun instead — the same numbers to round-off, much slower on 2 cores).
3. The reference deployment (``deploy.py``, 8 processes): dp 1 × ep 8, dp 2 × ep 4 and pure DP side by side.
4. AUC vs training samples for the three models (mean over seeds) → ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
KINDS = ("moe", "dense_active", "dense_total")
SIZES = {  # training examples, held-out examples, epochs, seeds
    "full": (2_000_000, 200_000, 1, 5), "quick": (200_000, 20_000, 6, 2), "smoke": (16_000, 4_000, 1, 1),
}
# Adam learning rate per model, chosen by `--quick --lr-sweep 1e-2,3e-3,1e-3` on a validation set drawn
# apart from the held-out test set (seed 0; results/lr_sweep.json): the widest dense model diverges at 1e-2.
LR = {"moe": 3e-3, "dense_active": 1e-2, "dense_total": 1e-3}
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)  # two-sided 95%, df 1..10


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of the per-seed differences a − b with a 95% t-interval (df = seeds − 1; normal beyond 10)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean = statistics.mean(d)
    if len(d) < 2:
        return {"mean": mean, "ci_low": math.nan, "ci_high": math.nan}
    half = (T95[len(d) - 2] if len(d) <= 11 else 1.96) * statistics.stdev(d) / math.sqrt(len(d))
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half}


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="200k / 20k examples, 6 epochs, 2 seeds (≤ 10 minutes on 2 cores)")
    size.add_argument("--smoke", action="store_true", help="16k / 4k examples, 1 epoch: a test of the mechanics")
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--plot", default=None, help="AUC vs training samples (PNG)")
    parser.add_argument("--seeds", type=int, default=None, help="default: 5 (full), 2 (--quick), 1 (--smoke)")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at a time (a torchrun MoE run counts as one)")
    parser.add_argument("--moe-layout", default="1x1", help="DPxEP for the MoE model (1x1: one process)")
    parser.add_argument("--no-deployment", action="store_true", help="skip the 8-process deployment run")
    parser.add_argument("--lr-sweep", default=None, metavar="LR,LR,...",
                        help="instead of the comparison: seed 0 of every model at each learning rate, scored on a "
                             "validation set (not the test set)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    dp, ep = (int(x) for x in args.moe_layout.lower().split("x"))
    regime = "quick" if args.quick else "smoke" if args.smoke else "full"
    n_train, n_test, epochs, seeds = SIZES[regime]
    args.seeds = args.seeds or seeds
    if args.seeds < 1 or args.jobs < 1 or dp < 1 or ep < 1:
        parser.error(f"--seeds {args.seeds}, --jobs {args.jobs}, --moe-layout {args.moe_layout}: all must be ≥ 1")
    from data import ClickWorld, generator_hash
    from train import auc

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctr-"))
    started = time.perf_counter()
    world = ClickWorld()
    world.sample(n_train, seed=1).save_to_disk(str(work / "data" / "train"))
    test = world.sample(n_test, seed=5 if args.lr_sweep else 2)  # seed 5: the validation set
    test.save_to_disk(str(work / "data" / "test"))
    cols = test.with_format("numpy")
    oracle = auc(cols["click"][:], cols["prob"][:])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}

    def train(kind: str, seed: int, lr: float | None = None) -> dict:
        out = work / f"{kind}-{seed}-{lr}.json"
        cmd = ["train.py", "--kind", kind, "--seed", str(seed), "--data", str(work / "data"), "--out", str(out),
               "--epochs", str(epochs), "--lr", str(lr or LR[kind])]
        if kind == "moe" and dp * ep > 1:
            cmd = [*_torchrun(dp * ep), *cmd, "--dp", str(dp), "--ep", str(ep)]
        else:
            cmd = [sys.executable, *cmd]
        subprocess.run(cmd, check=True, env=env, cwd=HERE, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        print(f"{kind:13s} seed {seed} lr {result['lr']:g}: AUC {result['auc']:.4f} log-loss {result['logloss']:.4f}",
              flush=True)
        return result

    if args.lr_sweep:
        rates = [float(x) for x in args.lr_sweep.split(",")]
        jobs = [(kind, 0, lr) for kind in KINDS for lr in rates]
        with ThreadPoolExecutor(args.jobs) as pool:
            swept = list(pool.map(lambda j: train(*j), jobs))
        table = {kind: {str(r["lr"]): r["auc"] for r in swept if r["kind"] == kind} for kind in KINDS}
        best = {kind: max(table[kind], key=table[kind].get) for kind in KINDS}
        Path(args.json).write_text(json.dumps({"regime": regime, "split": "validation (seed 5)", "validation_auc": table,
                                               "best_lr": best, "wall_s": time.perf_counter() - started}, indent=1))
        for kind in KINDS:
            print(f"{kind:13s} " + "  ".join(f"lr {lr}: {a:.4f}" for lr, a in table[kind].items()) + f"  → {best[kind]}")
        return

    # longest first (dense-total costs ~3× the MoE model and ~6× dense-active in one process), so that
    # the parallel jobs finish together
    cost = {"dense_total": 0, "moe": 1, "dense_active": 2}
    jobs = sorted(((kind, seed) for seed in range(args.seeds) for kind in KINDS), key=lambda j: (cost[j[0]], j[1]))
    with ThreadPoolExecutor(args.jobs) as pool:  # a torchrun MoE job counts as one (its ranks share the cores)
        done = dict(zip(jobs, pool.map(lambda j: train(*j), jobs), strict=True))
    results = {kind: [done[(kind, s)] for s in range(args.seeds)] for kind in KINDS}
    train_s = time.perf_counter() - started

    summary: dict = {"regime": regime, "generator_sha256": generator_hash(), "seeds": args.seeds,
                     "train_examples": n_train, "test_examples": results["moe"][0]["test_examples"], "epochs": epochs,
                     "batch": results["moe"][0]["batch"], "lr": results["moe"][0]["lr"], "moe_layout": f"{dp}x{ep}",
                     "auc_oracle": oracle}
    for kind in KINDS:
        for key in ("auc", "logloss"):
            values = [r[key] for r in results[kind]]
            summary[f"{key}_{kind}"] = statistics.mean(values)
            summary[f"{key}_{kind}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            summary[f"{key}_{kind}_per_seed"] = values
        summary[f"parameters_{kind}"] = results[kind][0]["parameters"]
        summary[f"curve_{kind}"] = [[c[0], statistics.mean(r["curve"][i][1] for r in results[kind])]
                                    for i, c in enumerate(results[kind][0]["curve"])]
    best = max(KINDS, key=lambda k: summary[f"auc_{k}"])
    summary["best_model"] = best
    summary["best_lift_fraction_of_oracle"] = (summary[f"auc_{best}"] - 0.5) / (oracle - 0.5)
    for other in ("dense_active", "dense_total"):
        summary[f"auc_moe_minus_{other}"] = paired(summary["auc_moe_per_seed"], summary[f"auc_{other}_per_seed"])
    summary["training_wall_s"] = train_s
    if not args.no_deployment:
        out = work / "deploy.json"
        subprocess.run([*_torchrun(8), "deploy.py", "--out", str(out)], check=True, env=env, cwd=HERE,
                       stdout=subprocess.DEVNULL)
        summary["deployment"] = json.loads(out.read_text())
    summary["wall_s"] = time.perf_counter() - started
    Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(summary, args.plot)
    report(summary)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"moe": "MoE, 128 experts, top-2", "dense_active": "dense, same active parameters",
              "dense_total": "dense, same total parameters"}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for kind in KINDS:
        xs, ys = zip(*summary[f"curve_{kind}"], strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, label=labels[kind])
    ax.axhline(summary["auc_oracle"], color="grey", linestyle="--", label="oracle (true probabilities)")
    ax.set_xlabel("training samples seen")
    ax.set_ylabel("held-out AUC")
    ax.set_title(f"CTR world v4: {summary['train_examples']:,} examples, mean of {summary['seeds']} seeds")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def report(s: dict) -> None:
    print(f"\n{s['train_examples']:,} training / {s['test_examples']:,} held-out examples, {s['epochs']} epochs, "
          f"{s['seeds']} seeds; oracle AUC {s['auc_oracle']:.4f}")
    print("| model | held-out AUC (mean ± std) | log-loss | mixture params (active / total) |")
    print("|---|---|---|---|")
    for kind in KINDS:
        p = s[f"parameters_{kind}"]
        print(f"| {kind} | {s[f'auc_{kind}']:.4f} ± {s[f'auc_{kind}_std']:.4f} | "
              f"{s[f'logloss_{kind}']:.4f} ± {s[f'logloss_{kind}_std']:.4f} | "
              f"{p['mixture_active']:,} / {p['mixture_total']:,} |")
    for other in ("dense_active", "dense_total"):
        d = s[f"auc_moe_minus_{other}"]
        print(f"MoE − {other}: {d['mean']:+.4f} AUC (95% CI {d['ci_low']:+.4f} … {d['ci_high']:+.4f}, paired by seed)")
    print(f"best model {s['best_model']}: {100 * s['best_lift_fraction_of_oracle']:.1f}% of the oracle's lift over 0.5")
    if "deployment" in s:
        dep = s["deployment"]
        print("\none-step parity vs one process: " + ", ".join(
            f"dp {p['dp']} × ep {p['ep']}: {'passed' if p['passed'] else 'FAILED'} (max param rel {p['max_param_rel']:.1e})"
            for p in dep["parity"]))
        print("| dp × ep | experts/rank | param bytes/rank | weights+grads+Adam bytes/rank | token exchange B/step/rank "
              "| grad all-reduce B/step/rank (ring) | samples/s (not indicative: 8 processes on 2 cores) |")
        print("|---|---|---|---|---|---|---|")
        for lay in dep["layouts"]:
            r = max(lay["ranks"], key=lambda x: x["state_bytes"])
            print(f"| {lay['dp']} × {lay['ep']} | {r['local_experts']} | {r['parameter_bytes']:,} | {r['state_bytes']:,} | "
                  f"{max(x['token_exchange_bytes_per_step'] for x in lay['ranks']):,} | "
                  f"{r['grad_allreduce_wire_bytes_per_step']:,} | {r['samples_per_s']:.0f} |")
    print(f"wall time {s['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
