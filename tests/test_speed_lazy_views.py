"""Lazy read views (``Executor.LAZY_VIEWS``, ``sim.read_views.LazyViews``): a streamed run
(``keep="report"``, compact-only memory) captures a read's views as a snapshot of its buffer
sliced on first use.  Built whenever (here: after the run, when the buffers have changed since
every read), they are the views the eager path slices at the capture instant, on random
schedules and host programs (a torn read's with the done part of the items in flight written
into its snapshot, as the eager path overlays them); the verdicts are the same; a materialised
memory keeps eager views; a fresh read's views are not built by the verdicts."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.bytes.compact import CompactBuffer, OriginTable
from sim.bytes.pattern import Origin
from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.executor import Executor, run_reference
from sim.read_views import LazyViews
from sim.schedule import validate
from sim.testing import kv_schedules, load_forward_programs
from sim.verdicts import analyse
from tests.helpers import both_ways, doc_sha, profile, stream_static
from tests.strategies import rich_schedules, schedules

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _describe(views) -> list:
    """Each view's offset, provenance digest and bytes' digest."""
    return [(v.offset, v.compact.nbytes, v.compact.provenance_digest(),
             hashlib.sha256(v.bytes().tobytes()).hexdigest()) for v in views]



def _static(s, seed: int, torn: bool, materialise: bool = False, describe: bool = True):
    """The schedule streamed with a read sink that keeps every capture, looked at only after
    the run: (report digest, [(entry, capture's views, expected views)], captures);
    ``describe=False``: the entries only, no view looked at."""
    seen = []
    run = stream_static(s, P, on_read=lambda cap, views, entry: seen.append((cap, views, entry)), digests=False,
                        seed=seed, torn=torn, materialise=materialise)
    caps = [cap for cap, _, _ in seen]
    if not describe:
        return None, [entry for _, _, entry in seen], caps
    return (doc_sha(analyse(run)), [(entry, _describe(cap.views), _describe(views)) for cap, views, entry in seen],
            caps)


def _both(fn, *args):
    return both_ways(Executor, "LAZY_VIEWS", fn, *args)


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16), kv_schedules(max_ops=16)),
       st.integers(0, 3), st.booleans())
def test_lazy_views_equal_the_views_sliced_at_capture_on_random_schedules(doc, seed, torn):
    s = validate(doc)
    (lazy_sha, lazy_seen, lazy_caps), (eager_sha, eager_seen, eager_caps) = _both(_static, s, seed, torn)
    assert lazy_sha == eager_sha and lazy_seen == eager_seen
    assert not any(isinstance(c.views, LazyViews) for c in eager_caps)
    assert all(isinstance(c.views, LazyViews) for c in lazy_caps)
    assert [c.torn for c in lazy_caps] == [c.torn for c in eager_caps]


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16), kv_schedules(max_ops=16)), st.integers(0, 3))
def test_a_capture_is_torn_only_where_an_in_flight_item_reaches_its_bytes(doc, seed):
    """``ReadCapture.torn`` False: the views are the buffer's bytes at the read (what an
    item-atomic run, ``torn=False``, captures at the same instant); True only with an item
    mid-flight."""
    s = validate(doc)
    _, seen_t, caps_t = _static(s, seed, True)
    _, seen_a, caps_a = _static(s, seed, False)
    assert not any(c.torn for c in caps_a)
    for ct, (_, views_t, _), (_, views_a, _) in zip(caps_t, seen_t, seen_a):
        if ct.torn:
            assert any(f["items_in_flight"] for f in ct.in_flight)
        else:
            assert views_t == views_a


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(load_forward_programs(gate_maps=["upstream-0.5.10", "upstream-0.5.11"], max_layers=2, max_requests=2),
       st.integers(0, 3))
def test_lazy_views_give_the_same_verdicts_on_host_programs(lf, seed):
    def report(lf, seed):
        return doc_sha(analyse(lf.run(P, keep="report", materialise=False, seed=seed)))
    lazy, eager = _both(report, lf, seed)
    assert lazy == eager


# ---- built schedules

def _doc(ops: list, units: int = 4) -> dict:
    host = {"kind": "host", "layout": "layer_first", "layers": 1, "units": units, "unit_bytes": 64}
    dev = {"kind": "paged", "layers": 1, "pages": units, "page_bytes": 64}
    return {"kvrace_schedule": 2, "name": "lazy", "events": ["e"],
            "buffers": [{"name": "h", "location": "host", "kind": "kv", "layout": host},
                        {"name": "g", "location": "device", "device": 0, "kind": "kv", "layout": dev}],
            "streams": [{"name": "a", "device": 0}, {"name": "b", "device": 0}],
            "ops": ops}


COPY = {"id": "c", "op": "copy", "stream": "a", "routine": "kernel_per_layer", "src": "h", "dst": "g",
        "args": {"layer": 0, "src_indices": [1, 3], "dst_indices": [2, 0]}}
READ = {"id": "r", "op": "read", "stream": "a", "buffer": "g", "layer": 0, "units": [0, 1, 2]}
OVERWRITE = {"id": "w", "op": "write", "stream": "a", "buffer": "g", "layer": 0, "units": [0, 2], "owner": 9}


def test_a_fresh_read_keeps_its_views_unbuilt_and_they_show_the_capture_instant():
    """A fresh read's views are not built by the verdicts; built after a later write of the
    same bytes, they hold what the read saw (the happens-before order's read)."""
    s = validate(_doc([COPY, READ, OVERWRITE]))
    _, [entry], [cap] = _static(s, 0, True, describe=False)
    assert entry["status"] == "ok"
    [ref] = run_reference(s, materialise=False).reads
    views = cap.views
    assert isinstance(views, LazyViews) and not views.built and len(views) == len(ref.views)
    assert not views.built                      # len() does not build
    assert _describe(views) == _describe(ref.views) and views.built
    assert views[0] is list(views)[0] and views[-1].offset == ref.views[-1].offset
    assert np.array_equal(cap.bytes(), ref.bytes())


def test_a_materialised_memory_keeps_eager_views():
    s = validate(_doc([COPY, READ, OVERWRITE]))
    _, _, [cap] = _static(s, 0, True, materialise=True)
    assert isinstance(cap.views, list) and cap.views[0].material is not None


def test_a_read_with_a_torn_copy_overlay_has_lazy_views_of_the_overlaid_snapshot():
    """A read on another stream while a copy of large items into its bytes is part-way: the done
    part of the items in flight is written into the read's snapshot (lazy views) or onto its
    eager views, the same either way; a torn read's views are lazy too."""
    units, ub = 8, 1 << 19
    copy = {"id": "c", "op": "copy", "stream": "b", "routine": "kernel_per_layer", "src": "h", "dst": "g",
            "args": {"layer": 0, "src_indices": [4, 5, 6, 7], "dst_indices": [3, 1, 2, 0]}}
    found = 0
    for delay in (10.0, 20.0, 40.0):
        for read_units in ([0, 1, 2, 3], [1], [2, 5], [0, 6, 3]):
            ops = [copy, {"id": "d", "op": "compute", "stream": "a", "duration_us": delay},
                   {"id": "r", "op": "read", "stream": "a", "buffer": "g", "layer": 0, "units": read_units}]
            doc = _doc(ops, units)
            doc["buffers"][0]["layout"]["unit_bytes"] = doc["buffers"][1]["layout"]["page_bytes"] = ub
            s = validate(doc)
            (lazy_sha, lazy_seen, [cap]), (eager_sha, eager_seen, [cap_e]) = _both(_static, s, 0, True)
            assert lazy_sha == eager_sha and lazy_seen == eager_seen and cap.torn == cap_e.torn
            assert isinstance(cap.views, LazyViews) and isinstance(cap_e.views, list)
            if cap.torn:
                assert lazy_seen[0][0]["status"] == "torn"
                found += 1
    assert found, "no delay put the read inside an item in flight"


def test_a_read_is_torn_only_where_an_item_in_flight_reaches_it():
    """While a copy of large items into units 0-3 is part-way, a one-unit read is ``torn``
    exactly when part of an item done so far lies in its bytes (units 0-3): then its views
    differ from an item-atomic run's (``torn=False``); a read of units 4-7 is not, and its views
    are the item-atomic run's, items in flight or not."""
    units, ub = 8, 1 << 19
    copy = {"id": "c", "op": "copy", "stream": "b", "routine": "kernel_per_layer", "src": "h", "dst": "g",
            "args": {"layer": 0, "src_indices": [4, 5, 6, 7], "dst_indices": [0, 1, 2, 3]}}
    n = {"torn": 0, "elsewhere": 0}
    for delay in (10.0, 20.0, 40.0):
        for unit in range(units):
            ops = [copy, {"id": "d", "op": "compute", "stream": "a", "duration_us": delay},
                   {"id": "r", "op": "read", "stream": "a", "buffer": "g", "layer": 0, "units": [unit]}]
            doc = _doc(ops, units)
            doc["buffers"][0]["layout"]["unit_bytes"] = doc["buffers"][1]["layout"]["page_bytes"] = ub
            s = validate(doc)
            _, [(_, views_t, _)], [cap] = _static(s, 0, True)
            _, [(_, views_a, _)], [cap_a] = _static(s, 0, False)
            in_flight = any(f["items_in_flight"] for f in cap.in_flight)
            assert not cap_a.torn and cap.torn == (in_flight and unit < 4)
            if cap.torn:
                n["torn"] += 1
                assert views_t != views_a
            else:
                n["elsewhere"] += in_flight
                assert views_t == views_a
    assert n["torn"] > 0 and n["elsewhere"] > 0, n


def test_lazy_views_of_a_snapshot_equal_the_buffers_slices_then():
    """``LazyViews`` of a clone, built after writes to the original, equal the original's
    slices taken before those writes (``CompactBuffer.clone`` shares no state a write changes)."""
    table = OriginTable()
    buf = CompactBuffer(4096, table, Origin("kv", 0, -1, 0, 64))
    rng = np.random.default_rng(3)
    for k in range(20):
        o = int(rng.integers(0, 4000))
        buf.fill(np.array([o]), np.array([int(rng.integers(1, 4096 - o))]), Origin("kv", 0, k, 1, 64),
                 np.array([int(rng.integers(0, 64))]))
    offs, lens = np.array([0, 100, 1000, 3000, 4095]), np.array([50, 300, 7, 1000, 1])
    then = [(int(o), buf.slice(int(o), int(n)).provenance_digest()) for o, n in zip(offs, lens)]
    lazy = LazyViews(buf.clone(), offs, lens)
    for k in range(20):
        buf.fill(np.array([k * 200]), np.array([150]), Origin("kv", 0, 100 + k, 2, 64), np.array([0]))
    assert [(v.offset, v.compact.provenance_digest()) for v in lazy] == then
    assert [(int(o), buf.slice(int(o), int(n)).provenance_digest()) for o, n in zip(offs, lens)] != then


def test_the_engine_gives_the_same_result_with_lazy_views():
    """Stale index-K reads and load-backs (glm5-22811-small, gate map 0.5.10): the same
    ``EngineResult`` but the wall time with lazy and with eager views."""
    sc = load_scenario("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10"])
    lazy = PrefillEngine(sc, 0, keep="report").run().signature()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Executor, "LAZY_VIEWS", False)
        eager = PrefillEngine(sc, 0, keep="report").run().signature()
    assert lazy["requests_corrupted"] > 0 and lazy["load_backs"] > 0
    assert lazy == eager
