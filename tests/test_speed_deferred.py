"""The run's memory deferred while nothing has raced (``Executor.DEFER_RUN_MEMORY``,
``sim.deferred``): a program run with streamed verdicts keeps the ops not landed instead of
applying every landing, and builds its memory from the reference when something needs it.
Both ways give the same run: on random host programs (the report, every read's views and
expected views, the final memory), with the memory built at any read (its contents equal the
eager run's at that instant), and on engine runs with and without races."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.executor import Executor
from sim.schedule import ScheduleBuilder
from tests.helpers import both_ways, profile
from tests.strategies import EVENTS, STREAMS, base_buffers
from tests.test_host_programs_property import HOSTS, program, step

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _contents(mem) -> dict:
    return {name: [a.tolist() for a in buf.coalesced_segments()] for name, buf in sorted(mem.compact.items())}


def _views(views) -> list:
    return [(v.offset, v.compact.nbytes, [a.tolist() for a in v.compact.coalesced_segments()]) for v in views]


def _programs_run(a, b, n_barriers, seed, build_at):
    """Two host programs streamed; at the ``build_at``-th read (None: never) the run's memory
    is asked for.  Returns (report, reads seen, memory asked for, final memory, [whether the
    run started deferred])."""
    doc = {"kvrace_schedule": 2, "name": "programs", "hosts": HOSTS, "buffers": base_buffers(),
           "streams": STREAMS, "events": EVENTS, "ops": []}
    builder = ScheduleBuilder(doc, max_ops=None, keep_ops=False)
    ex = Executor(builder.buffers, builder.streams, P, builder=builder, keep="report", hosts=builder.hosts,
                  seed=seed, materialise=False)
    seen, asked = [], []

    def sink(cap, expected, entry):
        seen.append((entry, _views(cap.views), _views(expected)))
        if len(seen) == build_at:
            asked.append(_contents(ex.run_memory()))

    ex.online.on_read(sink)
    deferred = [ex._deferred is not None]
    run = ex.run({"h0": program(a, n_barriers), "h1": program(b, n_barriers)})
    rep = run.online.report(run)
    rep.pop("wall_s", None)
    return rep, seen, asked, _contents(run.memory), deferred


@SETTINGS
@given(st.lists(step, max_size=10), st.lists(step, max_size=10), st.integers(0, 2), st.integers(0, 3),
       st.one_of(st.none(), st.integers(1, 6)))
def test_deferred_run_memory_gives_the_same_run_on_random_host_programs(a, b, n_barriers, seed, build_at):
    deferred, eager = both_ways(Executor, "DEFER_RUN_MEMORY", _programs_run, a, b, n_barriers, seed, build_at)
    assert deferred[4] == [True] and eager[4] == [False]
    assert deferred[0] == eager[0]
    assert deferred[1] == eager[1]
    assert deferred[2] == eager[2]          # the memory built at a read equals the eager one then
    assert deferred[3] == eager[3]


def _engine(name: str, sets: list):
    e = PrefillEngine(load_scenario(name, sets), 0, keep="report")
    ex = e.session._ex
    built = []
    orig = ex._materialise

    def spy():
        if ex._deferred is not None:
            built.append(ex.env.now)
        orig()
    ex._materialise = spy
    r = dataclasses.asdict(e.run())
    r.pop("wall_time_s")
    return r, built, e.session.env.now


@pytest.mark.parametrize("name, sets, races", [
    ("incident-repro", ["run.duration_s=2"], False),                                     # wrong KV, no race
    ("incident-short", ["run.layers=4", "run.duration_s=2", "deployment.simulated_ranks=2"], False),
    ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10"], True),     # stale index-K reads
])
def test_deferred_run_memory_gives_the_same_engine_run(name, sets, races):
    (deferred, built, end), (eager, built_eager, _) = both_ways(Executor, "DEFER_RUN_MEMORY", _engine, name, sets)
    assert deferred == eager
    assert not built_eager and len(built) == 1
    # built at the run's end when nothing raced, at the first race otherwise
    assert (built[0] < end) == races == (deferred["latent_races"] > 0)


def _built_mid_copy(at_us: float, then_write: bool):
    """A host program: a copy of 256 items host -> device, a write of other device units
    on another stream, and the run's memory built ``at_us`` after the copy's issue (the
    landed items applied first, as ``CacheSession.memory`` does).  Returns that memory, the
    items landed then, the final memory and the report."""
    ub, n = 1 << 16, 256
    host = {"kind": "host", "layout": "layer_first", "layers": 1, "units": 2 * n, "unit_bytes": ub}
    dev = {"kind": "paged", "layers": 1, "pages": 2 * n, "page_bytes": ub}
    doc = {"kvrace_schedule": 2, "name": "mid", "events": ["e"], "hosts": ["h0"], "ops": [],
           "buffers": [{"name": "h", "location": "host", "kind": "kv", "layout": host},
                       {"name": "g", "location": "device", "device": 0, "kind": "kv", "layout": dev}],
           "streams": [{"name": "a", "device": 0}, {"name": "b", "device": 0}]}
    builder = ScheduleBuilder(doc, max_ops=None, keep_ops=False)
    ex = Executor(builder.buffers, builder.streams, P, builder=builder, keep="report", hosts=builder.hosts,
                  materialise=False)
    got = {}

    def prog(h):
        h.issue({"op": "write", "stream": "a", "buffer": "h", "layer": 0, "units": list(range(n, 2 * n)), "owner": 3})
        yield h.synchronize(stream="a")
        h.issue({"op": "copy", "stream": "b", "routine": "kernel_per_layer", "src": "h", "dst": "g",
                 "args": {"layer": 0, "src_indices": list(range(n, 2 * n)), "dst_indices": list(range(n))[::-1]}})
        if then_write:
            h.issue({"op": "write", "stream": "a", "buffer": "g", "layer": 0, "units": [n + 5, n + 6], "owner": 4})
        yield h.delay(at_us)
        ex._advance(ex.env.now)
        got["landed"] = [cp.applied for cp in ex.active]
        got["memory"] = _contents(ex.run_memory())

    run = ex.run({"h0": prog})
    rep = run.online.report(run)
    rep.pop("wall_s", None)
    return got, _contents(run.memory), rep


@pytest.mark.parametrize("then_write", [False, True])
def test_the_memory_built_while_a_copy_is_part_way_holds_its_landed_items(then_write):
    """Built while some of a copy's items have landed (and, with ``then_write``, a later write
    of other units has been applied), the run's memory holds exactly those items, as the eager
    run's does then; both runs end the same."""
    part_way = 0
    for at_us in (40.0, 120.0, 160.0, 200.0, 240.0, 280.0):
        deferred, eager = both_ways(Executor, "DEFER_RUN_MEMORY", _built_mid_copy, at_us, then_write)
        assert deferred == eager
        part_way += any(0 < n < 256 for n in deferred[0]["landed"])
    assert part_way, "the memory was never built with a copy part-way"


def test_memory_held_does_not_build_the_runs_memory_and_memory_does():
    """Stepping an engine run where nothing races: ``memory_held`` is the reference while the
    run's memory is deferred (sampling it builds nothing); ``memory`` builds the run's (the
    same contents then) and ends the deferral; the run ends as a plain run does."""
    sets = ["run.duration_s=2"]
    e = PrefillEngine(load_scenario("incident-repro", sets), 0, keep="report")
    ex = e.session._ex
    e.start()
    for _ in range(12):
        assert e.step()
    assert ex._deferred is not None
    held = e.session.memory_held
    assert held is ex.online.ref and ex._deferred is not None
    for _ in range(3):
        assert e.step()
    assert ex._deferred is not None
    built = e.session.memory
    assert ex._deferred is None and e.session.memory_held is built is ex.mem and built is not held
    while e.step():
        pass
    r = dataclasses.asdict(e.finish())
    r.pop("wall_time_s")
    plain = dataclasses.asdict(PrefillEngine(load_scenario("incident-repro", sets), 0, keep="report").run())
    plain.pop("wall_time_s")
    assert r == plain


def test_a_copy_within_one_buffer_builds_the_memory_when_issued():
    """A copy whose source is its destination reads what its earlier items wrote as they land
    (``sim.deferred``): the run's memory is built when it is issued, and both ways give the
    same run."""
    steps = [("issue", {"op": "write", "stream": STREAMS[0], "buffer": "D", "layer": 0, "units": [0, 1, 2, 3],
                        "owner": 101}),
             ("issue", {"op": "copy", "stream": STREAMS[1], "routine": "kernel_per_layer", "src": "D", "dst": "D",
                        "args": {"layer": 0, "src_indices": [0, 1, 2], "dst_indices": [1, 2, 3]}}),
             ("delay", 40.0),
             ("issue", {"op": "read", "stream": STREAMS[1], "buffer": "D", "layer": 0, "units": [0, 1, 2, 3]})]
    built = []

    def run():
        orig = Executor._materialise

        def spy(self):
            if self._deferred is not None:
                built.append(self.env.now)
            orig(self)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Executor, "_materialise", spy)
            return _programs_run(steps, [], 0, 0, None)

    deferred, eager = both_ways(Executor, "DEFER_RUN_MEMORY", run)
    assert deferred[0] == eager[0] and deferred[1] == eager[1] and deferred[3] == eager[3]
    assert built == [0.0]                # at the copy's issue, not at the end
