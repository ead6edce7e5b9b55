"""The compact byte model's one-extent paths (``CompactBuffer.fill`` and ``copy_from`` with
plain integers, which go through ``_pieces_small``/``_write_small``, including the
same-row-count replacement that copies and sets instead of concatenating) give the
provenance of the general vectorised path (the same extents given as arrays) and the
bytes of a bytearray reference, with default and tiny blocks."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.bytes import CompactBuffer, Origin, OriginTable
from sim.bytes.pattern import pattern_bytes
from tests.test_bytes_models import check_coalesced

UNIT = 16
ORIGINS = [Origin("kv", 0, -1, 0, UNIT), Origin("kv", 1, 3, 1, UNIT), Origin("idx", 2, 5, 2, UNIT)]


@pytest.fixture(params=[None, 2], ids=["blocks-default", "blocks-2"])
def block_segments(request):
    saved = CompactBuffer.block_segments
    if request.param:
        CompactBuffer.block_segments = request.param
    yield
    CompactBuffer.block_segments = saved


# (kind, buffer, offset in units or bytes, length, origin / source buffer, stream or source offset)
step = st.tuples(st.sampled_from(["fill", "copy"]), st.integers(0, 1), st.integers(0, 40), st.integers(1, 3),
                 st.integers(0, 2), st.integers(0, 40), st.booleans())


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(step, min_size=1, max_size=40))
def test_one_extent_writes_equal_the_vectorised_path_and_the_bytes(block_segments, steps):
    size = 32 * UNIT
    t = OriginTable()
    fast = [CompactBuffer(size, t, ORIGINS[0]), CompactBuffer(size, t, ORIGINS[0], 7)]
    slow = [CompactBuffer(size, t, ORIGINS[0]), CompactBuffer(size, t, ORIGINS[0], 7)]
    ref = [bytearray(pattern_bytes(ORIGINS[0], 0, size).tobytes()),
           bytearray(pattern_bytes(ORIGINS[0], 7, size).tobytes())]
    for kind, b, off, n, o, so, aligned in steps:
        # page-aligned (a page over a page: the same-row-count case) or any byte offset
        d, ln = (off % 32 * UNIT, n * UNIT) if aligned else (off * 5 % (size - 1), n * 7)
        ln = min(ln, size - d)
        if kind == "fill":
            fast[b].fill(d, ln, ORIGINS[o], so * UNIT)
            slow[b].fill(np.array([d, d]), np.array([ln, ln]), ORIGINS[o], np.array([so * UNIT, so * UNIT]))
            ref[b][d:d + ln] = pattern_bytes(ORIGINS[o], so * UNIT, ln).tobytes()
        else:
            src = 1 - b if o else b
            s = (so % 32) * UNIT if aligned else so * 3 % (size - ln + 1)
            s = min(s, size - ln)
            fast[b].copy_from(fast[src], s, d, ln)
            slow[b].copy_from(slow[src], np.array([s]), np.array([d]), np.array([ln]))
            data = bytes(ref[src][s:s + ln])
            ref[b][d:d + ln] = data
        for f, w, r in zip(fast, slow, ref):
            check_coalesced(f)
            assert f.coalesced_segments()[0].tolist() == w.coalesced_segments()[0].tolist()
            assert [x.tolist() for x in f.coalesced_segments()] == [x.tolist() for x in w.coalesced_segments()]
            assert f.materialise().tobytes() == bytes(r)


def test_a_page_over_a_page_keeps_the_row_count_and_shares_no_array():
    t = OriginTable()
    buf = CompactBuffer(8 * UNIT, t, ORIGINS[0])
    buf.fill(2 * UNIT, UNIT, ORIGINS[1], 0)
    before = [a for a in buf._bs]
    view = buf.slice(0, 8 * UNIT)                 # may share arrays with buf
    n = buf.segment_count()
    buf.fill(2 * UNIT, UNIT, ORIGINS[2], 4 * UNIT)    # replaces exactly one row
    assert buf.segment_count() == n
    assert all(a is not b for a, b in zip(buf._bs, before))
    assert view.materialise().tobytes() == (pattern_bytes(ORIGINS[0], 0, 2 * UNIT).tobytes()
                                            + pattern_bytes(ORIGINS[1], 0, UNIT).tobytes()
                                            + pattern_bytes(ORIGINS[0], 3 * UNIT, 5 * UNIT).tobytes())


def _filled(table, fills) -> CompactBuffer:
    """A 32-unit buffer with ``fills`` ``(unit, bytes, origin index, stream offset)`` written in order."""
    buf = CompactBuffer(32 * UNIT, table, ORIGINS[0])
    for d, ln, o, so in fills:
        buf.fill(d * UNIT, min(ln, 32 * UNIT - d * UNIT), ORIGINS[o], so)
    return buf


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.integers(1, 40), st.integers(0, 2), st.integers(0, 99)),
                max_size=12), st.integers(0, 511), st.integers(1, 64), st.sampled_from(["read", "write", "pickle"]))
def test_a_small_view_is_the_buffer_its_segments_make(fills, off, n, then):
    """A slice of a few segments (``_SmallView``, arrays made on demand) answers every query
    as ``CompactBuffer._from_segments`` of the same segments, before and after a write."""
    import pickle

    from sim.bytes.compact import _SmallView
    t = OriginTable()
    buf = _filled(t, fills)
    n = min(n, 32 * UNIT - off)
    view = buf.slice(off, n)
    p = buf.pieces(off, n)
    plain = CompactBuffer._from_segments(n, t, p.start - off, p.origin_id, p.stream_offset)
    assert view.small_runs() == plain.small_runs()
    if isinstance(view, _SmallView) and then == "pickle":
        view = pickle.loads(pickle.dumps(view))
        assert view.table is not t
        plain = pickle.loads(pickle.dumps(plain))
    assert view.provenance_digest() == plain.provenance_digest()
    if then == "write":
        view.fill(0, 1, ORIGINS[2], 3)
        plain.fill(0, 1, ORIGINS[2], 3)
    assert [a.tolist() for a in view.segments()] == [a.tolist() for a in plain.segments()]
    assert view.segment_count() == plain.segment_count() and view.small_runs() == plain.small_runs()
    assert view.materialise().tobytes() == plain.materialise().tobytes()
    assert view.provenance_digest() == plain.provenance_digest()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.integers(1, 40), st.integers(0, 2), st.integers(0, 99)),
                max_size=12), st.integers(0, 511), st.integers(1, 200), st.data())
def test_a_small_views_pieces_from_its_lists_equal_those_of_its_arrays(fills, off, n, data):
    """``_SmallView._pieces_small`` answers from the segment lists while the arrays are not
    built (``describe`` of a read's view builds none): the same as once they are built."""
    from sim.bytes.compact import _SmallView
    t = OriginTable()
    buf = _filled(t, fills)
    n = min(n, 32 * UNIT - off)
    view, built = buf.slice(off, n), buf.slice(off, n)
    built.segments()
    for _ in range(4):
        lo = data.draw(st.integers(0, n - 1))
        hi = data.draw(st.integers(lo + 1, n))
        assert view._pieces_small(lo, hi) == built._pieces_small(lo, hi)
    assert not isinstance(view, _SmallView) or "_pending" in view.__dict__     # nothing built


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.integers(1, 40), st.integers(0, 2), st.integers(0, 99)),
                max_size=14), st.integers(0, 511), st.integers(1, 200), st.integers(1, 6), st.integers(0, 1 << 20))
def test_describe_of_a_part_numbers_bytes_from_the_larger_buffer(fills, off, n, max_items, base):
    """``describe(..., base=b)``: the items of ``describe`` with offsets and the text's byte
    ranges moved by ``b`` (a read's view at byte ``b`` of its buffer)."""
    from sim.bytes.describe import describe
    t = OriginTable()
    buf = _filled(t, fills)
    n = min(n, 32 * UNIT - off)
    plain = describe(buf, off, n, max_items)
    for it in plain:
        it["offset"] += base
        head, rest = it["text"].split(": ", 1)
        it["text"] = f"bytes {it['offset']}-{it['offset'] + it['nbytes'] - 1}: {rest}"
    assert describe(buf, off, n, max_items, base=base) == plain


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.integers(1, 40), st.integers(0, 2), st.integers(0, 99)),
                max_size=14), st.integers(0, 511), st.integers(0, 200), st.integers(1, 6))
def test_describe_of_a_few_segments_equals_describe_of_pieces(fills, off, n, max_items):
    """``describe`` reads a small range as lists (``_pieces_small``); the same as from
    ``pieces()`` arrays, including the summary item past ``max_items``."""
    from sim.bytes.describe import describe
    t = OriginTable()
    buf = _filled(t, fills)
    n = min(n, 32 * UNIT - off)
    fast = describe(buf, off, n, max_items)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(CompactBuffer, "_pieces_small", lambda self, lo, hi: None)
        slow = describe(buf, off, n, max_items)
    finally:
        mp.undo()
    assert fast == slow


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 50), st.integers(0, 5), st.integers(0, 99),
                          st.sampled_from([16, 20, 7])), min_size=1, max_size=25),
       st.integers(0, 100), st.sampled_from([1 << 23, 64, 200]))
def test_materialise_of_many_origins_equals_one_origin_at_a_time(fills, off, batch):
    """Many origins (``pattern_runs_of``, one pass per unit size, in batches of any size)
    give the bytes of one ``pattern_runs`` per origin."""
    import sim.bytes.compact as compact
    t = OriginTable()
    size = 64 * UNIT
    buf = CompactBuffer(size, t, ORIGINS[0])
    for d, ln, owner, so, ub in fills:
        buf.fill(d * UNIT, min(ln * 3, size - d * UNIT), Origin("kv", owner % 3, owner, 1, ub), so)
    off = min(off * 7, size - 1)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(compact, "_PATTERN_BATCH_BYTES", batch)
        mp.setattr(compact, "MATERIALISE_PER_ORIGIN", 0)
        fast = buf.materialise(off, size - off)
        mp.setattr(compact, "MATERIALISE_PER_ORIGIN", 1 << 30)
        slow = buf.materialise(off, size - off)
    finally:
        mp.undo()
    p = buf.pieces(off, size - off)
    want = b"".join(pattern_bytes(buf.table[int(o)], int(s), int(n)).tobytes()
                    for o, s, n in zip(p.origin_id, p.stream_offset, p.length))
    assert fast.tobytes() == slow.tobytes() == want


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31), st.integers(1, 40))
def test_gather_of_sparse_blocks_equals_the_gather_of_the_whole_span(seed, n_ext):
    """``_gather`` over only the blocks its extents touch (each segment's end from the next
    start, a block's last from the next block's first) gives the pieces the gather over every
    block between the first and last extent gives."""
    from sim.bytes.compact import _window_gather
    rng = np.random.default_rng(seed)
    saved = CompactBuffer.block_segments
    CompactBuffer.block_segments = 3
    try:
        t = OriginTable()
        b = CompactBuffer(4000, t, ORIGINS[0])
        for k in range(150):
            off = int(rng.integers(0, 3990))
            b.fill(np.array([off]), np.array([int(rng.integers(1, 10))]), ORIGINS[1 + k % 2], np.array([k]))
        s_off = np.sort(rng.choice(3990, n_ext, replace=False)).astype(np.int64)
        lens = rng.integers(1, 10, n_ext).astype(np.int64)
        if rng.integers(0, 2):
            s_off = s_off[rng.permutation(n_ext)]
        got = b._gather(s_off, lens)
        _, _, st_, oid, soff, end = b._span(int(s_off.min()), int((s_off + lens).max()))
        want = _window_gather(st_, oid, soff, end, s_off, lens)
        assert all(np.array_equal(x, y) for x, y in zip(got, want))
    finally:
        CompactBuffer.block_segments = saved


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.data())
def test_plain_extents_equal_the_general_validation(n, data):
    """``extents``'s fast path (1-D int64 arrays of one length, every extent non-empty and in
    bounds) returns what the general path returns; anything else (zero, negative or
    out-of-bounds extents, other dtypes or shapes, lists) takes the general path, so the same
    extents are dropped and the same errors named."""
    import sim.bytes.compact as compact
    from sim.errors import InputError
    nb = 100
    val = st.sampled_from([-1, 0, 1, 5, 50, 99, 100, 101])
    arr = lambda: np.array(data.draw(st.lists(val, min_size=n, max_size=n)), data.draw(
        st.sampled_from([np.int64, np.int64, np.int64, np.int32])))
    lens, src, dst = arr(), arr(), arr()
    if data.draw(st.booleans()):
        lens = lens.tolist()
    pairs = (("src_offsets", src, nb), ("dst_offsets", dst, nb + 7), ("stream_offsets", src, compact._I64_MAX))

    def outcome(f):
        try:
            return [(a.dtype, a.tolist()) for a in f("copy_from", lens, *pairs)]
        except InputError as e:
            return str(e)
    want = outcome(compact.extents)
    saved = compact._plain_extents
    compact._plain_extents = lambda *a: None
    try:
        assert outcome(compact.extents) == want
    finally:
        compact._plain_extents = saved


def test_plain_extents_at_every_bound():
    """One extent at each edge of each pair's bound (ending at the buffer's end, one byte past
    it, starting at -1, of length 0 or -1) among good ones: the fast path's outcome is the
    general path's."""
    import sim.bytes.compact as compact
    from sim.errors import InputError

    def outcome(lens, src, dst):
        try:
            return [a.tolist() for a in compact.extents("copy_from", lens, ("src_offsets", src, 100),
                                                         ("dst_offsets", dst, 107))]
        except InputError as e:
            return str(e)
    cases = 0
    for edge in [(1, 99), (1, 100), (0, 100), (-1, 5), (5, 0), (5, -1), (99, 1), (100, 1), (0, 101)]:
        for which in ("src", "dst"):
            for at in (0, 2, 4):
                o, n = edge
                if which == "dst":
                    o += 7
                lens = np.array([3, 4, 5, 6, 7], np.int64)
                src = np.array([0, 10, 20, 30, 40], np.int64)
                dst = src + 1
                lens[at] = n
                (src if which == "src" else dst)[at] = o
                want = outcome(lens, src, dst)
                saved = compact._plain_extents
                compact._plain_extents = lambda *a: None
                try:
                    assert outcome(lens, src, dst) == want, (edge, which, at)
                finally:
                    compact._plain_extents = saved
                cases += 1
    assert cases == 54
