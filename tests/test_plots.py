"""Plots (matplotlib, an optional extra): files written, errors named, and `import sim` free of it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from sim.errors import InputError


def test_import_sim_does_not_import_matplotlib():
    code = ("import sys, sim, sim.sweeps, sim.trace, sim.plots, kvrace.cli; "
            "sim.load; sim.run_schedule; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'matplotlib'], 'matplotlib imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.fixture(scope="module")
def rows():
    from sim.sweeps import SweepSpec, run_sweep

    grid = {"bytes_per_token": [64, 132], "compute_us": [6.0, 12.0], "launch_jitter_us": [5.0],
            "gated": [False, True]}
    return run_sweep(SweepSpec("minimal_race", grid, trials=2, chunk=2), workers=1)


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_sweep_layout_axes_and_panels(rows):
    from sim.plots import sweep_layout

    assert sweep_layout(rows, "bytes_per_token", "compute_us") == ("bytes_per_token", "compute_us", ["gated"])
    # load_bytes follows bytes_per_token: as x it makes no panels (nor a line) of its own
    assert sweep_layout(rows, x="load_bytes") == ("load_bytes", "compute_us", ["gated"])
    assert sweep_layout(rows) == ("bytes_per_token", "compute_us", ["gated"])
    with pytest.raises(InputError, match="--x: expected a column of the sweep"):
        sweep_layout(rows, x="nope")
    with pytest.raises(InputError, match="--lines: expected a column other than --x"):
        sweep_layout(rows, x="gated", lines="gated")
    with pytest.raises(InputError, match="no points"):
        sweep_layout([])


def test_sweep_plot_writes_png_and_svg(tmp_path, rows):
    pytest.importorskip("matplotlib")
    from sim.plots import plot_sweep

    png, svg = plot_sweep(rows, str(tmp_path / "p"), x="bytes_per_token", lines="compute_us")
    svg_text = open(svg).read()
    assert _is_png(png) and "<svg" in svg_text
    assert "gated = True" in svg_text and "compute_us = 6.0" in svg_text      # a panel per variant, a line per time


def test_timeline_plot_writes_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    from sim.executor import run_schedule
    from sim.plots import plot_timeline
    from sim.profile import load_profile
    from sim.schedule import load
    from sim.trace import timeline

    run = run_schedule(load("examples/index_k_torn_read.json"), load_profile("h200"))
    png, svg = plot_timeline(timeline(run), str(tmp_path / "t"))
    text = open(svg).read()
    assert _is_png(png) and "torn read" in text and "latent race" in text and "stream load" in text


def test_cli_plot_commands(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from kvrace.cli import main

    out = str(tmp_path / "s")
    assert main(["sweep", "minimal_race", "--grid", "compute_us=6,12", "--trials", "3", "--workers", "1",
                 "--out", out, "--progress", "never"]) == 0
    assert main(["plot", "sweep", out]) == 0
    assert _is_png(f"{out}/plot.png") and "compute_us" in capsys.readouterr().out + open(f"{out}/plot.svg").read()
    assert main(["plot", "timeline", "examples/index_k_gated.json", "--out", str(tmp_path / "tl")]) == 0
    assert _is_png(str(tmp_path / "tl.png"))
    assert main(["plot", "sweep", str(tmp_path / "missing")]) == 2
    assert "sweep.json" in capsys.readouterr().err
