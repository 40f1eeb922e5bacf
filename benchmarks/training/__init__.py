"""The training-throughput benchmark (``python benchmarks/bench_training.py``), by job:

* ``runs``: what is trained: layouts (``RunSpec``, ``default_runs``), the model (``ModelArgs``), step settings;
* ``fabric``: the emulated fabrics (flat loopback; two network namespaces joined by a shaped veth);
* ``launch``: one run from outside: a process per rank, waited for, killed on failure or timeout;
* ``worker``: one rank inside its process: build, train, measure, write its record;
* ``meters``: what a rank measures: memory, interface bytes, collective bytes and blocked time, routing;
* ``merge``: the per-rank records → the run's record;
* ``goals``: the parameter-bytes check and the measured goals over the runs;
* ``report``: the report's skeleton, its table, chart and JSON file;
* ``session``: clean start, scratch checkpoint, each run recorded and logged;
* ``regime``: ``--regime`` / ``--reevaluate`` (a named regime of ``benchmarks/regimes.py``);
* ``main``: the command line (its docstring is the benchmark's ``--help``).

Imported as the top-level package ``training`` with ``benchmarks/`` on ``sys.path`` (``bench_training.py`` puts it
there), so that its modules also find ``regimes``.
"""
