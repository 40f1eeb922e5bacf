"""Training throughput side by side: hybrid EP vs pure DP vs pure EP vs transformers' native EP.

The command line and the names other scripts import (``import bench_training as bt``); the benchmark itself is
the package ``benchmarks/training/`` (``--help`` describes it). Rank processes are started as this script with
``--worker <job.json>``.

    python benchmarks/bench_training.py --quick --json bench_training.json --chart docs/img/bench_training.png
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ``training`` and ``regimes``
from training.fabric import PREFIX, Fabric, FlatFabric, TwoNodeFabric, remove_stale_namespaces  # noqa: E402
from training.goals import check_param_formula, goals, overlap_goals  # noqa: E402
from training.launch import run_layout  # noqa: E402
from training.main import build_parser, main  # noqa: E402
from training.merge import merge  # noqa: E402
from training.meters import CollectiveMeter  # noqa: E402
from training.regime import memory_rate_gbps, regime_results, run_regime  # noqa: E402
from training.report import chart, machine_info, table, write_json  # noqa: E402
from training.runs import (  # noqa: E402
    AUTO_BUDGET_REPLICAS,
    OPTIMIZER,
    ModelArgs,
    RunSpec,
    StepArgs,
    default_runs,
    model_bytes,
    save_checkpoint,
)
from training.session import clean_start, run_logged, scratch_checkpoint  # noqa: E402
from training.worker import worker  # noqa: E402

__all__ = [
    "AUTO_BUDGET_REPLICAS", "OPTIMIZER", "PREFIX", "CollectiveMeter", "Fabric", "FlatFabric", "ModelArgs", "RunSpec",
    "StepArgs", "TwoNodeFabric", "build_parser", "chart", "check_param_formula", "clean_start", "default_runs",
    "goals", "machine_info", "main", "memory_rate_gbps", "merge", "model_bytes", "overlap_goals", "regime_results",
    "remove_stale_namespaces", "run_layout", "run_logged", "run_regime", "save_checkpoint", "scratch_checkpoint", "table", "worker",
    "write_json",
]

if __name__ == "__main__":
    main()
