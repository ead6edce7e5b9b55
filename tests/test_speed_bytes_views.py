"""A read's views sliced together (issue 9's speed): ``CompactBuffer.slices`` and
``Memory.views`` give what slicing one range at a time gives (``slice`` / ``view``): the same
kind of buffer, the same runs, segments and bytes, and the same error for a bad range."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.bytes import CompactBuffer, Origin, OriginTable
from sim.bytes.compact import _SmallView
from sim.errors import InputError
from sim.memory import Memory
from sim.schedule import validate
from tests.strategies import base_buffers

UNIT = 16
ORIGINS = [Origin("kv", 0, -1, 0, UNIT), Origin("kv", 1, 3, 1, UNIT), Origin("idx", 2, 5, 2, UNIT)]


def _same(a: CompactBuffer, b: CompactBuffer) -> None:
    assert type(a) is type(b)
    assert a.nbytes == b.nbytes and a.table is b.table
    if isinstance(a, _SmallView):
        assert a.__dict__["_pending"] == b.__dict__["_pending"]
    assert a.small_runs() == b.small_runs()
    assert a.segment_count() == b.segment_count()
    assert [x.tolist() for x in a.segments()] == [x.tolist() for x in b.segments()]
    assert [x.tolist() for x in a._bs] == [x.tolist() for x in b._bs]
    assert a.provenance_digest() == b.provenance_digest()
    assert a.materialise().tobytes() == b.materialise().tobytes()


def _buffer(rng, size, blocks, n_fills):
    buf = CompactBuffer(size, OriginTable(), ORIGINS[0])
    if blocks:
        buf.block_segments = blocks
    for _ in range(n_fills):
        d = int(rng.integers(0, size - 1))
        n = int(rng.integers(1, min(size - d, 5 * UNIT) + 1))
        buf.fill(d, n, ORIGINS[int(rng.integers(0, 3))], int(rng.integers(0, 8)) * UNIT)
    return buf


@pytest.mark.parametrize("seed", range(25))
def test_slices_equal_one_slice_at_a_time(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.choice([64, 1024, 4096]))
    buf = _buffer(rng, size, int(rng.choice([0, 2, 5])), int(rng.integers(0, 80)))
    n = int(rng.integers(0, 30))
    offs = rng.integers(0, size, n)
    lens = np.minimum(rng.choice([1, 7, UNIT, 3 * UNIT, 40 * UNIT], n), size - offs)
    lens[rng.random(n) < 0.1] = 0                       # empty ranges: sliced one at a time too
    for o, ln in ((offs, lens), (offs.tolist(), lens.tolist())):
        want = [buf.slice(a, b) for a, b in zip(offs.tolist(), lens.tolist())]
        got = buf.slices(o, ln)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)


def test_a_bad_range_raises_what_slice_raises():
    buf = CompactBuffer(256, OriginTable(), ORIGINS[0])
    offs, lens = [0, 16, 32, 250, 64], [16, 16, 16, 16, 16]
    with pytest.raises(InputError) as want:
        [buf.slice(o, n) for o, n in zip(offs, lens)]
    with pytest.raises(InputError) as got:
        buf.slices(offs, lens)
    assert str(got.value) == str(want.value)
    with pytest.raises(InputError):
        buf.slices([0, 1], [1])


@settings(max_examples=20, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.integers(0, 15), st.integers(1, 4)), min_size=0, max_size=12),
       st.integers(0, 3))
def test_memory_views_equal_one_view_at_a_time(materialise, ranges, writes):
    bufs = validate({"kvrace_schedule": 2, "name": "views", "buffers": base_buffers(), "streams": ["s0"],
                     "events": [], "ops": []}).buffers
    mem = Memory(bufs, materialise=materialise)
    name = next(iter(bufs))
    spec = bufs[name]
    ub = spec.layout.unit_bytes
    units = spec.layout.units
    for w in range(writes):
        u = np.array([w % units, (3 * w + 1) % units], np.int64)
        offs = np.asarray(spec.layout.unit_offsets(0, u), np.int64)
        mem.write_units(name, 0, u, offs, np.full(2, ub), w, w + 1)
    offs = [min(a * 8, spec.nbytes - 1) for a, _ in ranges]
    lens = [min(n * 8, spec.nbytes - o) for (_, n), o in zip(ranges, offs)]
    want = [mem.view(name, o, n) for o, n in zip(offs, lens)]
    got = mem.views(name, np.array(offs, np.int64), np.array(lens, np.int64))
    assert [v.offset for v in got] == [v.offset for v in want]
    for a, b in zip(got, want):
        _same(a.compact, b.compact)
        assert (a.material is None) == (b.material is None)
        assert a.bytes().tobytes() == b.bytes().tobytes()
