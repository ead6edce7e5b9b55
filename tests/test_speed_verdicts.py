"""The online verdicts' read hook (``OnlineVerdicts.on_read``) and the fast paths of
the online verdicts, each checked against the path it replaces."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import Executor, run_static
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile, stream_static
from tests.strategies import rich_schedules, schedules

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(s, seed: int, hook=None):
    """run_schedule(s, keep="report"), with ``hook`` given to the verdicts before the run."""
    return stream_static(s, P, on_read=hook, seed=seed)


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14)), st.integers(0, 3))
def test_on_read_sees_every_entry_the_report_keeps_and_keeps_none(doc, seed):
    s = validate(doc)
    kept = analyse(_run(s, seed))
    seen = []
    run = _run(s, seed, lambda cap, views, entry: seen.append((cap, views, entry)))
    hooked = analyse(run)
    assert [e for _, _, e in seen] == kept["reads"]
    assert run.online.reads == [] and hooked["reads"] == [] and not run.online._expected
    for cap, views, entry in seen:
        assert cap.op_id == entry["op"] and len(views) == len(cap.views)
        assert [v.offset for v in views] == [v.offset for v in cap.views]
    # everything but the reads is the same report
    for key in ("schedule_digest", "latent_races", "latent_races_total", "intra_launch_races", "end_us"):
        assert hooked[key] == kept[key], key


def test_on_read_refuses_a_non_callable_and_can_be_unset():
    doc = {"kvrace_schedule": 2, "name": "one", "buffers": [
        {"name": "d", "location": "host", "kind": "kv",
         "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": 4, "unit_bytes": 64}}],
        "streams": [{"name": "s", "device": 0}], "events": [],
        "ops": [{"id": "r", "op": "read", "stream": "s", "buffer": "d", "layer": 0, "units": [1]}]}
    s = validate(doc)
    ex = Executor(s.buffers, s.streams, P, keep="report", hosts=s.hosts, static_ops=s.ops)
    with pytest.raises(InputError, match="callback"):
        ex.online.on_read(3)
    ex.online.on_read(print)
    ex.online.on_read(None)
    run = run_static(ex, s)
    assert [r["op"] for r in run.online.reads] == ["r"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 18), st.one_of(st.integers(1, 1 << 17), st.integers(1, 1 << 20)),
                          st.booleans()), max_size=40),
       st.lists(st.tuples(st.integers(0, 1 << 18), st.integers(1, 1 << 16)), min_size=1, max_size=3),
       st.booleans())
def test_live_buffer_overlapping_equals_a_scan_of_every_row(rows, query, prune):
    """The one-interval, one-bucket fast paths of _LiveBuffer.append/overlapping give the rows
    a scan of every live row gives, in row order (also after keep_after re-indexes)."""
    from sim.hb import _LiveBuffer, merge_intervals
    import numpy as np
    lb = _LiveBuffer()
    for k, (s0, n, w) in enumerate(rows):
        lb.append([s0], [s0 + n], k, 0, k + 1, w)
    if prune:
        lb.keep_after([len(rows) // 2])
    qs, qe = merge_intervals(np.array([a for a, _ in query]), np.array([a + n for a, n in query]))
    qs, qe = qs.tolist(), qe.tolist()
    want = [row for row in lb.rows if any(row[0] < e and row[1] > s for s, e in zip(qs, qe))]
    assert lb.overlapping(qs, qe) == want


def test_origin_table_key_is_origin_key():
    from sim.bytes.compact import OriginTable, origin_key
    from sim.bytes.pattern import Origin
    t = OriginTable()
    origins = [Origin("kv", 1, 2, 3, 64), Origin("kv", 1, 2, 4, 64), Origin("index_k", 0, -1, 1, 132)]
    ids = [t.intern(o) for o in origins]
    assert [t.key(i) for i in ids] == [origin_key(o) for o in origins] == [t.key(i) for i in ids]


@settings(max_examples=200, deadline=None)
@given(st.integers(-(1 << 62), 1 << 62), st.integers(-(1 << 20), 1 << 62), st.sampled_from(["int64", "int32"]))
def test_merge_of_one_extent_equals_the_general_path(start, length, dtype):
    """_merge's one-extent fast path gives the general path's (merge_intervals) intervals."""
    import numpy as np
    from sim.hb import _merge, merge_intervals
    if dtype == "int32":
        start, length = start % (1 << 30), length % (1 << 30)
    s, e = np.array([start], dtype), np.array([length], dtype)
    ws, we = merge_intervals(s.astype(np.int64), s.astype(np.int64) + e.astype(np.int64))
    gs, ge = _merge(s, e)
    assert gs.dtype == ge.dtype == np.int64
    assert gs.tolist() == ws.tolist() and ge.tolist() == we.tolist()


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 1e7, allow_nan=False), st.floats(0, 1e4, allow_nan=False), st.floats(0, 2e7, allow_nan=False))
def test_one_item_copy_started_equals_searchsorted(t0, start, t):
    """A read's count of a one-item copy's started items (``_Copy.one_start``) is what
    ``searchsorted(t0 + rel_start, t, "right")`` gives, also at the start instant itself."""
    import numpy as np
    from sim.executor import _Copy
    rel = np.array([start])
    cp = _Copy(None, None, rel, rel + 1.0, t0, np.array([0, 1]))
    for when in (t, t0 + start, float(t0 + rel[0])):
        assert int(cp.one_start <= when) == int(np.searchsorted(cp.t0 + cp.rel_start, when, side="right"))


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14)))
def test_online_clocks_equal_happens_before_clocks(doc):
    """OnlineClocks.add (one new array per stream op) gives every op HappensBefore's clock,
    component and position."""
    import numpy as np
    from sim.hb import HappensBefore, OnlineClocks
    s = validate(doc)
    hb = HappensBefore(s)
    oc = OnlineClocks(s.streams, s.hosts)
    for op in s.ops:
        k, n, c = oc.add(op)
        assert (k, n) == (int(hb.comp[op.index]), int(hb.pos[op.index]))
        assert np.array_equal(c, hb.clock[op.index])
