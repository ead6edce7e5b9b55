"""The byte-level decode side kept whole (``PrefillEngine(keep="all")``: its session's run and
report) gives the streamed side's verdicts, ``kvrace run --export-races`` cuts its raced reads
into windows (``decode_race_K_OP.json``) that rerun as schedules with the read corrupt (the
decode server's overlap-loop race, as a file ``kvrace replay`` takes), and ``--trace`` shows the
decode session beside the prefill's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrace.cli import main
from sim.engine.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.executor import run_schedule
from sim.replay import controlled_schedule
from sim.schedule import load
from sim.verdicts import analyse
from tests.helpers import H200, current_window_read, example_script

#: glm5 (dsa-v3.2) in PD with a byte-level decode side in SGLang's overlap loop, 2 layers, a
#: decode pool small enough that freed pages are reused at once: the committed example's run
EXAMPLE = example_script("make_decode_window")
OVERLAP = EXAMPLE.OVERRIDES


def result(keep: str):
    e = PrefillEngine(load_scenario(EXAMPLE.SCENARIO, OVERLAP), 0, keep=keep)
    return e, e.run()


@pytest.fixture(scope="module")
def kept():
    return result("all")


def test_decode_side_kept_whole_gives_the_streamed_verdicts(kept):
    e, r = kept
    _, streamed = result("report")
    a, b = r.to_dict(), streamed.to_dict()
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a == b
    # the case raced on the decode side: not a comparison of two empty results
    assert r.decode["requests_corrupted"] > 0 and r.decode["stale_reads"] > 0
    assert e.decode.report is not None and e.decode.report["latent_races_total"] == r.decode["latent_races"]
    assert len(e.decode.latent_races()) == r.decode["latent_races"]


def test_overlap_loop_reads_name_their_layer(kept):
    """The overlap loop issues a step layer by layer: each read's entry names that layer."""
    _, r = kept
    for c in r.decode["corrupted_reads"]:
        assert c["op"].split(".")[1] == f"L{c['layer']}"


def test_decode_side_races_are_exported_and_rerun_corrupt(tmp_path, capsys):
    d = tmp_path / "races"
    rc = main(["run", "glm5-22811-small", *[a for kv in OVERLAP for a in ("--set", kv)], "--progress", "never",
               "--export-races", str(d), "--export-limit", "2", "--json", str(tmp_path / "run.json"),
               "--trace", str(tmp_path / "trace.json")])
    doc = json.loads((tmp_path / "run.json").read_text())
    assert rc == 0
    paths = [Path(p) for p in doc["exported_races"]]
    raced = [c["op"] for c in doc["decode"]["corrupted_reads"] if c["status"] in ("stale", "torn")]
    # the prefill side raced nothing here: both windows are the decode side's first raced reads
    assert not [c for c in doc["corrupted_reads"] if c["status"] in ("stale", "torn")]
    assert [p.name for p in paths] == [f"decode_race_{k}_{op}.json" for k, op in enumerate(raced[:2])]
    for p, op in zip(paths, raced):
        window = json.loads(p.read_text())
        assert window["name"] == f"glm5-22811-small_decode_race_{paths.index(p)}"
        assert "decode side" in window["description"] and "the decode step" in window["description"]
        rep = analyse(run_schedule(load(p), H200))
        assert next(e["status"] for e in rep["reads"] if e["op"] == op) in ("stale", "torn")
    out = capsys.readouterr().out
    assert f"exported: {paths[0]}" in out
    # the trace shows both sessions, the decode side's raced read marked in its part
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [p["label"] for p in trace["otherData"]["parts"]] == ["prefill", "decode"]
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(procs.values()) == ["decode: device", "decode: hosts", "prefill: device", "prefill: hosts"]
    decode_pids = {pid for pid, name in procs.items() if name.startswith("decode")}
    assert any(raced[0] in str(e.get("name", "")) and e["pid"] in decode_pids for e in trace["traceEvents"])


def test_committed_decode_window_is_current_and_keeps_the_ride_along_race():
    """examples/decode_overlap_window.json (the GPU suite replays every example): the decode
    step's read sees the finished request's ride-along store where the next request's PD
    transfer landed, both writes unordered (forward stream against the transfer's)."""
    first = EXAMPLE.build()[1]
    s, rep, read = current_window_read("make_decode_window", first["op"])
    assert read["status"] == "stale" and first["status"] == "stale"
    writes = [r for r in rep["latent_races"] if r["kinds"] == ["write (write)", "write (write)"]]
    assert any(r["streams"] == ["forward", "schedule"] for r in writes)
    controlled_schedule(s, run_schedule(s, H200, torn=False))
