"""Latent-race detection benchmark: ``sim.hb.race_scan`` at about 100k accesses.

    python benchmarks/bench_races.py [--quick] [--shapes NAME ...]

Each shape is a generated, validated schedule (validation is not timed; the
script lifts ``sim.schedule.MAX_OPS`` to 131,072 for them).  For
each: the accesses and their intervals, the time to build ``HappensBefore``
(vector clocks) and the time of ``race_scan(s, hb, limit=1000)`` (best of
``--reps``), the racing pairs counted and listed, and the peak of Python
allocations (``tracemalloc``, numpy's arrays included) during one more
``HappensBefore`` + ``race_scan``, measured in a separate run so that tracing
does not slow the timed ones.

Shapes (seeded):

* ``streams_one_buffer``: 256 streams x 400 ops on one device buffer of 4,096
  units of 64 B; each op writes (4/5) or reads (1/5) 1-4 random units; every 50
  ops a stream records an event that the next stream waits on.
* ``few_streams_many_ops``: 4 streams x 25,600 ops on a buffer of 65,536 units,
  1-8 consecutive units each (9/10 writes, 1/10 reads: all reads together may
  touch at most 65,536 extents), a cross-stream record/wait every 100 ops.
* ``large_interval_sets``: 1,000 host-to-device copies on 8 streams (2,000
  accesses, two buffers), each of 2,000 random scattered units (about 1,900
  merged intervals per access; 3.8 M intervals in all).
* ``same_bytes_writers``: 1,024 streams x 50 writes of the same 2 units (the
  quadratic case: every cross-stream pair races; 51,200 accesses, 1.3 G pairs).
* ``one_op_streams_500``: 500 streams, one write each of the same 2 units (the
  case that took 22.5 s and 1.3 GB with the all-pairs scan).
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sim.schedule  # noqa: E402
from sim.hb import HappensBefore, accesses, race_scan  # noqa: E402
from sim.schedule import validate  # noqa: E402

#: the generated schedules have up to ~107k ops; the schedule format's own op limit (which
#: bounds simulation work, not race detection) is lifted for them here
sim.schedule.MAX_OPS = max(sim.schedule.MAX_OPS, 1 << 17)


def _dev(name, units, unit_bytes=64, kind="kv"):
    return {"name": name, "location": "device", "kind": kind,
            "layout": {"kind": "paged", "layers": 1, "pages": units, "page_bytes": unit_bytes}}


def _host(name, units, unit_bytes=64):
    return {"name": name, "location": "host", "kind": "kv",
            "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": units,
                       "unit_bytes": unit_bytes}}


def _doc(name, buffers, streams, events, ops):
    return {"kvrace_schedule": 1, "name": name, "buffers": buffers, "streams": streams,
            "events": events, "ops": ops}


def streams_one_buffer(n_streams=256, per_stream=400, units=4096, seed=1):
    rng = np.random.default_rng(seed)
    streams = [f"s{i}" for i in range(n_streams)]
    ops, events = [], []
    for k in range(per_stream):
        for i, st in enumerate(streams):
            n = int(rng.integers(1, 5))
            u = sorted(set(rng.integers(0, units, n).tolist()))
            kind = "read" if rng.random() < 1 / 5 else "write"
            op = {"id": f"o{k}_{i}", "op": kind, "stream": st, "buffer": "D", "layer": 0, "units": u}
            ops.append(op)
            if k % 50 == 49:
                ev = f"e{k}_{i}"
                events.append(ev)
                ops.append({"op": "record", "stream": st, "event": ev})
                ops.append({"op": "wait", "stream": streams[(i + 1) % n_streams], "event": ev})
    return _doc("streams_one_buffer", [_dev("D", units)], streams, events, ops)


def few_streams_many_ops(n_streams=4, per_stream=25600, units=65536, seed=2):
    rng = np.random.default_rng(seed)
    streams = [f"s{i}" for i in range(n_streams)]
    ops, events = [], []
    for k in range(per_stream):
        for i, st in enumerate(streams):
            n = int(rng.integers(1, 9))
            start = int(rng.integers(0, units - n))
            kind = "read" if rng.random() < 1 / 10 else "write"
            ops.append({"id": f"o{k}_{i}", "op": kind, "stream": st, "buffer": "D", "layer": 0,
                        "units": {"start": start, "count": n}})
            if k % 100 == 99:
                ev = f"e{k}_{i}"
                events.append(ev)
                ops.append({"op": "record", "stream": st, "event": ev})
                ops.append({"op": "wait", "stream": streams[(i + 1) % n_streams], "event": ev})
    return _doc("few_streams_many_ops", [_dev("D", units)], streams, events, ops)


def large_interval_sets(n_copies=1000, per_copy=2000, units=100_000, n_streams=8, seed=3):
    rng = np.random.default_rng(seed)
    streams = [f"s{i}" for i in range(n_streams)]
    ops = []
    for k in range(n_copies):
        dst = np.sort(rng.choice(units, per_copy, replace=False)).tolist()
        src = rng.choice(units, per_copy, replace=False).tolist()
        ops.append({"id": f"c{k}", "op": "copy", "stream": streams[k % n_streams], "routine": "kernel_per_layer",
                    "src": "H", "dst": "D", "args": {"layer": 0, "src_indices": src, "dst_indices": dst}})
    return _doc("large_interval_sets", [_host("H", units), _dev("D", units)], streams, [], ops)


def same_bytes_writers(n_streams=1024, per_stream=50):
    streams = [f"s{i}" for i in range(n_streams)]
    ops = [{"id": f"w{k}_{i}", "op": "write", "stream": st, "buffer": "D", "layer": 0, "units": [0, 1]}
           for k in range(per_stream) for i, st in enumerate(streams)]
    return _doc("same_bytes_writers", [_dev("D", 16)], streams, [], ops)


def one_op_streams_500():
    return same_bytes_writers(500, 1) | {"name": "one_op_streams_500"}


SHAPES = {f.__name__: f for f in (streams_one_buffer, few_streams_many_ops, large_interval_sets,
                                  same_bytes_writers, one_op_streams_500)}


def bench(doc, reps: int, limit: int = 1000) -> dict:
    t = time.perf_counter()
    s = validate(doc)
    t_validate = time.perf_counter() - t
    acc = accesses(s)
    n_intervals = sum(a.starts.size for a in acc)
    best_hb = best_scan = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        hb = HappensBefore(s)
        best_hb = min(best_hb, time.perf_counter() - t)
        t = time.perf_counter()
        scan = race_scan(s, hb, limit)
        best_scan = min(best_scan, time.perf_counter() - t)
    del hb
    tracemalloc.start()
    scan = race_scan(s, HappensBefore(s), limit)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"shape": doc["name"], "ops": len(s.ops), "streams": len(s.streams), "accesses": len(acc),
            "intervals": n_intervals, "validate_s": t_validate, "hb_s": best_hb, "scan_s": best_scan,
            "racing_pairs": scan.total, "listed": len(scan.races), "peak_mib": peak / 2**20}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one rep; skip same_bytes_writers")
    args = ap.parse_args(argv)
    shapes = [x for x in args.shapes if not (args.quick and x == "same_bytes_writers")]
    print("| shape | ops | streams | accesses | intervals | HappensBefore s | race_scan s | racing pairs "
          "| listed | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in shapes:
        r = bench(SHAPES[name](), 1 if args.quick else args.reps)
        print(f"| {r['shape']} | {r['ops']:,} | {r['streams']:,} | {r['accesses']:,} | {r['intervals']:,} | "
              f"{r['hb_s']:.2f} | {r['scan_s']:.2f} | {r['racing_pairs']:,} | {r['listed']:,} | "
              f"{r['peak_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
