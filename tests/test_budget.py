"""The colocated decode-memory budget's arithmetic (sim.engine.budget), from SGLang 0.5.14's
``NewTokenRatioTracker`` and ``ScheduleBatch.retract_decode``."""

from __future__ import annotations

import pytest

from sim.engine.budget import NewTokenRatio, retract_order


def test_new_token_ratio_schedule_is_sglangs():
    r = NewTokenRatio.from_conservativeness(1.0)
    assert r.init == r.current == pytest.approx(0.7)
    assert r.floor == pytest.approx(0.7 * 0.14)
    assert r.decay == pytest.approx((0.7 - 0.098) / 600)
    r.decay_step()
    assert r.current == pytest.approx(0.7 - r.decay)
    for _ in range(1000):
        r.decay_step()
    assert r.current == pytest.approx(r.floor)
    r.reset()
    assert r.current == pytest.approx(0.7)
    assert NewTokenRatio.from_conservativeness(2.0).init == 1.0     # min(0.7 x 2, 1)
    assert NewTokenRatio.from_conservativeness(0.5).init == pytest.approx(0.35)


def test_ratio_after_a_retraction():
    r = NewTokenRatio.from_conservativeness(1.0)
    r.after_retract(decoded=100, max_new=1000, running=3)
    assert r.current == pytest.approx((100 + 20 * 3) / 1001)
    r.after_retract(decoded=900, max_new=100, running=3)
    assert r.current == 1.0


def test_retract_order_takes_the_fewest_outputs_then_the_longest_input_first():
    rids = [10, 11, 12, 13, 14]
    decoded = {10: 5, 11: 1, 12: 5, 13: 1, 14: 9}
    inputs = {10: 100, 11: 300, 12: 200, 13: 100, 14: 50}
    order = retract_order(rids, decoded, inputs)
    # requests leave from the end: fewest outputs first, ties the longest input first
    assert order == [14, 10, 12, 13, 11]
    assert [order.pop() for _ in range(2)] == [11, 13]
    # equal keys keep batch order (SGLang's stable sort)
    assert retract_order([3, 1, 2], {1: 0, 2: 0, 3: 0}, {1: 7, 2: 7, 3: 7}) == [3, 1, 2]
