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
