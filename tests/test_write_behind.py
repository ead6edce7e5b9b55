"""The compact model's write-behind (issue 9's speed): a buffer of several blocks queues its
writes and makes them together when its contents are next looked at, and a clone taken
between writes shares the queue up to that point.  Whatever is looked at, and whenever, the
contents equal those of the same writes made one at a time (``write_behind = False``): every
clone holds the contents of its moment, and queued writes are made in one window write."""
import numpy as np
import pytest

import sim.bytes.compact as compact
from sim.bytes import CompactBuffer, Origin, OriginTable
from tests.test_bytes_models import check_coalesced

UNIT = 16
ORIGINS = [Origin("kv", 0, -1, 0, UNIT), Origin("kv", 1, 3, 1, UNIT), Origin("idx", 2, 5, 2, UNIT),
           Origin("idx", 3, 7, 0, UNIT)]
SIZE = 512 * UNIT


def _extents(rng, k):
    d = rng.integers(0, 512, k) * UNIT
    n = np.minimum(rng.integers(1, 9, k) * UNIT, SIZE - d)
    s = rng.integers(0, 64, k) * UNIT
    return d.astype(np.int64), n.astype(np.int64), s.astype(np.int64)


def _look(rng, b):
    """Something that reads a buffer's contents (each makes the queued writes)."""
    what = int(rng.integers(0, 5))
    if what == 0:
        return [a.tolist() for a in b.segments()]
    if what == 1:
        o = int(rng.integers(0, SIZE - UNIT))
        p = b.pieces(o, int(rng.integers(1, SIZE - o)))
        return [p.start.tolist(), p.origin_id.tolist(), p.stream_offset.tolist()]
    if what == 2:
        return b.provenance_digest()
    if what == 3:
        return b.segment_count()
    o = int(rng.integers(0, SIZE - 64))
    return b.materialise(o, 64).tobytes()


def _run(seed, behind: bool):
    """A random mix of many-extent fills, multi-origin fills, copies (from another buffer and
    within one), clones and looks over three buffers; returns what was looked at, the clones
    (with the step each was taken at) and the buffers."""
    rng = np.random.default_rng(seed)
    mp = pytest.MonkeyPatch()
    mp.setattr(CompactBuffer, "block_segments", 8)
    mp.setattr(CompactBuffer, "write_behind", behind)
    looks, clones = [], []
    try:
        t = OriginTable()
        bufs = [CompactBuffer(SIZE, t, ORIGINS[i], i * UNIT) for i in range(3)]
        for i, b in enumerate(bufs):              # start with many segments (several blocks)
            d, n, s = _extents(rng, 60)
            b.fill(d, n, ORIGINS[(i + 1) % 4], s)
            b.segments()
        for step in range(int(rng.integers(5, 60))):
            r = rng.random()
            j = int(rng.integers(0, 3))
            b = bufs[j]
            if r < 0.3:
                d, n, s = _extents(rng, int(rng.integers(12, 40)))
                b.fill(d, n, ORIGINS[int(rng.integers(0, 4))], s)
            elif r < 0.4:
                d, n, s = _extents(rng, 2 * int(rng.integers(6, 20)))
                b.fill_groups(d, n, [ORIGINS[1], ORIGINS[3]], s)
            elif r < 0.65:
                src = bufs[(j + int(rng.integers(0, 3))) % 3]          # sometimes b itself
                d, n, _ = _extents(rng, int(rng.integers(12, 40)))
                so = rng.integers(0, 512, n.size).astype(np.int64) * UNIT
                b.copy_from(src, np.minimum(so, SIZE - n), d, n)
            elif r < 0.85:
                clones.append((step, j, b.clone()))
            else:
                looks.append((step, j, _look(rng, b)))
        out = [(step, j, c.segments()) for step, j, c in clones]
        for b in bufs:
            check_coalesced(b)
        return looks, out, [b.segments() for b in bufs]
    finally:
        mp.undo()


def _same(a, b):
    return [x.tolist() for x in a] == [x.tolist() for x in b]


@pytest.mark.parametrize("seed", range(80))
def test_write_behind_gives_the_contents_of_writes_made_one_at_a_time(seed):
    looks_on, clones_on, final_on = _run(seed, True)
    looks_off, clones_off, final_off = _run(seed, False)
    assert looks_on == looks_off
    assert len(clones_on) == len(clones_off)
    for (s1, j1, c1), (s2, j2, c2) in zip(clones_on, clones_off):
        assert (s1, j1) == (s2, j2) and _same(c1, c2), f"clone taken at step {s1} differs"
    for a, b in zip(final_on, final_off):
        assert _same(a, b)


def _layers(t, layers=43, pages=64, page=4 * UNIT):
    """A device pool of ``layers`` windows of ``pages`` pages, each page of its own origin
    (many segments, several blocks), and a host pool to load from."""
    size = layers * pages * page
    dev = CompactBuffer(size, t, ORIGINS[0])
    host = CompactBuffer(size, t, ORIGINS[1])
    starts = np.arange(0, size, page, dtype=np.int64)
    dev.fill(starts, np.full(starts.size, page, np.int64), ORIGINS[2], 3 * starts + UNIT)
    host.fill(starts, np.full(starts.size, page, np.int64), ORIGINS[3], 5 * starts)
    dev.segments(), host.segments()
    return dev, host, pages * page, page


def test_a_load_backs_per_layer_copies_are_made_in_one_window_write(monkeypatch):
    """43 per-layer copies of 5 pages each (a load-back), a clone after each (what the
    deferred run memory keeps): nothing is written until a look, then one window write
    makes all of them, and the clone of layer 10 still holds the contents after 11 copies."""
    calls = []
    real = CompactBuffer._write_now
    monkeypatch.setattr(CompactBuffer, "_write_now", lambda self, *a, **k: (calls.append(len(a[0])),
                                                                             real(self, *a, **k))[1])
    monkeypatch.setattr(CompactBuffer, "block_segments", 256)
    t = OriginTable()
    dev, host, window, page = _layers(t)
    eager, _, _, _ = _layers(t)
    calls.clear()
    pages = np.array([3, 9, 10, 40, 63], np.int64) * page
    clones, eager_clones = [], []
    for layer in range(43):
        at = layer * window + pages
        dev.copy_from(host, at, at, np.full(5, page, np.int64))
        clones.append(dev.clone())
    assert calls == []
    dev.segments()
    assert calls == [43 * 5]
    monkeypatch.setattr(CompactBuffer, "write_behind", False)
    for layer in range(43):
        at = layer * window + pages
        eager.copy_from(host, at, at, np.full(5, page, np.int64))
        eager_clones.append(eager.clone())
    assert _same(dev.segments(), eager.segments())
    assert _same(clones[10].segments(), eager_clones[10].segments())
    assert _same(clones[-1].segments(), eager.segments())


def test_a_buffer_makes_its_writes_once_the_queue_is_long(monkeypatch):
    """Past ``WRITE_BEHIND_PIECES`` queued pieces the writes are made without a look (the
    queue's memory stays bounded for a buffer that is written and never read)."""
    monkeypatch.setattr(CompactBuffer, "block_segments", 256)
    monkeypatch.setattr(compact, "WRITE_BEHIND_PIECES", 12)
    t = OriginTable()
    dev, host, window, page = _layers(t)
    at = np.array([1, 2, 5], np.int64) * page
    for layer in range(4):
        dev.copy_from(host, layer * window + at, layer * window + at, np.full(3, page, np.int64))
        assert ("_behind" in dev.__dict__) == (layer < 3), layer


@pytest.mark.parametrize("how", ["few", "many", "groups"])
def test_a_queued_write_does_not_see_the_callers_arrays_change(how, monkeypatch):
    """A fill's offset arrays are the caller's: written again after the call (a reused
    scratch array), the queued write still makes the extents it was given."""
    monkeypatch.setattr(CompactBuffer, "block_segments", 8)

    def contents(behind):
        monkeypatch.setattr(CompactBuffer, "write_behind", behind)
        b = CompactBuffer(SIZE, OriginTable(), ORIGINS[0])
        b.fill(np.arange(0, 480, 8, dtype=np.int64) * UNIT, np.full(60, UNIT, np.int64), ORIGINS[1],
               np.arange(60, dtype=np.int64) * UNIT)
        b.segments()
        k = 3 if how == "few" else 20
        offs = (np.arange(k, dtype=np.int64) * 4 + 1) * UNIT
        lens, so = np.full(k, UNIT, np.int64), np.zeros(k, np.int64)
        if how == "groups":
            b.fill_groups(offs, lens, [ORIGINS[2], ORIGINS[3]], so)
        else:
            b.fill(offs, lens, ORIGINS[2], so)
        queued = "_behind" in b.__dict__
        offs += 2 * UNIT
        so += 7
        lens[:] = 2 * UNIT
        return queued, [x.tolist() for x in b.segments()]

    queued, got = contents(True)
    assert queued
    assert got == contents(False)[1]


def test_small_buffers_write_at_once():
    t = OriginTable()
    b = CompactBuffer(SIZE, t, ORIGINS[0])
    b.fill(np.array([0, 64], np.int64), np.array([16, 16], np.int64), ORIGINS[1], np.array([0, 16], np.int64))
    assert "_behind" not in b.__dict__ and b.segment_count() == 4


@pytest.mark.parametrize("seed", range(40))
def test_pieces_far_apart_are_written_run_by_run_with_the_same_segments(seed, monkeypatch):
    """A write whose pieces leave blocks untouched between them is made as one window per
    run of touched blocks: the segments (and the joints between runs, coalesced) are those of
    one window over the whole span."""
    monkeypatch.setattr(CompactBuffer, "block_segments", 4)
    got, runs = {}, []
    real = CompactBuffer._write_run
    monkeypatch.setattr(CompactBuffer, "_write_run", lambda self, *a: (runs.append(len(a[0])), real(self, *a))[1])
    for gap in (1, 1 << 30):
        monkeypatch.setattr(compact, "WRITE_GAP_BLOCKS", gap)
        rng = np.random.default_rng(seed + 1000)
        t = OriginTable()
        b = CompactBuffer(SIZE, t, ORIGINS[0])
        d, n, s = _extents(np.random.default_rng(seed), 120)
        b.fill(d, n, ORIGINS[1], s)
        b.segments()
        runs.clear()
        for _ in range(6):
            d, n, s = _extents(rng, int(rng.integers(2, 12)))
            o = ORIGINS[int(rng.integers(0, 4))]
            if rng.random() < 0.3:                      # a write that continues what is there
                s = d + n - n
                o = ORIGINS[1]
            b.fill(d, n, o, s)
            check_coalesced(b)
        got[gap] = (b.segments(), len(runs))
    (split, n_split), (whole, n_whole) = got[1], got[1 << 30]
    assert _same(split, whole)
    assert n_whole == 6 and n_split >= 6
    if seed == 0:
        assert n_split > 6                              # the case is exercised


@pytest.mark.parametrize("seed", range(30))
def test_locate_names_the_segment_of_each_offset_as_pieces_does(seed, monkeypatch):
    """``locate``: for each offset, the origin id and delta of the piece holding it in
    ``pieces()`` of the whole buffer, and rows equal exactly when pieces are; with queued
    writes, one block and many."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(CompactBuffer, "block_segments", int(rng.choice([4, 1 << 12])))
    t = OriginTable()
    b = CompactBuffer(SIZE, t, ORIGINS[0])
    for _ in range(3):
        d, n, s = _extents(rng, 40)
        b.fill(d, n, ORIGINS[int(rng.integers(1, 4))], s)
    x = rng.integers(0, SIZE, 200).astype(np.int64)
    row, oid, delta = b.locate(x)
    p = b.pieces(0, SIZE)
    k = np.searchsorted(p.start, x, side="right") - 1
    assert oid.tolist() == p.origin_id[k].tolist()
    assert delta.tolist() == (p.stream_offset[k] - p.start[k]).tolist()
    assert ((row[:, None] == row[None, :]) == (k[:, None] == k[None, :])).all()
    assert row.max() < b.segment_count()
    with pytest.raises(compact.InputError, match="offsets"):
        b.locate(np.array([SIZE], np.int64))
