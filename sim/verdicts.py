"""Verdicts on a run: manifested corruption, latent races, out-of-bounds writes.

* **corruption (manifested)**: a read whose bytes differ from the same read in
  the happens-before-order execution (``run_reference``).  A corrupt read is
  ``torn`` when some buffer unit (page or row) inside one of its extents holds
  both expected and unexpected bytes (it saw a copy part-way through an item),
  else ``stale`` (every unit it saw is wholly old or wholly foreign).
* **latent race**: see ``sim.hb``; reported whether or not this run's timing
  made it manifest.  ``latent_races`` lists at most ``race_limit`` racing
  (buffer, op pair)s (default ``RACE_LIMIT``; ``None``: all);
  ``latent_races_total`` counts all of them.
* **intra-launch race**: a copy whose items write the same destination bytes
  (see ``sim.hb``).  Which item's bytes remain is not determined (the warps of
  one launch are concurrent; on an H200 ``transfer_cache_dsv4_mla`` over two
  layers of a 256 B/token buffer leaves different bytes from launch to
  launch).  ``intra_launch_races`` lists each such copy with its double-written
  ranges and, for the first pieces (bytes with one set of writers), the
  candidate writers: each item and the
  provenance it would leave there (its source bytes in the happens-before-order
  execution).  The byte models' "later extent wins" is one of the outcomes,
  never a prediction.
* **indeterminate bytes**: a read's bytes that hold an intra-launch race's
  outcome in the happens-before-order execution (propagated through later
  copies; any other write makes them determinate again).  The comparison with
  the reference ignores them (``bytes_indeterminate`` counts them): a read
  whose determinate bytes all match is ``indeterminate`` (not ``ok``) when it
  has any; ``stale``/``torn`` are decided on the determinate bytes alone.
* **out-of-bounds write**: a copy extent that leaves its destination (or reads
  past its source), with the neighbour it would hit.

A ``keep="report"`` run (``sim.executor``) computes the same verdicts while it runs,
op by op in issue order (:class:`OnlineVerdicts`), and ``analyse`` assembles its
report from them.

``analyse`` returns one JSON-serialisable dict (the ``kvrace schedule run
--json`` document); ``summary_text`` the human report.
"""
from __future__ import annotations

import hashlib

import numpy as np

from sim.arrays import unique_sorted
from sim.bytes.describe import describe
from sim.errors import InputError
from sim.executor import ReadCapture, RunResult, run_reference
from sim.hb import (RACE_LIMIT, HappensBefore, OnlineClocks, RaceTracker, _intersect_sets, _merge, merge_intervals,
                    _subtract, accesses, double_written, indeterminate_read_bytes, intra_launch_races,
                    race_scan)
from sim.memory import Memory, View, clip_and_leaves as _clip_and_leaves, clip_extents, oob_origin
from sim.schedule import fewer_full_collections

MAX_DESCRIBE = 16
#: per intra-launch race: ranges listed, ranges whose candidate writers are described, writers per range
INTRA_RANGES, INTRA_DESCRIBED_RANGES, INTRA_WRITERS = 8, 4, 8


def _describe(buf, offset: int, nbytes: int, base: int = 0, max_items=MAX_DESCRIBE) -> list[dict]:
    """describe() with offsets and text in absolute buffer offsets (``base`` is
    the buffer offset of ``buf``'s byte 0: a view's offset, or 0)."""
    return describe(buf, offset, nbytes, max_items=max_items, base=base)


def _describe_view(view, rel_off: int, nbytes: int, max_items=MAX_DESCRIBE) -> list[dict]:
    return _describe(view.compact, rel_off, nbytes, view.offset, max_items)


def _indeterminate_masks(obs, ranges) -> list[np.ndarray]:
    """Per view of a read: which of its bytes lie in ``ranges`` (merged starts, ends)."""
    masks = []
    for v in obs.views:
        n = v.compact.nbytes
        m = np.zeros(n, bool)
        if ranges is not None:
            starts, ends = ranges
            a = np.maximum(starts, v.offset)
            b = np.minimum(ends, v.offset + n)
            for x, y in zip((a - v.offset)[b > a].tolist(), (b - v.offset)[b > a].tolist()):
                m[x:y] = True
        masks.append(m)
    return masks


def _same_provenance(vo, vr) -> bool:
    if vo.compact.table is vr.compact.table:      # one origin table: ids name origins
        if vo.compact.nbytes != vr.compact.nbytes:
            return False
        ra, rb = vo.compact.small_runs(), vr.compact.small_runs()
        if ra is not None and rb is not None:     # a few segments each: plain Python
            return ra == rb
        a, b = vo.compact.coalesced_segments(), vr.compact.coalesced_segments()
    else:
        a, b = vo.compact.canonical_segments(), vr.compact.canonical_segments()
    return vo.compact.nbytes == vr.compact.nbytes and all(np.array_equal(x, y) for x, y in zip(a, b))


def _provenance_runs(view, keys: dict | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A view's provenance as pieces: (starts, origin keys, deltas), byte ``x`` of piece ``i``
    having origin ``keys[i]`` and stream offset ``x + deltas[i]``.  ``keys`` numbers the
    origins (views of different runs have different origin tables); None: the origin ids
    themselves (views of one table: an id names one origin)."""
    p = view.compact.pieces(0, view.compact.nbytes)
    start = np.asarray(p.start, np.int64)
    oid = np.asarray(p.origin_id, np.int64)
    if keys is not None:
        table = view.compact.table
        oid = np.array([keys.setdefault(table[i], len(keys)) for i in oid.tolist()], np.int64)
    return start, oid, np.asarray(p.stream_offset, np.int64) - start


def _small_runs(view, keys: dict | None) -> list | None:
    """``_provenance_runs`` as a list of ``(start, key, delta)`` for a view of a few segments
    (``CompactBuffer.small_runs``), else None."""
    runs = view.compact.small_runs()
    if runs is None:
        return None
    if keys is None:
        return [(s, o, f - s) for s, o, f in runs]
    table = view.compact.table
    return [(s, keys.setdefault(table[o], len(keys)), f - s) for s, o, f in runs]


def differing_runs(vo, vr, ind=None) -> list[tuple[int, int, bool, bool]]:
    """A view and its reference cut into runs where either's provenance or the indeterminate
    mask ``ind`` (per byte, or None) changes: ``(start, length, whether the two differ there
    by provenance, whether it is determinate)`` per run, in order.  The provenance of each
    side (origin and stream offset of every byte) and the mask are constant on a run.

    Provenance, not byte values, decides: two origins' pattern words share their word-index
    bytes, so equal values can still be someone else's bytes.

    NOTE: a read's views are mostly a few segments each (a page or two): merged in plain
    Python, which is several times faster than the numpy path at that size."""
    keys = None if vo.compact.table is vr.compact.table else {}
    n = vo.compact.nbytes
    if ind is None:
        ro, rr = _small_runs(vo, keys), _small_runs(vr, keys)
        if ro is not None and rr is not None:
            out, i, j, pos, lo, lr = [], 0, 0, 0, len(ro), len(rr)
            while pos < n:
                while i + 1 < lo and ro[i + 1][0] <= pos:
                    i += 1
                while j + 1 < lr and rr[j + 1][0] <= pos:
                    j += 1
                end = min(ro[i + 1][0] if i + 1 < lo else n, rr[j + 1][0] if j + 1 < lr else n)
                out.append((pos, end - pos, ro[i][1] != rr[j][1] or ro[i][2] != rr[j][2], True))
                pos = end
            return out
    so, ko, do = _provenance_runs(vo, keys)
    sr, kr, dr = _provenance_runs(vr, keys)
    cuts = [so, sr]
    if ind is not None:
        cuts.append(np.flatnonzero(ind[1:] != ind[:-1]) + 1)
    b = np.unique(np.concatenate(cuts))
    io, ir = np.searchsorted(so, b, "right") - 1, np.searchsorted(sr, b, "right") - 1
    wrong = (ko[io] != kr[ir]) | (do[io] != dr[ir])
    det = np.ones(b.size, bool) if ind is None else ~ind[b]
    return list(zip(b.tolist(), np.diff(np.append(b, n)).tolist(), wrong.tolist(), det.tolist()))


def _classify(obs, ref, unit_bytes: int, masks=None) -> tuple[str, dict | None, int]:
    """Compare one read's views with the reference's: status, first mismatch,
    bytes differing.  ``masks`` (per view) marks indeterminate bytes: they are
    left out of the comparison (status ``indeterminate`` when nothing else differs).

    A byte differs when its provenance (origin, stream offset) does; a buffer unit whose
    determinate bytes are both right and wrong is torn.  Decided on the runs of
    ``differing_runs`` (O(segments)), not byte by byte: two determinate runs next to each
    other (indeterminate runs between them aside) share a unit exactly when the first one's
    last byte and the second one's first byte lie in one unit, and a unit holding right and
    wrong bytes holds such a pair (``tests/test_speed_classify.py`` compares it with the
    per-byte classification)."""
    first = None
    differing = 0
    torn = False
    for i, (vo, vr) in enumerate(zip(obs.views, ref.views)):
        if _same_provenance(vo, vr):          # the common case, in O(segments)
            continue
        runs = differing_runs(vo, vr, None if masks is None else masks[i])
        bad = [(s, n) for s, n, wrong, det in runs if wrong and det]
        if not bad:
            continue
        differing += sum(n for _, n in bad)
        if not torn:
            prev = None                       # (wrong, unit of the last byte) of the last determinate run
            for s, n, wrong, det in runs:
                if not det:
                    continue
                a = vo.offset + s
                if prev is not None and prev[0] != wrong and prev[1] == a // unit_bytes:
                    torn = True
                    break
                prev = (wrong, (a + n - 1) // unit_bytes)
        if first is None:
            k = bad[0][0]
            first = {
                "offset": vo.offset + k,
                "observed": _describe_view(vo, k, 1, 1)[0]["text"],
                "expected": _describe_view(vr, k, 1, 1)[0]["text"],
            }
    if differing == 0:
        return ("indeterminate" if masks is not None and any(m.any() for m in masks) else "ok"), None, 0
    return ("torn" if torn else "stale"), first, differing


def _position(layout, offset: int) -> dict:
    try:
        return layout.describe(int(offset))
    except Exception as e:  # describe is informative only; never hide the verdict
        return {"offset": int(offset), "error": str(e)}


def _candidate_writers(s, intra: list[dict], table) -> dict[int, list]:
    """For each intra-launch race (by copy op index), for its first
    ``INTRA_DESCRIBED_RANGES`` pieces (bytes with one set of writers): the
    writing items (at most ``INTRA_WRITERS``) and what each would leave there,
    i.e. its source bytes in the happens-before-order execution, described."""
    racy = {r["op"]: r for r in intra}
    mem = Memory(s.buffers, materialise=False, table=table)
    out: dict[int, list] = {}
    for op in s.ops[:max(racy) + 1]:
        if op.op == "write":
            mem.apply_write(op)
        if op.op != "copy":
            continue
        src_spec, dst_spec = s.buffers[op.src], s.buffers[op.dst]
        c = clip_extents(op.plan.extents, src_spec.nbytes, dst_spec.nbytes)
        if op.index in racy:
            out[op.index] = _copy_candidates(mem, op, c, racy[op.index]["written"])
        mem.apply_copy(op.src, op.dst, c)
    return out


def _copy_candidates(mem, op, c, dw) -> list:
    """The candidates of one intra-launch race (``dw``: its DoubleWritten) from ``mem``,
    the happens-before-order memory just before the copy."""
    pieces = []
    for lo, hi, items in list(zip(dw.piece_starts.tolist(), dw.piece_ends.tolist(),
                                  dw.piece_items))[:INTRA_DESCRIBED_RANGES]:
        pieces.append({"range": [lo, hi], "items": int(items.size),
                       "writers": [_what_item_leaves(mem, op, c, item, lo, hi)
                                   for item in items[:INTRA_WRITERS].tolist()]})
    return pieces


def _what_item_leaves(mem, op, c, item: int, lo: int, hi: int) -> dict:
    """The bytes copy item ``item`` writes into ``[lo, hi)`` of the destination,
    from the memory's current (pre-copy) state, described."""
    view = mem.view(op.dst, lo, hi - lo)
    m = c.item == item
    d, s_, n_copy, f0, f1 = c.dst[m], c.src[m], c.copy_len[m], c.fill_start[m], c.fill_end[m]
    a, b = np.maximum(d, lo), np.minimum(d + n_copy, hi)
    k = b > a
    if k.any():
        mem.overlay(view, op.src, s_[k] + (a[k] - d[k]), a[k], (b - a)[k])
    fa, fb = np.maximum(d + f0, lo), np.minimum(d + f1, hi)
    kf = fb > fa
    if kf.any():
        mem.overlay_fill(view, oob_origin(op.src), fa[kf], (fb - fa)[kf],
                         s_[kf] + (fa[kf] - d[kf]) - c.src_nbytes)
    # describe only the bytes this item writes (the rest of the range is other items')
    ws = np.r_[a[k], fa[kf]]
    we = np.r_[b[k], fb[kf]]
    order = np.argsort(ws, kind="stable")
    ws, we = ws[order], we[order]
    run_end = np.maximum.accumulate(we) if we.size else we
    new = np.r_[True, ws[1:] > run_end[:-1]] if ws.size else np.zeros(0, bool)
    idx = np.flatnonzero(new)
    ms, me = ws[idx], (np.maximum.reduceat(run_end, idx) if idx.size else ws[:0])
    prov = []
    for x, y in zip(ms.tolist(), me.tolist()):
        prov.extend(_describe_view(view, x - lo, y - x, 4))
        if len(prov) >= 4:
            break
    return {"item": int(item), "bytes": int((me - ms).sum()), "provenance": prov[:4]}


def read_digest(read) -> str:
    """sha256 of a read's provenance: equal for two reads (of any runs) that saw the same
    bytes of the same origins at the same offsets."""
    # NOTE: one update of the views' texts joined: the same bytes as one update per view
    return hashlib.sha256("".join([f"{v.offset}:{v.compact.provenance_digest()};"
                                   for v in read.views]).encode()).hexdigest()


def read_entry(r, ref, layout, ind, *, detail: bool = True, fresh: bool = False, digests: bool = True) -> dict:
    """The report entry of one read ``r`` (a ReadCapture) against the same read ``ref``
    of the happens-before-order execution; ``ind``: its indeterminate bytes (merged
    starts, ends) or None.  ``detail=False`` leaves out what only explains a read
    (provenance, position, copies in flight) when the read is ``ok``.  ``fresh``: ``r`` is
    known to have seen the happens-before-order bytes (``OnlineVerdicts.captured``), so
    ``ref`` is not compared (nor needed: it may be None when ``ind`` is None).  ``digests=False``
    leaves out the provenance digests (``OnlineVerdicts.on_read``)."""
    masks = _indeterminate_masks(r, ind) if ind is not None else None
    n_indeterminate = 0 if masks is None else int(sum(int(m.sum()) for m in masks))
    same = fresh or _same_views(r, ref)
    if same:        # the common case, decided in O(segments)
        status, first, differing = ("indeterminate" if n_indeterminate else "ok"), None, 0
    else:
        status, first, differing = _classify(r, ref, layout.unit_bytes, masks)
    entry = {
        "op": r.op_id, "stream": r.stream, "buffer": r.buffer, "time_us": round(r.time_us, 4),
        "nbytes": r.nbytes, "status": status, "bytes_differing": differing,
        "bytes_indeterminate": n_indeterminate,
        "indeterminate_ranges": ([] if ind is None else
                                 [[int(x), int(y)] for x, y in zip(ind[0][:8], ind[1][:8])]),
    }
    if digests:
        # NOTE: by provenance (O(segments)): hashing the bytes would materialise every read;
        # the Snapshot (snapshot_of) carries the bytes themselves.  Equal provenance (an ok
        # read) has one digest: computed once.
        digest = entry["provenance_sha256"] = read_digest(r)
        entry["expected_provenance_sha256"] = digest if same else read_digest(ref)
    if not detail and status == "ok":
        return entry
    entry["position"] = _position(layout, r.offsets[0])
    entry["provenance"] = [p for v in r.views for p in _describe_view(v, 0, v.compact.nbytes)][:MAX_DESCRIBE]
    entry["copies_in_flight"] = r.in_flight
    if first is not None:
        first["position"] = _position(layout, first["offset"])
        entry["first_mismatch"] = first
        entry["expected_provenance"] = [p for v in ref.views
                                        for p in _describe_view(v, 0, v.compact.nbytes)][:MAX_DESCRIBE]
    return entry


def _same_views(r, ref) -> bool:
    """Both reads saw the same provenance in every view."""
    return len(r.views) == len(ref.views) and all(
        vo.offset == vr.offset and _same_provenance(vo, vr) for vo, vr in zip(r.views, ref.views))


def _race_report(buffers, race: dict, ops: tuple, kinds: tuple, streams: tuple, initial, final) -> dict:
    """One ``latent_races`` entry: ``race`` has ``buffer``, ``starts``/``ends``,
    ``n_ranges``, ``bytes``; ``ops``/``kinds``/``streams`` name its two ops;
    ``initial``/``final``: the memories its old and new bytes are described from."""
    layout = buffers[race["buffer"]].layout
    lo, hi = int(race["starts"][0]), int(race["ends"][0])
    position = _position(layout, lo)
    return {
        "buffer": race["buffer"],
        "ops": list(ops),
        "kinds": list(kinds),
        "streams": list(streams),
        "bytes": race["bytes"],
        "n_ranges": race["n_ranges"],
        "ranges": [[int(x), int(y)] for x, y in zip(race["starts"][:8], race["ends"][:8])],
        "first_range": [lo, hi],
        "position": position,
        "layer": position.get("layer"),
        "old_bytes": _describe(initial.compact[race["buffer"]], lo, hi - lo, max_items=4),
        "new_bytes": _describe(final.compact[race["buffer"]], lo, hi - lo, max_items=4),
    }


def _kind(op_kind: str, write: bool) -> str:
    return f"{op_kind} ({'write' if write else 'read'})"


def _intra_report(op, race: dict, layout, candidates: list) -> dict:
    lo = int(race["starts"][0])
    return {
        "op": op.id, "routine": op.routine, "stream": op.stream, "buffer": race["buffer"],
        "bytes": race["bytes"], "n_ranges": int(race["starts"].size),
        "ranges": [[int(x), int(y)] for x, y in zip(race["starts"][:INTRA_RANGES],
                                                      race["ends"][:INTRA_RANGES])],
        "items": int(unique_sorted(np.concatenate(race["items"])).size),
        "pieces": int(race["written"].piece_starts.size),
        "position": _position(layout, lo),
        "candidates": candidates,
    }


def _report(run: RunResult, *, name: str, digest: str, reads: list, races: list, races_total: int,
            intra: list, unbound: list, placement: list, timings: dict, accesses_list: list,
            tie_orders: list) -> dict:
    buffers = run.memory.specs
    return {
        "kvrace_report": 1,
        "schedule": name,
        "schedule_digest": digest,
        "profile": run.profile.name if run.profile else None,
        "profile_calibrated": run.profile.calibrated if run.profile else None,
        "reads": reads,
        "reads_total": len(reads),
        "stale_reads": sum(r["status"] == "stale" for r in reads),
        "torn_reads": sum(r["status"] == "torn" for r in reads),
        "corrupt_reads": sum(r["status"] in ("stale", "torn") for r in reads),
        "indeterminate_reads": sum(r["status"] == "indeterminate" for r in reads),
        "reads_with_indeterminate_bytes": sum(r["bytes_indeterminate"] > 0 for r in reads),
        "latent_races": races,
        "latent_races_total": races_total,
        "intra_launch_races": intra,
        # waits / host syncs / queries issued before any record of their event: CUDA makes
        # them no-ops (a query reports complete), so they order nothing
        "unbound_waits": list(unbound),
        "oob_writes": [o for o in run.oob if o["side"] == "dst"],
        "oob_reads": [o for o in run.oob if o["side"] == "src"],
        "placement": placement,
        "buffers": {name: {"nbytes": spec.nbytes,
                           "sha256": run.memory.digest(name)}
                    for name, spec in buffers.items()},
        "timings_us": {k: [round(a, 4), round(b, 4)] for k, (a, b) in timings.items()},
        "accesses": accesses_list,
        "tie_orders": [[round(t, 4), ids] for t, ids in tie_orders],
        "end_us": round(run.end_us, 4),
    }


def analyse(run: RunResult, reference: RunResult | None = None, race_limit: int | None = RACE_LIMIT) -> dict:
    """The report of one run (see the module doc); ``race_limit`` caps the
    listed latent races (``None``: list all).

    A run made with ``keep="report"`` carries its verdicts, computed while it ran
    (:class:`OnlineVerdicts`); the report is then assembled from them (``reference``
    must be None and ``race_limit`` at most the run's)."""
    with fewer_full_collections():
        return _analyse(run, reference, race_limit)


def _analyse(run: RunResult, reference: RunResult | None, race_limit: int | None) -> dict:
    if run.online is not None:
        if reference is not None:
            raise InputError("reference", "a keep='report' run was compared with its reference while it "
                             "ran; expected reference=None")
        return run.online.report(run, race_limit)
    s = run.schedule
    table = run.memory.table
    reference = reference or run_reference(s, materialise=run.memory.material is not None, table=table)
    ref_reads = {r.op_id: r for r in reference.reads}
    intra = intra_launch_races(s)
    indeterminate = indeterminate_read_bytes(s, intra)
    reads = [read_entry(r, ref_reads[r.op_id], s.buffers[r.buffer].layout, indeterminate.get(r.index))
             for r in run.reads]

    initial = Memory(s.buffers, materialise=False, table=reference.memory.table)
    hb = HappensBefore(s)
    acc_list = accesses(s)
    scan = race_scan(s, hb, race_limit, acc_list)
    races = []
    for race in scan.races:
        a, b = s.ops[race["a"].op], s.ops[race["b"].op]
        races.append(_race_report(s.buffers, race, (a.id, b.id),
                                  (_kind(a.op, race["a"].write), _kind(b.op, race["b"].write)),
                                  (a.stream, b.stream), initial, reference.memory))

    writers = _candidate_writers(s, intra, reference.memory.table) if intra else {}
    intra_report = [_intra_report(s.ops[race["op"]], race, s.buffers[race["buffer"]].layout,
                                  writers.get(race["op"], [])) for race in intra]
    placement = [pc for op in s.ops if op.op == "copy" for pc in [placement_check(s, op)] if pc]
    accesses_list = [{"op": s.ops[acc.op].id, "stream": s.ops[acc.op].stream, "buffer": acc.buffer,
                      "access": "write" if acc.write else "read", "ranges": int(acc.starts.size),
                      "bytes": (int(acc.ends[0]) - int(acc.starts[0]) if acc.starts.size == 1
                                else int((acc.ends - acc.starts).sum())),
                      "first_range": [int(acc.starts[0]), int(acc.ends[0])] if acc.starts.size else None,
                      "start_us": round(run.timings.get(s.ops[acc.op].id, (0.0, 0.0))[0], 4),
                      "end_us": round(run.timings.get(s.ops[acc.op].id, (0.0, 0.0))[1], 4)}
                     for acc in acc_list]
    return _report(run, name=s.name, digest=s.digest(), reads=reads, races=races, races_total=scan.total,
                   intra=intra_report, unbound=s.unbound, placement=placement, timings=run.timings,
                   accesses_list=accesses_list, tie_orders=run.tie_orders)


def summary_text(rep: dict) -> str:
    lines = [f"schedule {rep['schedule']}  (profile {rep['profile']}"
             f"{'' if rep['profile_calibrated'] else ', uncalibrated'}; simulated {rep['end_us']:.2f} us)"]
    listed, total = len(rep["latent_races"]), rep["latent_races_total"]
    races_text = f"{total}" if listed == total else f"{total} ({listed} of {total} listed)"
    lines.append(f"reads: {rep['reads_total']}  corrupt: {rep['corrupt_reads']} "
                 f"(stale {rep['stale_reads']}, torn {rep['torn_reads']})  "
                 f"indeterminate: {rep['indeterminate_reads']}  "
                 f"latent races: {races_text}  intra-launch races: {len(rep['intra_launch_races'])}  "
                 f"out-of-bounds writes: {len(rep['oob_writes'])}")
    for r in rep["reads"]:
        lines.append(f"\nread {r['op']} on {r['stream']} at {r['time_us']:.3f} us: {r['buffer']} "
                     f"{r['nbytes']} B -> {r['status'].upper()}")
        for c in r["copies_in_flight"]:
            lines.append(f"  copy {c['copy']} in flight: {c['items_done']}/{c['items']} items landed, "
                         f"{c['items_in_flight']} part-way")
        if r["bytes_indeterminate"]:
            first = r["indeterminate_ranges"][0]
            lines.append(f"  {r['bytes_indeterminate']} bytes indeterminate (written by more than one item of "
                         f"one copy launch; not compared), first [{first[0]}, {first[1]})")
        if r["status"] in ("stale", "torn"):
            fm = r["first_mismatch"]
            lines.append(f"  {r['bytes_differing']} bytes differ from the happens-before order; first at "
                         f"offset {fm['offset']} ({_pos_text(fm['position'])})")
            lines.append(f"    saw:      {fm['observed']}")
            lines.append(f"    expected: {fm['expected']}")
            lines.append("  what it saw:")
            lines.extend(f"    {p['text']}" for p in r["provenance"][:8])
    for race in rep["latent_races"]:
        lines.append(f"\nLATENT RACE on {race['buffer']} layer {race['layer']}: {race['ops'][0]} "
                     f"[{race['kinds'][0]}, {race['streams'][0]}] vs {race['ops'][1]} "
                     f"[{race['kinds'][1]}, {race['streams'][1]}], {race['bytes']} bytes unordered, "
                     f"first [{race['first_range'][0]}, {race['first_range'][1]})")
        if race["old_bytes"]:
            lines.append(f"  old: {race['old_bytes'][0]['text']}")
        if race["new_bytes"]:
            lines.append(f"  new: {race['new_bytes'][0]['text']}")
    if listed < total:
        lines.append(f"\n... {total - listed} more latent races not listed ({listed} of {total} listed)")
    for ir in rep["intra_launch_races"]:
        lines.append(f"\nINTRA-LAUNCH RACE in {ir['op']} ({ir['routine']}, {ir['stream']}) on {ir['buffer']}: "
                     f"{ir['bytes']} bytes written by more than one item of the launch, in {ir['n_ranges']} "
                     f"ranges, first [{ir['ranges'][0][0]}, {ir['ranges'][0][1]}) "
                     f"({_pos_text(ir['position'])}); which item's bytes remain is not determined")
        for rng in ir["candidates"][:2]:
            lines.append(f"  bytes [{rng['range'][0]}, {rng['range'][1]}): {rng['items']} candidate writers")
            for w in rng["writers"][:3]:
                if w["provenance"]:
                    lines.append(f"    item {w['item']} ({w['bytes']} B): {w['provenance'][0]['text']}")
    for u in rep.get("unbound_waits", []):
        where = f"stream {u['stream']}" if u.get("stream") else f"host {u['host']}"
        lines.append(f"\nUNBOUND {u['kind'].upper()} {u['op']} ({where}) on event {u['event']}: no record of "
                     f"{u['event']} was issued before it, so it orders nothing (a no-op in CUDA"
                     f"{'; the query reports complete' if u['kind'] == 'host_query' else ''})")
    for pc in rep["placement"]:
        lines.append(f"\nPLACEMENT of {pc['op']} ({pc['routine']}) against {pc['reference_routine']} on the "
                     f"buffers' own geometry: {pc['items_placed_correctly']} of {pc['items']} tokens land "
                     f"where they belong; {pc['bytes_misplaced']} bytes written where no token's bytes belong")
    groups: dict = {}
    for o in rep["oob_writes"] + rep["oob_reads"]:
        groups.setdefault((o["op"], o["side"], o["buffer"]), []).append(o)
    for (op_id, side, buf), items in groups.items():
        o = items[0]
        total = sum(x["bytes_outside"] for x in items)
        hits = sorted({x["would_hit"] for x in items})
        last = max(x["offset"] + x["length"] for x in items)
        what = "WRITE" if side == "dst" else "READ"
        lines.append(f"\nOUT-OF-BOUNDS {what} by {op_id} ({o['routine']}): {total} bytes "
                     f"{'written' if side == 'dst' else 'read'} past the end of {buf} ({o['buffer_nbytes']} B) "
                     f"in {len(items)} extents of {len({x['item'] for x in items})} items, up to offset "
                     f"{last - 1}; would hit: {', '.join(hits)}")
        for x in items[:3]:
            lines.append(f"  item {x['item']}: {x['length']} B at offset {x['offset']}, "
                         f"{x['bytes_outside']} B outside")
    return "\n".join(lines)


def placement_check(s, op, max_bytes: int = 1 << 24) -> dict | None:
    """For a token-granular routine with fixed constants (dsv4_token), how many
    tokens land where the buffers' own geometry says they belong (the
    token_bytewise copy of the same indices), byte for byte."""
    if op.routine != "dsv4_token":
        return None
    from sim.transfers.routines import plan as plan_copy
    src, dst = s.buffers[op.src].layout, s.buffers[op.dst].layout
    ext = op.plan.extents
    if int(ext.length.sum()) > max_bytes or not (hasattr(src, "token_extents") and hasattr(dst, "token_extents")):
        return None
    layers = op.args.get("layers", [0])
    try:
        ref = [plan_copy("token_bytewise", src, dst, {"layer": int(layer), "src_indices": op.args["src_indices"],
                                                      "dst_indices": op.args["dst_indices"]}, op.id).extents
               for layer in layers]
    except Exception:   # the buffers' geometries do not pair token by token: nothing to compare against
        return None

    def byte_pairs(e):
        n = e.length
        rep = np.repeat(np.arange(n.size), n)
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        return np.stack([e.item[rep], e.src[rep] + k, e.dst[rep] + k], axis=1)

    actual = byte_pairs(ext)
    intended = np.concatenate([byte_pairs(r) for r in ref])
    both = np.concatenate([intended, actual])
    _, inv = np.unique(both, axis=0, return_inverse=True)
    inv = inv.ravel()
    in_actual = np.isin(inv[:len(intended)], inv[len(intended):])
    bad_items = unique_sorted(intended[~in_actual, 0])
    n_items = int(ext.n_items)
    stray = ~np.isin(inv[len(intended):], inv[:len(intended)])
    return {"op": op.id, "routine": op.routine, "reference_routine": "token_bytewise", "items": n_items,
            "items_placed_correctly": n_items - int(bad_items.size), "bytes_misplaced": int(stray.sum())}


def _pos_text(pos: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in pos.items() if k != "offset")


# ----------------------------------------------------------------------------
# verdicts while a run runs (keep="report")

#: a clock component no op reaches: a buffer that no op still to come accesses keeps no access
_NEVER = 1 << 62


def _expected_views(buf, offs, lens) -> list:
    """A read's views of compact buffer ``buf`` (``Memory.view`` for one extent, else
    ``Memory.views``, of a compact-only Memory holding ``buf``)."""
    if offs.size == 1:
        o = int(offs[0])
        return [View(buf.slice(o, int(lens[0])), None, o)]
    ol = offs.tolist()
    return [View(c, None, o) for c, o in zip(buf.slices(ol, lens.tolist()), ol)]


class StaticRaceTracker(RaceTracker):
    """The race tracker of a static schedule: the same races (found, counted, kept and
    listed as :class:`~sim.hb.RaceTracker` does), with live accesses dropped per buffer.

    ``RaceTracker.prune`` drops an access that happens before every op still to be
    issued (``OnlineClocks.floor``).  With several independent devices that floor stays
    at zero for every component (a later op of device 1 is not ordered after anything
    of device 0), so nothing is ever dropped and the live accesses, and the cost of
    each lookup, grow with the run.  A static schedule lists every op up front, so for
    each buffer the streams that will still access it are known: an access to buffer
    ``B`` can be dropped once it happens before the next op of every stream that still
    accesses ``B`` later in the list (that op's clock is at least the stream's last
    clock, or, for a stream with no op yet, at least the smallest host clock: the rule
    of ``OnlineClocks.floor``, per buffer).  A dropped access can race no later access
    of its buffer, so every race is still found (``tests/test_speed_run.py`` checks
    the races, totals and listed entries against ``RaceTracker`` on random schedules).

    It overrides :meth:`~sim.hb.RaceTracker.floor_of` only; ``RaceTracker.prune``
    applies it buffer by buffer."""

    #: pruned less often than ``RaceTracker``: with a floor per buffer the live set stays a
    #: few hundred accesses, and a prune's cost is per buffer, not per live access
    PRUNE_EVERY = 2048

    def __init__(self, clocks: OnlineClocks, limit: int | None, ops: list, describe=None):
        super().__init__(clocks, limit, describe=describe)
        # buffer -> {stream: list index of that stream's last op accessing the buffer}
        last: dict[str, dict[str, int]] = {}
        for op in ops:
            kind = op.op
            if kind == "copy":
                last.setdefault(op.src, {})[op.stream] = op.index
                last.setdefault(op.dst, {})[op.stream] = op.index
            elif kind == "read" or kind == "write":
                last.setdefault(op.buffer, {})[op.stream] = op.index
        self._last_access = last
        self._at = -1                     # the op being added (prune runs inside add)

    def add(self, op_index: int, comp: int, pos: int, clock, accs: list, info=None) -> None:
        self._at = op_index
        super().add(op_index, comp, pos, clock, accs, info)

    def floor_of(self, buf: str) -> list:
        """A lower bound of the clock of every op after ``_at`` that accesses ``buf``."""
        cl = self.clocks
        lows, no_op_yet = [], False
        for stream, j in self._last_access.get(buf, {}).items():
            if j > self._at:
                got = cl.last.get(stream)
                if got is None:
                    no_op_yet = True
                else:
                    lows.append(got[1])
        if no_op_yet:
            lows.extend(cl.hc.values())
        if not lows:
            return [_NEVER] * cl.n_comp
        return np.minimum.reduce(lows).tolist()


class OnlineVerdicts:
    """The verdicts of :func:`analyse`, computed while the run runs, holding live
    state only (what ``keep="report"`` runs use; the report equals ``analyse`` of
    the same run kept whole, except what it leaves out, listed below).

    Each op is taken in issue order (a topological order of happens-before): it
    is applied to the happens-before-order memory (the reference, sharing the
    run's origin table, so provenance compares by id), its clock is computed
    (:class:`~sim.hb.OnlineClocks`), its byte accesses are checked against the
    live accesses of their buffers (:class:`~sim.hb.RaceTracker`), an
    intra-launch race is found and its candidates described from the memory just
    before it, and indeterminate bytes are followed.  A read's expected views are
    held until the run captures the read; then its entry is made and both are
    dropped.

    Left out of the report, because they grow with the run's length:
    ``timings_us`` and ``accesses`` are empty; an ``ok`` read's entry has no
    ``position``, ``provenance`` or ``copies_in_flight``; ``tie_orders`` holds the
    first ``sim.executor.TIE_ORDER_LIMIT`` (``tie_orders_total`` counts all).  Latent races
    are listed up to ``race_limit`` (given to the run)."""

    #: judge fresh reads without their expected views (see ``captured``); False: compare every
    #: read (the path the fast one is tested against)
    FAST_READS = True
    #: a static schedule's read is judged fresh only when the ops started are at most this many
    #: list positions past it (they are taken first; see captured)
    FRONTIER_WINDOW = 4096

    def __init__(self, buffers: dict, streams, hosts, table, *, race_limit: int | None = RACE_LIMIT,
                 ops: list | None = None, memo=None, memory: Memory | None = None):
        self.buffers = buffers
        # memo(plan, what, make): what the executor derives from copy plans, shared with it
        self._memo = memo if memo is not None else (lambda plan, what, make: make())
        self.race_limit = race_limit
        # memory: the run's Memory before any op (its table is ``table``): the reference and
        # the report's initial memory start as compact copies of it instead of being set up
        if memory is not None and memory.table is not table:
            raise InputError("memory", "expected the run's Memory, whose origin table is `table`")
        self.ref = memory.copy_compact() if memory is not None else Memory(buffers, materialise=False, table=table)
        self._initial = self.ref.copy_compact()
        self.clocks = OnlineClocks(streams, hosts)
        self.races = (RaceTracker(self.clocks, race_limit, describe=self._race_entry) if ops is None
                      else StaticRaceTracker(self.clocks, race_limit, ops, describe=self._race_entry))
        self._ops = ops                       # a static schedule's list (taken in list order, on demand)
        self._next = 0
        self._indet: dict[str, tuple] = {}    # buffer -> merged indeterminate (starts, ends)
        self._expected: dict[int, tuple] = {} # read op index -> (expected views, indeterminate ranges)
        self.reads: list[dict] = []
        self._on_read = None                  # on_read's callback (then reads are not kept)
        self._digests = True                  # entries carry the reads' provenance digests
        self.intra: list[dict] = []
        self.placement: list[dict] = []
        self.taken = 0
        # fresh reads (see captured)
        self._raced_reads: set[int] = set()   # reads taken, not captured, that raced a write
        self._writers_raced = False           # two writing ops have raced
        self._adding_read = False
        if self.FAST_READS:
            self.races.on_race = self._raced

    @property
    def nothing_raced(self) -> bool:
        """No race, indeterminate byte or intra-launch double write found so far: every read
        captured so far was fresh (``captured``), and the run's bytes equal the reference's
        wherever the run has landed what the reference applied (``sim.deferred``)."""
        return self.races.total == 0 and not self._indet and not self.intra and not self._writers_raced

    def read_snapshot(self, index: int):
        """The reference's buffer when read ``index`` (taken, not captured) was taken: a
        ``CompactBuffer`` snapshot (with ``FAST_READS``; else None)."""
        got = self._expected.get(index)
        return got[0] if got is not None and self.FAST_READS else None

    # ---- ops, in issue order
    def issued(self, op, clipped=None) -> None:
        """The executor issued ``op`` (a copy with its clipped extents): take it.  A static
        schedule's ops are taken in list order when a read needs them (``captured``) and at
        the end (``finish``), not as they are issued.

        NOTE: what is taken does not depend on when (the list order is the issue order the
        verdicts follow, and taking reads nothing of the run), so a static schedule's
        verdicts are the same taken late; taken at issue, every read's expected views
        (a static schedule is issued whole at time 0) were held from the start to its
        capture: memory that grew with the schedule's length."""
        if self._ops is None:
            self._take(op, clipped)

    def _take_through(self, index: int) -> None:
        """Take a static schedule's ops up to list index ``index``, in list order."""
        ops = self._ops
        while self._next <= index:
            self._take(ops[self._next])
            self._next += 1

    def finish(self) -> None:
        """The run has ended: take a static schedule's ops not taken yet."""
        if self._ops is not None:
            self._take_through(len(self._ops) - 1)

    def _take(self, op, clipped=None) -> None:
        self.taken += 1
        comp, pos, clock = self.clocks.add(op)
        kind = op.op
        if kind == "copy":
            accs = self._copy(op, clipped)
        elif kind == "write":
            offs, lens = op.extents
            ws, we = _merge(offs, lens)
            self.ref.apply_write(op)
            if op.buffer in self._indet:
                self._indet[op.buffer] = _subtract(*self._indet[op.buffer], ws, we)
            accs = [(op.buffer, True, ws, we)]
        elif kind == "read":
            offs, lens = op.extents
            rs, re_ = _merge(offs, lens)
            ind = None
            if op.buffer in self._indet:
                s, e, _ = _intersect_sets(rs, re_, *self._indet[op.buffer])
                ind = merge_intervals(s, e) if s.size else None
            if self.FAST_READS:
                # NOTE: the buffer as it is now (O(blocks): blocks are never written in place),
                # its views made at the capture only if the read is not fresh
                self._expected[op.index] = (self.ref.compact[op.buffer].clone(), ind)
            else:
                self._expected[op.index] = (_expected_views(self.ref.compact[op.buffer], offs, lens), ind)
            accs = [(op.buffer, False, rs, re_)]
        else:
            return
        self._adding_read = kind == "read"
        self.races.add(op.index, comp, pos, clock, accs, (op.id, op.op, op.stream))

    def _raced(self, a_ops, b: int) -> None:
        """``RaceTracker.on_race``: live ops ``a_ops`` race op ``b`` (being taken).  A read not
        captured yet that races a write is remembered (``_raced_reads``); a race between two
        ops that both write (a write or a copy, whichever of their accesses raced) sets
        ``_writers_raced`` (see ``captured``)."""
        info, pending = self.races.info, self._expected
        for a in a_ops:
            if info[a][1] == "read":
                if a in pending:                  # b writes what a reads
                    self._raced_reads.add(a)
            elif self._adding_read:               # a writes what b reads
                self._raced_reads.add(b)
            else:
                self._writers_raced = True

    def _copy(self, op, c=None) -> list:
        src, dst = self.buffers[op.src], self.buffers[op.dst]
        if c is None:
            c = self._memo(op.plan, ("clip", src.nbytes, dst.nbytes),
                           lambda: _clip_and_leaves(op.plan, src.nbytes, dst.nbytes))[0]
        dw = None
        if c.item.size >= 2 and not bool((c.item == c.item[0]).all()):
            dw = double_written(c.dst, c.dst + c.fill_end, c.item)
            if dw.starts.size:
                race = {"buffer": op.dst, "starts": dw.starts, "ends": dw.ends, "bytes": dw.nbytes,
                        "items": dw.items, "written": dw}
                self.intra.append(_intra_report(op, race, dst.layout, _copy_candidates(self.ref, op, c, dw)))
            else:
                dw = None
        if self._indet or dw is not None:
            z = np.zeros(0, np.int64)
            ss, se = self._indet.get(op.src, (z, z))
            ps, pe, pi = _intersect_sets(c.src, c.src + c.copy_len, ss, se)
            moved_s, moved_e = ps + (c.dst - c.src)[pi], pe + (c.dst - c.src)[pi]
            ds, de = self._indet.get(op.dst, (z, z))
            ws, we = merge_intervals(c.dst, c.dst + c.fill_end)
            ds, de = _subtract(ds, de, ws, we)
            add_s, add_e = [ds, moved_s], [de, moved_e]
            if dw is not None:
                add_s.append(dw.starts)
                add_e.append(dw.ends)
            merged = merge_intervals(np.concatenate(add_s), np.concatenate(add_e))
            if merged[0].size:
                self._indet[op.dst] = merged
            else:
                self._indet.pop(op.dst, None)
        pc = placement_check(self, op)
        if pc:
            self.placement.append(pc)
        self.ref.apply_copy(op.src, op.dst, c)
        rs, re_, ws, we = self._memo(op.plan, ("accesses", src.nbytes, dst.nbytes), lambda: (
            *_merge(c.src, np.minimum(c.length, c.fill_start)), *_merge(c.dst, c.fill_end)))
        return [(op.src, False, rs, re_), (op.dst, True, ws, we)]

    @staticmethod
    def _race_entry(entry: dict, a_info, b_info) -> dict:
        (a_id, a_kind, a_stream), (b_id, b_kind, b_stream) = a_info, b_info
        wa, wb = entry.pop("writes")
        entry["ids"] = (a_id, b_id)
        entry["kinds"] = (_kind(a_kind, wa), _kind(b_kind, wb))
        entry["streams"] = (a_stream, b_stream)
        return entry

    # ---- reads, as the run captures them
    def on_read(self, callback, *, digests: bool = True) -> None:
        """Hand every judged read to ``callback(capture, expected_views, entry)`` instead of
        keeping it: ``capture`` is the run's :class:`~sim.executor.ReadCapture`,
        ``expected_views`` the same read's views in the happens-before-order memory (one per
        extent), ``entry`` its report entry (``read_entry`` without detail).  Nothing of the
        read is kept afterwards, so ``reads`` (and the report's ``reads``) stay empty; set it
        before the run captures its first read.  One callback per verdicts; ``None`` goes back
        to keeping the entries.  ``digests=False``: the entries leave out
        ``provenance_sha256`` and ``expected_provenance_sha256`` (a digest per view of the
        read: for a caller that uses the status only, most of a fresh read's cost)."""
        if callback is not None and not callable(callback):
            raise InputError("callback", f"expected a callable (capture, expected_views, entry) or None, "
                             f"got {type(callback).__name__}")
        self._on_read = callback
        self._digests = bool(digests) or callback is None

    def captured(self, r: ReadCapture, frontier: int = -1) -> None:
        """The run captured read ``r``: compare it with its expected views and keep its entry
        (or hand both to the ``on_read`` callback).  ``frontier``: the largest list index of
        an op the run has started (a static schedule's ops are taken through it when it is at most
        ``FRONTIER_WINDOW`` past the read; further, the read is compared, not judged fresh).

        A **fresh** read is judged ``ok`` without building or comparing its expected views
        (they equal its own: the callback gets those): one that raced no write, has no
        indeterminate bytes, in a run where no two writing ops (writes, copies: a copy's
        source read counts as its op's) have raced so far.  Why its bytes are the
        happens-before-order bytes, byte ``x`` of the read ``R`` by byte:

        * every op that started before ``R`` touched its bytes has been taken: a program's
          ops are taken as they are issued (and an op runs after its issue), a static
          schedule's through ``frontier``; so every race between two such ops has been
          found (a race is found when the later of its two ops is taken, against the
          earlier's live access; pruning drops only accesses that happen before every op
          still to come, which cannot race).
        * The writers of ``x`` the run applied before ``R`` touched it are the writers of
          ``x`` listed before ``R``: one listed before ``R`` either happens before ``R``
          (then it completed before ``R`` started) or is concurrent with it (a race of
          ``R`` with a write: not fresh); one that wrote ``x`` before ``R`` touched it
          started before, so it was taken, and if listed after ``R`` it does not happen
          after ``R`` (that would start after ``R`` completed), so it races ``R``.
        * Any two of them are ordered (else a write-write race), and ordered ops are listed
          in happens-before order (the issue order is a topological order: a wait binds to
          the latest record issued before it), so the run applied them in list order: the
          last writer of ``x`` is the reference's.  A write's bytes do not depend on
          memory; a copy's are its source bytes when its item landed, the same argument
          applied to the copy (its source read raced nothing: that would be a race of two
          writing ops), by induction over the list order down to the initial contents.
        * No copy item was part-way over ``x`` (an item in flight is a write concurrent
          with ``R``), and ``x`` is not indeterminate (one launch's items writing it twice).

        ``tests/test_speed_fresh_reads.py`` checks the fresh verdicts against the full
        comparison on random schedules and on ones built to break each condition."""
        fast = self.FAST_READS
        if self._ops is not None:
            # NOTE: ops started far ahead of the read (a schedule listing one device's ops after
            # another's) are not taken early for it: every read taken holds its buffer's
            # snapshot until its capture, so the read is compared instead
            fast = fast and frontier - r.index <= self.FRONTIER_WINDOW
            self._take_through(frontier if fast and frontier > r.index else r.index)
        got, ind = self._expected.pop(r.index)
        raced = r.index in self._raced_reads
        if raced:
            self._raced_reads.discard(r.index)
        layout = self.buffers[r.buffer].layout
        if fast and ind is None and not raced and not self._writers_raced:
            views = r.views
            entry = read_entry(r, None, layout, None, detail=False, fresh=True, digests=self._digests)
        else:
            views = _expected_views(got, r.offsets, r.lengths) if self.FAST_READS else got
            ref = ReadCapture(r.op_id, r.index, r.stream, r.buffer, float(r.index), r.offsets, r.lengths, views)
            entry = read_entry(r, ref, layout, ind, detail=False, digests=self._digests)
        if self._on_read is None:
            self.reads.append(entry)
        else:
            self._on_read(r, views, entry)

    # ---- the report
    def report(self, run: RunResult, race_limit: int | None = RACE_LIMIT) -> dict:
        if self.race_limit is not None and (race_limit is None or race_limit > self.race_limit):
            raise InputError("race_limit", f"this run kept the first {self.race_limit} latent races; expected "
                             f"race_limit <= {self.race_limit} (give a larger race_limit to the run)")
        initial = self._initial
        races = [_race_report(self.buffers, e, e["ids"], e["kinds"], e["streams"], initial, self.ref)
                 for e in self.races.listed(race_limit)]
        s = run.schedule
        rep = _report(run, name=s.name, digest=run.digest, reads=self.reads, races=races,
                      races_total=self.races.total, intra=self.intra, unbound=run.unbound,
                      placement=self.placement, timings={}, accesses_list=[], tie_orders=run.tie_orders)
        rep["tie_orders_total"] = run.tie_orders_total
        rep["kept"] = "report"
        return rep
