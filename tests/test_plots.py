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


# ---------------------------------------------------------------- the signature table

def _table():
    """A synthetic signature table: 2 hypotheses x 3 configurations (one row fits, one cell empty)."""
    return {"scenario": "synthetic", "trials": 8,
            "columns": [{"name": "A 0.5.10", "config": {"gates": "0.5.10", "index_k": "bf16"}},
                        {"name": "B fp8", "config": {"gates": "0.5.10", "index_k": "fp8", "hicache": True,
                                                     "page": 64}},
                        {"name": "C 0.5.11", "config": {"gates": "0.5.11"}}],
            "rows": [{"hypothesis": "ungated-read", "score": 0.92, "fits": True,
                      "cells": [{"corrupted": 8, "requests": 24, "fraction": 8 / 24, "ci": [0.18, 0.53]},
                                {"corrupted": 0, "requests": 24, "fraction": 0.0, "ci": [0.0, 0.14]},
                                {"corrupted": 0, "requests": 24, "fraction": 0.0, "ci": [0.0, 0.14]}]},
                     {"hypothesis": "torn-write", "score": 0.1, "fits": False,
                      "cells": [{"corrupted": 24, "requests": 24, "fraction": 1.0, "ci": [0.86, 1.0]},
                                {"corrupted": 0, "requests": 0, "fraction": 0.0, "ci": [0.0, 1.0]},
                                {"corrupted": 12, "requests": 24, "fraction": 0.5, "ci": [0.31, 0.69]}]}],
            "observed": [{"fraction": 0.3, "corrupt": True}, {"fraction": None, "corrupt": False},
                         {"fraction": None, "corrupt": True}]}


def _svg_texts(path):
    """The texts of an SVG written by matplotlib (svg.fonttype 'none' keeps them as <text>)."""
    import re

    return re.findall(r"<text[^>]*>([^<]*)</text>", open(path).read())


def test_signature_heatmap_draws_cells_intervals_fits_and_observed(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    from sim.plots import signature_heatmap

    with matplotlib.rc_context({"svg.fonttype": "none"}):
        png, svg = signature_heatmap(_table(), str(tmp_path / "h"))
    assert _is_png(png)
    texts = " | ".join(_svg_texts(svg))
    # every cell's fraction, interval and count; the empty cell says so
    for cell_text in ("0.33", "[0.18, 0.53]", "8/24", "1.00", "[0.86, 1.00]", "0.50", "[0.31, 0.69]", "12/24",
                      "n/a"):
        assert cell_text in texts, cell_text
    # the observed row: a fraction where known, else corrupt / clean
    assert "observed" in texts and "0.30" in texts and "clean" in texts and "corrupt" in texts
    # the fitting row carries a check mark, the other none; scores at the right; configurations under names
    assert "\u2713 ungated-read" in texts and "\u2713 torn-write" not in texts and "torn-write" in texts
    assert "0.92" in texts and "0.1" in texts
    assert "A 0.5.10" in texts and "index_k=bf16" in texts and "+1 more" in texts
    assert "1 of 2 hypotheses fit" in texts


def test_signature_heatmap_colours_follow_the_fraction(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from sim.plots import signature_heatmap

    t = _table()
    for r in t["rows"]:
        for c in r["cells"]:
            c.update(corrupted=0, requests=24, fraction=0.0, ci=[0.0, 0.14])
    (low,) = signature_heatmap(t, str(tmp_path / "low.png"))
    for r in t["rows"]:
        for c in r["cells"]:
            c.update(corrupted=24, requests=24, fraction=1.0, ci=[0.86, 1.0])
    (high,) = signature_heatmap(t, str(tmp_path / "high.png"))
    assert not (tmp_path / "low.svg").exists()
    # the same figure, cells at 0 against cells at 1: many more dark-red pixels at 1
    def red(path):
        img = imread(path)[..., :3]
        return int(((img[..., 0] > 0.3) & (img[..., 1] < 0.15) & (img[..., 2] < 0.15)).sum())
    assert red(high) > red(low) + 5000


@pytest.mark.parametrize("edit, where", [
    (lambda t: t.pop("observed"), "signatures.observed"),
    (lambda t: t["rows"][0].pop("score"), "signatures.rows[0].score"),
    (lambda t: t["rows"][0].update(matched=[True, None]), "signatures.rows[0].matched"),
    (lambda t: t["rows"][1]["cells"].pop(), "signatures.rows[1].cells"),
    (lambda t: t["rows"][0]["cells"][2].update(fraction=1.5), "signatures.rows[0].cells[2].fraction"),
    (lambda t: t["rows"][0]["cells"][0].update(ci=[0.5, 0.6]), "signatures.rows[0].cells[0].ci"),
    (lambda t: t["rows"][0]["cells"][0].update(corrupted=30), "signatures.rows[0].cells[0].corrupted"),
    (lambda t: t["rows"][0].update(fits="yes"), "signatures.rows[0].fits"),
    (lambda t: t["observed"].pop(), "signatures.observed"),
    (lambda t: t["observed"][1].update(corrupt="no"), "signatures.observed[1].corrupt"),
    (lambda t: t["columns"][0].pop("config"), "signatures.columns[0].config"),
    (lambda t: t.update(trials=0), "signatures.trials"),
])
def test_signature_table_errors_name_the_key(edit, where):
    from sim.plots import check_signature_table

    t = _table()
    assert check_signature_table(t) is t
    edit(t)
    with pytest.raises(InputError) as e:
        check_signature_table(t)
    assert e.value.where == where and "expected" in e.value.message


def test_signature_table_takes_the_producers_extra_keys(tmp_path):
    """`kvrace signatures --json` writes more than the heat map draws: accepted; `matched` and
    an unobserved column are drawn."""
    pytest.importorskip("matplotlib")
    import matplotlib

    from sim.plots import check_signature_table, signature_heatmap

    t = _table()
    t.update(matrix="incident", seed=0, runs=6, wall_time_s=1.5)
    t["columns"][0].update(fixed=False, note="about 17 %")
    t["rows"][0].update(matched=[True, False, None])
    t["rows"][0]["cells"][0].update(stale_reads=3, torn_reads=0)
    t["observed"][0].update(low=0.12, high=0.18)
    t["observed"][2] = {"fraction": None, "low": None, "high": None, "corrupt": None}
    assert check_signature_table(t) is t
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        (svg,) = signature_heatmap(t, str(tmp_path / "x.svg"))
    texts = " | ".join(_svg_texts(svg))
    assert "not observed" in texts and "(0.12-0.18)" in texts and "\u2717" in texts


def test_cli_plot_signatures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import json

    from kvrace.cli import main
    from kvrace.sweep_cli import add_parsers

    f = tmp_path / "sig.json"
    f.write_text(json.dumps(_table()))
    # registered by add_parsers, which kvrace.cli calls on its own parser
    import argparse

    p = argparse.ArgumentParser()
    add_parsers(p.add_subparsers(dest="command"), "")
    args = p.parse_args(["plot", "signatures", str(f)])
    assert args.func(args) == 0
    assert _is_png(str(tmp_path / "sig_heatmap.png")) and (tmp_path / "sig_heatmap.svg").exists()
    assert main(["plot", "signatures", str(f), "--out", str(tmp_path / "x.svg")]) == 0
    assert (tmp_path / "x.svg").exists() and not (tmp_path / "x.png").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**_table(), "observed": []}))
    assert main(["plot", "signatures", str(bad)]) == 2
    assert "signatures.observed: expected a list of 3 entries" in capsys.readouterr().err
    assert main(["plot", "signatures", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
