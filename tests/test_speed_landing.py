"""Landed copy items applied together (``Executor._advance``, issue 9's speed): the items of one
copy that land with nothing of another copy between them go to memory in one call instead of
one per landing time.  Checked against the per-landing-time path (``MERGE_LANDED = False``) on
random schedules and host programs, and on a copy that reads the buffer it writes (whose
items must still land one by one: each reads what the one before it wrote)."""
from __future__ import annotations


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import Executor, run_schedule
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.testing import load_forward_programs
from sim.verdicts import analyse
from tests.helpers import both_ways, doc_sha, profile, schedule_doc
from tests.strategies import rich_schedules, schedules

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: one warp: a copy's items land one after another
SERIAL = profile(sm_count=1, resident_warps_per_sm=1, warp_gbps=1.0)
PROFILES = [profile(jitter_frac=0.1), SERIAL]



def _static(s, p, seed):
    run = run_schedule(s, p, seed=seed)
    reads = [(r.op_id, [(v.offset, v.compact.provenance_digest()) for v in r.views]) for r in run.reads]
    online = run_schedule(s, p, seed=seed, keep="report")
    return snapshot_of(run).to_json(), reads, doc_sha(analyse(run)), doc_sha(online.online.report(online))


def _both(fn, *args):
    return both_ways(Executor, "MERGE_LANDED", fn, *args)


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16)), st.sampled_from(PROFILES), st.integers(0, 3))
def test_landed_items_merged_equal_one_apply_per_landing_time(doc, p, seed):
    merged, per_time = _both(_static, validate(doc), p, seed)
    assert merged == per_time


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(load_forward_programs(max_layers=2, max_requests=2), st.sampled_from(PROFILES), st.integers(0, 3))
def test_host_programs_give_the_same_run_merged(lf, p, seed):
    def go():
        run = lf.run(p, keep="all", seed=seed)
        return snapshot_of(run).to_json(), doc_sha(analyse(run))
    merged, per_time = _both(go)
    assert merged == per_time


def test_a_copy_reading_its_own_destination_lands_item_by_item():
    ops = [{"op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [0, 1, 2, 3], "owner": 1, "id": "w0"},
           {"op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [0], "owner": 5, "id": "w1"},
           {"op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "D", "dst": "D", "id": "c",
            "args": {"layer": 0, "src_indices": [0, 1, 2], "dst_indices": [1, 2, 3]}},
           {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [0, 1, 2, 3], "id": "r"}]
    s = validate(schedule_doc(ops))
    run = run_schedule(s, SERIAL)
    ends = run.item_end_us["c"]
    assert len(set(ends.tolist())) == 3                   # three landing times
    # each item read what the one before it wrote: owner 5's unit 0 reached every unit
    assert len({v.compact.provenance_digest() for v in run.reads[0].views}) == 1
    merged, per_time = _both(_static, s, SERIAL, 0)
    assert merged == per_time
