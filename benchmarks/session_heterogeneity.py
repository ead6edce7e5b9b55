"""Run-to-run heterogeneity of the GPU's stale counts: the same free-sweep points, several sessions.

    python benchmarks/session_heterogeneity.py CSV CSV [CSV ...]

Each CSV is one device session's free sweep of one provider (``benchmarks/free_sweep.py`` or the
GPU agreement test's output).  For every point measured in all sessions whose counts are not all
0 or all ``n``, Pearson's chi-square of homogeneity (the sessions' stale / fresh counts as a
sessions x 2 table, ``sessions - 1`` degrees of freedom); the sum over points and its p-value test
whether the sessions share one stale probability per point.  Prints one line per point and the
total.  Pure Python + numpy; no GPU.
"""
from __future__ import annotations

import csv
import math
import sys

import numpy as np


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of the chi-square distribution (regularised incomplete gamma, series or
    continued fraction)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a)))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1.0 / d if d else 1e300
        c = b + an / c
        h *= d * c
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def load(path: str) -> dict:
    with open(path) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {(float(r["compute_us"]), int(r["bytes_per_token"]), int(r["tokens"])):
                (int(r["stale_trials"]), int(r["trials"])) for r in rows}


def heterogeneity(sessions: list[dict]) -> tuple[list[tuple], float, int, float]:
    """(per-point rows, total chi-square, degrees of freedom, p-value)."""
    keys = sorted(set.intersection(*[set(s) for s in sessions]))
    out, total, dof = [], 0.0, 0
    for key in keys:
        k = np.array([s[key][0] for s in sessions], float)
        n = np.array([s[key][1] for s in sessions], float)
        if k.sum() in (0, n.sum()):
            continue
        p = k.sum() / n.sum()
        chi = float(np.sum((k - n * p) ** 2 / (n * p) + ((n - k) - n * (1 - p)) ** 2 / (n * (1 - p))))
        total += chi
        dof += len(k) - 1
        out.append((key, k.astype(int).tolist(), chi, chi2_sf(chi, len(k) - 1)))
    return out, total, dof, chi2_sf(total, dof) if dof else 1.0


def main(argv=None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if len(paths) < 2:
        print(__doc__)
        return 2
    rows, total, dof, p = heterogeneity([load(p) for p in paths])
    for key, counts, chi, pp in rows:
        print(f"compute {key[0]:g} us, {key[1]} B x {key[2]}: stale {counts}; chi-square {chi:.1f}, p {pp:.2g}")
    print(f"{len(rows)} points with variation over {len(paths)} sessions: chi-square {total:.1f} on {dof} "
          f"degrees of freedom, p = {p:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
