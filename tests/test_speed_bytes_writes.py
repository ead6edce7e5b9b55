"""The compact model's few-pieces write paths (issue 9's speed): ``_window_write_few`` (plain
Python over the pieces, the old rows kept as slices) gives ``_window_write``'s arrays, and
``fill``'s plain-Python validation of a few extents (``_few_valid_extents``) gives what
``extents`` gives; whole buffers written both ways hold the same segments, block by block."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.bytes.compact as compact
from sim.bytes import CompactBuffer, Origin, OriginTable
from sim.bytes.compact import _coalesce_mask, _few_valid_extents, _window_write, _window_write_few, extents
from sim.errors import InputError
from tests.test_bytes_models import check_coalesced

UNIT = 16
ORIGINS = [Origin("kv", 0, -1, 0, UNIT), Origin("kv", 1, 3, 1, UNIT), Origin("idx", 2, 5, 2, UNIT)]


def _coalesced_window(rng, end, n):
    """A random coalesced window: n segment starts in [0, end), origin ids 0-2, offsets
    that sometimes continue the previous segment's stream (then the pair is merged)."""
    st = np.unique(np.r_[0, rng.integers(1, end, n)]).astype(np.int64)
    oid = rng.integers(0, 3, st.size).astype(np.int64)
    so = rng.integers(0, 4, st.size).astype(np.int64) * UNIT
    cont = rng.random(st.size) < 0.3
    for i in np.flatnonzero(cont)[np.flatnonzero(cont) > 0].tolist():
        oid[i], so[i] = oid[i - 1], so[i - 1] + st[i] - st[i - 1]
    keep = _coalesce_mask(st, oid, so)
    return st[keep], oid[keep], so[keep]


def _pieces(rng, end, k, st, oid, so):
    """k disjoint sorted non-empty pieces inside [0, end); some rewrite what is there, some
    continue each other or their neighbours (the joints the few path coalesces)."""
    cuts = np.unique(rng.integers(0, end + 1, 2 * k))
    if cuts.size % 2:
        cuts = cuts[:-1]
    ns, ne = cuts[0::2], cuts[1::2]
    if rng.integers(0, 2) and ns.size > 1:           # some pieces touch the next one
        ne[:-1] = np.where(rng.random(ns.size - 1) < 0.5, ns[1:], ne[:-1])
    noid = rng.integers(0, 3, ns.size).astype(np.int64)
    nso = rng.integers(0, 4, ns.size).astype(np.int64) * UNIT
    for i in range(ns.size):
        r = rng.random()
        if r < 0.25:                                  # the bytes already there (continues the old row)
            j = int(np.searchsorted(st, ns[i], side="right")) - 1
            noid[i], nso[i] = oid[j], so[j] + ns[i] - st[j]
        elif r < 0.4 and i:                           # continues the previous piece's stream
            noid[i], nso[i] = noid[i - 1], nso[i - 1] + ns[i] - ns[i - 1]
    return ns.astype(np.int64), ne.astype(np.int64), noid, nso


def _window_write_by_sorting(st, oid, soff, end, ns, ne, noid, nsoff):
    """``_window_write`` as it was first written: every old row's start searched among the
    pieces, the kept rows, pieces and resume rows sorted together (the reference the
    index-arithmetic version is checked against)."""
    S = len(st)
    lo, hi = int(ns[0]), int(ne[-1])
    i0 = int(np.searchsorted(st, lo, side="right")) - 1
    i1 = int(np.searchsorted(st, hi, side="left"))
    ws, wo, wf = st[i0:i1], oid[i0:i1], soff[i0:i1]
    j = np.searchsorted(ns, ws, side="right") - 1
    covered = (j >= 0) & (ws < ne[np.maximum(j, 0)])
    nxt_start = np.empty(len(ns), dtype=np.int64)
    nxt_start[:-1] = ns[1:]
    nxt_start[-1] = -1
    k = np.searchsorted(st, ne, side="right") - 1
    resume = (ne < end) & (ne != nxt_start) & (st[k] != ne)
    rk = k[resume]
    pos = np.concatenate([ws[~covered], ns, ne[resume]])
    po = np.concatenate([wo[~covered], noid, oid[rk]])
    pf = np.concatenate([wf[~covered], nsoff, soff[rk] + (ne[resume] - st[rk])])
    srt = np.argsort(pos, kind="stable")
    a, b = max(i0 - 1, 0), min(i1 + 1, S)
    pos = np.concatenate([st[a:i0], pos[srt], st[i1:b]])
    po = np.concatenate([oid[a:i0], po[srt], oid[i1:b]])
    pf = np.concatenate([soff[a:i0], pf[srt], soff[i1:b]])
    keep = _coalesce_mask(pos, po, pf)
    pos, po, pf = pos[keep], po[keep], pf[keep]
    return (np.concatenate([st[:a], pos, st[b:]]), np.concatenate([oid[:a], po, oid[b:]]),
            np.concatenate([soff[:a], pf, soff[b:]]))


@pytest.mark.parametrize("seed", range(300))
def test_window_write_equals_the_sorting_version(seed):
    """The window write places rows by index arithmetic; sorting them gives the same arrays,
    on random coalesced windows (few and many rows) and pieces (touching, continuing their
    neighbours or the rows they overwrite, at the window's ends)."""
    rng = np.random.default_rng(seed)
    end = int(rng.choice([8, 64, 4096, 1 << 20]))
    st, oid, so = _coalesced_window(rng, end, int(rng.integers(0, min(end, 3000))))
    ns, ne, noid, nso = _pieces(rng, end, int(rng.integers(1, 200)), st, oid, so)
    if ns.size == 0:
        return
    want = _window_write_by_sorting(st, oid, so, end, ns, ne, noid, nso)
    got = _window_write(st, oid, so, end, ns, ne, noid, nso)
    assert [x.tolist() for x in got] == [x.tolist() for x in want]
    assert all(x.dtype == np.int64 for x in got)
    assert (np.diff(got[0]) > 0).all() and _coalesce_mask(*got).all()


@pytest.mark.parametrize("seed", range(100))
def test_window_write_few_equals_window_write(seed):
    rng = np.random.default_rng(seed)
    end = int(rng.choice([8, 64, 4096]))
    st, oid, so = _coalesced_window(rng, end, int(rng.integers(0, min(end, 60))))
    ns, ne, noid, nso = _pieces(rng, end, int(rng.integers(1, 12)), st, oid, so)
    if ns.size == 0:
        return
    want = _window_write(st, oid, so, end, ns, ne, noid, nso)
    got = _window_write_few(st, oid, so, end, ns.tolist(), ne.tolist(), noid.tolist(), nso.tolist())
    assert [x.tolist() for x in got] == [x.tolist() for x in want]
    assert all(x.dtype == np.int64 for x in got)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 70), st.integers(-2, 12), st.integers(-2, 40)), min_size=1, max_size=6),
       st.sampled_from(["int64", "int32", "list"]))
def test_few_valid_extents_agrees_with_extents(rows, dtype):
    """None unless extents() keeps every extent unchanged (and raises nothing); else whether
    they are sorted and disjoint."""
    d, n, s = (np.array(col, np.int64) for col in zip(*rows))
    if dtype == "int32":
        d, n, s = d.astype(np.int32), n.astype(np.int32), s.astype(np.int32)
    elif dtype == "list":
        d, n, s = d.tolist(), n.tolist(), s.tolist()
    got = _few_valid_extents(d, n, s, 64)
    try:
        lens, dst, soff = extents("fill", n, ("dst_offsets", d, 64), ("stream_offsets", s, np.iinfo(np.int64).max))
    except InputError:
        assert got is None
        return
    kept = len(lens) == len(rows) and dtype == "int64"
    assert (got is not None) == kept
    if kept:
        assert got == bool(((dst[1:] >= dst[:-1] + lens[:-1]).all()))


step = st.tuples(st.integers(0, 2), st.lists(st.tuples(st.integers(0, 63), st.integers(1, 5), st.integers(0, 9)),
                                              min_size=1, max_size=40), st.booleans())


@pytest.mark.parametrize("blocks", [None, 3])
@settings(max_examples=15, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=25))
def test_buffers_written_both_ways_hold_the_same_segments(blocks, steps):
    """Fills (many extents, any order, overlapping or not) and copies, with the few-pieces
    paths on (every write of up to 40 pieces) and off: the same blocks of segments."""
    size = 64 * UNIT
    t = OriginTable()
    mp = pytest.MonkeyPatch()
    bufs = {}
    for few in (40, 0):
        mp.setattr(compact, "FEW_PIECES", few)
        mp.setattr(compact, "FEW_SEGMENTS", 1 << 40)
        mp.setattr(compact, "FEW_EXTENTS", few)
        if blocks:
            mp.setattr(CompactBuffer, "block_segments", blocks)
        try:
            b = [CompactBuffer(size, t, ORIGINS[0]), CompactBuffer(size, t, ORIGINS[1], 5 * UNIT)]
            for o, ext, copy in steps:
                d = np.array([x[0] * UNIT for x in ext], np.int64)
                n = np.minimum(np.array([x[1] * UNIT for x in ext], np.int64), size - d)
                s = np.array([x[2] * UNIT for x in ext], np.int64)
                if copy:
                    b[o % 2].copy_from(b[1 - o % 2], np.minimum(s, size - n), d, n)
                else:
                    b[o % 2].fill(d, n, ORIGINS[o], s)
                for x in b:
                    check_coalesced(x)
        finally:
            mp.undo()
        bufs[few] = b
    fast, slow = bufs[40], bufs[0]
    for f, w in zip(fast, slow):
        assert [a.tolist() for a in f._bs] == [a.tolist() for a in w._bs]
        assert [a.tolist() for a in f._bo] == [a.tolist() for a in w._bo]
        assert [a.tolist() for a in f._bf] == [a.tolist() for a in w._bf]
        assert f.segment_count() == w.segment_count()
        assert f.materialise().tobytes() == w.materialise().tobytes()


@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(12))
def test_writes_join_runs_across_block_boundaries(blocks, seed):
    """A write is made over the blocks its pieces span alone, unless its first or last
    segment continues the neighbour block's run (then again with one more block each side):
    one stream written back in shuffled chunks, by fills and by copies, ends as one segment,
    coalesced after every write; and random writes give the segments of the always-padded
    write (``_continues`` always True)."""
    rng = np.random.default_rng(seed)
    mp = pytest.MonkeyPatch()
    mp.setattr(CompactBuffer, "block_segments", blocks)
    try:
        size = 48 * UNIT
        cuts = np.unique(np.r_[0, rng.integers(1, 48, 20), 48]) * UNIT
        chunks = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
        t = OriginTable()
        src = CompactBuffer(size, t, ORIGINS[2], 7 * UNIT)
        for how in ("fill", "copy"):
            b = CompactBuffer(size, t, ORIGINS[0])
            for k in rng.permutation(len(chunks)).tolist():
                a, e = chunks[k]
                if how == "fill":
                    b.fill(np.array([a], np.int64), np.array([e - a], np.int64), ORIGINS[1],
                           np.array([a + UNIT], np.int64))
                else:
                    b.copy_from(src, np.array([a], np.int64), np.array([a], np.int64), np.array([e - a], np.int64))
                check_coalesced(b)
            assert b.segment_count() == 1
        got = {}
        for padded in (False, True):
            if padded:
                mp.setattr(CompactBuffer, "_continues", lambda self, k, new, at: True)
            r = np.random.default_rng(seed + 1000)
            b = [CompactBuffer(size, t, ORIGINS[0]), CompactBuffer(size, t, ORIGINS[1], 5 * UNIT)]
            for _ in range(30):
                i = int(r.integers(2))
                k = int(r.integers(1, 6))
                d = np.sort(r.choice(48, k, replace=False)).astype(np.int64) * UNIT
                n = np.minimum(r.integers(1, 4, k) * UNIT, size - d)
                s = d + int(r.integers(0, 3)) * UNIT       # often the stream the buffer holds
                if r.integers(2):
                    b[i].copy_from(b[1 - i], np.minimum(s, size - n), d, n)
                else:
                    b[i].fill(d, n, ORIGINS[int(r.integers(2))], s)
                check_coalesced(b[i])
            got[padded] = [[a.tolist() for a in x.segments()] for x in b]
        assert got[False] == got[True]
    finally:
        mp.undo()
