"""The online executor at scale (issue 7, item 5): a keep="report" run computes the
verdicts while it runs and keeps only live state, and its report equals the one the
whole-run analysis gives; the small-operation fast paths of the compact model equal
its general path."""
import hashlib
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.bytes.compact import CompactBuffer, OriginTable, _coalesce_mask
from sim.bytes.pattern import Origin
from sim.errors import InputError
from sim.executor import run_programs, run_schedule
from sim.hb import HappensBefore, OnlineClocks, RaceTracker, race_scan
from sim.schedule import ScheduleBuilder, validate
from sim.verdicts import analyse
from sim.window import cut_window
from tests.helpers import profile, track_races
from tests.strategies import EVENTS, STREAMS, base_buffers, rich_schedules, schedules
from tests.test_host_programs_property import HOSTS, program, step

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEEP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: the report keys both kinds of run fill the same way (keep="report" leaves out
#: timings_us and accesses, and an ok read's explanation)
SAME_KEYS = ("schedule_digest", "latent_races", "latent_races_total", "intra_launch_races", "unbound_waits",
             "oob_writes", "oob_reads", "placement", "buffers", "end_us", "reads_total", "stale_reads",
             "torn_reads", "corrupt_reads", "indeterminate_reads", "reads_with_indeterminate_bytes")


def _same_reports(full: dict, kept: dict) -> None:
    for key in SAME_KEYS:
        assert full[key] == kept[key], key
    assert len(full["reads"]) == len(kept["reads"])
    for a, b in zip(full["reads"], kept["reads"]):
        want = a if a["status"] != "ok" else {k: a[k] for k in b}
        assert want == b
    assert kept["timings_us"] == {} and kept["accesses"] == [] and kept["kept"] == "report"


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14)), st.integers(0, 3))
def test_report_run_equals_whole_run_analysis_on_static_schedules(doc, seed):
    _static_case(doc, seed)


@pytest.mark.slow
@DEEP
@given(st.one_of(rich_schedules(max_ops=24), schedules(max_ops=24)), st.integers(0, 3))
def test_report_run_equals_whole_run_analysis_deep(doc, seed):
    _static_case(doc, seed)


def _static_case(doc, seed):
    s = validate(doc)
    full = analyse(run_schedule(s, P, seed=seed))
    kept = analyse(run_schedule(s, P, seed=seed, keep="report"))
    _same_reports(full, kept)


@SETTINGS
@given(st.lists(step, max_size=10), st.lists(step, max_size=10), st.integers(0, 2), st.integers(0, 3))
def test_report_run_equals_whole_run_analysis_on_host_programs(a, b, n_barriers, seed):
    header = {"kvrace_schedule": 2, "name": "programs", "hosts": HOSTS, "buffers": base_buffers(),
              "streams": STREAMS, "events": EVENTS}
    progs = lambda: {"h0": program(a, n_barriers), "h1": program(b, n_barriers)}   # noqa: E731
    full_run = run_programs(header, progs(), P, seed=seed)
    kept_run = run_programs(header, progs(), P, seed=seed, keep="report")
    _same_reports(analyse(full_run), analyse(kept_run))
    assert kept_run.digest == full_run.schedule.digest()
    assert kept_run.n_ops == len(full_run.schedule.ops)
    with pytest.raises(InputError, match="keep='report'"):
        kept_run.recorded
    with pytest.raises(InputError, match="keep='all'"):
        cut_window(kept_run, t0=0.0, t1=1.0)


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16)), st.sampled_from([0, 1, 2, 5, None]))
def test_race_tracker_equals_race_scan(doc, limit):
    """Races found online (accesses dropped once ordered before every later op) are
    race_scan's: the same total and the same listed pairs, in the same order."""
    s = validate(doc)
    scan = race_scan(s, HappensBefore(s), limit)
    tracker = track_races(s, limit)
    assert tracker.total == scan.total
    got = [(e["buffer"], e["ops"], e["bytes"], e["n_ranges"]) for e in tracker.listed(limit)]
    want = [(r["buffer"], r["ops"], r["bytes"], r["n_ranges"]) for r in scan.races]
    assert got == want


def test_race_tracker_drops_accesses_ordered_before_every_later_op():
    """Two streams that alternate through events: every access is soon ordered before
    all later ops, so the live set stays small however long the run."""
    ops = []
    for r in range(400):
        ops += [{"op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [r % 4], "owner": r},
                {"op": "record", "stream": "s0", "event": "e0"},
                {"op": "wait", "stream": "s1", "event": "e0"},
                {"op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [r % 4]},
                {"op": "record", "stream": "s1", "event": "e1"},
                {"op": "wait", "stream": "s0", "event": "e1"}]
    doc = {"kvrace_schedule": 2, "name": "alternating", "buffers": base_buffers(), "streams": ["s0", "s1"],
           "events": ["e0", "e1"], "ops": ops}
    s = validate(doc)
    clocks = OnlineClocks(s.streams, s.hosts)
    tracker = RaceTracker(clocks, 10)
    most = 0
    for op in s.ops:
        comp, pos, clock = clocks.add(op)
        if op.op in ("read", "write"):
            tracker.add(op.index, comp, pos, clock, [(op.buffer, op.op == "write", op.extents[0],
                                                      op.extents[0] + op.extents[1])])
            most = max(most, tracker.live_accesses())
    assert tracker.total == 0
    assert most <= 2 * tracker.PRUNE_EVERY + 2
    assert len(clocks._by_index) <= len(s.streams) + len(s.events)


def test_race_tracker_prunes_wide_accesses_by_their_intervals():
    """Ops of many intervals each (a batch's KV store: one write over scattered pages).
    While a second stream lags, every write stays live (it may race that stream's next op);
    once the lagging stream waits, they are ordered before every later op and must go
    within a prune period counted in intervals: counted in ops, the period after a large
    live set was as many ops as it had intervals, and every write in it was checked
    against all of them."""
    clocks = OnlineClocks(["s0", "s1"], ["host"])
    tracker = RaceTracker(clocks, 10)
    starts = np.arange(0, 8 * 4096, 4096, dtype=np.int64)        # 8 intervals an op

    class Op:
        host, sync_targets, bound_record = "host", (), None

        def __init__(self, index, stream, op, event=None):
            self.index, self.stream, self.op, self.event = index, stream, op, event

    ops = [Op(0, "s1", "compute")]
    ops += [Op(len(ops) + k, "s0", "write") for k in range(600)]          # s1 lags: all live
    ops += [Op(len(ops), "s0", "record", "e0")]
    ops += [Op(len(ops), "s1", "wait", "e0")]
    for _ in range(300):                                                   # s1 follows s0
        ops += [Op(len(ops) + k, "s0", "write") for k in range(8)]
        ops += [Op(len(ops), "s0", "record", "e0")]
        ops += [Op(len(ops), "s1", "wait", "e0")]
    most = 0
    for op in ops:
        if op.op == "wait":
            op.bound_record = op.index - 1
        comp, pos, clock = clocks.add(op)
        if op.op == "write":
            tracker.add(op.index, comp, pos, clock, [("D", True, starts, starts + 256)])
            most = max(most, tracker.live_accesses())
    assert tracker.total == 0
    assert most <= 8 * 600 * 2, most


def test_race_tracker_prunes_after_many_intervals_in_few_ops(monkeypatch):
    """Few ops of thousands of intervals each (a batch's multi-layer KV stores, a one-step
    forward's reads): a prune is due once PRUNE_ROWS intervals were added, not only after
    PRUNE_EVERY ops, so the live set stays within a few periods of intervals."""
    monkeypatch.setattr(RaceTracker, "PRUNE_EVERY", 10 ** 9)       # the op count never triggers
    monkeypatch.setattr(RaceTracker, "PRUNE_ROWS", 64)
    clocks = OnlineClocks(["s0"], ["host"])
    tracker = RaceTracker(clocks, 10)
    starts = np.arange(0, 16 * 4096, 4096, dtype=np.int64)       # 16 intervals an op

    class Op:
        host, sync_targets, bound_record, stream, op = "host", (), None, "s0", "write"

        def __init__(self, index):
            self.index = index

    most = 0
    for k in range(400):                                          # one stream: each write is before the next
        comp, pos, clock = clocks.add(Op(k))
        tracker.add(k, comp, pos, clock, [("D", True, starts, starts + 256)])
        most = max(most, tracker.live_accesses())
    assert tracker.total == 0
    assert most <= 2 * 64 + 2 * 16, most


def test_report_run_holds_live_state_only(monkeypatch):
    """A host program of many rounds: what a keep="report" run holds per op does not
    grow with the number of rounds (a round reuses its slot after a positive query)."""
    header = {"kvrace_schedule": 2, "name": "rounds", "buffers": base_buffers(), "streams": ["s0", "s1"],
              "events": ["e0", "e1"]}
    held = {}

    def prog(rounds):
        def p(h):
            for r in range(rounds):
                h.issue({"op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [r % 4],
                         "owner": r})
                h.issue({"op": "record", "stream": "s0", "event": "e0"})
                h.issue({"op": "wait", "stream": "s1", "event": "e0"})
                h.issue({"op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [r % 4]})
                h.issue({"op": "record", "stream": "s1", "event": "e1"})
                while not h.query("e1"):
                    yield h.delay(1.0)
            ex = h._ex
            held[rounds] = (len(ex._where), len(ex.pending), len(ex.timings), len(ex.reads),
                            len(ex.online._expected), ex.online.races.live_accesses(),
                            len(ex.online.races._accs), len(ex.online.clocks._by_index), len(ex.clipped))
        return p

    monkeypatch.setattr("sim.executor.WHERE_PRUNE", 32)
    for rounds in (30, 200):
        run = run_programs(header, {"host": prog(rounds)}, P, keep="report")
        rep = analyse(run)
        assert rep["reads_total"] == rounds and rep["corrupt_reads"] == 0
        assert run.n_ops > 6 * rounds
    assert held[30][2:4] == held[200][2:4] == (0, 0)      # no timings, no read captures
    assert held[200][0] <= 32 + 4                        # stream ops a later op may still name
    bound = 2 * RaceTracker.PRUNE_EVERY + 8
    assert all(x <= bound for x in held[30] + held[200]), held


def test_streamed_digest_and_id_set_match_a_kept_schedule():
    doc = {"kvrace_schedule": 2, "name": "d\u00e9mo", "description": "ops \"ops\":[]",
           "buffers": base_buffers(), "streams": STREAMS, "events": EVENTS, "ops": []}
    ops = [{"op": "compute", "stream": STREAMS[k % 3], "duration_us": 1.0, "note": "\u2713"} for k in range(700)]
    kept = ScheduleBuilder(dict(doc), max_ops=None)
    streamed = ScheduleBuilder(dict(doc), max_ops=None, keep_ops=False)
    streamed._ids.RECENT = 64                       # exercise the hashed part of the id set
    for d in ops:
        kept.add(dict(d))
        streamed.add(dict(d))
    assert streamed.digest() == kept.digest() == kept.schedule().digest()
    assert streamed.count == 700 and streamed.ops == []
    unhashed = ScheduleBuilder(dict(doc), max_ops=None, keep_ops=False, digest=False)
    for d in ops:
        unhashed.add(dict(d))
    assert unhashed.digest() is None and unhashed.count == 700
    # a kept schedule's digest is always computed from its ops
    assert ScheduleBuilder(dict(doc), max_ops=None, digest=False).digest() == ScheduleBuilder(dict(doc)).digest()
    with pytest.raises(InputError, match="duplicate op id"):
        streamed.add({"op": "compute", "stream": STREAMS[0], "duration_us": 1.0, "id": "op3"})
    with pytest.raises(InputError, match="duplicate op id"):
        streamed.add({"op": "compute", "stream": STREAMS[0], "duration_us": 1.0, "id": "op699"})
    streamed.add({"op": "compute", "stream": STREAMS[0], "duration_us": 1.0, "id": "fresh"})


def test_report_run_refuses_more_races_than_it_kept():
    s = validate(json.loads(open("examples/index_k_ungated_race.json").read()))
    run = run_schedule(s, P, keep="report", race_limit=1)
    assert len(analyse(run, race_limit=1)["latent_races"]) <= 1
    with pytest.raises(InputError, match="race_limit"):
        analyse(run)
    with pytest.raises(InputError, match="keep"):
        run_schedule(s, P, keep="everything")


# ---------------------------------------------------------------- compact model fast paths

def _segments(buf):
    st, oid, so = buf.segments()
    return st.tolist(), [buf.table[i] for i in oid.tolist()], so.tolist()


@pytest.mark.parametrize("block", [2, 3, 1 << 14])
@pytest.mark.parametrize("seed", range(2))
def test_small_writes_equal_the_general_path(block, seed, monkeypatch):
    """One-extent fills and copies (the plain-Python path) leave the same segments as
    the vectorised path, and keep the segments coalesced across block boundaries."""
    rng = random.Random(seed)
    monkeypatch.setattr(CompactBuffer, "block_segments", block)
    origins = [Origin("k", layer, -1, 0, 64) for layer in range(3)]
    table = OriginTable()
    fast = [CompactBuffer(4096, table, origins[0]) for _ in range(2)]
    table2 = OriginTable()
    slow = [CompactBuffer(4096, table2, origins[0]) for _ in range(2)]
    for _ in range(120):
        n = rng.choice([1, 7, 64, 100, 640])
        d = rng.randrange(0, 4096 - n + 1)
        if rng.random() < 0.5:
            o, so = rng.choice(origins), rng.choice([0, 64, d, 128 + d])
            k = rng.randrange(2)
            fast[k].fill(np.array([d]), np.array([n]), o, np.array([so]))
            slow[k].fill(np.array([d, 0]), np.array([n, 0]), o, np.array([so, 0]))   # two extents: general
        else:
            a, b = rng.randrange(2), rng.randrange(2)
            s = rng.randrange(0, 4096 - n + 1)
            fast[b].copy_from(fast[a], np.array([s]), np.array([d]), np.array([n]))
            slow[b].copy_from(slow[a], np.array([s, 0]), np.array([d, 0]), np.array([n, 0]))
        for f, g in zip(fast, slow):
            assert _segments(f) == _segments(g)
            st, oid, so = f.segments()
            assert _coalesce_mask(st, oid, so).all()
            assert f.segment_count() == len(st)
    for f, g in zip(fast, slow):
        assert np.array_equal(f.slice(100, 900).materialise(), g.materialise(100, 900))
        assert f.provenance_digest() == g.provenance_digest()
        st, keys, so = g.canonical_segments()           # the digest's definition, vectorised
        h = hashlib.sha256(b"kvrace-provenance-v1" + np.int64(g.nbytes).tobytes())
        h.update(np.stack([st, keys, so], axis=1).astype("<i8").tobytes())
        assert f.provenance_digest() == h.hexdigest()
        small = f.slice(0, 64)                           # few segments: the plain-Python digest
        st, keys, so = small.canonical_segments()
        h = hashlib.sha256(b"kvrace-provenance-v1" + np.int64(64).tobytes())
        h.update(np.stack([st, keys, so], axis=1).astype("<i8").tobytes())
        assert small.provenance_digest() == h.hexdigest()


def test_an_idle_stream_does_not_pin_the_live_accesses_of_the_others():
    """One host, two streams: ``load`` copies once and then idles (a HiCache run whose
    load-backs stop), ``forward`` writes on, and the host synchronizes ``forward`` after each
    write.  A later op of any stream is after the host's clock, so once the host has
    synchronized past a write it is ordered before every later op, however old ``load``'s
    last op: the live set stays within a prune period (it grew with the run while the floor
    was only the streams' last ops: 4.6 GB in ten simulated minutes of ``incident``)."""
    clocks = OnlineClocks(["load", "forward"], ["host"])
    tracker = RaceTracker(clocks, 10)
    starts = np.arange(0, 4 * 4096, 4096, dtype=np.int64)

    class Op:
        host, bound_record, event = "host", None, None

        def __init__(self, index, stream, op, sync_targets=()):
            self.index, self.stream, self.op, self.sync_targets = index, stream, op, sync_targets

    most, i = 0, 0
    for k in range(3000):
        stream = "load" if k == 0 else "forward"
        comp, pos, clock = clocks.add(Op(i, stream, "write"))
        tracker.add(i, comp, pos, clock, [("D", True, starts, starts + 256)])
        most = max(most, tracker.live_accesses())
        clocks.add(Op(i + 1, None, "host_sync", (i,)))
        i += 2
    assert tracker.total == 0
    assert most <= 4 * (2 * tracker.PRUNE_EVERY + 2), most
