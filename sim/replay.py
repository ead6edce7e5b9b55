"""From a simulated run to schedules a GPU can replay and check.

**Controlled replay** (:func:`controlled_schedule`): every racing pair of the
schedule is forced into the order the simulator chose.  A copy that a read (or
write) observed part-way is split at that item boundary into two copies of the
same routine over the sliced indices; events are inserted so that the items the
simulator had landed land before the read, and the rest start after it.  The
result is itself a schedule, with no latent race left, so on a GPU it must give
exactly the bytes the simulator predicted for the original run with item-atomic
landing (``torn=False``).  The transform checks that by simulating its own
output.

**Free replay** (:func:`possible_provenance`): the schedule runs unchanged many
times; each observed read must consist, word by word, of bytes the read's
position holds at some point of the happens-before-order execution (old or new).
"""
from __future__ import annotations

import copy as _copy
from dataclasses import dataclass

import networkx as nx
import numpy as np

from sim.executor import RunResult, run_reference
from sim.hb import HappensBefore, latent_races
from sim.memory import Memory, clip_extents
from sim.schedule import Schedule, validate
from sim.transfers.routines import slice_items


class ReplayError(Exception):
    """The simulated interleaving cannot be forced with streams and events alone."""


@dataclass
class Forced:
    """Force: items [0, cut) of ``copy`` land before ``other``, the rest start after it.
    For two instant ops or two whole copies: ``copy`` (all of it) before ``other``."""

    copy: int
    other: int
    cut: int | None


def _forcings(s: Schedule, run: RunResult) -> list[Forced]:
    hb = HappensBefore(s)
    out = []
    seen = set()
    for race in latent_races(s, hb):
        a, b = s.ops[race["a"].op], s.ops[race["b"].op]
        key = (a.index, b.index)
        if key in seen:
            continue
        seen.add(key)
        if a.op == "copy" and b.op == "copy":
            (sa, ea), (sb, eb) = run.timings[a.id], run.timings[b.id]
            if ea <= sb:
                out.append(Forced(a.index, b.index, None))
            elif eb <= sa:
                out.append(Forced(b.index, a.index, None))
            else:
                raise ReplayError(f"copies {a.id} and {b.id} race and overlapped in time; "
                                  "their item interleaving cannot be forced")
        elif a.op == "copy" or b.op == "copy":
            c, x = (a, b) if a.op == "copy" else (b, a)
            ends = run.item_end_us.get(c.id, np.zeros(0))
            k = int(np.searchsorted(ends, run.access_us[x.id], side="right"))
            out.append(Forced(c.index, x.index, k))
        else:
            first, second = sorted((a, b), key=lambda o: run.access_seq[o.id])
            out.append(Forced(first.index, second.index, None))
    return out


def controlled_schedule(s: Schedule, run: RunResult, verify: bool = True) -> dict:
    """A race-free schedule that forces ``run``'s interleaving (see module doc).

    ``run`` must come from ``run_schedule(..., torn=False)``: a controlled
    replay can force item boundaries, not bytes inside an item.
    """
    if run.schedule is not s:
        raise ValueError("run must be a run of this schedule")
    if run.torn:
        raise ReplayError("a controlled replay forces item boundaries, not bytes inside an item: "
                          "simulate with torn=False (kvrace schedule run --item-atomic)")
    forced = _forcings(s, run)
    cuts: dict[int, set] = {}
    for f in forced:
        n = s.ops[f.copy].plan.extents.n_items if s.ops[f.copy].op == "copy" else 1
        if f.cut is not None and 0 < f.cut < n:
            cuts.setdefault(f.copy, set()).add(f.cut)

    # new ops: per original op a list of (key, dict); key orders ops deterministically
    events = []
    record_name: dict[int, str] = {}       # original record op index -> unique event name
    new_ops: list[tuple[tuple, dict]] = []
    seg_of: dict[tuple[int, int], str] = {}   # (copy index, item a) -> id of the segment starting at a
    seg_end: dict[tuple[int, int], str] = {}  # (copy index, item b) -> id of the segment ending at b

    def add(key, d):
        new_ops.append((key, d))

    for op in s.ops:
        if op.op == "copy":
            n = op.plan.extents.n_items
            bounds = [0, *sorted(cuts.get(op.index, ())), n]
            for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                if a == b and n:
                    continue
                seg_id = op.id if len(bounds) == 2 else f"{op.id}#{a}-{b}"
                d = {"id": seg_id, "op": "copy", "stream": op.stream, "routine": op.routine,
                     "src": op.src, "dst": op.dst,
                     "args": slice_items(op.routine, op.args, a, b) if len(bounds) > 2
                     else _copy.deepcopy(op.args)}
                add((op.index, j, 0), d)
                seg_of[(op.index, a)] = seg_id
                seg_end[(op.index, b)] = seg_id
        else:
            d = _copy.deepcopy(op.raw)
            d["id"] = op.id
            if op.op == "record":
                name = f"{op.event}@{op.id}"
                record_name[op.index] = name
                events.append(name)
                d["event"] = name
            elif op.op in ("wait", "host_sync") and op.bound_record is not None:
                d["event"] = record_name[op.bound_record]
            add((op.index, 0, 0), d)

    by_id = {d["id"]: (key, d) for key, d in new_ops}
    extra_edges = []

    def force(before_id, before_key, after_id, after_key):
        b_stream = by_id[before_id][1]["stream"]
        a_stream = by_id[after_id][1]["stream"]
        ev = f"force{len(events)}"
        events.append(ev)
        rec = {"id": f"rec_{ev}", "op": "record", "stream": b_stream, "event": ev,
               "note": f"{before_id} before {after_id}"}
        wait = {"id": f"wait_{ev}", "op": "wait", "stream": a_stream, "event": ev}
        # the record goes right after the op it marks, the wait right before the op it holds
        add((before_key[0], before_key[1], len(new_ops)), rec)
        add((after_key[0], after_key[1], -len(new_ops)), wait)
        extra_edges.append((before_id, rec["id"]))
        extra_edges.append((rec["id"], wait["id"]))
        extra_edges.append((wait["id"], after_id))

    for f in forced:
        c, x = s.ops[f.copy], s.ops[f.other]
        if f.cut is None:
            first = seg_end[(c.index, c.plan.extents.n_items)] if c.op == "copy" else c.id
            second = seg_of[(x.index, 0)] if x.op == "copy" else x.id
            force(first, by_id[first][0], second, by_id[second][0])
            continue
        n = c.plan.extents.n_items
        if f.cut > 0:
            seg = seg_end[(c.index, f.cut)]
            force(seg, by_id[seg][0], x.id, by_id[x.id][0])
        if f.cut < n:
            seg = seg_of[(c.index, f.cut)]
            force(x.id, by_id[x.id][0], seg, by_id[seg][0])

    ordered = _issue_order(s, new_ops, extra_edges)
    doc = _copy.deepcopy(s.raw)
    doc["name"] = f"{s.name}.controlled"
    doc["description"] = f"Controlled replay of {s.name}: the simulator's interleaving forced with events."
    doc["events"] = events
    doc["ops"] = ordered
    if verify:
        _verify(s, run, doc)
    return doc


def _issue_order(s: Schedule, new_ops, extra_edges) -> list[dict]:
    """Order new ops so every record precedes its waits, streams keep their order,
    and host ops keep their place; refuse when that is impossible."""
    g = nx.DiGraph()
    key_of = {}
    for key, d in new_ops:
        g.add_node(d["id"])
        key_of[d["id"]] = key
    by_stream: dict[str, list] = {}
    host_ops = []
    for key, d in sorted(new_ops, key=lambda kd: kd[0]):
        if d.get("stream") is not None:
            by_stream.setdefault(d["stream"], []).append(d["id"])
        else:
            host_ops.append(d["id"])
    for ids in by_stream.values():
        g.add_edges_from(zip(ids[:-1], ids[1:]))
    record_of = {d["event"]: d["id"] for _, d in new_ops if d["op"] == "record"}
    for _, d in new_ops:
        if d["op"] in ("wait", "host_sync") and "event" in d:
            g.add_edge(record_of[d["event"]], d["id"])
    g.add_edges_from(extra_edges)
    for h in host_ops:
        hk = key_of[h][0]
        for other, key in key_of.items():
            if other != h and key[0] < hk:
                g.add_edge(other, h)
            elif other != h and key[0] > hk:
                g.add_edge(h, other)
    try:
        order = list(nx.lexicographical_topological_sort(g, key=lambda n: key_of[n]))
    except nx.NetworkXUnfeasible:
        raise ReplayError("the simulated interleaving conflicts with the schedule's host syncs; "
                          "it cannot be forced") from None
    d_of = {d["id"]: d for _, d in new_ops}
    return [d_of[i] for i in order]


def _verify(s: Schedule, run: RunResult, doc: dict) -> None:
    cs = validate(doc)
    left = [r for r in latent_races(cs) if {cs.ops[r["a"].op].op, cs.ops[r["b"].op].op} & {"read", "write"}]
    if left:
        r = left[0]
        raise ReplayError(f"controlled schedule still races: {cs.ops[r['a'].op].id} vs {cs.ops[r['b'].op].id}")
    ref = {r.op_id: r.bytes() for r in run_reference(cs).reads}
    for r in run.reads:
        if not np.array_equal(ref[r.op_id], r.bytes()):
            raise ReplayError(f"controlled schedule does not reproduce read {r.op_id}")


def possible_provenance(s: Schedule) -> dict[str, list]:
    """For every read: the views of its bytes at each point of the happens-before
    order execution (before and after every op that writes the buffer).  A free
    replay's read is plausible when each 8-byte word equals one of these states'
    words at the same position."""
    mem = Memory(s.buffers, materialise=True)
    states: dict[str, list] = {}
    reads = [op for op in s.ops if op.op == "read"]
    snap = {op.id: [] for op in reads}

    def record():
        for op in reads:
            offs, lens = op.extents
            snap[op.id].append(np.concatenate([mem.view(op.buffer, int(o), int(n)).bytes()
                                               for o, n in zip(offs, lens)]))
    record()
    for op in s.ops:
        if op.op == "copy":
            src, dst = s.buffers[op.src], s.buffers[op.dst]
            mem.apply_copy(op.src, op.dst, clip_extents(op.plan.extents, src.nbytes, dst.nbytes))
            record()
        elif op.op == "write":
            offs, lens = op.extents
            mem.write_units(op.buffer, op.layer, op.units, offs, lens, op.owner, op.version)
            record()
    for k, v in snap.items():
        states[k] = v
    return states


def plausible_words(observed: np.ndarray, states: list[np.ndarray]) -> np.ndarray:
    """Per 8-byte word of a read: does it equal that word in one of the states?"""
    n = observed.size // 8 * 8
    obs = observed[:n].view("<u8")
    ok = np.zeros(obs.size, bool)
    for st in states:
        ok |= obs == st[:n].view("<u8")
    return ok
