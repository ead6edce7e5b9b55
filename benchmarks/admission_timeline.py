"""Where a long run's prefill throughput goes: a timeline of the engine's queue and cache.

    python benchmarks/admission_timeline.py [SCENARIO] [--set key=value]... [--duration S] [--every S]

Runs ``SCENARIO`` (default ``incident``) with ``run.duration_s = S`` (default 200) through the
streaming engine and prints, every ``--every`` simulated seconds (default 10), what the
scheduler saw: requests completed, waiting and ready (arrived), whether a chunked request is in
progress, free / evictable / protected device tokens, and over the last interval the prefill
batches, the tokens they computed, the requests they admitted and the admissions refused
(``OTHER``: chunk or input budget; ``NO_TOKEN``: memory), with the load-backs so far.  This
is how the head-of-line collapse of docs/engine.md was read: with ``fcfs`` the GPUs compute
full chunks back to back while completions fall and load-backs stop.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.engine import engine as E                  # noqa: E402
from sim.engine.scenario import load_scenario       # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", nargs="?", default="incident")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--duration", type=float, default=200.0)
    ap.add_argument("--every", type=float, default=10.0)
    args = ap.parse_args(argv)
    stats = collections.Counter()
    admit, run_batch = E.PrefillEngine._admit, E.PrefillEngine._run_batch

    def counted_admit(self, req, *a, **kw):
        got = admit(self, req, *a, **kw)
        if got is None:
            stats["other"] += 1
        elif got is E._NO_TOKEN:
            stats["no_token"] += 1
        return got

    def counted_run(self, batch):
        stats["batches"] += 1
        stats["tokens"] += sum(a.chunk for a in batch)
        stats["admitted"] += sum(1 for a in batch if a.done == 0)
        return run_batch(self, batch)

    E.PrefillEngine._admit, E.PrefillEngine._run_batch = counted_admit, counted_run
    sc = load_scenario(args.scenario, [*args.sets, f"run.duration_s={args.duration}"])
    eng = E.PrefillEngine(sc, keep="report")
    if eng.overlap_loop:
        raise SystemExit("admission_timeline.py: the overlap loop launches batches through _launch; "
                         "run it with scheduler.event_loop=normal")
    print(f"# {args.scenario} {' '.join(args.sets)} run.duration_s={args.duration}")
    print("| t (sim s) | CPU s | done | waiting | ready | chunked | free | evictable | protected "
          "| batches | tokens | admitted | refused OTHER | refused NO_TOKEN | load-backs |")
    print("| " + " | ".join(["---:"] * 15) + " |")
    eng.start()
    mark, prev, c0 = args.every, collections.Counter(), time.process_time()
    while eng.step():
        s = eng.session
        if s.now / 1e6 < mark:
            continue
        mark += args.every
        d = stats - prev
        prev = stats.copy()
        ready = sum(1 for r in eng.waiting if r.arrival_us <= s.now)
        print(f"| {s.now / 1e6:.2f} | {time.process_time() - c0:.1f} | {len(eng.completed)} | {len(eng.waiting)} "
              f"| {ready} | {'yes' if eng.chunked is not None else 'no'} | {s.allocator.available_size()} "
              f"| {eng.cache.evictable_size()} | {eng.cache.protected_size()} | {d['batches']} | {d['tokens']} "
              f"| {d['admitted']} | {d['other']} | {d['no_token']} | {eng.counts['load_backs']} |", flush=True)
    eng.finish()


if __name__ == "__main__":
    main()
