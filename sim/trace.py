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

``measured_timeline(schedule, timings_us, statuses)`` is the same model for a
run on a GPU (``kvrace replay``): slices from the measured CUDA-event times of
its copies, reads, writes and computes, the reads marked with the status the
replay gave them, and record -> wait edges whose ends are inferred (see its
doc).  ``combined_trace([(label, timeline), ...])`` puts several timelines in
one trace, each under its own labelled processes, so that the simulated run
and the measured one sit one above the other in Perfetto, on one time axis.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Edge", "Landing", "Mark", "Slice", "Timeline", "chrome_trace", "combined_trace", "measured_timeline",
           "timeline", "write_trace"]

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
    kind: str            # clean | stale | torn | indeterminate | race | mismatch (a replayed read != prediction)
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
    clock: str = "simulated"      # "measured" for a GPU run's timeline (measured_timeline)


def _access_args(op) -> dict:
    """A read's or write's slice args: its buffer, layer (``layers`` for a multi-layer write)
    and bytes."""
    out = {"buffer": op.buffer, "layer": op.layer, "bytes": int(op.extents[1].sum())}
    if len(op.layers) > 1:
        out["layers"] = list(op.layers)
    return out


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
            args.update(_access_args(op))
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
    meta, timed = _trace_events(tl, None, 0, 0)
    return {"traceEvents": meta + timed, "displayTimeUnit": "ns",
            "otherData": {"kvrace_trace": 1, "schedule": tl.name, "profile": tl.profile, "end_us": tl.end_us,
                          "time_unit": f"{tl.clock} microseconds"}}


def combined_trace(parts: list[tuple[str, Timeline]]) -> dict:
    """Several timelines in one Chrome trace-event document, on one time axis.

    Part ``i`` gets processes ``LABEL: hosts`` and ``LABEL: device`` (pids
    ``2i+1`` and ``2i+2``, sorted in ``parts`` order) and its own flow ids, so
    no arrow joins two parts.  Each part is laid out as ``chrome_trace`` lays
    out one timeline."""
    if not parts:
        raise ValueError("combined_trace: expected at least one (label, timeline)")
    meta, timed, flows = [], [], 0
    for i, (label, tl) in enumerate(parts):
        m, t = _trace_events(tl, label, 2 * i, flows)
        meta += m
        timed += t
        flows += len(tl.edges)
    timed.sort(key=lambda ev: ev["ts"])          # stable: each part keeps its own order among equal stamps
    return {"traceEvents": meta + timed, "displayTimeUnit": "ns",
            "otherData": {"kvrace_trace": 1, "parts": [{"label": label, "schedule": tl.name, "profile": tl.profile,
                                                        "end_us": tl.end_us} for label, tl in parts],
                          "time_unit": "microseconds (simulated or measured, per part)"}}


def _trace_events(tl: Timeline, label: str | None, pid_base: int, flow_base: int) -> tuple[list, list]:
    """(metadata events, timed events sorted by time) of one timeline; pids
    ``pid_base + 1`` (hosts) and ``pid_base + 2`` (device), flow ids from
    ``flow_base + 1``; process names prefixed with ``label: `` when given."""
    hosts_pid, device_pid = pid_base + HOSTS_PID, pid_base + DEVICE_PID
    prefix = f"{label}: " if label else ""
    tids, pids = {}, {}
    events = [{"ph": "M", "pid": hosts_pid, "tid": 0, "name": "process_name", "args": {"name": prefix + "hosts"}},
              {"ph": "M", "pid": device_pid, "tid": 0, "name": "process_name", "args": {"name": prefix + "device"}},
              {"ph": "M", "pid": hosts_pid, "tid": 0, "name": "process_sort_index",
               "args": {"sort_index": pid_base}},
              {"ph": "M", "pid": device_pid, "tid": 0, "name": "process_sort_index",
               "args": {"sort_index": pid_base + 1}}]
    for i, lane in enumerate(tl.lanes):
        kind, name = lane.split(":", 1)
        pids[lane] = hosts_pid if kind == "host" else device_pid
        tids[lane] = i + 1
        label_ = f"host {name}" if kind == "host" else f"stream {name}"
        events.append({"ph": "M", "pid": pids[lane], "tid": tids[lane], "name": "thread_name",
                       "args": {"name": label_}})
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
        starts.setdefault(e.src_op, []).append((flow_base + k + 1, e))
    ends = {e.dst_op: [] for e in tl.edges}
    for k, e in enumerate(tl.edges):
        ends[e.dst_op].append((flow_base + k + 1, e))
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
                      "pid": device_pid, "args": {"items": 0}})
        for t, c in zip(ld.times_us[pick].tolist(), ld.counts[pick].tolist()):
            timed.append({"ph": "C", "name": name, "ts": t, "pid": device_pid, "args": {"items": int(c)}})
    for m in tl.marks:
        if m.kind == "clean":
            continue
        timed.append({"ph": "i", "s": "t", "name": m.text, "cat": m.kind, "ts": m.time_us, **at(m.lane),
                      "args": {"op": m.op, **m.args}})
    timed.sort(key=lambda ev: ev["ts"])          # stable: issue order among equal stamps
    return events, timed


def write_trace(path: str, tl) -> None:
    """Write ``chrome_trace(tl)`` as JSON to ``path`` ('-': stdout); ``tl`` may
    also be a list of ``(label, Timeline)`` (``combined_trace``)."""
    from sim.report_io import write_json

    write_json(chrome_trace(tl) if isinstance(tl, Timeline) else combined_trace(tl), path)


#: the op kinds a GPU run times (each between two CUDA events on its stream)
TIMED_KINDS = ("copy", "read", "write", "compute")


def measured_timeline(schedule, timings_us: dict, statuses: dict | None = None, *, name: str | None = None,
                      source: str | None = None) -> Timeline:
    """The timeline of a run of ``schedule`` measured on a GPU.

    ``timings_us``: op id -> (start, end) in microseconds from the run's start,
    for the ops the GPU times (``TIMED_KINDS``: the runner brackets each with
    two CUDA events); these become slices as in ``timeline``.  ``statuses``:
    read op id -> (kind, text) for the read's mark (``clean``, ``stale``,
    ``torn``, ``mismatch``, ...), placed at the read's start.

    A CUDA event is a marker, not timed work, so ``record`` and ``wait`` ops are
    given *inferred* zero-or-more-length slices (``args["inferred"] = True``):
    a record at the end of the latest earlier op of its stream (when the
    event completes), a wait from that point on its stream to when its record
    completed (clipped to the start of the next timed op of its stream, which
    the GPU ran after the wait released it).  The record -> wait edges join
    those.  Host ops are not timed on the GPU and have no slices; lanes are
    the schedule's streams (and only those hosts that have slices: none).
    There are no item landings (a GPU copy reports its start and end only)."""
    statuses = statuses or {}
    unknown = sorted(set(timings_us) - {op.id for op in schedule.ops})
    if unknown:
        raise ValueError(f"timings for ops the schedule does not have: {unknown[:5]}")
    ops = [op for op in schedule.ops if op.stream is not None]
    next_start: dict[int, float] = {}         # op index -> start of the next timed op on its stream
    upcoming: dict[str, float] = {}
    for op in reversed(ops):
        if op.id in timings_us and op.op in TIMED_KINDS:
            upcoming[op.stream] = float(timings_us[op.id][0])
        elif op.stream in upcoming:
            next_start[op.index] = upcoming[op.stream]
    last_end = {st: 0.0 for st in schedule.streams}
    record_at: dict[int, float] = {}
    slices, marks, edges = [], [], []
    for op in ops:
        lane = f"stream:{op.stream}"
        if op.op in TIMED_KINDS:
            if op.id not in timings_us:
                continue
            t0, t1 = (float(x) for x in timings_us[op.id])
            args = {"op": op.op, "measured": True}
            if op.op == "copy":
                args.update(routine=op.routine, src=op.src, dst=op.dst, items=int(op.plan.extents.n_items))
            elif op.op in ("read", "write"):
                args.update(_access_args(op))
            slices.append(Slice(op.id, op.op, lane, t0, t1, args))
            last_end[op.stream] = max(last_end[op.stream], t1)
            if op.op == "read" and op.id in statuses:
                kind, text = statuses[op.id]
                marks.append(Mark(kind, lane, t0, op.id, text, {"buffer": op.buffer}))
        elif op.op == "record":
            t = last_end[op.stream]
            record_at[op.index] = t
            slices.append(Slice(op.id, "record", lane, t, t, {"op": "record", "event": op.event, "inferred": True}))
        elif op.op == "wait":
            t0 = last_end[op.stream]
            t1 = max(t0, record_at.get(op.bound_record, t0))
            if op.index in next_start and next_start[op.index] >= t0:
                t1 = min(t1, next_start[op.index])
            slices.append(Slice(op.id, "wait", lane, t0, t1, {"op": "wait", "event": op.event, "inferred": True}))
            last_end[op.stream] = t1
            if op.bound_record is not None and op.bound_record in record_at:
                rec = schedule.ops[op.bound_record]
                edges.append(Edge("record->wait", rec.id, op.id, f"stream:{rec.stream}", lane,
                                  record_at[op.bound_record], t1))
    end = max([sl.end_us for sl in slices], default=0.0)
    return Timeline(name or schedule.name, source, [f"stream:{st}" for st in schedule.streams], slices, [], marks,
                    edges, end, clock="measured")
