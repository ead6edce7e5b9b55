"""Hypothesis properties of the simulator (DESIGN.md, 'Time, streams and events')."""
import copy

import pytest

import networkx as nx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import TieBreak, run_reference, run_schedule
from sim.hb import HappensBefore, hb_graph, latent_races
from sim.replay import plausible_words, possible_provenance
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile, schedule_doc
from tests.strategies import schedules

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


@FAST
@given(schedules(), st.data())
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
