"""Traces of GPU replays (``kvrace replay --trace``), without a GPU.

The measured timeline is built from a replay report: the committed H200 reports in
``results/`` (controlled replays of three examples) and reports made here through the numpy
stand-in runner of ``tests/test_gpu_replay_cpu.py``, given made-up CUDA-event times.
"""
from __future__ import annotations

import argparse
import json

import pytest

from gpu_backend.replay import cli_replay, replay, replay_timelines, replay_trace
from gpu_backend.runner import GpuRun
from sim.errors import InputError
from sim.schedule import load, validate
from sim.trace import TIMED_KINDS, combined_trace, measured_timeline
from tests.helpers import profile
from tests.test_gpu_replay_cpu import NumpyRunner
from tests.test_trace import _perfetto_bindings

P = profile()
#: committed H200 reports of examples whose generators a test keeps byte-identical (the engine window's
#: example is regenerated as the engine grows, so its committed replay is of an earlier file)
COMMITTED = [("examples/window_load_back_race.json", "results/window/window_builtin.json"),
             ("examples/hicache_load_back_session.json", "results/hicache_session/session_sglang.json"),
             ("examples/hicache_load_back_session.json", "results/hicache_session/session_torch.json")]


class TimedNumpyRunner(NumpyRunner):
    """The numpy stand-in, giving each timed op of its run made-up times: ops run one after
    another in issue order, each 2 us long, 1 us apart."""

    def run(self, *, timings=False, final=True, guards=True) -> GpuRun:
        gpu = super().run(timings=timings, final=final, guards=guards)
        if timings:
            timed = [op for op in self.s.ops if op.stream is not None and op.op in TIMED_KINDS]
            gpu.timings_us = {op.id: (3.0 * k + 1.0, 3.0 * k + 3.0) for k, op in enumerate(timed)}
        return gpu


def timed_runner(schedule, provider, *, guard_bytes=None):
    return TimedNumpyRunner(schedule, provider, guard_bytes=guard_bytes)


def _processes(trace):
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}


def _check_flows(trace):
    """Every flow id has one start and one end, each bound (Perfetto's rule) to its record and its wait."""
    bound = _perfetto_bindings(trace)
    flows = {}
    for e in trace["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], {})[e["ph"]] = e
    for k, pair in flows.items():
        assert set(pair) == {"s", "f"}, k
        assert bound[("s", k)] == pair["s"]["args"]["from"] and bound[("f", k)] == pair["f"]["args"]["to"]
        assert pair["s"]["ts"] <= pair["f"]["ts"]
    return flows


# ---------------------------------------------------------------- measured_timeline

def _two_streams():
    return validate({"kvrace_schedule": 2, "name": "two", "buffers": [
        {"name": "H", "location": "host", "layout": {"kind": "host", "layout": "layer_first", "layers": 1,
                                                       "units": 4, "unit_bytes": 64}},
        {"name": "D", "location": "device", "layout": {"kind": "paged", "name": "kv", "layers": 1, "pages": 4,
                                                         "page_bytes": 64, "entries_per_page": 1}}],
        "streams": ["load", "forward"], "events": ["done"],
        "ops": [{"id": "cp", "op": "copy", "stream": "load", "routine": "kernel_per_layer", "src": "H", "dst": "D",
                 "args": {"layer": 0, "src_indices": [0, 1], "dst_indices": [0, 1]}},
                {"id": "rec", "op": "record", "stream": "load", "event": "done"},
                {"id": "spin", "op": "compute", "stream": "forward", "duration_us": 2.0},
                {"id": "w", "op": "wait", "stream": "forward", "event": "done"},
                {"id": "rd", "op": "read", "stream": "forward", "buffer": "D", "layer": 0, "units": [0, 1]}]})


def test_measured_timeline_slices_inferred_events_and_marks():
    s = _two_streams()
    tl = measured_timeline(s, {"cp": (1.0, 9.0), "spin": (0.5, 2.5), "rd": (9.5, 10.0)},
                           {"rd": ("clean", "clean read rd")}, source="GPU X")
    by = {sl.op: sl for sl in tl.slices}
    assert (by["cp"].start_us, by["cp"].end_us) == (1.0, 9.0) and by["cp"].args["measured"]
    assert by["cp"].args["items"] == 2 and by["rd"].args["bytes"] == 128
    # the record completes when the copy before it ends; the wait holds the forward stream from the
    # end of the compute until then; the read starts after
    assert (by["rec"].start_us, by["rec"].end_us) == (9.0, 9.0) and by["rec"].args["inferred"]
    assert (by["w"].start_us, by["w"].end_us) == (2.5, 9.0) and by["w"].args["inferred"]
    assert [(e.src_op, e.dst_op, e.src_us, e.dst_us) for e in tl.edges] == [("rec", "w", 9.0, 9.0)]
    assert [(m.kind, m.op, m.time_us) for m in tl.marks] == [("clean", "rd", 9.5)]
    assert tl.lanes == ["stream:load", "stream:forward"] and tl.end_us == 10.0 and tl.profile == "GPU X"
    assert tl.landings == [] and tl.clock == "measured"


def test_measured_wait_is_clipped_to_the_next_timed_op():
    """CUDA-event times are not exact: a wait never ends after the op it held has started."""
    s = _two_streams()
    tl = measured_timeline(s, {"cp": (1.0, 9.0), "spin": (0.5, 2.5), "rd": (8.8, 10.0)})
    w = next(sl for sl in tl.slices if sl.op == "w")
    assert w.end_us == 8.8 and tl.edges[0].dst_us == 8.8


def test_measured_timeline_refuses_timings_of_unknown_ops():
    with pytest.raises(ValueError, match="nope"):
        measured_timeline(_two_streams(), {"nope": (0.0, 1.0)})


def test_combined_trace_keeps_parts_apart():
    s = _two_streams()
    a = measured_timeline(s, {"cp": (1.0, 9.0), "spin": (0.5, 2.5), "rd": (9.5, 10.0)})
    b = measured_timeline(s, {"cp": (2.0, 5.0), "spin": (0.5, 1.5), "rd": (6.0, 7.0)})
    trace = combined_trace([("first", a), ("second", b)])
    json.dumps(trace)
    assert _processes(trace) == {1: "first: hosts", 2: "first: device", 3: "second: hosts", 4: "second: device"}
    flows = _check_flows(trace)
    assert sorted(flows) == [1, 2]                              # one arrow per part, distinct ids
    assert {flows[1]["s"]["pid"], flows[2]["s"]["pid"]} == {2, 4}
    stamps = [e["ts"] for e in trace["traceEvents"] if "ts" in e]
    assert stamps == sorted(stamps)


# ---------------------------------------------------------------- from committed H200 reports

@pytest.mark.parametrize("example, result", COMMITTED, ids=lambda p: p.split("/")[-1])
def test_committed_replay_reports_draw_simulated_and_measured(example, result):
    s = load(example)
    rep = json.load(open(result))
    trace = replay_trace(s, rep)
    json.dumps(trace)
    procs = _processes(trace)
    assert procs[2].startswith("simulated (h200, seed 0, item-atomic")
    assert procs[4] == f"measured on NVIDIA H200 ({rep['provider']}, controlled): device"
    # every op the GPU timed is a slice of the measured device process, at the measured times
    measured = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 4}
    assert set(rep["timings_us"]) <= set(measured)
    for op, (t0, t1) in rep["timings_us"].items():
        assert measured[op]["ts"] == t0 and measured[op]["ts"] + measured[op]["dur"] == pytest.approx(t1)
    # each read is marked on both sides: the simulator's status, and the GPU's (equal bytes)
    marks = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    for r in rep["reads"]:
        sim = [m for m in marks if m["pid"] == 2 and m["args"]["op"] == r["op"]]
        gpu = [m for m in marks if m["pid"] == 4 and m["args"]["op"] == r["op"]]
        if sim:                                                  # clean reads carry no marker
            assert gpu and gpu[0]["cat"] == sim[0]["cat"] and "GPU bytes equal the prediction" in gpu[0]["name"]
        else:
            assert not gpu
    assert any(m["cat"] == "stale" for m in marks if m["pid"] == 4)   # each example's race, reproduced
    _check_flows(trace)


def test_committed_report_errors():
    s = load("examples/window_load_back_race.json")
    rep = json.load(open("results/window/window_builtin.json"))
    with pytest.raises(InputError, match="another digest"):
        replay_timelines(load("examples/index_k_ungated_race.json"), rep)
    bad = dict(rep, timings_us={"no_such_op": [0.0, 1.0]})
    with pytest.raises(InputError, match="no_such_op.*profile and seed of the replay"):
        replay_timelines(s, bad)
    with pytest.raises(InputError, match="no timed run"):
        replay_timelines(s, dict(rep, mode="free"))
    with pytest.raises(InputError, match="kvrace replay report"):
        replay_timelines(s, {"mode": "controlled"})


# ---------------------------------------------------------------- through replay() and the CLI

def test_controlled_replay_trace_through_the_numpy_runner():
    s = load("examples/index_k_ungated_race.json")
    rep = replay(s, "builtin", "controlled", profile=P, make_runner=timed_runner)
    assert rep["ok"] and rep["seed"] == 0
    (sim_label, sim), (gpu_label, gpu) = replay_timelines(s, rep, profile=P)
    assert "item-atomic" in sim_label and gpu_label.startswith("measured on numpy stand-in")
    assert {sl.op for sl in gpu.slices if not sl.args.get("inferred")} == set(rep["timings_us"])
    stale = [m for m in gpu.marks if m.op == "indexer_read_index_k_L0"]
    assert [m.kind for m in stale] == ["stale"]


def test_a_mismatching_read_is_marked_mismatch():
    s = load("examples/index_k_ungated_race.json")

    def garbage(schedule, provider, *, guard_bytes=None):
        return TimedNumpyRunner(schedule, provider, guard_bytes=guard_bytes, garbage=True)
    rep = replay(s, "builtin", "controlled", profile=P, make_runner=garbage)
    assert not rep["ok"]
    _, (_, gpu) = replay_timelines(s, rep, profile=P)
    (m,) = gpu.marks
    assert m.kind == "mismatch" and "bytes differ from the prediction" in m.text


def test_free_replay_keeps_a_timed_run_only_when_asked():
    s = load("examples/index_k_ungated_race.json")
    rep = replay(s, "builtin", "free", profile=P, trials=2, sim_seeds=0, make_runner=timed_runner)
    assert "timed_run" not in rep
    rep = replay(s, "builtin", "free", profile=P, trials=2, sim_seeds=0, make_runner=timed_runner, timeline=True)
    assert rep["trials"] == 2 and set(rep["timed_run"]["reads"]) == {"indexer_read_index_k_L0"}
    # the numpy runner runs ops in issue order: the happens-before order's bytes, clean
    assert rep["timed_run"]["reads"]["indexer_read_index_k_L0"] == "clean"
    trace = replay_trace(s, rep, profile=P)
    assert _processes(trace)[4] == "measured on numpy stand-in (builtin, free): device"
    _check_flows(trace)


def test_cli_replay_trace(tmp_path, capsys):
    out = tmp_path / "t.json"
    args = argparse.Namespace(file="examples/index_k_ungated_race.json", provider="builtin", mode="controlled",
                              trials=2, profile="h200", seed=0, json=None, trace=str(out))
    assert cli_replay(args, make_runner=timed_runner) == 0
    trace = json.loads(out.read_text())
    assert set(_processes(trace).values()) >= {"measured on numpy stand-in (builtin, controlled): device"}
    assert any(e["ph"] == "i" and e["cat"] == "stale" and e["pid"] == 4 for e in trace["traceEvents"])
    args.mode, args.trace = "free", str(tmp_path / "f.json")
    assert cli_replay(args, make_runner=timed_runner) == 0
    assert json.loads((tmp_path / "f.json").read_text())["otherData"]["parts"][1]["schedule"].endswith("(free replay)")
    args.trace = str(tmp_path / "no_such_dir" / "t.json")
    with pytest.raises(InputError, match="--trace"):
        cli_replay(args, make_runner=timed_runner)
    capsys.readouterr()


def test_the_replay_command_takes_trace():
    """What kvrace/cli.py registers on `replay`: add_trace_option, the same option as `schedule run`."""
    from kvrace.sweep_cli import add_trace_option

    p = argparse.ArgumentParser()
    add_trace_option(p)
    assert p.parse_args(["--trace", "x.json"]).trace == "x.json"
