"""Run N fuzzed schedules (tests/fuzz.py mutants of examples/*.json) through
``kvrace schedule validate`` and ``kvrace schedule run --json`` and print counts.

    python benchmarks/fuzz_inputs.py [--inputs 10000] [--start 0] [--jobs NCPU] [--stop-after S]
    python benchmarks/fuzz_inputs.py --seed N --one      # one input, traceback printed in full

A pool of worker processes (one per job, default one per CPU) runs the inputs;
the parent sends each worker only a seed, the worker builds that mutant itself,
writes it to ``<failures-dir>/mutant_<seed>.json`` and runs it with its address
space capped at its size after imports + 2 GiB; the parent kills it when the
input (building included) passes 20 s.  A worker is replaced every
``--max-tasks`` inputs.  Each input's record (seed, mutation kinds, verdict or
failure, wall seconds, build seconds, that input's peak RSS and RSS growth) is
appended to ``--records`` (JSON lines) as it finishes; a line of progress is
printed every ``--progress`` inputs.  At the end: inputs, validated (validate
exit 0) / ran (run exit 0 or 1) / refused (exit 2), tracebacks (MemoryError
among them), over 20 s, over 2 GiB (a MemoryError, or RSS growth above 2 GiB),
other failures, max seconds, max build seconds, max peak RSS; then every
failure with its seed, the command that reproduces it and the file kept for it.
Exit status 1 when any input failed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.fuzz import (  # noqa: E402
    MAX_TASKS, MEM_BUDGET_BYTES, TIME_BUDGET_S, Harness, _cli, build, mutant_path, run_seeds,
)

DEFAULT_DIR = "/tmp/kvrace-fuzz"


def _last_line(o) -> str:
    lines = o.detail.strip().splitlines()
    return lines[-1][:300] if lines else ""


def _repro(o) -> str:
    return f"python benchmarks/fuzz_inputs.py --seed {o.seed} --one"


def _one(a) -> int:
    os.makedirs(a.failures_dir, exist_ok=True)
    data, kinds = build(a.seed)
    path = mutant_path(a.failures_dir, a.seed)
    with open(path, "wb") as f:
        f.write(data)
    print(f"seed {a.seed}: mutations {', '.join(kinds)}; {len(data)} bytes written to {path}")
    print(f"  by hand: kvrace schedule validate {path}; kvrace schedule run --json /tmp/report.json {path}")
    with Harness(time_budget=a.time_budget) as h:
        o = h.check_path(path, a.seed)
    print(f"  validate exit {o.validate_rc}, run exit {o.run_rc}, {o.seconds:.2f} s, "
          f"peak RSS {o.peak_rss_bytes / 2**20:.0f} MiB (growth {o.rss_growth_bytes / 2**20:.0f} MiB)")
    if o.failure:
        print(f"  FAILED: {o.failure}\n{o.detail}")
        return 1
    print(f"  passed ({o.verdict})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=10_000)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--seed", type=int, help="with --one: the seed to run")
    ap.add_argument("--one", action="store_true", help="run only --seed, print its traceback in full")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per CPU)")
    ap.add_argument("--max-tasks", type=int, default=MAX_TASKS, help="inputs per worker before it is replaced")
    ap.add_argument("--time-budget", type=float, default=TIME_BUDGET_S)
    ap.add_argument("--stop-after", type=float, default=float("inf"), metavar="SECONDS",
                    help="start no new input after this many seconds (the counts say how many ran)")
    ap.add_argument("--progress", type=int, default=500, help="a progress line every N inputs")
    ap.add_argument("--failures-dir", default=os.path.join(DEFAULT_DIR, "inputs"),
                    help="where each input is written (kept only when it fails)")
    ap.add_argument("--records", help="JSON lines, one per input (default: DIR/records_START_END.jsonl)")
    a = ap.parse_args(argv)
    if a.one:
        if a.seed is None:
            ap.error("--one needs --seed N")
        return _one(a)
    if a.seed is not None:
        ap.error("--seed goes with --one (use --start for a range)")

    seeds = range(a.start, a.start + a.inputs)
    os.makedirs(a.failures_dir, exist_ok=True)
    records = a.records or os.path.join(DEFAULT_DIR, f"records_{a.start}_{a.start + a.inputs - 1}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(records)), exist_ok=True)
    t0 = time.time()
    done = []
    fails = []
    with open(records, "w") as rec:
        def on_outcome(o):
            done.append(o)
            rec.write(json.dumps(o.record()) + "\n")
            if o.failure:
                fails.append(o)
                rec.flush()
                print(f"FAIL seed {o.seed}: {o.failure}: {_last_line(o)}\n  reproduce: {_repro(o)}"
                      f"\n  input: {o.input_path or '(not written: rebuild it with the command above)'}", flush=True)
            if len(done) % a.progress == 0 or len(done) == len(seeds):
                el = time.time() - t0
                rate = len(done) / el if el else 0.0
                print(f"[fuzz] {len(done)}/{len(seeds)} inputs  {el:.0f} s  {rate:.1f}/s  "
                      f"eta {(len(seeds) - len(done)) / rate if rate else 0:.0f} s  failures {len(fails)}  "
                      f"max {max(x.seconds for x in done):.2f} s  "
                      f"max peak RSS {max(x.peak_rss_bytes for x in done) / 2**20:.0f} MiB", flush=True)

        outs = run_seeds(seeds, a.jobs, time_budget=a.time_budget, max_tasks=a.max_tasks,
                         in_dir=a.failures_dir, on_outcome=on_outcome, stop_at=t0 + a.stop_after)
    wall = time.time() - t0
    tracebacks = [o for o in outs if o.failure and "traceback" in o.failure]
    slow = [o for o in outs if o.timed_out]
    big = [o for o in outs if o.over_memory]
    other = [o for o in outs if o.failure and o not in tracebacks and o not in slow]
    print(f"kvrace fuzz_inputs: seeds {a.start}..{a.start + a.inputs - 1}, {a.jobs} job(s), "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {wall:.0f} s wall")
    import sim
    print(f"cli {_cli().__name__} ({_cli().__file__}), sim from {os.path.dirname(sim.__file__)}")
    print(f"inputs {len(outs)} of {len(seeds)}  validated {sum(o.validate_rc == 0 for o in outs)}  "
          f"ran {sum(o.run_rc in (0, 1) for o in outs)}  refused {sum(o.validate_rc == 2 for o in outs)}")
    print(f"tracebacks {len(tracebacks)}  over {a.time_budget:g} s {len(slow)}  over 2 GiB {len(big)}  "
          f"other failures {len(other)}")
    if outs:
        top_t = max(outs, key=lambda o: o.seconds)
        top_b = max(outs, key=lambda o: o.build_seconds)
        top_m = max(outs, key=lambda o: o.peak_rss_bytes)
        top_g = max(outs, key=lambda o: o.rss_growth_bytes)
        print(f"max time {top_t.seconds:.2f} s (seed {top_t.seed})  max build {top_b.build_seconds:.2f} s "
              f"(seed {top_b.seed})  max peak RSS {top_m.peak_rss_bytes / 2**20:.0f} MiB (seed {top_m.seed})  "
              f"max RSS growth {top_g.rss_growth_bytes / 2**20:.0f} MiB (seed {top_g.seed})  "
              f"per-input RSS exact: {all(o.rss_exact for o in outs if not o.failure)}")
    print(f"records: {records}")
    for o in fails:
        print(f"  seed {o.seed}: {o.failure}: {_last_line(o)}\n    reproduce: {_repro(o)}\n    input: {o.input_path}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
