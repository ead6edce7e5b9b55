"""Run-to-run variation of the GPU: a per-session timing jitter fitted from repeated sweeps.

The same free-sweep point measured in different device sessions (one session: one process that
replays every point once) gives stale counts that differ by far more than binomial sampling
allows (results/gpu_fidelity.md, round 3: heterogeneity chi-square 113.6 on 26 degrees of
freedom for sglang, 86.1 on 26 for builtin).  The variation is not one shift shared by a
session's points (the best single shift per session is within 0.2 us of the other sessions'),
so it is modelled per point and session:

    in session ``j``, point ``x`` (compute ``c``) is stale with probability
    ``pi_xj = S_x(c + mu_x + delta_xj)``, ``delta_xj ~ N(0, sigma^2)`` independent,

where ``S_x(c)`` is the point's stale probability as a function of the compute time by the fit's
rule (``spread_fit.rule_margins``: the window's shape from the profile), ``mu_x`` a free
location per point (the profile's error at that point is not the session variation) and
``sigma`` (microseconds) common to every point of a provider.  A session's stale trials are
``Binomial(n, pi_xj)``.  ``fit_session_jitter`` maximises the marginal likelihood
``prod_x max_mu prod_j integral Binom(k_xj; n_xj, S_x(c + mu + delta)) phi_sigma(delta) ddelta``
over ``sigma`` (Gauss-Hermite quadrature, a grid over ``mu`` and ``sigma``).  Points whose
sessions are all 0 or all ``n`` carry no information about ``sigma`` and are left out.

``session_spread`` turns ``sigma`` into the range of one session's stale probability at a point:
``S(c + z sigma)`` and ``S(c - z sigma)`` around ``S(c)``, which ``gpu_backend.agreement``
adds to the simulated side of the difference interval (docs/timing.md, "Run-to-run variation").
Pure numpy; no GPU.
"""
from __future__ import annotations

import numpy as np

from gpu_backend.calibrate.spread_fit import rule_margins, stale_at

__all__ = ["SIGMA_GRID_US", "MU_GRID_US", "point_loglik", "fit_session_jitter", "session_spread",
           "point_session_spread", "profile_jitter_us", "Z95"]

#: the sigma values tried (us)
SIGMA_GRID_US = np.round(np.arange(0.0, 3.0001, 0.05), 3)
#: the per-point locations tried (us)
MU_GRID_US = np.round(np.arange(-8.0, 8.0001, 0.1), 3)
Z95 = 1.959964
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(41)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()


def point_loglik(margins: np.ndarray, compute_us: float, counts, sigma_us: float,
                 mu_grid=MU_GRID_US) -> np.ndarray:
    """Log-likelihood of one point's session counts ``[(k, n), ...]`` for every ``mu`` of
    ``mu_grid`` at jitter ``sigma_us`` (binomial coefficients left out: they do not depend on
    the parameters)."""
    k = np.array([c[0] for c in counts], float)
    n = np.array([c[1] for c in counts], float)
    shifts = compute_us + mu_grid[:, None] + sigma_us * _NODES[None, :]         # (mu, node)
    p = np.clip(stale_at(margins, shifts), 1e-9, 1 - 1e-9)
    # (mu, node, session)
    ll = k[None, None, :] * np.log(p)[:, :, None] + (n - k)[None, None, :] * np.log1p(-p)[:, :, None]
    top = ll.max(axis=1, keepdims=True)
    per_session = np.log(np.sum(_WEIGHTS[None, :, None] * np.exp(ll - top), axis=1)) + top[:, 0, :]
    return per_session.sum(axis=1)


def fit_session_jitter(profile, sessions: list[dict], sigma_grid=SIGMA_GRID_US, margins_of=None) -> dict:
    """``sigma`` (us) by maximum marginal likelihood from ``sessions``: one dict per session
    mapping ``(bytes_per_token, tokens, compute_us)`` to ``(stale trials, trials)``.

    Returns ``sigma_us``, the log-likelihood per sigma (``loglik``), the gain over ``sigma = 0``
    (``gain``, with the likelihood-ratio statistic ``2 x gain``), the informative ``points``
    and the sessions' count.  ``margins_of(b, t)`` gives a point's ``rule_margins`` (default: the
    profile's rule; a test passes its own curves)."""
    margins_of = margins_of or (lambda b, t: rule_margins(profile, b, t))
    keys = sorted(set.intersection(*[set(s) for s in sessions]))
    informative = []
    for key in keys:
        counts = [s[key] for s in sessions]
        if sum(c[0] for c in counts) in (0, sum(c[1] for c in counts)):
            continue
        informative.append((key, counts))
    margins = {}
    total = np.zeros(len(sigma_grid))
    for (b, t, c), counts in informative:
        if (b, t) not in margins:
            margins[(b, t)] = margins_of(b, t)
        total += np.array([point_loglik(margins[(b, t)], c, counts, float(s)).max() for s in sigma_grid])
    i = int(np.argmax(total))
    return {"sigma_us": float(sigma_grid[i]), "loglik": total.tolist(), "sigma_grid": list(map(float, sigma_grid)),
            "gain": float(total[i] - total[0]), "points": [list(k) for k, _ in informative],
            "sessions": len(sessions)}


def profile_jitter_us(path: str) -> float:
    """``[fit.session] jitter_us`` of a profile TOML file (0 where it has none)."""
    from sim.profile import tomllib

    with open(path, "rb") as f:
        doc = tomllib.load(f)
    return float(doc.get("fit", {}).get("session", {}).get("jitter_us", 0.0))


def point_session_spread(profile, key, compute_us: float | None = None, sigma_us: float = 0.0
                         ) -> tuple[float, float]:
    """``(below, above)`` for ``gpu_backend.agreement.agreement(session=...)``: how far one
    session's stale probability reaches below and above the rule's at a free-sweep point
    ``key = (bytes_per_token, tokens, compute_us)`` or a schedule document (its compute op's
    duration), at jitter ``sigma_us``."""
    from gpu_backend.calibrate.spread_fit import rule_margins_doc

    if sigma_us <= 0:
        return 0.0, 0.0
    if isinstance(key, dict):
        margins = rule_margins_doc(profile, key)
        c = float(next(o for o in key["ops"] if o["op"] == "compute")["duration_us"]) if compute_us is None \
            else compute_us
    else:
        b, t, c = key
        margins = rule_margins(profile, b, t)
    p0, lo, hi = session_spread(margins, c, sigma_us)
    return p0 - lo, hi - p0


def session_spread(margins: np.ndarray, compute_us: float, sigma_us: float, z: float = Z95
                   ) -> tuple[float, float, float]:
    """``(S(c), lowest, highest)``: the point's stale probability by the rule and the range of
    one session's probability, ``S(c + z sigma)`` .. ``S(c - z sigma)`` (S does not increase
    with the compute time)."""
    p0, lo, hi = stale_at(margins, [compute_us, compute_us + z * sigma_us, compute_us - z * sigma_us])
    return float(p0), float(min(lo, p0)), float(max(hi, p0))
