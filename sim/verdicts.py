"""Verdicts on a run: manifested corruption, latent races, out-of-bounds writes.

* **corruption (manifested)**: a read whose bytes differ from the same read in
  the happens-before-order execution (``run_reference``).  A corrupt read is
  ``torn`` when some buffer unit (page or row) inside one of its extents holds
  both expected and unexpected bytes (it saw a copy part-way through an item),
  else ``stale`` (every unit it saw is wholly old or wholly foreign).
* **latent race**: see ``sim.hb``; reported whether or not this run's timing
  made it manifest.
* **out-of-bounds write**: a copy extent that leaves its destination (or reads
  past its source), with the neighbour it would hit.

``analyse`` returns one JSON-serialisable dict (the ``kvrace schedule run
--json`` document); ``summary_text`` the human report.
"""
from __future__ import annotations

import hashlib

import numpy as np

from sim.bytes.describe import describe
from sim.executor import RunResult, run_reference
from sim.hb import HappensBefore, accesses, latent_races
from sim.memory import Memory

MAX_DESCRIBE = 16


def _describe(buf, offset: int, nbytes: int, base: int = 0, max_items=MAX_DESCRIBE) -> list[dict]:
    """describe() with offsets and text in absolute buffer offsets (``base`` is
    the buffer offset of ``buf``'s byte 0: a view's offset, or 0)."""
    items = describe(buf, offset, nbytes, max_items=max_items)
    for it in items:
        it["offset"] += base
        head, rest = it["text"].split(": ", 1)
        it["text"] = f"bytes {it['offset']}-{it['offset'] + it['nbytes'] - 1}: {rest}"
    return items


def _describe_view(view, rel_off: int, nbytes: int, max_items=MAX_DESCRIBE) -> list[dict]:
    return _describe(view.compact, rel_off, nbytes, view.offset, max_items)


def _provenance_per_byte(view, keys: dict) -> tuple[np.ndarray, np.ndarray]:
    """(origin key, stream offset) of every byte of a view; ``keys`` numbers the
    origins (views of different runs have different origin tables)."""
    p = view.compact.pieces(0, view.compact.nbytes)
    ids = np.array([keys.setdefault(view.compact.table[int(i)], len(keys)) for i in p.origin_id],
                   dtype=np.int64)
    origin = np.repeat(ids, p.length)
    stream = np.repeat(p.stream_offset - p.start, p.length) + np.arange(view.compact.nbytes)
    return origin, stream


def differing_bytes(vo, vr) -> np.ndarray:
    """Per byte: does the observed view hold other bytes (by provenance) than the reference?

    Provenance, not byte values, decides: two origins' pattern words share their
    word-index bytes, so equal values can still be someone else's bytes."""
    keys: dict = {}
    oo, so = _provenance_per_byte(vo, keys)
    orr, sr = _provenance_per_byte(vr, keys)
    return (oo != orr) | (so != sr)


def _classify(obs, ref, unit_bytes: int) -> tuple[str, dict | None, int]:
    """Compare one read's views with the reference's: status, first mismatch, bytes differing."""
    first = None
    differing = 0
    torn = False
    for vo, vr in zip(obs.views, ref.views):
        diff = differing_bytes(vo, vr)
        if not diff.any():
            continue
        differing += int(diff.sum())
        # split the extent at buffer unit boundaries: a unit both right and wrong is torn
        unit_id = (vo.offset + np.arange(diff.size)) // unit_bytes
        bounds = np.flatnonzero(np.diff(unit_id)) + 1
        for part in np.split(diff, bounds):
            if part.any() and not part.all():
                torn = True
        if first is None:
            k = int(np.argmax(diff))
            first = {
                "offset": vo.offset + k,
                "observed": _describe_view(vo, k, 1, 1)[0]["text"],
                "expected": _describe_view(vr, k, 1, 1)[0]["text"],
            }
    if differing == 0:
        return "ok", None, 0
    return ("torn" if torn else "stale"), first, differing


def _position(layout, offset: int) -> dict:
    try:
        return layout.describe(int(offset))
    except Exception as e:  # describe is informative only; never hide the verdict
        return {"offset": int(offset), "error": str(e)}


def analyse(run: RunResult, reference: RunResult | None = None) -> dict:
    s = run.schedule
    reference = reference or run_reference(s, materialise=run.memory.material is not None)
    ref_reads = {r.op_id: r for r in reference.reads}
    reads = []
    for r in run.reads:
        ref = ref_reads[r.op_id]
        layout = s.buffers[r.buffer].layout
        status, first, differing = _classify(r, ref, layout.unit_bytes)
        data = r.bytes()
        entry = {
            "op": r.op_id, "stream": r.stream, "buffer": r.buffer, "time_us": round(r.time_us, 4),
            "nbytes": r.nbytes, "status": status, "bytes_differing": differing,
            "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
            "expected_sha256": hashlib.sha256(ref.bytes().tobytes()).hexdigest(),
            "position": _position(layout, r.offsets[0]),
            "provenance": [p for v in r.views for p in _describe_view(v, 0, v.compact.nbytes)][:MAX_DESCRIBE],
            "copies_in_flight": r.in_flight,
        }
        if first is not None:
            first["position"] = _position(layout, first["offset"])
            entry["first_mismatch"] = first
            entry["expected_provenance"] = [p for v in ref.views
                                            for p in _describe_view(v, 0, v.compact.nbytes)][:MAX_DESCRIBE]
        reads.append(entry)

    initial = Memory(s.buffers, materialise=False, table=reference.memory.table)
    races = []
    hb = HappensBefore(s)
    for race in latent_races(s, hb):
        a, b = s.ops[race["a"].op], s.ops[race["b"].op]
        layout = s.buffers[race["buffer"]].layout
        lo, hi = int(race["starts"][0]), int(race["ends"][0])
        races.append({
            "buffer": race["buffer"],
            "ops": [a.id, b.id],
            "kinds": [f"{a.op} ({'write' if race['a'].write else 'read'})",
                      f"{b.op} ({'write' if race['b'].write else 'read'})"],
            "streams": [a.stream, b.stream],
            "bytes": race["bytes"],
            "ranges": [[int(x), int(y)] for x, y in zip(race["starts"][:8], race["ends"][:8])],
            "first_range": [lo, hi],
            "position": _position(layout, lo),
            "layer": _position(layout, lo).get("layer"),
            "old_bytes": _describe(initial.compact[race["buffer"]], lo, hi - lo, max_items=4),
            "new_bytes": _describe(reference.memory.compact[race["buffer"]], lo, hi - lo, max_items=4),
        })

    placement = [pc for op in s.ops if op.op == "copy" for pc in [placement_check(s, op)] if pc]

    return {
        "kvrace_report": 1,
        "schedule": s.name,
        "schedule_digest": s.digest(),
        "profile": run.profile.name if run.profile else None,
        "profile_calibrated": run.profile.calibrated if run.profile else None,
        "reads": reads,
        "reads_total": len(reads),
        "stale_reads": sum(r["status"] == "stale" for r in reads),
        "torn_reads": sum(r["status"] == "torn" for r in reads),
        "corrupt_reads": sum(r["status"] != "ok" for r in reads),
        "latent_races": races,
        "oob_writes": [o for o in run.oob if o["side"] == "dst"],
        "oob_reads": [o for o in run.oob if o["side"] == "src"],
        "placement": placement,
        "buffers": {name: {"nbytes": spec.nbytes,
                           "sha256": hashlib.sha256(run.memory.final_bytes(name).tobytes()).hexdigest()}
                    for name, spec in s.buffers.items()},
        "timings_us": {k: [round(a, 4), round(b, 4)] for k, (a, b) in run.timings.items()},
        "accesses": [{"op": s.ops[acc.op].id, "stream": s.ops[acc.op].stream, "buffer": acc.buffer,
                      "access": "write" if acc.write else "read", "ranges": int(acc.starts.size),
                      "bytes": int((acc.ends - acc.starts).sum()),
                      "first_range": [int(acc.starts[0]), int(acc.ends[0])] if acc.starts.size else None,
                      "start_us": round(run.timings.get(s.ops[acc.op].id, (0.0, 0.0))[0], 4),
                      "end_us": round(run.timings.get(s.ops[acc.op].id, (0.0, 0.0))[1], 4)}
                     for acc in accesses(s)],
        "tie_orders": [[round(t, 4), ids] for t, ids in run.tie_orders],
        "end_us": round(run.end_us, 4),
    }


def summary_text(rep: dict) -> str:
    lines = [f"schedule {rep['schedule']}  (profile {rep['profile']}"
             f"{'' if rep['profile_calibrated'] else ', uncalibrated'}; simulated {rep['end_us']:.2f} us)"]
    lines.append(f"reads: {rep['reads_total']}  corrupt: {rep['corrupt_reads']} "
                 f"(stale {rep['stale_reads']}, torn {rep['torn_reads']})  "
                 f"latent races: {len(rep['latent_races'])}  out-of-bounds writes: {len(rep['oob_writes'])}")
    for r in rep["reads"]:
        lines.append(f"\nread {r['op']} on {r['stream']} at {r['time_us']:.3f} us: {r['buffer']} "
                     f"{r['nbytes']} B -> {r['status'].upper()}")
        for c in r["copies_in_flight"]:
            lines.append(f"  copy {c['copy']} in flight: {c['items_done']}/{c['items']} items landed, "
                         f"{c['items_in_flight']} part-way")
        if r["status"] != "ok":
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
    from sim.transfers.routines import plan as plan_copy

    if op.routine != "dsv4_token":
        return None
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
    bad_items = np.unique(intended[~in_actual, 0])
    n_items = int(ext.n_items)
    stray = ~np.isin(inv[len(intended):], inv[:len(intended)])
    return {"op": op.id, "routine": op.routine, "reference_routine": "token_bytewise", "items": n_items,
            "items_placed_correctly": n_items - int(bad_items.size), "bytes_misplaced": int(stray.sum())}


def _pos_text(pos: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in pos.items() if k != "offset")
