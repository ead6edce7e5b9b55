"""Agreement between a measured and a simulated race probability, as a statistical test.

A point of the free sweep has ``k_gpu`` stale trials out of ``n_gpu`` free replays on the GPU and
``k_sim`` stale runs out of ``n_sim`` seeded simulator runs.  The claim (issue 12) is that the
simulated probability lies in the band ``[min(p_gpu - 0.05, lo), max(p_gpu + 0.05, hi)]``
(within 5 percentage points of the measured one, or inside the measured 95 % Wilson interval
``[lo, hi]`` where that is wider), i.e. that ``d = p_sim - p_gpu`` lies in
``[band_lo, band_hi]``.  Both numbers are estimates, so the claim is tested, not read off the
point estimates:

* the 95 % interval of the difference ``p_sim - p_gpu`` is Newcombe's hybrid score interval
  (method 10 of Newcombe 1998, from the two Wilson intervals), which carries both sampling errors
  and behaves at 0 and 1, where the sweep's points mostly are;
* the point **agrees** when that interval meets ``[band_lo, band_hi]`` (the data do not reject
  the claim at the 5 % level); it **misses** when the whole interval lies outside the band on
  one side.

Run-to-run variation (round 3): the GPU's stale probability at a point differs between device
sessions by more than sampling allows.  ``agreement(..., session=(below, above))`` takes the range
of one session's probability about the simulated one (``session_fit``: a per-point, per-session
timing jitter of the fitted ``sigma``, through the point's own window curve) and adds it, in
quadrature, to the simulated side of the interval.  It widens the interval only where the
window's edge is steep enough for ``sigma`` to move the probability; at points where the curve
is flat (0 or 1 over ``+-1.96 sigma``) nothing changes.
``within`` records the plain reading as well (``band_lo <= d <= band_hi`` for the point
estimates), and ``z_p`` the p-value of the pooled two-proportion z-test of equality.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gpu_backend.compare import wilson_interval

__all__ = ["Agreement", "agreement", "newcombe_interval", "two_proportion_p", "TOLERANCE", "predict_points"]

TOLERANCE = 0.05


def newcombe_interval(k1: int, n1: int, k2: int, n2: int, z: float = 1.959964,
                      extra: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """95 % interval of ``k1/n1 - k2/n2`` (Newcombe's hybrid score method from Wilson intervals).

    ``extra = (below, above)``: a further independent 95 % margin of ``p1`` below and above it
    (the range of one GPU session's probability about the simulated one, ``session_fit``),
    combined in quadrature with the sampling margins as Newcombe combines the two Wilson ones."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_interval(k1, n1, z)
    l2, u2 = wilson_interval(k2, n2, z)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2 + extra[0] ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2 + extra[1] ** 2)
    return max(-1.0, lo), min(1.0, hi)


def two_proportion_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test of ``p1 == p2`` (1 when both are
    0 or both 1: no variance, no evidence of a difference)."""
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    zval = abs(k1 / n1 - k2 / n2) / se
    return math.erfc(zval / math.sqrt(2))


@dataclass(frozen=True)
class Agreement:
    """One point's comparison (see the module docstring)."""

    k_gpu: int
    n_gpu: int
    k_sim: int
    n_sim: int
    p_gpu: float
    p_sim: float
    gpu_lo: float
    gpu_hi: float
    band_lo: float
    band_hi: float
    diff_lo: float
    diff_hi: float
    agrees: bool
    within: bool
    z_p: float

    def as_dict(self) -> dict:
        return asdict(self)


def agreement(k_gpu: int, n_gpu: int, k_sim: int, n_sim: int, tolerance: float = TOLERANCE,
              session: tuple[float, float] = (0.0, 0.0)) -> Agreement:
    """Test ``p_sim - p_gpu`` in the band of ``tolerance`` or the measured interval (module docstring).

    ``session = (below, above)``: the range of one GPU session's stale probability below and
    above the simulated one (``gpu_backend.calibrate.session_fit.session_spread``: the fitted
    run-to-run jitter); it widens the simulated side of the difference interval, in quadrature."""
    if min(session) < 0:
        raise ValueError(f"session spread: expected two numbers >= 0, got {session}")
    if n_gpu < 1 or n_sim < 1 or not (0 <= k_gpu <= n_gpu) or not (0 <= k_sim <= n_sim):
        raise ValueError(f"expected 0 <= k <= n and n >= 1, got {k_gpu}/{n_gpu} and {k_sim}/{n_sim}")
    pg, ps = k_gpu / n_gpu, k_sim / n_sim
    lo, hi = wilson_interval(k_gpu, n_gpu)
    band_lo, band_hi = min(-tolerance, lo - pg), max(tolerance, hi - pg)
    dlo, dhi = newcombe_interval(k_sim, n_sim, k_gpu, n_gpu, extra=session)
    d = ps - pg
    return Agreement(k_gpu, n_gpu, k_sim, n_sim, pg, ps, lo, hi, band_lo, band_hi, dlo, dhi,
                     agrees=dlo <= band_hi and dhi >= band_lo, within=band_lo - 1e-12 <= d <= band_hi + 1e-12,
                     z_p=two_proportion_p(k_sim, n_sim, k_gpu, n_gpu))


def _simulate_point(job):
    from gpu_backend.calibrate.spread import race_doc
    from gpu_backend.replay import simulate_stale
    from sim.profile import load_profile
    from sim.schedule import validate

    key, profile, seeds = job
    if isinstance(key, tuple):
        s = validate(race_doc(*key))
    else:
        from sim.schedule import load

        s = load(key)
    per_read, _ = simulate_stale(s, load_profile(profile), seeds=seeds, seed=0)
    return key, sum(per_read.values())


def predict_points(keys: list, profile: str, seeds: int, workers: int = 1) -> dict:
    """Stale runs out of ``seeds`` for each key: a free-sweep point ``(bytes_per_token, tokens,
    compute_us)`` or a schedule file path (its one read).  ``workers > 1`` uses a spawned process
    pool (safe after CUDA has started in this process)."""
    jobs = [(k, profile, seeds) for k in keys]
    if workers <= 1:
        return dict(map(_simulate_point, jobs))
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        return dict(pool.map(_simulate_point, jobs, chunksize=1))
