"""A window of a run as a self-contained schedule (format 2).

``cut_window(run, t0=..., t1=...)`` or ``cut_window(run, ops=[...])`` turns part
of a run (:class:`sim.executor.RunResult` of ``run_schedule`` or
``run_programs``) into a schedule document that, run with the same profile
(``run_schedule(validate(doc), profile, torn=run.torn)``), predicts the same
bytes for every kept read, and whose happens-before among the kept ops is the
run's.

**What is kept** (stream ops only; the run's host ops are never kept):

1. *Seed.*  Time window: every stream op whose run interval ``[start, end]``
   overlaps ``[t0, t1)`` (``start < t1`` and ``end > t0``, or ``start`` in
   ``[t0, t1)``).  Op set: the named ops and, on each of their streams, every op
   between the first and the last named op of that stream (their stream order
   stays exactly the run's).
2. *Bindings.*  The record each kept wait bound to (a record is instant; one
   that ran before the window is issued when it ran).
3. *Byte order.*  The run's byte accesses form one sequence (copy items by
   landing time, then op index, as ``Executor._advance`` applies them; a read or
   write after the items landed by its access, in ``access_seq`` order).  Let
   ``T`` be the buffers kept ops touch (read, write, copy source and
   destination).  Every dropped copy or write with an access between the first
   and the last access of a kept op, writing a buffer of ``T``, is kept.
4. *Racing writers.*  Every dropped copy or write that writes a buffer a kept op
   reads (a read's buffer, a copy's source) and is unordered with that reader by
   happens-before is kept: the copies a read raced come with it.
5. *In flight.*  Every dropped copy into a buffer of ``T`` that is in flight
   (started, last item not landed) when a kept op touches bytes is kept whole:
   a copy overlapping the window is included whole and the window starts at its
   start.

2-5 repeat until nothing changes.  Afterwards no dropped op changes a byte of
``T`` between the first and the last access of a kept op, and the window starts
at the first access of a kept op in that sequence.

**Contents at the window's start.**  Each buffer of ``T`` starts with its
contents just before that first access: the accesses before it in the sequence
above, re-applied to a fresh :class:`~sim.memory.Memory` by the executor's own
functions (``apply_copy`` per group of a copy's items that landed together,
``write_units``).  That is exact: the executor applies landed items lazily but
always in that order, and every mutation the run made before the window's start
is in the prefix.  (Re-running a truncated schedule was the alternative; it is
exact only when dropping the later ops changes no earlier timing or random
draw, which ties and jitter do not guarantee.)  Only the bytes the kept ops touch
are written (a read's or write's extents, a copy's source and destination extents):
nothing else of a buffer can reach a kept read, and a window of a large pool stays
small.  Those contents are written as one general ``init`` fill per buffer::

    "init": [{"segments": [[offset, nbytes, kind, layer, owner, version, unit_bytes, stream_offset], ...]}]

bytes ``[offset, offset+nbytes)`` hold pattern bytes ``[stream_offset,
stream_offset+nbytes)`` of origin ``(kind, layer, owner, version, unit_bytes)``
(any provenance: another kind's bytes, ``oob:<buffer>`` origins, part units);
segments are disjoint and in address order, each one counts as a fill against
``MAX_INIT_FILLS`` (see ``sim.schedule._parse_segments``; applied to both byte
models by ``Memory._init_buffer``).  A buffer of more than MAX_INIT_FILLS
segments at the window's start cannot be cut (InputError).

**Time.**  The cut keeps the run's clock: every kept op is issued at the time it
started in the run (a copy at the time it took its link, a wait no earlier than
its record's issue), so it starts when it started in the run, whatever dropped
op held its stream before it.  Ops issued at one time go out in list order,
except that reads and writes on different streams go out in the order they
touched bytes in the run (``access_seq``) and copies on different streams in the
order they started; each increasing run of that sequence is one host (``host``,
then ``at1``, ``at2``, ...), whose only host op is a leading ``host_delay`` to
its time, and hosts of one time issue in declaration order.  Kept ``compute``
ops get ``duration_us`` 0 (their time is carried by the next op's issue time;
the run's duration is in their ``note``), so compute jitter cannot move them.
Exact (same read times, same bytes) when the profile has no launch skew
(``launch_jitter_us`` 0) and the ops that meet at one same-instant gate go in
the run's order: run the cut with ``ties=window_ties(run, doc)`` (explicit
ties: reads and writes in the run's access order, then copies in the order they
started) for
that; with the default ``fifo`` ties it holds unless a same-instant tie among
kept ops is resolved differently (the run used seeded or explicit ties, or an
added sync or a dropped op changed which op reached the gate first).

**Happens-before from outside the window** (the rule).  The cut's own edges are
the run's stream order among kept ops and record -> wait among kept pairs
(every record is renamed ``<event>@<record id>`` so a wait binds to its own
record; a wait that bound to no record stays unbound, ``<event>@unbound``).
Every run edge that reaches a kept op only through dropped ops or host ops
(``host_sync``, a positive ``host_query``, a ``barrier``, a wait whose stream
order was through a dropped op) becomes a sync: for kept ops ``A`` (stream X)
and ``B`` with ``A`` happens-before ``B`` in the run but not yet in the cut, with
``A`` the latest such op of X, a ``record`` of event ``hb@<A>`` right after ``A``
and a ``wait`` on it right before ``B``.  Such a wait never delays ``B`` (``A``
completed before ``B`` started in the run).  Edges from dropped ops that ran
before the window need nothing: their effects are in the contents at the
window's start (and rule 4 keeps every dropped writer that is *not* ordered
before a kept reader).  So happens-before restricted to the kept ops is the
run's, and latent races among kept ops are the run's.  A read's *expected*
bytes (``run_reference``) are those of the cut's issue order from the contents
at the window's start; they equal the run's expected bytes unless a race wholly
among dropped ops (both ordered before the read) left its outcome in those
contents: the cut takes that outcome as given.
"""
from __future__ import annotations

import copy as _copy
import math

import numpy as np

from sim.errors import InputError
from sim.executor import TieBreak
from sim.hb import HappensBefore, merge_intervals
from sim.memory import Memory, clip_extents
from sim.schedule import DEFAULT_HOST, MAX_HOSTS, SCHEMA_VERSION, validate

__all__ = ["cut_window", "snapshot_at", "window_ties"]

MEMORY_OPS = ("copy", "read", "write")


def _effects(run, op) -> tuple[float, float]:
    """[first, last] time op touches bytes (copy: its run interval to its last item)."""
    if op.op == "copy":
        ends = run.item_end_us.get(op.id)
        s = run.timings[op.id][0]
        return s, (float(ends.max()) if ends is not None and ends.size else s)
    t = run.access_us[op.id]
    return t, t


def _writes(op) -> str | None:
    return op.dst if op.op == "copy" else (op.buffer if op.op == "write" else None)


def _touches(op) -> tuple[str, ...]:
    if op.op == "copy":
        return (op.src, op.dst)
    if op.op in ("read", "write"):
        return (op.buffer,)
    return ()


def _events(run) -> list[tuple]:
    """Every byte access of the run in the executor's order: ``(time, rank, seq, op, a, b)``;
    rank 0: items ``[a, b)`` of a copy that landed together (by landing time, then op
    index: the order ``Executor._advance`` applies them); rank 1: a read or write touching
    its bytes (after every item landed by then, in ``access_seq`` order)."""
    s = run.schedule
    out = []
    for op in s.ops:
        if op.op == "copy":
            ends = np.asarray(run.item_end_us.get(op.id, np.zeros(0)), float)
            if not ends.size:
                continue
            cuts = np.flatnonzero(np.diff(ends)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, ends.size]):
                out.append((float(ends[a]), 0, op.index, op, int(a), int(b)))
        elif op.op in ("read", "write"):
            out.append((run.access_us[op.id], 1, run.access_seq[op.id], op, None, None))
    out.sort(key=lambda x: x[:3])
    return out


def _apply(run, events) -> Memory:
    """A fresh Memory of the run's buffers with ``events`` (from :func:`_events`, in order)
    applied by the executor's own functions (compact model only)."""
    s = run.schedule
    mem = Memory(s.buffers, materialise=False)
    clipped = {}
    for _, _, _, op, a, b in events:
        if op.op == "copy":
            c = clipped.get(op.id)
            if c is None:
                src, dst = s.buffers[op.src], s.buffers[op.dst]
                c = clipped[op.id] = clip_extents(op.plan.extents, src.nbytes, dst.nbytes)
            bounds = np.searchsorted(c.item, [a, b])
            mem.apply_copy(op.src, op.dst, c, slice(int(bounds[0]), int(bounds[1])))
        elif op.op == "write":
            mem.apply_write(op)
    return mem


def _whole(run) -> None:
    """A window is cut from a run's recorded ops and effects: a keep="report" run has neither."""
    if getattr(run, "kept", "all") != "all":
        raise InputError("window", "a window is cut from a run kept whole; expected a run with keep='all' "
                         "(this one kept its report only)")


def snapshot_at(run, before_us: float) -> Memory:
    """The run's memory (compact model) with every mutation that happened before
    ``before_us`` applied, in the executor's order (see :func:`_events`)."""
    _whole(run)
    return _apply(run, [e for e in _events(run) if e[0] < before_us])


def _touched_ranges(s, ops) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per buffer, the byte ranges ``[start, end)`` that ``ops`` touch (a read's or write's
    extents, a copy's source and destination extents), clipped to the buffer, sorted and merged."""
    parts: dict[str, list] = {}
    for o in ops:
        if o.op == "copy":
            e = o.plan.extents
            n = np.asarray(e.length, np.int64)
            for name, offs in ((o.src, e.src), (o.dst, e.dst)):
                offs = np.asarray(offs, np.int64)
                parts.setdefault(name, []).append((offs, offs + n))
        elif o.op in ("read", "write"):
            offs, lens = (np.asarray(x, np.int64) for x in o.extents)
            parts.setdefault(o.buffer, []).append((offs, offs + lens))
    out = {}
    for name, lst in parts.items():
        nb = s.buffers[name].nbytes
        a = np.clip(np.concatenate([x[0] for x in lst]), 0, nb)
        b = np.clip(np.concatenate([x[1] for x in lst]), 0, nb)
        out[name] = merge_intervals(a, b)
    return out


def _segments(mem: Memory, name: str, ranges: tuple[np.ndarray, np.ndarray] | None = None) -> list[list]:
    """The buffer's contents inside ``ranges`` (sorted, disjoint; None: the whole buffer) as
    ``init`` segments: each segment of the compact model cut to the parts of it in a range."""
    buf = mem.compact[name]
    st, oid, soff = buf.segments()
    ends = np.r_[st[1:], buf.nbytes]
    if ranges is None:
        ranges = (np.zeros(1, np.int64), np.full(1, buf.nbytes, np.int64))
    rows = []
    for lo, hi in zip(*(r.tolist() for r in ranges)):
        k = int(np.searchsorted(st, lo, side="right")) - 1
        while k < st.size and st[k] < hi:
            a, e = max(int(st[k]), lo), min(int(ends[k]), hi)
            if e > a:
                g = mem.table[int(oid[k])]
                rows.append([a, e - a, g.kind, g.layer, g.owner, g.version, g.unit_bytes,
                             int(soff[k]) + a - int(st[k])])
            k += 1
    return rows


def _seed(run, t0, t1, ops) -> set[int]:
    s = run.schedule
    if ops is not None:
        if t0 is not None or t1 is not None:
            raise InputError("window", "expected either t0/t1 or ops, not both")
        ids = list(ops)
        if not ids:
            raise InputError("window.ops", "expected at least one op id")
        by_id = {o.id: o for o in s.ops}
        chosen = []
        for k in ids:
            if k not in by_id:
                raise InputError("window.ops", f"unknown op id {k!r}")
            if by_id[k].stream is None:
                raise InputError("window.ops", f"{k!r} is a host op; a window keeps stream ops (host "
                                 "ops' ordering becomes record/wait syncs)")
            chosen.append(by_id[k])
        keep = set()
        for st in {o.stream for o in chosen}:
            idx = [o.index for o in chosen if o.stream == st]
            lo, hi = min(idx), max(idx)
            keep |= {o.index for o in s.ops if o.stream == st and lo <= o.index <= hi}
        return keep
    if t0 is None or t1 is None:
        raise InputError("window", "expected t0 and t1 (microseconds) or ops")
    if not (isinstance(t0, (int, float)) and isinstance(t1, (int, float)) and math.isfinite(t0)
            and math.isfinite(t1) and t0 < t1):
        raise InputError("window", f"expected finite t0 < t1, got {t0!r}, {t1!r}")
    keep = set()
    for o in s.ops:
        if o.stream is None:
            continue
        a, b = run.timings[o.id]
        if (a < t1 and b > t0) or t0 <= a < t1:
            keep.add(o.index)
    if not keep:
        raise InputError("window", f"no stream op of the run overlaps [{t0}, {t1})")
    return keep


def _close(run, keep: set[int], events, hb: HappensBefore) -> tuple[set[int], int]:
    """Rules 2-5 of the module doc, to a fixpoint; returns the kept op indices and the
    position in ``events`` of the first byte access of a kept op (the window's start)."""
    s = run.schedule
    while True:
        n = len(keep)
        for i in list(keep):
            o = s.ops[i]
            if o.op == "wait" and o.bound_record is not None:
                keep.add(o.bound_record)
        pos = [k for k, e in enumerate(events) if e[3].index in keep]
        if not pos:
            return keep, len(events)
        p0, p1 = pos[0], pos[-1]
        mem_ops = [s.ops[i] for i in keep if s.ops[i].op in MEMORY_OPS]
        touched = {b for o in mem_ops for b in _touches(o)}
        # mutations of touched buffers between the first and the last kept access
        for e in events[p0 + 1:p1]:
            if e[3].index not in keep and _writes(e[3]) in touched:
                keep.add(e[3].index)
        # racing writers: a dropped writer of a buffer a kept op reads (a read's buffer, a
        # copy's source), unordered with that reader by happens-before
        has_effect = {e[3].index for e in events}
        for r in mem_ops:
            src = r.buffer if r.op == "read" else (r.src if r.op == "copy" else None)
            if src is None:
                continue
            for o in s.ops:
                if (o.index not in keep and o.index in has_effect and _writes(o) == src
                        and hb.concurrent(o.index, r.index)):
                    keep.add(o.index)
        # copies in flight (started, not all landed) while a kept op touches bytes
        times = [run.access_us[o.id] for o in mem_ops if o.op != "copy"]
        times += [float(t) for o in mem_ops if o.op == "copy" for t in run.item_end_us.get(o.id, ())]
        for o in s.ops:
            if o.index in keep or o.op != "copy" or o.dst not in touched:
                continue
            a, b = _effects(run, o)
            if any(a <= t < b for t in times):
                keep.add(o.index)
        if len(keep) == n:
            return keep, p0


def _issue_sequence(run, group: list[int]) -> list[int]:
    """The order to issue ``group`` (op indices issued at one instant, in list order):
    list order, except that two reads/writes on different streams go in the order they
    touched bytes in the run, and two copies on different streams in the order they
    started; where those orders conflict, list order wins."""
    s = run.schedule

    active = {k: n for n, k in enumerate(run.item_end_us)}     # copies in the order they started

    def rank(o):
        if o.op in ("read", "write"):
            return (0, run.access_seq[o.id])
        if o.op == "copy" and o.id in active:
            return (1, active[o.id])
        return None

    def before(y, x):            # must y be issued before x?
        oy, ox = s.ops[y], s.ops[x]
        ry, rx = rank(oy), rank(ox)
        if ry is not None and rx is not None and ry[0] == rx[0] and oy.stream != ox.stream:
            return ry < rx
        return y < x

    rem = list(group)
    seq = []
    while rem:
        free = [x for x in rem if not any(before(y, x) for y in rem if y != x)]
        pick = min(free) if free else rem[0]
        seq.append(pick)
        rem.remove(pick)
    return seq


def cut_window(run, *, t0: float | None = None, t1: float | None = None, ops=None,
               name: str | None = None) -> dict:
    """Cut a window of ``run`` (a time window ``[t0, t1)`` in microseconds, or a set of
    stream op ids ``ops``) into a self-contained format 2 schedule document (see the
    module docstring for exactly what is kept, the contents at the window's start and
    the rule for happens-before edges from outside).  The document is validated before
    it is returned; op ids of kept ops are the run's."""
    if run.profile is None:
        raise InputError("window", "expected a run of run_schedule or run_programs, not a reference run")
    _whole(run)
    s = run.schedule
    accesses = _events(run)
    hb = HappensBefore(s)
    keep, p0 = _close(run, _seed(run, t0, t1, ops), accesses, hb)
    base = accesses[p0][0] if p0 < len(accesses) else min(run.timings[s.ops[i].id][0] for i in keep)
    kept = sorted(keep)
    start = {i: run.timings[s.ops[i].id][0] for i in kept}

    # issue times: the run's start (a wait no earlier than its kept record's issue)
    issue: dict[int, float] = {}
    for i in kept:
        o = s.ops[i]
        t = start[i]
        if o.op == "wait" and o.bound_record in keep:
            t = max(t, issue[o.bound_record])
        issue[i] = t

    # happens-before from outside: record after A, wait before B (see module doc)
    streams_kept = sorted({s.ops[i].stream for i in kept}, key=list(s.streams).index)
    clock: dict[int, dict[str, int]] = {}
    last_on: dict[str, int] = {}
    added_rec: set[int] = set()                    # kept ops followed by an hb record
    waits_before: dict[int, list[int]] = {}        # kept op -> A's it waits for
    for i in kept:
        o = s.ops[i]
        c: dict[str, int] = dict(clock[last_on[o.stream]]) if o.stream in last_on else {}
        if o.op == "wait" and o.bound_record in keep:
            for k, v in clock[o.bound_record].items():
                c[k] = max(c.get(k, -1), v)
        for x in streams_kept:
            if x == o.stream:
                continue
            cands = [j for j in kept if j < i and s.ops[j].stream == x and hb.ordered(j, i)]
            if not cands:
                continue
            a = max(cands)
            if c.get(x, -1) >= a:
                continue
            added_rec.add(a)
            waits_before.setdefault(i, []).append(a)
            for k, v in clock[a].items():
                c[k] = max(c.get(k, -1), v)
        c[o.stream] = i
        clock[i] = c
        last_on[o.stream] = i

    # hosts: the ops issued at one time go out in list order, except that reads and writes
    # go out in the order they touched bytes in the run (access_seq: the order same-instant
    # ties were resolved in, whatever gate batch they met at), so that the cut's fifo ties
    # meet them in that order; each increasing run of that sequence is one host, and hosts
    # of one time issue in declaration order
    times = sorted(set(issue.values()))
    hosts: list[tuple[str, float]] = []
    host_of: dict[int, str] = {}
    for t in times:
        seq = _issue_sequence(run, [i for i in kept if issue[i] == t])
        runs: list[list[int]] = []
        for i in seq:
            if runs and i > runs[-1][-1]:
                runs[-1].append(i)
            else:
                runs.append([i])
        for r in runs:
            # the first issuer is named "host" (DEFAULT_HOST) so that ops added without a host
            # (e.g. sim.replay.controlled_schedule's record/wait pairs) belong to a declared host
            name = DEFAULT_HOST if not hosts else f"at{len(hosts)}"
            hosts.append((name, t))
            for i in r:
                host_of[i] = name
    if len(hosts) > MAX_HOSTS:
        raise InputError("window", f"the window's ops need {len(hosts)} issuing hosts (one per start time); "
                         f"a schedule has at most {MAX_HOSTS} (MAX_HOSTS): cut a smaller window")
    out_ops: list[dict] = []
    for name, t in hosts:
        if t > 0:
            out_ops.append({"id": f"delay_{name}", "op": "host_delay", "host": name, "duration_us": t,
                            "note": "issue the ops of this host when they started in the run"})
    events: list[str] = []
    record_name: dict[int, str] = {}
    for i in kept:
        o = s.ops[i]
        h = host_of[i]
        for a in waits_before.get(i, ()):
            ev = f"hb@{s.ops[a].id}"
            out_ops.append({"id": f"hb_wait:{s.ops[a].id}->{o.id}", "op": "wait", "stream": o.stream,
                            "event": ev, "host": h,
                            "note": f"{s.ops[a].id} happens before {o.id} in the run through dropped or host ops"})
        d = {k: _copy.deepcopy(v) for k, v in o.raw.items() if k not in ("host",)}
        d["id"], d["host"] = o.id, h
        if o.op == "record":
            record_name[i] = d["event"] = f"{o.event}@{o.id}"
            events.append(d["event"])
        elif o.op == "wait":
            if o.bound_record in keep:
                d["event"] = record_name[o.bound_record]
            else:
                d["event"] = f"{o.event}@unbound"
                if d["event"] not in events:
                    events.append(d["event"])
        elif o.op == "compute":
            a, b = run.timings[o.id]
            d["duration_us"] = 0
            d["note"] = f"ran {b - a:.6g} us ({o.duration_us:g} us asked) in the run; the next op's issue time carries it"
        out_ops.append(d)
        if i in added_rec:
            ev = f"hb@{o.id}"
            events.append(ev)
            out_ops.append({"id": f"hb_rec:{o.id}", "op": "record", "stream": o.stream, "event": ev, "host": h})

    # buffers with their contents at the window's start
    ranges = _touched_ranges(s, [s.ops[i] for i in sorted(kept)])
    touched = [b for b in s.buffers if b in ranges]
    mem = _apply(run, accesses[:p0])
    raw_bufs = {b["name"]: b for b in s.raw.get("buffers", [])}
    buffers = []
    for b in touched:
        d = {k: _copy.deepcopy(v) for k, v in raw_bufs[b].items() if k != "init"}
        d["init"] = [{"segments": _segments(mem, b, ranges[b])}]
        buffers.append(d)
    raw_streams = s.raw.get("streams", [])
    streams = [st for st in raw_streams
               if (st if isinstance(st, str) else st.get("name")) in set(streams_kept)]
    what = f"ops {sorted(ops)}" if ops is not None else f"[{t0}, {t1}) us"
    doc = {
        "kvrace_schedule": SCHEMA_VERSION,
        "name": name or f"{s.name}.window",
        "description": (f"Window {what} of a run of {s.name}: {len(kept)} ops, contents of "
                        f"{len(touched)} buffers at {base:.6g} us (see sim/window.py)."),
        "hosts": [name for name, _ in hosts],
        "buffers": buffers,
        "streams": streams,
        "events": events,
        "ops": out_ops,
    }
    validate(doc)
    return doc


def window_ties(run, doc: dict) -> TieBreak:
    """Explicit ties for running a cut of ``run``: reads and writes in the order they
    touched bytes in the run, then copies in the order they started (took their link).  With them,
    ops of the cut that meet at one same-instant gate go in the run's order even
    where the cut's syncs or the run's own seeded/explicit ties would put them
    otherwise (``run_schedule(validate(doc), profile, ties=window_ties(run, doc))``)."""
    _whole(run)
    ids = {d.get("id") for d in doc.get("ops", [])}
    rw = sorted((o for o in run.schedule.ops if o.id in ids and o.op in ("read", "write")),
                key=lambda o: run.access_seq[o.id])
    active = {k: n for n, k in enumerate(run.item_end_us)}     # copies in the order they started
    cp = sorted((o for o in run.schedule.ops if o.id in ids and o.op == "copy"),
                key=lambda o: (active.get(o.id, len(active)), o.index))
    return TieBreak("explicit", first=tuple(o.id for o in rw + cp))
