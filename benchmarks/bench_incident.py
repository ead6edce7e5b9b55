"""CPU seconds of the streaming engine on the ``incident`` scenario (issue 9's speed target).

    PYTHONPATH=<tree> python benchmarks/bench_incident.py [DURATION_S] [--repeat N] [--set key=value]...
        [--eager-views] [--signature PATH]

Runs ``incident`` with ``run.duration_s=DURATION_S`` (default 5) through ``PrefillEngine``
(``keep="report"``) ``N`` times (default 1) in this process and prints, per run, the CPU seconds
of ``run()`` (``time.process_time``: on a shared machine the wall clock grows with the other
processes' load) and the result's counts (requests, corrupted, reads, stale, torn: equal
before and after a speed change), then the best of the runs.  ``PYTHONPATH`` picks the tree
whose ``sim`` is measured (a script's own folder, not the cwd, is first on ``sys.path``), so
two trees are compared by alternating this command between them.  ``--eager-views`` slices every
read's views at its capture (``Executor.LAZY_VIEWS = False``: what lazy views save, in one tree).
``--signature PATH`` writes the last run's ``EngineResult.signature()`` (every field but the wall
time) as JSON, to compare two trees' results.
"""
from __future__ import annotations

import argparse
import json
import resource
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("duration", nargs="?", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--eager-views", action="store_true")
    ap.add_argument("--signature", default=None)
    a = ap.parse_args(argv)
    import sim
    from sim.executor import Executor

    if a.eager_views:
        Executor.LAZY_VIEWS = False
    from sim.engine.engine import PrefillEngine
    from sim.engine.scenario import load_scenario

    print(f"sim from {sim.__file__}")
    best = None
    for _ in range(a.repeat):
        e = PrefillEngine(load_scenario("incident", [*a.set, f"run.duration_s={a.duration}"]), keep="report")
        t = time.process_time()
        r = e.run()
        c = time.process_time() - t
        best = c if best is None else min(best, c)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"cpu {c:.2f} s  sim {r.sim_time_s:.3f} s  requests {r.requests_total}  corrupted "
              f"{r.requests_corrupted}  reads {r.reads_total}  stale {r.stale_reads}  torn {r.torn_reads}  "
              f"maxrss {rss:.0f} MiB")
    print(f"best cpu {best:.2f} s of {a.repeat}")
    if a.signature:
        with open(a.signature, "w") as f:
            json.dump(r.signature(), f, sort_keys=True, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
