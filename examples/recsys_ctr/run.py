"""The CTR experiment end to end: data, the MoE model on hybrid EP (world 4), two dense baselines,
3 seeds each; held-out AUC and log-loss (mean ± std) and samples/s per layout.

    python examples/recsys_ctr/run.py --quick --json ctr.json     # 200k/20k examples, minutes on 2 cores
    python examples/recsys_ctr/run.py --json ctr.json             # 2M/200k examples
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200k training / 20k held-out examples")
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from data import ClickWorld

    n_train, n_test = (200_000, 20_000) if args.quick else (2_000_000, 200_000)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctr-"))
    world = ClickWorld()
    world.sample(n_train, seed=1).save_to_disk(str(work / "data" / "train"))
    test = world.sample(n_test, seed=2)
    test.save_to_disk(str(work / "data" / "test"))
    from train import auc

    oracle = auc(test.with_format("numpy")["click"][:], test.with_format("numpy")["prob"][:])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    results: dict[str, list[dict]] = {"moe": [], "dense_active": [], "dense_total": []}
    layouts = {}
    for seed in range(args.seeds):
        for kind in results:
            out = work / f"{kind}-{seed}.json"
            base = ["train.py", "--kind", kind, "--seed", str(seed), "--data", str(work / "data"), "--out", str(out)]
            if kind == "moe":
                cmd = [*_torchrun(), str(HERE / base[0]), *base[1:], "--dp", "1", "--ep", "4"]
            else:
                cmd = [sys.executable, str(HERE / base[0]), *base[1:]]
            subprocess.run(cmd, check=True, env=env, cwd=HERE)
            results[kind].append(json.loads(out.read_text()))
            print(f"{kind:13s} seed {seed}: AUC {results[kind][-1]['auc']:.4f} log-loss {results[kind][-1]['logloss']:.4f}",
                  flush=True)
    layouts["1x4"] = results["moe"][0]["samples_per_s"]
    out = work / "moe-2x2.json"
    subprocess.run([*_torchrun(), str(HERE / "train.py"), "--kind", "moe", "--seed", "0", "--data", str(work / "data"),
                    "--out", str(out), "--dp", "2", "--ep", "2"], check=True, env=env, cwd=HERE)
    layouts["2x2"] = json.loads(out.read_text())["samples_per_s"]

    def stats(kind: str, key: str) -> tuple[float, float]:
        values = [r[key] for r in results[kind]]
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    summary = {"seeds": args.seeds, "train_examples": n_train, "test_examples": results["moe"][0]["test_examples"],
               "auc_oracle": oracle,
               "layouts": {k: {"samples_per_s": v} for k, v in layouts.items()}}
    for kind in results:
        for key in ("auc", "logloss"):
            mean, std = stats(kind, key)
            summary[f"{key}_{kind}"] = mean
            summary[f"{key}_{kind}_std"] = std
        summary[f"parameters_{kind}"] = results[kind][0]["parameters"]
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"\n{n_train} training / {summary['test_examples']} held-out examples, {args.seeds} seeds")
    print("| model | held-out AUC | log-loss | mixture params (active / total) |")
    print("|---|---|---|---|")
    for kind in results:
        p = summary[f"parameters_{kind}"]
        print(f"| {kind} | {summary[f'auc_{kind}']:.4f} ± {summary[f'auc_{kind}_std']:.4f} | "
              f"{summary[f'logloss_{kind}']:.4f} ± {summary[f'logloss_{kind}_std']:.4f} | "
              f"{p['mixture_active']} / {p['mixture_total']} |")
    print(f"oracle AUC (the generator's true click probabilities): {oracle:.4f}")
    print("samples/s (MoE, world 4, 2 CPU cores): " + ", ".join(f"dp×ep {k}: {v:.0f}" for k, v in layouts.items()))


if __name__ == "__main__":
    main()
