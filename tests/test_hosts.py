"""Host programs on the online executor: issue while time runs, several hosts, runs
recorded as schedules (CUDA semantics for waits, queries and host syncs).

Expected times and verdicts are derived by hand from CUDA's rules and the test
profile (no jitter), not read back from the executor.
"""
import json

import pytest

from sim.errors import InputError
from sim.executor import run_programs, run_schedule
from sim.hb import HappensBefore
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.verdicts import analyse
from tests.helpers import profile, schedule_doc

P = profile()
UNIT = 64


def header(hosts=("host",), streams=("s0", "s1", "s2"), events=("e0", "e1")):
    doc = schedule_doc([], streams=streams, events=events)
    doc["kvrace_schedule"] = 2
    doc["hosts"] = list(hosts)
    return doc


def load(stream, units, layer=0, id=None):
    d = {"op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": "H", "dst": "D",
         "args": {"layer": layer, "src_indices": list(units), "dst_indices": list(units)}}
    if id:
        d["id"] = id
    return d


def read(stream, units, id, layer=0):
    return {"id": id, "op": "read", "stream": stream, "buffer": "D", "layer": layer, "units": list(units)}


def rerun(run):
    """Validate the recorded document afresh and run it statically."""
    doc = json.loads(json.dumps(run.recorded))       # it is plain JSON
    return run_schedule(validate(doc), P)


def same_run(a, b):
    sa, sb = snapshot_of(a), snapshot_of(b)
    assert sa.schedule_digest == sb.schedule_digest
    assert sa.reads.keys() == sb.reads.keys()
    for k in sa.reads:
        assert (sa.reads[k] == sb.reads[k]).all(), k
    assert sa.buffers == sb.buffers
    assert sa.timings_us == sb.timings_us
    ra, rb = analyse(a), analyse(b)
    for key in ("reads", "latent_races", "oob_writes"):
        assert ra[key] == rb[key], key


def test_a_program_issues_while_time_runs_and_its_run_is_recorded():
    one = P.launch_us + P.item_overhead_us + UNIT / (P.h2d_gbps * 1e3)   # one 64 B item, H2D

    def prog(h):
        h.issue(load("s0", [0], id="ld"))
        h.issue({"op": "record", "stream": "s0", "event": "e0", "id": "rec"})
        polls = 0
        while not h.query("e0"):
            polls += 1
            yield h.delay(1.0)
        # acknowledged: only now does the host issue the read (no wait needed)
        h.issue(read("s1", [0], "rd"))
        assert polls == int(one // 1.0) + (one % 1.0 > 0)

    run = run_programs(header(), {"host": prog}, P)
    assert run.timings["ld"] == pytest.approx((0, one))
    polls = int(one // 1.0) + (one % 1.0 > 0)
    assert run.timings["rd"][0] == pytest.approx(polls * 1.0)
    rep = analyse(run)
    assert rep["reads"][0]["status"] == "ok"
    assert rep["latent_races"] == []          # the positive query orders the copy before the read
    doc = run.recorded
    assert doc["kvrace_schedule"] == 2
    kinds = [d["op"] for d in doc["ops"]]
    assert kinds.count("host_query") == polls + 1
    assert [d["outcome"] for d in doc["ops"] if d["op"] == "host_query"] == [False] * polls + [True]
    same_run(run, rerun(run))


def test_negative_query_orders_nothing():
    def prog(h):
        h.issue(load("s0", [0, 1, 2, 3], id="ld"))
        h.issue({"op": "record", "stream": "s0", "event": "e0"})
        assert h.query("e0") is False
        h.issue(read("s1", [0], "rd"))        # a slot reused without acknowledgement
        yield h.delay(0)

    rep = analyse(run_programs(header(), {"host": prog}, P))
    assert [r["ops"] for r in rep["latent_races"]] == [["ld", "rd"]]
    assert rep["reads"][0]["status"] == "stale"


def test_wait_before_record_is_a_noop_and_a_finding():
    ops = [{"id": "w", "op": "wait", "stream": "s1", "event": "e0"},          # consumer waits too early
           read("s1", [0, 1], "rd"),
           load("s0", [0, 1], id="ld"),
           {"id": "rec", "op": "record", "stream": "s0", "event": "e0"}]
    s = validate(schedule_doc(ops))                    # accepted, as CUDA accepts it
    run = run_schedule(s, P)
    assert run.timings["w"] == (0, 0)
    assert [u["op"] for u in run.unbound] == ["w"]
    rep = analyse(run)
    assert [u["op"] for u in rep["unbound_waits"]] == ["w"]
    assert [r["ops"] for r in rep["latent_races"]] == [["rd", "ld"]]


def test_query_of_a_never_recorded_event_reports_complete():
    def prog(h):
        assert h.query("e1") is True          # cudaEventQuery on an unrecorded event: cudaSuccess
        yield h.delay(0)

    run = run_programs(header(), {"host": prog}, P)
    assert [u["op"] for u in run.unbound] == [run.recorded["ops"][0]["id"]]


def test_issue_validates_each_op_by_the_schedule_rules():
    def prog(h):
        h.issue(load("s0", [0]))
        h.issue({"op": "read", "stream": "s1", "buffer": "nope", "layer": 0, "units": [0], "id": "bad"})
        yield h.delay(0)

    with pytest.raises(InputError, match=r"ops\[1\] \(bad\)\.buffer.*unknown buffer 'nope'"):
        run_programs(header(), {"host": prog}, P)

    def host_op(h):
        h.issue({"op": "host_sync"})
        yield h.delay(0)

    with pytest.raises(InputError, match="synchronize"):
        run_programs(header(), {"host": host_op}, P)


def test_two_hosts_barrier_orders_host_sides():
    # prefill host loads and synchronizes, then both reach a barrier; decode reads after it
    def prefill(h):
        h.issue(load("s0", [0, 1], id="ld"))
        yield h.synchronize(stream="s0")
        yield h.barrier("handoff", ["prefill", "decode"])

    def decode(h):
        yield h.delay(1.0)
        yield h.barrier("handoff", ["prefill", "decode"])
        h.issue(read("s1", [0, 1], "rd"))

    run = run_programs(header(hosts=("prefill", "decode")), {"prefill": prefill, "decode": decode}, P)
    copy_end = run.timings["ld"][1]
    assert run.timings["rd"][0] == pytest.approx(copy_end)
    rep = analyse(run)
    assert rep["latent_races"] == [] and rep["reads"][0]["status"] == "ok"
    doc = run.recorded
    assert {d["host"] for d in doc["ops"]} == {"prefill", "decode"}
    same_run(run, rerun(run))


def test_without_the_barrier_the_hosts_race():
    def prefill(h):
        h.issue(load("s0", [0, 1], id="ld"))
        yield h.synchronize(stream="s0")

    def decode(h):
        yield h.delay(100.0)                  # late enough to read the right bytes, but unordered
        h.issue(read("s1", [0, 1], "rd"))

    rep = analyse(run_programs(header(hosts=("prefill", "decode")), {"prefill": prefill, "decode": decode}, P))
    assert rep["reads"][0]["status"] == "ok"
    assert [r["ops"] for r in rep["latent_races"]] == [["ld", "rd"]]


def test_happens_before_has_a_component_per_host():
    doc = header(hosts=("a", "b"))
    doc["ops"] = [
        {"id": "ld", "host": "a", **{k: v for k, v in load("s0", [0]).items()}},
        {"id": "sync", "host": "a", "op": "host_sync", "stream": "s0"},
        {"id": "ba", "host": "a", "op": "barrier", "barrier": "x", "hosts": ["a", "b"]},
        {"id": "bb", "host": "b", "op": "barrier", "barrier": "x", "hosts": ["a", "b"]},
        {"id": "rd", "host": "b", **read("s1", [0], "rd")},
        {"id": "rd2", "host": "a", **read("s2", [0], "rd2")},
    ]
    s = validate(doc)
    hb = HappensBefore(s)
    ix = {op.id: op.index for op in s.ops}
    assert hb.ordered(ix["ld"], ix["rd"])       # a's sync -> barrier -> b's read
    assert hb.ordered(ix["ld"], ix["rd2"])
    assert not hb.ordered(ix["rd"], ix["rd2"]) and not hb.ordered(ix["rd2"], ix["rd"])
    assert not hb.ordered(ix["ba"], ix["bb"]) and not hb.ordered(ix["bb"], ix["ba"])


def test_barrier_listed_out_of_issue_order_is_refused():
    doc = header(hosts=("a", "b"))
    doc["ops"] = [
        {"id": "ba", "host": "a", "op": "barrier", "barrier": "x", "hosts": ["a", "b"]},
        {"id": "rd2", "host": "a", **read("s2", [0], "rd2")},        # a cannot issue before b arrives
        {"id": "bb", "host": "b", "op": "barrier", "barrier": "x", "hosts": ["a", "b"]},
    ]
    with pytest.raises(InputError, match=r"ops\[1\].*barrier 'x'"):
        validate(doc)
    doc["ops"] = doc["ops"][:1]
    with pytest.raises(InputError, match=r"barrier 'x' is never reached by host\(s\) \['b'\]"):
        validate(doc)


def test_version_1_files_still_load_as_one_host():
    import glob

    paths = [p for p in sorted(glob.glob("examples/*.json"))
             if json.load(open(p))["kvrace_schedule"] == 1]
    assert len(paths) >= 4
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        s = validate(doc)
        assert s.hosts == ("host",) and {op.host for op in s.ops} == {"host"}
        run = run_schedule(s, P)
        same_run(run, rerun(run))
