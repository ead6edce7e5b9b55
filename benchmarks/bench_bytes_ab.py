"""Before/after CPU seconds of the engine on source trees, interleaved (issue 9's speed work
on the race tracker and the byte models).

    python benchmarks/bench_bytes_ab.py TREE [TREE ...] [--scenario incident] [--set KEY=VALUE]...
                                        [--duration 3] [--reps 3] [--modes plain profile writes]
                                        [--json OUT]

Each TREE is a directory holding the repository's files (``git archive <commit> | tar -x -C
TREE``, then any files changed).  For every repetition, every tree in turn runs, each in its own
child process with ``PYTHONPATH`` and the working directory at the tree:

* ``plain``: ``PrefillEngine(load_scenario(SCENARIO, ['run.duration_s=D']), keep='report').run()``,
  CPU seconds (``time.process_time``) of the run alone, the child's peak RSS, and the sha256 of its whole
  ``EngineResult`` (every field but ``wall_time_s``, JSON with sorted keys): equal across
  trees when no result changed;
* ``profile``: the same run under ``cProfile``, then ``pstats`` of the top 25 by own time (the
  profile command of the work's brief), CPU seconds (user + system) of the whole child process;
* ``writes`` (only when asked): the plain run with ``Memory.write_units`` timed, with the
  compact model's few-pieces write paths on (as committed) and off (``FEW_PIECES = 0``,
  ``FEW_SEGMENTS`` and ``FEW_EXTENTS`` out of reach: the general paths), CPU seconds of the
  run and of its writes (both memories, the run's and the happens-before-order one).

Repetitions interleave the trees, so a load that changes during the benchmark (a shared
machine) falls on all of them; the table gives best-of-reps and every value, the runs'
requests (corrupted), reads (stale, torn), latent races and the result's sha256 prefix.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.provenance import tree_origin  # noqa: E402

PLAIN = """
import dataclasses, hashlib, json, resource, sys, time
from sim.engine.engine import PrefillEngine
from sim.engine.scenario import load_scenario
e = PrefillEngine(load_scenario({scenario!r}, {sets!r} + ['run.duration_s={duration}']), keep='report')
t = time.process_time()
r = e.run()
cpu = time.process_time() - t
d = dataclasses.asdict(r)
d.pop('wall_time_s')
# NOTE: as benchmarks/engine_cases.py: fields added after the first digests count only when non-zero
for late in ('requests_retracted', 'graph_replays', 'early_sends'):
    if late in d and not d[late]:
        d.pop(late)
sha = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()
print(json.dumps({{"cpu_s": cpu, "requests": r.requests_total, "corrupted": r.requests_corrupted,
                  "reads": r.reads_total, "stale": r.stale_reads, "torn": r.torn_reads,
                  "latent_races": r.latent_races, "sim_time_s": r.sim_time_s, "result_sha256": sha,
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}}))
"""

WRITES = """
import json, time
import sim.bytes.compact as compact
from sim.memory import Memory
from sim.engine.engine import PrefillEngine
from sim.engine.scenario import load_scenario
if {off!r}:
    compact.FEW_PIECES, compact.FEW_SEGMENTS, compact.FEW_EXTENTS = 0, 1 << 62, 0
spent = [0.0, 0]
write_units = Memory.write_units
def timed(self, *a, **k):
    t = time.process_time()
    write_units(self, *a, **k)
    spent[0] += time.process_time() - t
    spent[1] += 1
Memory.write_units = timed
e = PrefillEngine(load_scenario({scenario!r}, {sets!r} + ['run.duration_s={duration}']), keep='report')
t = time.process_time()
r = e.run()
print(json.dumps({{"cpu_s": time.process_time() - t, "write_units_s": spent[0], "calls": spent[1]}}))
"""

PROFILE = """
import cProfile, pstats
from sim.engine.engine import PrefillEngine
from sim.engine.scenario import load_scenario
e = PrefillEngine(load_scenario({scenario!r}, {sets!r} + ['run.duration_s={duration}']), keep='report')
cProfile.run('r = e.run()', {prof!r})
pstats.Stats({prof!r}).sort_stats('tottime').print_stats(25)
"""


def _child(tree: str, code: str) -> tuple[float, str]:
    """Run ``code`` in a child at ``tree``: (its CPU seconds, user + system; its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--scenario", default="incident")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="scenario overrides, as `kvrace run --set`")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["plain", "profile"], choices=["plain", "profile", "writes"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.trees]
    rows = {t: {"plain": [], "profile": [], "writes_on": [], "writes_off": [], "result": None} for t in trees}
    t0 = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for rep in range(args.reps):
        for t in trees:
            if "plain" in args.modes:
                _, out = _child(t, PLAIN.format(scenario=args.scenario, duration=args.duration, sets=args.sets))
                got = json.loads(out.strip().splitlines()[-1])
                rows[t]["plain"].append(round(got.pop("cpu_s"), 2))
                rows[t].setdefault("peak_rss_mib", []).append(got.pop("peak_rss_mib"))
                rows[t]["result"] = rows[t]["result"] or got
                if got != rows[t]["result"]:
                    raise SystemExit(f"{t}: results differ between repetitions: {got} vs {rows[t]['result']}")
            if "profile" in args.modes:
                prof = f"/tmp/bench_bytes_ab_{os.getpid()}.prof"
                cpu, _ = _child(t, PROFILE.format(scenario=args.scenario, duration=args.duration, prof=prof,
                                                  sets=args.sets))
                rows[t]["profile"].append(round(cpu, 2))
            if "writes" in args.modes:
                for off in (False, True):
                    _, out = _child(t, WRITES.format(scenario=args.scenario, duration=args.duration, off=off,
                                                     sets=args.sets))
                    got = json.loads(out.strip().splitlines()[-1])
                    rows[t]["writes_off" if off else "writes_on"].append(
                        [round(got["cpu_s"], 2), round(got["write_units_s"], 2), got["calls"]])
            print(f"rep {rep + 1} {t}: plain {rows[t]['plain'][-1:]} profile {rows[t]['profile'][-1:]}",
                  file=sys.stderr, flush=True)
    print(f"\n{args.scenario} {' '.join(args.sets)}, run.duration_s={args.duration}, best of {args.reps} "
          "(every value), CPU s\n")
    print("| tree | plain run | profile command | peak RSS MiB (plain) | requests (corrupted) | reads (stale, torn) "
          "| latent races | result sha256 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in trees:
        r = rows[t]
        res = r["result"] or {}
        fmt = (lambda v: f"{min(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})" if v else "-")
        rss = r.get("peak_rss_mib")
        print(f"| `{t}` | {fmt(r['plain'])} | {fmt(r['profile'])} | {max(rss) if rss else '-'} | "
              f"{res.get('requests', '-')} ({res.get('corrupted', '-')}) | "
              f"{res.get('reads', '-')} ({res.get('stale', '-')}, {res.get('torn', '-')}) | "
              f"{res.get('latent_races', '-')} | {str(res.get('result_sha256', '-'))[:12]} |")
    if "writes" in args.modes:
        print("\nMemory.write_units with the few-pieces paths on / off: best run CPU s (its writes' CPU s, calls)\n")
        print("| tree | on | off |\n| --- | --- | --- |")
        for t in trees:
            fmt = (lambda v: "{:.2f} ({:.2f}, {:,})".format(*min(v)) if v else "-")
            print(f"| `{t}` | {fmt(rows[t]['writes_on'])} | {fmt(rows[t]['writes_off'])} |")
    if args.json:
        with open(args.json, "w") as f:
            # NOTE: a tree is a directory (a git archive, maybe with files copied in): its
            # TREE_ORIGIN file names it (benchmarks/provenance.py)
            cmd = " ".join(["python benchmarks/bench_bytes_ab.py", *(sys.argv[1:] if argv is None else argv)])
            json.dump({"command": cmd, "tree_origins": {t: tree_origin(t) for t in trees},
                       "scenario": args.scenario, "set": args.sets, "duration_s": args.duration, "reps": args.reps,
                       "started": t0, "machine": platform.platform(), "python": platform.python_version(),
                       "load_avg": os.getloadavg(), "trees": rows}, f, indent=1)


if __name__ == "__main__":
    main()
