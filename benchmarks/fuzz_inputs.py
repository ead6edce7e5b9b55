"""Run N fuzzed schedules (tests/fuzz.py mutants of examples/*.json) through
``kvrace schedule validate`` and ``kvrace schedule run --json`` and print counts.

    python benchmarks/fuzz_inputs.py --inputs 10000 [--start 0] [--jobs 2] [--stop-after S]

Each input runs in a worker process (one per job) whose address space is capped
at its size after imports + 2 GiB, with 20 s per input.  Prints: inputs,
validate ok / refused, tracebacks (MemoryError among them), over 20 s, over
2 GiB (a MemoryError, or a worker peak RSS above 2 GiB), other failures
(bad exit code, validate accepting what run refuses), max seconds of one input,
max worker peak RSS; then the first failures with their seeds.
"""
from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.fuzz import MEM_BUDGET_BYTES, TIME_BUDGET_S, Harness  # noqa: E402


def _chunk(args):
    seeds, time_budget, stop_at = args
    out = []
    with Harness(time_budget=time_budget, start_method="spawn") as h:
        for s in seeds:
            if time.time() > stop_at:
                break
            out.append(h.check(s))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes in parallel")
    ap.add_argument("--time-budget", type=float, default=TIME_BUDGET_S)
    ap.add_argument("--stop-after", type=float, default=float("inf"), metavar="SECONDS",
                    help="start no new input after this many seconds (the counts say how many ran)")
    a = ap.parse_args(argv)
    seeds = list(range(a.start, a.start + a.inputs))
    t0 = time.time()
    chunks = [(seeds[i::a.jobs], a.time_budget, t0 + a.stop_after) for i in range(a.jobs)]
    with ThreadPoolExecutor(a.jobs) as pool:      # each thread drives its own worker process
        results = list(pool.map(_chunk, chunks))
    outs = sorted((o for r in results for o in r), key=lambda o: o.seed)
    tracebacks = [o for o in outs if o.failure and "traceback" in o.failure]
    slow = [o for o in outs if o.timed_out]
    big = [o for o in outs if o.memory_error or o.peak_rss_bytes > MEM_BUDGET_BYTES]
    other = [o for o in outs if o.failure and o not in tracebacks and o not in slow]
    print(f"kvrace fuzz_inputs: seeds {a.start}..{a.start + a.inputs - 1}, {a.jobs} job(s), "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {time.time() - t0:.0f} s wall")
    print(f"inputs {len(outs)} of {len(seeds)}  validate ok {sum(o.validate_rc == 0 for o in outs)}  "
          f"refused {sum(o.validate_rc == 2 for o in outs)}")
    print(f"tracebacks {len(tracebacks)}  over {a.time_budget:g} s {len(slow)}  over 2 GiB {len(big)}  "
          f"other failures {len(other)}")
    print(f"max time {max(o.seconds for o in outs):.2f} s (seed {max(outs, key=lambda o: o.seconds).seed})  "
          f"max worker RSS {max(o.peak_rss_bytes for o in outs) / 2**20:.0f} MiB")
    for o in [o for o in outs if o.failure][:10]:
        print(f"  seed {o.seed}: {o.failure}: {o.detail.strip().splitlines()[-1][:200] if o.detail.strip() else ''}")
    return 1 if any(o.failure for o in outs) else 0


if __name__ == "__main__":
    sys.exit(main())
