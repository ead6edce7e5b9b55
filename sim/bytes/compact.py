"""Compact byte model: a buffer's provenance as coalesced segments.

Every byte of a buffer is byte ``k`` of some origin's pattern stream.  A
``CompactBuffer`` stores that as segments ``(start, origin_id, stream_offset)``
in three int64 numpy arrays sorted by ``start``; a segment runs to the next
segment's start (the last to ``nbytes``), and byte ``p`` of segment ``i`` is
stream byte ``stream_offset[i] + p - start[i]`` of origin ``origin_id[i]``.

Invariants (kept by every operation):

* ``start[0] == 0`` (when ``nbytes > 0``) and ``start`` is strictly increasing;
* segments are coalesced: no segment continues its predecessor's stream
  (same origin id and ``stream_offset[i] == stream_offset[i-1] + start[i] - start[i-1]``),
  so equal provenance means equal arrays.

The arrays are cut into blocks of about 16k segments (a list of numpy
arrays), so an operation copies and searches only the blocks its byte range
spans.  Batch writes are vectorised; overlapping destination extents are
resolved "later extent wins" with a segment tree over elementary intervals.
A write costs O((n + w) log) for n new pieces and w segments in the blocks
its range spans.

This module also holds the extent helpers the materialised model shares:
validation, later-wins resolution, vectorised pattern generation and batched
gather/scatter of byte extents.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import struct

from dataclasses import dataclass

import numpy as np

from sim.arrays import unique_sorted
from sim.bytes.pattern import _K, _M1, _M2, Origin, _check16, _fmix32
from sim.errors import InputError

_I64 = np.int64
_I64_MAX = int(np.iinfo(np.int64).max)


def _one(x):
    """``x`` as a Python int if it is one integer (an int or a 1-element integer
    array), else None."""
    if type(x) is int:
        return x
    if isinstance(x, np.ndarray) and x.size == 1 and x.dtype.kind in "iu":
        return int(x.reshape(-1)[0])
    return None


# --------------------------------------------------------------------------
# Origins
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=1 << 16)
def origin_key(origin: Origin) -> int:
    """A 63-bit name of an origin from its fields (stable across processes and tables)."""
    return int.from_bytes(hashlib.sha256(repr(origin).encode()).digest()[:8], "little") >> 1


_PROVENANCE_V1 = b"kvrace-provenance-v1"
_PACK4 = struct.Struct("<4q").pack


class OriginTable:
    """Interns ``Origin`` objects to small int ids; shared by one run's buffers."""

    def __init__(self):
        self._ids: dict[Origin, int] = {}
        self._origins: list[Origin] = []
        self._keys: dict[int, int] = {}       # id -> origin_key of its origin (asked for)

    def key(self, i: int) -> int:
        """``origin_key`` of the origin with id ``i``, computed once per id (an id names
        one origin object for the table's life)."""
        k = self._keys.get(i)
        if k is None:
            k = self._keys[i] = origin_key(self._origins[int(i)])
        return k

    def intern(self, origin: Origin) -> int:
        if not isinstance(origin, Origin):
            raise InputError("origin", f"expected an Origin, got {type(origin).__name__}")
        i = self._ids.get(origin)
        if i is None:
            i = len(self._origins)
            self._ids[origin] = i
            self._origins.append(origin)
        return i

    def __getitem__(self, i: int) -> Origin:
        return self._origins[int(i)]

    def __len__(self) -> int:
        return len(self._origins)

    def __iter__(self):
        return iter(self._origins)

    def __repr__(self) -> str:
        return f"OriginTable({len(self)} origins)"


# --------------------------------------------------------------------------
# Extent validation
# --------------------------------------------------------------------------
def _int_array(x, where: str) -> np.ndarray:
    a = np.asarray(x)
    if a.size and a.dtype.kind not in "iu":
        raise InputError(where, f"expected integers, got dtype {a.dtype}")
    return np.atleast_1d(a.astype(_I64, copy=False))


def check_range(size: int, offset: int, nbytes: int | None, where: str) -> tuple[int, int]:
    """``(offset, nbytes)`` of a range inside a buffer of ``size`` bytes (``nbytes``
    None: to the end), or InputError."""
    offset = int(offset)
    nbytes = size - offset if nbytes is None else int(nbytes)
    if nbytes < 0 or offset < 0 or offset + nbytes > size:
        raise InputError(where, f"range [{offset}, {offset + nbytes}) is out of bounds: "
                                f"expected a range inside [0, {size})")
    return offset, nbytes


def _check_bounds(offsets, lengths, nbytes: int, where: str) -> None:
    """Raise InputError naming the first extent outside ``[0, nbytes)``."""
    bad = (lengths > 0) & ((offsets < 0) | (offsets > nbytes - lengths))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        o, n = int(offsets[i]), int(lengths[i])
        raise InputError(
            f"{where}[{i}]",
            f"extent [{o}, {o + n}) ({n} bytes at offset {o}) is out of bounds: "
            f"expected 0 <= offset and offset + length <= {nbytes}")


def extents(where: str, lengths, *pairs):
    """Validate a batch of extents.

    ``pairs`` are ``(name, offsets, nbytes)``: each offsets array is checked to
    lie in ``[0, nbytes)`` for its buffer.  Scalars broadcast.  Returns the int64
    arrays ``(lengths, offsets...)`` with zero-length extents dropped (they are
    allowed and ignored wherever they point).
    """
    fast = _plain_extents(lengths, pairs)
    if fast is not None:
        return fast
    lengths = _int_array(lengths, f"{where}.lengths")
    arrays = [_int_array(o, f"{where}.{name}") for name, o, _ in pairs]
    try:
        lengths, *arrays = np.broadcast_arrays(lengths, *arrays)
    except ValueError as e:
        raise InputError(where, f"offset and length arrays must have one length: {e}") from None
    if lengths.ndim != 1:
        raise InputError(where, f"expected 1-D offset and length arrays, got shape {lengths.shape}")
    if (lengths < 0).any():
        i = int(np.flatnonzero(lengths < 0)[0])
        raise InputError(f"{where}.lengths[{i}]", f"expected a length >= 0, got {int(lengths[i])}")
    for (name, _, nbytes), offs in zip(pairs, arrays):
        _check_bounds(offs, lengths, nbytes, f"{where}.{name}")
    keep = lengths > 0
    if keep.all():
        return (np.ascontiguousarray(lengths), *[np.ascontiguousarray(a) for a in arrays])
    return (lengths[keep], *[a[keep] for a in arrays])


def _plain_extents(lengths, pairs):
    """What :func:`extents` returns for the common case, checked in a few reductions: every
    array a 1-D int64 ndarray of one length, every length > 0, every extent in bounds (so
    nothing is dropped and nothing raises); None for anything else, which the general path
    then accepts, drops or names.

    NOTE: the memories apply every copy and write through here with arrays already planned
    and clipped; the general path's broadcasting and per-pair masks were about 4 % of a long
    engine run."""
    if type(lengths) is not np.ndarray or lengths.dtype != _I64 or lengths.ndim != 1 or not lengths.size:
        return None
    n = lengths.size
    for _, o, _ in pairs:
        if type(o) is not np.ndarray or o.dtype != _I64 or o.shape != (n,):
            return None
    if int(lengths.min()) <= 0:
        return None
    for _, o, nbytes in pairs:
        if int(o.min()) < 0 or bool((o > nbytes - lengths).any()):
            return None
    return (np.ascontiguousarray(lengths), *[np.ascontiguousarray(o) for _, o, _ in pairs])


def _starts_of(counts: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum: where each group starts in the flat order."""
    out = np.zeros(len(counts), dtype=_I64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=out[1:])
    return out


def _ranks(counts: np.ndarray) -> np.ndarray:
    """For groups of ``counts`` elements: each element's rank within its group."""
    total = int(counts.sum())
    return np.arange(total, dtype=_I64) - np.repeat(_starts_of(counts), counts)


# --------------------------------------------------------------------------
# Later-wins resolution of overlapping extents
# --------------------------------------------------------------------------
def resolve_later_wins(starts: np.ndarray, ends: np.ndarray):
    """Cut overlapping intervals ``[starts[i], ends[i])`` (all non-empty) so the
    interval with the larger index wins where they overlap.

    Returns ``(piece_start, piece_end, owner)``: disjoint pieces sorted by
    position, each owned by the index of the winning interval; adjacent pieces
    of one owner are merged.  Vectorised: a segment tree over the elementary
    intervals, ranges decomposed level by level, then maxima pushed down.
    """
    n = len(starts)
    bounds = unique_sorted(np.concatenate([starts, ends]))
    m = len(bounds) - 1                       # elementary intervals
    size = 1
    while size < m:
        size *= 2
    tree = np.full(2 * size, -1, dtype=_I64)
    lo = np.searchsorted(bounds, starts) + size
    hi = np.searchsorted(bounds, ends) + size
    prio = np.arange(n, dtype=_I64)
    active = lo < hi
    while active.any():
        sel = active & (lo & 1 == 1)
        np.maximum.at(tree, lo[sel], prio[sel])
        lo[sel] += 1
        sel = active & (hi & 1 == 1)
        hi[sel] -= 1
        np.maximum.at(tree, hi[sel], prio[sel])
        lo >>= 1
        hi >>= 1
        active = lo < hi
    level = 1
    while level < size:                       # push maxima down, level by level
        top = tree[level:2 * level]
        kids = tree[2 * level:4 * level].reshape(level, 2)   # children of node k: 2k, 2k+1
        np.maximum(kids, top[:, None], out=kids)
        level *= 2
    owner = tree[size:size + m]
    head = np.ones(m, dtype=bool)
    head[1:] = owner[1:] != owner[:-1]
    head &= owner >= 0
    tail = np.ones(m, dtype=bool)             # last elementary interval of each run
    tail[:-1] = owner[1:] != owner[:-1]
    tail &= owner >= 0
    return bounds[:-1][head], bounds[1:][tail], owner[head]


def disjoint_in_order(starts: np.ndarray, ends: np.ndarray):
    """If the intervals are pairwise disjoint, return an order sorting them by
    start; else None."""
    if len(starts) <= 1:
        return np.arange(len(starts))
    if (starts[1:] >= ends[:-1]).all():
        return np.arange(len(starts))
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    if (s[1:] >= e[:-1]).all():
        return order
    return None


# --------------------------------------------------------------------------
# Pattern bytes, vectorised over many runs of one origin
# --------------------------------------------------------------------------
_PATTERN_BATCH_BYTES = 8 << 20
#: materialise generates up to this many origins one by one, more in one pass per unit size
MATERIALISE_PER_ORIGIN = 4
MATERIALISE_GROUP_BYTES = 1 << 19


def _pattern_units(ub: int, h, soff: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``_pattern_batch`` of runs of whole units (every ``soff`` and ``lens`` a multiple of
    ``ub``): the words as one (units, words per unit) array, the word index's terms made
    once per unit size instead of once per word (a pool's initial contents, pages written
    or copied whole: what ``materialise`` meets)."""
    nu = lens // ub
    u = (np.repeat(soff // ub - _starts_of(nu), nu) + np.arange(int(nu.sum()), dtype=_I64)).astype(np.uint32)
    many = isinstance(h, np.ndarray) and h.ndim == 1
    hu = np.repeat(h.astype(np.uint32), nu) if many else np.uint32(h)
    wpu = -(-ub // 8)
    w = np.arange(wpu, dtype=np.uint32)
    with np.errstate(over="ignore"):
        # unit_seeds and _check16 of pattern.py, in place on one (units, words) array
        seeds = _fmix32(hu ^ (u * _K))
        mixed = (seeds ^ hu)[:, None] ^ (w * _M1)[None, :]
        mixed ^= mixed >> np.uint32(16)
        mixed *= _M1
        mixed ^= mixed >> np.uint32(13)
        mixed *= _M2
        mixed ^= mixed >> np.uint32(16)
        mixed &= np.uint32(0xFFFF)
        words = mixed.astype(np.uint64)
        words |= ((seeds.astype(np.uint64) << np.uint64(32))[:, None]
                  | (w.astype(np.uint64) << np.uint64(16))[None, :])
    raw = words.astype("<u8", copy=False).view(np.uint8)
    if wpu * 8 == ub:
        return raw.reshape(-1)
    return np.ascontiguousarray(raw.reshape(len(u), wpu * 8)[:, :ub]).reshape(-1)


def _pattern_batch(ub: int, h, soff: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Pattern bytes of runs ``[soff, +lens)`` of origins of unit size ``ub`` whose
    ``Origin.hash32`` is ``h`` (one uint32, or one per run), concatenated in run order."""
    if not (soff % ub).any() and not (lens % ub).any():
        return _pattern_units(ub, h, soff, lens)
    return _general_batch(ub, h, soff, lens)


def _general_batch(ub: int, h, soff: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``_pattern_batch`` of any runs, word by word."""
    u0 = soff // ub
    u1 = (soff + lens - 1) // ub
    nu = u1 - u0 + 1
    run = np.repeat(np.arange(len(soff)), nu)          # chunk -> run
    k = _ranks(nu)
    u = u0[run] + k
    b0 = np.where(k == 0, soff[run] - u * ub, 0)        # byte range of the chunk in its unit
    b1 = np.where(u == u1[run], soff[run] + lens[run] - u * ub, ub)
    w0 = b0 >> 3
    nw = ((b1 - 1) >> 3) - w0 + 1
    chunk = np.repeat(np.arange(len(u)), nw)
    w = (w0[chunk] + _ranks(nw)).astype(np.uint64)
    many = isinstance(h, np.ndarray) and h.ndim == 1
    with np.errstate(over="ignore"):
        # unit_seeds and _check16 of pattern.py, with the origin hash per unit and per word
        seeds = _fmix32((h[run] if many else h) ^ (u.astype(np.uint32) * _K))[chunk]
        words = ((seeds.astype(np.uint64) << np.uint64(32)) | (w << np.uint64(16))
                 | _check16(h[run][chunk] if many else h, seeds, w))
    raw = words.astype("<u8", copy=False).view(np.uint8)
    src = _starts_of(nw) * 8 + (b0 & 7)
    clen = b1 - b0
    dst = _starts_of(clen)
    total = int(clen.sum())
    if (src - dst == src[0]).all():                     # chunks are contiguous in raw
        return raw[src[0]:src[0] + total].copy()
    out = np.empty(total, dtype=np.uint8)
    move_extents(raw, src, out, dst, clen)
    return out


def pattern_runs(origin: Origin, stream_offsets, lengths) -> np.ndarray:
    """Pattern bytes of ``origin`` for many runs ``[stream_offset, +length)``,
    concatenated in run order (uint8).  Equals concatenating ``pattern_bytes``
    of each run, without a Python loop over runs."""
    soff = np.atleast_1d(np.asarray(stream_offsets, dtype=_I64))
    lens = np.atleast_1d(np.asarray(lengths, dtype=_I64))
    soff, lens = np.broadcast_arrays(soff, lens)
    if (soff < 0).any():
        raise InputError("stream_offsets", "expected stream offsets >= 0")
    return _runs(origin.unit_bytes, origin.hash32, soff, lens)


def pattern_runs_of(origins: list, unit_bytes: int, stream_offsets, lengths) -> np.ndarray:
    """``pattern_runs`` of many origins of one unit size at once: run ``i`` is of
    ``origins[i]``; equals concatenating ``pattern_runs(origins[i], ...)`` run by run,
    without a Python loop over origins (a pool whose pages came from many requests)."""
    soff = np.atleast_1d(np.asarray(stream_offsets, dtype=_I64))
    lens = np.atleast_1d(np.asarray(lengths, dtype=_I64))
    if (soff < 0).any():
        raise InputError("stream_offsets", "expected stream offsets >= 0")
    if any(o.unit_bytes != unit_bytes for o in origins):
        raise InputError("origins", f"expected origins of unit_bytes {unit_bytes}")
    h = np.array([o.hash32 for o in origins], dtype=np.uint32).reshape(-1)
    return _runs(unit_bytes, h, soff, lens)


def _runs(ub: int, h, soff: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The runs' pattern bytes (``h``: one hash, or one per run), generated in batches of
    about _PATTERN_BATCH_BYTES."""
    many = isinstance(h, np.ndarray) and h.ndim == 1
    keep = lens > 0
    soff, lens = soff[keep], lens[keep]
    if many:
        h = h[keep]
    total = int(lens.sum())
    # NOTE: a batch's temporaries are about ten times its bytes; many origins (a whole pool)
    # go in smaller batches, as many one-origin calls would
    B = _PATTERN_BATCH_BYTES if not many else max(1, _PATTERN_BATCH_BYTES // 16)
    # NOTE: whole units per batch, so runs of whole units stay whole (_pattern_units)
    B = max(ub, B - B % ub)
    if total <= B:
        return _pattern_batch(ub, h, soff, lens) if total else np.zeros(0, np.uint8)
    # cut runs into pieces of at most B bytes, then generate in batches of ~B
    nper = -(-lens // B)
    r = np.repeat(np.arange(len(lens)), nper)
    k = _ranks(nper)
    psoff = soff[r] + k * B
    plen = np.minimum(lens[r] - k * B, B)
    ph = h[r] if many else h
    out = np.empty(total, dtype=np.uint8)
    ends = np.cumsum(plen)
    cuts = np.searchsorted(ends, np.arange(B, total, B), side="left") + 1
    pos, prev = 0, 0
    for c in unique_sorted(cuts).tolist() + [len(plen)]:
        if c <= prev:
            continue
        part = _pattern_batch(ub, ph[prev:c] if many else ph, psoff[prev:c], plen[prev:c])
        out[pos:pos + len(part)] = part
        pos += len(part)
        prev = c
    return out


# --------------------------------------------------------------------------
# Moving byte extents between numpy arrays
# --------------------------------------------------------------------------
_BIG_EXTENT = 1 << 16
_MOVE_BATCH_BYTES = 32 << 20


def _windows(a: np.ndarray, length: int) -> np.ndarray:
    """A view of ``a`` whose element ``i`` is the ``length`` bytes at ``a[i:]``."""
    return np.ndarray((a.size - length + 1,), dtype=np.dtype((np.void, length)),
                      buffer=a, strides=(1,))


def _move_equal(src, s, dst, d, length: int) -> None:
    if length >= _BIG_EXTENT or len(s) <= 4:
        for a, b in zip(s.tolist(), d.tolist()):
            dst[b:b + length] = src[a:a + length]
        return
    sw, dw = _windows(src, length), _windows(dst, length)
    step = max(1, _MOVE_BATCH_BYTES // length)
    for i in range(0, len(s), step):
        dw[d[i:i + step]] = sw[s[i:i + step]]


def move_extents(src: np.ndarray, s, dst: np.ndarray, d, lens) -> None:
    """Copy extents ``src[s[i]:+lens[i]] -> dst[d[i]:+lens[i]]`` (uint8, 1-D,
    contiguous).  Destination extents must be disjoint and ``src``/``dst`` must
    not share memory; bounds are the caller's to check."""
    n = len(lens)
    if n == 0:
        return
    if (lens == lens[0]).all():
        _move_equal(src, s, dst, d, int(lens[0]))
        return
    uniq, inv = np.unique(lens, return_inverse=True)
    if len(uniq) <= 16:
        for k, length in enumerate(uniq.tolist()):
            sel = inv == k
            _move_equal(src, s[sel], dst, d[sel], length)
        return
    big = lens >= 4096
    for a, b, length in zip(s[big].tolist(), d[big].tolist(), lens[big].tolist()):
        dst[b:b + length] = src[a:a + length]
    s, d, lens = s[~big], d[~big], lens[~big]
    ends = np.cumsum(lens)
    lo = 0
    while lo < len(lens):                               # batches of ~8 MiB, flat indices
        base = ends[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, base + (8 << 20), side="right")))
        ln = lens[lo:hi]
        delta_s = np.repeat(s[lo:hi] - _starts_of(ln), ln)
        delta_d = np.repeat(d[lo:hi] - _starts_of(ln), ln)
        r = np.arange(int(ln.sum()), dtype=_I64)
        dst[delta_d + r] = src[delta_s + r]
        lo = hi


def gather_extents(data: np.ndarray, offsets, lengths) -> np.ndarray:
    """The bytes of many extents of ``data``, concatenated."""
    out = np.empty(int(np.sum(lengths)), dtype=np.uint8)
    move_extents(data, offsets, out, _starts_of(lengths), lengths)
    return out


def scatter_extents(data: np.ndarray, offsets, lengths, flat: np.ndarray) -> None:
    """Write concatenated ``flat`` bytes to disjoint extents of ``data``."""
    move_extents(flat, _starts_of(lengths), data, offsets, lengths)


# --------------------------------------------------------------------------
# Compact buffer
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Pieces:
    """Maximal runs of one origin stream in a byte range (int64 arrays)."""

    start: np.ndarray           # absolute offset in the buffer
    length: np.ndarray
    origin_id: np.ndarray
    stream_offset: np.ndarray

    def __len__(self) -> int:
        return len(self.start)


def _coalesce_mask(st, oid, so) -> np.ndarray:
    """True where a segment starts a new run (does not continue its predecessor)."""
    keep = np.ones(len(st), dtype=bool)
    if len(st) > 1:
        keep[1:] = (oid[1:] != oid[:-1]) | (so[1:] != so[:-1] + (st[1:] - st[:-1]))
    return keep


def _window_pieces(st, oid, soff, offset: int, stop: int):
    """Segments of a window clipped to ``[offset, stop)`` (inside the window)."""
    i0 = int(np.searchsorted(st, offset, side="right")) - 1
    i1 = int(np.searchsorted(st, stop, side="left"))
    seg = st[i0:i1]
    nxt = np.empty(len(seg), dtype=_I64)
    nxt[:-1] = seg[1:]
    nxt[-1] = stop
    s = np.maximum(seg, offset)
    e = np.minimum(nxt, stop)
    return Pieces(s, e - s, oid[i0:i1].copy(), soff[i0:i1] + (s - seg))


def _window_gather(st, oid, soff, end: int, s_off, lens):
    """The source pieces of many extents, in extent order then position:
    ``(extent, start, stop, origin_id, stream_offset)``.  The window's last
    segment runs to ``end``."""
    s_end = s_off + lens
    i0 = np.searchsorted(st, s_off, side="right") - 1
    i1 = np.searchsorted(st, s_end, side="left")          # exclusive
    cnt = i1 - i0
    ext = np.repeat(np.arange(len(lens)), cnt)
    seg = i0[ext] + _ranks(cnt)
    nxt = seg + 1
    inside = nxt < len(st)
    seg_end = np.full(len(seg), end, dtype=_I64)
    seg_end[inside] = st[nxt[inside]]
    ps = np.maximum(st[seg], s_off[ext])
    pe = np.minimum(seg_end, s_end[ext])
    return ext, ps, pe, oid[seg], soff[seg] + (ps - st[seg])


def _window_write(st, oid, soff, end: int, ns, ne, noid, nsoff):
    """A window's segments after writing disjoint, sorted, non-empty pieces
    that lie inside it (its last segment runs to ``end``).  Returns new arrays,
    coalesced.

    The old rows a piece replaces are those starting inside it (one index range per piece,
    found by searching the pieces' bounds among the rows: O(k log W)); the rows kept, the
    pieces and the rows where the old contents resume after a piece are already in order
    gap by gap (the rows before piece 0, piece 0, its resume row, the rows between it and
    piece 1, ...), so they are placed by index arithmetic, O(W + k), without sorting the
    window."""
    S = len(st)
    lo, hi = int(ns[0]), int(ne[-1])
    i0 = int(np.searchsorted(st, lo, side="right")) - 1
    i1 = int(np.searchsorted(st, hi, side="left"))
    ws = st[i0:i1]
    W, k = i1 - i0, len(ns)
    c0 = ws.searchsorted(ns, "left")              # the first row each piece replaces
    c1 = ws.searchsorted(ne, "left")              # the first row after it (>= 1: ws[0] <= lo)
    # the old contents resume after a piece where no row starts at its end, the next piece
    # does not start there and the buffer does not end there; from the row before c1
    j = i0 + c1
    after = np.where(j < S, st[np.minimum(j, S - 1)], end)
    nxt_start = np.empty(k, dtype=_I64)
    nxt_start[:-1] = ns[1:]
    nxt_start[-1] = -1
    resume = (ne < end) & (ne != nxt_start) & (after != ne)
    # the kept rows, gap by gap: [0, c0[0]), [c1[0], c0[1]), ..., [c1[-1], W)
    g0 = np.concatenate(([0], c1))
    cnt = np.concatenate((c0, [W])) - g0
    kept = i0 + np.repeat(g0, cnt) + _ranks(cnt)
    # places: gap q's rows follow the q pieces and the resume rows before them (``shift[q]``
    # new rows); piece q follows gap q
    r = resume.astype(_I64)
    shift = np.concatenate(([0], np.arange(1, k + 1, dtype=_I64) + np.cumsum(r)))
    old_at = np.arange(kept.size, dtype=_I64) + np.repeat(shift, cnt)
    at = np.cumsum(cnt[:-1]) + shift[:-1]
    n = kept.size + k + int(r.sum())
    rk = j[resume] - 1
    ra = at[resume] + 1
    pos, po, pf = np.empty(n, _I64), np.empty(n, _I64), np.empty(n, _I64)
    pos[old_at], po[old_at], pf[old_at] = st[kept], oid[kept], soff[kept]
    pos[at], po[at], pf[at] = ns, noid, nsoff
    pos[ra], po[ra], pf[ra] = ne[resume], oid[rk], soff[rk] + (ne[resume] - st[rk])
    # coalesce, including the neighbours just outside [i0, i1)
    a, b = max(i0 - 1, 0), min(i1 + 1, S)
    pos = np.concatenate([st[a:i0], pos, st[i1:b]])
    po = np.concatenate([oid[a:i0], po, oid[i1:b]])
    pf = np.concatenate([soff[a:i0], pf, soff[i1:b]])
    keep = _coalesce_mask(pos, po, pf)
    if not keep.all():
        pos, po, pf = pos[keep], po[keep], pf[keep]
    return (np.concatenate([st[:a], pos, st[b:]]), np.concatenate([oid[:a], po, oid[b:]]),
            np.concatenate([soff[:a], pf, soff[b:]]))


#: a write of k pieces into a window of S segments takes ``_window_write_few`` (plain Python
#: over the pieces) when ``k <= FEW_PIECES + S // FEW_SEGMENTS``: its cost grows with k, the
#: general path's (about 40 numpy calls) with S (measured: about 14 us a piece against
#: 140 us + 0.025 us a segment)
FEW_PIECES = 10
FEW_SEGMENTS = 512
#: ``fill`` validates up to this many extents in plain Python (``_few_valid_extents``)
FEW_EXTENTS = 48


def _window_write_few(st, oid, soff, end: int, ns: list, ne: list, noid: list, nsoff: list):
    """``_window_write`` for a few pieces (lists), when the window is coalesced (the
    buffer's invariant): the window's rows a piece does not cover are kept as slices of
    the old arrays, and only the joints next to a new row (a piece, or the old contents
    resuming after one) are coalesced.  O(k log S) searches, O(k) Python and one
    concatenation per array, where the general path makes O(S) work in about 40 numpy calls."""
    S, k = len(st), len(ns)
    pos = st.searchsorted(np.array(ns + ne, _I64), side="right").tolist()
    A = [p - 1 for p in pos[:k]]                 # the segment holding each piece's start
    K = [p - 1 for p in pos[k:]]                 # the last segment starting at or before its end
    need = sorted({0, S - 1, *A, *K, *[a - 1 for a in A if a], *[x + 1 for x in K if x + 1 < S]})
    ix = np.array(need, _I64)
    at = dict(zip(need, zip(st[ix].tolist(), oid[ix].tolist(), soff[ix].tolist())))
    rows: list = []             # new rows kept (start, origin id, stream offset)
    parts: list = []            # [old lo, old hi] or [None, first new row, last new row + 1]
    last = None                 # the last row of the output so far

    def old(lo: int, hi: int) -> None:
        nonlocal last
        if hi <= lo:
            return
        s0, o0, f0 = at[lo]
        if last is not None and o0 == last[1] and f0 == last[2] + (s0 - last[0]):
            lo += 1                             # continues the row before it
        if hi > lo:
            parts.append([lo, hi])
            last = at[hi - 1]

    def new(row: tuple) -> None:
        nonlocal last
        if last is not None and row[1] == last[1] and row[2] == last[2] + (row[0] - last[0]):
            return
        if parts and parts[-1][0] is None:
            parts[-1][2] += 1
        else:
            parts.append([None, len(rows), len(rows) + 1])
        rows.append(row)
        last = row

    prev = 0
    for p in range(k):
        a, q = A[p], ne[p]
        old(prev, a + 1 if at[a][0] < ns[p] else a)
        new((ns[p], noid[p], nsoff[p]))
        sk, ok_, fk = at[K[p]]
        if q < end and (p + 1 == k or ns[p + 1] != q) and sk != q:
            new((q, ok_, fk + q - sk))          # the old contents resume after the piece
        prev = K[p] if sk == q else K[p] + 1
    old(prev, S)
    new_rows = np.array(rows, _I64).reshape(-1, 3)
    return tuple(np.concatenate([arr[q[0]:q[1]] if q[0] is not None else new_rows[q[1]:q[2], col]
                                 for q in parts])
                 for col, arr in enumerate((st, oid, soff)))


def _few_valid_extents(dst, lengths, soff, nbytes: int) -> bool | None:
    """For int64 1-D arrays of one size, at most ``FEW_EXTENTS``: None unless every extent is
    non-empty and in bounds (``0 <= dst <= nbytes - length``, ``0 <= soff <= int64 max -
    length``: then ``extents`` would return them unchanged); else whether they are sorted
    and disjoint."""
    if not (type(dst) is np.ndarray and type(lengths) is np.ndarray and type(soff) is np.ndarray):
        return None
    n = lengths.size
    if not (0 < n <= FEW_EXTENTS and lengths.shape == dst.shape == soff.shape == (n,)
            and lengths.dtype == dst.dtype == soff.dtype == _I64):
        return None
    L, D, F = lengths.tolist(), dst.tolist(), soff.tolist()
    if min(L) <= 0 or min(D) < 0 or min(F) < 0:
        return None
    for d, ln, f in zip(D, L, F):
        if d > nbytes - ln or f > _I64_MAX - ln:
            return None
    return all(D[i] + L[i] <= D[i + 1] for i in range(n - 1))


#: a buffer makes its queued writes (write-behind, ``CompactBuffer.write_behind``) without
#: waiting for a look once this many pieces, or this many writes, are queued
WRITE_BEHIND_PIECES = 1 << 18
WRITE_BEHIND_WRITES = 512

#: a write whose pieces leave more than this many blocks untouched between them writes the
#: blocks on each side in separate windows (``CompactBuffer._write_now``)
WRITE_GAP_BLOCKS = 1

#: the attributes holding a buffer's segments (absent while writes are queued)
_STATE = ("_bs", "_bo", "_bf", "_first", "_count")


class _Behind:
    """Writes a buffer has queued and not made (write-behind): each of ``writes`` is the
    arguments of one ``_write_now`` (pieces in priority order), made over the contents
    ``base`` (a state: the ``_STATE`` values) or, with no base, over those of ``parent``
    once its own writes are made.  A link a clone holds is ``shared``: the buffer queues its
    next write on a new link, so the clone's contents stay those of its moment.  ``state``:
    the contents once made, kept for every holder of the link (then the rest is dropped).
    ``pieces`` and ``count`` count the pieces and writes queued along the chain."""

    __slots__ = ("base", "parent", "writes", "pieces", "count", "shared", "state")

    def __init__(self, base, parent):
        self.base, self.parent = base, parent
        self.writes: list = []
        self.pieces = parent.pieces if parent is not None else 0
        self.count = parent.count if parent is not None else 0
        self.shared = False
        self.state = None

    def add(self, ns, ne, noid, nsoff, ordered: bool) -> None:
        self.writes.append((ns, ne, noid, nsoff, ordered))
        self.pieces += len(ns)
        self.count += 1

    def resolve(self, nbytes: int, table) -> tuple:
        """The contents after every write of the chain up to this link, made here in one
        window write (later pieces win where pieces overlap, as one write after another)."""
        if self.state is None:
            links, b = [], self
            while True:
                links.append(b)
                if b.base is not None:
                    start = b.base
                    break
                b = b.parent
                if b.state is not None:
                    start = b.state
                    break
            writes = [w for link in reversed(links) for w in link.writes]
            buf = CompactBuffer.__new__(CompactBuffer)
            buf.nbytes, buf.table = nbytes, table
            buf._adopt(start)
            if len(writes) == 1:
                buf._write_now(*writes[0])
            else:
                buf._write_now(*(np.concatenate(col) for col in list(zip(*writes))[:4]))
            self.state = tuple(buf.__dict__[k] for k in _STATE)
            self.base = self.parent = self.writes = None
        return self.state


#: ``_pieces_small`` answers for a range over at most this many segments (else None: the arrays)
SMALL_PIECE_ROWS = 8


def _row_pieces(lo: int, hi: int, starts: list, after: int, oids: list, soffs: list):
    """The pieces of ``[lo, hi)`` over segment rows ``starts`` (lists, the first starting at or
    before ``lo``, the last before ``hi``; the row after them starts at ``after``): starts,
    stops, origin ids, stream offsets, as lists (``CompactBuffer._pieces_small``)."""
    if len(starts) == 1:                       # inside one segment: no list to build
        s0 = starts[0]
        a = lo if lo > s0 else s0
        return [a], [hi], oids, [soffs[0] + a - s0]
    ps = [max(s, lo) for s in starts]
    pe = [min(e, hi) for e in starts[1:] + [after]]
    return ps, pe, oids, [f + (a - s) for f, a, s in zip(soffs, ps, starts)]


class CompactBuffer:
    """A buffer of ``nbytes`` bytes whose contents are kept as provenance.

    The segment arrays are cut into blocks of about ``block_segments``
    segments, so an operation touches (copies, re-sorts) only the blocks its
    byte range spans, not the whole buffer.
    """

    #: NOTE: a write re-cuts every block it spans, so its cost grows with the block: 4,096
    #: segments cost 12-15 % less CPU than 16,384 over a 30-45 s ``incident`` run, with the same
    #: results (1,024 and 2,048 measured the same as 4,096; BENCHMARKS.md, ninth session)
    block_segments = 1 << 12

    #: NOTE: write-behind: a buffer of several blocks queues its writes (``_Behind``) and makes
    #: them in one window write when its contents are next looked at.  A load-back's per-layer
    #: copies into one device pool (a write each, over the blocks of one layer) and a batch's
    #: store (a write over every block) are then made together: a window write's fixed cost and
    #: its blocks' segments are paid once, not once per write.  False: every write at once.
    write_behind = True

    def __init__(self, nbytes: int, table: OriginTable, origin: Origin, stream_offset: int = 0):
        nbytes, stream_offset = int(nbytes), int(stream_offset)
        if nbytes < 0:
            raise InputError("nbytes", f"expected nbytes >= 0, got {nbytes}")
        if stream_offset < 0:
            raise InputError("stream_offset", f"expected stream_offset >= 0, got {stream_offset}")
        k = 1 if nbytes else 0
        self._init(nbytes, table, np.zeros(k, dtype=_I64),
                   np.full(k, table.intern(origin), dtype=_I64), np.full(k, stream_offset, dtype=_I64))

    def _init(self, nbytes, table, st, oid, soff) -> None:
        self.nbytes, self.table = int(nbytes), table
        self._bs: list[np.ndarray] = []       # per block: starts, origin ids, stream offsets
        self._bo: list[np.ndarray] = []
        self._bf: list[np.ndarray] = []
        self._first = np.zeros(0, dtype=_I64)  # first start of each block
        self._count = 0
        if len(st):
            self._replace(0, 0, st, oid, soff)

    @classmethod
    def _from_segments(cls, nbytes, table, start, oid, soff) -> "CompactBuffer":
        buf = cls.__new__(cls)
        if 0 < len(start) <= cls.block_segments:      # one block, as _replace would cut it
            buf.nbytes, buf.table = int(nbytes), table
            buf._bs, buf._bo, buf._bf = [start], [oid], [soff]
            buf._first = start[:1].copy()
            buf._count = len(start)
            return buf
        buf._init(nbytes, table, start, oid, soff)
        return buf

    #: ``small_runs()`` remembered by a buffer made with its runs at hand (a read's view);
    #: every write forgets it
    _runs = None

    def __getattr__(self, name):
        # NOTE: only called for attributes not set: the segments while writes are queued
        # (write_behind), made now
        if name in _STATE:
            b = self.__dict__.get("_behind")
            if b is not None:
                self._adopt(b.resolve(self.nbytes, self.table))
                return self.__dict__[name]
        raise AttributeError(name)

    def _adopt(self, state: tuple) -> None:
        """Hold segments ``state`` (the ``_STATE`` values; the block lists are copied, the
        arrays shared) and no queued writes."""
        bs, bo, bf, first, count = state
        d = self.__dict__
        d.pop("_behind", None)
        d["_bs"], d["_bo"], d["_bf"], d["_first"], d["_count"] = list(bs), list(bo), list(bf), first, count

    def _replace(self, k0: int, k1: int, st, oid, soff) -> None:
        """Replace blocks ``[k0, k1)`` by segments cut into even blocks."""
        self._runs = None
        n = len(st)
        old = sum(len(b) for b in self._bs[k0:k1])
        nblk = -(-n // self.block_segments)
        cuts = [(i * n) // nblk for i in range(nblk + 1)]

        def part(a, lo, hi):
            return a if (lo == 0 and hi == n and a.base is None) else a[lo:hi].copy()

        self._bs[k0:k1] = [part(st, cuts[i], cuts[i + 1]) for i in range(nblk)]
        self._bo[k0:k1] = [part(oid, cuts[i], cuts[i + 1]) for i in range(nblk)]
        self._bf[k0:k1] = [part(soff, cuts[i], cuts[i + 1]) for i in range(nblk)]
        self._first = np.concatenate([self._first[:k0], st[cuts[:-1]], self._first[k1:]])
        self._count += n - old

    def _span(self, lo: int, hi: int, pad: bool = False):
        """Blocks ``[k0, k1)`` covering bytes ``[lo, hi)`` (one more block each
        side with ``pad``), their segments concatenated, and where they end."""
        nblk = len(self._first)
        k0 = int(np.searchsorted(self._first, lo, side="right")) - 1
        k1 = int(np.searchsorted(self._first, hi, side="left"))
        if pad:
            k0, k1 = max(k0 - 1, 0), min(k1 + 1, nblk)
        end = int(self._first[k1]) if k1 < nblk else self.nbytes
        if k1 - k0 == 1:
            return k0, k1, self._bs[k0], self._bo[k0], self._bf[k0], end
        return (k0, k1, np.concatenate(self._bs[k0:k1]), np.concatenate(self._bo[k0:k1]),
                np.concatenate(self._bf[k0:k1]), end)

    def _gather(self, s_off, lens):
        """``_window_gather`` of extents ``[s_off, s_off + lens)`` (non-empty, in bounds) over
        this buffer: their source pieces, in extent order then position.

        NOTE: only the blocks the extents touch are concatenated (every block of the span when
        they touch more than half of it), through ``_blocks_joined``, which keeps its last
        result.  A copy's extents can be spread over the whole buffer (a per-layer load from a
        ``page_first`` host pool reads one slice of every page), where concatenating every
        block between the first and the last extent cost more than the gather, and the next
        layer's copy reads the same blocks.  A segment's end is the next segment's start in
        the buffer, or the end of its block, so the pieces are those of the whole span."""
        first = self._first
        nblk = len(first)
        s_end = s_off + lens
        if nblk > 2:
            kb0 = first.searchsorted(s_off, "right") - 1
            cnt = first.searchsorted(s_end, "left") - kb0
            k0, k1 = int(kb0.min()), int((kb0 + cnt).max())
            blocks = unique_sorted(np.repeat(kb0, cnt) + _ranks(cnt))
            if 2 * blocks.size > k1 - k0:
                # NOTE: dense: every block of the span, joined (and kept: the next layer's copy
                # out of the same host pool spans the same blocks, as a sparse one touches them)
                blocks = np.arange(k0, k1)
            st, seg_end, oid_all, soff_all = self._blocks_joined(blocks)
            i0 = np.searchsorted(st, s_off, side="right") - 1
            c = np.searchsorted(st, s_end, side="left") - i0
            ext = np.repeat(np.arange(len(lens)), c)
            seg = i0[ext] + _ranks(c)
            ps = np.maximum(st[seg], s_off[ext])
            pe = np.minimum(seg_end[seg], s_end[ext])
            return ext, ps, pe, oid_all[seg], soff_all[seg] + (ps - st[seg])
        _, _, st, oid, soff, end = self._span(int(s_off.min()), int(s_end.max()))
        return _window_gather(st, oid, soff, end, s_off, lens)

    #: the last ``_blocks_joined`` result: (key, what the key's ids name, the joined arrays)
    _joined = None

    def _blocks_joined(self, blocks: np.ndarray):
        """Blocks ``blocks`` (sorted block indices) joined: their starts, each segment's end
        (the next start in its block, the last one's its block's end), origin ids and stream
        offsets, as four arrays.

        NOTE: the last result is kept, keyed by the identity of the block arrays and of the
        block starts (``_first``): no operation writes either in place (a write replaces the
        arrays of the blocks it spans, a re-cut replaces ``_first``), and the entry holds them,
        so their ids are not reused while it lives.  A load-back's per-layer copies out of a
        ``page_first`` host pool read one slice of the same pages, layer after layer, with no
        write to the host pool between them: each joined the same blocks again (about half of
        the gather's cost)."""
        bl = blocks.tolist()
        bs, bo, bf = [self._bs[k] for k in bl], [self._bo[k] for k in bl], [self._bf[k] for k in bl]
        key = (id(self._first), *map(id, bs), *map(id, bo), *map(id, bf))
        got = self._joined
        if got is not None and got[0] == key:
            return got[2]
        st = np.concatenate(bs)
        seg_end = np.empty(st.size, _I64)
        seg_end[:-1] = st[1:]
        seg_end[np.cumsum(np.fromiter(map(len, bs), _I64, len(bs))) - 1] = \
            np.append(self._first[1:], self.nbytes)[blocks]
        out = (st, seg_end, np.concatenate(bo), np.concatenate(bf))
        for a in out:
            a.setflags(write=False)            # shared by the gathers that find the entry
        self._joined = (key, (self._first, bs, bo, bf), out)
        return out

    def __repr__(self) -> str:
        return f"CompactBuffer({self.nbytes} bytes, {self.segment_count()} segments)"

    def clone(self) -> "CompactBuffer":
        """An independent buffer with the same contents and table, in O(blocks): the block
        arrays are shared (no operation writes a block array in place; every write
        replaces the arrays of the blocks it spans), the lists holding them are not."""
        out = CompactBuffer.__new__(CompactBuffer)
        out.nbytes, out.table = self.nbytes, self.table
        b = self.__dict__.get("_behind")
        if b is not None:
            # queued writes stay queued: the clone holds the same link (made once for both)
            b.shared = True
            out._behind = b
            return out
        out._bs, out._bo, out._bf = list(self._bs), list(self._bo), list(self._bf)
        out._first = self._first
        out._count = self._count
        out._runs = self._runs
        return out

    # ---- queries ---------------------------------------------------------
    def segment_count(self) -> int:
        return self._count

    def memory_bytes(self) -> int:
        return self._first.nbytes + sum(a.nbytes for arrays in (self._bs, self._bo, self._bf)
                                        for a in arrays)

    def coalesced_segments(self):
        """The maximal runs ``(start, origin_id, stream_offset)`` (ids of this buffer's
        table): equal for two buffers of one table with the same contents."""
        st, oid, so = self.segments()       # (a run split between blocks, or by a slice, is joined)
        keep = _coalesce_mask(st, oid, so)
        return st[keep], oid[keep], so[keep]

    def canonical_segments(self):
        """The maximal runs ``(start, origin key, stream offset)`` as int64 arrays, with
        origins named by a hash of their fields (``origin_key``): two buffers with the
        same contents have equal arrays, whatever their origin tables or block cuts."""
        st, oid, so = self.segments()
        keep = _coalesce_mask(st, oid, so)          # canonical: blocks may split a run
        st, oid, so = st[keep], oid[keep], so[keep]
        uniq, inv = np.unique(oid, return_inverse=True)
        key = self.table.key
        keys = np.array([key(i) for i in uniq.tolist()], dtype=_I64)
        return st, keys[inv.reshape(-1)] if len(st) else np.zeros(0, _I64), so

    #: buffers of at most this many segments (in one block) answer small_runs()
    SMALL_RUNS = 8

    def small_runs(self) -> list | None:
        """The maximal runs ``(start, origin_id, stream_offset)`` as a list of tuples when
        the buffer has at most ``SMALL_RUNS`` segments in one block (a read's view), else
        None: what ``coalesced_segments`` gives, without numpy."""
        if self._runs is not None:
            return self._runs
        if self._count > self.SMALL_RUNS or len(self._bs) != 1:
            return None
        runs, last = [], None
        for s, o, f in zip(self._bs[0].tolist(), self._bo[0].tolist(), self._bf[0].tolist()):
            if last is not None and o == last[1] and f == last[2] + (s - last[0]):
                continue                                   # continues the run before it
            last = (s, o, f)
            runs.append(last)
        return runs

    def provenance_digest(self) -> str:
        """sha256 (hex) of the buffer's size and canonical segments: equal provenance
        means equal bytes; it costs O(segments), not O(bytes)."""
        runs = self.small_runs()
        if runs is not None:                               # a few segments: plain Python, same bytes
            if len(runs) == 1:                             # one run (most of a read's views): one pack
                s, o, f = runs[0]
                return hashlib.sha256(_PROVENANCE_V1 + _PACK4(self.nbytes, s, self.table.key(o), f)).hexdigest()
            key = self.table.key
            flat = [x for s, o, f in runs for x in (s, key(o), f)]
            h = hashlib.sha256(b"kvrace-provenance-v1" + struct.pack("<q", self.nbytes))
            h.update(struct.pack(f"<{len(flat)}q", *flat))
            return h.hexdigest()
        else:
            st, keys, so = self.canonical_segments()
        h = hashlib.sha256(b"kvrace-provenance-v1" + np.int64(self.nbytes).tobytes())
        h.update(np.stack([st, keys, so], axis=1).astype("<i8").tobytes())
        return h.hexdigest()

    def segments(self):
        """The segment arrays ``(start, origin_id, stream_offset)`` (copies)."""
        if not self._bs:
            return tuple(np.zeros(0, dtype=_I64) for _ in range(3))
        return np.concatenate(self._bs), np.concatenate(self._bo), np.concatenate(self._bf)

    def _range(self, offset: int, nbytes: int | None, where: str):
        return check_range(self.nbytes, offset, nbytes, where)

    def pieces(self, offset: int = 0, nbytes: int | None = None) -> Pieces:
        offset, nbytes = self._range(offset, nbytes, "pieces")
        if nbytes == 0:
            e = np.zeros(0, dtype=_I64)
            return Pieces(e, e.copy(), e.copy(), e.copy())
        _, _, st, oid, soff, _ = self._span(offset, offset + nbytes)
        return _window_pieces(st, oid, soff, offset, offset + nbytes)

    def locate(self, offsets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For byte offsets (int64, each in ``[0, nbytes)``): the row of the segment holding
        each (numbered from 0 in buffer order: two offsets lie in one segment exactly when
        their rows are equal; rows are below ``segment_count()``), its origin id and
        ``delta`` (a byte ``x`` of that segment has stream offset ``x + delta``).  Searches
        the blocks the offsets fall in, without building the pieces between them."""
        x = np.asarray(offsets, _I64)
        row, oid, delta = np.empty(x.size, _I64), np.empty(x.size, _I64), np.empty(x.size, _I64)
        if not x.size:
            return row, oid, delta
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi >= self.nbytes:
            raise InputError("offsets", f"expected byte offsets in [0, {self.nbytes}), got {lo}..{hi}")
        bs, bo, bf, first = self._bs, self._bo, self._bf, self._first
        if len(bs) == 1:
            i = bs[0].searchsorted(x, "right") - 1
            return i, bo[0][i], bf[0][i] - bs[0][i]
        kb = first.searchsorted(x, "right") - 1
        base = np.cumsum([0] + [len(b) for b in bs[:-1]])
        for k in unique_sorted(kb).tolist():
            m = np.flatnonzero(kb == k)
            st = bs[k]
            i = st.searchsorted(x[m], "right") - 1
            row[m], oid[m], delta[m] = base[k] + i, bo[k][i], bf[k][i] - st[i]
        return row, oid, delta

    def slice(self, offset: int, nbytes: int) -> "CompactBuffer":
        """An independent buffer of ``nbytes`` holding this buffer's range."""
        offset, nbytes = int(offset), int(nbytes)
        if nbytes > 0 and 0 <= offset <= self.nbytes - nbytes:
            got = self._pieces_small(offset, offset + nbytes)
            if got is not None:
                ps, _, po, pf = got
                if len(ps) <= self.SMALL_RUNS:       # what small_runs() would compute, at hand
                    runs, last = [], None
                    for a, o, f in zip(ps, po, pf):
                        if last is not None and o == last[1] and f == last[2] + (a - offset - last[0]):
                            continue
                        last = (a - offset, o, f)
                        runs.append(last)
                    return _SmallView(nbytes, self.table, [a - offset for a in ps], po, pf, runs)
                return CompactBuffer._from_segments(nbytes, self.table, np.array(ps, _I64) - offset,
                                                    np.array(po, _I64), np.array(pf, _I64))
        p = self.pieces(offset, nbytes)
        return CompactBuffer._from_segments(nbytes, self.table, p.start - int(offset),
                                            p.origin_id, p.stream_offset)

    #: ``slices`` of fewer ranges slice them one at a time
    SLICES_MIN = 4

    def slices(self, offsets, lengths) -> list:
        """``[self.slice(o, n) for o, n in zip(offsets, lengths)]`` (a read's views): the
        ranges that lie in one block and a few segments (what ``slice`` makes a small view
        of) are looked up together, two ``searchsorted`` per block instead of per range."""
        offs = offsets.tolist() if isinstance(offsets, np.ndarray) else [int(x) for x in offsets]
        lens = lengths.tolist() if isinstance(lengths, np.ndarray) else [int(x) for x in lengths]
        n = len(offs)
        if n != len(lens):
            raise InputError("lengths", f"expected one length per offset ({n}), got {len(lens)}")
        out: list = [None] * n
        if n >= self.SLICES_MIN and self._bs:
            O, L = np.array(offs, _I64), np.array(lens, _I64)
            H = O + L
            ok = (L > 0) & (O >= 0) & (H <= self.nbytes)
            if len(self._first) == 1:
                blk = np.zeros(n, _I64)
            else:
                blk = self._first.searchsorted(O, "right") - 1
                ok &= H <= np.append(self._first[1:], self.nbytes)[blk]
            small = min(8, self.SMALL_RUNS)          # what _pieces_small and slice keep small
            for kb in unique_sorted(blk[ok]).tolist():
                sel = np.flatnonzero(ok & (blk == kb))
                st, oid, soff = self._bs[kb], self._bo[kb], self._bf[kb]
                lo = O[sel]
                i0 = st.searchsorted(lo, "right") - 1
                c = st.searchsorted(H[sel], "left") - i0
                few = c <= small
                sel, lo, i0, c = sel[few], lo[few], i0[few], c[few]
                row = np.repeat(np.arange(sel.size), c)
                seg = i0[row] + _ranks(c)
                s_seg = st[seg]
                a = np.maximum(s_seg, lo[row])
                rel, po, pf = (a - lo[row]).tolist(), oid[seg].tolist(), (soff[seg] + (a - s_seg)).tolist()
                p = 0
                table = self.table
                for j, cnt in zip(sel.tolist(), c.tolist()):
                    if cnt == 1:
                        o, f = po[p], pf[p]
                        out[j] = _SmallView(lens[j], table, [0], [o], [f], [(0, o, f)])
                    else:
                        ps, oo, ff = rel[p:p + cnt], po[p:p + cnt], pf[p:p + cnt]
                        runs, last = [], None
                        for x, o, f in zip(ps, oo, ff):
                            if last is not None and o == last[1] and f == last[2] + (x - last[0]):
                                continue
                            last = (x, o, f)
                            runs.append(last)
                        out[j] = _SmallView(lens[j], table, ps, oo, ff, runs)
                    p += cnt
        for j in range(n):
            if out[j] is None:
                out[j] = self.slice(offs[j], lens[j])
        return out

    def materialise(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        offset, nbytes = self._range(offset, nbytes, "materialise")
        out = np.empty(nbytes, dtype=np.uint8)
        p = self.pieces(offset, nbytes)
        if len(p) == 0:
            return out
        ids, inv = np.unique(p.origin_id, return_inverse=True)
        inv = inv.reshape(-1)
        if len(ids) <= MATERIALISE_PER_ORIGIN:
            for k, oid in enumerate(ids.tolist()):
                sel = inv == k if len(ids) > 1 else slice(None)
                flat = pattern_runs(self.table[oid], p.stream_offset[sel], p.length[sel])
                scatter_extents(out, p.start[sel] - offset, p.length[sel], flat)
            return out
        # NOTE: many origins (a pool written by many requests): one pass per unit size over
        # every piece, instead of one per origin
        origins = [self.table[oid] for oid in ids.tolist()]
        ub = np.array([o.unit_bytes for o in origins], dtype=_I64)
        for size in unique_sorted(ub).tolist():
            idx = np.flatnonzero(ub[inv] == size)
            # pieces in groups of about MATERIALISE_GROUP_BYTES, each scattered at once (the
            # pattern of a whole pool is never held twice)
            ends = np.cumsum(p.length[idx])
            cuts = unique_sorted(np.searchsorted(ends, np.arange(MATERIALISE_GROUP_BYTES, int(ends[-1]),
                                                             MATERIALISE_GROUP_BYTES), side="left") + 1)
            prev = 0
            for c in cuts.tolist() + [len(idx)]:
                if c <= prev:
                    continue
                sel = idx[prev:c]
                flat = pattern_runs_of([origins[k] for k in inv[sel].tolist()], size, p.stream_offset[sel],
                                       p.length[sel])
                scatter_extents(out, p.start[sel] - offset, p.length[sel], flat)
                prev = c
        return out

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """The bytes of a range (same as ``materialise(offset, nbytes)``)."""
        return self.materialise(offset, nbytes)

    def equals(self, other) -> bool:
        """Same provenance everywhere (a ``MaterialBuffer``: same bytes)."""
        if not isinstance(other, CompactBuffer):
            data = getattr(other, "data", None)
            return data is not None and len(data) == self.nbytes and bool(
                np.array_equal(self.materialise(), data))
        if other.nbytes != self.nbytes or other.segment_count() != self.segment_count():
            return False
        (s1, o1, f1), (s2, o2, f2) = self.segments(), other.segments()
        if not (np.array_equal(s1, s2) and np.array_equal(f1, f2)):
            return False
        if other.table is self.table:
            return bool(np.array_equal(o1, o2))
        return [self.table[i] for i in o1.tolist()] == [other.table[i] for i in o2.tolist()]

    # ---- writes ----------------------------------------------------------
    def fill(self, dst_offsets, lengths, origin: Origin, stream_offsets) -> None:
        """Write pattern bytes of ``origin`` (from ``stream_offsets``) into extents."""
        n, d, s = _one(lengths), _one(dst_offsets), _one(stream_offsets)
        if n is not None and d is not None and s is not None and n >= 0 and 0 <= d <= self.nbytes - n \
                and 0 <= s <= _I64_MAX - n:
            if n and not self._write_small([d], [d + n], [self.table.intern(origin)], [s]):
                self._write(np.array([d], _I64), np.array([d + n], _I64),
                            np.array([self.table.intern(origin)], _I64), np.array([s], _I64))
            return
        few = _few_valid_extents(dst_offsets, lengths, stream_offsets, self.nbytes)
        if few is not None:
            # NOTE: what extents() would return (nothing dropped, nothing out of bounds),
            # checked in plain Python: its dozen numpy calls cost more than a few extents' work
            self._write(dst_offsets, dst_offsets + lengths, np.full(len(lengths), self.table.intern(origin), _I64),
                        stream_offsets, ordered=few, owned=False)
            return
        lens, dst, soff = extents("fill", lengths, ("dst_offsets", dst_offsets, self.nbytes),
                                  ("stream_offsets", stream_offsets, np.iinfo(_I64).max))
        oid = self.table.intern(origin)
        if len(lens):
            self._write(dst, dst + lens, np.full(len(lens), oid, dtype=_I64), soff, owned=False)

    def fill_groups(self, dst_offsets, lengths, origins, stream_offsets) -> None:
        """:meth:`fill` of several origins in one write: the extents are ``len(origins)`` equal
        groups, group ``k`` holding pattern bytes of ``origins[k]`` (a multi-layer write: one
        group per layer); a later extent wins where extents overlap, as one fill per group in
        group order would give."""
        lengths = _int_array(lengths, "fill_groups.lengths")
        k = len(origins)
        if not (k > 0 and lengths.size % k == 0):
            raise InputError("origins", f"expected the {lengths.size} extents in {k} equal groups (one per origin)")
        oids = np.repeat(np.array([self.table.intern(o) for o in origins], _I64), lengths.size // k)
        # NOTE: the origin ids ride along as a third offsets array (bounded by int64), so the
        # zero-length extents extents() drops take their ids with them
        lens, dst, soff, oid = extents("fill", lengths, ("dst_offsets", dst_offsets, self.nbytes),
                                       ("stream_offsets", stream_offsets, _I64_MAX), ("origins", oids, _I64_MAX))
        if len(lens):
            self._write(dst, dst + lens, oid, soff, owned=False)

    def copy_from(self, src: "CompactBuffer", src_offsets, dst_offsets, lengths) -> None:
        """Copy extents of ``src`` into this buffer: all source bytes are read
        first (``src`` may be ``self``), then written in extent order (a later
        extent wins where destination extents overlap)."""
        if not isinstance(src, CompactBuffer):
            raise InputError("src", f"expected a CompactBuffer, got {type(src).__name__}")
        n, so, do = _one(lengths), _one(src_offsets), _one(dst_offsets)
        if n is not None and so is not None and do is not None and n > 0 and 0 <= so <= src.nbytes - n \
                and 0 <= do <= self.nbytes - n:
            got = src._pieces_small(so, so + n)
            if got is not None:
                ps, pe, po, pf = got
                if src.table is not self.table:
                    po = [self.table.intern(src.table[i]) for i in po]
                shift = do - so
                ps = [x + shift for x in ps]
                pe = [x + shift for x in pe]
                if self._write_small(ps, pe, po, pf):
                    return
                self._write(np.array(ps, _I64), np.array(pe, _I64), np.array(po, _I64), np.array(pf, _I64))
                return
        lens, s_off, d_off = extents("copy_from", lengths,
                                     ("src_offsets", src_offsets, src.nbytes),
                                     ("dst_offsets", dst_offsets, self.nbytes))
        if not len(lens):
            return
        ext, ps, pe, oid, soff = src._gather(s_off, lens)
        if src.table is not self.table:
            uniq, inv = np.unique(oid, return_inverse=True)
            remap = np.array([self.table.intern(src.table[i]) for i in uniq.tolist()], dtype=_I64)
            oid = remap[inv.reshape(-1)]
        shift = d_off[ext] - s_off[ext]
        self._write(ps + shift, pe + shift, oid, soff)

    # ---- small operations: one extent inside one block, in plain Python over a few rows
    def _block_of(self, lo: int) -> int:
        first = self._first
        return 0 if len(first) == 1 else int(first.searchsorted(lo, "right")) - 1

    def _pieces_small(self, lo: int, hi: int):
        """The pieces of ``[lo, hi)`` as lists (starts, stops, origin ids, stream
        offsets) when the range lies in one block and a few segments; else None."""
        if not self._bs:
            return None
        k = self._block_of(lo)
        end = int(self._first[k + 1]) if k + 1 < len(self._first) else self.nbytes
        if hi > end:
            return None
        st = self._bs[k]
        i0 = int(st.searchsorted(lo, "right")) - 1
        n = len(st)
        if i0 + 1 == n or int(st[i0 + 1]) >= hi:
            # inside one segment (st[i0] <= lo < hi <= the next start): no second search
            return _row_pieces(lo, hi, [int(st[i0])], hi, [int(self._bo[k][i0])], [int(self._bf[k][i0])])
        i1 = int(st.searchsorted(hi, "left"))
        if i1 - i0 > SMALL_PIECE_ROWS:
            return None
        return _row_pieces(lo, hi, st[i0:i1].tolist(), int(st[i1]) if i1 < n else end,
                           self._bo[k][i0:i1].tolist(), self._bf[k][i0:i1].tolist())

    def _write_small(self, ns, ne, noid, nsoff) -> bool:
        """Write pieces (lists, sorted, each non-empty) that tile ``[ns[0], ne[-1])``
        without gaps, when the range lies in one block and does not touch a block
        boundary where a neighbour block's segment could continue it.  Returns
        False (nothing written) otherwise."""
        lo, hi = ns[0], ne[-1]
        if len(ns) > 1 and any(ne[i] != ns[i + 1] for i in range(len(ns) - 1)):
            return False
        nblk = len(self._first)
        k = 0 if nblk == 1 else int(self._first.searchsorted(lo, "right")) - 1
        end = int(self._first[k + 1]) if k + 1 < nblk else self.nbytes
        if hi > end or (hi == end and k + 1 < nblk):
            return False
        st, oid, so = self._bs[k], self._bo[k], self._bf[k]
        n = len(st)
        i0 = int(st.searchsorted(lo, "right")) - 1
        p = i0 + 1 if int(st[i0]) < lo else i0          # rows [0, p) stay
        if p == 0 and k > 0:
            return False
        last = (int(st[p - 1]), int(oid[p - 1]), int(so[p - 1])) if p else None
        rows = list(zip(ns, noid, nsoff))
        if hi < end:
            # the last segment starting at or before hi (st[i0] <= lo < hi: i0 when the next
            # segment starts after hi, without a second search)
            r = i0 if (i0 + 1 == n or int(st[i0 + 1]) > hi) else int(st.searchsorted(hi, "right")) - 1
            sr = int(st[r])
            if sr == hi:
                q = r
            else:
                q = r + 1
                rows.append((hi, int(oid[r]), int(so[r]) + hi - sr))
        else:
            q = n
        out = []
        for row in rows:
            if last is not None and row[1] == last[1] and row[2] == last[2] + (row[0] - last[0]):
                continue                      # continues the run before it
            out.append(row)
            last = row
        if q < n and last is not None and int(oid[q]) == last[1] \
                and int(so[q]) == last[2] + (int(st[q]) - last[0]):
            q += 1
        if len(out) == q - p:
            # as many rows as they replace (a page over a page): copy and set, no concatenation
            # (the arrays may be shared with other buffers: never written in place)
            new_s, new_o, new_f = st.copy(), oid.copy(), so.copy()
            for j, (a0, a1, a2) in enumerate(out, p):
                new_s[j] = a0
                new_o[j] = a1
                new_f[j] = a2
        elif out:
            a = np.array(out, dtype=_I64).reshape(-1, 3)
            new_s = np.concatenate((st[:p], a[:, 0], st[q:]))
            new_o = np.concatenate((oid[:p], a[:, 1], oid[q:]))
            new_f = np.concatenate((so[:p], a[:, 2], so[q:]))
        else:
            new_s = np.concatenate((st[:p], st[q:]))
            new_o = np.concatenate((oid[:p], oid[q:]))
            new_f = np.concatenate((so[:p], so[q:]))
        if len(new_s) > 2 * self.block_segments:
            self._replace(k, k + 1, new_s, new_o, new_f)
        else:
            self._bs[k], self._bo[k], self._bf[k] = new_s, new_o, new_f
            self._count += len(new_s) - n
            self._runs = None
        return True

    def _write(self, ns, ne, noid, nsoff, ordered: bool = False, owned: bool = True) -> None:
        """Write new pieces (in priority order; non-empty, in bounds; ``ordered``: known to
        be sorted and disjoint): queued on a buffer of several blocks (``write_behind``),
        else made at once.  ``owned=False``: ``ns`` and ``nsoff`` may be the caller's (a fill's
        offsets), who may write them after the call: a queued write holds copies of them (``ne``
        and ``noid`` are always made by the caller's method)."""
        d = self.__dict__
        b = d.get("_behind")
        if b is None:
            if not (self.write_behind and "_first" in d and len(d["_first"]) > 1):
                self._write_now(ns, ne, noid, nsoff, ordered)
                return
            b = d["_behind"] = _Behind(tuple(d.pop(k) for k in _STATE), None)
        elif b.shared:
            b = d["_behind"] = _Behind(None, b)
        if not owned:
            ns, nsoff = np.array(ns, _I64), np.array(nsoff, _I64)
        b.add(ns, ne, noid, nsoff, ordered)
        self._runs = None
        if b.pieces >= WRITE_BEHIND_PIECES or b.count >= WRITE_BEHIND_WRITES:
            self._adopt(b.resolve(self.nbytes, self.table))

    def _write_now(self, ns, ne, noid, nsoff, ordered: bool = False) -> None:
        """``_write``, made at once."""
        if not ordered:
            order = disjoint_in_order(ns, ne)
            if order is None:
                ps, pe, owner = resolve_later_wins(ns, ne)
                ns, ne, noid, nsoff = ps, pe, noid[owner], nsoff[owner] + (ps - ns[owner])
            elif not (order[1:] > order[:-1]).all():
                ns, ne, noid, nsoff = ns[order], ne[order], noid[order], nsoff[order]
        first = self._first
        if len(ns) > 1 and len(first) > WRITE_GAP_BLOCKS + 2:
            # NOTE: pieces far apart (a backup's pages spread over a host pool) are written run
            # by run of the blocks they touch: one window over every block between them costs
            # each untouched block's segments, a window more costs its fixed part only
            kb0 = first.searchsorted(ns, "right") - 1
            kb1 = first.searchsorted(ne, "left") - 1          # the block of a piece's last byte
            cuts = (np.flatnonzero(kb0[1:] - kb1[:-1] > WRITE_GAP_BLOCKS) + 1).tolist()
            if cuts:
                for a, b in zip([0, *cuts], [*cuts, len(ns)]):
                    self._write_run(ns[a:b], ne[a:b], noid[a:b], nsoff[a:b])
                return
        self._write_run(ns, ne, noid, nsoff)

    def _write_run(self, ns, ne, noid, nsoff) -> None:
        """Write sorted, disjoint, non-empty pieces over the blocks they span."""
        # NOTE: first over the blocks the pieces span alone, then, only where the result's first
        # or last segment continues the neighbour block's (the buffer keeps its segments
        # coalesced across blocks), again with one more block each side.  The window_write of
        # the padded blocks changes nothing outside the unpadded ones but those two joints, so
        # both give the same segments; the unpadded window is a third of the padded one.
        lo, hi = int(ns[0]), int(ne[-1])
        for pad in (False, True):
            k0, k1, st, oid, soff, end = self._span(lo, hi, pad=pad)
            if len(ns) <= FEW_PIECES + len(st) // FEW_SEGMENTS:
                new = _window_write_few(st, oid, soff, end, ns.tolist(), ne.tolist(), noid.tolist(),
                                        nsoff.tolist())
            else:
                new = _window_write(st, oid, soff, end, ns, ne, noid, nsoff)
            if pad or not (self._continues(k0 - 1, new, 0) or self._continues(k1, new, -1)):
                self._replace(k0, k1, *new)
                return

    def _continues(self, k: int, new: tuple, at: int) -> bool:
        """Whether block ``k``'s neighbouring segment and segment ``at`` (0: the first, -1: the
        last) of the new window segments ``new`` would coalesce: the new first continues block
        ``k``'s last segment, or block ``k``'s first continues the new last (False when there
        is no block ``k``)."""
        if not 0 <= k < len(self._bs):
            return False
        st, oid, so = new
        if at == 0:
            a, b = (int(self._bs[k][-1]), int(self._bo[k][-1]), int(self._bf[k][-1])), \
                (int(st[0]), int(oid[0]), int(so[0]))
        else:
            a, b = (int(st[-1]), int(oid[-1]), int(so[-1])), \
                (int(self._bs[k][0]), int(self._bo[k][0]), int(self._bf[k][0]))
        return a[1] == b[1] and b[2] == a[2] + (b[0] - a[0])


class _SmallView(CompactBuffer):
    """A slice of a few segments (a read's view): its segment lists are kept as Python
    lists and made into the block arrays only when something needs them, so a view that
    is only compared and digested by its runs (``small_runs``: an ``ok`` read) never
    builds numpy arrays.  Once built it is an ordinary ``CompactBuffer`` (equal to
    ``CompactBuffer._from_segments`` of the same segments: ``tests/test_speed_bytes.py``)."""

    _LAZY = frozenset({"_bs", "_bo", "_bf", "_first"})

    def __init__(self, nbytes: int, table: OriginTable, starts: list, oids: list, soffs: list, runs: list):
        self.nbytes, self.table = nbytes, table
        self._count = len(starts)
        self._runs = runs
        self._pending = (starts, oids, soffs)

    def __getattr__(self, name):
        # only called for attributes not set: the block arrays before they are built
        if name not in _SmallView._LAZY or "_pending" not in self.__dict__:
            return super().__getattr__(name)
        starts, oids, soffs = self.__dict__.pop("_pending")
        st = np.array(starts, _I64)
        self._bs, self._bo, self._bf = [st], [np.array(oids, _I64)], [np.array(soffs, _I64)]
        self._first = st[:1].copy()
        return self.__dict__[name]

    def _pieces_small(self, lo: int, hi: int):
        """``CompactBuffer._pieces_small`` from the segment lists while the arrays are not
        built (a read's view that is described: ``describe``), else from the arrays."""
        pending = self.__dict__.get("_pending")
        if pending is None:
            return super()._pieces_small(lo, hi)
        st, oid, so = pending
        i0 = bisect.bisect_right(st, lo) - 1
        n = len(st)
        if i0 + 1 == n or st[i0 + 1] >= hi:
            return _row_pieces(lo, hi, [st[i0]], hi, [oid[i0]], [so[i0]])
        i1 = bisect.bisect_left(st, hi)
        if i1 - i0 > SMALL_PIECE_ROWS:
            return None
        return _row_pieces(lo, hi, st[i0:i1], st[i1] if i1 < n else self.nbytes, oid[i0:i1], so[i0:i1])
