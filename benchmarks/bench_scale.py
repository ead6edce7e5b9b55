"""Online executor at scale: ops per wall second with verdicts, and memory, up to 1M ops on 8 devices.

    python benchmarks/bench_scale.py [--sizes 10000 100000 1000000] [--devices 8]
                                     [--modes static program] [--timeout 3000] [--profile N]

The workload is ``bench_executor.py``'s HiCache load-back loop on every device of a
TP group: device ``d`` has its own host pools, device pools, ``load_d`` and
``forward_d`` streams and ring of per-layer events, and is driven by host ``rank<d>``
(one scheduler thread per TP rank).  A request on one rank is ``2 + 6 * LAYERS`` ops
(per layer two ``copy`` ops and a ``record`` on ``load_d``; an ungated index-K read,
a ``wait`` and a latent read on ``forward_d``).

* **static**: the ops of every rank, request by request, validated as one schedule
  (``validate(doc, max_ops=None)``), then ``run_schedule(..., keep="report")``.
* **program**: each rank is a host program that issues its requests while time runs;
  before reusing a ring slot it polls ``query`` on the slot's last event every 5 us
  (each poll is a ``host_query`` and a ``host_delay`` op), and the ranks meet at a
  ``barrier`` after every request (TP lockstep).  ``run_programs(..., keep="report")``.
  A size counts the ops issued, polls and barriers included (about
  ``PROGRAM_OPS_PER_REQUEST`` per request and rank), so a program of size N
  runs fewer requests than a static schedule of size N.

Each (mode, size) runs in its own process, compact mode (``materialise=False``),
profile ``h200``; the verdicts (``analyse``) are included in every time.  Reported:
ops issued, wall and CPU seconds, ops per wall second, peak RSS (``ru_maxrss``), the
sha256 of the whole report (JSON, sorted keys: equal before and after a speed change), and
for program runs the RSS at each tenth of the run (``/proc/self/statm``), which is
how memory flat in the run's length shows; for static runs the RSS once the document is
validated (``rss_input_mib``: the input, held whole), which the peak is compared with.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_executor import DEVICE_PAGES, HOST_PAGES, LAYERS, PAGES, RING  # noqa: E402

OPS_PER_REQUEST = 2 + 6 * LAYERS
#: ops a program issues per request and rank, polls and barrier included (measured: 35,120 ops
#: for 5 requests on 8 ranks); program runs are sized by it, so "ops" is what was issued
PROGRAM_OPS_PER_REQUEST = 878


def header(devices: int, requests_per_rank: int) -> dict:
    host_pages = min(HOST_PAGES, max(PAGES, requests_per_rank * PAGES))
    buffers, streams, events = [], [], []
    for d in range(devices):
        for kind, unit_bytes, preset in (("index_k", 8448, "dsa_index_k"), ("latent", 37440, "c4_paged")):
            buffers.append({"name": f"host_{kind}_{d}", "location": "host", "kind": kind,
                            "layout": {"kind": "host", "layout": "layer_first", "layers": LAYERS,
                                       "units": host_pages, "unit_bytes": unit_bytes}})
            buffers.append({"name": f"dev_{kind}_{d}", "location": "device", "device": d, "kind": kind,
                            "layout": {"preset": preset, "layers": LAYERS, "pages": DEVICE_PAGES}})
        streams += [{"name": f"forward_{d}", "device": d}, {"name": f"load_{d}", "device": d}]
        events += [f"start_{d}"] + [f"ring{k}_L{l}_{d}" for k in range(RING) for l in range(LAYERS)]
    return {"kvrace_schedule": 2, "name": f"loadback_{devices}x{requests_per_rank}",
            "hosts": [f"rank{d}" for d in range(devices)], "buffers": buffers, "streams": streams,
            "events": events, "ops": []}


def request_ops(d: int, r: int, host_pages: int) -> list[dict]:
    """Request ``r`` of rank ``d`` (the ops of bench_executor.request_ops on device d)."""
    slot = r % RING
    dev = [(r * PAGES + k) % DEVICE_PAGES for k in range(PAGES)]
    host = [(r * PAGES + k) % host_pages for k in range(PAGES)]
    h = f"rank{d}"
    ops = [{"id": f"d{d}r{r}_start", "op": "record", "stream": f"forward_{d}", "event": f"start_{d}", "host": h},
           {"id": f"d{d}r{r}_wait_start", "op": "wait", "stream": f"load_{d}", "event": f"start_{d}", "host": h}]
    for l in range(LAYERS):
        for kind in ("index_k", "latent"):
            ops.append({"id": f"d{d}r{r}_load_{kind}_L{l}", "op": "copy", "stream": f"load_{d}", "host": h,
                        "routine": "kernel_per_layer", "src": f"host_{kind}_{d}", "dst": f"dev_{kind}_{d}",
                        "args": {"layer": l, "src_indices": host, "dst_indices": dev}})
        ops.append({"id": f"d{d}r{r}_rec_L{l}", "op": "record", "stream": f"load_{d}", "host": h,
                    "event": f"ring{slot}_L{l}_{d}"})
    for l in range(LAYERS):
        ops.append({"id": f"d{d}r{r}_idx_L{l}", "op": "read", "stream": f"forward_{d}", "host": h,
                    "buffer": f"dev_index_k_{d}", "layer": l, "units": dev})
        ops.append({"id": f"d{d}r{r}_wait_L{l}", "op": "wait", "stream": f"forward_{d}", "host": h,
                    "event": f"ring{slot}_L{l}_{d}"})
        ops.append({"id": f"d{d}r{r}_lat_L{l}", "op": "read", "stream": f"forward_{d}", "host": h,
                    "buffer": f"dev_latent_{d}", "layer": l, "units": dev})
    return ops


def requests_for(n_ops: int, devices: int, mode: str = "static") -> int:
    per = OPS_PER_REQUEST if mode == "static" else PROGRAM_OPS_PER_REQUEST
    return max(1, round(n_ops / (per * devices)))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def programs(devices: int, n_req: int, host_pages: int, trend: list, t0: float) -> dict:
    hosts = [f"rank{d}" for d in range(devices)]
    marks = {max(1, (n_req * k) // 10) for k in range(1, 11)}

    def rank(d: int):
        def prog(host):
            for r in range(n_req):
                if r >= RING:      # the ring slot about to be reused must have finished
                    while not host.query(f"ring{r % RING}_L{LAYERS - 1}_{d}"):
                        yield host.delay(5.0)
                for op in request_ops(d, r, host_pages):
                    host.issue(op)
                yield host.barrier("step", hosts)
                if d == 0 and r + 1 in marks and host._ex.online is not None:
                    ex = host._ex
                    trend.append({"requests": r + 1, "ops": ex.online.taken, "rss_mib": round(_rss_mib(), 1),
                                  "cpu_s": round(time.process_time() - t0, 1),
                                  "live_accesses": ex.online.races.live_accesses()})
            yield host.delay(0.0)
        return prog
    return {f"rank{d}": rank(d) for d in range(devices)}


def measure(mode: str, n_ops: int, devices: int) -> dict:
    from sim.executor import run_programs, run_schedule
    from sim.profile import load_profile
    from sim.schedule import validate
    from sim.verdicts import analyse

    prof = load_profile("h200")
    n_req = requests_for(n_ops, devices, mode)
    doc = header(devices, n_req)
    host_pages = doc["buffers"][0]["layout"]["units"]
    trend: list = []
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "static":
        doc["ops"] = [op for r in range(n_req) for d in range(devices) for op in request_ops(d, r, host_pages)]
        # NOTE: a document is limited to MAX_OPS ops; the benchmark lifts the bound (max_ops=None)
        sched = validate(doc, max_ops=None)
        # the input held (the document and its validated ops) before the run starts: the run's
        # own memory is what the peak adds to it
        rss_input = round(_rss_mib(), 1)
        run = run_schedule(sched, prof, materialise=False, keep="report")
    else:
        rss_input = None
        run = run_programs(doc, programs(devices, n_req, host_pages, trend, c0), prof, materialise=False,
                           keep="report")
    t_run = time.perf_counter() - t0
    rep = analyse(run)
    t_all, c_all = time.perf_counter() - t0, time.process_time() - c0
    ops = run.n_ops
    return {"mode": mode, "devices": devices, "ops": ops, "requests_per_rank": n_req, "run_s": round(t_run, 2),
            "wall_s": round(t_all, 2), "cpu_s": round(c_all, 2), "ops_per_wall_s": round(ops / t_all),
            "ops_per_cpu_s": round(ops / c_all), "reads": rep["reads_total"], "corrupt_reads": rep["corrupt_reads"],
            "latent_races_total": rep["latent_races_total"],
            # NOTE: taken after the timing: equal digests before and after a change mean the same report
            "report_sha256": hashlib.sha256(json.dumps(rep, sort_keys=True, default=str).encode()).hexdigest(),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "rss_input_mib": rss_input, "rss_trend": trend}


def split(n_ops: int, devices: int, repeat: int = 3) -> None:
    """Where a static run's CPU goes: each part timed alone, best of ``repeat`` (the report is
    timed on a run after the first, so its byte digests come from the per-process cache: the
    first report of a process also materialises and hashes the device pools)."""
    from sim.executor import run_schedule
    from sim.profile import load_profile
    from sim.schedule import validate
    from sim.verdicts import analyse

    prof = load_profile("h200")
    n_req = requests_for(n_ops, devices)
    doc = header(devices, n_req)
    hp = doc["buffers"][0]["layout"]["units"]
    doc["ops"] = [op for r in range(n_req) for d in range(devices) for op in request_ops(d, r, hp)]
    best: dict[str, float] = {}
    first_report = None
    for _ in range(repeat):
        parts = {}
        c = time.process_time()
        s = validate(doc, max_ops=None)
        parts["validation"], c = time.process_time() - c, time.process_time()
        run_schedule(s, prof, materialise=False, keep="all")
        parts["run without verdicts (keep='all')"], c = time.process_time() - c, time.process_time()
        run = run_schedule(s, prof, materialise=False, keep="report")
        parts["run with online verdicts (keep='report')"], c = time.process_time() - c, time.process_time()
        s.digest()
        parts["schedule digest (part of the run above)"], c = time.process_time() - c, time.process_time()
        analyse(run)
        parts["report (analyse)"] = time.process_time() - c
        first_report = parts["report (analyse)"] if first_report is None else first_report
        best = {k: min(best.get(k, v), v) for k, v in parts.items()}
    prov = provenance()
    print(f"# {len(s.ops)} ops, {devices} devices, code {prov['commit']}, {prov['date']}, "
          f"load average {prov['load_average']}; CPU seconds, best of {repeat}")
    print("| part | CPU s | us per op |\n| --- | ---: | ---: |")
    for k, v in best.items():
        print(f"| {k} | {v:.3f} | {v / len(s.ops) * 1e6:.1f} |")
    print(f"| first report of the process (device pools hashed) | {first_report:.3f} | "
          f"{first_report / len(s.ops) * 1e6:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--modes", nargs="+", default=["static", "program"], choices=["static", "program"])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds per (mode, size) process")
    ap.add_argument("--json", help="also write every result to this JSON file")
    ap.add_argument("--profile", type=int, metavar="N", default=0,
                    help="run the first (mode, size) in this process under cProfile and print the N "
                         "entries with the most internal time (the times are then not comparable)")
    ap.add_argument("--split", action="store_true",
                    help="for the first size's static document: CPU seconds per part (validation, the run "
                         "without verdicts, the run with them, the schedule digest, the report), best of three")
    ap.add_argument("--ab", metavar="TREE",
                    help="before/after: run every (mode, size) --repeat times in TREE (another source tree, "
                         "e.g. `git archive <commit>` unpacked) and in this one, alternating, and print the "
                         "best CPU seconds of each (on a shared machine repeats vary by up to 20 %%)")
    ap.add_argument("--repeat", type=int, default=3, help="with --ab: runs per tree")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "OPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ab:
        ab(Path(args.ab), args)
        return
    if args.split:
        split(args.sizes[0], args.devices)
        return
    if args.profile:
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        r = prof.runcall(measure, args.modes[0], args.sizes[0], args.devices)
        r.pop("rss_trend")
        print(json.dumps(r))
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())
        return
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.devices)))
        return
    prov = provenance()
    print(f"# {prov['machine']}, python {prov['python']}, {prov['date']}, {args.devices} devices, "
          f"code {prov['commit']}, load average {prov['load_average']}")
    print("| mode | ops | wall s | CPU s | ops / wall s | ops / CPU s | reads | corrupt | races | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    results = []
    for n in args.sizes:
        for mode in args.modes:
            try:
                out = subprocess.run([sys.executable, __file__, "--one", mode, str(n), "--devices", str(args.devices)],
                                     capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"| {mode} | {n} | over {args.timeout:.0f} s | | | | | | | |", flush=True)
                continue
            if out.returncode != 0:
                print(f"| {mode} | {n} | failed: {out.stderr.strip().splitlines()[-1][:120]} | | | | | | | |",
                      flush=True)
                continue
            r = json.loads(out.stdout)
            results.append(r)
            print(f"| {mode} | {r['ops']} | {r['wall_s']} | {r['cpu_s']} | {r['ops_per_wall_s']} | "
                  f"{r['ops_per_cpu_s']} | {r['reads']} | {r['corrupt_reads']} | {r['latent_races_total']} | "
                  f"{r['peak_rss_mib']} |", flush=True)
            if r.get("rss_input_mib") is not None:
                print(f"  RSS once validated (the input): {r['rss_input_mib']} MiB", flush=True)
            if r["rss_trend"]:
                print("  RSS trend (ops: MiB): " + ", ".join(f"{x['ops']}: {x['rss_mib']}" for x in r["rss_trend"]),
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "results": results}, indent=1))


def _one(tree: Path, mode: str, n: int, devices: int, timeout: float) -> dict:
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_scale.py"), "--one", mode, str(n),
                          "--devices", str(devices)], capture_output=True, text=True, timeout=timeout, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {mode} {n} failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def ab(before: Path, args) -> None:
    """Before/after in alternation: ``--repeat`` runs of each (mode, size) in ``before`` and
    in this tree; prints the best CPU seconds of each, the peak RSS and whether every run's
    report sha256 is the same; ``--json`` keeps every run."""
    here = Path(__file__).resolve().parents[1]
    prov = provenance()
    print(f"# before: {before}; after: {here} (code {prov['commit']}); {prov['machine']}, {prov['date']}, "
          f"load average {prov['load_average']}; best of {args.repeat} CPU seconds, runs alternating")
    print("| mode | ops | CPU s before | CPU s after | ops / CPU s before | ops / CPU s after | "
          "peak RSS MiB before / after | report sha256 (all runs) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    runs = []
    for n in args.sizes:
        for mode in args.modes:
            got = {"before": [], "after": []}
            for _ in range(args.repeat):
                for side, tree in (("before", before), ("after", here)):
                    r = _one(tree, mode, n, args.devices, args.timeout)
                    r["side"] = side
                    got[side].append(r)
                    runs.append(r)
            b = min(got["before"], key=lambda r: r["cpu_s"])
            a = min(got["after"], key=lambda r: r["cpu_s"])
            shas = {r["report_sha256"] for r in got["before"] + got["after"]}
            same = f"`{shas.pop()[:16]}…`" if len(shas) == 1 else f"DIFFER: {sorted(s[:12] for s in shas)}"
            print(f"| {mode} | {a['ops']} | {b['cpu_s']} | {a['cpu_s']} | {b['ops_per_cpu_s']} | "
                  f"{a['ops_per_cpu_s']} | {b['peak_rss_mib']} / {a['peak_rss_mib']} | {same} |", flush=True)
    if args.json:
        from benchmarks.provenance import tree_origin
        Path(args.json).write_text(json.dumps({"provenance": {**prov, "before_tree": str(before),
                                                              "before_origin": tree_origin(before)},
                                               "runs": runs}, indent=1))


def provenance() -> dict:
    """Where a result came from: the code's commit, the command, the machine, the date and the
    load average (the machine may be shared: CPU seconds are then the comparable figure)."""
    from benchmarks.provenance import command, git_commit
    return {"commit": git_commit(), "command": command(), "machine": f"{platform.node()} "
            f"{_cpu_model()}, {os.cpu_count()} cores", "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg())}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
