"""Wall time of a schedule-level sweep and its scaling with workers (issue 11's target).

    python benchmarks/sweep_scale.py --workers 1 2 [--trials 10000] [--out DIR] [--json PATH]

The sweep is the issue's: the minimal race over 32 points (8 index-K sizes x 4 compute
times, 5 us of launch skew so that some points are a coin toss), ``--trials`` seeded trials
per point, seed 0, profile ``h200``, local backend.  Each worker count runs the whole sweep
in a fresh results folder (nothing resumed).  Reported per worker count: wall seconds, CPU
seconds of this process and its worker processes together (``RUSAGE_SELF`` +
``RUSAGE_CHILDREN``, read after the pool is shut down), trials per wall second, CPU
milliseconds per trial, the machine's 1-minute load average sampled every 5 s during the run
(min and max: the machine is shared, so the load says how much of the wall time was the
sweep's), and whether the rows equal the first worker count's rows (they must: trial seeds
do not depend on the workers).

The target (issue 11): at most 600 s for 32 points x 10,000 trials on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from provenance import git_commit  # noqa: E402  (benchmarks/, the script's own folder)

GRID = {"bytes_per_token": [64, 128, 132, 256, 512, 1024, 2048, 4096], "compute_us": [3.0, 10.0, 20.0, 30.0],
        "launch_jitter_us": [5.0]}
TARGET_S = 600.0
RESULT_KEYS = ("key", "trials", "corrupt_trials", "stale_trials", "torn_trials", "indeterminate_trials",
               "latent_races")


class LoadSampler(threading.Thread):
    """Samples ``os.getloadavg()[0]`` every ``every_s`` seconds until stopped."""

    def __init__(self, every_s: float = 5.0):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.samples = [os.getloadavg()[0]]
        self._halt = threading.Event()

    def run(self):
        while not self._halt.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self):
        self._halt.set()
        self.join()
        self.samples.append(os.getloadavg()[0])


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(workers: int, trials: int, out: str) -> tuple[dict, list[dict]]:
    from sim.sweeps import SweepSpec, run_sweep

    spec = SweepSpec("minimal_race", GRID, trials=trials, seed=0, profile="h200")
    sampler = LoadSampler()
    sampler.start()
    cpu0, t0 = _cpu_s(), time.perf_counter()
    rows = run_sweep(spec, out, workers=workers)
    wall = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0
    sampler.stop()
    n = sum(r["trials"] for r in rows)
    return ({"workers": workers, "points": len(rows), "trials_per_point": trials, "trials": n,
             "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "trials_per_wall_s": round(n / wall, 1),
             "cpu_ms_per_trial": round(1e3 * cpu / n, 3), "load_min": round(min(sampler.samples), 2),
             "load_max": round(max(sampler.samples), 2), "within_target": wall <= TARGET_S},
            [{k: r[k] for k in RESULT_KEYS} for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--trials", type=int, default=10_000, help="trials per point (default 10,000)")
    ap.add_argument("--out", help="keep each run's sweep folder under DIR (default: a temporary folder)")
    ap.add_argument("--json", help="also write the measurements as JSON to this path")
    args = ap.parse_args(argv)
    base = args.out or tempfile.mkdtemp(prefix="sweep_scale_")
    info = {"commit": git_commit(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "grid": GRID, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())}
    print(json.dumps(info), flush=True)
    results, first_rows = [], None
    try:
        for w in args.workers:
            out = os.path.join(base, f"w{w}")
            shutil.rmtree(out, ignore_errors=True)
            res, rows = measure(w, args.trials, out)
            if first_rows is None:
                first_rows = rows
            res["rows_equal_first"] = rows == first_rows
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        if not args.out:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
            f.write("\n")
    print(f"{'workers':>7} {'wall s':>8} {'CPU s':>8} {'trials/s':>9} {'CPU ms/trial':>12} {'load':>10} target")
    for r in results:
        print(f"{r['workers']:>7} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['trials_per_wall_s']:>9.1f} "
              f"{r['cpu_ms_per_trial']:>12.3f} {r['load_min']:>4.1f}-{r['load_max']:<4.1f} "
              f"{'met' if r['within_target'] else 'MISSED'}")
    return 0 if all(r["rows_equal_first"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
