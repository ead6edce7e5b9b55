"""The engine at scale: wall time and peak memory of `kvrace run` on a scenario, one core.

    python benchmarks/bench_engine.py [SCENARIO] [--set key=value]... [--durations 1 3 10]
                                      [--keep report|all] [--sample-every N] [--json OUT]

Runs ``SCENARIO`` (default ``incident-short``) once per simulated duration, each in a fresh
child process (so peak RSS is that run's), and prints per run: simulated seconds, wall and
CPU seconds (simulation and verdicts; CPU time is what a shared machine cannot inflate), the
ratio of simulated time to CPU time, peak RSS, requests, ops issued, and the corrupted
requests.  ``--keep report`` (default) is the streaming engine ``kvrace run`` uses;
``--keep all`` keeps the whole run and judges it at the end (the engine's path before
streaming, and what ``--export-races`` / ``--trace`` still use).  ``--sample-every N``: every
N batches, the resident set (``/proc/self/statm``), the peak, the provenance segments of the
memory the run holds (``CacheSession.memory_held``: the reference while the run's is deferred), the origins and the KV oracle's content keys (the row's ``samples``).  Issue 9's target is 10 simulated minutes of
``incident`` in at most 60 s and 2 GiB on one core.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run_sampled(e, every: int) -> tuple:
    """``e.run()``, sampling memory every ``every`` batches (see the module doc)."""
    samples, last = [], -1
    e.start()
    while e.step():
        b = e.counts["batches"]
        if b % every == 0 and b != last:
            last = b
            mem = e.session.memory_held         # NOTE: .memory would end the run's deferred memory
            samples.append({"batches": b, "sim_s": e.session.now / 1e6, "rss_mib": _rss_mib(),
                            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                            "segments": sum(c.segment_count() for c in mem.compact.values()),
                            "origins": len(mem.table), "oracle_content": len(e.oracle.content)})
    return e.finish(), samples


def _one(scenario: str, sets: list[str], duration: float, keep: str, every: int, q) -> None:
    from sim.engine.engine import PrefillEngine
    from sim.engine.scenario import load_scenario

    t0 = time.perf_counter()
    c0 = time.process_time()
    e = PrefillEngine(load_scenario(scenario, [*sets, f"run.duration_s={duration}"]), keep=keep)
    r, samples = _run_sampled(e, every) if every else (e.run(), [])
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    q.put({"scenario": scenario, "set": sets, "keep": keep, "duration_s": duration, "sim_time_s": r.sim_time_s,
           "wall_s": wall, "cpu_s": cpu, "sim_per_wall": r.sim_time_s / wall, "sim_per_cpu": r.sim_time_s / cpu,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "ops": e.session.finish().n_ops, "requests": r.requests_total, "batches": r.batches,
           "forwards_one_step": r.forwards_one_step, "reads": r.reads_total, "samples": samples,
           "requests_corrupted": r.requests_corrupted, "load_backs": r.load_backs, "layers": r.layers,
           # the KV oracle: entries x pool layers judged, and those looked up in the bytes (the
           # incremental oracle's; absent in trees before it)
           "oracle_entries": r.oracle_entries, "oracle_sampled": getattr(e.oracle, "entries_sampled", None),
           "signature": r.signature()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default="incident-short")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--durations", type=float, nargs="+", default=[1.0, 3.0, 10.0])
    ap.add_argument("--keep", choices=["report", "all"], default="report")
    ap.add_argument("--sample-every", type=int, default=0, metavar="N")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.1f}")
    for d in a.durations:
        q = ctx.Queue()
        p = ctx.Process(target=_one, args=(a.scenario, a.set, d, a.keep, a.sample_every, q))
        p.start()
        row = q.get()
        p.join()
        rows.append(row)
        print(f"{a.scenario} {' '.join(a.set)} keep={a.keep} sim {row['sim_time_s']:.2f} s: wall {row['wall_s']:.1f} s, "
              f"CPU {row['cpu_s']:.1f} s ({row['sim_per_cpu']:.3f} x real time per CPU s), peak RSS {row['peak_rss_mib']:.0f} MiB, "
              f"{row['ops']} ops, {row['requests']} requests ({row['requests_corrupted']} corrupted), "
              f"{row['load_backs']} load-backs, oracle {row['oracle_entries']} entries "
              f"({row['oracle_sampled']} looked up)", flush=True)
    if a.json:
        from provenance import command, git_commit     # benchmarks/, the script's own folder

        doc = {"command": command(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
               "load_average": os.getloadavg(), "rows": rows}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
