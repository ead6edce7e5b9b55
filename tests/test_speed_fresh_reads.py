"""Fresh reads (``OnlineVerdicts.captured``): a read that raced no write, with no indeterminate
bytes, in a run where no two writing ops raced, is judged ``ok`` without its expected views.
Checked against the full comparison (``OnlineVerdicts.FAST_READS = False``: every read's
expected views made when it is taken and compared) on random schedules and host programs, and
on schedules built so that each condition is what makes a read stale."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import Executor, run_static
from sim.schedule import validate
from sim.testing import kv_schedules, load_forward_programs
from sim.verdicts import OnlineVerdicts, analyse, read_digest
from tests.helpers import both_ways, doc_sha, profile, stream_static
from tests.strategies import rich_schedules, schedules

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _static(s, seed: int, torn: bool = True):
    """run_schedule(s, keep="report") with every read handed to a hook: (report, reads seen)."""
    seen = []
    run = stream_static(s, P, on_read=lambda cap, views, entry: seen.append(
        (entry, [(v.offset, v.compact.provenance_digest()) for v in views])), seed=seed, torn=torn)
    return doc_sha(analyse(run)), seen


def _both(fn, *args):
    return both_ways(OnlineVerdicts, "FAST_READS", fn, *args)


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16), kv_schedules(max_ops=16)),
       st.integers(0, 3), st.booleans())
def test_fresh_verdicts_equal_the_full_comparison_on_random_schedules(doc, seed, torn):
    s = validate(doc)
    fast, full = _both(_static, s, seed, torn)
    assert fast == full


def _program(lf, seed: int):
    run = lf.run(P, keep="report", materialise=False, seed=seed)
    return doc_sha(analyse(run))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(load_forward_programs(gate_maps=["upstream-0.5.10", "upstream-0.5.11"], max_layers=2, max_requests=2),
       st.integers(0, 3))
def test_fresh_verdicts_equal_the_full_comparison_on_host_programs(lf, seed):
    fast, full = _both(_program, lf, seed)
    assert fast == full


# ---- schedules where exactly one condition makes a read stale

def _doc(ops: list) -> dict:
    host = {"kind": "host", "layout": "layer_first", "layers": 1, "units": 4, "unit_bytes": 64}
    dev = {"kind": "paged", "layers": 1, "pages": 4, "page_bytes": 64}
    return {"kvrace_schedule": 2, "name": "fresh", "events": ["ea", "eb"],
            "buffers": [{"name": "h", "location": "host", "kind": "kv", "layout": host},
                        {"name": "g", "location": "device", "device": 0, "kind": "kv", "layout": dev}],
            "streams": [{"name": "a", "device": 0}, {"name": "b", "device": 0}, {"name": "c", "device": 0}],
            "ops": ops}


def _copy(i, stream):
    return {"id": i, "op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": "h", "dst": "g",
            "args": {"layer": 0, "src_indices": [1], "dst_indices": [2]}}


def _write(i, stream, buf, owner):
    return {"id": i, "op": "write", "stream": stream, "buffer": buf, "layer": 0, "units": [1 if buf == "h" else 2],
            "owner": owner}


READ = {"id": "r", "op": "read", "stream": "a", "buffer": "g", "layer": 0, "units": [2]}
DELAY = {"id": "d", "op": "compute", "stream": "a", "duration_us": 50.0}

BUILT = {
    # the copy's source is written by a concurrent write listed after the read, which runs
    # first: the copy (before the read on its stream) lands that write's bytes; the read
    # itself races nothing
    "copy of a raced source": [DELAY, _copy("c", "a"), READ, _write("x", "b", "h", 7)],
    # two concurrent writes of the read's bytes, listed in the other order than they run;
    # the read waits for both
    "write-write race": [DELAY, _write("w2", "a", "g", 2), {"id": "ra", "op": "record", "stream": "a", "event": "ea"},
                         _write("w1", "b", "g", 1), {"id": "rb", "op": "record", "stream": "b", "event": "eb"},
                         {"id": "wa", "op": "wait", "stream": "c", "event": "ea"},
                         {"id": "wb", "op": "wait", "stream": "c", "event": "eb"},
                         dict(READ, stream="c")],
    # a write listed after the read, concurrent with it, that runs first (a static schedule
    # takes its ops on demand: the race is found only if the ops started are taken)
    "a later write that runs first": [DELAY, READ, _write("x", "b", "g", 7)],
}


@pytest.mark.parametrize("name", sorted(BUILT))
def test_built_schedules_are_judged_stale_both_ways(name):
    s = validate(_doc(BUILT[name]))
    (fast, fast_seen), (full, full_seen) = _both(_static, s, 0)
    assert fast == full and fast_seen == full_seen
    [(entry, _)] = [x for x in fast_seen if x[0]["op"] == "r"]
    assert entry["status"] == "stale"


def test_a_read_far_behind_the_ops_started_is_compared(monkeypatch):
    """Ops started more than FRONTIER_WINDOW list positions past a read are not taken early
    for it: the read is compared (still stale here), and no more expected views are held."""
    monkeypatch.setattr(OnlineVerdicts, "FRONTIER_WINDOW", 0)
    s = validate(_doc(BUILT["a later write that runs first"]))
    (fast, fast_seen), (full, full_seen) = _both(_static, s, 0)
    assert fast == full and fast_seen == full_seen and fast_seen[0][0]["status"] == "stale"


def test_a_read_of_indeterminate_bytes_is_not_fresh():
    """Two items of one copy write the read's page (an intra-launch race): the read raced
    nothing, yet its bytes are indeterminate, which only the full comparison reports."""
    twice = dict(_copy("c", "a"), args={"layer": 0, "src_indices": [0, 1], "dst_indices": [2, 2]})
    s = validate(_doc([twice, READ]))
    (fast, fast_seen), (full, full_seen) = _both(_static, s, 0)
    assert fast == full and fast_seen == full_seen
    [(entry, _)] = fast_seen
    assert entry["status"] == "indeterminate"


def test_a_fresh_read_hands_its_own_views_as_expected():
    s = validate(_doc([_copy("c", "a"), READ]))
    ex = Executor(s.buffers, s.streams, P, keep="report", hosts=s.hosts, static_ops=s.ops)
    seen = []
    ex.online.on_read(lambda cap, views, entry: seen.append((cap, views, entry)))
    run_static(ex, s)
    [(cap, views, entry)] = seen
    assert entry["status"] == "ok" and views is cap.views
    assert entry["provenance_sha256"] == entry["expected_provenance_sha256"] == read_digest(cap)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(rich_schedules(max_ops=14), kv_schedules(max_ops=14)), st.integers(0, 3))
def test_entries_without_digests_are_the_entries_less_the_digests(doc, seed):
    s = validate(doc)
    _, with_digests = _static(s, seed)
    seen = []
    stream_static(s, P, on_read=lambda cap, views, entry: seen.append(
        (entry, [(v.offset, v.compact.provenance_digest()) for v in views])), digests=False, seed=seed)
    strip = ("provenance_sha256", "expected_provenance_sha256")
    assert seen == [({k: v for k, v in e.items() if k not in strip}, views) for e, views in with_digests]
