"""Whose bytes are these: a byte range of a compact buffer in words.

Used by race and corruption reports ("slot 4112: bytes 0-127 from request 12
unit 3301 v1, bytes 128-255 from request 40 unit 88 v0").
"""
from __future__ import annotations

from sim.bytes.compact import CompactBuffer


def _owner(owner: int) -> str:
    return "initial" if owner < 0 else f"request {owner}"


def _small_pieces(buf: CompactBuffer, offset: int, nbytes):
    """The pieces of ``[offset, +nbytes)`` as lists (starts, lengths, origin ids, stream
    offsets) when the range lies in one block and a few segments (``_pieces_small``:
    no numpy), else None."""
    if nbytes is not None:
        n = int(nbytes)
        if n > 0 and 0 <= offset <= buf.nbytes - n:
            got = buf._pieces_small(offset, offset + n)
            if got is not None:
                ps, pe, po, pf = got
                return ps, [e - a for a, e in zip(ps, pe)], po, pf
    return None


def describe(buf: CompactBuffer, offset: int, nbytes: int, max_items: int = 64,
             base: int | None = None) -> list[dict]:
    """One dict per run of consecutive units of one origin in ``[offset, +nbytes)``.

    Keys: ``offset`` (absolute, in the buffer), ``nbytes``, ``origin``
    (``Origin.to_json()``), ``first_unit``, ``last_unit``, ``unit_byte_start``
    (byte in the first unit where the run starts), ``unit_byte_end`` (exclusive
    end in the last unit) and ``text``.  Byte ranges in ``text`` are inclusive
    and relative to ``offset`` (the range described).  When there are more than
    ``max_items`` runs, the first ``max_items - 1`` are listed and the last dict
    summarises the rest: ``origin`` and the unit keys are None, ``more_runs``
    counts the runs it stands for.  ``base``: ``buf`` is a part of a larger buffer
    starting at byte ``base`` of it (a read's view); the items' ``offset`` and the text's
    byte ranges are then in that buffer's bytes (absolute in ``buf`` plus ``base``).
    """
    max_items = max(1, int(max_items))
    offset = int(offset)
    # the text numbers bytes from ``offset`` (relative) or from the larger buffer's byte 0
    at = offset if base is None else -int(base)
    shift = 0 if base is None else int(base)
    small = _small_pieces(buf, offset, nbytes)
    if small is not None:
        p_start, p_length, p_oid, p_soff = small
        n = len(p_start)
        rest_oids = p_oid
    else:   # NOTE: only the pieces shown are made Python ints (a range may hold millions)
        p = buf.pieces(offset, nbytes)
        n = len(p)
        p_start, p_length, p_oid, p_soff = (a[:max_items].tolist()
                                            for a in (p.start, p.length, p.origin_id, p.stream_offset))
        rest_oids = p.origin_id
    shown = n if n <= max_items else max_items - 1
    items = []
    for i in range(shown):
        start, length = p_start[i], p_length[i]
        o = buf.table[p_oid[i]]
        s = p_soff[i]
        ub = o.unit_bytes
        u0, u1 = s // ub, (s + length - 1) // ub
        b0, b1 = s - u0 * ub, s + length - u1 * ub
        rel = start - at
        head = f"bytes {rel}-{rel + length - 1}: {o.kind} layer {o.layer} {_owner(o.owner)}"
        if u0 == u1:
            text = f"{head} unit {u0} v{o.version} (unit bytes {b0}-{b1 - 1})"
        else:
            text = (f"{head} units {u0}-{u1} v{o.version} "
                    f"(from byte {b0} of unit {u0} to byte {b1 - 1} of unit {u1})")
        items.append({"offset": start + shift, "nbytes": length, "origin": o.to_json(),
                      "first_unit": u0, "last_unit": u1, "unit_byte_start": b0,
                      "unit_byte_end": b1, "text": text})
    if shown < n:
        start = p_start[shown]
        end = offset + int(nbytes)
        rest = n - shown
        origins = len(set(rest_oids[shown:] if small is not None else rest_oids[shown:].tolist()))
        items.append({"offset": start + shift, "nbytes": end - start, "origin": None,
                      "first_unit": None, "last_unit": None, "unit_byte_start": None,
                      "unit_byte_end": None, "more_runs": rest,
                      "text": f"bytes {start - at}-{end - at - 1}: {rest} more runs "
                              f"from {origins} origins"})
    return items


def describe_text(buf: CompactBuffer, offset: int, nbytes: int, max_items: int = 64,
                  sep: str = "; ") -> str:
    """``describe`` as one line of text."""
    return sep.join(d["text"] for d in describe(buf, offset, nbytes, max_items))
