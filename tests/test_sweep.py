"""kvrace sweep: generators, seeded chunked trials, the Wilson interval, resumable results,
results that do not depend on the number of workers or the backend, and the command line."""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import TieBreak, run_schedule
from sim.profile import load_profile
from sim.schedule import load, validate
from sim.sweeps import (Progress, SweepSpec, get_generator, load_results, parse_grid, point_key, run_sweep,
                        trial_seed, wilson_interval)
from sim.sweeps.trials import Task, _Prepared, run_chunk
from sim.verdicts import analyse, read_digest

GEN = get_generator("minimal_race")
# launch skew makes the minimal race a coin toss at these points (neither 0 nor 1)
MIXED = {"launch_jitter_us": 5.0, "compute_us": 12.0}


def _task(point, start, stop, *, seed=0, chunk=0, profile="h200"):
    p = GEN.point(point)
    return Task(GEN.name, tuple(p.items()), profile, seed, point_key(GEN.name, p, profile), chunk, start, stop)


# ---------------------------------------------------------------- Wilson interval

@pytest.mark.parametrize("k,n,lo,hi", [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
    # 0 of 10 and 10 of 10, the textbook rule-of-three neighbourhood
    (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634),
])
def test_wilson_interval_matches_published_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=6e-5)


@given(st.integers(0, 5000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
@settings(max_examples=60, deadline=None)
def test_wilson_interval_contains_the_estimate_and_mirrors(kn):
    k, n = kn
    lo, hi = wilson_interval(k, n)
    if n == 0:
        assert (lo, hi) == (0.0, 1.0)
        return
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    mlo, mhi = wilson_interval(n - k, n)
    assert lo == pytest.approx(1 - mhi, abs=1e-12) and hi == pytest.approx(1 - mlo, abs=1e-12)


def test_wilson_interval_refuses_impossible_counts():
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


# ---------------------------------------------------------------- the generator

def test_minimal_race_defaults_are_the_shipped_example():
    """At its defaults the generator is examples/index_k_ungated_race.json: the same op
    timings, the same read status and the same bytes (by provenance) under one seed."""
    prof = replace(load_profile("h200"), launch_jitter_us=2.0)
    ex = load("examples/index_k_ungated_race.json")
    gen = validate(GEN.build(GEN.point()))
    for seed in (0, 1, 7):
        a = run_schedule(ex, prof, seed=seed, ties=TieBreak("seeded", seed=seed))
        b = run_schedule(gen, prof, seed=seed, ties=TieBreak("seeded", seed=seed))
        named = {k: v for k, v in a.timings.items() if not k.startswith("op")}
        assert named == {k: v for k, v in b.timings.items() if k in named}
        ra, rb = analyse(a), analyse(b)
        assert [r["status"] for r in ra["reads"]] == [r["status"] for r in rb["reads"]]
        assert read_digest(a.reads[0]) == read_digest(b.reads[0])
        assert ra["latent_races_total"] == rb["latent_races_total"] == 1


def test_gated_variant_has_no_race():
    rep = analyse(run_schedule(validate(GEN.build(GEN.point({"gated": True}))), load_profile("h200")))
    assert rep["latent_races_total"] == 0 and rep["corrupt_reads"] == 0


def test_generator_refuses_geometry_it_cannot_build():
    with pytest.raises(InputError, match="bytes_per_token.*more than scale_bytes=4"):
        GEN.build(GEN.point({"bytes_per_token": 4}))
    with pytest.raises(InputError, match="multiple of 8"):
        GEN.build(GEN.point({"bytes_per_token": 5, "page_tokens": 1, "scale_bytes": 0}))
    with pytest.raises(InputError, match=r"point\.pagez.*expected one of"):
        GEN.point({"pagez": 3})


def test_point_derived_columns():
    assert GEN.columns(GEN.point({"bytes_per_token": 256, "pages": 8})) == {"load_bytes": 256 * 64 * 8}


# ---------------------------------------------------------------- grid parsing

def test_parse_grid_checks_keys_and_values():
    assert parse_grid(GEN, ["compute_us=3,10", "gated=false,true", "launch_jitter_us=profile,5"]) == {
        "compute_us": [3.0, 10.0], "gated": [False, True], "launch_jitter_us": [None, 5.0]}
    with pytest.raises(InputError) as e:
        parse_grid(GEN, ["computeus=3"])
    assert e.value.where == "--grid computeus" and "compute_us" in e.value.message
    with pytest.raises(InputError, match=r"--grid pages: expected a whole number >= 1, got 0"):
        parse_grid(GEN, ["pages=4,0"])
    with pytest.raises(InputError, match="--grid gated: expected true or false"):
        parse_grid(GEN, ["gated=maybe"])
    with pytest.raises(InputError, match="KEY=V1,V2"):
        parse_grid(GEN, ["pages"])
    with pytest.raises(InputError, match="given twice"):
        parse_grid(GEN, ["pages=1", "pages=2"])
    with pytest.raises(InputError, match="distinct"):
        parse_grid(GEN, ["pages=2,2"])


# ---------------------------------------------------------------- trials

def test_trial_status_is_what_analyse_reports():
    """A sweep trial classifies its read exactly as ``analyse`` does for the same run."""
    prep = _Prepared(_task(MIXED, 0, 1))
    seen = set()
    for t in range(20):
        seed = trial_seed(0, "00ff00ff00ff00ff", t)
        stale, torn, _ = prep.trial(seed)
        run = run_schedule(prep.schedule, prep.profile, seed=seed, ties=TieBreak("seeded", seed=seed))
        status = analyse(run)["reads"][0]["status"]
        assert (stale, torn) == (status == "stale", status == "torn")
        seen.add(status)
    assert {"ok", "torn"} <= seen            # the point really is mixed


@pytest.mark.parametrize("point", [
    {"bytes_per_token": 4096, "compute_us": 10.0, "launch_jitter_us": 5.0},               # 1 MiB, torn pages
    {"bytes_per_token": 264, "page_tokens": 3, "pages": 7, "compute_us": 14.0, "launch_jitter_us": 6.0},
    {"bytes_per_token": 136, "page_tokens": 1, "pages": 40, "compute_us": 5.0, "launch_jitter_us": 3.0},
])
def test_read_status_agrees_with_the_verdicts_classifier(point):
    """The piece-wise status (no per-byte arrays) equals sim.verdicts' per-byte one."""
    from sim.sweeps.trials import read_status
    from sim.verdicts import _classify, _indeterminate_masks

    prep = _Prepared(_task(point, 0, 1))
    seen = set()
    for seed in range(12):
        run = run_schedule(prep.schedule, prep.profile, seed=seed, ties=TieBreak("seeded", seed=seed),
                           materialise=False)
        r = run.reads[0]
        ref = prep.reference[r.op_id]
        unit = prep.schedule.buffers[r.buffer].layout.unit_bytes
        status = read_status(r, ref, unit)
        assert status == _classify(r, ref, unit, _indeterminate_masks(r, None))[0]
        seen.add(status)
    assert seen - {"ok"}


def test_chunks_add_up_to_one_chunk():
    """Trial t's seed depends on (seed, point, t) only: cutting trials into chunks changes nothing."""
    whole = run_chunk(_task(MIXED, 0, 30))
    parts = [run_chunk(_task(MIXED, a, a + 10, chunk=i)) for i, a in enumerate((0, 10, 20))]
    assert whole.corrupt == sum(p.corrupt for p in parts) and whole.torn == sum(p.torn for p in parts)
    assert whole.latent_races == parts[0].latent_races == 1 and parts[1].latent_races is None
    assert 0 < whole.corrupt < 30


def test_trial_seeds_differ_by_point_trial_and_seed():
    seeds = {trial_seed(s, k, t) for s in (0, 1) for k in ("0" * 16, "1" * 16) for t in range(50)}
    assert len(seeds) == 200


# ---------------------------------------------------------------- run_sweep

def _spec(**kw):
    base = dict(grid={"compute_us": [6.0, 12.0], "launch_jitter_us": [5.0]}, trials=40, chunk=10)
    base.update(kw)
    return SweepSpec("minimal_race", **base)


def _strip(rows):
    return sorted(rows, key=lambda r: r["key"])


def test_results_do_not_depend_on_the_number_of_workers(tmp_path):
    one = run_sweep(_spec(), workers=1)
    two = run_sweep(_spec(), str(tmp_path / "two"), workers=2)
    assert one == two
    assert [r["compute_us"] for r in one] == [6.0, 12.0]             # grid order
    assert all(r["trials"] == 40 and r["latent_races"] == 1 for r in one)
    on_disk = load_results(str(tmp_path / "two"))["points"]
    assert _strip(on_disk) == _strip(two)


def test_until_ci_stops_at_the_first_narrow_chunk_whatever_the_workers():
    spec = _spec(grid={"compute_us": [3.0, 12.0], "launch_jitter_us": [5.0]}, trials=60, until_ci=0.5)
    one = run_sweep(spec, workers=1)
    two = run_sweep(spec, workers=2)
    assert one == two
    for row in one:
        # recompute the rule from the chunks: stop after the first chunk whose prefix is narrow
        chunks = [run_chunk(_task({"compute_us": row["compute_us"], "launch_jitter_us": 5.0}, a, a + 10,
                                  chunk=a // 10)) for a in range(0, 60, 10)]
        k = n = 0
        for c in chunks:
            k, n = k + c.corrupt, n + c.trials
            lo, hi = wilson_interval(k, n)
            if hi - lo < 0.5:
                break
        assert (row["trials"], row["corrupt_trials"]) == (n, k)
        assert row["stopped"] == ("until_ci" if n < 60 else "trials")


def test_resume_skips_finished_points_and_keeps_them(tmp_path):
    out = str(tmp_path / "r")
    first = run_sweep(_spec(grid={"compute_us": [6.0], "launch_jitter_us": [5.0]}), out, workers=1)
    seen = []
    both = run_sweep(_spec(), out, workers=1, progress=seen.append)
    assert both[0] == first[0]
    assert seen[-1].points_total == 1 and seen[-1].trials_total == 40      # only the new point ran
    doc = load_results(out)
    assert len(doc["points"]) == 2 and [r["points_run"] for r in doc["runs"]] == [1, 1]
    with open(os.path.join(out, "sweep.csv")) as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["key"] for r in rows) == sorted(r["key"] for r in both)
    # a run with other settings would give other numbers for the same keys: refused by name
    with pytest.raises(InputError, match="trials=40, this one has trials=41"):
        run_sweep(_spec(trials=41), out, workers=1)


def test_a_row_cut_by_a_crash_is_dropped_on_resume(tmp_path):
    out = str(tmp_path / "c")
    run_sweep(_spec(grid={"compute_us": [6.0], "launch_jitter_us": [5.0]}), out, workers=1)
    with open(os.path.join(out, "sweep.csv"), "a") as f:
        f.write("deadbeef,minimal_ra")                # a half-written row
    run_sweep(_spec(grid={"compute_us": [6.0], "launch_jitter_us": [5.0]}), out, workers=1)
    with open(os.path.join(out, "sweep.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["compute_us"] == "6"


def test_progress_counts_every_trial():
    seen: list[Progress] = []
    run_sweep(_spec(), workers=1, progress=seen.append)
    assert seen[0].trials_done == 0 and seen[-1].trials_done == seen[-1].trials_total == 80
    assert seen[-1].points_done == 2


def test_bad_settings_are_named():
    with pytest.raises(InputError, match="--trials"):
        SweepSpec("minimal_race", trials=0)
    with pytest.raises(InputError, match="--until-ci"):
        SweepSpec("minimal_race", until_ci=1.5)
    with pytest.raises(InputError, match="generator: expected one of minimal_race"):
        SweepSpec("nope").points()
    with pytest.raises(InputError, match="--backend"):
        run_sweep(_spec(), backend="dask")
    with pytest.raises(InputError, match="--import no_such_module_kvrace"):
        SweepSpec("minimal_race", imports=("no_such_module_kvrace",))


@pytest.mark.slow
def test_ray_backend_gives_the_local_numbers():
    ray = pytest.importorskip("ray")
    spec = _spec()
    local = run_sweep(spec, workers=2)
    try:
        remote = run_sweep(spec, workers=2, backend="ray")
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert remote == local


# ---------------------------------------------------------------- command line

def test_cli_sweep_writes_csv_and_json(tmp_path, capsys):
    from kvrace.cli import main

    out = str(tmp_path / "cli")
    rc = main(["sweep", "minimal_race", "--grid", "compute_us=6,12", "--grid", "launch_jitter_us=5",
               "--trials", "20", "--workers", "1", "--out", out, "--progress", "never"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "compute_us=6.0" in text and "corrupt" in text and "latent races 1" in text
    doc = json.load(open(os.path.join(out, "sweep.json")))
    assert doc["meta"]["trials"] == 20 and len(doc["points"]) == 2
    with open(os.path.join(out, "sweep.csv")) as f:
        header = next(csv.reader(f))
    assert header[:4] == ["key", "generator", "profile", "bytes_per_token"]
    assert {"corrupt_fraction", "ci_lo", "ci_hi", "latent_races", "load_bytes"} <= set(header)


@pytest.mark.parametrize("args,where", [
    (["--grid", "computeus=3"], "--grid computeus"),
    (["--grid", "pages=-1"], "--grid pages"),
    (["--profile", "nope"], "profile"),
])
def test_cli_sweep_bad_input_exits_2(tmp_path, capsys, args, where):
    from kvrace.cli import main

    rc = main(["sweep", "minimal_race", "--trials", "5", "--out", str(tmp_path / "x"), *args])
    assert rc == 2
    assert f"kvrace: error: {where}" in capsys.readouterr().err


def test_cli_sweep_list(capsys):
    from kvrace.cli import main

    assert main(["sweep", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("minimal_race:") and "bytes_per_token" in out and "derived columns: load_bytes" in out


def test_progress_bar_line_has_eta():
    from kvrace.sweep_cli import ProgressBar

    buf = io.StringIO()
    bar = ProgressBar(buf, force=True, every_s=0)
    bar(Progress(1, 4, 250, 1000, 5.0))
    bar.close()
    text = buf.getvalue()
    assert "25.0%" in text and "points 1/4" in text and "trials 250/1000" in text and "ETA 0:15" in text
    assert ProgressBar(io.StringIO()).enabled is False          # not a terminal: silent
