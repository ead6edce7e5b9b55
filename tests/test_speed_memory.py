"""A run's memories start as copies, not set up afresh: buffers of one kind and layout
share their first one's initial segments (``Memory._init_buffer``), and the reference
and initial memories of a keep="report" run are ``Memory.copy_compact`` of the run's.
Each equals the memory set up buffer by buffer, and writes to one never show in another."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import run_schedule
from sim.memory import Memory
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile
from tests.strategies import rich_schedules, schedules

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
any_schedule = st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14))


def _two_ranks() -> dict:
    bufs = []
    for d in range(3):
        bufs.append({"name": f"dev{d}", "location": "device", "device": d, "kind": "kv",
                     "layout": {"preset": "dsa_index_k", "layers": 3, "pages": 8}})
        bufs.append({"name": f"host{d}", "location": "host", "kind": "kv",
                     "layout": {"kind": "host", "layout": "page_first", "layers": 3, "units": 8,
                                "unit_bytes": 8448}})
    return {"kvrace_schedule": 2, "name": "ranks", "buffers": bufs, "streams": ["s0"], "events": [], "ops": []}


def _state(mem: Memory) -> dict:
    return {n: [a.tolist() for a in b.canonical_segments()] for n, b in mem.compact.items()}


def test_equal_buffers_share_their_start_and_not_their_writes():
    s = validate(_two_ranks())
    shared = Memory(s.buffers, materialise=False)
    one_by_one = Memory(s.buffers, materialise=True)        # materialised: set up buffer by buffer
    assert _state(shared) == _state(one_by_one)
    lay = s.buffers["dev1"].layout
    off = np.asarray(lay.unit_offsets(1, np.array([2])), np.int64)
    shared.write_units("dev1", 1, np.array([2]), off, np.full(off.size, lay.unit_bytes), owner=5, version=1)
    one_by_one.write_units("dev1", 1, np.array([2]), off, np.full(off.size, lay.unit_bytes), owner=5, version=1)
    assert _state(shared) == _state(one_by_one)
    assert _state(shared)["dev0"] != _state(shared)["dev1"] and _state(shared)["dev0"] == _state(shared)["dev2"]


def test_a_compact_copy_is_independent():
    s = validate(_two_ranks())
    mem = Memory(s.buffers, materialise=False)
    copy = mem.copy_compact()
    assert copy.table is mem.table and _state(copy) == _state(mem)
    before = _state(mem)
    lay = s.buffers["host0"].layout
    off = np.asarray(lay.unit_offsets(0, np.array([1])), np.int64)
    copy.write_units("host0", 0, np.array([1]), off, np.full(off.size, lay.unit_bytes), owner=1, version=2)
    assert _state(mem) == before and _state(copy) != before


@SETTINGS
@given(any_schedule, st.integers(0, 3))
def test_report_runs_from_copied_memories_equal_runs_from_fresh_ones(doc, seed):
    """The report of a keep="report" run whose reference and initial memories are compact
    copies of the run's equals the one whose memories are set up afresh."""
    fast = analyse(run_schedule(validate(doc), profile(jitter_frac=0.1), seed=seed, keep="report"))
    mp = __import__("pytest").MonkeyPatch()
    try:
        mp.setattr(Memory, "copy_compact",
                   lambda self: Memory(self.specs, materialise=False, table=self.table))
        mp.setattr(Memory, "_init_buffer", Memory._init_buffer_models)
        slow = analyse(run_schedule(validate(doc), profile(jitter_frac=0.1), seed=seed, keep="report"))
    finally:
        mp.undo()
    assert fast == slow
