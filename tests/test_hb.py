"""Latent races (sort + sweep, capped listing, full count) and intra-launch races.

The reference for latent races is brute force and independent of sim.hb's
vector clocks and interval arithmetic: python sets of bytes per access and
reachability in the networkx happens-before graph."""
import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.hb import (HappensBefore, accesses, double_written, hb_graph, indeterminate_read_bytes,
                    intra_launch_races, latent_races, race_scan)
from sim.schedule import validate
from tests.helpers import schedule_doc
from tests.strategies import schedules

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bytes(acc):
    return {x for s, e in zip(acc.starts.tolist(), acc.ends.tolist()) for x in range(s, e)}


def brute_force_races(s):
    """{(buffer, op a, op b): conflicting bytes} over all op pairs, a < b."""
    g = hb_graph(s)
    by = {}
    for acc in accesses(s):
        by.setdefault((acc.buffer, acc.op), []).append((acc.write, _bytes(acc)))
    out = {}
    keys = sorted(by)
    for i, (buf, a) in enumerate(keys):
        for buf2, b in keys[i + 1:]:
            if buf2 != buf or a == b:
                continue
            if nx.has_path(g, a, b) or nx.has_path(g, b, a):
                continue
            common = set()
            for wa, ba in by[(buf, a)]:
                for wb, bb in by[(buf, b)]:
                    if wa or wb:
                        common |= ba & bb
            if common:
                out[(buf, min(a, b), max(a, b))] = common
    return out


def _as_dict(races):
    return {(r["buffer"], r["a"].op, r["b"].op):
            {x for s, e in zip(r["starts"].tolist(), r["ends"].tolist()) for x in range(s, e)}
            for r in races}


@st.composite
def schedules_with_self_copies(draw):
    """The shared random schedules, plus sometimes a device copy within one buffer
    (an op with a read and a write access on the same buffer)."""
    doc = draw(schedules())
    for _ in range(draw(st.integers(0, 2))):
        units = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True))
        src = draw(st.lists(st.integers(0, 7), min_size=len(units), max_size=len(units)))
        at = draw(st.integers(0, len(doc["ops"])))
        doc["ops"].insert(at, {"id": f"self{at}_{len(doc['ops'])}", "op": "copy",
                               "stream": draw(st.sampled_from(["s0", "s1", "s2"])),
                               "routine": "kernel_per_layer", "src": "D", "dst": "D",
                               "args": {"layer": draw(st.integers(0, 1)), "src_indices": src,
                                        "dst_indices": units}})
    return doc


@FAST
@given(schedules_with_self_copies())
def test_latent_races_equal_brute_force_all_pairs(doc):
    s = validate(doc)
    expected = brute_force_races(s)
    races = latent_races(s)
    got = _as_dict(races)
    assert len(races) == len(got)                       # one entry per (buffer, op pair)
    assert got == expected
    assert all(r["bytes"] == len(expected[(r["buffer"], r["a"].op, r["b"].op)]) for r in races)
    scan = race_scan(s, limit=2)
    assert scan.total == len(expected)
    assert [(r["buffer"], r["a"].op, r["b"].op) for r in scan.races] == \
        [(r["buffer"], r["a"].op, r["b"].op) for r in races[:2]]


def test_vectorised_concurrency_equals_pairwise():
    doc = schedule_doc([
        {"id": "a", "op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [0]},
        {"op": "record", "stream": "s0", "event": "e0"},
        {"id": "b", "op": "write", "stream": "s1", "buffer": "D", "layer": 0, "units": [0]},
        {"op": "wait", "stream": "s1", "event": "e0"},
        {"id": "c", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [0]},
        {"id": "d", "op": "read", "stream": "s2", "buffer": "D", "layer": 0, "units": [0]}])
    s = validate(doc)
    hb = HappensBefore(s)
    ops = [op.index for op in s.ops if op.stream is not None]
    a, b = np.array([(x, y) for x in ops for y in ops if x != y]).T
    assert hb.concurrent_many(a, b).tolist() == [hb.concurrent(x, y) for x, y in zip(a, b)]


def _one_op_streams(n, units=(0, 1)):
    ops = [{"id": f"w{i}", "op": "write", "stream": f"s{i}", "buffer": "D", "layer": 0,
            "units": list(units), "owner": 100 + i} for i in range(n)]
    return validate(schedule_doc(ops, streams=[f"s{i}" for i in range(n)]))


def test_500_one_op_streams_are_counted_not_listed():
    s = _one_op_streams(500)
    scan = race_scan(s, limit=1000)
    assert scan.total == 500 * 499 // 2            # every pair of writers of the same 2 units
    assert len(scan.races) == 1000
    # listed in op-pair order: writer 0 against writers 1..499, then writer 1 against 2..501
    pairs = [(r["a"].op, r["b"].op) for r in scan.races]
    assert pairs[:499] == [(0, j) for j in range(1, 500)]
    assert pairs[499:997] == [(1, j) for j in range(2, 500)]
    assert pairs[997:] == [(2, 3), (2, 4), (2, 5)]
    assert all(r["bytes"] == 2 * 64 and r["n_ranges"] == 1 for r in scan.races)


def test_limit_zero_and_none():
    s = _one_op_streams(20)
    assert race_scan(s, limit=0).races == [] and race_scan(s, limit=0).total == 190
    assert len(latent_races(s)) == 190 and len(latent_races(s, None, 7)) == 7


def test_ordered_writers_of_the_same_bytes_do_not_race_and_readers_do_not_race_each_other():
    ops = [{"id": f"w{i}", "op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [3]}
           for i in range(50)]
    ops += [{"id": f"r{i}", "op": "read", "stream": "s1", "buffer": "D2", "layer": 0, "units": [3]}
            for i in range(50)]
    ops += [{"id": f"q{i}", "op": "read", "stream": "s2", "buffer": "D2", "layer": 0, "units": [3]}
            for i in range(50)]
    assert race_scan(validate(schedule_doc(ops))).total == 0


def test_many_interval_accesses_race_once_per_op_pair_with_all_bytes():
    # two copies of every other unit: 4 ranges each, on one buffer, not ordered
    units = [0, 2, 4, 6]
    ops = [{"id": "c0", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 1, "src_indices": units, "dst_indices": units}},
           {"id": "c1", "op": "copy", "stream": "s1", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 1, "src_indices": units, "dst_indices": units[1:] + [7]}}]
    races = latent_races(validate(schedule_doc(ops)))
    assert len(races) == 1
    r = races[0]
    layer1 = 8 * 64
    assert r["buffer"] == "D" and r["bytes"] == 3 * 64
    assert [[int(a), int(b)] for a, b in zip(r["starts"], r["ends"])] == \
        [[layer1 + u * 64, layer1 + u * 64 + 64] for u in (2, 4, 6)]


@FAST
@given(st.integers(2, 6), st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["read", "write", "rec"])),
                                   min_size=2, max_size=40), st.integers(0, 30))
def test_window_count_of_a_large_same_bytes_group_equals_pairwise(n_streams, plan, limit):
    """Forced onto the big-group path (CHUNK_PAIRS tiny), the happens-before window
    count and the row-wise listing equal the brute-force all-pairs result."""
    import sim.hb as hbmod
    ops, events = [], []
    for i, (k, kind) in enumerate(plan):
        st_name = f"s{k % n_streams}"
        if kind == "rec":
            ev = f"e{i}"
            events.append(ev)
            ops.append({"op": "record", "stream": st_name, "event": ev})
            ops.append({"op": "wait", "stream": f"s{(k + 1) % n_streams}", "event": ev})
        else:
            ops.append({"id": f"x{i}", "op": kind, "stream": st_name, "buffer": "D", "layer": 0,
                        "units": [1, 2]})
    s = validate(schedule_doc(ops, streams=[f"s{i}" for i in range(n_streams)], events=events or ["e0"]))
    expected = brute_force_races(s)
    old = hbmod.CHUNK_PAIRS
    try:
        hbmod.CHUNK_PAIRS = 1
        scan = race_scan(s, limit=limit)
    finally:
        hbmod.CHUNK_PAIRS = old
    assert scan.total == len(expected)
    assert [(r["a"].op, r["b"].op) for r in scan.races] == sorted((a, b) for _, a, b in expected)[:limit]
