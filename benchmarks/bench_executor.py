"""Executor scale: ops per wall second and peak memory, static schedules and host programs.

    python benchmarks/bench_executor.py [--sizes 10000 100000 1000000] [--timeout 600]

The workload is a HiCache-style load-back loop (what the engine model issues):
request ``r`` loads ``PAGES`` index-K pages and ``PAGES`` latent pages of each of
``LAYERS`` layers host -> device on ``load`` (per layer: two ``copy`` ops and a
``record`` of the layer's event, from a ring of 3 event sets as SGLang's
``LayerDoneCounter``), while ``forward`` reads each layer: the indexer reads
index-K (ungated, the #22811 class), then waits on the layer's event and reads
the latent.  Device pages are reused round-robin, so requests overwrite each
other's slots.  A request is ``2 + 6 * LAYERS`` ops.

* **static**: the whole list is validated as one schedule, then run.
* **program**: one host program issues the same ops while time runs, and before
  reusing a ring slot polls ``query`` on that slot's last event (SGLang asserts
  the reused slot finished) with a 5 us delay between polls.
* **simpy**: SimPy alone with the static run's event pattern (five events an op) and
  nothing of kvrace (``simpy_floor``): the floor of any executor that spends SimPy
  events per op, on this machine.

Each size runs in its own process (peak RSS is per process: ``ru_maxrss``),
compact mode (no materialised bytes), profile ``h200``; ``--keep report`` runs with
``keep="report"`` (verdicts computed while running, nothing kept per op).  Reported: ops, wall
seconds of the static schedule's validation (``validate``, included in the run's seconds; the
document is made before the clock starts), for the run alone and for run + verdicts
(``analyse``), ops per wall second for both, the request ops alone per wall second (a host
program's polls are ops of its recorded schedule: most of its ops at scale), peak RSS.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = 43
PAGES = 1                # pages per request per buffer
DEVICE_PAGES = 64        # device pool pages: requests reuse them round-robin
HOST_PAGES = 256
RING = 3
OPS_PER_REQUEST = 2 + 6 * LAYERS   # request_ops: a record and a wait, then per layer 2 copies, a record, 2 reads, a wait


def header(n_requests: int) -> dict:
    host_pages = min(HOST_PAGES, max(PAGES, n_requests * PAGES))
    return {
        "kvrace_schedule": 2, "name": f"loadback_{n_requests}", "hosts": ["host"],
        "buffers": [
            {"name": "host_index_k", "location": "host", "kind": "index_k",
             "layout": {"kind": "host", "layout": "layer_first", "layers": LAYERS, "units": host_pages,
                        "unit_bytes": 8448}},
            {"name": "host_latent", "location": "host", "kind": "latent",
             "layout": {"kind": "host", "layout": "layer_first", "layers": LAYERS, "units": host_pages,
                        "unit_bytes": 37440}},
            {"name": "dev_index_k", "location": "device", "kind": "index_k",
             "layout": {"preset": "dsa_index_k", "layers": LAYERS, "pages": DEVICE_PAGES}},
            {"name": "dev_latent", "location": "device", "kind": "latent",
             "layout": {"preset": "c4_paged", "layers": LAYERS, "pages": DEVICE_PAGES}},
        ],
        "streams": ["forward", "load"],
        "events": ["start"] + [f"ring{k}_L{l}" for k in range(RING) for l in range(LAYERS)],
        "ops": [],
    }


def request_ops(r: int, host_pages: int) -> list[dict]:
    slot = r % RING
    dev = [(r * PAGES + k) % DEVICE_PAGES for k in range(PAGES)]
    host = [(r * PAGES + k) % host_pages for k in range(PAGES)]
    ops = [{"id": f"r{r}_start", "op": "record", "stream": "forward", "event": "start"},
           {"id": f"r{r}_wait_start", "op": "wait", "stream": "load", "event": "start"}]
    for l in range(LAYERS):
        for kind in ("index_k", "latent"):
            ops.append({"id": f"r{r}_load_{kind}_L{l}", "op": "copy", "stream": "load",
                        "routine": "kernel_per_layer", "src": f"host_{kind}", "dst": f"dev_{kind}",
                        "args": {"layer": l, "src_indices": host, "dst_indices": dev}})
        ops.append({"id": f"r{r}_rec_L{l}", "op": "record", "stream": "load", "event": f"ring{slot}_L{l}"})
    for l in range(LAYERS):
        ops.append({"id": f"r{r}_idx_L{l}", "op": "read", "stream": "forward", "buffer": "dev_index_k",
                    "layer": l, "units": dev})
        ops.append({"id": f"r{r}_wait_L{l}", "op": "wait", "stream": "forward", "event": f"ring{slot}_L{l}"})
        ops.append({"id": f"r{r}_lat_L{l}", "op": "read", "stream": "forward", "buffer": "dev_latent",
                    "layer": l, "units": dev})
    return ops


def n_requests_for(n_ops: int) -> int:
    return max(1, round(n_ops / OPS_PER_REQUEST))


def static_doc(n_requests: int) -> dict:
    doc = header(n_requests)
    hp = doc["buffers"][0]["layout"]["units"]
    doc["ops"] = [op for r in range(n_requests) for op in request_ops(r, hp)]
    return doc


def program(n_requests: int, host_pages: int):
    def prog(host):
        for r in range(n_requests):
            if r >= RING:      # the ring slot about to be reused must have finished
                while not host.query(f"ring{r % RING}_L{LAYERS - 1}"):
                    yield host.delay(5.0)
            for op in request_ops(r, host_pages):
                host.issue(op)
        yield host.delay(0.0)
    return prog


def measure(mode: str, n_ops: int, keep: str = "all") -> dict:
    from sim.executor import run_programs, run_schedule
    from sim.profile import load_profile
    from sim.schedule import validate
    from sim.verdicts import analyse

    prof = load_profile("h200")
    n_req = n_requests_for(n_ops)
    if mode == "simpy":
        return simpy_floor(n_req * OPS_PER_REQUEST)
    doc = static_doc(n_req) if mode == "static" else None      # the input, made before the clock starts
    t0, c0 = time.perf_counter(), time.process_time()
    t_validate = None
    if mode == "static":
        # NOTE: a document is limited to MAX_OPS ops; the benchmark lifts the bound (max_ops=None)
        schedule = validate(doc, max_ops=None)
        t_validate = time.perf_counter() - t0
        run = run_schedule(schedule, prof, materialise=False, keep=keep)
    else:
        doc = header(n_req)
        run = run_programs(doc, {"host": program(n_req, doc["buffers"][0]["layout"]["units"])}, prof,
                           materialise=False, keep=keep)
    t_run = time.perf_counter() - t0
    rep = analyse(run)
    t_all, c_all = time.perf_counter() - t0, time.process_time() - c0
    ops = run.n_ops
    # NOTE: a program's polls (query + delay) are ops of its recorded schedule; the request ops
    # alone, the static schedule's, show what a poll-free rate would be
    request_ops = n_req * OPS_PER_REQUEST
    return {"mode": mode, "keep": keep, "ops": ops, "requests": n_req, "request_ops": request_ops,
            "request_ops_per_s_with_verdicts": round(request_ops / t_all),
            "validate_s": None if t_validate is None else round(t_validate, 2), "run_s": round(t_run, 2),
            "run_and_verdicts_s": round(t_all, 2), "ops_per_s_run": round(ops / t_run),
            "ops_per_s_with_verdicts": round(ops / t_all), "cpu_s": round(c_all, 2),
            "ops_per_cpu_s": round(ops / c_all),
            "corrupt_reads": rep["corrupt_reads"],
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def simpy_floor(n_ops: int) -> dict:
    """SimPy alone, with the executor's event pattern and nothing else: one host process puts
    ``n_ops`` items into a queue (the executor's ``StreamQueue``: ``simpy.Store`` takes items
    with ``list.pop(0)``, quadratic with the ops queued at time 0), one stream process takes
    each and waits three timeouts (the read's tie gate, launch and duration): five events an
    op, as the executor's static run of this workload takes (148,929 SimPy steps for 29,900
    ops).  What no executor built on SimPy events per op can beat on this machine."""
    import simpy

    from sim.executor import StreamQueue

    env = simpy.Environment()
    store = StreamQueue(env)

    def host():
        for i in range(n_ops):
            yield store.put(i)

    def stream():
        for _ in range(n_ops):
            yield store.get()
            yield env.timeout(0)
            yield env.timeout(1.0)
            yield env.timeout(0.5)

    env.process(host())
    env.process(stream())
    t0, c0 = time.perf_counter(), time.process_time()
    env.run()
    t, c = time.perf_counter() - t0, time.process_time() - c0
    return {"mode": "simpy", "keep": "-", "ops": n_ops, "requests": 0, "request_ops": n_ops,
            "request_ops_per_s_with_verdicts": round(n_ops / t), "validate_s": None, "run_s": round(t, 2),
            "run_and_verdicts_s": round(t, 2), "ops_per_s_run": round(n_ops / t),
            "ops_per_s_with_verdicts": round(n_ops / t), "cpu_s": round(c, 2), "ops_per_cpu_s": round(n_ops / c),
            "corrupt_reads": 0, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--modes", nargs="+", default=["static", "program"], choices=["static", "program", "simpy"])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per (mode, size) process")
    ap.add_argument("--keep", default="all", choices=["all", "report"],
                    help="what a run keeps: everything (default) or the report only (verdicts while running)")
    ap.add_argument("--json", help="also write every result, with its provenance, to this JSON file")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "OPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.keep)))
        return
    from benchmarks.bench_scale import provenance
    prov = provenance()
    print(f"# {prov['machine']}, python {prov['python']}, {prov['date']}, code {prov['commit']}, "
          f"load average {prov['load_average']}, keep={args.keep}")
    print("| mode | ops | validate s | run s | run + verdicts s | ops/s (run) | ops/s (with verdicts) "
          "| request ops/s (with verdicts) | CPU s | ops / CPU s | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for n in args.sizes:
        for mode in args.modes:
            try:
                out = subprocess.run([sys.executable, __file__, "--one", mode, str(n), "--keep", args.keep],
                                     capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"| {mode} | {n} | | over {args.timeout:.0f} s | | | | | | | |", flush=True)
                continue
            if out.returncode != 0:
                why = out.stderr.strip().splitlines()[-1][:120]
                print(f"| {mode} | {n} | | failed: {why} | | | | | | | |", flush=True)
                continue
            r = json.loads(out.stdout)
            results.append(r)
            validate_s = "-" if r["validate_s"] is None else r["validate_s"]
            print(f"| {mode} | {r['ops']} | {validate_s} | {r['run_s']} | {r['run_and_verdicts_s']} | "
                  f"{r['ops_per_s_run']} | {r['ops_per_s_with_verdicts']} | {r['request_ops_per_s_with_verdicts']} | "
                  f"{r['cpu_s']} | {r['ops_per_cpu_s']} | "
                  f"{r['peak_rss_mib']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": prov, "results": results}, indent=1))


if __name__ == "__main__":
    main()
