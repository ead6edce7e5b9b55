"""The profile's ``[timing]`` distributions from race-window scans (no GPU; see docs/timing.md).

Input: the raw JSON of ``gpu_backend.calibrate.spread`` (per shape: stale counts over compute
times ``c``, and timed runs) and, optionally, free-sweep CSVs measured with ``--timed`` (the
copy's duration per shape).  Three steps:

1. **Copy timing** (``refit_link``): ``sim.transfers.timing``'s kernel-copy model (``launch_us``,
   ``item_overhead_us``, ``h2d_gbps``, ``warp_gbps``) fitted by ``fit_kernel_warp_rate`` to the
   median durations (CUDA events around the copy) of every measured ``kernel_per_layer`` shape.
2. **Race window** (``window_quantiles``): per shape, ``S(c)`` = stale fraction at ``c``, made
   non-increasing by pool-adjacent-violators (weighted by trials), is the survival function of
   ``Z``, the latest ``c`` at which the read is still stale.  Its quantiles are read off by linear
   interpolation; where ``S`` is below 1 at the smallest ``c`` measured (the lower tail is not
   observed) the quantiles there are clamped to that ``c``, likewise at the top.
3. **Read skew and copy rate** (``read_skew_table``): in the simulator the read is stale
   exactly when ``c + kernel_launch_us + R < launch_us + f (E - launch_us)``, with ``E`` the
   copy's simulated end (step 1's profile, no skew), ``R`` the read's extra launch delay after a
   compute op and ``f`` the copy's rate factor.  The shapes whose copy is short (the anchors)
   give ``R``'s distribution, the longer ones ``f`` (see the function).  Values of ``R`` below 0
   cannot be delays of the read: the table is shifted up by ``m = -min`` and the copy after its
   wait is delayed by the constant ``m`` instead (only the difference is observed here).
4. **Copy rate spread** (``rate_factor_table``): each timed run's copy duration over its shape's
   median, pooled over the shapes whose copy takes at least ``min_us``: the per-run spread of the
   copy rate, times ``f`` (``Profile.for_run`` draws one factor per run).
5. **Read skew by the copy beside it** (``beside_offsets``): the read's delay grows with the
   copy running beside it.  The bytes of that copy (what ``Profile.launch_skew`` gets as
   ``beside_bytes``) are cut into buckets (``BESIDE_UPTO``, a factor of 2 apart); each bucket's
   table is step 3's table moved by one offset, fitted by binomial likelihood to every stale
   count of the shapes in that bucket (the scans' and the measured sweeps' points, censored
   shapes included: a count at any ``c`` is evidence).  A bucket without data keeps step 3's table.
"""
from __future__ import annotations

import numpy as np

__all__ = ["BESIDE_UPTO", "beside_offsets", "stale_probability", "rule_stale_probability", "rule_margins", "rule_margins_doc", "stale_at", "QUANTILES", "pava_nonincreasing", "survival", "window_quantiles", "refit_link", "fit_link_model", "read_skew_table", "apply_to_profile_text", "main",
           "rate_factor_table", "fit_timing", "timing_toml"]

#: the probabilities of the written tables: 0, 0.05, ..., 1
QUANTILES = np.linspace(0.0, 1.0, 21)
#: shapes whose simulated copy runs at most this long after its launch set the read skew
ANCHOR_US = 5.0
#: upper bounds (bytes beside the read) of the buckets of the conditional read skew: 2^(k + 1/2)
#: for k = 13 .. 21 (11,585 .. 2,965,821 B), so each bucket holds one of the sweep's power-of-two
#: load sizes (8 KiB .. 4 MiB) and the 136 B rows' loads next to it.  NOTE: buckets a factor of 4
#: apart (two load sizes each) agreed at fewer points (sglang 44, builtin 68 of the 4c0c97d
#: agreement run's points, against 45 and 69): the bytes beside do not order the delay
#: monotonically, so neighbouring sizes must not share an offset
BESIDE_UPTO = tuple(int(round(2 ** (k + 0.5))) for k in range(13, 22))
#: the offsets a bucket's fit tries: steps of this many microseconds, up to BESIDE_MAX_US
BESIDE_STEP_US = 0.05
BESIDE_MAX_US = 20.0


def pava_nonincreasing(y, w) -> np.ndarray:
    """The weighted least-squares non-increasing fit of ``y`` (pool-adjacent-violators)."""
    vals, wts, cnt = [], [], []
    for yi, wi in zip(np.asarray(y, float), np.asarray(w, float)):
        vals.append(yi)
        wts.append(wi)
        cnt.append(1)
        while len(vals) > 1 and vals[-2] < vals[-1]:
            v1, w1, c1 = vals.pop(), wts.pop(), cnt.pop()
            v0, w0, c0 = vals.pop(), wts.pop(), cnt.pop()
            ww = w0 + w1
            vals.append((v0 * w0 + v1 * w1) / ww if ww > 0 else (v0 + v1) / 2)
            wts.append(ww)
            cnt.append(c0 + c1)
    return np.repeat(vals, cnt)


def survival(c, trials, stale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(c, S(c), trials)`` with equal ``c`` merged, sorted, ``S`` non-increasing."""
    c, n, k = (np.asarray(x, float) for x in (c, trials, stale))
    uc, inv = np.unique(np.round(c, 6), return_inverse=True)
    nn = np.bincount(inv, weights=n, minlength=uc.size)
    kk = np.bincount(inv, weights=k, minlength=uc.size)
    return uc, pava_nonincreasing(kk / nn, nn), nn


def window_quantiles(c, trials, stale, probs=QUANTILES) -> np.ndarray:
    """Quantiles of the race window ``Z`` (``P(Z > c) = S(c)``) at ``probs``, clamped to the
    measured range of ``c``."""
    uc, s, _ = survival(c, trials, stale)
    cdf = 1.0 - s                                      # non-decreasing
    out = np.empty(len(probs))
    for i, q in enumerate(probs):
        if q <= 0 and cdf[0] <= 0:
            out[i] = uc[int(np.searchsorted(cdf, 0.0, side="right")) - 1]    # where S starts to fall
        elif q <= cdf[0]:
            out[i] = uc[0]
        elif q > cdf[-1]:
            out[i] = uc[-1]
        else:
            j = int(np.searchsorted(cdf, q, side="left"))    # cdf[j-1] < q <= cdf[j]
            a, b = cdf[j - 1], cdf[j]
            out[i] = uc[j - 1] + (uc[j] - uc[j - 1]) * ((q - a) / (b - a) if b > a else 1.0)
    return np.maximum.accumulate(out)


def refit_link(n_items, item_bytes, us, resident_warps: int) -> dict:
    """``fit_kernel_warp_rate`` on ``kernel_per_layer`` copies (medians of timed runs)."""
    from gpu_backend.calibrate.fit import fit_kernel_warp_rate

    return fit_kernel_warp_rate("kernel_per_layer", n_items, item_bytes, us, resident_warps)


def fit_link_model(plans: list, us, base_profile) -> dict:
    """``launch_us``, ``item_overhead_us``, ``h2d_gbps`` and ``warp_gbps`` of
    ``sim.transfers.timing`` fitted to measured copy times ``us`` of the copy ``plans`` (least
    squares on relative error), with the profile's own worker rule (``link.kernel_workers``),
    row factors (``link.row_factors``, kept as they are) and resident warps: a grid over the two rates, refined once, ``launch_us`` and
    ``item_overhead_us`` by NNLS at each point (a copy ends ``launch_us + rounds x
    item_overhead_us`` plus its rounds' transfer times)."""
    from gpu_backend.calibrate.fit import nnls
    from sim.transfers.timing import LinkTiming, copy_end_us, item_rounds, row_factor

    us = np.asarray(us, dtype=np.float64)
    rule, rw = base_profile.kernel_workers, base_profile.resident_warps

    def times(g, w):
        t = LinkTiming(gbps=g, warp_gbps=w, resident_warps=rw, workers=rule, row_factors=base_profile.row_factors)
        # NOTE: a row factor scales a round's overhead too, so the overhead's column carries it
        rounds = np.array([(int(item_rounds(p, t)[-1]) + 1) * row_factor(t, int(np.asarray(p.extents.length).max()))
                           if p.n_items else 0 for p in plans], dtype=np.float64)
        return rounds, np.array([copy_end_us(p, t) for p in plans])

    def score(g, w):
        rounds, t0 = times(g, w)
        A = np.stack([np.ones_like(us), rounds], axis=1) / us[:, None]
        y = (us - t0) / us
        x = nnls(A, y)
        pred = x[0] + rounds * x[1] + t0
        return float(np.sum(((pred - us) / us) ** 2)), x, pred

    best = None
    for stage in (0, 1):
        if stage == 0:
            gs, ws = np.geomspace(5, 200, 18), np.geomspace(0.2, 50, 18)
        else:
            gs, ws = best[1] * np.geomspace(0.85, 1.18, 9), best[2] * np.geomspace(0.8, 1.25, 9)
        for g in gs:
            for w in ws:
                r, x, pred = score(float(g), float(w))
                if best is None or r < best[0]:
                    best = (r, float(g), float(w), x, pred)
    _, g, w, x, pred = best
    rel = np.abs(pred - us) / us
    return {"gbps": g, "warp_gbps": w, "launch_us": float(x[0]), "item_overhead_us": float(x[1]),
            "workers": rule, "rel_err_median": float(np.median(rel)), "rel_err_max": float(rel.max()),
            "rel_err_rms": float(np.sqrt(np.mean(rel ** 2))), "samples": int(us.size)}


def _copy_end(doc: dict, profile) -> float:
    from sim.executor import run_schedule
    from sim.schedule import validate

    s = validate(doc)
    run = run_schedule(s, profile, seed=0, materialise=False)
    return max(float(e.max()) for e in run.item_end_us.values() if e.size)


def read_skew_table(shapes: list[dict], profile, probs=QUANTILES, *, anchor_us: float = ANCHOR_US
                    ) -> tuple[np.ndarray, float, float, list[dict]]:
    """``(read skew quantiles, copy-after-wait constant m, rate factor f, per-shape rows)``
    (module docstring, steps 3 and 4); ``profile`` is the refitted profile without skew tables.

    In the simulator a shape's read is stale at ``c`` exactly when ``c + kernel_launch_us + R <
    launch_us + f (E - launch_us)``, ``E`` its simulated copy end and ``f`` the copy's rate
    factor, so ``R(q) = f (E - launch_us) + launch_us - kernel_launch_us - Z(1 - q)``.

    * The read skew comes from the **anchor** shapes, whose copy runs at most ``anchor_us`` after
      its launch (``E - launch_us``): there the copy's rate hardly matters, and the window is the
      read's own delay.  Their quantile functions are averaged about their medians.
    * The rate factor ``f`` comes from the longer shapes: each one's median window gives
      ``f_s = (Z_med + kernel_launch_us + R_med - launch_us) / (E - launch_us)``; ``f`` is the
      median of the ``f_s``.  ``f`` below 1 says the read sees the copy's last byte before the
      event after the copy kernel records (its timed duration, which the link fit follows).
    * ``R`` depends on ``f`` through the anchors and ``f`` on ``R``'s median: 20 rounds of
      fixed-point iteration from ``f = 1``.

    Without anchor shapes every uncensored shape is an anchor and ``f = 1``."""
    per, rows, es = [], [], []
    for sh in shapes:
        sc = sh["scan"]
        uc, s, _ = survival(sc["compute_us"], sc["trials"], sc["stale"])
        if s[-1] > 0.05 or s[0] < 0.95:
            # NOTE: still stale at the largest c measured, or already clean at the smallest: a
            # tail of the window is not observed (c cannot go below 0), so the shape's quantiles
            # would be clamped there; it is left out
            rows.append({"label": sh["label"], "censored": f"stale fraction {s[0]:.2f} at c = {uc[0]:.1f} us, "
                                                           f"{s[-1]:.2f} at c = {uc[-1]:.1f} us"})
            continue
        z = window_quantiles(sc["compute_us"], sc["trials"], sc["stale"], probs)
        e = _copy_end(sh["doc"], profile)
        per.append(z)
        es.append(e)
        rows.append({"label": sh["label"], "sim_copy_end_us": e, "z_median_us": float(np.interp(0.5, probs, z))})
    if not per:
        raise ValueError("no race-window scan with both tails observed; scan longer copies or more compute times")
    L, kl = profile.launch_us, profile.kernel_launch_us
    x = np.asarray(es) - L
    anchors = [i for i in range(len(per)) if x[i] <= anchor_us] or list(range(len(per)))
    longer = [i for i in range(len(per)) if i not in anchors]
    f, skew = 1.0, None
    for _ in range(20 if longer else 1):
        r = np.array([f * x[i] + L - kl - per[i][::-1] for i in anchors])
        mids = np.array([np.interp(0.5, probs, ri) for ri in r])
        # NOTE: each anchor's skew about its own median, pooled, then moved to the anchors'
        # median: the spread within a shape is the GPU's, the shapes' different medians are not
        skew = np.maximum.accumulate(np.mean(r - mids[:, None], axis=0) + float(np.median(mids)))
        r_med = float(np.interp(0.5, probs, skew))
        if longer:
            f = float(np.median([(np.interp(0.5, probs, per[i]) + kl + r_med - L) / x[i] for i in longer]))
    live = [row for row in rows if "censored" not in row]
    for i, row in enumerate(live):
        row["role"] = "anchor" if i in anchors else "rate"
        row["read_skew_median_us"] = float(np.interp(0.5, probs, f * x[i] + L - kl - per[i][::-1]))
    m = max(0.0, -float(skew.min()))
    return skew + m, m, f, rows


def rate_factor_table(shapes: list[dict], probs=QUANTILES, min_us: float = 30.0) -> np.ndarray | None:
    """Per-run copy duration over its shape's median, pooled over shapes of ``>= min_us``."""
    ratios = []
    for sh in shapes:
        t = sh["timed"]
        d = np.asarray(t["copy_end_us"], float) - np.asarray(t["copy_start_us"], float)
        if d.size >= 5 and np.median(d) >= min_us:
            ratios.append(d / np.median(d))
    if not ratios:
        return None
    return np.quantile(np.concatenate(ratios), probs)


def _copy_bytes(doc: dict) -> int:
    """Bytes of the schedule's copies (what ``sim.executor``'s ``_bytes_beside`` counts for the
    read of a race document, whose one copy is in flight when the read is ready)."""
    from sim.schedule import validate

    return int(sum(int(np.asarray(o.plan.extents.length).sum()) for o in validate(doc).ops if o.op == "copy"))


def stale_probability(margin_us, skew, rate) -> np.ndarray:
    """``P(R + delta < f x + L + m - kl - c)`` for every ``delta`` of ``margin_us``'s caller: the
    simulator's stale rule with ``R`` and ``f`` drawn independently from the quantile tables
    ``skew`` and ``rate``.  ``margin_us(f)`` gives ``f x + L + m - kl - c`` for an array of ``f``;
    the result is the sorted array of ``margin - R`` over a grid of 201 x 41 quantiles, so that
    ``P(stale | delta) = 1 - searchsorted(result, delta, 'right') / result.size``."""
    from sim.profile import QuantileTable

    r = np.array([QuantileTable(tuple(skew)).quantile(q) for q in np.linspace(0, 1, 201)])
    f = np.array([QuantileTable(tuple(rate)).quantile(q) for q in np.linspace(0, 1, 41)]) if rate is not None \
        else np.ones(1)
    return np.sort((margin_us(f)[:, None] - r[None, :]).ravel())


def rule_margins(profile, bytes_per_token: int, tokens: int) -> np.ndarray:
    """The sorted stale margins of a free-sweep point at ``compute_us = 0`` by the fit's rule
    (``rule_stale_probability``): the point is stale at compute ``c`` with probability
    ``1 - searchsorted(margins, c, 'right') / margins.size``, so one array serves every ``c``."""
    from gpu_backend.calibrate.spread import race_doc

    return rule_margins_doc(profile, race_doc(bytes_per_token, tokens, 1.0))


def rule_margins_doc(profile, doc: dict) -> np.ndarray:
    """``rule_margins`` of any schedule document with one copy racing one read after one compute
    op (the minimal race example), its compute time taken as 0."""
    from dataclasses import replace

    base = replace(profile, timing=(), timing_beside=())
    key = "read_after_compute_us"
    bt = profile.beside_table(key)
    table = bt.table_for(_copy_bytes(doc)) if bt is not None else profile.timing_table(key)
    skew = table.values if table is not None else (0.0,)
    rate = profile.timing_table("copy_rate_factor")
    m = profile.timing_table("copy_after_wait_us")
    x = _copy_end(doc, base) - base.launch_us
    lead = base.launch_us + (m.values[0] if m is not None else 0.0) - base.kernel_launch_us
    return stale_probability(lambda f: f * x + lead, skew, rate.values if rate is not None else None)


def stale_at(margins: np.ndarray, compute_us) -> np.ndarray:
    """``P(stale)`` at each compute time (array-valued) from ``rule_margins``' array."""
    return 1.0 - np.searchsorted(margins, np.asarray(compute_us, float), side="right") / margins.size


def rule_stale_probability(profile, bytes_per_token: int, tokens: int, compute_us: float) -> float:
    """The stale probability of a free-sweep point by the rule the fit assumes (``R`` from the
    profile's read-skew table for the bytes beside, ``f`` from its rate table, the copy's end from
    the profile's link), without running the simulator: a quick check of a fit against measured
    sweeps (``benchmarks/agreement.py --rule``); the simulator's own runs are the reference
    (``tests/test_agreement_cpu.py`` compares the two)."""
    return float(stale_at(rule_margins(profile, bytes_per_token, tokens), compute_us))


def beside_offsets(points: list[dict], skew, rate, upto=BESIDE_UPTO) -> list[dict]:
    """One offset per bucket of ``upto`` (and one above): the ``delta`` that maximises the
    binomial likelihood of the stale counts of the ``points`` in that bucket, where a point
    (``bytes``, ``c``, ``n``, ``k``, ``x`` = its simulated copy's run after its launch, ``L``,
    ``kl``, ``m``) is stale with ``stale_probability`` under ``R + delta``.  ``delta`` runs from
    ``-min(skew)`` (no negative delay) to ``BESIDE_MAX_US`` in steps of ``BESIDE_STEP_US``; among
    equal likelihoods the smallest ``|delta|`` wins, and a bucket without points gets 0."""
    skew = np.asarray(skew, float)
    lowest = -float(skew.min())
    deltas = np.unique(np.round(np.concatenate([[lowest, 0.0], np.arange(np.ceil(lowest / BESIDE_STEP_US) * BESIDE_STEP_US,
                                                                         BESIDE_MAX_US + 1e-9, BESIDE_STEP_US)]), 6))
    out = []
    for i in range(len(upto) + 1):
        lo = upto[i - 1] if i else 0
        hi = upto[i] if i < len(upto) else None
        mine = [p for p in points if p["bytes"] > lo and (hi is None or p["bytes"] <= hi)]
        if not mine:
            out.append({"upto_bytes": hi, "offset_us": 0.0, "points": 0, "trials": 0})
            continue
        nll = np.zeros(deltas.size)
        for p in mine:
            t = stale_probability(lambda f, p=p: f * p["x"] + p["L"] + p["m"] - p["kl"] - p["c"], skew, rate)
            s = 1.0 - np.searchsorted(t, deltas, side="right") / t.size
            s = np.clip(s, 1e-4, 1 - 1e-4)
            nll -= p["k"] * np.log(s) + (p["n"] - p["k"]) * np.log(1 - s)
        best = np.flatnonzero(nll <= nll.min() + 1e-9)
        d = float(deltas[best[np.argmin(np.abs(deltas[best]))]])
        out.append({"upto_bytes": hi, "offset_us": d, "points": len(mine), "trials": int(sum(p["n"] for p in mine))})
    return out


def _beside_points(shapes: list[dict], sweep_rows: list[dict], profile, m: float) -> list[dict]:
    """The stale counts the beside fit uses: every scan point and every measured sweep point."""
    from gpu_backend.calibrate.spread import race_doc

    L, kl = profile.launch_us, profile.kernel_launch_us
    pts, memo = [], {}

    def shape(doc):
        key = doc.get("name", "")
        if key not in memo:
            memo[key] = (_copy_bytes(doc), _copy_end(doc, profile) - L)
        return memo[key]

    for sh in shapes:
        b, x = shape(sh["doc"])
        sc = sh["scan"]
        for c, n, k in zip(sc["compute_us"], sc["trials"], sc["stale"]):
            pts.append({"bytes": b, "c": float(c), "n": int(n), "k": int(k), "x": x, "L": L, "kl": kl, "m": m})
    for r in sweep_rows:
        if r.get("stale_trials") in (None, "") or r.get("trials") in (None, ""):
            continue
        doc = race_doc(int(r["bytes_per_token"]), int(r["tokens"]), 1.0)
        b, x = shape(doc)
        pts.append({"bytes": b, "c": float(r["compute_us"]), "n": int(float(r["trials"])),
                    "k": int(float(r["stale_trials"])), "x": x, "L": L, "kl": kl, "m": m})
    return pts


def fit_timing(spread: dict, base_profile, sweep_rows: list[dict] | None = None, *, fixed_link: bool = False,
               anchor_us: float = ANCHOR_US, beside_upto=BESIDE_UPTO) -> dict:
    """Everything the profile gets from one provider's scans: the refitted link keys, the
    ``[timing]`` tables (with ``beside_upto``, not empty: the read skew by the bytes beside it,
    ``beside_offsets``, under ``tables["beside"]``) and the per-shape diagnostics."""
    from dataclasses import replace

    from gpu_backend.calibrate.spread import race_doc
    from sim.schedule import validate

    shapes = [sh for sh in spread["shapes"] if "scan" in sh]
    plans, us = [], []
    for sh in shapes:
        ops = [o for o in validate(sh["doc"]).ops if o.op == "copy"]
        if ops and ops[0].routine in ("kernel_per_layer", "dsa_indexer_per_layer"):
            t = sh["timed"]
            plans.append(ops[0].plan)
            us.append(float(np.median(np.asarray(t["copy_end_us"]) - np.asarray(t["copy_start_us"]))))
    memo = {}
    for r in sweep_rows or []:
        if r.get("gpu_copy_us_p50") not in (None, "") and np.isfinite(float(r["gpu_copy_us_p50"])):
            key = (int(r["bytes_per_token"]), int(r["tokens"]))
            if key not in memo:
                memo[key] = [o for o in validate(race_doc(*key, 1.0)).ops if o.op == "copy"][0].plan
            plans.append(memo[key])
            us.append(float(r["gpu_copy_us_p50"]))
    link = None
    prof = replace(base_profile, timing=())
    if not fixed_link and len({int(np.asarray(p.extents.length).max()) for p in plans}) >= 2:
        link = fit_link_model(plans, us, prof)
        prof = replace(prof, h2d_gbps=link["gbps"], warp_gbps=link["warp_gbps"], launch_us=link["launch_us"],
                       item_overhead_us=link["item_overhead_us"])
    skew, m, f, rows = read_skew_table(shapes, prof, anchor_us=anchor_us)
    rate = rate_factor_table(shapes)
    tables = {"read_after_compute_us": [float(x) for x in skew]}
    if m > 0:
        tables["copy_after_wait_us"] = [m]
    if rate is not None or f != 1.0:
        tables["copy_rate_factor"] = [float(x) * f for x in (rate if rate is not None else [1.0])]
    beside = None
    if beside_upto:
        offs = beside_offsets(_beside_points(shapes, sweep_rows or [], prof, m), skew,
                              tables.get("copy_rate_factor"), beside_upto)
        tables["beside"] = {"read_after_compute_us": {
            "upto_bytes": list(beside_upto), "tables": [[float(v) + o["offset_us"] for v in skew] for o in offs]}}
        beside = offs
    return {"profile": prof, "link": link, "timing": tables, "shapes": rows, "copy_samples": len(us),
            "rate_median": f, "beside": beside}


def timing_toml(tables: dict, comment: str) -> str:
    """The ``[timing]`` table as TOML text (``comment`` lines first)."""
    lines = [f"# {line}" for line in comment.splitlines()] + ["[timing]"]
    for key in sorted(k for k in tables if k != "beside"):
        vals = ", ".join(f"{v:.4f}" for v in tables[key])
        lines.append(f"{key} = [{vals}]")
    for key, b in sorted(tables.get("beside", {}).items()):
        lines += ["", f"[timing.beside.{key}]", "upto_bytes = [" + ", ".join(str(int(u)) for u in b["upto_bytes"]) + "]",
                  "tables = ["]
        lines += ["  [" + ", ".join(f"{v:.4f}" for v in t) + "]," for t in b["tables"]]
        lines.append("]")
    return "\n".join(lines) + "\n"


def apply_to_profile_text(text: str, fit: dict, source: str) -> str:
    """A profile's TOML text with ``fit``'s link keys replaced in ``[link]`` (the line's comment
    says where they came from), any previous ``[timing]`` and ``[fit.spread]`` tables dropped and
    the new ones appended."""
    import re

    out, skip = [], False
    for line in text.splitlines():
        head = re.match(r"^\[([^\]]+)\]\s*(#.*)?$", line.strip())
        if head:
            skip = head.group(1) in ("timing", "fit.spread") or head.group(1).startswith(("fit.spread.", "timing."))
        if skip or line.startswith("# [timing]") or line.startswith("# timing:"):
            continue
        out.append(line)
    text = "\n".join(out).rstrip("\n") + "\n"
    link = fit.get("link")
    if link:
        for key, val in (("h2d_gbps", link["gbps"]), ("warp_gbps", link["warp_gbps"]),
                         ("launch_us", link["launch_us"]), ("item_overhead_us", link["item_overhead_us"])):
            text = re.sub(rf"(?m)^{key} = [^\n]*$",
                          f"{key} = {val:.6f}".ljust(35) + f"# refit: {fit['copy_samples']} timed kernel copies "
                          "([fit.spread]; gpu_backend.calibrate.spread_fit)", text, count=1)
    text = re.sub(r'(?m)^source = "([^"]*)"$', lambda m: f'source = "{m.group(1).split(" | ")[0]} | {source}"',
                  text, count=1)
    rows = fit["shapes"]
    lines = ["", "[fit.spread]", f'what = "{source}"', f"rate_median = {fit['rate_median']:.6f}"]
    if link:
        lines += [f"link_rel_err_median = {link['rel_err_median']:.6f}", f"link_rel_err_max = {link['rel_err_max']:.6f}",
                  f"link_samples = {fit['copy_samples']}", f'link_workers = "{link["workers"]}"']
    lines.append("shapes = [" + ", ".join(f'"{r["label"]}"' for r in rows) + "]")
    lines.append("z_median_us = [" + ", ".join(f"{r.get('z_median_us', float('nan')):.4f}" if "z_median_us" in r
                                              else "nan" for r in rows) + "]")
    lines.append("role = [" + ", ".join(f'"{r.get("role", "censored")}"' for r in rows) + "]")
    lines.append("read_skew_median_us = [" + ", ".join(f"{r['read_skew_median_us']:.4f}" if "read_skew_median_us" in r
                                                      else "nan" for r in rows) + "]")
    if fit.get("beside"):
        bs = fit["beside"]
        lines.append("beside_offset_us = [" + ", ".join(f"{o['offset_us']:.2f}" for o in bs) + "]")
        lines.append("beside_points = [" + ", ".join(str(o["points"]) for o in bs) + "]")
        lines.append("beside_trials = [" + ", ".join(str(o["trials"]) for o in bs) + "]")
    comment = ("timing: measured distributions (docs/timing.md): quantiles at probabilities 0, 0.05, ..., 1\n"
               "read_after_compute_us: race-window scans (gpu_backend.calibrate.spread); copy_rate_factor: the\n"
               "copy's rate as a concurrent read sees it times the per-run spread of timed copy durations")
    if fit["timing"].get("beside"):
        comment += ("\nbeside.read_after_compute_us: the same table moved by one offset per bucket of the bytes\n"
                    "of the copy in flight beside the read ([fit.spread] beside_offset_us; spread_fit.beside_offsets)")
    return text + "\n".join(lines) + "\n\n" + timing_toml(fit["timing"], comment)


def main(argv=None) -> int:
    """``python -m gpu_backend.calibrate.spread_fit --spread RAW.json --provider P --profile IN.toml
    [--sweep CSV ...] --out OUT.toml``: IN's text with the refitted link keys and the [timing]
    tables from P's scans (and the sweeps' timed copy durations)."""
    import argparse
    import json

    from sim.profile import load_profile

    ap = argparse.ArgumentParser(prog="python -m gpu_backend.calibrate.spread_fit", description=main.__doc__)
    ap.add_argument("--spread", required=True)
    ap.add_argument("--provider", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--sweep", action="append", default=[], help="free_sweep.csv measured with --timed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with open(args.spread) as f:
        raw = json.load(f)
    rows = []
    if args.sweep:
        import csv

        for path in args.sweep:
            with open(path) as f:
                rows += list(csv.DictReader(line for line in f if not line.startswith("#")))
    fit = fit_timing(raw["providers"][args.provider], load_profile(args.profile), rows)
    prov = raw.get("provenance", {})
    source = (f"[timing] and link refit by gpu_backend.calibrate.spread_fit from {args.provider} race-window scans "
              f"on {raw['providers'][args.provider]['device']} ({raw['providers'][args.provider]['date']}, commit "
              f"{str(prov.get('commit', '?'))[:10]})")
    with open(args.profile) as f:
        text = f.read()
    new = apply_to_profile_text(text, fit, source)
    from sim.profile import profile_from_dict, tomllib

    profile_from_dict(tomllib.loads(new), args.out)      # refuse to write a profile sim cannot read
    with open(args.out, "w") as f:
        f.write(new)
    print(f"wrote {args.out}: rate median {fit['rate_median']:.3f}, read skew median "
          f"{np.interp(0.5, QUANTILES, fit['timing']['read_after_compute_us']):.2f} us; offsets by bytes beside "
          + ", ".join(f"<= {o['upto_bytes']}: {o['offset_us']:+.2f} us ({o['points']} points)" for o in fit["beside"] or []))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
