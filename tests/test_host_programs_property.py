"""Property: random host programs that branch on query outcomes, run online, recorded,
then re-run statically from the recorded document, give the same Snapshot and the same
verdicts (the online-executor issue, item 3)."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import run_programs, run_schedule
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.verdicts import analyse
from tests.helpers import profile
from tests.strategies import EVENTS, STREAMS, base_buffers, copy_op, idx_sets, LAYERS

P = profile(jitter_frac=0.1)       # jitter on: the re-run must draw the same numbers in the same order
HOSTS = ["h0", "h1"]


@st.composite
def stream_op(draw):
    stream = draw(st.sampled_from(STREAMS))
    kind = draw(st.sampled_from(["copy", "read", "write", "compute", "record", "wait"]))
    if kind == "copy":
        return draw(copy_op(stream))
    if kind in ("read", "write"):
        op = {"op": kind, "stream": stream, "buffer": draw(st.sampled_from(["D", "D2"])),
              "layer": draw(st.integers(0, LAYERS - 1)), "units": draw(idx_sets)}
        if kind == "write":
            op["owner"] = draw(st.integers(100, 120))
        return op
    if kind == "compute":
        return {"op": "compute", "stream": stream, "duration_us": draw(st.sampled_from([0.0, 0.5, 3.0, 20.0]))}
    return {"op": kind, "stream": stream, "event": draw(st.sampled_from(EVENTS))}


# a step: ("issue", op) | ("delay", us) | ("branch", event, ops if complete, ops if not)
#         | ("poll", event, at most n polls) | ("sync", event or stream) | ("barrier",)
step = st.one_of(
    st.tuples(st.just("issue"), stream_op()),
    st.tuples(st.just("delay"), st.sampled_from([0.0, 1.0, 7.5, 40.0])),
    st.tuples(st.just("branch"), st.sampled_from(EVENTS), st.lists(stream_op(), max_size=2),
              st.lists(stream_op(), max_size=2)),
    st.tuples(st.just("poll"), st.sampled_from(EVENTS), st.integers(1, 6)),
    st.tuples(st.just("sync"), st.sampled_from(EVENTS + [f"stream:{s}" for s in STREAMS])),
    st.tuples(st.just("barrier")),
)


def program(steps, n_barriers):
    def prog(h):
        done_barriers = 0
        for s in steps:
            if s[0] == "issue":
                h.issue(s[1])
            elif s[0] == "delay":
                yield h.delay(s[1])
            elif s[0] == "branch":
                for op in (s[2] if h.query(s[1]) else s[3]):
                    h.issue(op)
            elif s[0] == "poll":
                for _ in range(s[2]):
                    if h.query(s[1]):
                        break
                    yield h.delay(2.0)
            elif s[0] == "sync":
                target = s[1]
                yield (h.synchronize(stream=target[7:]) if target.startswith("stream:")
                       else h.synchronize(event=target))
            elif done_barriers < n_barriers:
                yield h.barrier("step", HOSTS)
                done_barriers += 1
        while done_barriers < n_barriers:      # both hosts reach every barrier instance
            yield h.barrier("step", HOSTS)
            done_barriers += 1
        yield h.delay(0.0)
    return prog


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=10), st.lists(step, max_size=10), st.integers(0, 2), st.integers(0, 3))
def test_recorded_host_programs_rerun_statically_to_the_same_snapshot_and_verdicts(a, b, n_barriers, seed):
    header = {"kvrace_schedule": 2, "name": "programs", "hosts": HOSTS, "buffers": base_buffers(),
              "streams": STREAMS, "events": EVENTS}
    run = run_programs(header, {"h0": program(a, n_barriers), "h1": program(b, n_barriers)}, P, seed=seed)
    doc = json.loads(json.dumps(run.recorded))
    again = run_schedule(validate(doc), P, seed=seed)
    sa, sb = snapshot_of(run), snapshot_of(again)
    assert sa.schedule_digest == sb.schedule_digest
    assert sa.buffers == sb.buffers and sa.timings_us == sb.timings_us
    assert sa.reads.keys() == sb.reads.keys()
    assert all((sa.reads[k] == sb.reads[k]).all() for k in sa.reads)
    ra, rb = analyse(run), analyse(again)
    for key in ("reads", "latent_races", "latent_races_total", "intra_launch_races", "unbound_waits",
                "oob_writes", "tie_orders"):
        assert ra[key] == rb[key], key
    # every query outcome the programs saw is in the record
    outcomes = [d["outcome"] for d in doc["ops"] if d["op"] == "host_query"]
    assert all(isinstance(o, bool) for o in outcomes)
