"""Fitting (pure numpy): non-negative least squares on relative error for the kernel, memcpy and
spin models, and the grid fit of the per-warp rate (``warp_gbps``)."""
from __future__ import annotations

import math

import numpy as np

from sim.transfers.timing import concurrency, LinkTiming
from gpu_backend.calibrate.model import model_kernel_us, model_rounds, synthetic_plan


def nnls(A: np.ndarray, y: np.ndarray, required: tuple[int, ...] = ()) -> np.ndarray:
    """Non-negative least squares for a few columns, exactly: the best unconstrained solution
    over every support whose solution is non-negative (the optimum is one of them).  Columns in
    ``required`` are always in the support."""
    A, y = np.asarray(A, dtype=np.float64), np.asarray(y, dtype=np.float64)
    k = A.shape[1]
    if k > 8:
        raise ValueError(f"nnls: expected at most 8 columns, got {k}")
    best, best_r = (None, math.inf) if required else (np.zeros(k), float(np.sum(y ** 2)))
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        if any(j not in cols for j in required):
            continue
        x, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
        if (x < 0).any():
            continue
        r = float(np.sum((A[:, cols] @ x - y) ** 2))
        if best is None or r < best_r:
            full = np.zeros(k)
            full[cols] = x
            best, best_r = full, r
    if best is None:
        raise ValueError("nnls: no non-negative solution with the required columns")
    return best


def _rel_stats(pred: np.ndarray, meas: np.ndarray) -> dict:
    rel = (np.asarray(pred) - np.asarray(meas)) / np.asarray(meas)
    return {"rel_err_median": float(np.median(np.abs(rel))) if rel.size else 0.0,
            "rel_err_max": float(np.max(np.abs(rel))) if rel.size else 0.0,
            "rel_err_rms": float(np.sqrt(np.mean(rel ** 2))) if rel.size else 0.0,
            "samples": int(rel.size)}


def fit_kernel(routine: str, n_items, item_bytes, us, resident_warps: int) -> dict:
    """Fit ``launch_us + R * item_overhead_us + B / gbps`` to kernel copies (relative error)."""
    n_items, item_bytes, us = (np.asarray(x, dtype=np.float64) for x in (n_items, item_bytes, us))
    if us.size < 3:
        raise ValueError(f"fit_kernel({routine}): expected at least 3 samples, got {us.size}")
    rounds = np.array([model_rounds(routine, int(n), int(b), resident_warps)
                       for n, b in zip(n_items, item_bytes)], dtype=np.float64)
    mbytes = n_items * item_bytes / 1e6
    A = np.stack([mbytes, np.ones_like(us), rounds], axis=1) / us[:, None]
    us_per_mb, launch, overhead = nnls(A, np.ones_like(us), required=(0,))
    gbps = 1e3 / us_per_mb
    pred = np.array([model_kernel_us(routine, int(n), int(b), gbps=gbps, launch_us=launch,
                                     item_overhead_us=overhead, resident_warps=resident_warps)
                     for n, b in zip(n_items, item_bytes)])
    return {"routine": routine, "gbps": float(gbps), "launch_us": float(launch),
            "item_overhead_us": float(overhead), "resident_warps": int(resident_warps),
            **_rel_stats(pred, us)}


def fit_memcpy(nbytes, us) -> dict:
    """Fit ``memcpy_latency_us + B / gbps`` to single memcpys (relative error)."""
    nbytes, us = np.asarray(nbytes, dtype=np.float64), np.asarray(us, dtype=np.float64)
    if us.size < 2:
        raise ValueError(f"fit_memcpy: expected at least 2 sizes, got {us.size}")
    A = np.stack([nbytes / 1e6, np.ones_like(us)], axis=1) / us[:, None]
    us_per_mb, lat = nnls(A, np.ones_like(us), required=(0,))
    gbps = 1e3 / us_per_mb
    pred = lat + nbytes / (gbps * 1e3)
    return {"gbps": float(gbps), "latency_us": float(lat),
            "largest_bytes": int(nbytes.max()), "gbps_at_largest": float(nbytes.max() / us[np.argmax(nbytes)] / 1e3),
            **_rel_stats(pred, us)}


def fit_gbps_fixed(routine: str, n_items, item_bytes, us, *, launch_us: float, item_overhead_us: float,
                   resident_warps: int) -> dict:
    """Only ``gbps`` free (launch and round costs held): least squares on relative error."""
    n_items, item_bytes, us = (np.asarray(x, dtype=np.float64) for x in (n_items, item_bytes, us))
    rounds = np.array([model_rounds(routine, int(n), int(b), resident_warps)
                       for n, b in zip(n_items, item_bytes)], dtype=np.float64)
    rest = us - launch_us - rounds * item_overhead_us
    x = n_items * item_bytes / 1e6 / us
    yr = rest / us
    us_per_mb = float(np.sum(x * yr) / np.sum(x * x))
    if us_per_mb <= 0:
        raise ValueError(f"fit_gbps_fixed({routine}): the launch and round costs alone exceed the "
                         "measured times; expected some time left for the bytes")
    gbps = 1e3 / us_per_mb
    pred = np.array([model_kernel_us(routine, int(n), int(b), gbps=gbps, launch_us=launch_us,
                                     item_overhead_us=item_overhead_us, resident_warps=resident_warps)
                     for n, b in zip(n_items, item_bytes)])
    return {"routine": routine, "gbps": float(gbps), "launch_us": float(launch_us),
            "item_overhead_us": float(item_overhead_us), "resident_warps": int(resident_warps),
            **_rel_stats(pred, us)}


def _round_split(routine: str, n_items, resident_warps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per copy: (items per full round W, full rounds, items in the last partial round)."""
    W, full, rem = [], [], []
    for n in n_items:
        n = int(n)
        w = concurrency(synthetic_plan(routine, n, 8), LinkTiming(gbps=1.0, resident_warps=int(resident_warps)))
        W.append(w)
        full.append(n // w)
        rem.append(n % w)
    return (np.array(W, dtype=np.float64), np.array(full, dtype=np.float64), np.array(rem, dtype=np.float64))


def warp_rate_us(routine: str, n_items, item_bytes, *, gbps: float, warp_gbps: float, launch_us: float,
                 item_overhead_us: float, resident_warps: int) -> np.ndarray:
    """The end time ``sim.transfers.timing`` gives a copy of ``n_items`` equal items with the
    per-warp rate: a round takes ``item_overhead_us + max(round_bytes / gbps, item_bytes /
    warp_gbps)``, i.e. one warp moves its item no faster than ``warp_gbps`` however idle the link
    is (the simulator's ``LinkTiming.warp_gbps``, the profile's ``link.warp_gbps``).  Vectorised
    over copies; equal items, so a round's largest item is ``item_bytes``."""
    n = np.asarray(n_items, dtype=np.float64)
    ib = np.asarray(item_bytes, dtype=np.float64)
    W, full, rem = _round_split(routine, n, resident_warps)
    per_item = ib / (warp_gbps * 1e3)
    t = full * np.maximum(W * ib / (gbps * 1e3), per_item) + (rem > 0) * np.maximum(rem * ib / (gbps * 1e3), per_item)
    return launch_us + (full + (rem > 0)) * item_overhead_us + t


def fit_kernel_warp_rate(routine: str, n_items, item_bytes, us, resident_warps: int) -> dict:
    """Least squares (relative error) of ``warp_rate_us``: a grid over ``gbps`` and ``warp_gbps``,
    refined once, with ``launch_us`` and ``item_overhead_us`` by NNLS at each point.  For the
    link provider's ``kernel_per_layer`` H2D copies this fit sets the profile's ``h2d_gbps``,
    ``warp_gbps``, ``launch_us`` and ``item_overhead_us`` (``fit_profile``)."""
    n, ib, us = (np.asarray(x, dtype=np.float64) for x in (n_items, item_bytes, us))
    W, full, rem = _round_split(routine, n, resident_warps)
    R = full + (rem > 0)
    A = np.stack([np.ones_like(us), R], axis=1) / us[:, None]          # (S, 2)

    def scan(gs, ws):
        """Best (score, g, wg, x, pred) over the grid, the 2-column NNLS solved in closed form."""
        g = np.repeat(gs, ws.size)[:, None]
        wg = np.tile(ws, gs.size)[:, None]
        per_item = ib[None, :] / (wg * 1e3)
        t = (full * np.maximum(W * ib / (g * 1e3), per_item)
             + (rem > 0) * np.maximum(rem * ib / (g * 1e3), per_item))    # (G, S)
        y = (us - t) / us
        cands = [np.zeros((y.shape[0], 2))]
        for j in (0, 1):   # one column
            xj = np.clip(y @ A[:, j] / (A[:, j] @ A[:, j]), 0, None)
            c = np.zeros((y.shape[0], 2))
            c[:, j] = xj
            cands.append(c)
        both = np.linalg.solve(A.T @ A, A.T @ y.T).T
        cands.append(np.where((both >= 0).all(axis=1, keepdims=True), both, np.nan))
        best_x, best_r = None, None
        for c in cands:
            r = np.sum((c @ A.T - y) ** 2, axis=1)
            r = np.where(np.isnan(r), np.inf, r)
            if best_r is None:
                best_x, best_r = c.copy(), r
            else:
                better = r < best_r
                best_x[better], best_r[better] = c[better], r[better]
        k = int(np.argmin(best_r))
        x = best_x[k]
        return best_r[k], float(g[k, 0]), float(wg[k, 0]), x, x[0] + R * x[1] + t[k]

    _, g0, w0, _, _ = scan(np.geomspace(1.0, 400.0, 80), np.geomspace(0.02, 100.0, 80))
    _, g, wg, x, pred = scan(g0 * np.geomspace(0.92, 1.08, 41), w0 * np.geomspace(0.92, 1.08, 41))
    return {"routine": routine, "gbps": float(g), "warp_gbps": float(wg), "launch_us": float(x[0]),
            "item_overhead_us": float(x[1]), "resident_warps": int(resident_warps), **_rel_stats(pred, us),
            "what": ("sim.transfers.timing's model with the per-warp rate: a round takes item_overhead_us + "
                     "max(round_bytes / gbps, item_bytes / warp_gbps)")}


def fit_spin(cycles, us) -> dict:
    """``us = floor_us + cycles / cycles_per_us`` by least squares on the cycle counts given."""
    cycles, us = np.asarray(cycles, dtype=np.float64), np.asarray(us, dtype=np.float64)
    A = np.stack([cycles, np.ones_like(cycles)], axis=1)
    (slope, floor), *_ = np.linalg.lstsq(A, us, rcond=None)
    if slope <= 0:
        raise ValueError(f"fit_spin: expected the spin time to grow with cycles, got slope {slope}")
    return {"cycles_per_us": float(1.0 / slope), "floor_us": float(max(floor, 0.0))}


def spin_cycles_for(us: float, cycles_per_us: float, floor_us: float = 0.0) -> int:
    """Cycles to ask ``torch.cuda._sleep`` for so that the spin lasts about ``us``."""
    return max(0, int(round((us - floor_us) * cycles_per_us)))
