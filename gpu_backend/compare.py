"""Compare the bytes a GPU read with the bytes the simulator predicted, and name both sides.

* :func:`compare_read`: per read, bytes equal, bytes and 8-byte words differing, and the first
  differing byte with its provenance on both sides.  The predicted side comes from the
  simulator's compact view (``ReadCapture.views`` described with ``sim.bytes.describe``).  The
  observed side is named without any table of bytes: the observed 8-byte word that holds the
  byte is decoded with ``sim.bytes.pattern.decode_words`` against every origin of the run's
  ``OriginTable``.  Pattern words are aligned to their unit's start, so the word is taken at the
  phase the predicted piece has (its stream offset within its unit): the observed writer is
  assumed to use the same unit geometry, which holds for a stale or foreign row of the same
  buffer.
* :func:`gpu_expected_bytes`: what the GPU must hold where the simulator predicts bytes that a
  copy read past its source's end.  The simulator names those bytes with an ``oob:<source>``
  origin; on the GPU that read lands in the source's guard, whose bytes are the canary
  (``gpu_backend.memory.canary_bytes``), so the expectation is the canary at the same place.
* :func:`predicted_oob` and :func:`oob_agreement`: the out-of-bounds bytes the simulator
  predicts per buffer and side, against the guard reports.
* :func:`wilson_interval`: the 95 % interval of a stale fraction.
"""
from __future__ import annotations

import math

import numpy as np

from gpu_backend.memory import canary_bytes
from sim.bytes.describe import describe
from sim.bytes.pattern import decode_words

OOB_PREFIX = "oob:"


# ---------------------------------------------------------------- statistics

def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (95 % by default); (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # clamp: at k == 0 or k == n rounding can leave p a hair outside its own interval
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


# ---------------------------------------------------------------- expected bytes on the GPU

def gpu_expected_bytes(views, table, *, guard_bytes: int | None = None,
                       ordinals: dict[str, int] | None = None) -> np.ndarray:
    """The bytes of ``views`` (a ReadCapture's views, or ``[memory.view(...)]``) as a guarded GPU
    buffer set holds them: pieces of an ``oob:<source>`` origin become the source's after-guard
    canary at the same offset past its end.  Without ``ordinals`` the views' bytes are returned."""
    parts = []
    for v in views:
        data = v.bytes().copy()
        if ordinals is not None:
            p = v.compact.pieces(0, v.compact.nbytes)
            for start, length, oid, soff in zip(p.start.tolist(), p.length.tolist(),
                                                p.origin_id.tolist(), p.stream_offset.tolist()):
                kind = table[oid].kind
                if not kind.startswith(OOB_PREFIX):
                    continue
                src = kind[len(OOB_PREFIX):]
                if src not in ordinals or guard_bytes is None or soff + length > guard_bytes:
                    continue          # past the guard: the GPU read unknown memory
                data[start:start + length] = canary_bytes(ordinals[src], "after", guard_bytes)[soff:soff + length]
        parts.append(data)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


# ---------------------------------------------------------------- one read

def _locate(lengths: np.ndarray, k: int) -> tuple[int, int]:
    """(extent index, offset inside the extent) of byte ``k`` of a read's byte stream."""
    ends = np.cumsum(np.asarray(lengths, np.int64))
    j = int(np.searchsorted(ends, k, side="right"))
    start = int(ends[j - 1]) if j else 0
    return j, k - start


def _owner(owner: int) -> str:
    return "initial" if owner < 0 else f"request {owner}"


def describe_observed(observed: np.ndarray, k: int, phase: int, table, unit_bytes: int | None = None) -> dict:
    """Name byte ``k`` of an observed read: decode the 8-byte word that holds it.

    ``phase`` is the byte's position inside its pattern word (0..7) as the prediction places it;
    the word starts at ``k - phase`` of the observed bytes."""
    w0 = k - phase
    out = {"byte": int(observed[k]), "word": None, "origin": None, "unit": None, "word_index": None,
           "text": f"byte 0x{int(observed[k]):02x}: no whole 8-byte word around it to decode"}
    if w0 < 0 or w0 + 8 > observed.size:
        return out
    word = np.frombuffer(observed[w0:w0 + 8].tobytes(), dtype="<u8")
    out["word"] = f"0x{int(word[0]):016x}"
    origins = list(table)
    oi, unit, widx = decode_words(word, origins)
    if oi[0] < 0:
        out["text"] = (f"word {out['word']}: matches no origin of this run (not pattern bytes: a "
                       "guard canary, garbage, or bytes no modelled writer wrote)")
        return out
    o = origins[int(oi[0])]
    byte_in_unit = int(widx[0]) * 8 + phase
    out.update(origin=o.to_json(), unit=int(unit[0]), word_index=int(widx[0]),
               text=f"{o.kind} layer {o.layer} {_owner(o.owner)} unit {int(unit[0])} v{o.version} "
                    f"(unit byte {byte_in_unit}, word {int(widx[0])})")
    return out


def describe_predicted(capture, k: int, table) -> dict:
    """Name byte ``k`` of a predicted read from the simulator's compact view; also the byte's
    phase in its pattern word."""
    j, rel = _locate(capture.lengths, k)
    view = capture.views[j]
    item = describe(view.compact, rel, 1, max_items=1)[0]
    p = view.compact.pieces(rel, 1)
    origin = table[int(p.origin_id[0])]
    soff = int(p.stream_offset[0])
    phase = (soff % origin.unit_bytes) % 8
    head, rest = item["text"].split(": ", 1)
    offset = int(capture.offsets[j]) + rel
    return {"extent": j, "buffer_offset": offset, "phase": phase, "origin": item["origin"],
            "unit": item["first_unit"], "unit_byte": item["unit_byte_start"],
            "text": f"byte {offset}: {rest}"}


def compare_read(observed: np.ndarray, capture, table, *, expected: np.ndarray | None = None,
                 layout=None) -> dict:
    """Compare one read's observed bytes with the prediction ``capture`` (a ReadCapture).

    ``expected`` overrides the predicted bytes (``gpu_expected_bytes``); ``layout`` (the
    buffer's) adds the position of the first differing byte."""
    exp = capture.bytes() if expected is None else np.asarray(expected, np.uint8)
    obs = np.asarray(observed, np.uint8)
    entry = {"op": capture.op_id, "buffer": capture.buffer, "nbytes": int(exp.size)}
    if obs.size != exp.size:
        entry.update(match=False, bytes_equal=0, bytes_differing=int(max(obs.size, exp.size)),
                     words_differing=None, first_mismatch={
                         "text": f"observed {obs.size} bytes, predicted {exp.size}"})
        return entry
    diff = obs != exp
    n_diff = int(diff.sum())
    nw = obs.size // 8
    words = int((obs[:nw * 8].view("<u8") != exp[:nw * 8].view("<u8")).sum()) + int(diff[nw * 8:].any())
    entry.update(match=n_diff == 0, bytes_equal=int(obs.size - n_diff), bytes_differing=n_diff,
                 words_differing=words, first_mismatch=None)
    if n_diff:
        k = int(np.argmax(diff))
        entry["first_mismatch"] = first_mismatch(obs, capture, table, k, expected=exp, layout=layout)
    return entry


def first_mismatch(observed: np.ndarray, capture, table, k: int, *, expected: np.ndarray | None = None,
                   layout=None) -> dict:
    """Both sides of byte ``k`` of a read: what the simulator predicted and what the GPU saw."""
    pred = describe_predicted(capture, k, table)
    exp = capture.bytes() if expected is None else expected
    pred["byte"] = int(exp[k])
    obs = describe_observed(observed, k, pred["phase"], table)
    out = {"read": capture.op_id, "buffer": capture.buffer, "read_byte": k,
           "buffer_offset": pred["buffer_offset"], "predicted": pred, "observed": obs}
    if layout is not None:
        try:
            out["position"] = layout.describe(int(pred["buffer_offset"]))
        except Exception as e:  # informative only
            out["position"] = {"error": str(e)}
    return out


def mismatch_text(fm: dict) -> str:
    return (f"read {fm['read']} byte {fm['read_byte']} ({fm['buffer']} offset {fm['buffer_offset']}):\n"
            f"    predicted: {fm['predicted']['text']}\n"
            f"    observed:  {fm['observed']['text']}")


# ---------------------------------------------------------------- out of bounds

def _union_count(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int]:
    """(bytes, 8-byte words) covered by the union of [start, end) ranges; words are counted on
    the grid whose word 0 starts at offset 0."""
    if starts.size == 0:
        return 0, 0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > run_end[:-1]]
    gs = s[new]
    ge = np.maximum.reduceat(e, np.flatnonzero(new))
    nbytes = int((ge - gs).sum())
    ws, we = gs // 8, -(-ge // 8)
    # merge word ranges that touch after rounding
    wrun = np.maximum.accumulate(we)
    wnew = np.r_[True, ws[1:] >= wrun[:-1]]
    wgs = ws[wnew]
    wge = np.maximum.reduceat(we, np.flatnonzero(wnew))
    return nbytes, int((wge - wgs).sum())


def predicted_oob(schedule) -> dict[str, dict]:
    """Per buffer with out-of-bounds writes: bytes and words the schedule's copies write before
    its start and past its end (each byte once), as ``check_bounds`` predicts them."""
    per: dict[str, dict[str, list]] = {}
    for op in schedule.ops:
        if op.op != "copy":
            continue
        ext = op.plan.extents
        d = np.asarray(ext.dst, np.int64)
        n = np.asarray(ext.length, np.int64)
        nbytes = schedule.buffers[op.dst].nbytes
        after = d + n > nbytes
        before = d < 0
        if after.any() or before.any():
            b = per.setdefault(op.dst, {"after": [[], []], "before": [[], []]})
            a_s = np.maximum(d[after], nbytes) - nbytes
            b["after"][0].append(a_s)
            b["after"][1].append(d[after] + n[after] - nbytes)
            # before: offsets counted back from the start: byte -1 is 0 bytes before
            b_e = -d[before]
            b_s = np.maximum(-(d[before] + n[before]), 0)
            b["before"][0].append(b_s)
            b["before"][1].append(b_e)
    out = {}
    for name, sides in per.items():
        entry = {}
        for side, (ss, es) in sides.items():
            s = np.concatenate(ss) if ss else np.zeros(0, np.int64)
            e = np.concatenate(es) if es else np.zeros(0, np.int64)
            nb, nw = _union_count(s, e)
            entry[f"{side}_bytes"] = nb
            entry[f"{side}_words"] = nw
        out[name] = entry
    return out


def oob_agreement(predicted: dict[str, dict], guards) -> dict[str, dict]:
    """Per buffer (predicted or reported): the predicted out-of-bounds bytes and words against the
    guard reports (words changed x 8).  ``agree`` when the words match on both sides."""
    reported: dict[str, dict] = {}
    for g in guards:
        r = reported.setdefault(g.buffer, {})
        r[g.side] = g
    out = {}
    for name in sorted(set(predicted) | set(reported)):
        p = predicted.get(name, {})
        r = reported.get(name, {})
        entry = {}
        agree = True
        for side in ("after", "before"):
            pw = int(p.get(f"{side}_words", 0))
            rw = r[side].words_changed if side in r else 0
            entry[f"predicted_{side}_bytes"] = int(p.get(f"{side}_bytes", 0))
            entry[f"predicted_{side}_words"] = pw
            entry[f"guard_{side}_words"] = int(rw)
            entry[f"guard_{side}_bytes"] = int(8 * rw)
            entry[f"guard_{side}_bytes_changed"] = int(r[side].bytes_changed) if side in r else 0
            agree &= pw == rw
        entry["agree"] = agree
        out[name] = entry
    return out
