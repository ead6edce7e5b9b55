"""Validation's memos (unit selections expanded once per layout, layer and units; a copy
plan's bound checks once per plan) give the schedule, totals and errors that validating
without them gives."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.schedule as schedule
from sim.errors import InputError
from sim.schedule import ScheduleBuilder, validate
from tests.strategies import rich_schedules, schedules

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _NoMemo(dict):
    def __setitem__(self, key, value):
        pass


def _fields(s):
    out = []
    for op in s.ops:
        ext = None if op.extents is None else [a.tolist() for a in op.extents]
        units = None if op.units is None else op.units.tolist()
        plan = None if op.plan is None else [a.tolist() for a in (op.plan.extents.src, op.plan.extents.dst)]
        out.append((op.id, op.op, op.layer, units, ext, plan))
    return out


def _validate_without_memos(doc):
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(schedule, "_SELECTIONS", _NoMemo())
        orig = ScheduleBuilder.__init__

        def init(self, *a, **k):
            orig(self, *a, **k)
            self._plan_checks = _NoMemo()
        mp.setattr(ScheduleBuilder, "__init__", init)
        return validate(doc)
    finally:
        mp.undo()


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16)))
def test_memoised_validation_equals_validation_without_memos(doc):
    fast, again, slow = validate(doc), validate(doc), _validate_without_memos(doc)
    assert _fields(fast) == _fields(slow) == _fields(again)
    assert fast.to_json() == slow.to_json()


def test_memoised_arrays_are_shared_read_only_and_errors_repeat():
    from tests.strategies import base_buffers
    doc = {"kvrace_schedule": 2, "name": "m", "buffers": base_buffers(), "streams": ["s0"], "events": [],
           "ops": [{"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [1, 2]},
                   {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [1, 2]}]}
    s = validate(doc)
    a, b = s.ops
    assert a.units is b.units and not a.extents[0].flags.writeable
    with pytest.raises(ValueError):
        a.extents[0][0] = 5
    lay = s.buffers["D"].layout
    bad = dict(doc, ops=doc["ops"] + [{"op": "read", "stream": "s0", "buffer": "D", "layer": 0,
                                       "units": [lay.units]}])
    msgs = []
    for _ in range(2):
        with pytest.raises(InputError) as e:
            validate(bad)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "ops[2]" in msgs[0]
    assert np.array_equal(a.extents[0], np.asarray(lay.unit_offsets(0, np.array([1, 2]))))


def test_fewer_full_collections_restores_the_collector():
    import gc

    from sim.schedule import GC_OLD_THRESHOLD, fewer_full_collections
    old = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with fewer_full_collections():
            inside = gc.get_threshold()
            with fewer_full_collections():            # nested: restores the outer block's values
                pass
            assert gc.get_threshold() == inside
        assert inside[2] == GC_OLD_THRESHOLD and inside[0] > 700 and gc.get_threshold() == (700, 10, 10)
        with pytest.raises(RuntimeError):
            with fewer_full_collections():
                raise RuntimeError("inside")
        assert gc.get_threshold() == (700, 10, 10)
        gc.disable()
        with fewer_full_collections():
            assert gc.get_threshold() == (700, 10, 10) and not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*old)


@pytest.mark.parametrize("seed", range(12))
def test_layer_shifted_plan_checks_equal_fresh_checks(seed):
    """A ``kernel_per_layer`` copy's bound checks (lowest byte per side, extents out of bounds)
    at another layer of the same arguments are derived from the first layer's checks; equal to
    checking each plan afresh, for indices inside the pool, past a layer's pages (their extents
    leave the buffer at the last layers only) and far past the buffer (at every layer)."""
    import sim.transfers.routines as routines
    from benchmarks.bench_executor import static_doc
    rng = np.random.default_rng(seed)
    doc = static_doc(1)
    copies = [o for o in doc["ops"] if o["op"] == "copy"]
    pages = next(b for b in doc["buffers"] if b["name"] == copies[0]["dst"])["layout"]["pages"]
    k = int(rng.integers(1, 5))
    dst = rng.integers(0, pages, k).tolist()
    if seed % 3 == 1:
        dst[0] = pages + int(rng.integers(0, 3 * pages))        # past the layer: out at the last layers
    elif seed % 3 == 2:
        dst[-1] = 2 ** 31 + int(rng.integers(0, 2 ** 20))        # past the buffer at every layer
    order = rng.permutation(len(copies)).tolist()
    doc["ops"] = [dict(copies[i], args=dict(copies[i]["args"], src_indices=[0] * k, dst_indices=dst))
                  for i in order]

    def check(memo: bool) -> int:
        mp = pytest.MonkeyPatch()
        mp.setattr(routines, "_layer_families", {})
        try:
            b = ScheduleBuilder(doc, max_ops=None)
            if not memo:
                b._plan_checks = _NoMemo()
            for d in doc["ops"]:
                b.add(d)
            return b.totals.out_of_bounds
        finally:
            mp.undo()
    got = check(True)
    assert got == check(False)
    assert (got == 0) == (seed % 3 == 0)
    if seed % 3 == 2:
        assert got >= len(copies)
    elif seed % 3 == 1:
        assert 0 < got < len(copies)
