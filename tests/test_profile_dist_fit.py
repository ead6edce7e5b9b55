"""Fitting the profile's [timing] tables from race-window scans (gpu_backend.calibrate.spread_fit),
on synthetic scans whose true distributions are known; and the profile text it writes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.calibrate.spread import race_doc
from gpu_backend.calibrate.spread_fit import (QUANTILES, apply_to_profile_text, fit_link_model, pava_nonincreasing,
                                              read_skew_table, window_quantiles)
from sim.executor import run_schedule
from sim.profile import QuantileTable, load_profile, profile_from_dict, tomllib
from sim.schedule import validate


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(1, 50)), min_size=1, max_size=30))
def test_pava_gives_the_closest_non_increasing_sequence(pairs):
    y = np.array([p[0] for p in pairs])
    w = np.array([p[1] for p in pairs], dtype=float)
    fit = pava_nonincreasing(y, w)
    assert (np.diff(fit) <= 1e-12).all()
    # weighted mean is kept, and an already non-increasing input is returned unchanged
    assert np.sum(fit * w) == pytest.approx(np.sum(y * w))
    ys = np.sort(y)[::-1]
    assert np.allclose(pava_nonincreasing(ys, w), ys)


def test_window_quantiles_recover_a_uniform_window():
    c = np.linspace(0.5, 12, 116)
    s = np.clip((8 - c) / 6, 0, 1)                        # Z uniform on [2, 8]
    n = np.full(c.size, 10000)
    z = window_quantiles(c, n, np.round(s * n), QUANTILES)
    assert z == pytest.approx(2 + 6 * QUANTILES, abs=0.12)


def _scan(doc, profile, r_table: QuantileTable, n=4000):
    """A synthetic scan: stale iff c + kernel_launch_us + R < E (the simulator's rule)."""
    run = run_schedule(validate(doc), profile, seed=0, materialise=False)
    e = max(float(v.max()) for v in run.item_end_us.values() if v.size)
    c = np.linspace(0.5, e + 5, 80)
    s = np.array([np.mean(np.interp(e - profile.kernel_launch_us - ci, r_table.values, np.linspace(0, 1, len(r_table.values)),
                                     left=0.0, right=1.0)) for ci in c])
    return {"label": doc["name"], "doc": doc, "scan": {"compute_us": c.tolist(), "trials": [n] * c.size,
                                                       "stale": np.round(s * n).tolist()}}


def test_read_skew_table_recovers_the_skew_that_made_the_scans():
    prof = load_profile("h200")
    truth = QuantileTable(tuple(np.linspace(1.0, 5.0, 21)))
    shapes = [_scan(race_doc(b, t, 1.0), prof, truth) for b, t in ((1024, 256), (512, 1024), (256, 4096))]
    skew, m, f, rows = read_skew_table(shapes, prof)
    assert m == 0 and f == 1.0
    assert skew[1:-1] == pytest.approx(np.array(truth.values)[1:-1], abs=0.35)
    assert all(abs(r["read_skew_median_us"] - 3.0) < 0.35 for r in rows)


def test_a_shape_clean_at_the_smallest_compute_is_left_out():
    prof = load_profile("h200")
    late = QuantileTable((50.0, 60.0))          # the read always after the copy: never stale
    good = _scan(race_doc(512, 1024, 1.0), prof, QuantileTable((1.0, 2.0)))
    bad = _scan(race_doc(128, 64, 1.0), prof, late)
    _, _, _, rows = read_skew_table([good, bad], prof)
    assert "censored" in rows[1] and "censored" not in rows[0]


def test_fit_link_model_recovers_the_profile_that_timed_the_copies():
    prof = load_profile("h200-calibrated-sglang")
    plans, us = [], []
    for b, t in ((128, 64), (256, 1024), (1024, 256), (512, 4096), (1024, 1024), (128, 4096)):
        op = [o for o in validate(race_doc(b, t, 1.0)).ops if o.op == "copy"][0]
        run = run_schedule(validate(race_doc(b, t, 1.0)), prof, seed=0, materialise=False)
        plans.append(op.plan)
        us.append(float(run.item_end_us[op.id].max()))
    fit = fit_link_model(plans, us, prof)
    assert fit["rel_err_median"] < 0.03 and fit["workers"] == "sglang_jit"


def test_profile_text_gets_the_tables_once_and_stays_loadable():
    with open("sim/profiles/h200-calibrated-sglang.toml") as f:
        text = f.read()
    fit = {"link": None, "shapes": [{"label": "x", "z_median_us": 1.0, "read_skew_median_us": 2.0}],
           "timing": {"read_after_compute_us": [1.0, 2.0, 3.0]}, "rate_median": 1.0, "copy_samples": 0}
    once = apply_to_profile_text(text, fit, "test")
    twice = apply_to_profile_text(once, fit, "test")
    heads = [line for line in twice.splitlines() if line.startswith("[")]
    assert heads.count("[timing]") == 1 and heads.count("[fit.spread]") == 1
    p = profile_from_dict(tomllib.loads(twice), "t")
    assert p.timing_table("read_after_compute_us").values == (1.0, 2.0, 3.0)
    assert p.timing_table("copy_rate_factor") is None


def test_calibrate_adds_the_timing_tables_from_the_scans(monkeypatch):
    """kvrace calibrate (full): the scans' tables are appended; a failing scan leaves the text."""
    import gpu_backend.calibrate.spread as spread
    from gpu_backend.calibrate.cli import add_timing_tables

    prof = load_profile("h200-calibrated")
    with open("sim/profiles/h200-calibrated.toml") as f:
        text = f.read()
    truth = QuantileTable(tuple(np.linspace(2.0, 6.0, 21)))
    shapes = []
    for b, t in ((1024, 256), (512, 1024), (256, 4096)):
        sh = _scan(race_doc(b, t, 1.0), prof, truth)
        run = run_schedule(validate(sh["doc"]), prof, seed=0, materialise=False)
        end = float(run.item_end_us["load_index_k_L0"].max())
        sh["timed"] = {"copy_start_us": [0.0] * 8, "copy_end_us": list(end * np.linspace(0.98, 1.02, 8))}
        shapes.append(sh)
    monkeypatch.setattr(spread, "measure_spread", lambda provider: {"device": "fake", "date": "2026-12-01",
                                                                     "shapes": shapes})
    said = []
    new = add_timing_tables(text, None, said.append)
    p = profile_from_dict(tomllib.loads(new), "t")
    assert p.timing_table("read_after_compute_us").quantile(0.5) == pytest.approx(4.0, abs=0.6)
    assert p.skew_by_beside            # the full level writes the skew by the bytes beside too
    assert "race-window scans" in said[-1] and "bytes beside" in said[-1]

    def broken(provider):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(spread, "measure_spread", broken)
    assert add_timing_tables(text, None, said.append) == text
    assert "no GPU here" in said[-1]


def test_anchor_shapes_give_the_skew_and_longer_ones_the_rate():
    """Scans made with a rate factor 0.8 and a read skew uniform on [2, 4]: the fit finds both."""
    from dataclasses import replace

    prof = load_profile("h200")
    truth = QuantileTable(tuple(np.linspace(2.0, 4.0, 21)))
    slow = replace(prof, h2d_gbps=prof.h2d_gbps / 0.8, warp_gbps=prof.warp_gbps / 0.8,
                   item_overhead_us=prof.item_overhead_us * 0.8)       # copies at 0.8 of prof's time
    shapes = [_scan(race_doc(b, t, 1.0), slow, truth) for b, t in ((128, 64), (1024, 256), (512, 1024), (256, 4096))]
    skew, m, f, rows = read_skew_table(shapes, prof, anchor_us=2.0)
    assert [r["role"] for r in rows][0] == "anchor" and "rate" in [r["role"] for r in rows]
    assert f == pytest.approx(0.8, abs=0.03)
    assert np.interp(0.5, QUANTILES, skew) == pytest.approx(3.0, abs=0.4)
