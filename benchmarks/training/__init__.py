"""The training-throughput harness behind ``python -m benchmarks.bench_training`` (and ``bench_dedup``),
by job:

* ``runs``: what is trained: layouts (``RunSpec``, ``default_runs``), the model (``ModelArgs``), step settings;
* ``fabric``: the emulated fabrics (flat loopback; two network namespaces joined by a shaped veth);
* ``launch``: one run from outside: a process per rank, waited for, killed on failure or timeout;
* ``worker``: one rank inside its process: build, train, measure, write its record;
* ``meters``: what a rank measures: memory, interface bytes, collective bytes and blocked time, routing;
* ``merge``: the per-rank records → the run's record;
* ``goals``: the parameter-bytes check and the measured goals over the runs;
* ``report``: the report's skeleton, its table, chart and JSON file;
* ``session``: clean start, scratch checkpoint, each run recorded and logged;
* ``regimes``: the named regimes (model shape, workload, memory budget, link rate) and the step-time model
  checked against them (``python -m benchmarks.training.regimes REPORT…`` prints their tables and chart);
* ``regime_run``: ``--regime`` / ``--reevaluate``: one named regime end to end;
* ``main``: the command line (its docstring is the benchmark's ``--help``).
"""
