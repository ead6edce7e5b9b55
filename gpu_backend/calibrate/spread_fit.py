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
3. **Read skew** (``read_skew_table``): in the simulator the read is stale exactly when
   ``c + kernel_launch_us + R < E``, with ``E`` the copy's simulated end (step 1's profile, no
   skew) and ``R`` the read's extra launch delay after a compute op; so ``R = E -
   kernel_launch_us - Z``, and its quantile at ``q`` is ``E - kernel_launch_us - Z(1 - q)``.
   The shapes' quantile functions are averaged (a pooled shape: between-shape differences of
   the median are model error, not spread).  Values below 0 cannot be delays of the read: the
   table is shifted up by ``m = -min`` and the copy after its wait is delayed by the constant
   ``m`` instead (only the difference is observed here).
4. **Copy rate factor** (``rate_factor_table``): each timed run's copy duration over its shape's
   median, pooled over the shapes whose copy takes at least ``min_us``: the per-run spread of the
   copy rate (``Profile.for_run`` draws one per run).
"""
from __future__ import annotations

import numpy as np

__all__ = ["QUANTILES", "pava_nonincreasing", "survival", "window_quantiles", "refit_link", "read_skew_table",
           "rate_factor_table", "fit_timing", "timing_toml"]

#: the probabilities of the written tables: 0, 0.05, ..., 1
QUANTILES = np.linspace(0.0, 1.0, 21)


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
        if q <= cdf[0]:
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


def _copy_end(doc: dict, profile) -> float:
    from sim.executor import run_schedule
    from sim.schedule import validate

    s = validate(doc)
    run = run_schedule(s, profile, seed=0, materialise=False)
    return max(float(e.max()) for e in run.item_end_us.values() if e.size)


def read_skew_table(shapes: list[dict], profile, probs=QUANTILES) -> tuple[np.ndarray, float, list[dict]]:
    """``(read skew quantiles, copy-after-wait constant m, per-shape rows)`` (module docstring,
    step 3); ``profile`` is the refitted profile without skew tables."""
    per, rows = [], []
    for sh in shapes:
        sc = sh["scan"]
        uc, s, _ = survival(sc["compute_us"], sc["trials"], sc["stale"])
        if s[-1] > 0.05:
            # NOTE: still stale at the largest c measured: the window's upper part is not observed
            rows.append({"label": sh["label"], "censored": f"stale fraction {s[-1]:.2f} at c = {uc[-1]:.1f} us"})
            continue
        z = window_quantiles(sc["compute_us"], sc["trials"], sc["stale"], probs)
        e = _copy_end(sh["doc"], profile)
        r = e - profile.kernel_launch_us - z[::-1]
        per.append(r)
        rows.append({"label": sh["label"], "sim_copy_end_us": e, "z_median_us": float(np.interp(0.5, probs, z)),
                     "read_skew_median_us": float(np.interp(0.5, probs, r))})
    pooled = np.maximum.accumulate(np.mean(per, axis=0))
    m = max(0.0, -float(pooled.min()))
    return pooled + m, m, rows


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


def fit_timing(spread: dict, base_profile, sweep_rows: list[dict] | None = None, *, fixed_link: bool = False) -> dict:
    """Everything the profile gets from one provider's scans: the refitted link keys, the
    ``[timing]`` tables and the per-shape diagnostics."""
    from dataclasses import replace

    shapes = [sh for sh in spread["shapes"] if "scan" in sh]
    n, ib, us = [], [], []
    for sh in shapes:
        ops = [op for op in sh["doc"]["ops"] if op.get("op") == "copy"]
        if ops and ops[0]["routine"] in ("kernel_per_layer", "dsa_indexer_per_layer"):
            from sim.schedule import validate

            op = [o for o in validate(sh["doc"]).ops if o.op == "copy"][0]
            ext_bytes = op.plan.extents.item_bytes()
            t = sh["timed"]
            n.append(op.plan.n_items)
            ib.append(int(ext_bytes.max()))
            us.append(float(np.median(np.asarray(t["copy_end_us"]) - np.asarray(t["copy_start_us"]))))
    for r in sweep_rows or []:
        if r.get("gpu_copy_us_p50") not in (None, "") and np.isfinite(float(r["gpu_copy_us_p50"])):
            n.append(int(r["tokens"]))
            ib.append(int(r["bytes_per_token"]))
            us.append(float(r["gpu_copy_us_p50"]))
    link = None
    prof = replace(base_profile, timing=())
    if not fixed_link and len(set(ib)) >= 2:
        link = refit_link(n, ib, us, base_profile.resident_warps)
        prof = replace(prof, h2d_gbps=link["gbps"], warp_gbps=link["warp_gbps"], launch_us=link["launch_us"],
                       item_overhead_us=link["item_overhead_us"])
    skew, m, rows = read_skew_table(shapes, prof)
    rate = rate_factor_table(shapes)
    tables = {"read_after_compute_us": [float(x) for x in skew]}
    if m > 0:
        tables["copy_after_wait_us"] = [m]
    if rate is not None:
        tables["copy_rate_factor"] = [float(x) for x in rate]
    return {"profile": prof, "link": link, "timing": tables, "shapes": rows, "copy_samples": len(us)}


def timing_toml(tables: dict, comment: str) -> str:
    """The ``[timing]`` table as TOML text (``comment`` lines first)."""
    lines = [f"# {line}" for line in comment.splitlines()] + ["[timing]"]
    for key in sorted(tables):
        vals = ", ".join(f"{v:.4f}" for v in tables[key])
        lines.append(f"{key} = [{vals}]")
    return "\n".join(lines) + "\n"
