"""Benchmarks of hf_hybrid_ep: one ``bench_*`` module per question, run from the repository root as a module.

    python -m benchmarks.bench_dispatch --help
    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_engine_step

Shared code lives in subpackages: ``common`` (the demo's model and data, kernel inputs and CUDA timing) and
``training`` (the training-throughput harness behind ``bench_training`` and ``bench_dedup``).
``benchmarks/README.md`` lists every script; ``docs/benchmarks.md`` holds the figures and their commands.
"""
