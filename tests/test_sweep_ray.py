"""``kvrace sweep --backend ray``: a local Ray gives the local backend's numbers, row for row.

The Ray tests start one local Ray (2 CPUs) for the module and are ``slow`` (starting Ray takes
seconds); they skip, with the reason, when Ray is not installed (``pip install 'kvrace[ray]'``).
The test that Ray's absence is reported runs in the default tier.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sim.errors import InputError
from sim.sweeps import SweepSpec, run_sweep

GRID = {"bytes_per_token": [64, 132], "compute_us": [6.0, 20.0], "launch_jitter_us": [5.0]}


def test_backend_ray_without_ray_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)          # import ray raises ImportError
    with pytest.raises(InputError, match=r"--backend ray: Ray is not installed; expected `pip install 'kvrace\[ray\]'`"):
        run_sweep(SweepSpec("minimal_race", {"compute_us": [6.0]}, trials=2, chunk=2), backend="ray")


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvrace[ray]')")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _counts(rows):
    return [{k: r[k] for k in ("key", "trials", "corrupt_trials", "stale_trials", "torn_trials",
                               "indeterminate_trials", "corrupt_fraction", "ci_lo", "ci_hi", "latent_races",
                               "stopped")} for r in rows]


@pytest.mark.slow
def test_ray_rows_equal_local_rows(ray, tmp_path):
    spec = SweepSpec("minimal_race", GRID, trials=300, seed=3)
    local = run_sweep(spec, str(tmp_path / "local"), workers=2)
    remote = run_sweep(spec, str(tmp_path / "ray"), workers=2, backend="ray")
    assert remote == local
    assert 0 < sum(r["corrupt_trials"] for r in local) < sum(r["trials"] for r in local)   # not all-or-nothing
    doc = json.load(open(tmp_path / "ray" / "sweep.json"))

    def by_key(points):                      # written as points finish: in either order
        return sorted(points, key=lambda r: r["key"])
    assert doc["runs"][-1]["backend"] == "ray"
    assert by_key(doc["points"]) == by_key(json.load(open(tmp_path / "local" / "sweep.json"))["points"])
    # --until-ci stops each point at the same chunk on Ray as on one local worker (chunks past a
    # point's stop are cancelled on Ray and ignored; a cancelled future once hung the sweep)
    spec = SweepSpec("minimal_race", GRID, trials=600, seed=3, until_ci=0.1)
    local = run_sweep(spec, workers=1)
    assert {r["stopped"] for r in local} == {"until_ci"} and len({r["trials"] for r in local}) > 1
    assert run_sweep(spec, backend="ray") == local


@pytest.mark.slow
def test_ray_workers_import_user_generators(tmp_path):
    """A generator registered by an --import module that is not installed (here: a file in the
    working folder of `kvrace sweep`) runs on the workers of the Ray it starts (shipped to them)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvrace[ray]')")
    (tmp_path / "kvrace_user_gens.py").write_text(textwrap.dedent('''
        from sim.sweeps.generators import Generator, Param, minimal_race, register

        register(Generator("user_minimal", "minimal_race, registered by a user module",
                           (Param("compute_us", float, 3.0, "compute before the read"),
                            Param("launch_jitter_us", float, 5.0, "profile override", minimum=0.0)),
                           lambda p: minimal_race.build(minimal_race.point(p)), reads=minimal_race.reads))
    '''))
    outs = {}
    for backend in ("local", "ray"):
        cmd = [sys.executable, "-m", "kvrace", "sweep", "user_minimal", "--import", "kvrace_user_gens",
               "--grid", "compute_us=6,20", "--trials", "200", "--workers", "2", "--backend", backend,
               "--progress", "never", "--out", backend]
        p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert p.returncode == 0, p.stderr[-3000:]
        outs[backend] = (tmp_path / backend / "sweep.csv").read_text()
    # the same rows (written as points finish, so in either order)
    assert sorted(outs["ray"].splitlines()) == sorted(outs["local"].splitlines()) and outs["local"].count("\n") == 3


@pytest.mark.slow
def test_cli_backend_ray_prints_the_local_numbers(ray, tmp_path, capsys):
    from kvrace.cli import main

    args = ["sweep", "minimal_race", "--grid", "bytes_per_token=64,132", "--grid", "compute_us=6,20",
            "--grid", "launch_jitter_us=5", "--trials", "200", "--progress", "never"]
    assert main(args + ["--workers", "2", "--out", str(tmp_path / "l")]) == 0
    local = capsys.readouterr().out
    assert main(args + ["--backend", "ray", "--out", str(tmp_path / "r")]) == 0
    remote = capsys.readouterr().out

    def numbers(text):                       # the per-point lines, without the wall-time line
        return [line for line in text.splitlines() if "corrupt" in line]
    assert numbers(remote) == numbers(local) and len(numbers(local)) == 4
    assert sorted(open(tmp_path / "r" / "sweep.csv")) == sorted(open(tmp_path / "l" / "sweep.csv"))
