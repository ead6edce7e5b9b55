"""The README's promises, run as a user would: the CLI on the shipped examples."""
import json
import subprocess
import sys

import pytest

from kvrace.cli import main


def kvrace(*args):
    p = subprocess.run([sys.executable, "-m", "kvrace", *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def test_minimal_race_names_stale_bytes_and_their_owner():
    rc, out, err = kvrace("schedule", "run", "examples/index_k_ungated_race.json")
    assert rc == 1, err                      # corruption found: --fail-on corrupt is the default
    assert "found 1 corrupt read" in err
    assert "corrupt: 1 (stale 1, torn 0)" in out
    assert "saw:      bytes 33792-33792: index_k layer 0 initial unit 4 v0" in out
    assert "expected: bytes 33792-33792: index_k layer 0 request 12 unit 0 v1" in out
    assert "LATENT RACE on dev_index_k layer 0" in out


def test_gated_twin_is_clean():
    rc, out, _ = kvrace("schedule", "run", "examples/index_k_gated.json", "--json", "-")
    rep = json.loads(out)
    assert rc == 0
    assert rep["reads_total"] == 1 and rep["corrupt_reads"] == 0 and rep["latent_races"] == []


def test_c4_example_reports_out_of_bounds_bytes():
    rc, out, _ = kvrace("schedule", "run", "examples/c4_routine_on_bf16_index_k.json", "--json", "-")
    rep = json.loads(out)
    assert rc == 0
    # Derived from the C4 constants: token t goes to page t//64 (37,440 B stride), value 576 B at
    # entry*576, scale 8 B at 36,864 + entry*8; the device buffer holds 300 x 256 = 76,800 B.
    expected = 0
    for t in range(300):
        base = (t // 64) * 37440
        for off, n in ((base + (t % 64) * 576, 576), (base + 36864 + (t % 64) * 8, 8)):
            expected += max(0, off + n - max(off, 76800))
    assert sum(o["bytes_outside"] for o in rep["oob_writes"]) == expected
    assert {o["would_hit"] for o in rep["oob_writes"]} == {"dev_neighbour"}
    assert rep["placement"][0]["items"] == 300
    assert rep["placement"][0]["items_placed_correctly"] < 300


def test_json_report_keys(tmp_path):
    path = tmp_path / "r.json"
    assert main(["schedule", "run", "examples/index_k_ungated_race.json", "--json", str(path)]) == 1
    rep = json.loads(path.read_text())
    for key in ("reads", "stale_reads", "torn_reads", "latent_races", "oob_writes"):
        assert key in rep
    assert rep["reads"][0]["provenance"][0]["origin"]["kind"] == "index_k"


def test_validate_and_bad_input_exit_2_with_named_key(tmp_path):
    rc, out, _ = kvrace("schedule", "validate", "examples/index_k_gated.json")
    assert rc == 0 and "valid kvrace schedule" in out
    doc = json.load(open("examples/index_k_gated.json"))
    doc["ops"][2]["dst"] = "dev_nowhere"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    rc, out, err = kvrace("schedule", "run", str(bad))
    assert rc == 2
    assert "ops[2] (load_index_k_L0).dst: unknown buffer 'dev_nowhere'" in err
    assert "Traceback" not in err


def test_profiles_listed():
    rc, out, _ = kvrace("profiles")
    assert rc == 0 and "h200" in out and "rtx-pro-6000: uncalibrated" in out


def test_readme_opens_with_exactly_two_commands_and_ci_runs_the_second():
    lines = open("README.md").read().splitlines()
    assert lines[0] == "```bash" and lines[3] == "```"
    assert lines[1].endswith("pip install . && kvrace run") and "pytest" in lines[2]
    ci = open(".ci/run").read()
    assert "sed -n '3p' README.md" in ci


@pytest.mark.parametrize("profile", ["h200", "rtx-pro-6000"])
def test_both_profiles_run(profile):
    assert main(["schedule", "run", "examples/index_k_ungated_race.json", "--profile", profile,
                 "--json", "-", "--fail-on", "none"]) == 0


def test_torn_example_shows_half_written_pages():
    rc, out, _ = kvrace("schedule", "run", "examples/index_k_torn_read.json", "--json", "-")
    rep = json.loads(out)
    assert rc == 1
    r = rep["reads"][0]
    assert r["status"] == "torn" and rep["torn_reads"] == 1
    prov = r["provenance"]
    assert len(prov) == 8                      # 4 pages, each new bytes then old bytes
    split = prov[0]["nbytes"]
    assert split % 256 == 0 and 0 < split < 8448   # whole 256 B warp steps landed
    for page in range(4):
        new, old = prov[2 * page], prov[2 * page + 1]
        assert new["origin"]["owner"] == 12 and new["first_unit"] == page and new["nbytes"] == split
        assert old["origin"]["owner"] == -1 and old["nbytes"] == 8448 - split
    assert r["bytes_differing"] == 4 * (8448 - split)


# ---- exit codes, --fail-on ----

RACE = "examples/index_k_ungated_race.json"
GATED = "examples/index_k_gated.json"
C4 = "examples/c4_routine_on_bf16_index_k.json"


@pytest.mark.parametrize("case, fail_on, rc", [
    (GATED, [], 0), (GATED, ["--fail-on", "corrupt,race,oob"], 0),
    (RACE, [], 1), (RACE, ["--fail-on", "race"], 1), (RACE, ["--fail-on", "oob"], 0),
    (RACE, ["--fail-on", "none"], 0),
    (C4, [], 0), (C4, ["--fail-on", "oob"], 1), (C4, ["--fail-on", "race", "--fail-on", "oob"], 1),
    (C4, ["--fail-on", "corrupt,race"], 0),
])
def test_exit_code_follows_fail_on(case, fail_on, rc, capsys):
    assert main(["schedule", "run", case, "--json", "-", *fail_on]) == rc
    json.loads(capsys.readouterr().out)      # the report is still written in full


@pytest.mark.parametrize("bad", ["stale", "none,race", "corrupt,,bogus"])
def test_bad_fail_on_is_a_usage_error(bad, capsys):
    assert main(["schedule", "run", GATED, "--fail-on", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrace: error: --fail-on:")
    assert ("'none' cannot be combined" in err) if bad.startswith("none,") else ("corrupt, race, oob, none" in err)


def test_race_count_uses_totals_when_the_report_has_them():
    from kvrace.cli import findings

    rep = {"corrupt_reads": 0, "latent_races": [], "oob_writes": [], "oob_reads": []}
    assert findings(rep) == {"corrupt": 0, "race": 0, "oob": 0}
    assert findings({**rep, "latent_races": [{}], "latent_races_total": 40})["race"] == 40
    assert findings({**rep, "intra_launch_races": [{}, {}]})["race"] == 2
    assert findings({**rep, "intra_launch_races": 3, "oob_reads": [{}]}) == {"corrupt": 0, "race": 3, "oob": 1}


# ---- --help, --version, --json everywhere ----

def test_help_documents_exit_codes():
    for cmd in ([], ["schedule", "run"], ["replay"]):
        rc, out, _ = kvrace(*cmd, "--help")
        assert rc == 0
        assert "exit codes:" in out and "3  no GPU" in out and "2  bad input" in out
    rc, out, _ = kvrace("schedule", "run", "--help")
    assert "--fail-on" in out and "implies --ties explicit" in out


def test_version():
    from importlib import metadata

    rc, out, _ = kvrace("--version")
    assert rc == 0 and out.strip() == f"kvrace {metadata.version('kvrace')}"


def test_validate_and_profiles_write_json(tmp_path):
    rc, out, _ = kvrace("schedule", "validate", GATED, "--json", "-")
    doc = json.loads(out)
    assert rc == 0 and doc["valid"] is True and doc["copies"] == 1 and doc["ops"] > doc["copies"]
    rc, out, _ = kvrace("profiles", "--json", "-")
    profiles = {p["name"]: p for p in json.loads(out)}
    assert rc == 0 and profiles["h200"]["calibrated"] is False and profiles["h200"]["h2d_gbps"] > 0
    path = tmp_path / "p.json"
    assert main(["profiles", "--json", str(path)]) == 0
    assert json.loads(path.read_text()) == list(profiles.values())


# ---- '-' is stdout everywhere ----

def test_snapshot_dash_is_stdout(tmp_path):
    rc, out, err = kvrace_at(tmp_path, "schedule", "run", GATED, "--snapshot", "-")
    assert rc == 0, err
    assert json.loads(out)["kvrace_snapshot"] == 1       # only the snapshot on stdout
    assert not (tmp_path / "-").exists()
    rc, out, err = kvrace_at(tmp_path, "schedule", "run", GATED, "--snapshot", "-", "--json", "r.json")
    assert rc == 0 and "kvrace_snapshot" in json.loads(out) and "reads" in json.loads((tmp_path / "r.json").read_text())


def test_json_and_snapshot_cannot_both_be_stdout(capsys):
    assert main(["schedule", "run", GATED, "--json", "-", "--snapshot", "-"]) == 2
    cap = capsys.readouterr()
    assert "only one of them can go to stdout" in cap.err and cap.out == ""


def test_json_and_snapshot_cannot_share_a_file(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["schedule", "run", GATED, "--json", str(path), "--snapshot", str(tmp_path / "." / "out.json")]) == 2
    assert "give them different paths" in capsys.readouterr().err and not path.exists()


def kvrace_at(cwd, *args):
    import os

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "kvrace", *[os.path.abspath(a) if a.startswith("examples/") else a
                                                          for a in args]],
                       capture_output=True, text=True, cwd=cwd, env=env)
    return p.returncode, p.stdout, p.stderr


# ---- --first ----

def test_first_before_file_does_not_swallow_it():
    rc, out, err = kvrace("schedule", "run", "--first", "indexer_read_index_k_L0", RACE, "--json", "-")
    assert rc == 1, err
    assert json.loads(out)["reads_total"] == 1


@pytest.mark.parametrize("first, ties", [
    (["--first", "indexer_read_index_k_L0", "--first", "load_index_k_L0"], []),
    (["--first", "indexer_read_index_k_L0,load_index_k_L0"], ["--ties", "explicit"]),
    (["--first", " indexer_read_index_k_L0 , load_index_k_L0"], []),
])
def test_first_takes_repeats_and_commas_and_implies_explicit(first, ties, monkeypatch):
    import sim.executor

    seen = []
    real = sim.executor.run_schedule

    def spy(s, profile, **kw):
        seen.append(kw["ties"])
        return real(s, profile, **kw)
    monkeypatch.setattr(sim.executor, "run_schedule", spy)
    assert main(["schedule", "run", RACE, *first, *ties, "--fail-on", "none"]) == 0
    assert seen[0].mode == "explicit" and seen[0].first == ("indexer_read_index_k_L0", "load_index_k_L0")


def test_no_first_keeps_fifo(monkeypatch):
    import sim.executor

    seen = []
    real = sim.executor.run_schedule
    monkeypatch.setattr(sim.executor, "run_schedule", lambda s, p, **kw: seen.append(kw["ties"]) or real(s, p, **kw))
    assert main(["schedule", "run", GATED]) == 0
    assert seen[0].mode == "fifo" and seen[0].first == ()


def test_unknown_first_id_names_it_and_the_known_ones(capsys):
    assert main(["schedule", "run", RACE, "--first", "load_index_k_L0,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown op id 'nope'" in err and "load_index_k_L0" in err and "indexer_read_index_k_L0" in err


def test_first_with_other_ties_is_an_error(capsys):
    assert main(["schedule", "run", RACE, "--ties", "seeded", "--first", "load_index_k_L0"]) == 2
    assert "--ties explicit" in capsys.readouterr().err


# ---- clean errors, checked before the simulation ----

def test_negative_seed_is_a_usage_error():
    rc, _, err = kvrace("schedule", "run", GATED, "--seed", "-1")
    assert rc == 2 and "--seed" in err and ">= 0" in err and "Traceback" not in err


@pytest.mark.parametrize("opt", ["--json", "--snapshot"])
def test_unwritable_output_paths_are_refused_before_running(opt, tmp_path, capsys, monkeypatch):
    import sim.executor

    def must_not_run(*a, **k):
        raise AssertionError("simulated despite a bad output path")
    monkeypatch.setattr(sim.executor, "run_schedule", must_not_run)
    assert main(["schedule", "run", GATED, opt, str(tmp_path)]) == 2
    assert f"kvrace: error: {opt}: '{tmp_path}' is a directory" in capsys.readouterr().err
    missing = tmp_path / "missing" / "x.json"
    assert main(["schedule", "run", GATED, opt, str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    assert not missing.parent.exists()


def test_validate_and_profiles_refuse_a_directory(tmp_path, capsys):
    assert main(["schedule", "validate", GATED, "--json", str(tmp_path)]) == 2
    assert main(["profiles", "--json", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("is a directory") == 2


@pytest.mark.parametrize("content, says", [
    (b"\xff\xfename = 'x'\n", "not a UTF-8 text file"),
    (b"[[[", "not valid TOML"),
    (b"name = 'x'\ncalibrated = true\nsource = 's'\ndate = 'd'\nlink = 3\n", "[link]: missing table"),
])
def test_bad_profile_file_is_named(content, says, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(content)
    rc, _, err = kvrace("schedule", "run", GATED, "--profile", str(bad))
    assert rc == 2 and "Traceback" not in err
    assert err.startswith(f"kvrace: error: {bad}: {says}")


def test_profile_checks_values_are_finite(tmp_path):
    from sim.errors import InputError
    from sim.profile import load_profile

    text = (resources_text("h200")).replace("h2d_gbps = ", "h2d_gbps = inf # ", 1)
    path = tmp_path / "inf.toml"
    path.write_text(text)
    with pytest.raises(InputError, match="h2d_gbps: expected a finite number, got inf"):
        load_profile(str(path))
    with pytest.raises(InputError, match="is a directory"):
        load_profile(str(tmp_path))


def resources_text(name):
    from importlib import resources

    return (resources.files("sim") / "profiles" / f"{name}.toml").read_text()


@pytest.mark.parametrize("cmd", [["profiles"], ["schedule", "run", C4, "--json", "-"]])
def test_closed_pipe_exits_quietly(cmd):
    import os

    r, w = os.pipe()
    os.close(r)                              # the reader is gone before kvrace writes a byte
    p = subprocess.run([sys.executable, "-m", "kvrace", *cmd], stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    assert p.stderr == ""
    assert p.returncode == 141


@pytest.mark.parametrize("args, says", [
    (["replay", RACE, "--json", "nowhere/r.json"], "directory 'nowhere' does not exist"),
    (["replay", RACE, "--seed", "-1"], "--seed: expected a whole number >= 0"),
    (["replay", RACE, "--trials", "0"], "--trials: expected a whole number >= 1"),
    (["calibrate", "--out", "nowhere/p.toml"], "directory 'nowhere' does not exist"),
])
def test_gpu_commands_check_their_arguments_before_looking_for_a_gpu(args, says):
    rc, _, err = kvrace(*args)
    assert rc == 2 and says in err and "Traceback" not in err


def _fake_calibration(monkeypatch):
    """cli_calibrate with the GPU measurement replaced by a shipped profile's TOML (CPU only)."""
    import gpu_backend.calibrate.cli as cal      # patch the names where cli_calibrate looks them up

    fit = {"gbps": 33.0, "launch_us": 4.0, "item_overhead_us": 1.9, "rel_err_median": 0.05}
    fits = {"link_h2d": fit,
            "memcpy_h2d": {"gbps_at_largest": 51.2, "largest_bytes": 256 << 20, "latency_us": 7.9},
            "memcpy_d2h": {"gbps_at_largest": 55.3},
            "spin": {"cycles_per_us": 1980.0, "floor_us": 3.27}}
    monkeypatch.setattr(cal, "measure", lambda level, providers: ({}, {"gpu": "Fake GPU", "seconds": 0.1}))
    monkeypatch.setattr(cal, "build_profile", lambda meas, info, name, level: (resources_text("h200"), {}, fits))
    return cal


def test_calibrate_out_dash_writes_the_profile_to_stdout(monkeypatch, capsys, tmp_path):
    import argparse

    from sim.profile import tomllib          # tomli on Python 3.10

    cal = _fake_calibration(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cal.cli_calibrate(argparse.Namespace(out="-", name=None, quick=True)) == 0
    cap = capsys.readouterr()
    assert tomllib.loads(cap.out)["name"] == "h200"          # stdout holds only the TOML
    assert "wrote stdout: profile 'h200'" in cap.err and list(tmp_path.iterdir()) == []
    assert cal.cli_calibrate(argparse.Namespace(out="p.toml", name=None, quick=True)) == 0
    assert "wrote p.toml" in capsys.readouterr().out and (tmp_path / "p.toml").read_text() == resources_text("h200")


def test_calibrate_refuses_a_bad_out_path_before_measuring(monkeypatch, tmp_path):
    import argparse

    from sim.errors import InputError

    cal = _fake_calibration(monkeypatch)
    monkeypatch.setattr(cal, "measure", lambda *a, **k: pytest.fail("measured despite a bad --out"))
    with pytest.raises(InputError, match="is a directory"):
        cal.cli_calibrate(argparse.Namespace(out=str(tmp_path), name=None, quick=True))
