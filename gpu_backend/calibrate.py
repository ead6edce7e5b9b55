"""``kvrace calibrate``: measure the present GPU and write a hardware profile the simulator reads.

What is measured (CUDA events on one stream, warm-ups first, medians over repetitions):

* pinned host <-> device ``cudaMemcpyAsync`` (``tensor.copy_(non_blocking=True)``) by size,
  8 KiB .. 256 MiB, both directions;
* the builtin providers' kernels on host -> device copies: ``kernel_per_layer`` (the
  sgl-kernel launch shape: at most 2 CTAs of 32 warps, item ``i`` in round ``i // warps``) over
  item counts and item sizes (token rows and the index-K pages of 64 .. 1,024 key bytes per
  token), and ``dsv4_token`` (a warp per token) over token counts; a few
  device -> host ``kernel_per_layer`` copies; with ``sglang`` available and not ``--quick``, the
  real SGLang kernels on the same copies;
* an empty-ish kernel and an empty event pair (the launch floor), a 1 GiB device-to-device copy
  (HBM), the SM count and the copy kernel's occupancy (resident warps per SM), and the spin kernel
  (``torch.cuda._sleep``): cycles per microsecond, then requested against measured durations.

Each timed operation runs behind a spin kernel on its stream, so the host has enqueued it before
the stream reaches it and the event pair around it sees what the stream sees: from the moment the
previous operation ended to the moment the copy's last byte landed.  Kernel copies are timed
"staged": their index arrays are already on the device (``staged_launch``), as the provider
would hold them, so the time is the kernel's, not the index upload's.

The fit (``fit_profile``, pure numpy; tested on synthetic data).  ``sim.transfers.timing`` says a
warp-kernel copy of ``R`` rounds and ``B`` bytes ends at ``launch_us + R * item_overhead_us +
B / gbps``, and one memcpy at ``memcpy_latency_us + B / gbps``.  Both are linear in the
parameters, so each is fitted by non-negative least squares on relative error, with ``R`` and
``B`` computed by the simulator's own launch shapes for the same copy:

* ``h2d_gbps``, ``launch_us``, ``item_overhead_us``: the builtin ``kernel_per_layer`` H2D copies,
  all item sizes together.  These are the hicache-family kernels (``kernel_per_layer``,
  ``dsa_indexer_per_layer``) whose item timing decides the races the simulator studies.  The
  simulator applies one ``h2d_gbps`` to every H2D copy, memcpys too, and the memcpy ceiling and the
  warp-per-item kernel's rate are recorded beside it (``[fit]``) because the single number cannot
  be all three;
* ``memcpy_latency_us``: the intercept of the H2D memcpy fit (``memcpy_latency_us + B / gbps``,
  both free);
* ``d2h_gbps``: the builtin D2H kernel copies, fitted the same way (the simulator applies the H2D
  launch and round costs to them too; ``[fit.link_d2h]`` says how much worse that fits);
* ``hbm_gbps``: 2 x bytes / time of the device-to-device copy (read + write counted);
* ``kernel_launch_us``: the median time of one tiny kernel between two events;
* ``sm_count``: ``torch.cuda.get_device_properties``; ``resident_warps_per_sm``: the builtin
  ``kvr_dsv4`` kernel's occupancy at 1,024 threads per block (``cuOccupancyMaxActiveBlocksPer
  Multiprocessor``, blocks x 32);
* ``jitter_frac``: the relative standard deviation of the spin kernel's durations (the replayer's
  ``compute`` ops are spin kernels);
* ``gpus_per_link``: not measurable on one GPU; 1 (each H200 has its own x16 link).

``[fit.<provider>_kernel_per_layer_h2d_warp_rate]`` fits a term the simulator does not have (a
warp moves its own item no faster than ``warp_gbps``), to show what copies of a few large items
would need; ``fit_profile(meas, "sglang")`` takes the link from SGLang's kernels instead.

The written TOML holds every key of ``sim.profile``'s schema, ``calibrated = true``, the source,
the date, and extra tables that ``sim.profile`` ignores: ``[calibration]`` (GPU, driver, torch,
CUDA), ``[spin]`` (cycles per microsecond for the replayer's spin), ``[fit]`` (every fit with its
residuals) and ``[measurements]`` (the raw size -> time data the fits used; ``refit_file`` refits
a written profile from them).
"""
from __future__ import annotations

import datetime
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from sim.profile import _SCHEMA, profile_from_dict
from sim.transfers.routines import CopyPlan, Extents, warp_per_item_launch, warp_quota_launch
from sim.transfers.timing import LinkTiming, concurrency, copy_end_us, item_rounds

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
#: bytes one DSv4 token moves per layer (576 B value + 8 B scale)
DSV4_TOKEN_BYTES = 584
#: the hicache-family routine whose builtin H2D copies set the profile's link parameters
LINK_ROUTINE = "kernel_per_layer"


# =============================================================== levels: what to measure

Shapes = tuple  # ((item_bytes, (n_items, ...)), ...)


@dataclass(frozen=True)
class Level:
    """What one calibration level measures.  ``kpl``/``d2h``/``sglang_kpl``: ``kernel_per_layer``
    shapes as ``((item_bytes, (n_items, ...)), ...)``."""

    name: str
    reps: int
    warmup: int
    memcpy_bytes: tuple[int, ...]
    kpl: Shapes
    dsv4_items: tuple[int, ...]
    d2h: Shapes
    sglang_kpl: Shapes
    spin_cycles: tuple[int, ...]
    spin_requested_us: tuple[float, ...]
    hbm_bytes: int


#: index-K pages of 64 tokens at 64, 128, 256, 512 and 1,024 key bytes per token (+ 4 B scale)
INDEX_K_PAGES = tuple(64 * (k + 4) for k in (64, 128, 256, 512, 1024))
_SMALL_N = (1, 4, 16, 64, 128, 512, 2048, 8192, 16384)
_LARGE_N = (1, 4, 16, 64, 128, 512, 2048)

LEVELS = {
    "full": Level("full", 15, 3,
                  tuple(8 * KIB << k for k in range(16)),
                  ((256, _SMALL_N), (576, _SMALL_N), (1152, _SMALL_N),
                   *((b, _SMALL_N if b <= 8448 else _LARGE_N) for b in INDEX_K_PAGES)),
                  (1, 32, 256, 1024, 4096, 8448, 16384, 32768),
                  ((1152, (64, 1024, 8192)), (8448, (4, 64, 1024, 8192))),
                  ((1152, _SMALL_N), (8448, _SMALL_N), (33024, _LARGE_N)),
                  (0, 1000, 10_000, 100_000, 1_000_000, 4_000_000),
                  (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
                  GIB),
    "quick": Level("quick", 7, 2,
                   (8 * KIB, 64 * KIB, 512 * KIB, 4 * MIB, 32 * MIB, 256 * MIB),
                   ((1152, (1, 16, 64, 512, 4096)), (8448, (1, 16, 64, 512, 4096)), (33024, (1, 16, 64, 512))),
                   (1, 256, 4096, 16384),
                   ((8448, (4, 64, 512, 4096)),),
                   (),
                   (0, 10_000, 1_000_000),
                   (5, 20, 100, 500),
                   256 * MIB),
    # the GPU test's level: seconds, every code path once
    "smoke": Level("smoke", 3, 1,
                   (8 * KIB, 4 * MIB), ((1152, (1, 64, 512)), (8448, (1, 64, 512))), (1, 256, 4096),
                   ((8448, (64,)),), (), (0, 100_000), (20, 100), 64 * MIB),
}


def _shape_bytes(shapes: Shapes) -> list[int]:
    return [n * 5 // 4 * b for b, counts in shapes for n in counts]


# =============================================================== the model's features

def synthetic_plan(routine: str, n_items: int, item_bytes: int) -> CopyPlan:
    """A plan of ``n_items`` equal items under the simulator's launch shape for ``routine``
    (warp per item for ``dsv4_token``, the sgl-kernel quota shape otherwise)."""
    n = int(n_items)
    idx = np.arange(n, dtype=np.int64)
    ext = Extents(idx * item_bytes, idx * item_bytes, np.full(n, item_bytes, dtype=np.int64), idx, n)
    launch = warp_per_item_launch(n) if routine == "dsv4_token" else warp_quota_launch(n)
    return CopyPlan(routine, ext, launch)


def model_rounds(routine: str, n_items: int, item_bytes: int, resident_warps: int) -> int:
    """Rounds the timing model gives this copy (``item_rounds``: item ``i`` in ``i // W``)."""
    if n_items <= 0:
        return 0
    plan = synthetic_plan(routine, n_items, item_bytes)
    return int(item_rounds(plan, LinkTiming(gbps=1.0, resident_warps=int(resident_warps)))[-1]) + 1


def model_kernel_us(routine: str, n_items: int, item_bytes: int, *, gbps: float, launch_us: float,
                    item_overhead_us: float, resident_warps: int) -> float:
    """The simulator's end time of such a copy (``sim.transfers.timing.copy_end_us``)."""
    plan = synthetic_plan(routine, n_items, item_bytes)
    return copy_end_us(plan, LinkTiming(gbps=gbps, launch_us=launch_us, item_overhead_us=item_overhead_us,
                                        resident_warps=int(resident_warps)))


# =============================================================== fitting (pure numpy)

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
    """A proposed extension of ``sim.transfers.timing`` (not what the simulator does): a round
    takes ``item_overhead_us + max(round_bytes / gbps, item_bytes / warp_gbps)``, i.e. one warp
    moves its item no faster than ``warp_gbps`` however idle the link is."""
    n = np.asarray(n_items, dtype=np.float64)
    ib = np.asarray(item_bytes, dtype=np.float64)
    W, full, rem = _round_split(routine, n, resident_warps)
    per_item = ib / (warp_gbps * 1e3)
    t = full * np.maximum(W * ib / (gbps * 1e3), per_item) + (rem > 0) * np.maximum(rem * ib / (gbps * 1e3), per_item)
    return launch_us + (full + (rem > 0)) * item_overhead_us + t


def fit_kernel_warp_rate(routine: str, n_items, item_bytes, us, resident_warps: int) -> dict:
    """Least squares (relative error) of ``warp_rate_us``: a grid over ``gbps`` and ``warp_gbps``,
    refined once, with ``launch_us`` and ``item_overhead_us`` by NNLS at each point."""
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
            "what": ("proposal, not used by sim.transfers.timing: a round takes item_overhead_us + "
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


# =============================================================== measurements -> profile

def _get(meas: Mapping, table: str) -> Mapping:
    if table not in meas:
        raise ValueError(f"measurements: missing table {table!r}; expected {sorted(MEASUREMENT_TABLES)}")
    return meas[table]


#: what a fitted launch or latency of 0 is written as (the profile schema wants it > 0)
MIN_POSITIVE_US = 0.001
MEASUREMENT_TABLES = ("device", "launch", "memcpy_h2d", "memcpy_d2h", "kernel_h2d", "kernel_d2h",
                      "hbm", "spin_cycles", "spin")


def _select(tab: Mapping, **where) -> dict:
    n = len(tab["us_median"])
    keep = np.ones(n, dtype=bool)
    for k, v in where.items():
        keep &= np.array([x == v for x in tab[k]], dtype=bool)
    return {k: [x for x, m in zip(vals, keep) if m] for k, vals in tab.items() if isinstance(vals, list)
            and len(vals) == n}


def fit_profile(meas: Mapping, link_provider: str = "builtin") -> tuple[dict, dict]:
    """``(profile values by schema section, fits)`` from raw measurements (``MEASUREMENT_TABLES``).

    ``link_provider``: whose ``kernel_per_layer`` H2D copies set ``h2d_gbps``, ``launch_us`` and
    ``item_overhead_us`` (builtin by default: what ``kvrace replay`` runs unless told otherwise;
    ``sglang`` gives a profile for the real JIT kernels from the same measurements).
    Pure: the CPU tests feed it synthetic measurements made with the simulator's own model.
    """
    dev = _get(meas, "device")
    sm, rw_per_sm = int(dev["sm_count"]), int(dev["resident_warps_per_sm"])
    rw = sm * rw_per_sm
    fits: dict[str, dict] = {}

    kh = _get(meas, "kernel_h2d")
    link = _select(kh, provider=link_provider, routine=LINK_ROUTINE)
    if len(link.get("us_median", [])) < 3:
        raise ValueError(f"measurements: {len(link.get('us_median', []))} {link_provider} {LINK_ROUTINE} H2D "
                         f"copies; expected at least 3 to fit the link (providers measured: "
                         f"{sorted(set(kh['provider']))})")
    fits["link_h2d"] = fit_kernel(LINK_ROUTINE, link["n_items"], link["item_bytes"], link["us_median"], rw)
    fits["link_h2d"]["what"] = (f"{link_provider} {LINK_ROUTINE} H2D copies: the profile's h2d_gbps, launch_us, "
                                "item_overhead_us")
    fits["link_h2d"]["provider"] = link_provider
    for prov in sorted(set(kh["provider"])):
        for routine in sorted(set(kh["routine"])):
            sel = _select(kh, provider=prov, routine=routine)
            if len(sel["us_median"]) < 3:
                continue
            if (prov, routine) != (link_provider, LINK_ROUTINE):
                fits[f"{prov}_{routine}_h2d"] = fit_kernel(routine, sel["n_items"], sel["item_bytes"],
                                                           sel["us_median"], rw)
            if routine == LINK_ROUTINE and len(set(sel["item_bytes"])) >= 2:
                fits[f"{prov}_{routine}_h2d_warp_rate"] = fit_kernel_warp_rate(
                    routine, sel["n_items"], sel["item_bytes"], sel["us_median"], rw)
    mh = _get(meas, "memcpy_h2d")
    fits["memcpy_h2d"] = fit_memcpy(mh["bytes"], mh["us_median"])
    md = _get(meas, "memcpy_d2h")
    fits["memcpy_d2h"] = fit_memcpy(md["bytes"], md["us_median"])
    lf = fits["link_h2d"]
    kd = _select(_get(meas, "kernel_d2h"), provider="builtin", routine=LINK_ROUTINE)
    try:
        fits["link_d2h"] = fit_kernel(LINK_ROUTINE, kd["n_items"], kd["item_bytes"], kd["us_median"], rw)
        fits["link_d2h"]["what"] = ("builtin D2H copies, all three free: the profile's d2h_gbps (the simulator "
                                    "applies link_h2d's launch and round costs to D2H copies too)")
        held = fit_gbps_fixed(LINK_ROUTINE, kd["n_items"], kd["item_bytes"], kd["us_median"],
                              launch_us=lf["launch_us"], item_overhead_us=lf["item_overhead_us"], resident_warps=rw)
        fits["link_d2h"]["rel_err_median_with_h2d_costs"] = held["rel_err_median"]
    except (ValueError, KeyError, ZeroDivisionError) as e:
        fits["link_d2h"] = {"gbps": fits["memcpy_d2h"]["gbps"],
                            "what": f"D2H kernel fit failed ({e}); the D2H memcpy fit's gbps instead"}

    hbm = _get(meas, "hbm")
    hbm_gbps = max(2.0 * b / u / 1e3 for b, u in zip(hbm["bytes"], hbm["us_median"]))
    launch = _get(meas, "launch")
    sc = _get(meas, "spin_cycles")
    fits["spin"] = fit_spin(sc["cycles"], sc["us_median"])
    spin = _get(meas, "spin")
    big = [i for i, r in enumerate(spin["requested_us"]) if r >= 20]
    jitter = float(np.median([spin["us_rel_sd"][i] for i in big])) if big else float(np.median(spin["us_rel_sd"]))
    rel = [(m - r) / r for r, m in zip(spin["requested_us"], spin["us_median"])]
    fits["spin"].update(rel_err_median_ge_20us=float(np.median(np.abs([rel[i] for i in big]))) if big else None,
                        rel_err_max_ge_20us=float(np.max(np.abs([rel[i] for i in big]))) if big else None,
                        rel_sd_median=jitter)
    if fits["spin"]["rel_err_median_ge_20us"] is None:
        del fits["spin"]["rel_err_median_ge_20us"], fits["spin"]["rel_err_max_ge_20us"]

    # the simulator's link model has the per-warp rate: take the warp-rate fit when there is one
    wr = fits.get(f"{link_provider}_{LINK_ROUTINE}_h2d_warp_rate")
    if wr is not None:
        wr["what"] = ("the profile's h2d_gbps, warp_gbps, launch_us, item_overhead_us: a round takes "
                      "item_overhead_us + max(round_bytes / gbps, item_bytes / warp_gbps)")
        lf = wr
    values = {
        "link": {"h2d_gbps": lf["gbps"], "d2h_gbps": fits["link_d2h"]["gbps"], "launch_us": lf["launch_us"],
                 "memcpy_latency_us": fits["memcpy_h2d"]["latency_us"],
                 "item_overhead_us": lf["item_overhead_us"],
                 "warp_gbps": lf.get("warp_gbps", NO_WARP_LIMIT_GBPS), "gpus_per_link": 1},
        "device": {"sm_count": sm, "resident_warps_per_sm": rw_per_sm, "hbm_gbps": hbm_gbps,
                   "kernel_launch_us": float(launch["tiny_kernel_us"])},
        "compute": {"jitter_frac": jitter},
    }
    for key in ("launch_us", "memcpy_latency_us"):   # the schema wants these > 0
        if values["link"][key] <= 0:
            fits.setdefault("clamped", {})[key] = f"fit gave {values['link'][key]}; written as {MIN_POSITIVE_US}"
            values["link"][key] = MIN_POSITIVE_US
    for sec, keys in _SCHEMA.items():
        missing = set(keys) - set(values[sec])
        assert not missing, f"fit_profile does not produce {sec}.{sorted(missing)}"
    return values, fits


NO_WARP_LIMIT_GBPS = 1e6   # written when the measurements cannot fit a per-warp rate (one item size)


# =============================================================== TOML writing

def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"TOML: expected a finite number, got {f}")
        s = repr(round(f, 6)) if abs(f) >= 1e-3 or f == 0 else f"{f:.6e}"
        return s
    if isinstance(v, str):
        return json.dumps(v)   # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"TOML: cannot write {type(v).__name__} {v!r}")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def toml_table(name: str, table: Mapping, comments: Mapping[str, str] | None = None) -> list[str]:
    """``[name]`` with scalar/array keys first, then sub-tables ``[name.sub]``."""
    out = [f"[{name}]"]
    subs = []
    for k, v in table.items():
        if isinstance(v, Mapping):
            subs.append((k, v))
            continue
        if v is None:
            continue
        line = f"{_toml_key(k)} = {_toml_value(v)}"
        if comments and k in comments:
            line = f"{line:<34} # {comments[k]}"
        out.append(line)
    for k, v in subs:
        out.append("")
        out.extend(toml_table(f"{name}.{_toml_key(k)}", v))
    return out


KEY_COMMENTS = {
    "h2d_gbps": "kernel_per_layer H2D fit with warp rate ([fit.*_h2d_warp_rate]; memcpy ceiling in [fit.memcpy_h2d])",
    "warp_gbps": "one warp's own copy rate ([fit.*_h2d_warp_rate])",
    "d2h_gbps": "builtin kernel_per_layer D2H fit ([fit.link_d2h])",
    "launch_us": "kernel copy: stream ready -> first round starts ([fit.*_h2d_warp_rate])",
    "memcpy_latency_us": "intercept of the H2D memcpy fit ([fit.memcpy_h2d])",
    "item_overhead_us": "per warp round of the kernel copy ([fit.*_h2d_warp_rate])",
    "gpus_per_link": "not measured (one GPU): each H200 has its own x16 link",
    "sm_count": "torch.cuda.get_device_properties",
    "resident_warps_per_sm": "occupancy of the builtin warp-per-item kernel at 1024 threads",
    "hbm_gbps": "device-to-device copy, read + write counted ([measurements.hbm])",
    "kernel_launch_us": "one tiny kernel between two events ([measurements.launch])",
    "jitter_frac": "relative sd of spin-kernel durations >= 20 us ([measurements.spin])",
}


def profile_text(name: str, source: str, date: str, values: Mapping, fits: Mapping, meas: Mapping,
                 info: Mapping, header: list[str] | None = None) -> str:
    lines = [f"# kvrace hardware profile written by `kvrace calibrate` on {date}."]
    lines += [f"# {h}" for h in (header or [])]
    lines += ["# sim.profile reads name, calibrated, source, date, [link], [device], [compute];",
              "# [calibration], [spin], [fit] and [measurements] are extra (ignored by sim.profile).",
              f"name = {_toml_value(name)}", "calibrated = true",
              f"source = {_toml_value(source)}", f"date = {_toml_value(date)}", ""]
    for sec in _SCHEMA:
        lines += toml_table(sec, values[sec], KEY_COMMENTS) + [""]
    lines += toml_table("calibration", info) + [""]
    spin = fits.get("spin", {})
    lines += toml_table("spin", {"cycles_per_us": spin.get("cycles_per_us"), "floor_us": spin.get("floor_us"),
                                 "rel_sd_median": spin.get("rel_sd_median")},
                        {"cycles_per_us": "torch.cuda._sleep cycles per microsecond of spin",
                         "floor_us": "a spin of 0 cycles between two events"}) + [""]
    lines += toml_table("fit", {k: v for k, v in fits.items()}) + [""]
    lines += toml_table("measurements", meas) + [""]
    return "\n".join(lines)


def build_profile(meas: Mapping, info: Mapping, *, name: str, date: str | None = None,
                  level: str = "full", link_provider: str = "builtin") -> tuple[str, dict, dict]:
    """``(TOML text, values, fits)``; the text loads with ``sim.profile.load_profile``."""
    date = date or datetime.date.today().isoformat()
    values, fits = fit_profile(meas, link_provider)
    lf = fits.get(f"{link_provider}_{LINK_ROUTINE}_h2d_warp_rate", fits["link_h2d"])
    mh = fits["memcpy_h2d"]
    source = (f"kvrace calibrate ({level}) on {info.get('gpu', 'a GPU')}, {date}: CUDA-event medians "
              f"behind a spin kernel; link = NNLS fit of sim.transfers.timing to {link_provider} "
              f"{LINK_ROUTINE} H2D copies ({lf['samples']} shapes, median rel. error "
              f"{lf['rel_err_median']:.1%}); pinned H2D memcpy {mh['gbps_at_largest']:.1f} GB/s at "
              f"{mh['largest_bytes'] // MIB} MiB")
    header = [f"GPU: {info.get('gpu')} (sm_{info.get('compute_capability', '?').replace('.', '')}, "
              f"{values['device']['sm_count']} SMs); driver {info.get('driver')}; torch {info.get('torch')}; "
              f"CUDA {info.get('cuda')}"]
    text = profile_text(name, source, date, values, fits, meas, info, header)
    profile_from_dict(_loads(text), "calibrated profile")   # never write what the simulator rejects
    return text, values, fits


def _loads(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def refit_file(path: str, *, name: str | None = None, link_provider: str = "builtin") -> tuple[str, dict, dict]:
    """Refit a profile written by ``kvrace calibrate`` from its own ``[measurements]`` (same
    date; ``link_provider="sglang"`` for a profile of the real SGLang kernels)."""
    with open(path, "rb") as f:
        doc = _loads(f.read().decode())
    return build_profile(doc["measurements"], doc.get("calibration", {}), name=name or doc["name"],
                         date=doc["date"], level=doc.get("calibration", {}).get("level", "full"),
                         link_provider=link_provider)


# =============================================================== GPU side: staged launches

class NotStaged(RuntimeError):
    """This provider cannot run this copy as a staged launch; the message says why."""


_PROVIDERS: dict = {}


def provider(name: str):
    """One provider object per name for the process (the builtin one holds its compiled module,
    so a fresh object per launch would compile the kernels again)."""
    if name not in _PROVIDERS:
        from gpu_backend.providers import get_provider
        _PROVIDERS[name] = get_provider(name)
    return _PROVIDERS[name]


def _view(tensor):
    """A Buffer-like object (``tensor``, ``ptr``) over a slice of a bigger allocation."""
    class _V:
        pass
    v = _V()
    v.tensor, v.ptr = tensor, int(tensor.data_ptr())
    return v


def staged_launch(provider_name: str, routine: str, src, dst, src_layout, dst_layout, args: Mapping,
                  device) -> Callable:
    """``run(stream)`` that enqueues only the copy: index arrays, pointer tables and byte pieces
    are made once here (on the device, synchronously), as the provider makes them per launch.

    builtin: the same parameter block ``BuiltinProvider.launch`` builds; sglang: the JIT hicache
    and hisparse calls ``SGLangProvider.launch`` makes; torch: its byte pieces, one
    ``copy_(non_blocking=True)`` each.  Raises NotStaged where the provider cannot run the copy
    (or, for sglang, would use the AOT ``sgl_kernel`` path, which is not staged).
    """
    import torch

    from gpu_backend.providers import base

    prov = provider(provider_name)
    ok, why = prov.supports(routine, src_layout, dst_layout, args)
    if not ok:
        raise NotStaged(why)
    sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
    layers = base.routine_layers(routine, src_layout, args)
    keep = []   # device tensors the closure needs alive

    if provider_name == "builtin":
        from gpu_backend.providers import builtin_kernels as bk
        from gpu_backend.providers.builtin import kernel_params

        if routine == "direct_per_layer":
            raise NotStaged("direct_per_layer is a host routine (one cuMemcpyAsync per piece)")
        mod = prov._module(device.index)
        mod.make_current()
        kp = kernel_params(routine, src, dst, src_layout, dst_layout, args)
        n, values = kp.n_items, dict(kp.values)
        keep = [torch.from_numpy(np.ascontiguousarray(kp.src_idx)).to(device),
                torch.from_numpy(np.ascontiguousarray(kp.dst_idx)).to(device),
                torch.tensor(kp.layers, dtype=torch.int64).to(device)]
        values.update(src_idx=keep[0].data_ptr(), dst_idx=keep[1].data_ptr(), layer_ids=keep[2].data_ptr())
        kernel = bk.KERNELS[routine]

        def run(stream, _keep=keep):
            if n:
                mod.make_current()
                prov._launch(mod, kernel, kp.shape, values, stream)

    elif provider_name == "sglang":
        import tvm_ffi

        from gpu_backend import sglang_shim
        from gpu_backend.providers import sglang_kernels as sk

        path, why = prov._path(routine, src_layout, dst_layout, args)
        if path not in ("jit", "dsv4"):
            raise NotStaged(f"sglang would use its {path} path for {routine}: only the JIT kernels are staged")
        if path == "dsv4":
            s, d = base.index_pair(args)
            fn = sglang_shim.import_jit_module("hisparse").transfer_cache_dsv4_mla
            keep = [sk._ptr_table(torch, src, sp, layers, device), sk._ptr_table(torch, dst, dp, layers, device),
                    sk._idx(torch, s, device), sk._idx(torch, d, device)]
            call = (lambda: fn(*keep)) if s.size else (lambda: None)
        else:
            s, d = sk._rows_and_pages(routine, args)
            ib = sk._item_bytes(routine, src_layout, args)
            hicache = sglang_shim.import_jit_module("hicache")
            si, di = sk._idx(torch, s, device), sk._idx(torch, d, device)
            if routine == "kernel_all_layer":
                st, dt = sk._ptr_table(torch, src, sp, layers, device), sk._ptr_table(torch, dst, dp, layers, device)
                keep = [si, di, st, dt]
                call = lambda: hicache.transfer_hicache_all_layer_mla(  # noqa: E731
                    dt, di, st, si, cache_src_stride_bytes=base.unit_stride(sp),
                    cache_dst_stride_bytes=base.unit_stride(dp), element_size=ib)
            else:
                L = layers[0]
                dr, sr = sk._rows(dst, dp, L, ib), sk._rows(src, sp, L, ib)
                keep = [si, di, dr, sr]
                call = lambda: hicache.transfer_hicache_one_layer_mla(dr, di, sr, si, element_dim=ib)  # noqa: E731
            if not s.size:
                call = lambda: None  # noqa: E731

        def run(stream, _keep=keep):
            with tvm_ffi.use_torch_stream(torch.cuda.stream(stream)):
                call()

    elif provider_name == "torch":
        from gpu_backend.providers.torch_copy import host_pieces

        if prov._rows_on_device(routine, src, dst, src_layout, dst_layout):
            raise NotStaged("same-GPU row copies use index_copy_; only host <-> device pieces are staged")
        pieces = [(dst.tensor[do:do + n], src.tensor[so:so + n])
                  for so, do, n in host_pieces(routine, src_layout, dst_layout, args).tolist()]

        def run(stream):
            with torch.cuda.stream(stream):
                for a, b in pieces:
                    a.copy_(b, non_blocking=True)
    else:
        raise NotStaged(f"unknown provider {provider_name!r}")
    torch.cuda.synchronize(device)
    return run


# =============================================================== GPU side: timing

class Timer:
    """Times ``fn(stream)`` with CUDA events, each repetition behind a spin kernel; ``fn`` runs
    with the timer's stream current, so plain torch ops inside it go to that stream too."""

    def __init__(self, device, spin_cycles: int = 200_000):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.spin_cycles = int(spin_cycles)

    def times_us(self, fn: Callable, reps: int, warmup: int = 2, spin_cycles: int | None = None) -> np.ndarray:
        torch = self.torch
        spin = self.spin_cycles if spin_cycles is None else int(spin_cycles)
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                fn(self.stream)
        torch.cuda.synchronize(self.device)
        pairs = []
        with torch.cuda.stream(self.stream):
            for _ in range(reps):
                if spin:
                    torch.cuda._sleep(spin)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(self.stream)
                fn(self.stream)
                b.record(self.stream)
                pairs.append((a, b))
        self.stream.synchronize()
        return np.array([a.elapsed_time(b) * 1e3 for a, b in pairs])


def summary(us: np.ndarray) -> dict:
    return {"us_median": float(np.median(us)), "us_p10": float(np.percentile(us, 10)),
            "us_p90": float(np.percentile(us, 90)),
            "us_rel_sd": float(np.std(us) / np.mean(us)) if np.mean(us) > 0 else 0.0}


def _append(table: dict, **row) -> None:
    for k, v in row.items():
        table.setdefault(k, []).append(v)


def h2d_case(routine: str, n_items: int, item_bytes: int, rng: np.random.Generator,
             direction: str = "h2d"):
    """(src layout, dst layout, args) of one copy between a pinned host pool (layer_first) and a
    device pool, random slots on both sides, 25 % spare slots."""
    from sim.pools.layouts import HostLayout, PagedLayout, c4_paged

    if routine == "dsv4_token":
        pages = max(1, -(-n_items * 5 // 4 // 64))
        c4 = c4_paged(1, pages)
        host = HostLayout("host", "layer_first", 1, pages, c4.page_bytes, 1, 64, c4.fields)
        s = rng.permutation(pages * 64)[:n_items]
        d = rng.permutation(pages * 64)[:n_items]
        src, dst = (host, c4) if direction == "h2d" else (c4, host)
        return src, dst, {"src_indices": s.tolist(), "dst_indices": d.tolist()}
    units = max(2, n_items * 5 // 4)
    host = HostLayout("host", "layer_first", 1, units, item_bytes)
    dev = PagedLayout("dev", 1, units, item_bytes)
    s, d = rng.permutation(units)[:n_items], rng.permutation(units)[:n_items]
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    if routine == "dsa_indexer_per_layer":
        ps = 64
        s = (s[:, None] * ps + np.arange(ps)).ravel()
        d = (d[:, None] * ps + np.arange(ps)).ravel()
        return src, dst, {"layer": 0, "src_indices": s.tolist(), "dst_indices": d.tolist(), "page_size": ps}
    return src, dst, {"layer": 0, "src_indices": s.tolist(), "dst_indices": d.tolist()}


class Arena:
    """One pinned host and one device allocation; layouts are laid over their starts."""

    def __init__(self, device, nbytes: int):
        import torch

        self.nbytes = int(nbytes)
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.host.fill_(0x5A)
        self.dev.fill_(0xA5)

    def buffers(self, src_layout, dst_layout):
        def side(layout):
            if layout.nbytes > self.nbytes:
                raise ValueError(f"layout {layout.name} needs {layout.nbytes} bytes; the arena has {self.nbytes}")
            t = self.host if layout.kind == "host" else self.dev
            return _view(t[:layout.nbytes])
        return side(src_layout), side(dst_layout)


def device_info(torch, device) -> dict:
    props = torch.cuda.get_device_properties(device)
    info = {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "sm_count_reported": int(props.multi_processor_count),
            "memory_gib": round(props.total_memory / GIB, 1),
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        from cuda.bindings import driver
        err, v = driver.cuDriverGetVersion()
        if int(err) == 0:
            info["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:
        pass
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            info["driver"] = out.stdout.strip().splitlines()[0]
    except Exception:
        pass
    info.setdefault("driver", info.get("cuda_driver_api", "unknown"))
    for mod in ("cuda.bindings", "tvm_ffi"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod.replace(".", "_") + "_version"] = str(getattr(m, "__version__", "?"))
        except Exception:
            pass
    try:
        from importlib.metadata import version
        info["sglang_version"] = version("sglang")
    except Exception:
        pass
    return info


def resident_warps_per_sm(torch, device) -> tuple[int, str]:
    """Occupancy of the builtin warp-per-item kernel at 1,024 threads (blocks per SM x 32)."""
    try:
        from cuda.bindings import driver

        mod = provider("builtin")._module(device.index)
        err, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(mod.functions["kvr_dsv4"], 1024, 0)
        if int(err) == 0 and int(blocks) > 0:
            return int(blocks) * 32, "cuOccupancyMaxActiveBlocksPerMultiprocessor(kvr_dsv4, 1024 threads)"
    except Exception as e:   # fall back to the hardware limit, say so
        why = f"{type(e).__name__}: {e}"
    else:
        why = "occupancy query failed"
    props = torch.cuda.get_device_properties(device)
    per_sm = int(getattr(props, "max_threads_per_multi_processor", 2048))
    return (per_sm // 1024) * 32, f"hardware limit ({why})"


def _log(msg: str, t0: float) -> None:
    print(f"[calibrate {time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def measure(level: Level, device=None, providers: tuple[str, ...] = ("builtin",), seed: int = 0) -> tuple[dict, dict]:
    """Run the measurements of ``level`` on the GPU; ``(measurements, info)``."""
    import torch

    from gpu_backend.providers import ProviderError

    t0 = time.perf_counter()
    device = torch.device(device or "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    rng = np.random.default_rng(seed)
    info = device_info(torch, device)
    info["level"] = level.name
    meas: dict[str, dict] = {}
    timer = Timer(device)
    reps, wu = level.reps, level.warmup

    # ---- spin kernel: cycles per us first (it sizes the pre-spin of everything else)
    torch.cuda._sleep(50_000_000)   # let the clocks come up
    torch.cuda.synchronize(device)
    sc: dict = {}
    for c in level.spin_cycles:
        us = timer.times_us(lambda s, c=c: torch.cuda._sleep(c), reps, wu, spin_cycles=100_000)
        _append(sc, cycles=int(c), **summary(us))
    meas["spin_cycles"] = sc
    spin_fit = fit_spin(sc["cycles"], sc["us_median"])
    cpu = spin_fit["cycles_per_us"]
    timer.spin_cycles = spin_cycles_for(100.0, cpu)
    sp: dict = {}
    for req in level.spin_requested_us:
        cyc = spin_cycles_for(req, cpu, spin_fit["floor_us"])
        us = timer.times_us(lambda s, c=cyc: torch.cuda._sleep(c), reps, wu)
        _append(sp, requested_us=float(req), cycles=cyc, **summary(us))
    meas["spin"] = sp
    _log(f"spin: {cpu:.0f} cycles/us, floor {spin_fit['floor_us']:.2f} us", t0)

    # ---- device facts and the launch floor
    props = torch.cuda.get_device_properties(device)
    rw_sm, rw_how = resident_warps_per_sm(torch, device)
    meas["device"] = {"sm_count": int(props.multi_processor_count), "resident_warps_per_sm": rw_sm,
                      "resident_warps_source": rw_how,
                      "max_warps_per_sm": int(getattr(props, "max_threads_per_multi_processor", 2048)) // 32}
    tiny_d = torch.zeros(64, dtype=torch.float32, device=device)
    tiny_h = torch.zeros(64, dtype=torch.float32, pin_memory=True)
    launch = {"event_floor_us": float(np.median(timer.times_us(lambda s: None, reps, wu))),
              "tiny_kernel_us": float(np.median(timer.times_us(lambda s: tiny_d.add_(1), reps, wu))),
              "tiny_memcpy_h2d_us": float(np.median(timer.times_us(
                  lambda s: tiny_d.copy_(tiny_h, non_blocking=True), reps, wu)))}
    meas["launch"] = launch

    # ---- memcpy by size, both directions
    arena_bytes = max([*level.memcpy_bytes, *_shape_bytes(level.kpl), *_shape_bytes(level.d2h),
                       *_shape_bytes(level.sglang_kpl),
                       *(-(-n * 5 // 4 // 64) * 37440 for n in level.dsv4_items)]) + MIB
    arena = Arena(device, arena_bytes)
    for direction in ("h2d", "d2h"):
        tab: dict = {}
        for nb in level.memcpy_bytes:
            dst, src = (arena.dev, arena.host) if direction == "h2d" else (arena.host, arena.dev)
            us = timer.times_us(lambda s, a=dst[:nb], b=src[:nb]: a.copy_(b, non_blocking=True), reps, wu)
            _append(tab, bytes=int(nb), **summary(us))
        tab["gbps"] = [b / u / 1e3 for b, u in zip(tab["bytes"], tab["us_median"])]
        meas[f"memcpy_{direction}"] = tab
        _log(f"memcpy {direction}: {tab['gbps'][-1]:.1f} GB/s at {tab['bytes'][-1] // MIB} MiB", t0)

    # ---- kernel copies
    def kernel_rows(table: dict, provider: str, routine: str, shapes: Shapes, direction: str):
        for ib, counts in shapes:
            for n in counts:
                src_l, dst_l, args = h2d_case(routine, n, ib, rng, direction)
                src, dst = arena.buffers(src_l, dst_l)
                try:
                    run = staged_launch(provider, routine, src, dst, src_l, dst_l, args, device)
                except (NotStaged, ProviderError) as e:
                    _log(f"{provider} {routine} {ib} B x {n}: not run ({e})", t0)
                    continue
                us = timer.times_us(run, reps, wu)
                nb = n * ib
                _append(table, provider=provider, routine=routine, n_items=int(n), item_bytes=int(ib),
                        bytes=int(nb), rounds=model_rounds(routine, n, ib, meas["device"]["sm_count"] * rw_sm),
                        **summary(us))

    kh: dict = {}
    kernel_rows(kh, "builtin", "kernel_per_layer", level.kpl, "h2d")
    kernel_rows(kh, "builtin", "dsv4_token", ((DSV4_TOKEN_BYTES, level.dsv4_items),), "h2d")
    _log(f"builtin kernels H2D: {len(kh.get('us_median', []))} shapes", t0)
    if "sglang" in providers and level.sglang_kpl:
        from gpu_backend.providers import get_provider
        ok, why = get_provider("sglang", require_available=False).available()
        info["sglang_measured"] = ok
        if ok:
            kernel_rows(kh, "sglang", "kernel_per_layer", level.sglang_kpl, "h2d")
            kernel_rows(kh, "sglang", "dsv4_token", ((DSV4_TOKEN_BYTES, level.dsv4_items),), "h2d")
            _log("sglang kernels H2D measured", t0)
        else:
            info["sglang_unavailable"] = why
            _log(f"sglang not measured: {why}", t0)
    meas["kernel_h2d"] = kh
    kd: dict = {}
    kernel_rows(kd, "builtin", "kernel_per_layer", level.d2h, "d2h")
    meas["kernel_d2h"] = kd
    del arena
    torch.cuda.empty_cache()

    # ---- HBM: device-to-device
    a = torch.empty(level.hbm_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = timer.times_us(lambda s: b.copy_(a, non_blocking=True), max(3, reps // 2), wu)
    meas["hbm"] = {"bytes": [int(level.hbm_bytes)], **{k: [v] for k, v in summary(us).items()}}
    del a, b
    torch.cuda.empty_cache()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    _log("done", t0)
    return meas, info


def default_name(gpu: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    return f"{slug or 'gpu'}-calibrated"


def cli_calibrate(args) -> int:
    """``kvrace calibrate --out PROFILE.toml|- [--name N] [--quick]`` (torch + CUDA already checked).

    ``--out -`` writes the profile TOML to stdout and the summary to stderr.  Exit 0 when the
    profile was written; a bad output path is an InputError (exit 2) raised before measuring."""
    import functools

    from sim.cli import check_output_path
    from sim.profile import load_profile, profile_from_dict, tomllib

    check_output_path(args.out, "--out")
    to_stdout = args.out == "-"
    say = functools.partial(print, file=sys.stderr if to_stdout else sys.stdout)

    level = LEVELS["quick" if getattr(args, "quick", False) else "full"]
    meas, info = measure(level, providers=("builtin", "sglang"))
    name = getattr(args, "name", None) or default_name(info["gpu"])
    try:
        text, values, fits = build_profile(meas, info, name=name, level=level.name)
    except Exception:
        raw = "calibrate.measurements.json" if to_stdout else f"{args.out}.measurements.json"
        with open(raw, "w") as f:
            json.dump({"measurements": meas, "calibration": info}, f, indent=1)
        print(f"kvrace calibrate: the fit failed; raw measurements kept in {raw}", file=sys.stderr)
        raise
    if to_stdout:
        sys.stdout.write(text)
        prof = profile_from_dict(tomllib.loads(text), "calibrated profile")
    else:
        with open(args.out, "w") as f:
            f.write(text)
        prof = load_profile(args.out)
    lf, mh, md = fits["link_h2d"], fits["memcpy_h2d"], fits["memcpy_d2h"]
    say(f"wrote {'stdout' if to_stdout else args.out}: profile {prof.name!r} for {info['gpu']} ({level.name}, {info['seconds']} s)")
    say(f"  pinned memcpy: H2D {mh['gbps_at_largest']:.1f} GB/s, D2H {md['gbps_at_largest']:.1f} GB/s at "
          f"{mh['largest_bytes'] // MIB} MiB; latency {mh['latency_us']:.2f} us")
    say(f"  kernel path (builtin {LINK_ROUTINE}): {lf['gbps']:.1f} GB/s, launch {lf['launch_us']:.2f} us, "
          f"{lf['item_overhead_us']:.3f} us per round; median rel. error {lf['rel_err_median']:.1%}")
    for k, f in fits.items():
        if k.endswith("_h2d") and k not in ("link_h2d", "memcpy_h2d"):
            say(f"  {k}: {f['gbps']:.1f} GB/s, launch {f['launch_us']:.2f} us, "
                  f"{f['item_overhead_us']:.3f} us per round; median rel. error {f['rel_err_median']:.1%}")
        if k.endswith("_warp_rate"):
            say(f"  {k} (proposal): {f['gbps']:.1f} GB/s, {f['warp_gbps']:.2f} GB/s per warp, launch "
                  f"{f['launch_us']:.2f} us, {f['item_overhead_us']:.3f} us per round; median rel. error "
                  f"{f['rel_err_median']:.1%}, max {f['rel_err_max']:.1%}")
    sp = fits["spin"]
    say(f"  spin: {sp['cycles_per_us']:.0f} cycles/us, floor {sp['floor_us']:.2f} us, "
          f"median |error| {sp.get('rel_err_median_ge_20us', float('nan')):.1%} at >= 20 us")
    say(f"  d2h_gbps {prof.d2h_gbps:.1f}, hbm {prof.hbm_gbps:.0f} GB/s, "
          f"kernel_launch {prof.kernel_launch_us:.2f} us, {prof.sm_count} SMs x {prof.resident_warps_per_sm} warps, jitter {prof.jitter_frac:.4f}")
    return 0


def main(argv=None) -> int:
    """``python -m gpu_backend.calibrate --refit PROFILE --out NEW [--link-provider sglang]``: a
    profile refitted from another's raw measurements (no GPU needed)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gpu_backend.calibrate", description=main.__doc__)
    ap.add_argument("--refit", required=True, metavar="PROFILE.toml", help="a profile written by kvrace calibrate")
    ap.add_argument("--out", required=True, metavar="NEW.toml")
    ap.add_argument("--name", default=None)
    ap.add_argument("--link-provider", default="builtin", choices=["builtin", "sglang"],
                    help="whose kernel_per_layer H2D copies set the link parameters (default builtin)")
    args = ap.parse_args(argv)
    text, values, fits = refit_file(args.refit, name=args.name, link_provider=args.link_provider)
    with open(args.out, "w") as f:
        f.write(text)
    lf = fits["link_h2d"]
    print(f"wrote {args.out}: link from {args.link_provider}: {lf['gbps']:.1f} GB/s, launch {lf['launch_us']:.2f} us, "
          f"{lf['item_overhead_us']:.3f} us per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
