"""Timelines and their Chrome trace-event JSON (what `schedule run --trace` writes for Perfetto)."""
from __future__ import annotations

import json

import pytest

from sim.executor import run_schedule
from sim.profile import load_profile
from sim.schedule import load, validate
from sim.trace import DEVICE_PID, HOSTS_PID, chrome_trace, timeline
from sim.verdicts import analyse

H200 = load_profile("h200")


def _trace(schedule):
    run = run_schedule(schedule, H200)
    rep = analyse(run)
    return run, rep, chrome_trace(timeline(run, rep))


def _with_host_sync():
    """The ungated example with the host synchronising on the layer event before the read."""
    doc = json.load(open("examples/index_k_ungated_race.json"))
    ops = doc["ops"]
    at = next(i for i, op in enumerate(ops) if op.get("id") == "indexer_q_proj")
    ops.insert(at, {"id": "host_waits_L0", "op": "host_sync", "event": "layer0_loaded"})
    return validate(doc)


def _names(trace):
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    return threads, procs


def _perfetto_bindings(trace):
    """Which slice each flow event binds to, by Perfetto's rules for JSON flow v1: events are
    taken in time order; a thread's slice leaves its stack when a later slice starts at or
    after its end; "s" and "f" (bp "e") bind to the slice on top of their thread's stack."""
    stacks: dict = {}
    bound = {}
    for e in trace["traceEvents"]:
        if e["ph"] in ("X", "i"):
            stack = stacks.setdefault((e["pid"], e["tid"]), [])
            while stack and stack[-1][1] <= e["ts"]:
                stack.pop()
            stack.append((e["name"], e["ts"] + e.get("dur", 0.0)))
        elif e["ph"] in ("s", "f"):
            stack = stacks.get((e["pid"], e["tid"]), [])
            bound[(e["ph"], e["id"])] = stack[-1][0] if stack else None
    return bound


def test_tracks_slices_and_markers_of_the_minimal_race():
    run, rep, trace = _trace(load("examples/index_k_ungated_race.json"))
    json.dumps(trace)                                             # serialisable as it is
    threads, procs = _names(trace)
    assert procs == {HOSTS_PID: "hosts", DEVICE_PID: "device"}
    assert sorted(threads.values()) == ["host host", "stream forward", "stream load"]
    track = {name: key for key, name in threads.items()}
    events = trace["traceEvents"]
    slices = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(slices) == set(run.timings)                        # a slice per op
    for op_id, (t0, t1) in run.timings.items():
        assert slices[op_id]["ts"] == t0 and slices[op_id]["dur"] == pytest.approx(t1 - t0)
    assert (slices["load_index_k_L0"]["pid"], slices["load_index_k_L0"]["tid"]) == track["stream load"]
    assert slices["load_index_k_L0"]["args"]["items"] == 4
    # the stale read and the latent race, marked on the reader's track when it touched the bytes
    instants = [e for e in events if e["ph"] == "i"]
    assert {e["cat"] for e in instants} == {"stale", "race"}
    for e in instants:
        assert e["s"] == "t" and (e["pid"], e["tid"]) == track["stream forward"]
        assert e["ts"] == pytest.approx(run.access_us["indexer_read_index_k_L0"])
    race = next(e for e in instants if e["cat"] == "race")
    assert race["args"]["ops"] == ["load_index_k_L0", "indexer_read_index_k_L0"]
    # items landing: a counter that climbs to every item
    counter = [e for e in events if e["ph"] == "C"]
    assert counter[0]["args"]["items"] == 0 and counter[-1]["args"]["items"] == 4
    assert counter[-1]["ts"] == pytest.approx(run.timings["load_index_k_L0"][1])
    timed = [e for e in events if e["ph"] != "M"]
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)


def test_flows_go_from_each_record_to_its_wait_and_bind_to_them():
    for s in (load("examples/index_k_gated.json"), load("examples/index_k_ungated_race.json"), _with_host_sync()):
        run, rep, trace = _trace(s)
        events = trace["traceEvents"]
        starts = {e["id"]: e for e in events if e["ph"] == "s"}
        ends = {e["id"]: e for e in events if e["ph"] == "f"}
        assert set(starts) == set(ends) and starts
        expected = {(s.ops[op.bound_record].id, op.id) for op in s.ops
                    if op.op in ("wait", "host_sync") and op.bound_record is not None}
        assert {(e["args"]["from"], e["args"]["to"]) for e in starts.values()} == expected
        bound = _perfetto_bindings(trace)
        for k, e in starts.items():
            assert ends[k]["bp"] == "e" and ends[k]["ts"] >= e["ts"]
            assert bound[("s", k)] == e["args"]["from"] and bound[("f", k)] == e["args"]["to"]


def test_host_sync_edge_lands_on_the_host_track():
    run, rep, trace = _trace(_with_host_sync())
    threads, _ = _names(trace)
    end = next(e for e in trace["traceEvents"] if e["ph"] == "f" and e["args"]["to"] == "host_waits_L0")
    assert threads[(end["pid"], end["tid"])] == "host host" and end["name"] == "record->host_sync"
    assert end["ts"] == pytest.approx(run.timings["complete_L0"][1])
    assert rep["corrupt_reads"] == 0           # the host sync orders the read after the load


def test_torn_read_is_marked_torn():
    run, rep, trace = _trace(load("examples/index_k_torn_read.json"))
    assert rep["torn_reads"] == 1
    assert any(e["ph"] == "i" and e["cat"] == "torn" and e["name"].startswith("TORN read") for e in trace["traceEvents"])


def test_gated_run_has_no_markers():
    _, _, trace = _trace(load("examples/index_k_gated.json"))
    assert not [e for e in trace["traceEvents"] if e["ph"] == "i"]


def test_timeline_model():
    run, rep, _ = _trace(load("examples/index_k_ungated_race.json"))
    tl = timeline(run, rep)
    assert tl.lanes == ["host:host", "stream:forward", "stream:load"]
    assert [m.kind for m in tl.marks] == ["stale", "race"]
    (ld,) = tl.landings
    assert ld.items == 4 and ld.counts[-1] == 4 and ld.times_us[-1] == pytest.approx(run.end_us)
    assert [(e.src_op, e.kind) for e in tl.edges] == [("start_event", "record->wait")]


def test_cli_trace_option(tmp_path):
    from kvrace.cli import main

    path = tmp_path / "t.json"
    assert main(["schedule", "run", "examples/index_k_ungated_race.json", "--fail-on", "none",
                 "--trace", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["otherData"]["schedule"] == "index_k_ungated_race"
    assert any(e["ph"] == "i" and e["cat"] == "stale" for e in doc["traceEvents"])
    assert main(["schedule", "run", "examples/index_k_gated.json", "--trace", "-"]) == 2
    assert main(["schedule", "run", "examples/index_k_gated.json", "--trace", str(tmp_path / "no" / "t.json")]) == 2
