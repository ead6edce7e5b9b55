"""`kvrace run`: the summary, the JSON keys issue 9 names, exit codes, and exported races that
`kvrace schedule run` takes unchanged."""
from __future__ import annotations

import json
import os

import pytest

from kvrace.cli import main
from tests.test_engine_overlap import FENCE, FENCE_SEED

ARGS = ["run", "glm5-22811-small", "--set", "run.layers=2", "--progress", "never"]
KEYS = ("scenario", "seed", "requests_total", "requests_corrupted", "corrupted_fraction", "stale_reads", "torn_reads",
        "latent_races", "oob_writes", "load_backs", "branches", "sim_time_s", "wall_time_s")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rc = main(ARGS + ["--json", str(d / "run.json"), "--export-races", str(d / "races"), "--export-limit", "2",
                      "--fail-on", "corrupt", "--trace", str(d / "trace.json")])
    return rc, json.loads((d / "run.json").read_text()), d


def test_json_has_the_documented_keys_and_fail_on(exported):
    rc, doc, _ = exported
    assert list(doc)[:len(KEYS)] == list(KEYS)
    assert doc["requests_corrupted"] > 0 and rc == 1
    assert doc["branches"]["index_k"] and doc["branches"]["latent"]


def test_exported_races_rerun_as_schedules_with_the_same_corrupt_read(exported, capsys):
    _, doc, d = exported
    paths = doc["exported_races"]
    assert len(paths) == 2
    for p, c in zip(paths, doc["corrupted_reads"]):
        rc = main(["schedule", "run", p, "--json", str(d / "rep.json"), "--fail-on", "none"])
        assert rc == 0
        rep = json.loads((d / "rep.json").read_text())
        statuses = {r["op"]: r["status"] for r in rep["reads"]}
        assert statuses[c["op"]] == c["status"]


#: the overlap loop without #36738's fence (tests/test_engine_overlap.py's fence run: its FENCE
#: workload and seed, 5 layers: with a batch's KV stored in one write per layer, a decode step's
#: late store lands after the unfenced load-back's H2D only from a later layer on; at 5 both
#: exported reads' windows carry the race that decided their bytes)
UNFENCED = ["--set", "run.layers=5", "--set", "variant.gate_map=upstream-0.5.11", "--set", "scheduler.event_loop=overlap",
            *[a for kv in FENCE for a in ("--set", kv)], "--set", "variant.hypotheses=load-unfenced",
            "--seed", str(FENCE_SEED)]


def test_exported_race_of_reads_that_waited_shows_the_writers_race(tmp_path):
    """A read that waited for everything is stale because a late forward write and a load-back
    into its reused page raced before it: its window carries that race, and the read is stale
    in the window too (a window of the read alone would take the race's outcome as given)."""
    rc = main(ARGS + UNFENCED + ["--json", str(tmp_path / "run.json"), "--export-races", str(tmp_path / "races"),
                                 "--export-limit", "2", "--fail-on", "none"])
    doc = json.loads((tmp_path / "run.json").read_text())
    assert rc == 0 and len(doc["exported_races"]) == 2
    for p, c in zip(doc["exported_races"], doc["corrupted_reads"]):
        assert c["waited"]
        window = json.loads(open(p).read())
        kinds = {o["op"] for o in window["ops"]}
        assert {"copy", "write"} <= kinds
        assert main(["schedule", "run", p, "--json", str(tmp_path / "rep.json"), "--fail-on", "none"]) == 0
        rep = json.loads((tmp_path / "rep.json").read_text())
        assert {r["op"]: r["status"] for r in rep["reads"]}[c["op"]] == c["status"]
        assert "races on its bytes" in window["description"]


def test_summary_table_and_clean_exit(capsys):
    rc = main(ARGS + ["--set", "variant.gate_map=upstream-0.5.11", "--fail-on", "corrupt,race"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "corrupted requests    0 (0.0 %): 0 raced, 0 read KV not theirs" in out and "copy branches" in out


@pytest.mark.parametrize("argv, needle", [
    (["run", "glm5-22811-small", "--set", "workload.bogus=1"], "workload"),
    (["run", "no-such-scenario"], "no-such-scenario"),
    (["run", "glm5-22811-small", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["signatures", "--json", "/nonexistent-dir/x.json"], "--json"),
])
def test_bad_input_exit_2(argv, needle, capsys):
    assert main(argv + ["--progress", "never"]) == 2
    assert needle in capsys.readouterr().err


def test_bad_fail_on_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(ARGS + ["--fail-on", "everything"])
    assert e.value.code == 2 and "corrupt, race, oob" in capsys.readouterr().err


def test_trace_of_an_engine_run_marks_its_corrupt_reads(exported):
    _, doc, d = exported
    events = json.loads((d / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = " ".join(str(e.get("name", "")) for e in events)
    assert any(e.get("ph") == "X" for e in events)
    assert doc["corrupted_reads"][0]["op"] in names


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_default_scenario_reproduces_the_incidents_signature(dtype, tmp_path):
    """`kvrace run` with no scenario runs incident-repro: with the fork's bf16 index-K, requests
    read index-K that is not theirs after a load-back (no race: wrong bytes in every order); with
    fp8 nothing is corrupted. Index-K only ever takes the page-granular copy."""
    out = tmp_path / "r.json"
    assert main(["run", "--set", "run.duration_s=2", "--set", f"model.index_k_dtype={dtype}", "--json", str(out),
                 "--progress", "never"]) == 0
    d = json.loads(out.read_text())
    assert d["scenario"] == "incident-repro" and d["load_backs"] > 0
    assert d["requests_raced"] == 0 and d["latent_races"] == 0
    assert (d["requests_wrong_kv"] > 0) == (dtype == "bf16")
    assert not any("token" in r for r in d["branches"]["index_k"])


def test_run_streams_unless_an_output_needs_the_whole_run(exported, tmp_path, monkeypatch):
    """Without --export-races/--trace the engine streams (keep="report") and gives the same
    metrics as the run that kept everything for the exports."""
    import sim.engine.engine as eng

    keeps = []
    orig = eng.PrefillEngine.__init__

    def spy(self, *a, **kw):
        keeps.append(kw.get("keep"))
        orig(self, *a, **kw)
    monkeypatch.setattr(eng.PrefillEngine, "__init__", spy)
    assert main(ARGS + ["--json", str(tmp_path / "s.json")]) == 0
    assert main(ARGS + ["--json", str(tmp_path / "t.json"), "--trace", str(tmp_path / "t.trace")]) == 0
    assert keeps == ["report", "all"]
    streamed = json.loads((tmp_path / "s.json").read_text())
    kept = exported[1]
    skip = {"wall_time_s", "exported_races"}
    assert {k: v for k, v in streamed.items() if k not in skip} == {k: v for k, v in kept.items() if k not in skip}


def test_a_window_too_large_to_cut_is_skipped_and_named(tmp_path, monkeypatch, capsys):
    """A raced read whose window cannot be a schedule (its buffer holds more provenance segments
    than MAX_INIT_FILLS at the window's start: seen on a graph-replay-no-waits run) is skipped
    with the reason; the export goes on to the next raced read, and the run's summary and JSON
    are still written."""
    import kvrace.run_cli as run_cli
    from sim.errors import InputError

    real = run_cli.race_window
    refused = []

    def first_too_large(run, report, read_id):
        if not refused:
            refused.append(read_id)
            raise InputError("buffers[1].init[0].segments", "the buffers' init entries would fill 4377 "
                             "(entry, layer) pairs; expected at most MAX_INIT_FILLS = 4096")
        return real(run, report, read_id)

    monkeypatch.setattr(run_cli, "race_window", first_too_large)
    rc = main(ARGS + ["--json", str(tmp_path / "run.json"), "--export-races", str(tmp_path / "races"),
                      "--export-limit", "2", "--fail-on", "none"])
    doc = json.loads((tmp_path / "run.json").read_text())
    assert rc == 0
    raced = [c["op"] for c in doc["corrupted_reads"] if c["status"] in ("stale", "torn")]
    assert refused == raced[:1]
    assert [s["op"] for s in doc["exported_races_skipped"]] == raced[:1]
    assert "MAX_INIT_FILLS" in doc["exported_races_skipped"][0]["reason"]
    # the limit counts windows written: the next two raced reads
    from pathlib import Path
    assert [Path(p).name.split("_", 2)[-1][:-len(".json")] for p in doc["exported_races"]] == raced[1:3]
    out = capsys.readouterr().out
    assert f"not exported: {raced[0]}" in out


def test_export_races_says_why_nothing_was_exported(tmp_path, capsys):
    """A run whose corrupted reads are wrong KV (no race window), on either side, writes no
    window and says so, instead of nothing."""
    rc = main(["run", "incident-repro", "--set", "run.duration_s=1", "--progress", "never", "--export-races",
               str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert rc == 0 and not list((tmp_path / "a").iterdir())
    assert "nothing exported: no stale or torn read on the prefill side; its " in out
    assert "wrong-KV reads are wrong in every order" in out and "decode side" not in out.splitlines()[-1]
    main(["run", "incident-short", "--set", "run.layers=4", "--set", "run.duration_s=0.2", "--progress", "never",
          "--set", "variant.hypotheses=index-k-not-transferred", "--export-races", str(tmp_path / "b")])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("nothing exported: no stale or torn read on the prefill side")
    assert last.endswith("; none on the decode side (its " + last.split("(its ")[-1])
    assert last.endswith("wrong-KV reads have no race window)")


def test_json_and_trace_inside_the_export_folder(tmp_path):
    """``--json D/run.json`` and ``--trace D/trace.json`` beside ``--export-races D`` work when
    ``D`` does not exist yet: the export makes the folder before either is written."""
    d = tmp_path / "out"
    rc = main(["run", "incident-repro", "--set", "run.duration_s=0.5", "--progress", "never",
               "--export-races", str(d), "--json", str(d / "run.json"), "--trace", str(d / "trace.json")])
    assert rc == 0 and json.loads((d / "run.json").read_text())["scenario"] == "incident-repro"
    assert json.loads((d / "trace.json").read_text())["traceEvents"]


def test_export_races_folder_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    """An ``--export-races`` path that is a file, or whose folder cannot be made, is refused
    (exit 2) with the option named before the engine runs, not with a traceback after the run."""
    from sim.engine import engine as engine_mod

    def no_run(*a, **k):
        raise AssertionError("the engine ran before the output folder was checked")

    monkeypatch.setattr(engine_mod.PrefillEngine, "run", no_run)
    f = tmp_path / "a_file"
    f.write_text("x")
    cases = [(f, "is a file; expected a folder"), (f / "below", "cannot make")]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if not os.access(ro, os.W_OK):          # root writes anywhere: nothing to refuse then
        cases.append((ro / "races", "permission denied"))
    try:
        for path, why in cases:
            assert main(ARGS + ["--export-races", str(path)]) == 2
            err = capsys.readouterr().err
            assert "--export-races" in err and why in err and "Traceback" not in err
    finally:
        ro.chmod(0o700)
