"""Hypothesis properties of the simulator (DESIGN.md, 'Time, streams and events')."""
import copy

import pytest

import networkx as nx
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import TieBreak, run_reference, run_schedule
from sim.hb import HappensBefore, hb_graph, latent_races
from sim.replay import plausible_words, possible_provenance
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile, schedule_doc
from tests.strategies import rich_schedules, schedules

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

timings = st.builds(
    lambda launch, gbps, jitter: profile(launch_us=launch, h2d_gbps=gbps, d2h_gbps=gbps, jitter_frac=jitter),
    st.sampled_from([0.5, 10.0, 40.0]), st.sampled_from([0.01, 1.0, 55.0]), st.sampled_from([0.0, 0.3]))


@FAST
@given(st.one_of(schedules(), schedules(synchronised=True)), st.data())
def test_race_free_schedules_read_the_same_bytes_under_any_timing_and_order(doc, data):
    s = validate(doc)
    if latent_races(s):
        assert not any(op.id.startswith("w") for op in s.ops if op.op == "wait"), "synchronised yet racy"
        return
    reference = run_reference(s)
    ref = {r.op_id: r.bytes() for r in reference.reads}
    for _ in range(3):
        prof = data.draw(timings)
        ties = TieBreak("seeded", seed=data.draw(st.integers(0, 2**16)))
        run = run_schedule(s, prof, seed=data.draw(st.integers(0, 99)), ties=ties)
        assert len(run.reads) == len(ref)
        assert all(np.array_equal(r.bytes(), ref[r.op_id]) for r in run.reads)
        assert all(np.array_equal(run.memory.final_bytes(n), reference.memory.final_bytes(n))
                   for n in s.buffers)


@FAST
@given(schedules())
def test_vector_clocks_equal_graph_reachability(doc):
    s = validate(doc)
    hb, g = HappensBefore(s), hb_graph(s)
    stream_ops = [op.index for op in s.ops if op.stream is not None]
    for a in stream_ops:
        for b in stream_ops:
            if a != b:
                assert hb.ordered(a, b) == nx.has_path(g, a, b), (s.ops[a].id, s.ops[b].id)


@settings(max_examples=80, deadline=None)
@given(units=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
       read_units=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
       delay=st.floats(0, 40), gbps=st.sampled_from([0.05, 1.0, 55.0]))
def test_ungated_read_of_copied_bytes_is_always_a_latent_race_and_manifests_only_on_overlap(
        units, read_units, delay, gbps):
    ops = [{"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": units, "dst_indices": units}},
           {"op": "compute", "stream": "s1", "duration_us": delay},
           {"id": "rd", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": read_units}]
    s = validate(schedule_doc(ops))
    prof = profile(h2d_gbps=gbps)
    rep = analyse(run_schedule(s, prof))
    overlap = sorted(set(units) & set(read_units))
    races = [r for r in rep["latent_races"] if set(r["ops"]) == {"cp", "rd"}]
    assert bool(races) == bool(overlap)
    if overlap:
        assert races[0]["bytes"] == 64 * len(overlap)
    # when do the copy's items land?  By hand (sim/transfers/timing.py): at most 8 items of 64 B
    # run in one round of the 64-warp launcher, the copy starts at 0 (nothing before it on s0, the
    # link is free), so every item lands at launch 10 + overhead 0.5 + n x 64 B / (gbps x 1,000 B/us)
    # (the test profile has no per-warp limit)
    lands = 10.0 + 0.5 + len(units) * 64 / (gbps * 1e3)
    end = [lands] * len(units)
    t_read = delay + 4.0                  # kernel_launch_us of the h200 profile
    pending = [u for k, u in enumerate(units) if u in overlap and end[k] > t_read]
    status = rep["reads"][0]["status"]
    assert (status != "ok") == bool(pending)


# integers: small ones, and sizes far beyond any limit (mid-size index counts would only cost time)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**4), st.sampled_from([2**31, 10**12, 2**62]),
                 st.floats(allow_nan=True),
                 st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3), st.just({}),
                 st.just({"start": 0, "count": -1}))


@st.composite
def broken(draw):
    doc = copy.deepcopy(draw(schedules(max_ops=6)))
    # walk to a random dict inside the document and damage one key
    nodes = []

    def collect(x):
        if isinstance(x, dict):
            nodes.append(x)
            for v in x.values():
                collect(v)
        elif isinstance(x, list):
            for v in x:
                collect(v)
    collect(doc)
    target = draw(st.sampled_from(nodes))
    action = draw(st.sampled_from(["delete", "junk", "add"]))
    keys = sorted(target)
    if action == "add" or not keys:
        target[draw(st.sampled_from(["bogus", "units", "event", "layer"]))] = draw(JUNK)
    elif action == "delete":
        del target[draw(st.sampled_from(keys))]
    else:
        target[draw(st.sampled_from(keys))] = draw(JUNK)
    return doc


@settings(max_examples=300, deadline=None)
@given(broken())
def test_invalid_schedules_raise_named_input_errors_never_tracebacks(doc):
    try:
        s = validate(doc)
    except InputError as e:
        assert e.where or e.message
        assert str(e)
        return
    # a damage that left a valid schedule must still run (compact model: a damaged size may be huge)
    run_schedule(s, profile(), materialise=False)


# Deeper exploration of the same properties (minutes): pytest -m slow
DEEP = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@DEEP
@given(st.one_of(schedules(max_ops=24), schedules(max_ops=24, synchronised=True)), st.data())
def test_deep_race_free_schedules_are_timing_independent(doc, data):
    test_race_free_schedules_read_the_same_bytes_under_any_timing_and_order.hypothesis.inner_test(doc, data)


@pytest.mark.slow
@DEEP
@given(broken())
def test_deep_invalid_schedules_never_traceback(doc):
    test_invalid_schedules_raise_named_input_errors_never_tracebacks.hypothesis.inner_test(doc)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(schedules(), rich_schedules(max_ops=8)), st.data())
def test_every_simulated_read_is_plausible_in_free_mode(doc, data):
    """Free replay's rule (sim.replay.possible_provenance): whatever timing, tie
    order, compute jitter or torn landing the simulator picks, each 8-byte word
    of each read is one the free-mode check accepts."""
    s = validate(doc)
    states = possible_provenance(s)
    for _ in range(3):
        prof = data.draw(timings)
        run = run_schedule(s, prof, seed=data.draw(st.integers(0, 99)),
                           ties=TieBreak("seeded", seed=data.draw(st.integers(0, 2**16))),
                           torn=data.draw(st.booleans()))
        for r in run.reads:
            ok = plausible_words(r.bytes(), states[r.op_id])
            assert ok.all(), (r.op_id, int((~ok).sum()))


def _host_synced_pairs(doc):
    """(a, b) op ids that a host_sync orders, derived from the document alone (CUDA semantics,
    no sim.hb): ``a`` is a stream op the sync waits for (device: every stream op issued before
    it; stream S: every op issued on S before it; event: every op issued on the recording stream
    up to the latest earlier record of that event) and ``b`` any stream op issued after it."""
    ops = doc["ops"]
    out = set()
    for h, op in enumerate(ops):
        if op["op"] != "host_sync":
            continue
        before = [o for o in ops[:h] if "stream" in o and o["op"] != "host_sync"]
        if "event" in op:
            rec = [i for i, o in enumerate(ops[:h]) if o["op"] == "record" and o["event"] == op["event"]][-1]
            waited = [o for o in ops[:rec + 1] if o.get("stream") == ops[rec]["stream"] and o["op"] != "host_sync"]
        elif "stream" in op:
            waited = [o for o in before if o["stream"] == op["stream"]]
        else:
            waited = before
        after = [o for o in ops[h + 1:] if "stream" in o and o["op"] != "host_sync"]
        out |= {(a["id"], b["id"]) for a in waited for b in after}
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rich_schedules())
def test_a_host_synced_pair_is_never_a_race(doc):
    s = validate(doc)
    synced = _host_synced_pairs(doc)
    for r in latent_races(s):
        a, b = s.ops[r["a"].op].id, s.ops[r["b"].op].id
        assert (a, b) not in synced and (b, a) not in synced, (a, b)
    for a, b in synced:
        assert HappensBefore(s).ordered(s.op(a).index, s.op(b).index), (a, b)


# knobs of the bounded search for a run in which a race manifests
_KNOBS = dict(scale=[1.0, 0.0, 20.0, 0.1], h2d=[55.0, 0.01, 1000.0, 1.0], d2h=[55.0, 0.01, 1000.0, 1.0],
              hbm=[4160.0, 1.0, 0.05, 1e6], launch=[10.0, 0.5, 40.0], klaunch=[4.0, 0.1, 30.0],
              memcpy=[10.0, 0.5, 40.0], skew=[0.0, 5.0, 50.0, 5000.0], sharing=["fifo", "concurrent"])


def _touch_window(run, op):
    """(first, last) instant at which ``op`` touches bytes in ``run`` (a copy: its first and
    last item landing; a read or write: its one access); None for a copy of no items."""
    if op.op == "copy":
        ends = run.item_end_us.get(op.id)
        return None if ends is None or ends.size == 0 else (float(ends.min()), float(ends.max()))
    t = run.access_us[op.id]
    return t, t


def _reversed(run, x, y):
    """Did ``y`` (issued after ``x``) touch bytes before ``x`` had finished touching them?
    (Same-instant rules of sim.executor: landed items are applied before a read or write at
    the same instant; two reads/writes at one instant go in the recorded access order.)"""
    wx, wy = _touch_window(run, x), _touch_window(run, y)
    if wx is None or wy is None:
        return False
    if y.op == "copy" and x.op != "copy":
        return wy[0] <= wx[1]
    if x.op != "copy" and y.op != "copy" and wy[0] == wx[1]:
        return run.access_seq[y.id] < run.access_seq[x.id]
    return wy[0] < wx[1]


def _unmanifested(doc, pairs, runs):
    """The racing pairs (issue-order index pairs) for which no run of a bounded search (tie
    seeds, link and HBM speeds, launch costs, compute and host-delay durations scaled) puts the
    later-issued op's access before the earlier one's completes."""
    import copy as _c

    left = set(pairs)
    rng = np.random.default_rng(0)
    for i in range(runs):
        k = {name: v[0] if i == 0 else v[rng.integers(len(v))] for name, v in _KNOBS.items()}
        d = _c.deepcopy(doc)
        for o in d["ops"]:
            if o["op"] in ("compute", "host_delay"):
                o["duration_us"] *= k["scale"]
        s = validate(d)
        run = run_schedule(s, profile(h2d_gbps=k["h2d"], d2h_gbps=k["d2h"], hbm_gbps=k["hbm"],
                                      launch_us=k["launch"], kernel_launch_us=k["klaunch"],
                                      memcpy_latency_us=k["memcpy"], launch_jitter_us=k["skew"],
                                      sharing=k["sharing"]),
                           ties=TieBreak("seeded", seed=i), seed=i)
        left = {(a, b) for a, b in left if not _reversed(run, s.ops[a], s.ops[b])}
        if not left:
            break
    return left


def _races(s):
    """Racing pairs (a, b), a issued first."""
    return {tuple(sorted((r["a"].op, r["b"].op))) for r in latent_races(s)}


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(schedules(max_ops=10), rich_schedules(max_ops=8)))
def test_a_reported_race_manifests_under_some_timing(doc):
    """Every latent race is shown to manifest: some run of a bounded search (tie seeds, link,
    HBM and launch costs, launch skew, FIFO or concurrent links, scaled durations) reverses the
    pair's issue order (the reference order)."""
    _check_races_manifest(doc, runs=120)


def _check_races_manifest(doc, runs):
    s = validate(doc)
    left = _unmanifested(doc, _races(s), runs=runs)
    assert not left, [(s.ops[a].id, s.ops[b].id) for a, b in left]


def _manifests_with_skew(doc, pair, seeds=400):
    """Some seed of a run with launch skew (500 us) and concurrent links reverses ``pair``'s
    issue order: the timing that shows the race (see sim.profile: launch_jitter_us, sharing)."""
    s = validate(doc)
    prof = profile(launch_jitter_us=500.0, sharing="concurrent")
    a, b = pair
    return any(_reversed(run_schedule(s, prof, seed=k, ties=TieBreak("seeded", seed=k)), s.ops[a], s.ops[b])
               for k in range(seeds))


def test_a_copy_vs_read_race_behind_a_shared_link_manifests_with_launch_skew():
    """'other' (s1) and 'first' (s0) are issued at t = 0; 'second' and 'rd' follow 'first' on
    s0.  With FIFO links and no skew 'other' always lands before 'rd' reads (the model could not
    show this race); a GPU may start 'other' late, and so does a run with launch skew."""
    cp = lambda i, stream: {"id": i, "op": "copy", "stream": stream, "routine": "kernel_per_layer",
                            "src": "H", "dst": "D", "args": {"layer": 0, "src_indices": [0], "dst_indices": [0]}}
    ops = [cp("first", "s0"), cp("second", "s0"), cp("other", "s1"),
           {"id": "rd", "op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [0]}]
    doc = schedule_doc(ops)
    s = validate(doc)
    assert (2, 3) in {tuple(sorted((r["a"].op, r["b"].op))) for r in latent_races(s)}   # other vs rd
    assert _unmanifested(doc, {(2, 3)}, runs=1) == {(2, 3)}     # the default timing does not show it
    assert _manifests_with_skew(doc, (2, 3))


def test_a_copy_race_on_one_link_manifests_with_concurrent_copies():
    """Two H2D copies on different streams, 'late' issued 0.5 us after 'early': a FIFO link
    never lets 'late' land first; concurrent copy kernels on a GPU (and with launch skew) can."""
    ops = [{"id": "early", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": [0], "dst_indices": [0]}},
           {"id": "pause", "op": "host_delay", "duration_us": 0.5},
           {"id": "late", "op": "copy", "stream": "s1", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": [1], "dst_indices": [0]}}]
    doc = schedule_doc(ops)
    s = validate(doc)
    pairs = {tuple(sorted((r["a"].op, r["b"].op))) for r in latent_races(s)}
    assert pairs == {(0, 2)}                     # early vs late on D's unit 0, by hand
    assert _unmanifested(doc, pairs, runs=1) == pairs
    assert _manifests_with_skew(doc, (0, 2))


def test_a_race_between_two_kernels_manifests_with_launch_skew():
    """'wr' (s0) touches D at kernel_launch_us; 'rd' (s1) comes after another kernel on s1.
    Without per-stream launch skew 'rd' is always later; with it, some run puts 'rd' first."""
    ops = [{"id": "wr", "op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [0], "owner": 5},
           {"id": "other", "op": "write", "stream": "s1", "buffer": "D2", "layer": 0, "units": [0], "owner": 6},
           {"id": "rd", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [0]}]
    doc = schedule_doc(ops)
    s = validate(doc)
    pairs = {tuple(sorted((r["a"].op, r["b"].op))) for r in latent_races(s)}
    assert pairs == {(0, 2)}                     # wr vs rd on D, by hand
    assert _unmanifested(doc, pairs, runs=1) == pairs
    assert _manifests_with_skew(doc, (0, 2))


@pytest.mark.slow
@DEEP
@given(rich_schedules(max_ops=20), st.data())
def test_deep_every_simulated_read_is_plausible(doc, data):
    test_every_simulated_read_is_plausible_in_free_mode.hypothesis.inner_test(doc, data)


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "OPEN: the bounded random search (200 runs) can miss a race between ops separated by a long "
    "chain on one stream (e.g. o2 vs o11 with nine ops queued before o11): with exponential launch "
    "skew the chance per run falls like 2**-chain; a targeted search (skew only on the earlier op's "
    "stream) would find it.  Kept to report such schedules."))
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(schedules(max_ops=16), rich_schedules(max_ops=16)))
def test_deep_reported_races_manifest(doc):
    _check_races_manifest(doc, runs=200)


@pytest.mark.slow
@DEEP
@given(rich_schedules(max_ops=20))
def test_deep_host_synced_pairs_never_race(doc):
    test_a_host_synced_pair_is_never_a_race.hypothesis.inner_test(doc)
