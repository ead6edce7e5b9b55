"""The executor's scale fast paths (issue 7, item 5) give what their slow paths give:
cached copy plans, per-plan memos of clipping, item times and accesses, the race
tracker's bucket index of live accesses, byte digests shared by equal provenance,
and the runs a read's view remembers.  Each is compared with the path it replaces on
random schedules (``tests/strategies.py``)."""
import hashlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.memory as memory
import sim.transfers.routines as routines
from sim.bytes.compact import CompactBuffer, OriginTable
from sim.bytes.pattern import Origin
from sim.executor import Executor, run_schedule
from sim.hb import HappensBefore, _LiveBuffer, race_scan
from sim.memory import Memory
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile, track_races
from tests.strategies import rich_schedules, schedules

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
any_schedule = st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14))


def _same_plan(a, b) -> None:
    ea, eb = a.extents, b.extents
    for x, y in ((ea.src, eb.src), (ea.dst, eb.dst), (ea.length, eb.length), (ea.item, eb.item)):
        assert np.array_equal(x, y)
    assert ea.n_items == eb.n_items and a.launch == b.launch and a.routine == b.routine


@SETTINGS
@given(any_schedule)
def test_cached_plans_equal_fresh_plans(doc):
    # NOTE: the caches are cleared when full; a clear between validate and plan (after earlier
    # tests filled them) would make ``again`` a fresh plan: the layer-shifted plans' families
    # too (kernel_per_layer), whose fill depends on which tests ran before
    routines._plan_cache.clear()
    routines._layer_families.clear()
    s = validate(doc)
    for op in s.ops:
        if op.op != "copy":
            continue
        src, dst = s.buffers[op.src].layout, s.buffers[op.dst].layout
        fresh = routines._plan(op.routine, src, dst, op.args, op.id)
        _same_plan(fresh, op.plan)
        again = routines.plan(op.routine, src, dst, dict(op.args), op.id)
        _same_plan(fresh, again)
        if routines._plan_key(op.routine, src, dst, op.args) is not None:
            assert again is op.plan and not again.extents.src.flags.writeable


def test_plan_key_tells_apart_what_the_routines_treat_differently():
    lay = validate(_doc_with_copy())
    src, dst = lay.buffers["H"].layout, lay.buffers["D"].layout
    key = lambda args: routines._plan_key("kernel_per_layer", src, dst, args)   # noqa: E731
    base = {"layer": 0, "src_indices": [1, 2], "dst_indices": [3, 4]}
    assert key(base) == key(dict(reversed(list(base.items()))))
    assert key(base) != key({**base, "layer": False})             # a bool is refused as a layer
    assert key(base) != key({**base, "src_indices": (1, 2)})
    assert key(base) != key({**base, "layer": 1})
    assert key({**base, "src_indices": np.array([1, 2])}) is None   # arrays are planned afresh
    assert key({**base, "src_indices": list(range(routines.PLAN_CACHE_MAX_INDICES + 1))}) is None


def _doc_with_copy() -> dict:
    from tests.strategies import base_buffers
    return {"kvrace_schedule": 2, "name": "one_copy", "buffers": base_buffers(), "streams": ["s0"],
            "events": [], "ops": []}


@SETTINGS
@given(any_schedule, st.integers(0, 3), st.sampled_from(["all", "report"]))
def test_memoised_runs_equal_unmemoised_runs(doc, seed, keep):
    """Clipping, item times and accesses memoised per plan (or derived from a layer-shifted
    plan's base), and plans cached or layer-shifted: the same report as every one of them
    computed afresh for every copy."""
    fast = analyse(run_schedule(validate(doc), P, seed=seed, keep=keep))
    mp = __import__("pytest").MonkeyPatch()
    try:
        mp.setattr(Executor, "_memo", lambda self, plan, what, make: make())
        mp.setattr(routines, "_plan_key", lambda *a, **k: None)          # no plan cache, no layer families
        slow = analyse(run_schedule(validate(doc), P, seed=seed, keep=keep))
    finally:
        mp.undo()
    assert fast == slow


@SETTINGS
@given(any_schedule, st.sampled_from([None, 0, 2]), st.integers(3, 12), st.integers(0, 3))
def test_race_tracker_bucket_index_equals_race_scan(doc, limit, shift, max_buckets):
    """Tiny buckets, so that intervals span several buckets, the wide list and the
    full scan of a long query are all exercised; pruning as early as allowed."""
    s = validate(doc)
    scan = race_scan(s, HappensBefore(s), limit)
    mp = __import__("pytest").MonkeyPatch()
    try:
        mp.setattr(_LiveBuffer, "BUCKET_SHIFT", shift)
        mp.setattr(_LiveBuffer, "MAX_BUCKETS", max_buckets)
        tracker = track_races(s, limit)
    finally:
        mp.undo()
    assert tracker.total == scan.total
    got = [(e["buffer"], e["ops"], e["bytes"], e["n_ranges"], [int(x) for x in e["starts"]],
            [int(x) for x in e["ends"]], e["writes"]) for e in tracker.listed(limit)]
    want = [(r["buffer"], r["ops"], r["bytes"], r["n_ranges"], [int(x) for x in r["starts"]],
             [int(x) for x in r["ends"]]) for r in scan.races]
    assert [g[:6] for g in got] == want


def test_live_buffer_overlapping_equals_a_scan():
    rng = np.random.default_rng(7)
    lb = _LiveBuffer()
    rows = []
    for k in range(300):
        s0 = int(rng.integers(0, 1 << 20))
        e0 = s0 + int(rng.choice([1, 100, 1 << 14, 1 << 19]))
        lb.append([s0], [e0], k, 0, k + 1, bool(k % 2))
        rows.append((s0, e0, k, 0, k + 1, bool(k % 2)))
    for _ in range(200):
        n = int(rng.integers(1, 4))
        cuts = np.sort(rng.choice(1 << 21, 2 * n, replace=False))
        s, e = cuts[0::2].tolist(), cuts[1::2].tolist()
        want = [r for r in rows if any(r[0] < b and r[1] > a for a, b in zip(s, e))]
        assert lb.overlapping(s, e) == want
    lb.keep_after([150])
    assert lb.rows == [r for r in rows if r[4] > 150]
    assert lb.overlapping([0], [1 << 21]) == lb.rows


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31), st.lists(st.sampled_from(["narrow", "wide", "query", "racing", "prune", "rows",
                                                          "rows_at"]), min_size=1, max_size=40))
def test_live_buffer_rows_made_on_demand_equal_the_rows_appended(seed, steps):
    """Rows appended as intervals (one, or hundreds as arrays), their tuples made only when a
    Python query needs them (only for the rows it looks at: ``_rows_at``), pruned by random
    floors: ``rows``, ``n``, ``writes``, ``ops()``, ``_rows_at`` and every query equal a plain
    list of every row appended, filtered by the same floors."""
    rng = np.random.default_rng(seed)
    lb, ref, k = _LiveBuffer(), [], 0
    for step in steps:
        if step in ("narrow", "wide"):
            n = 1 if step == "narrow" else int(rng.integers(16, 300))
            s = np.sort(rng.choice(1 << 22, n, replace=False)).astype(np.int64) * 4
            e = s + rng.integers(1, 4, n)
            comp, w = int(rng.integers(0, 3)), bool(rng.integers(0, 2))
            lb.append(s.tolist(), e.tolist(), k, comp, k + 1, w, s, e)
            ref += [(a, b, k, comp, k + 1, w) for a, b in zip(s.tolist(), e.tolist())]
            k += 1
        elif step in ("query", "racing"):
            lo = int(rng.integers(0, 1 << 24))
            s, e = [lo], [lo + int(rng.choice([3, 1 << 10, 1 << 24]))]
            want = [r for r in ref if r[0] < e[0] and r[1] > s[0]]
            if step == "query":
                assert lb.overlapping(s, e) == want
            else:
                clock = rng.integers(0, k + 2, 3)
                write = bool(rng.integers(0, 2))
                got = sorted(lb.racing(s, e, np.array(s), np.array(e), write, clock, None))
                assert got == sorted(r[2] for r in want if clock[r[3]] < r[4] and (write or r[5]))
        elif step == "prune":
            floor = rng.integers(0, k + 2, 3).tolist()
            lb.keep_after(floor)
            ref = [r for r in ref if floor[r[3]] < r[4]]
        elif step == "rows_at":
            made = len(lb._rows)
            idx = sorted(set(rng.integers(0, max(len(ref), 1), int(rng.integers(0, 20))).tolist()) & set(range(len(ref))))
            assert lb._rows_at(idx) == [ref[i] for i in idx]
            assert len(lb._rows) == made                # no tuple made for the prefix
        else:
            assert lb.rows == ref
        assert lb.n == len(ref) and lb.writes == sum(r[5] for r in ref) and sorted(lb.ops()) == sorted(
            r[2] for r in ref)
        assert lb._rows == ref[:len(lb._rows)]          # the tuples made: a prefix of the rows
    assert lb.rows == ref


def test_a_prune_keeps_the_tuples_made_of_the_rows_it_keeps():
    lb = _LiveBuffer()
    for k in range(40):
        lb.append([10 * k], [10 * k + 5], k, k % 2, k + 1, k % 3 == 0)
    assert len(lb.rows) == 40
    lb.keep_after([10, 3])                  # drops ops 0, 2, 4, 6, 8 (comp 0) and op 1 (comp 1)
    want = [(10 * k, 10 * k + 5, k, k % 2, k + 1, k % 3 == 0) for k in range(40) if k > (9 if k % 2 == 0 else 2)]
    assert lb._rows == want and lb.rows == want and lb.n == 34


@SETTINGS
@given(any_schedule, st.integers(0, 3))
def test_shared_byte_digests_equal_hashed_bytes(doc, seed):
    run = run_schedule(validate(doc), P, seed=seed, materialise=False)
    memory._BYTE_DIGESTS.clear()
    first = {name: run.memory.digest(name) for name in run.memory.specs}
    again = {name: run.memory.digest(name) for name in run.memory.specs}     # from the cache
    assert first == again
    for name, spec in run.memory.specs.items():
        if spec.nbytes <= memory.BYTE_DIGEST_LIMIT:
            assert first[name] == hashlib.sha256(run.memory.final_bytes(name).tobytes()).hexdigest()


def test_equal_provenance_shares_one_digest_and_different_does_not():
    doc = _doc_with_copy()
    s = validate(doc)
    a, b = Memory(s.buffers, materialise=False), Memory(s.buffers, materialise=False)
    memory._BYTE_DIGESTS.clear()
    assert a.digest("D") == b.digest("D") and len(memory._BYTE_DIGESTS) == 1
    b.write_units("D", 0, np.array([1]), *_unit_extent(s, "D", 1), owner=3, version=1)
    assert b.digest("D") != a.digest("D")
    assert b.digest("D") == hashlib.sha256(b.final_bytes("D").tobytes()).hexdigest()


def _unit_extent(s, name, unit):
    lay = s.buffers[name].layout
    off = np.asarray(lay.unit_offsets(0, np.array([unit])), np.int64)
    return off, np.full(off.size, lay.unit_bytes, np.int64)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 255), st.integers(1, 64), st.integers(0, 3), st.integers(0, 500)),
                max_size=30),
       st.integers(0, 255), st.integers(1, 64))
def test_runs_a_view_remembers_equal_its_computed_runs(writes, off, n):
    t = OriginTable()
    buf = CompactBuffer(320, t, Origin("kv", 0, -1, 0, 16))
    for d, ln, owner, so in writes:
        ln = min(ln, 320 - d)
        buf.fill(d, ln, Origin("kv", 0, owner, 1, 16), so)
    n = min(n, 320 - off)
    view = buf.slice(off, n)
    remembered = view.small_runs()
    view._runs = None
    assert remembered == view.small_runs()
    view._runs = remembered
    view.fill(0, 1, Origin("kv", 1, 9, 1, 16), 5)            # a write forgets them
    assert view._runs is None
