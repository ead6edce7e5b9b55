"""The timeline of one run, and its Chrome trace-event JSON (what the Perfetto UI opens).

``timeline(run, report)`` collects, from a ``RunResult`` and its ``analyse``
report:

* **lanes**: one per host (host ops: ``host_sync``, ``host_delay``,
  ``host_query``, ``barrier``) and one per stream (stream ops);
* **slices**: every op from its start to its end (``RunResult.timings``);
  a copy's slice runs from when it took its link to when its last item
  landed;
* **landings**: for each copy, the times its items landed (cumulative count);
* **marks**: every counted read at the instant it touched its bytes, with its
  status (``clean``, ``stale``, ``torn``, ``indeterminate``), and every listed
  latent race at the later of its two ops' starts, on that op's lane;
* **edges**: happens-before edges through events: each ``record`` to the
  ``wait`` (or ``host_sync``, positive ``host_query``) bound to it, from the
  record's completion to the end of the waiting op.

``chrome_trace`` writes it in the Chrome trace-event format (JSON object
form): process ``hosts`` with a thread per host and process ``device`` with a
thread per stream; ``X`` slices; ``C`` counters of items landed; ``s``/``f``
flow events (flow v1, bound to the enclosing slice) for the edges; ``i``
thread-scoped instants for stale, torn and indeterminate reads and latent
races.  Times are simulated microseconds (the format's unit).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Edge", "Landing", "Mark", "Slice", "Timeline", "chrome_trace", "timeline", "write_trace"]

#: counter samples per copy at most (item landings are thinned evenly beyond this)
MAX_LANDING_SAMPLES = 2000
HOSTS_PID, DEVICE_PID = 1, 2


@dataclass(frozen=True)
class Slice:
    op: str
    kind: str            # the op's type: copy, read, write, compute, record, wait, host_sync, ...
    lane: str            # "host:NAME" or "stream:NAME"
    start_us: float
    end_us: float
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Landing:
    """When the items of one copy landed: ``times_us[i]`` is when ``counts[i]`` items had landed."""

    op: str
    lane: str
    times_us: np.ndarray
    counts: np.ndarray
    items: int


@dataclass(frozen=True)
class Mark:
    kind: str            # clean | stale | torn | indeterminate | race
    lane: str
    time_us: float
    op: str
    text: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Edge:
    kind: str            # record->wait | record->host_sync | record->host_query
    src_op: str
    dst_op: str
    src_lane: str
    dst_lane: str
    src_us: float
    dst_us: float


@dataclass
class Timeline:
    name: str
    profile: str | None
    lanes: list[str]
    slices: list[Slice]
    landings: list[Landing]
    marks: list[Mark]
    edges: list[Edge]
    end_us: float


def _lane(op) -> str:
    return f"stream:{op.stream}" if op.stream is not None else f"host:{op.host}"


def timeline(run, report: dict | None = None) -> Timeline:
    """The timeline of ``run`` (a ``sim.executor.RunResult``); ``report`` is its
    ``sim.verdicts.analyse`` report (computed when not given)."""
    if report is None:
        from sim.verdicts import analyse

        report = analyse(run)
    s = run.schedule
    by_id = {op.id: op for op in s.ops}
    lanes = [f"host:{h}" for h in s.hosts] + [f"stream:{st}" for st in s.streams]
    slices = []
    for op in s.ops:
        if op.id not in run.timings:
            continue
        t0, t1 = run.timings[op.id]
        args = {"op": op.op, "host": op.host}
        if op.op == "copy":
            args.update(routine=op.routine, src=op.src, dst=op.dst, items=int(op.plan.extents.n_items))
        elif op.op in ("read", "write"):
            args.update(buffer=op.buffer, layer=op.layer, bytes=int(op.extents[1].sum()))
            if op.id in run.access_us:
                args["touched_us"] = float(run.access_us[op.id])
        elif op.event is not None:
            args["event"] = op.event
        if op.op == "host_query":
            args["outcome"] = bool(op.outcome)
        slices.append(Slice(op.id, op.op, _lane(op), float(t0), float(t1), args))

    landings = []
    for cid, ends in run.item_end_us.items():
        ends = np.asarray(ends, float)
        if ends.size == 0:
            continue
        times, per_time = np.unique(ends, return_counts=True)
        counts = np.cumsum(per_time)
        landings.append(Landing(cid, _lane(by_id[cid]), times, counts, int(ends.size)))

    marks = []
    for r in report.get("reads", []):
        status = "clean" if r["status"] == "ok" else r["status"]
        text = f"{status.upper()} read {r['op']}" if status != "clean" else f"clean read {r['op']}"
        when = float(run.access_us.get(r["op"], r["time_us"]))     # the report rounds its time
        marks.append(Mark(status, f"stream:{r['stream']}", when, r["op"], text,
                          {"buffer": r["buffer"], "bytes": r["nbytes"], "bytes_differing": r["bytes_differing"],
                           "copies_in_flight": r["copies_in_flight"]}))
    for race in report.get("latent_races", []):
        a, b = (by_id[x] for x in race["ops"])
        when = {x.id: float(run.access_us.get(x.id, run.timings.get(x.id, (0.0, 0.0))[0])) for x in (a, b)}
        later = b if when[b.id] >= when[a.id] else a
        marks.append(Mark("race", _lane(later), when[later.id], later.id,
                          f"LATENT RACE {a.id} vs {b.id} on {race['buffer']}",
                          {"buffer": race["buffer"], "ops": list(race["ops"]), "kinds": race["kinds"],
                           "bytes": race["bytes"], "layer": race.get("layer")}))

    edges = []
    for op in s.ops:
        if op.op == "wait":
            srcs = [op.bound_record] if op.bound_record is not None else []
        elif op.op in ("host_sync", "host_query") and op.event is not None:
            srcs = list(op.sync_targets)
        else:
            continue
        for i in srcs:
            rec = s.ops[i]
            if rec.id not in run.timings or op.id not in run.timings:
                continue
            edges.append(Edge(f"record->{op.op}", rec.id, op.id, _lane(rec), _lane(op),
                              float(run.timings[rec.id][1]), float(run.timings[op.id][1])))
    return Timeline(s.name, run.profile.name if run.profile else None, lanes, slices, landings, marks, edges,
                    float(run.end_us))


def _thin(n: int, limit: int) -> np.ndarray:
    """Indices of at most ``limit`` of ``n`` samples, evenly, always keeping the last."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.r_[np.linspace(0, n - 1, limit).astype(np.int64), n - 1])


def chrome_trace(tl: Timeline) -> dict:
    """``tl`` as a Chrome trace-event document (see the module doc)."""
    tids, pids = {}, {}
    events = [{"ph": "M", "pid": HOSTS_PID, "tid": 0, "name": "process_name", "args": {"name": "hosts"}},
              {"ph": "M", "pid": DEVICE_PID, "tid": 0, "name": "process_name", "args": {"name": "device"}},
              {"ph": "M", "pid": HOSTS_PID, "tid": 0, "name": "process_sort_index", "args": {"sort_index": 0}},
              {"ph": "M", "pid": DEVICE_PID, "tid": 0, "name": "process_sort_index", "args": {"sort_index": 1}}]
    for i, lane in enumerate(tl.lanes):
        kind, name = lane.split(":", 1)
        pids[lane] = HOSTS_PID if kind == "host" else DEVICE_PID
        tids[lane] = i + 1
        label = f"host {name}" if kind == "host" else f"stream {name}"
        events.append({"ph": "M", "pid": pids[lane], "tid": tids[lane], "name": "thread_name",
                       "args": {"name": label}})
        events.append({"ph": "M", "pid": pids[lane], "tid": tids[lane], "name": "thread_sort_index",
                       "args": {"sort_index": i}})

    def at(lane):
        return {"pid": pids[lane], "tid": tids[lane]}

    # NOTE: flow v1 events bind to the slice on top of their thread's stack when they are parsed,
    # and Perfetto parses in time-stamp order.  So each flow start ("s") is stamped at its
    # record's time and each flow end ("f", bp "e") at its waiting op's end, and both are placed
    # right after their slice in issue order before a stable sort by time: a record is issued
    # before any op bound to it, and nothing else runs on a lane while a wait holds it, so each
    # flow event meets its own slice on top (zero-length slices included: they stay on the
    # stack until the next slice of their thread starts).
    starts = {}
    for k, e in enumerate(tl.edges):
        starts.setdefault(e.src_op, []).append((k + 1, e))
    ends = {e.dst_op: [] for e in tl.edges}
    for k, e in enumerate(tl.edges):
        ends[e.dst_op].append((k + 1, e))
    timed = []
    for sl in tl.slices:
        timed.append({"ph": "X", "name": sl.op, "cat": sl.kind, "ts": sl.start_us, "dur": sl.end_us - sl.start_us,
                      **at(sl.lane), "args": sl.args})
        for k, e in starts.get(sl.op, ()):
            timed.append({"ph": "s", "id": k, "name": e.kind, "cat": "sync", "ts": e.src_us, **at(e.src_lane),
                          "args": {"from": e.src_op, "to": e.dst_op}})
        for k, e in ends.get(sl.op, ()):
            timed.append({"ph": "f", "bp": "e", "id": k, "name": e.kind, "cat": "sync", "ts": e.dst_us,
                          **at(e.dst_lane), "args": {"from": e.src_op, "to": e.dst_op}})
    slice_start = {sl.op: sl.start_us for sl in tl.slices}
    for ld in tl.landings:
        pick = _thin(ld.times_us.size, MAX_LANDING_SAMPLES)
        name = f"{ld.op} items landed"
        timed.append({"ph": "C", "name": name, "ts": slice_start.get(ld.op, float(ld.times_us[0])),
                      "pid": DEVICE_PID, "args": {"items": 0}})
        for t, c in zip(ld.times_us[pick].tolist(), ld.counts[pick].tolist()):
            timed.append({"ph": "C", "name": name, "ts": t, "pid": DEVICE_PID, "args": {"items": int(c)}})
    for m in tl.marks:
        if m.kind == "clean":
            continue
        timed.append({"ph": "i", "s": "t", "name": m.text, "cat": m.kind, "ts": m.time_us, **at(m.lane),
                      "args": {"op": m.op, **m.args}})
    timed.sort(key=lambda ev: ev["ts"])          # stable: issue order among equal stamps
    return {"traceEvents": events + timed, "displayTimeUnit": "ns",
            "otherData": {"kvrace_trace": 1, "schedule": tl.name, "profile": tl.profile, "end_us": tl.end_us,
                          "time_unit": "simulated microseconds"}}


def write_trace(path: str, tl: Timeline) -> None:
    """Write ``chrome_trace(tl)`` as JSON to ``path`` ('-': stdout)."""
    from sim.report_io import write_json

    write_json(chrome_trace(tl), path)
