"""Properties of sim.explore on random schedules: the reduction loses no outcome, and every
witness, run on the executor under any timing, gives its outcome's bytes."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import TieBreak, run_schedule
from sim.explore import Explorer
from sim.explore.search import linearizations, orientation_of, traces
from sim.schedule import validate
from sim.verdicts import read_digest
from tests.helpers import profile
from tests.strategies import STREAMS, base_buffers, copy_op, idx_sets, rich_schedules, schedules

#: brute force explores at most this many interleavings per example, the reduction this many traces
BRUTE_LIMIT = 300
TRACE_LIMIT = 2000
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEEP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def racy_schedules(draw, max_ops: int = 5):
    """A few copies, reads and writes of the 64 B-row buffers on three streams, with at most one
    record -> wait: most pairs race.  Rows of 64 B or 1,024 B (chunks of 256 B tear those)."""
    unit = draw(st.sampled_from([64, 1024]))
    ops = []
    n = draw(st.integers(2, max_ops))
    gate = draw(st.integers(0, n))             # where a record -> wait goes (n: none)
    for i in range(n):
        stream = draw(st.sampled_from(STREAMS))
        kind = draw(st.sampled_from(["copy", "copy", "read", "write"]))
        if kind == "copy":
            op = draw(copy_op(stream))
            op["args"]["src_indices"] = op["args"]["src_indices"][:3]
            op["args"]["dst_indices"] = op["args"]["dst_indices"][:3]
        else:
            op = {"op": kind, "stream": stream, "buffer": draw(st.sampled_from(["D", "D2"])),
                  "layer": draw(st.integers(0, 1)), "units": draw(idx_sets)[:3]}
            if kind == "write":
                op["owner"] = 100 + i
        op["id"] = f"o{i}"
        ops.append(op)
        if i == gate:
            ops.append({"id": f"rec{i}", "op": "record", "stream": stream, "event": "e0"})
            ops.append({"id": f"wait{i}", "op": "wait", "stream": draw(st.sampled_from(STREAMS)), "event": "e0"})
    return {"kvrace_schedule": 1, "name": "racy", "buffers": base_buffers(unit), "streams": STREAMS,
            "events": ["e0"], "ops": ops}


def _outcomes_match(doc, chunk: int) -> None:
    s = validate(doc)
    ex = Explorer(s, chunk, witnesses=False)
    m = ex.model
    reduced = ex.exhaustive(max_orders=TRACE_LIMIT)
    if not reduced.complete:
        return      # two long racing copies cut fine can have 2**n traces: nothing to compare with
    brute = ex.exhaustive(max_orders=BRUTE_LIMIT, reduction=False)
    keys = {o.key for o in reduced.outcomes}
    # every outcome of every interleaving is one the reduction found ...
    assert {o.key for o in brute.outcomes} <= keys
    if brute.complete:
        # ... and with every interleaving explored, the same set, one trace per class
        assert {o.key for o in brute.outcomes} == keys
        classes = {orientation_of(m, order) for order in linearizations(m)}
        assert len(classes) == reduced.orders == sum(1 for _ in traces(m))


@FAST
@given(schedules(max_ops=7))
def test_reduction_gives_the_outcomes_of_every_interleaving(doc):
    _outcomes_match(doc, 0)


@FAST
@given(racy_schedules(), st.sampled_from([0, 256]))
def test_reduction_gives_the_outcomes_of_every_interleaving_of_racy_schedules(doc, chunk):
    _outcomes_match(doc, chunk)


@FAST
@given(rich_schedules(max_ops=5), st.sampled_from([0, 256, 4096]))
def test_reduction_gives_the_outcomes_of_every_interleaving_with_chunks(doc, chunk):
    _outcomes_match(doc, chunk)


@pytest.mark.slow
@DEEP
@given(st.one_of(rich_schedules(max_ops=7), racy_schedules(max_ops=6)), st.sampled_from([0, 256, 1024, 4096]))
def test_reduction_gives_the_outcomes_of_every_interleaving_deep(doc, chunk):
    _outcomes_match(doc, chunk)


def _witnesses_reproduce(doc, chunk: int, seed: int, jitter: float) -> None:
    s = validate(doc)
    res = Explorer(s, chunk).exhaustive(max_orders=60)
    prof = profile(launch_jitter_us=jitter)
    for o in res.outcomes:
        if o.witness is None:
            # only a tear inside an item, or an order the host ops forbid to move, has none
            assert "inside item" in o.witness_reason or "cannot be forced" in o.witness_reason \
                or "host" in o.witness_reason, o.witness_reason
            continue
        ws = validate(o.witness)
        run = run_schedule(ws, prof, seed=seed, ties=TieBreak("seeded", seed=seed))
        assert {r.op_id: read_digest(r) for r in run.reads} == {s.ops[i].id: d for i, d in o.key[0]}
        assert tuple((n, run.memory.compact[n].provenance_digest()) for n in sorted(run.memory.compact)) == o.key[1]


@FAST
@given(racy_schedules(), st.integers(0, 1000), st.sampled_from([0.0, 5.0]))
def test_every_witness_forced_on_the_executor_reproduces_its_outcome(doc, seed, jitter):
    _witnesses_reproduce(doc, 0, seed, jitter)


@pytest.mark.slow
@DEEP
@given(st.one_of(rich_schedules(max_ops=8), racy_schedules(max_ops=6)), st.sampled_from([0, 4096]),
       st.integers(0, 1000), st.sampled_from([0.0, 5.0]))
def test_every_witness_reproduces_its_outcome_deep(doc, chunk, seed, jitter):
    _witnesses_reproduce(doc, chunk, seed, jitter)


@FAST
@given(schedules(max_ops=8, synchronised=True))
def test_a_race_free_schedule_has_one_clean_outcome(doc):
    res = Explorer(validate(doc)).exhaustive()
    assert res.orders == 1 and len(res.outcomes) == 1 and not res.corrupt
