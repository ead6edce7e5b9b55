"""From a simulated run to schedules a GPU can replay and check.

**Controlled replay** (:func:`controlled_schedule`): every racing pair of the
schedule is forced into the order the simulator chose.  A copy that a read (or
write) observed part-way is split at that item boundary into two copies of the
same routine over the sliced indices; events are inserted so that the items the
simulator had landed land before the read, and the rest start after it.  Two
racing copies that overlapped in time are ordered the same way by when their
items landed, where one of them is a single item.  Host ops keep their place in
the issue order, but a stream op may be issued after a barrier it was listed
before.  The result is itself a schedule, with no latent race left, so on a GPU it must give
exactly the bytes the simulator predicted for the original run with item-atomic
landing (``torn=False``).  The transform checks that by simulating its own
output.

**Free replay** (:func:`possible_provenance`): the schedule runs unchanged many
times; each observed read must consist, word by word, of values the read's
position may hold under some timing: the initial bytes or what any write or
copy not ordered after the read can leave there (a sound over-approximation
built from happens-before; see the function).
"""
from __future__ import annotations

import copy as _copy
from dataclasses import dataclass

import networkx as nx
import numpy as np

from sim.errors import InputError, KvraceError
from sim.executor import RunResult, run_reference
from sim.hb import HappensBefore, latent_races
from sim.memory import Memory, clip_extents
from sim.schedule import DEFAULT_HOST, Schedule, validate
from sim.transfers.routines import slice_items


class ReplayError(KvraceError):
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
                out.append(_overlapping_copies(a, b, run))
        elif a.op == "copy" or b.op == "copy":
            c, x = (a, b) if a.op == "copy" else (b, a)
            ends = run.item_end_us.get(c.id, np.zeros(0))
            k = int(np.searchsorted(ends, run.access_us[x.id], side="right"))
            out.append(Forced(c.index, x.index, k))
        else:
            first, second = sorted((a, b), key=lambda o: run.access_seq[o.id])
            out.append(Forced(first.index, second.index, None))
    return out


def _overlapping_copies(a, b, run: RunResult) -> Forced:
    """Two racing copies that overlapped in time, forced by when their items landed.

    NOTE: in an item-atomic run a copy's item reads its source and writes its destination
    when it lands, so the outcome is the order of the landings. Where one copy is a single
    item, that order is "the other's items landed before it, then it, then the rest": a cut
    like a read's. Two multi-item copies would need their items interleaved, and a landing at
    the very instant of the single item's leaves the order to the tie: both are refused."""
    ends = {c.id: run.item_end_us.get(c.id, np.zeros(0)) for c in (a, b)}
    single = [c for c in (b, a) if ends[c.id].size == 1]
    if single:
        x = single[0]
        c = a if x is b else b
        t = ends[x.id][0]
        k = int(np.searchsorted(ends[c.id], t, side="left"))
        if not (k < ends[c.id].size and ends[c.id][k] == t):
            return Forced(c.index, x.index, k)
    raise ReplayError(f"copies {a.id} and {b.id} race and overlapped in time; "
                      "their item interleaving cannot be forced")


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
                if op.host != DEFAULT_HOST:
                    d["host"] = op.host            # a segment is issued by the copy's host
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
            elif op.op in ("wait", "host_sync", "host_query") and op.event is not None:
                if op.bound_record is not None:
                    d["event"] = record_name[op.bound_record]
                else:      # bound to no record (a CUDA no-op): keep it bound to none
                    d["event"] = f"{op.event}@unbound"
                    if d["event"] not in events:
                        events.append(d["event"])
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
        # NOTE: each is issued by the host of the op it sits beside (a schedule with several
        # hosts declares no default host)
        for added, beside in ((rec, before_id), (wait, after_id)):
            if "host" in by_id[beside][1]:
                added["host"] = by_id[beside][1]["host"]
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
    try:
        cs = validate(doc)
    except InputError as e:
        # NOTE: a stream op moved past its host's barrier must also follow the other
        # participants' barrier ops; an order that breaks that is refused, not returned
        raise ReplayError(f"the simulated interleaving has no valid issue order ({e}); it cannot be forced") from None
    if verify:
        _verify(s, run, cs)
    return doc


def _issue_order(s: Schedule, new_ops, extra_edges) -> list[dict]:
    """Order new ops so every record precedes its waits, streams keep their order,
    and host ops keep their place, except that a stream op may be issued after a
    barrier it was issued before; refuse when that is impossible.

    NOTE: a barrier orders hosts, not GPU work: a stream op issued before it happens
    before nothing on that account (``sim.hb``), so issuing it after the barrier drops
    no edge; it only adds the edges of what the barrier's hosts knew, which the run
    had anyway (each host op keeps its place). That is what lets a copy that another
    host issued after a hand-over barrier run before an op listed ahead of the barrier
    (the RDMA read of a PD chunk before the forward's store of it)."""
    g = nx.DiGraph()
    key_of = {}
    d_of = {d["id"]: d for _, d in new_ops}
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
        if d["op"] in ("wait", "host_sync", "host_query") and d.get("event") in record_of:
            g.add_edge(record_of[d["event"]], d["id"])
    g.add_edges_from(extra_edges)
    for h in host_ops:
        hk = key_of[h][0]
        barrier = d_of[h]["op"] == "barrier"
        for other, key in key_of.items():
            if other != h and key[0] < hk and not (barrier and d_of[other].get("stream") is not None):
                g.add_edge(other, h)
            elif other != h and key[0] > hk:
                g.add_edge(h, other)
    try:
        order = list(nx.lexicographical_topological_sort(g, key=lambda n: key_of[n]))
    except nx.NetworkXUnfeasible:
        raise ReplayError("the simulated interleaving conflicts with the schedule's host syncs; "
                          "it cannot be forced") from None
    return [d_of[i] for i in order]


def _verify(s: Schedule, run: RunResult, cs: Schedule) -> None:
    left = [r for r in latent_races(cs) if {cs.ops[r["a"].op].op, cs.ops[r["b"].op].op} & {"read", "write"}]
    if left:
        r = left[0]
        raise ReplayError(f"controlled schedule still races: {cs.ops[r['a'].op].id} vs {cs.ops[r['b'].op].id}")
    ref = {r.op_id: r.bytes() for r in run_reference(cs).reads}
    for r in run.reads:
        if not np.array_equal(ref[r.op_id], r.bytes()):
            raise ReplayError(f"controlled schedule does not reproduce read {r.op_id}")


class ReadStates(list):
    """The candidate words of one read, as a list of byte arrays of the read's length.

    Word ``k`` (bytes ``8k..8k+8`` of the read's concatenated extents) of state
    ``j`` is the ``j``-th value that word may hold (repeated when it has fewer).
    ``wild[k]``: the word is not constrained (any value is plausible: see
    :func:`possible_provenance` for when).  ``bytewise[k]``: a copy that may be in
    flight across the read writes that word with a byte-granular prefix, so each
    byte may come from a different candidate.
    """

    def __init__(self, states, wild: np.ndarray, bytewise: np.ndarray):
        super().__init__(states)
        self.wild = wild
        self.bytewise = bytewise


def _pairs(pos, val):
    """Sorted, de-duplicated (word position, word value) pairs."""
    pos = np.asarray(pos, np.int64)
    val = np.asarray(val, np.uint64)
    if pos.size == 0:
        return pos, val
    order = np.lexsort((val, pos))
    pos, val = pos[order], val[order]
    keep = np.r_[True, (pos[1:] != pos[:-1]) | (val[1:] != val[:-1])]
    return pos[keep], val[keep]


def _cat(parts):
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    return _pairs(np.concatenate([p for p, _ in parts]), np.concatenate([v for _, v in parts]))


def _covered_words(starts, lengths, n_words: int):
    """(full, touched): words whose 8 bytes all lie in the union of the ranges,
    and words with at least one byte in it."""
    nb = n_words * 8
    cov = np.zeros(nb + 1, np.int64)
    s = np.clip(np.asarray(starts, np.int64), 0, nb)
    e = np.clip(np.asarray(starts, np.int64) + np.asarray(lengths, np.int64), 0, nb)
    m = e > s
    np.add.at(cov, s[m], 1)
    np.add.at(cov, e[m], -1)
    inside = (np.cumsum(cov)[:nb] > 0).reshape(n_words, 8)
    return inside.all(1), inside.any(1)


def _words_inside(starts, lengths, n_words: int):
    """Per range: the words wholly inside it, as (range index, word) arrays."""
    s = np.asarray(starts, np.int64)
    e = np.minimum(s + np.asarray(lengths, np.int64), n_words * 8)
    w0 = -(-s // 8)
    w1 = np.maximum(e // 8, w0)
    cnt = w1 - w0
    idx = np.repeat(np.arange(s.size), cnt)
    first = np.repeat(w0, cnt)
    off = np.arange(idx.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    return idx, first + off


@dataclass
class _Writer:
    """What one ``write`` or ``copy`` op can leave in its destination buffer's words."""

    op: int
    buffer: str
    full: np.ndarray                # words it overwrites entirely (whatever the timing)
    const: tuple                    # (pos, val): words whose value does not depend on timing
    wild: np.ndarray                # words it leaves part-written or misaligned (unconstrained)
    bytewise: np.ndarray            # words a read may see with a byte-granular prefix landed
    src: str | None = None          # copy: source buffer and word map (source word -> dest word)
    map_src: np.ndarray | None = None
    map_dst: np.ndarray | None = None


def _writers(s: Schedule, n_words: dict) -> list[_Writer]:
    from sim.bytes.compact import pattern_runs
    from sim.bytes.material import MaterialBuffer
    from sim.memory import oob_origin, write_pattern

    out = []
    for op in s.ops:
        if op.op == "write":
            nw = n_words[op.buffer]
            offs, lens = (np.asarray(a, np.int64) for a in op.extents)
            spec = s.buffers[op.buffer]
            mat = MaterialBuffer(spec.nbytes)
            origins, soffs = write_pattern(spec, op.layers, op.units, op.owner, op.version)
            mat.fill_groups(offs, lens, origins, soffs)
            full, touched = _covered_words(offs, lens, nw)
            words = mat.data[:nw * 8].view("<u8")
            pos = np.flatnonzero(full)
            out.append(_Writer(op.index, op.buffer, full, (pos, words[pos].astype(np.uint64)),
                               touched & ~full, np.zeros(nw, bool)))
        elif op.op == "copy":
            nw = n_words[op.dst]
            src, dst = s.buffers[op.src], s.buffers[op.dst]
            c = clip_extents(op.plan.extents, src.nbytes, dst.nbytes)
            full, touched = _covered_words(c.dst, c.fill_end, nw)
            # bytes read past the source: the oob origin's bytes, whatever the timing
            f = c.fill_end > c.fill_start
            fpos, fval = np.zeros(0, np.int64), np.zeros(0, np.uint64)
            fill_full = np.zeros(nw, bool)
            if f.any():
                fs, fl = c.dst[f] + c.fill_start[f], (c.fill_end - c.fill_start)[f]
                data = pattern_runs(oob_origin(op.src), c.src[f] + c.fill_start[f] - c.src_nbytes, fl)
                base = np.cumsum(fl) - fl
                i, w = _words_inside(fs, fl, nw)
                at = base[i] + 8 * w - fs[i]
                fval = data[at[:, None] + np.arange(8)].copy().view("<u8").reshape(-1).astype(np.uint64)
                fpos = w
                fill_full[w] = True
            # copied bytes: dest word w <- source word w - shift when the shift is whole words
            m = c.copy_len > 0
            aligned = m & ((c.dst - c.src) % 8 == 0)
            i, w = _words_inside(c.dst[aligned], c.copy_len[aligned], nw)
            shift = ((c.dst - c.src)[aligned] // 8)[i]
            src_w = w - shift
            ok = (src_w >= 0) & (src_w < n_words[op.src])
            mapped = np.zeros(nw, bool)
            mapped[w[ok]] = True
            # every other word it touches is part-written (or mixes two source words): unconstrained
            wild = touched & ~mapped & ~fill_full
            chunk = int(op.plan.launch.chunk_bytes)
            clean_prefix = (chunk % 8 == 0 and bool(np.all(c.dst % 8 == 0))
                            and bool(np.all(c.length % 8 == 0)))
            bytewise = touched.copy() if not clean_prefix else np.zeros(nw, bool)
            out.append(_Writer(op.index, op.dst, full, (fpos, fval), wild, bytewise,
                               op.src, src_w[ok], w[ok]))
    return out


def possible_provenance(s: Schedule) -> dict[str, ReadStates]:
    """For every read: the 8-byte words each position may hold under some timing.

    Sound over-approximation from happens-before (``hb``), per read or copy
    ``X`` that reads word ``p`` of buffer ``B``:

    * the initial word, unless some write or copy ``W2`` with ``W2 hb X``
      overwrites the whole word;
    * for every writer ``W`` of ``B`` that does not happen after ``X`` (a copy
      also counts for its own source), each value ``W`` can leave at ``p``,
      unless some ``W2 != W`` with ``W hb W2 hb X`` overwrites the whole word;
    * a write leaves its pattern bytes; a copy leaves, at each destination word,
      any value its source word may hold when the copy reads it (the same rule
      with ``X`` the copy: any state of the source not happens-after the copy),
      and the ``oob:<source>`` bytes where it reads past the source.  Items of
      one copy that overlap on the destination each contribute their values.

    The copy rule is recursive (copies may feed each other); the sets are the
    least fixed point, reached by iterating from the timing-independent values.
    A word is unconstrained (``wild``) where a writer leaves it part-written or
    a copy moves it by a shift that is not a whole number of words; a word is
    checked byte by byte (``bytewise``) where a copy that may be in flight
    lands a byte-granular or unaligned prefix (``cudaMemcpyAsync`` runs,
    unaligned extents).  Any outcome any simulated timing, tie order or compute
    duration can produce is therefore plausible; the check still rejects every
    word no writer could have put there.
    """
    hb = HappensBefore(s)
    init = Memory(s.buffers, materialise=True)
    n_words = {name: spec.nbytes // 8 for name, spec in s.buffers.items()}
    init_words = {name: init.final_bytes(name)[:n_words[name] * 8].view("<u8").astype(np.uint64)
                  for name in s.buffers}
    writers = _writers(s, n_words)
    by_buffer: dict[str, list[_Writer]] = {}
    for w in writers:
        by_buffer.setdefault(w.buffer, []).append(w)
    out = {w.op: (w.const, w.wild) for w in writers}

    def before(a: int, b: int) -> bool:
        return a != b and hb.ordered(a, b)

    def candidates(buf: str, x: int):
        nw = n_words[buf]
        ws = by_buffer.get(buf, [])
        prior = [w for w in ws if before(w.op, x)]
        gone = np.zeros(nw, bool)
        for w in prior:
            gone |= w.full
        keep = np.flatnonzero(~gone)
        parts = [(keep, init_words[buf][keep])]
        wild = np.zeros(nw, bool)
        for w in ws:
            if before(x, w.op):
                continue
            kill = np.zeros(nw, bool)
            for w2 in prior:
                if w2.op != w.op and before(w.op, w2.op):
                    kill |= w2.full
            (pos, val), wwild = out[w.op]
            k = ~kill[pos]
            parts.append((pos[k], val[k]))
            wild |= wwild & ~kill
        pos, val = _cat(parts)
        return pos, val, wild

    copies = [w for w in writers if w.src is not None]
    for _ in range(10_000):
        changed = False
        for w in copies:
            pos, val, swild = candidates(w.src, w.op)
            # join the source pairs with the word map (many-to-many)
            order = np.argsort(w.map_src, kind="stable")
            msrc, mdst = w.map_src[order], w.map_dst[order]
            lo = np.searchsorted(pos, msrc, side="left")
            hi = np.searchsorted(pos, msrc, side="right")
            cnt = hi - lo
            take = np.repeat(lo, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
            new = _cat([w.const, (np.repeat(mdst, cnt), val[take])])
            wild = w.wild.copy()
            wild[mdst[swild[msrc]]] = True
            (old_pos, _), old_wild = out[w.op]
            if new[0].size != old_pos.size or not np.array_equal(wild, old_wild):
                changed = True
            out[w.op] = (new, wild)
        if not changed:
            break
    else:  # the sets only grow and are finite: cannot happen
        raise AssertionError("possible_provenance did not reach a fixed point")

    result = {}
    for op in s.ops:
        if op.op != "read":
            continue
        pos, val, wild_b = candidates(op.buffer, op.index)
        nw = n_words[op.buffer]
        offs, lens = (np.asarray(a, np.int64) for a in op.extents)
        at = np.repeat(offs - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        k_words = at.size // 8
        first = at[:k_words * 8].reshape(k_words, 8) if k_words else np.zeros((0, 8), np.int64)
        bw = first[:, 0] // 8
        aligned = (first[:, 0] % 8 == 0) & np.all(first == first[:, :1] + np.arange(8), axis=1) & (bw < nw)
        bw = np.where(aligned, bw, 0)
        lo = np.searchsorted(pos, bw, side="left")
        cnt = np.searchsorted(pos, bw, side="right") - lo
        m = max(1, int(cnt.max())) if cnt.size else 1
        states = []
        for j in range(m):
            vals = np.zeros(k_words, np.uint64)
            has = cnt > 0
            vals[has] = val[lo[has] + np.minimum(j, cnt[has] - 1)]
            st = np.zeros(int(lens.sum()), np.uint8)
            st[:k_words * 8] = vals.astype("<u8").view(np.uint8)
            states.append(st)
        wild = ~aligned | wild_b[bw]
        byte_w = np.zeros(nw, bool)
        for w in by_buffer.get(op.buffer, []):
            if not before(w.op, op.index) and not before(op.index, w.op):
                byte_w |= w.bytewise
        bytewise = aligned & byte_w[bw]
        result[op.id] = ReadStates(states, wild, bytewise)
    return result


def plausible_words(observed: np.ndarray, states: list[np.ndarray]) -> np.ndarray:
    """Per 8-byte word of a read: does it equal that word in one of the states?

    With :class:`ReadStates`, a ``wild`` word is always plausible and a
    ``bytewise`` word is plausible when each of its bytes equals that byte in
    some state."""
    n = observed.size // 8 * 8
    obs = observed[:n].view("<u8")
    ok = np.zeros(obs.size, bool)
    for st in states:
        ok |= obs == st[:n].view("<u8")
    wild = getattr(states, "wild", None)
    if wild is not None:
        ok |= wild[:obs.size]
        bytewise = states.bytewise[:obs.size]
        if bytewise.any():
            byte_ok = np.zeros(n, bool)
            for st in states:
                byte_ok |= observed[:n] == st[:n]
            ok |= bytewise & byte_ok.reshape(-1, 8).all(1)
    return ok
