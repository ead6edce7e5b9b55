"""The agreement test between measured and simulated stale probabilities (gpu_backend.agreement),
on the CPU: the interval, the decision rule and its edges."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.agreement import agreement, newcombe_interval, two_proportion_p


def test_identical_samples_agree_and_far_ones_miss():
    assert agreement(50, 100, 100, 200).agrees
    assert agreement(0, 100, 0, 200).agrees
    a = agreement(0, 100, 200, 200)
    assert not a.agrees and not a.within and a.diff_lo > a.band_hi
    b = agreement(100, 100, 0, 200)
    assert not b.agrees and b.diff_hi < b.band_lo


def test_the_band_is_5_points_or_the_measured_interval_where_that_is_wider():
    a = agreement(50, 100, 60, 100)
    assert (a.band_lo, a.band_hi) == pytest.approx((a.gpu_lo - 0.5, a.gpu_hi - 0.5))
    assert a.band_hi > 0.05
    z = agreement(0, 400, 0, 400)
    assert (z.band_lo, z.band_hi) == (-0.05, 0.05)


def test_a_small_difference_with_little_data_is_not_a_miss_but_a_large_one_with_much_data_is():
    assert agreement(0, 100, 8, 200).agrees            # 4 points apart, the data cannot reject 5
    assert not agreement(0, 4000, 800, 4000).agrees     # 20 points apart, thousands of trials


def test_the_predicted_value_inside_the_measured_interval_is_not_enough_when_it_is_far():
    """Not 'an interval that contains its own estimate': a simulated value with much data and
    12 points off fails although the measured interval of 100 trials alone would be wide."""
    a = agreement(20, 100, 4000, 10000)
    assert a.p_sim - a.p_gpu == pytest.approx(0.2) and a.p_sim > a.gpu_hi
    assert not a.agrees
    # inside the measured interval: agrees, as the rule allows the interval's half-width
    b = agreement(20, 100, 2800, 10000)
    assert b.gpu_lo < b.p_sim < b.gpu_hi and b.agrees and b.within
    # and the simulated value's own error counts: 10 runs, 1 stale, against 80 of 100
    c = agreement(80, 100, 1, 10)
    assert not c.agrees


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.data())
def test_newcombe_interval_contains_the_difference_and_is_ordered(n1, n2, data):
    k1 = data.draw(st.integers(0, n1))
    k2 = data.draw(st.integers(0, n2))
    lo, hi = newcombe_interval(k1, n1, k2, n2)
    d = k1 / n1 - k2 / n2
    assert -1 <= lo <= d + 1e-12 and d - 1e-12 <= hi <= 1
    # symmetric under swapping the samples
    lo2, hi2 = newcombe_interval(k2, n2, k1, n1)
    assert lo2 == pytest.approx(-hi) and hi2 == pytest.approx(-lo)
    assert 0.0 <= two_proportion_p(k1, n1, k2, n2) <= 1.0


def test_the_rule_rejects_about_five_percent_of_equal_points_at_most():
    """Coverage check: equal true probabilities 0.3, 100 GPU trials and 200 runs: the rule calls
    a miss rarely (it tests |d| <= tol, so much less than 5 % of the time)."""
    rng = np.random.default_rng(0)
    misses = sum(not agreement(int(rng.binomial(100, 0.3)), 100, int(rng.binomial(200, 0.3)), 200).agrees
                 for _ in range(400))
    assert misses <= 20


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        agreement(5, 4, 0, 1)
    with pytest.raises(ValueError):
        agreement(0, 0, 0, 1)


def test_the_fit_stale_rule_matches_the_simulator_at_an_intermediate_point():
    """benchmarks/agreement.py --rule: the fit's stale rule (read skew by the bytes beside, rate
    factor, link) gives the simulator's stale probability (here about 1/2, where they differ most)."""
    from gpu_backend.calibrate.spread import race_doc
    from gpu_backend.calibrate.spread_fit import rule_stale_probability
    from gpu_backend.replay import simulate_stale
    from sim.profile import load_profile
    from sim.schedule import validate

    prof = load_profile("h200-calibrated")
    rule = rule_stale_probability(prof, 256, 256, 10.0)
    assert 0.2 < rule < 0.8
    per_read, _ = simulate_stale(validate(race_doc(256, 256, 10.0)), prof, seeds=120, seed=0)
    assert sum(per_read.values()) / 120 == pytest.approx(rule, abs=0.14)
    assert rule_stale_probability(prof, 1024, 4096, 3.0) == 1.0     # the read long before a long copy's end


def test_session_spread_widens_only_the_simulated_side_and_only_where_given():
    """``agreement(..., session=(below, above))``: no spread is the old test; a spread widens the
    difference interval on the side it is given, in quadrature; a far point still misses."""
    a0 = agreement(99, 100, 120, 200)
    assert agreement(99, 100, 120, 200, session=(0.0, 0.0)) == a0
    a1 = agreement(99, 100, 120, 200, session=(0.0, 0.4))
    assert a1.diff_lo == a0.diff_lo and a1.diff_hi > a0.diff_hi
    below = a0.p_sim - a0.p_gpu - a0.diff_lo
    assert a0.p_sim - a0.p_gpu - agreement(99, 100, 120, 200, session=(0.3, 0.0)).diff_lo == \
        pytest.approx(np.hypot(below, 0.3))
    assert not a0.agrees and a1.agrees
    assert not agreement(1, 100, 172, 200, session=(0.2, 0.2)).agrees     # 0.01 against 0.86
    with pytest.raises(ValueError):
        agreement(1, 100, 1, 200, session=(-0.1, 0.0))


def _window_margins(edge_us: float, width_us: float) -> np.ndarray:
    """rule_margins of a window whose stale probability falls linearly from 1 to 0 over
    ``[edge - width/2, edge + width/2]`` of compute time."""
    return np.sort(np.linspace(edge_us - width_us / 2, edge_us + width_us / 2, 2001))


def test_session_spread_is_zero_where_the_window_is_flat():
    from gpu_backend.calibrate.session_fit import session_spread

    m = _window_margins(10.0, 2.0)
    assert session_spread(m, 30.0, 0.7) == (0.0, 0.0, 0.0)          # far past the window: 0 +- 0
    p0, lo, hi = session_spread(m, 10.0, 0.5)
    assert p0 == pytest.approx(0.5, abs=0.01) and lo == pytest.approx(0.01, abs=0.01) and hi == pytest.approx(0.99, abs=0.01)


def test_session_jitter_fit_recovers_sigma_from_synthetic_sessions():
    """Sessions drawn with a per-point, per-session shift of sigma = 0.6 us (and per-point
    locations the fit must not mistake for jitter) give back about 0.6; sessions without jitter
    give about 0."""
    from gpu_backend.calibrate.session_fit import fit_session_jitter

    rng = np.random.default_rng(3)
    shapes = [(64 * (i + 1), 256) for i in range(16)]
    curves = {sh: _window_margins(10.0 + 0.3 * i, 3.0) for i, sh in enumerate(shapes)}

    def sessions(sigma):
        out = [dict() for _ in range(3)]
        for sh in shapes:
            mu = rng.uniform(-1, 1)
            for s in out:
                c = 10.0 + 0.3 * shapes.index(sh)
                p = 1 - np.searchsorted(curves[sh], c + mu + rng.normal(0, sigma), side="right") / 2001 \
                    if sigma else 1 - np.searchsorted(curves[sh], c + mu, side="right") / 2001
                s[(sh[0], sh[1], c)] = (int(rng.binomial(100, p)), 100)
        return out

    grid = np.round(np.arange(0, 1.6, 0.1), 2)
    fit = fit_session_jitter(None, sessions(0.6), sigma_grid=grid, margins_of=lambda b, t: curves[(b, t)])
    assert 0.3 <= fit["sigma_us"] <= 0.9 and fit["gain"] > 3
    fit0 = fit_session_jitter(None, sessions(0.0), sigma_grid=grid, margins_of=lambda b, t: curves[(b, t)])
    assert fit0["sigma_us"] <= 0.2


def test_row_fit_writes_a_profile_the_simulator_reads():
    """``apply_rows_to_profile_text``: the row factors land in [link], the beside tables are the
    plain table moved by the offsets, [fit.rows] / [fit.session] record the fit; applying it twice
    leaves one copy of each."""
    from gpu_backend.calibrate.row_fit import apply_rows_to_profile_text
    from gpu_backend.calibrate.spread_fit import BESIDE_UPTO
    from sim.profile import load_profile, profile_from_dict, tomllib

    path = "sim/profiles/h200-calibrated-sglang.toml"
    with open(path) as f:
        text = f.read()
    plain = list(load_profile(path).timing_table("read_after_compute_us").values)
    fit = {"row_factors": [(128, 1.0), (1024, 0.8)], "offsets_us": [0.5] * (len(BESIDE_UPTO) + 1),
           "bucket_points": [1] * (len(BESIDE_UPTO) + 1), "upto_bytes": list(BESIDE_UPTO), "plain_skew": plain,
           "nll_start": 2.0, "nll": 1.0, "points": 10, "sessions": 2}
    session = {"sigma_us": 0.4, "gain": 3.0, "points": [[1, 2, 3.0]], "sessions": 2}
    new = apply_rows_to_profile_text(apply_rows_to_profile_text(text, fit, None, "t"), fit, session, "t")
    doc = tomllib.loads(new)
    prof = profile_from_dict(doc, "x")
    assert prof.row_factors == ((128, 1.0), (1024, 0.8))
    assert doc["fit"]["session"]["jitter_us"] == 0.4 and doc["fit"]["rows"]["points"] == 10
    tables = doc["timing"]["beside"]["read_after_compute_us"]["tables"]
    assert np.allclose(tables[3], np.maximum(np.array(plain) + 0.5, 0), atol=1e-4)
    assert new.count("\n[fit.rows]\n") == 1 and new.count("row_factors = [") == 2   # [link] and [fit.rows]


def test_row_fit_frees_the_smallest_row():
    """Round 4: two shapes of one bucket of bytes beside (128 B x 4,096 and 512 B x 1,024, both
    512 KiB) whose windows need opposite moves.  Counts drawn from the fit's own rule with the
    128 B row's factor at 1.3: fitting every factor recovers it (and the counts); holding the
    smallest row at 1 (round 3's rule) cannot, and its likelihood is worse."""
    from dataclasses import replace

    from gpu_backend.calibrate import spread_fit as sf
    from gpu_backend.calibrate.row_fit import fit_rows
    from gpu_backend.calibrate.spread import race_doc
    from sim.profile import load_profile

    prof = load_profile("sim/profiles/h200-calibrated-sglang.toml")
    base = replace(prof, timing=(), timing_beside=(), row_factors=())
    skew = np.asarray(prof.timing_table("read_after_compute_us").values, float)
    rate = np.asarray(prof.timing_table("copy_rate_factor").values, float)
    lead = base.launch_us - base.kernel_launch_us
    truth = {128: 1.3, 512: 1.0}
    session = {}
    for b, t in ((128, 4096), (512, 1024), (128, 64), (512, 64)):
        x = sf._copy_end(race_doc(b, t, 1.0), base) - base.launch_us
        margins = sf.stale_probability(lambda f: f * truth[b] * x + lead, skew, rate)
        for q in (0.2, 0.5, 0.8):      # compute times where the true window is intermediate
            c = float(np.quantile(margins, 1 - q))
            session[(b, t, round(c, 3))] = (int(round(float(sf.stale_at(margins, round(c, 3))) * 400)), 400)
    free = fit_rows(prof, [session], rounds=4)
    held = fit_rows(prof, [session], rounds=4, reference=128)
    g = dict(free["row_factors"])
    assert abs(g[128] / g[512] - 1.3) <= 0.05, free["row_factors"]
    assert dict(held["row_factors"])[128] == 1.0
    assert free["nll"] < held["nll"] - 1.0, (free["nll"], held["nll"])
