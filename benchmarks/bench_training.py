"""Training throughput side by side: hybrid EP vs pure DP vs pure EP vs transformers' native EP.

The command line of the package ``benchmarks/training/`` (``--help`` describes the benchmark). Rank processes
are started as this module with ``--worker <job.json>``.

    python -m benchmarks.bench_training --quick --json bench_training.json --chart docs/img/bench_training.png
"""

from __future__ import annotations

from benchmarks.training.main import main

if __name__ == "__main__":
    main()
