"""CPU seconds inside the engine parts that lazy read views and forward planning changed.

    PYTHONPATH=<tree> python benchmarks/bench_engine_parts.py [DURATION_S] [--repeat N] [--scenario NAME]

Runs ``SCENARIO`` (default ``incident``) with ``run.duration_s=DURATION_S`` (default 5) through
``PrefillEngine`` (``keep="report"``) ``N`` times (default 3) with a CPU timer
(``time.process_time``) around each call of:

* ``Executor._capture``: a read's capture, everything under it (its views, the online verdict,
  the engine's read sink and KV oracle);
* ``sim.engine.forward._plan``: a forward's plan (reads' extents, costs and keyed jitter);
* ``DecodeStepModel.nominal_us``: a decode step's roofline duration (its cache included);

and prints, per part, the best of the runs' totals, and the whole run's CPU seconds (best of
the runs).  The parts are timed wherever the tree has them, so the same command compares two
trees (``PYTHONPATH`` picks the tree: a script's own folder, not the cwd, comes first on
``sys.path``); a part's total is far less noisy on a shared machine than the whole run's.
The timer adds about a microsecond per call (a few thousand calls a run).
"""
from __future__ import annotations

import argparse
import time


def _timed(owner, name: str, totals: dict, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kw):
        t = time.process_time()
        try:
            return fn(*args, **kw)
        finally:
            totals[label] += time.process_time() - t

    setattr(owner, name, wrapper)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("duration", nargs="?", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scenario", default="incident")
    a = ap.parse_args(argv)
    import sim
    import sim.engine.forward as forward
    from sim.engine.decode import DecodeStepModel
    from sim.engine.engine import PrefillEngine
    from sim.engine.scenario import load_scenario
    from sim.executor import Executor

    parts = ("read capture (Executor._capture)", "forward plan (forward._plan)",
             "decode step cost (DecodeStepModel.nominal_us)")
    totals = dict.fromkeys(parts, 0.0)
    _timed(Executor, "_capture", totals, parts[0])
    _timed(forward, "_plan", totals, parts[1])
    _timed(DecodeStepModel, "nominal_us", totals, parts[2])
    print(f"sim from {sim.__file__}")
    best: dict = {}
    for _ in range(a.repeat):
        for k in totals:
            totals[k] = 0.0
        e = PrefillEngine(load_scenario(a.scenario, [f"run.duration_s={a.duration}"]), keep="report")
        t = time.process_time()
        r = e.run()
        run_s = time.process_time() - t
        for k, v in [*totals.items(), ("whole run", run_s)]:
            best[k] = min(best.get(k, v), v)
        print(f"run: cpu {run_s:.2f} s, requests {r.requests_total}, corrupted {r.requests_corrupted}, "
              + ", ".join(f"{k.split(' (')[0]} {v:.3f} s" for k, v in totals.items()))
    for k, v in best.items():
        print(f"best of {a.repeat}: {k:50s} {v:7.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
