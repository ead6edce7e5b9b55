"""CPU cost of the byte-level decode side (``hicache.decode = true``, PD) against the decode side in
simulated time (``hicache.decode = false``), on the same scenario and seed.

    python benchmarks/bench_decode_hicache.py [--repeat N] [--set key=value]...

Runs ``glm5-22811-small`` in PD (prefill TP4 / decode TP4, 2 layers; ``--set`` adds or
overrides keys) both ways, ``--repeat`` times each, back to back, and prints the best
``time.process_time`` of each with the run's requests and the decode side's steps and reads.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from sim.engine.engine import run_prefill_engine  # noqa: E402

BASE = ["deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4", "run.layers=2"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args(argv)
    for flag in ("false", "true"):
        best, r = float("inf"), None
        for _ in range(a.repeat):
            t0 = time.process_time()
            r = run_prefill_engine("glm5-22811-small", overrides=[*BASE, *a.sets, f"hicache.decode={flag}"])
            best = min(best, time.process_time() - t0)
        dec = r.decode or {}
        print(f"hicache.decode={flag:5}  best of {a.repeat}: {best:6.2f} CPU s  requests {r.requests_total}  "
              f"decode steps {dec.get('steps', '-')}  decode reads {dec.get('reads_total', '-')}")


if __name__ == "__main__":
    main()
