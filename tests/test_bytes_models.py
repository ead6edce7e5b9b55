"""The compact and materialised byte models against each other and against
plain Python references."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.bytes import (CompactBuffer, MaterialBuffer, Origin, OriginTable, describe,
                       describe_text, pattern_bytes)
from sim.bytes.compact import move_extents, resolve_later_wins
from sim.errors import InputError

ORIGINS = [Origin("kv", 0, -1, 0, 656), Origin("index_k", 7, 12, 1, 132),
           Origin("kv", 3, 40, 0, 8), Origin("latent", 1, 5, 2, 3), Origin("index_k", 0, 1, 0, 1),
           Origin("kv", 2, 9, 1, 13)]


def naive_copy(dst: bytearray, src: bytes, extents):
    """Reference semantics: read every source extent first, then write in order."""
    chunks = [bytes(src[s:s + n]) for s, _, n in extents]
    for (_, d, n), c in zip(extents, chunks):
        dst[d:d + n] = c


def check_coalesced(buf: CompactBuffer):
    start, oid, soff = buf.segments()
    assert buf.segment_count() == len(start)
    assert [len(b) > 0 for b in buf._bs] == [True] * len(buf._bs)
    assert np.array_equal(buf._first, [b[0] for b in buf._bs])
    if buf.nbytes == 0:
        assert len(start) == 0
        return
    assert start[0] == 0 and (np.diff(start) > 0).all() and start[-1] < buf.nbytes
    cont = (oid[1:] == oid[:-1]) & (soff[1:] == soff[:-1] + np.diff(start))
    assert not cont.any(), "adjacent segments that continue one stream must be coalesced"


def check_pieces(buf: CompactBuffer, ref: bytes, offset: int, nbytes: int):
    p = buf.pieces(offset, nbytes)
    assert p.length.sum() == nbytes
    if nbytes:
        assert p.start[0] == offset and (p.length > 0).all()
        assert np.array_equal(p.start[1:], (p.start + p.length)[:-1])
        cont = (p.origin_id[1:] == p.origin_id[:-1]) & (
            p.stream_offset[1:] == p.stream_offset[:-1] + p.length[:-1])
        assert not cont.any()
    for s, n, o, so in zip(p.start.tolist(), p.length.tolist(), p.origin_id.tolist(),
                           p.stream_offset.tolist()):
        assert pattern_bytes(buf.table[o], so, n).tobytes() == ref[s:s + n]


@st.composite
def extent_list(draw, src_size, dst_size, max_n=6):
    n = draw(st.integers(0, max_n))
    out = []
    for _ in range(n):
        if min(src_size, dst_size) == 0 or draw(st.integers(0, 9)) == 0:
            out.append((draw(st.integers(0, src_size)), draw(st.integers(0, dst_size)), 0))
            continue
        length = draw(st.integers(1, min(src_size, dst_size)))
        out.append((draw(st.integers(0, src_size - length)),
                    draw(st.integers(0, dst_size - length)), length))
    return out


@pytest.fixture(params=[None, 1, 3], ids=["blocks-default", "blocks-1", "blocks-3"])
def block_segments(request):
    """Run with the default block size and with tiny blocks (so block
    boundaries fall everywhere)."""
    saved = CompactBuffer.block_segments
    if request.param:
        CompactBuffer.block_segments = request.param
    yield
    CompactBuffer.block_segments = saved


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_differential_random_operations(block_segments, data):
    """Random fills, copies (across and within buffers, overlapping source and
    destination, overlapping destination extents) and slices: after every step
    the compact model materialises to the materialised model's bytes, and to a
    bytearray reference."""
    table = OriginTable()
    sizes = data.draw(st.lists(st.integers(0, 400), min_size=1, max_size=3), label="sizes")
    compact, material, ref = [], [], []
    for size in sizes:
        o = data.draw(st.sampled_from(ORIGINS))
        so = data.draw(st.integers(0, 5000))
        compact.append(CompactBuffer(size, table, o, so))
        material.append(MaterialBuffer(size, table, o, so))
        ref.append(bytearray(pattern_bytes(o, so, size).tobytes()))
    for step in range(data.draw(st.integers(1, 12))):
        kind = data.draw(st.sampled_from(["fill", "copy", "copy_self", "slice", "many"]))
        i = data.draw(st.integers(0, len(compact) - 1))
        if kind == "fill":
            o = data.draw(st.sampled_from(ORIGINS))
            ext = data.draw(extent_list(10**5, compact[i].nbytes))
            args = ([d for _, d, _ in ext], [n for _, _, n in ext], o, [s for s, _, _ in ext])
            compact[i].fill(*args)
            material[i].fill(*args)
            for s, d, n in ext:
                ref[i][d:d + n] = pattern_bytes(o, s, n).tobytes()
        elif kind in ("copy", "copy_self", "many"):
            j = i if kind == "copy_self" else data.draw(st.integers(0, len(compact) - 1))
            if kind == "many":      # many extents of many lengths: the vectorised paths
                n_src, n_dst = compact[j].nbytes, compact[i].nbytes
                if min(n_src, n_dst) < 2:
                    continue
                seed = data.draw(st.integers(0, 2**32 - 1))
                rng = np.random.default_rng(seed)
                k = int(rng.integers(17, 80))
                lens = rng.integers(1, min(n_src, n_dst) // 2 + 1, k)
                if rng.integers(2):
                    lens[:] = lens[0]
                ext = [(int(rng.integers(0, n_src - ln + 1)), int(rng.integers(0, n_dst - ln + 1)),
                        int(ln)) for ln in lens]
            else:
                ext = data.draw(extent_list(compact[j].nbytes, compact[i].nbytes))
            s_, d_, n_ = ([e[0] for e in ext], [e[1] for e in ext], [e[2] for e in ext])
            compact[i].copy_from(compact[j], s_, d_, n_)
            material[i].copy_from(material[j], s_, d_, n_)
            naive_copy(ref[i], bytes(ref[j]), ext)
        else:
            size = compact[i].nbytes
            off = data.draw(st.integers(0, size))
            n = data.draw(st.integers(0, size - off))
            compact.append(compact[i].slice(off, n))
            material.append(material[i].slice(off, n))
            ref.append(bytearray(ref[i][off:off + n]))
            # write into the slice: the original must not change
            k = len(compact) - 1
            ext = data.draw(extent_list(compact[i].nbytes, n))
            s_, d_, n_ = ([e[0] for e in ext], [e[1] for e in ext], [e[2] for e in ext])
            compact[k].copy_from(compact[i], s_, d_, n_)
            material[k].copy_from(material[i], s_, d_, n_)
            naive_copy(ref[k], bytes(ref[i]), ext)
        for c, m, r in zip(compact, material, ref):
            assert c.materialise().tobytes() == bytes(r)
            assert m.data.tobytes() == bytes(r)
            check_coalesced(c)
    for c, r in zip(compact, ref):
        off = data.draw(st.integers(0, c.nbytes))
        check_pieces(c, bytes(r), off, data.draw(st.integers(0, c.nbytes - off)))
        assert c.equals(c.slice(0, c.nbytes))


@settings(max_examples=150, deadline=None)
@given(ivs=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 25)), min_size=1, max_size=20))
def test_resolve_later_wins_matches_painting(ivs):
    starts = np.array([s for s, _ in ivs], dtype=np.int64)
    ends = starts + np.array([n for _, n in ivs], dtype=np.int64)
    paint = np.full(100, -1)
    for k, (s, e) in enumerate(zip(starts, ends)):
        paint[s:e] = k
    got = np.full(100, -1)
    ps, pe, owner = resolve_later_wins(starts, ends)
    assert (pe > ps).all() and (ps[1:] >= pe[:-1]).all()
    for s, e, k in zip(ps, pe, owner):
        got[s:e] = k
    assert np.array_equal(got, paint)
    # maximal: adjacent pieces have different owners
    touching = ps[1:] == pe[:-1]
    assert not (touching & (owner[1:] == owner[:-1])).any()


@pytest.mark.parametrize("lengths", [[256] * 300, [70_000] * 3, list(range(1, 40)) * 3,
                                     [5000, 3, 9000, 7] * 10, [1, 2, 3] * 50])
def test_move_extents_paths(lengths):
    rng = np.random.default_rng(len(lengths))
    lens = np.array(lengths, dtype=np.int64)
    src = rng.integers(0, 256, int(lens.sum()) * 2 + 10, dtype=np.uint8)
    s = rng.integers(0, len(src) - lens + 1)
    d = np.cumsum(lens) - lens + rng.integers(0, 3)          # disjoint destination
    d = d + np.arange(len(lens))
    dst = np.zeros(int(d[-1] + lens[-1]) + 5, dtype=np.uint8)
    ref = dst.copy()
    for a, b, n in zip(s, d, lens):
        ref[b:b + n] = src[a:a + n]
    move_extents(src, s, dst, d, lens)
    assert np.array_equal(dst, ref)


def test_copy_of_consecutive_units_is_one_segment(block_segments):
    table = OriginTable()
    tokens, row = 80_000, 656
    src_origin = Origin("kv", 7, 12, 1, row)
    host = CompactBuffer(tokens * row, table, src_origin)
    dev = CompactBuffer((tokens + 100) * row, table, Origin("kv", 7, -1, 0, row))
    rows = np.arange(tokens, dtype=np.int64) * row
    perm = np.random.default_rng(0).permutation(tokens)       # extent order does not matter
    dev.copy_from(host, rows[perm], rows[perm] + 50 * row, np.full(tokens, row))
    assert dev.segment_count() == 3
    p = dev.pieces(50 * row, tokens * row)
    assert len(p) == 1 and p.origin_id[0] == table.intern(src_origin) and p.stream_offset[0] == 0
    # one origin's consecutive units filled piecewise into consecutive places
    dev2 = CompactBuffer(tokens * row, table, Origin("kv", 7, -1, 0, row))
    dev2.fill(rows, row, src_origin, rows)
    assert dev2.segment_count() == 1 and dev2.equals(host)
    assert dev2.materialise(100 * row, 3 * row).tobytes() == \
        pattern_bytes(src_origin, 100 * row, 3 * row).tobytes()


def test_equals_across_tables_and_after_coalescing():
    o, other = ORIGINS[1], ORIGINS[2]
    a = CompactBuffer(1000, OriginTable(), o, 10)
    t = OriginTable()
    t.intern(other)
    b = CompactBuffer(1000, t, other)
    b.fill([600, 0], [400, 600], o, [610, 10])
    assert b.segment_count() == 1 and a.equals(b) and b.equals(a)
    b.fill([5], [1], other, [0])
    assert not a.equals(b)
    assert a.equals(MaterialBuffer(1000, None, o, 10))


@pytest.mark.parametrize("model", [CompactBuffer, MaterialBuffer])
def test_out_of_bounds_extents_raise(model):
    t = OriginTable()
    a, b = model(100, t, ORIGINS[0]), model(50, t, ORIGINS[1])
    with pytest.raises(ValueError, match=r"dst_offsets\[1\]"):
        a.fill([0, 90], [10, 11], ORIGINS[2], [0, 0])
    with pytest.raises(ValueError, match=r"dst_offsets\[0\]"):
        a.fill([-1], [1], ORIGINS[2], [0])
    with pytest.raises(ValueError, match=r"stream_offsets\[0\]"):
        a.fill([0], [1], ORIGINS[2], [-3])
    with pytest.raises(ValueError, match=r"src_offsets\[2\]"):
        a.copy_from(b, [0, 0, 45], [0, 0, 0], [10, 0, 6])
    with pytest.raises(InputError, match=r"dst_offsets\[0\]"):
        b.copy_from(a, [0], [1], [50])
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        b.copy_from(a, [0], [1], [-1])
    with pytest.raises(ValueError):
        a.slice(90, 11)
    before = a.materialise()
    a.copy_from(b, [10**9, 3], [-5, 200], [0, 0])           # zero-length: ignored
    a.fill([500], [0], ORIGINS[3], [0])
    assert np.array_equal(a.materialise(), before)


def test_describe():
    t = OriginTable()
    buf = CompactBuffer(132 * 10, t, Origin("index_k", 7, -1, 0, 132))
    req = Origin("index_k", 7, 12, 1, 132)
    buf.fill([132 * 2], [128], req, [3301 * 132])
    buf.fill([132 * 2 + 128], [132 + 4], Origin("index_k", 7, 40, 0, 132), [88 * 132])
    items = describe(buf, 132 * 2, 264)
    assert [d["text"] for d in items] == [
        "bytes 0-127: index_k layer 7 request 12 unit 3301 v1 (unit bytes 0-127)",
        "bytes 128-263: index_k layer 7 request 40 units 88-89 v0 "
        "(from byte 0 of unit 88 to byte 3 of unit 89)"]
    assert items[0]["origin"] == req.to_json() and items[0]["offset"] == 264
    assert (items[1]["first_unit"], items[1]["last_unit"]) == (88, 89)
    assert (items[1]["unit_byte_start"], items[1]["unit_byte_end"]) == (0, 4)
    assert describe_text(buf, 0, 10) == "bytes 0-9: index_k layer 7 initial unit 0 v0 (unit bytes 0-9)"
    many = CompactBuffer(1000, t, ORIGINS[0])
    many.fill(np.arange(0, 1000, 10), 5, ORIGINS[4], np.arange(100) * 7)
    items = describe(many, 0, 1000, max_items=8)
    assert len(items) == 8 and items[-1]["more_runs"] == 200 - 7
    assert sum(d["nbytes"] for d in items) == 1000


@settings(max_examples=150, deadline=None)
@given(ext=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(1, 10)),
                    min_size=1, max_size=6))
def test_source_destination_overlap_check(ext):
    """The materialised model copies directly (no gather-first) only when no
    source extent overlaps a destination extent."""
    from sim.bytes.material import _intersect
    src, dst = np.zeros(60, bool), np.zeros(60, bool)
    for s, d, n in ext:
        src[s:s + n] = True
        dst[d:d + n] = True
    s_, d_, n_ = (np.array([e[k] for e in ext]) for k in range(3))
    assert _intersect(s_, d_, n_) == bool((src & dst).any())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block=st.sampled_from([1, 2, 3, 5, 8, 16]))
def test_copy_gathers_only_the_blocks_its_extents_touch(seed, block):
    """``copy_from`` gathers a few extents spread over a many-block source from the blocks they
    touch (``CompactBuffer._gather``): the same pieces as the gather over the whole span between
    them, and the copy's bytes equal a bytearray reference."""
    rng = np.random.default_rng(seed)
    saved = CompactBuffer.block_segments
    CompactBuffer.block_segments = block
    try:
        table = OriginTable()
        size = 4000
        src = CompactBuffer(size, table, ORIGINS[0], 0)
        ref = bytearray(pattern_bytes(ORIGINS[0], 0, size).tobytes())
        for _ in range(60):                        # many segments, so many blocks
            o = ORIGINS[int(rng.integers(len(ORIGINS)))]
            d, n, so = int(rng.integers(0, size - 40)), int(rng.integers(1, 40)), int(rng.integers(0, 999))
            src.fill([d], [n], o, [so])
            ref[d:d + n] = pattern_bytes(o, so, n).tobytes()
        k = int(rng.integers(1, 6)) if rng.integers(2) else int(rng.integers(6, 200))   # sparse or dense
        lens = rng.integers(1, 60, k)
        s_off = np.sort(rng.choice(size - 60, k, replace=False)).astype(np.int64)
        if rng.integers(2):
            s_off = s_off[::-1].copy()             # extents in any order
        s_off, lens = s_off.astype(np.int64), lens.astype(np.int64)
        from sim.bytes.compact import _window_gather
        for _ in range(3):                         # gathered again after a write: nothing stale kept
            got = src._gather(s_off, lens)
            _, _, st_, oid, soff, end = src._span(int(s_off.min()), int((s_off + lens).max()))
            want = _window_gather(st_, oid, soff, end, s_off, lens)
            for a, b in zip(got, want):
                assert np.array_equal(a, b)
            o = ORIGINS[int(rng.integers(len(ORIGINS)))]
            j = int(rng.integers(k))                # over part of a gathered extent
            d, so = int(s_off[j]) + int(rng.integers(0, lens[j])), int(rng.integers(999))
            n = min(int(rng.integers(1, 40)), size - d)
            src.fill([d], [n], o, [so])
            ref[d:d + n] = pattern_bytes(o, so, n).tobytes()
        dst = CompactBuffer(size, table, ORIGINS[1], 0)
        dref = bytearray(pattern_bytes(ORIGINS[1], 0, size).tobytes())
        d_off = rng.integers(0, size - 60, k)
        dst.copy_from(src, s_off.tolist(), d_off.tolist(), lens.tolist())
        naive_copy(dref, bytes(ref), list(zip(s_off.tolist(), d_off.tolist(), lens.tolist())))
        assert dst.materialise().tobytes() == bytes(dref)
        check_coalesced(dst)
    finally:
        CompactBuffer.block_segments = saved


def test_copy_gather_of_sparse_extents_takes_the_touched_blocks_path(monkeypatch):
    """The case above exercises the touched-blocks path, not only the span fallback."""
    calls = []
    saved = CompactBuffer.block_segments
    CompactBuffer.block_segments = 2
    try:
        table = OriginTable()
        src = CompactBuffer(1000, table, ORIGINS[0], 0)
        for d in range(0, 1000, 10):
            src.fill([d], [5], ORIGINS[1 + d % 3], [d])
        src.segment_count()                     # the queued writes made (write-behind), before counting
        real = CompactBuffer._span
        monkeypatch.setattr(CompactBuffer, "_span", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
        ext = src._gather(np.array([3, 997 - 20], np.int64), np.array([4, 20], np.int64))
        assert not calls and len(src._first) > 50 and sorted(set(ext[0].tolist())) == [0, 1]
    finally:
        CompactBuffer.block_segments = saved

