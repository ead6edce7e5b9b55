"""Interval estimates for the fraction of trials that saw a race."""
from __future__ import annotations

import math

__all__ = ["Z95", "wilson_interval"]

#: the two-sided 95 % quantile of the standard normal
Z95 = 1.959963984540054


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of the proportion ``k / n`` (95 % by default).

    ``(0.0, 1.0)`` when ``n == 0`` (nothing is known).  The interval always
    contains ``k / n``: at ``k == 0`` its lower end is exactly 0 and at
    ``k == n`` its upper end exactly 1 (rounding could otherwise leave the
    estimate a hair outside its own interval)."""
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"expected 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else max(0.0, min(p, centre - half))
    hi = 1.0 if k == n else min(1.0, max(p, centre + half))
    return lo, hi
