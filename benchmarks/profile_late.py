"""Profile a late stretch of ``incident`` (cProfile), after running it unprofiled up to there.

    PYTHONPATH=. python benchmarks/profile_late.py WARM_S PROFILE_S [--out FILE]

Runs ``incident`` (``run.duration_s=600``, seed 0, streaming verdicts) without a profiler up to
``WARM_S`` simulated seconds, then under cProfile for ``PROFILE_S`` more, and writes the stats
(``pstats``) to ``--out`` (default ``/tmp/late.prof``).  The early minutes of ``incident`` (load-backs
while the host pool serves prefixes) and the late ones (full 8,192-token chunks, write-through
backups, no load-backs: docs/engine.md "Head of line") cost differently; ``profile_engine.py``
profiles a run from its start.
"""
import argparse
import cProfile
import time

from sim.engine.engine import PrefillEngine
from sim.engine.scenario import load_scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("warm_s", type=float)
    ap.add_argument("profile_s", type=float)
    ap.add_argument("--out", default="/tmp/late.prof")
    args = ap.parse_args()
    e = PrefillEngine(load_scenario("incident", ["run.duration_s=600"]), 0, keep="report")
    e.start()
    t = time.process_time()
    while e.session.now < args.warm_s * 1e6 and e.step():
        pass
    print("warm cpu", round(time.process_time() - t, 1), "sim", e.session.now / 1e6, flush=True)
    pr = cProfile.Profile()
    b0, t = e.counts["batches"], time.process_time()
    pr.enable()
    while e.session.now < (args.warm_s + args.profile_s) * 1e6 and e.step():
        pass
    pr.disable()
    print("profiled cpu", round(time.process_time() - t, 1), "sim", e.session.now / 1e6,
          "batches", e.counts["batches"] - b0, flush=True)
    pr.dump_stats(args.out)


if __name__ == "__main__":
    main()
