"""Pattern bytes of whole units (``compact._pattern_units``, what ``materialise`` and the
report's buffer digests meet) equal the word-by-word path and ``pattern_bytes`` of each run."""
import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.bytes.compact as compact
from sim.arrays import plain_ints, unique_sorted
from sim.bytes.compact import CompactBuffer, OriginTable, pattern_runs, pattern_runs_of
from sim.bytes.pattern import Origin, pattern_bytes


unit_sizes = st.sampled_from([8, 16, 132, 256, 1168, 8448, 16384, 37440, 1 << 19])


@settings(max_examples=60, deadline=None)
@given(unit_sizes, st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=6),
       st.lists(st.integers(0, 1 << 31), min_size=6, max_size=6), st.booleans())
def test_whole_units_equal_pattern_bytes(ub, runs, seeds, many):
    origins = [Origin("k", int(s) % 7, int(s) % 5 - 1, 0, ub) for s in seeds[:len(runs)]]
    soff = np.array([u * ub for u, _ in runs], np.int64)
    lens = np.array([n * ub for _, n in runs], np.int64)
    want = np.concatenate([pattern_bytes(o if many else origins[0], int(a), int(n))
                           for o, a, n in zip(origins, soff, lens)])
    if many:
        got = pattern_runs_of(origins, ub, soff, lens)
        h = np.array([o.hash32 for o in origins], np.uint32)
    else:
        got = pattern_runs(origins[0], soff, lens)
        h = origins[0].hash32
    assert np.array_equal(got, want)
    assert np.array_equal(compact._pattern_units(ub, h, soff, lens), compact._general_batch(ub, h, soff, lens))


def test_materialise_of_a_pool_and_its_digest():
    t = OriginTable()
    ub = 37440
    b = CompactBuffer(300 * ub, t, Origin("c4", 0, -1, 0, ub))
    b.fill(np.array([5 * ub, 40 * ub]), np.array([3 * ub, ub]), Origin("c4", 0, 7, 1, ub), np.array([0, 9 * ub]))
    b.fill(np.array([100 * ub + 17]), np.array([1000]), Origin("c4", 2, 3, 0, ub), np.array([33]))
    got = b.materialise()
    want = np.empty(b.nbytes, np.uint8)
    p = b.pieces(0, b.nbytes)
    for st_, oid, so, n in zip(p.start.tolist(), p.origin_id.tolist(), p.stream_offset.tolist(), p.length.tolist()):
        want[st_:st_ + n] = pattern_bytes(t[oid], so, n)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(want).hexdigest()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-5, 5), max_size=30))
def test_unique_sorted_equals_np_unique(xs):
    a = np.array(xs, dtype=np.int64)
    got, want = unique_sorted(a), np.unique(a)
    assert got.dtype == want.dtype and np.array_equal(got, want)


class _Int(int):
    pass


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(-(1 << 70), 1 << 70), st.booleans(), st.floats(allow_nan=False),
                          st.integers(0, 9).map(_Int), st.just(None)), max_size=12))
def test_plain_ints_equals_the_generator_it_replaced(xs):
    assert plain_ints(xs) == all(type(x) is int for x in xs)
    assert plain_ints(iter(xs)) == all(type(x) is int for x in xs)
