"""Where the streaming engine's CPU time goes: cProfile of one `kvrace run`, grouped by part.

    python benchmarks/profile_engine.py [SCENARIO] [--set key=value]... [--duration S] [--warm W] [--top N]
                                        [--dump PATH]

Runs ``SCENARIO`` (default ``incident``) with ``run.duration_s = S`` (default 3) through the
streaming engine (``keep="report"``) under cProfile (``--warm W``: the first ``W`` simulated
seconds unprofiled, so a late stretch of a long run is profiled alone: the late minutes of
``incident``, full chunks and backups without load-backs, cost differently from its first ones)
and prints the CPU seconds (``process_time``,
profiler included), then the cumulative time of each part of the hot path, with its share of the
profiled total (CPU time: the profiler's clock is ``process_time``) and the file that owns it,
then the top ``N`` functions by own time (``--dump PATH``: the whole profile, for ``pstats``).  The parts
overlap where one calls another (a write's race tracking happens inside the op's issue), so
the shares do not add up to 100 %; each says what removing that part would save at most.
A part is the cumulative time of one function, the largest of that name in its file.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

#: (label, owner, (file suffix, function name)): cumulative time of that function
PARTS = [
    ("ops issued (validation, race tracking of the issue, all of it)", "sim/executor.py", ("sim/executor.py", "_issue_dict")),
    ("op validation (ScheduleBuilder.add)", "sim/schedule.py", ("sim/schedule.py", "add")),
    ("race tracker (RaceTracker.add)", "sim/hb.py", ("sim/hb.py", "add")),
    ("read capture (views, overlays, verdict of the read)", "sim/executor.py", ("sim/executor.py", "_capture")),
    ("read views (Memory.view)", "sim/memory.py", ("sim/memory.py", "view")),
    ("read views, vectorised (Memory.views, where the executor has it)", "sim/memory.py", ("sim/memory.py", "views")),
    ("read verdicts (OnlineVerdicts.captured)", "sim/verdicts.py", ("sim/verdicts.py", "captured")),
    ("memory writes (Memory.write_units)", "sim/memory.py", ("sim/memory.py", "write_units")),
    ("memory copies (Memory.apply_copy)", "sim/memory.py", ("sim/memory.py", "apply_copy")),
    ("KV oracle: checks (KVOracle.check_reads)", "sim/engine/oracle.py", ("sim/engine/oracle.py", "check_reads")),
    ("KV oracle: forgetting written pages (KVOracle.written)", "sim/engine/oracle.py", ("sim/engine/oracle.py", "written")),
    ("batch KV stores (CacheSession.store_kv)", "sim/cache/session.py", ("sim/cache/session.py", "store_kv")),
    ("forward issue (issue_forward)", "sim/engine/forward.py", ("sim/engine/forward.py", "issue_forward")),
    ("backups (HiCacheController.start_writing)", "sim/cache/controller.py", ("sim/cache/controller.py", "start_writing")),
    ("ownership checks (PrefillEngine._check_ownership)", "sim/engine/engine.py", ("sim/engine/engine.py", "_check_ownership")),
    ("SimPy event loop (Environment.step)", "simpy", ("simpy/core.py", "step")),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default="incident")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warm", type=float, default=0.0,
                    help="simulated seconds run before the profiler starts (default 0)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dump", metavar="PATH", help="also write the profile to PATH (pstats format)")
    a = ap.parse_args(argv)
    from sim.engine.engine import PrefillEngine
    from sim.engine.scenario import load_scenario

    e = PrefillEngine(load_scenario(a.scenario, [*a.set, f"run.duration_s={a.duration}"]), keep="report")
    # NOTE: the process's CPU clock, not the wall clock: on a shared machine the wall time of
    # a function grows with the other processes' load
    prof = cProfile.Profile(time.process_time)
    e.start()
    c0 = time.process_time()
    while e.session.now < a.warm * 1e6 and e.step():
        pass
    warm = (f", the first {e.session.now / 1e6:.2f} s unprofiled ({time.process_time() - c0:.1f} CPU s, "
            f"{e.counts['batches']} batches)") if a.warm else ""
    c0 = time.process_time()
    prof.enable()
    while e.step():
        pass
    r = e.finish()
    prof.disable()
    cpu = time.process_time() - c0
    st = pstats.Stats(prof)
    total = max(v[3] for v in st.stats.values())
    print(f"{a.scenario} {' '.join(a.set)} run.duration_s={a.duration}: sim {r.sim_time_s:.2f} s{warm}, CPU {cpu:.1f} s "
          f"under cProfile, {e.session.finish().n_ops} ops, {r.batches} batches, {r.reads_total} reads, "
          f"{r.requests_total} requests")
    print(f"{'part':<66} {'cum s':>7} {'share':>6}  owner")
    for label, owner, (suffix, fn) in PARTS:
        # NOTE: the largest of the same-named functions of that file (``add`` is also another
        # class's method in hb.py and schedule.py); cProfile does not record the class
        cum = max([v[3] for (f, _, name), v in st.stats.items() if f.endswith(suffix) and name == fn], default=0.0)
        print(f"{label:<66} {cum:7.2f} {cum / total:6.1%}  {owner}")
    st.sort_stats("tottime").print_stats(a.top)
    if a.dump:
        st.dump_stats(a.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
