"""The race tracker's vectorised paths (issue 9's speed): a query that touches many buckets
(a batch's KV store, a forward's read of many pages) tests the live rows as numpy columns,
the clock and write tests first.  Each is compared with the Python paths it replaces: the
rows a scan of every live row gives, the ops that scan's rows race, and ``race_scan`` on
random schedules with the vectorised path forced on and off."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.hb import HappensBefore, _LiveBuffer, merge_intervals, race_scan
from sim.schedule import validate
from tests.helpers import track_races
from tests.strategies import rich_schedules, schedules

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
any_schedule = st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14))


def _intervals(rng, n, span, longest):
    s = rng.integers(0, span, n)
    return merge_intervals(s, s + rng.integers(1, longest, n))


def _scan(rows, s, e):
    return [row for row in rows if any(row[0] < b and row[1] > a for a, b in zip(s, e))]


@pytest.mark.parametrize("seed", range(6))
def test_racing_and_overlapping_equal_a_scan_of_every_row(seed, monkeypatch):
    """Random appends (one interval or many, reads and writes, several clock components),
    prunes and queries: ``overlapping`` gives the scan's rows in row order and ``racing``
    the ops of those rows that are unordered and write-conflicting, on every path."""
    rng = np.random.default_rng(seed)
    shift = int(rng.choice([4, 8, 16]))
    monkeypatch.setattr(_LiveBuffer, "BUCKET_SHIFT", shift)
    monkeypatch.setattr(_LiveBuffer, "NUMPY_ROWS", int(rng.choice([0, 8, 32])))
    span = 1 << (shift + 7)
    lb, rows = _LiveBuffer(), []
    n_comp = 3
    count = [0] * n_comp
    for op in range(120):
        comp = int(rng.integers(0, n_comp))
        count[comp] += 1
        n = int(rng.choice([1, 1, 2, 5, 40]))
        s, e = _intervals(rng, n, span, int(rng.choice([2, 1 << shift, 1 << (shift + 4)])))
        w = bool(rng.integers(0, 2))
        if rng.integers(0, 2):
            lb.append(s.tolist(), e.tolist(), op, comp, count[comp], w, s, e)
        else:
            lb.append(s.tolist(), e.tolist(), op, comp, count[comp], w)
        rows.extend((a, b, op, comp, count[comp], w) for a, b in zip(s.tolist(), e.tolist()))
        if op % 17 == 16:
            floor = [int(rng.integers(0, c + 1)) for c in count]
            lb.keep_after(floor)
            rows = [r for r in rows if floor[r[3]] < r[4]]
        assert lb.rows == rows
        cols = lb.columns()
        assert [tuple(x) for x in zip(*[c.tolist() for c in cols])] == rows
        qs, qe = _intervals(rng, int(rng.choice([1, 3, 30])), span,
                            int(rng.choice([2, 1 << shift, 1 << (shift + 3)])))
        want = _scan(rows, qs.tolist(), qe.tolist())
        assert lb.overlapping(qs.tolist(), qe.tolist()) == want
        assert lb.overlapping(qs.tolist(), qe.tolist(), qs, qe) == want
        clock = np.array([int(rng.integers(0, c + 2)) for c in count], np.int64)
        for write in (False, True):
            racing = [r[2] for r in want if clock[r[3]] < r[4] and (write or r[5])]
            got = lb.racing(qs.tolist(), qe.tolist(), qs, qe, write, clock, None)
            assert sorted(got) == sorted(racing)
            assert sorted(lb.racing(qs.tolist(), qe.tolist(), qs, qe, write, clock, clock.tolist())) \
                == sorted(racing)


@pytest.mark.parametrize("seed", range(8))
def test_index_many_equals_index_one_row_at_a_time(seed, monkeypatch):
    """The vectorised bucket index of a many-interval append: the same buckets (each in row
    order) and wide rows as ``_index`` row by row."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(_LiveBuffer, "BUCKET_SHIFT", int(rng.choice([3, 6, 10])))
    monkeypatch.setattr(_LiveBuffer, "MAX_BUCKETS", int(rng.choice([1, 2, 8])))
    vec, one = _LiveBuffer(), _LiveBuffer()
    monkeypatch.setattr(one, "INDEX_MANY", 1 << 30)
    monkeypatch.setattr(vec, "INDEX_MANY", 1)
    for op in range(30):
        s, e = _intervals(rng, int(rng.choice([1, 2, 20, 200])), 1 << 14, int(rng.choice([2, 64, 4096])))
        for lb in (vec, one):
            lb.append(s.tolist(), e.tolist(), op, 0, op + 1, bool(op % 3), s, e)
    assert vec.rows == one.rows
    assert vec.buckets == one.buckets and vec.wide == one.wide


@SETTINGS
@given(any_schedule, st.sampled_from([None, 0, 2]), st.integers(3, 12), st.sampled_from([0, 2, 1 << 20]))
def test_race_tracker_vectorised_equals_race_scan(doc, limit, shift, numpy_rows):
    """Tiny buckets, so that queries touch many buckets; the vectorised path from 0 or 2
    live rows, or never (1 << 20): the same races, counts and entries as ``race_scan``."""
    s = validate(doc)
    scan = race_scan(s, HappensBefore(s), limit)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(_LiveBuffer, "BUCKET_SHIFT", shift)
        mp.setattr(_LiveBuffer, "MAX_BUCKETS", 1)
        mp.setattr(_LiveBuffer, "NUMPY_ROWS", numpy_rows)
        tracker = track_races(s, limit)
    finally:
        mp.undo()
    assert tracker.total == scan.total
    got = [(e["buffer"], e["ops"], e["bytes"], e["n_ranges"], [int(x) for x in e["starts"]],
            [int(x) for x in e["ends"]]) for e in tracker.listed(limit)]
    want = [(r["buffer"], r["ops"], r["bytes"], r["n_ranges"], [int(x) for x in r["starts"]],
             [int(x) for x in r["ends"]]) for r in scan.races]
    assert got == want
