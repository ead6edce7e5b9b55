"""When each item's bytes land: a timing model for a :class:`CopyPlan`.

Times are microseconds relative to the moment the copy starts executing on
its stream; bandwidth is in GB/s (1 GB/s = 1e3 bytes/us).

Warp kernels (``warp_quota``, ``warp_per_item``)
    After ``launch_us`` the items run in *rounds*.  With
    ``W = min(launch.warps, resident_warps)`` concurrent warps, item ``i``
    runs in round ``i // W`` (for the sgl-kernel launcher that is the warp's
    ``i // warps``-th iteration, ``item_id = round * warp_num + warp_id``).
    A round's items share the link, and one warp moves its own item no faster
    than ``warp_gbps`` however idle the link is: the round takes
    ``item_overhead_us + max(round_bytes / gbps, largest_item_bytes / warp_gbps)``,
    and rounds follow each other.  (``kvrace calibrate`` on an H200 measured a
    warp at about 0.67 GB/s: without that term 4 index-K pages of 8,448 B were
    predicted to land in 8.7 us against 19.8 us measured.)
SGLang's JIT worker shape (``LinkTiming.workers = "sglang_jit"``)
    The hicache JIT kernel (``sglang/jit_kernel/csrc/kvcacheio/hicache.cuh``, 0.5.14) runs at
    most 2 blocks of 1024 threads and gives each item a worker of ``32 / unroll`` threads, with
    ``unroll`` 4 for elements of at most 512 B, 2 up to 1024 B and 1 above
    (``_default_unroll``): 256, 128 or 64 items at once, item ``i`` on worker ``i % W`` in round
    ``i // W``.  The element is one layer's row, the largest extent of the copy.  With this
    shape a ``warp_quota`` launch (the sgl-kernel AOT shape the routines describe) runs ``W``
    items per round instead of its ``warps``; nothing else changes.
The builtin provider's wide launch (``LinkTiming.workers = "builtin"``)
    kvrace's builtin row kernel keeps the sgl-kernel launch shape below 16 MiB and runs copies of
    at least ``BUILTIN_WIDE_MIN_BYTES`` on one block of 32 warps per SM (the two CTAs cannot keep
    enough host reads in flight: ``benchmarks/bench_rows_variants.py``); the item order is the
    same (item ``i`` on warp ``i % W``, round ``i // W``), with ``W = resident_warps``.  The link
    parameters are the ones fitted below 16 MiB; a wide copy's rate is not fitted separately.
Row factors (``LinkTiming.row_factors``, round 3 of issue 12)
    A kernel copy's rounds take ``row_factor(row)`` times as long, ``row`` the copy's largest
    extent: an effective term, fitted per row size to the race windows measured on a GPU
    (``gpu_backend.calibrate.row_fit``), for what the four link parameters leave over per row
    size.  Memcpy runs are not scaled.
Memcpy runs (``memcpy_runs``)
    One ``cudaMemcpyAsync`` per run, each starting when the previous one ends
    and taking ``memcpy_latency_us + run_bytes / gbps``; the first starts at 0.
Partial progress (:func:`bytes_done`)
    An item in flight at time ``t`` has written a prefix of its concatenated
    extents (in extent order) of ``floor(frac * item_bytes / chunk_bytes) *
    chunk_bytes`` bytes, ``frac = (t - start) / (end - start)``.

Simplifications (what this model does NOT capture):

* Every item of a round starts at the round's start and ends at its end; a real
  warp starts its next item as soon as its own finishes, so rounds overlap and
  items finish in a spread, not in lock-step.
* The link is one number (``gbps``) shared evenly; there is no per-transaction
  latency, no PCIe packetisation, no contention from other streams' copies
  (the caller may scale ``gbps`` for a shared link) and no SM scheduling.
* Progress inside an item is linear and in whole ``chunk_bytes`` steps of the
  concatenated extents.  The AOT kernel really restarts its 256 B lane stride
  at every extent (so an item of 576 B per layer moves 256 + 256 + 64 B per
  layer), and the DSv4 kernel stores the first 512 B of a value before the
  value tail and the scale; here one 584 B chunk per (token, layer) lands at
  once.  Inside a chunk all 8-byte stores are taken to land together.
* Memcpy progress is byte-granular and linear (no claim on the DMA engine's
  write order beyond "a prefix").
* A resident-warp cap turns a large grid into waves of ``W`` items; blocks are
  not modelled.
* Items skipped by the kernel (a negative index) occupy a slot in their round
  and cost no bytes.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from sim.errors import InputError
from sim.transfers.routines import CopyPlan

BYTES_PER_US_PER_GBPS = 1e3
#: item-worker rules of a ``warp_quota`` kernel copy: the launch's own warps, or SGLang's JIT shape
WORKER_RULES = ("launch", "sglang_jit", "builtin")
JIT_BLOCKS = 2
JIT_BLOCK_THREADS = 1024
#: the builtin provider's row kernel runs copies of at least this many bytes on one 1,024-thread
#: block per SM (gpu_backend.providers.builtin_kernels.kvr_rows_wide); below, the launch's warps
BUILTIN_WIDE_MIN_BYTES = 16 << 20
BUILTIN_WIDE_ROUTINES = ("kernel_per_layer", "kernel_all_layer", "dsa_indexer_per_layer")


def sglang_jit_workers(element_bytes: int) -> int:
    """Items SGLang's JIT hicache kernel copies at once for elements of ``element_bytes``."""
    unroll = 4 if element_bytes <= 512 else 2 if element_bytes <= 1024 else 1
    return JIT_BLOCKS * JIT_BLOCK_THREADS // (32 // unroll)


@dataclass(frozen=True)
class LinkTiming:
    """Timing parameters for one copy path (built from a hardware profile)."""

    gbps: float
    launch_us: float = 0.0
    item_overhead_us: float = 0.0
    memcpy_latency_us: float = 0.0
    resident_warps: int = 1 << 30
    warp_gbps: float = float("inf")     # one warp's own copy rate (inf: no per-warp limit)
    workers: str = "launch"             # WORKER_RULES: who runs a warp_quota kernel's items
    #: ((row bytes, factor), ...), row bytes increasing: a kernel copy's rounds take ``factor``
    #: times as long, the factor interpolated in log2 of the copy's row (largest extent) between
    #: the points and held at the end points outside them; () is 1 for every row
    row_factors: tuple = ()

    def __post_init__(self):
        for k in ("gbps", "launch_us", "item_overhead_us", "memcpy_latency_us", "warp_gbps"):
            v = getattr(self, k)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not (
                    np.isfinite(v) or (k == "warp_gbps" and v == float("inf"))):
                raise InputError(f"LinkTiming.{k}", f"expected a finite number, got {v!r}")
            positive = k in ("gbps", "warp_gbps")
            if v < 0 or (positive and v <= 0):
                raise InputError(f"LinkTiming.{k}",
                                 f"expected a {'positive' if positive else 'non-negative'} "
                                 f"number, got {v}")
        if self.workers not in WORKER_RULES:
            raise InputError("LinkTiming.workers", f"expected one of {list(WORKER_RULES)}, got {self.workers!r}")
        rf = self.row_factors
        if not isinstance(rf, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], numbers.Integral) and p[0] > 0
                and isinstance(p[1], numbers.Real) and np.isfinite(p[1]) and p[1] > 0 for p in rf) \
                or any(a[0] >= b[0] for a, b in zip(rf, rf[1:])):
            raise InputError("LinkTiming.row_factors", f"expected ((row bytes > 0, factor > 0), ...) with "
                                                       f"increasing row bytes, got {rf!r}")
        rw = self.resident_warps
        if not isinstance(rw, numbers.Integral) or isinstance(rw, bool) or rw < 1:
            raise InputError("LinkTiming.resident_warps", f"expected an integer >= 1, got {rw!r}")

    @property
    def bytes_per_us(self) -> float:
        return self.gbps * BYTES_PER_US_PER_GBPS


def builtin_runs_wide(plan: CopyPlan) -> bool:
    """Whether the builtin provider runs ``plan`` on its wide launch: a row routine's
    ``warp_quota`` copy of at least ``BUILTIN_WIDE_MIN_BYTES``, counted as items x the largest
    item's bytes (an item skipped for a negative index counts as the provider's kernel counts it)."""
    if plan.routine not in BUILTIN_WIDE_ROUTINES or plan.launch.kind != "warp_quota" or plan.n_items == 0:
        return False
    return plan.n_items * int(plan.extents.item_bytes().max()) >= BUILTIN_WIDE_MIN_BYTES


def concurrency(plan: CopyPlan, timing: LinkTiming) -> int:
    """Items running at once: ``min(launch.warps, resident_warps)`` (1 for memcpy); with
    ``timing.workers == "sglang_jit"`` a ``warp_quota`` kernel runs SGLang's JIT worker count
    for its largest extent instead of ``launch.warps``; with ``"builtin"`` a copy the builtin
    provider runs wide (``builtin_runs_wide``) runs ``resident_warps`` items at once (one block of
    32 warps per SM: the profile's ``resident_warps_per_sm`` of 32 makes that ``sm_count x 32``)."""
    if plan.launch.kind == "memcpy_runs":
        return 1
    warps = plan.launch.warps
    if timing.workers == "sglang_jit" and plan.launch.kind == "warp_quota" and len(plan.extents):
        warps = sglang_jit_workers(int(np.asarray(plan.extents.length).max()))
    if timing.workers == "builtin" and builtin_runs_wide(plan):
        warps = timing.resident_warps
    return max(1, min(warps, timing.resident_warps))


def row_factor(timing: LinkTiming, row_bytes: int) -> float:
    """The factor of ``timing.row_factors`` for a copy whose largest extent is ``row_bytes``:
    linear in ``log2(row_bytes)`` between the two neighbouring points, the end point's factor
    outside them, 1 without points."""
    rf = timing.row_factors
    if not rf:
        return 1.0
    xs = np.log2([float(b) for b, _ in rf])
    return float(np.interp(np.log2(max(1, int(row_bytes))), xs, [float(f) for _, f in rf]))


def item_rounds(plan: CopyPlan, timing: LinkTiming) -> np.ndarray:
    """Round of every item (for memcpy runs: the run's position)."""
    return np.arange(plan.n_items, dtype=np.int64) // concurrency(plan, timing)


def item_times(plan: CopyPlan, timing: LinkTiming) -> tuple[np.ndarray, np.ndarray]:
    """``(start_us, end_us)`` per item, relative to the copy's start."""
    n = plan.n_items
    ib = plan.extents.item_bytes().astype(np.float64)
    bpu = timing.bytes_per_us
    if n == 0:
        return np.zeros(0), np.zeros(0)
    if plan.launch.kind == "memcpy_runs":
        dur = timing.memcpy_latency_us + ib / bpu
        end = np.cumsum(dur)
        return end - dur, end
    if plan.launch.kind not in ("warp_quota", "warp_per_item"):
        raise InputError("plan.launch.kind", f"expected warp_quota, warp_per_item or "
                                             f"memcpy_runs, got {plan.launch.kind!r}")
    rnd = item_rounds(plan, timing)
    n_rounds = int(rnd[-1]) + 1
    round_bytes = np.bincount(rnd, weights=ib, minlength=n_rounds)
    largest = np.zeros(n_rounds)
    np.maximum.at(largest, rnd, ib)
    dur = timing.item_overhead_us + np.maximum(round_bytes / bpu,
                                               largest / (timing.warp_gbps * BYTES_PER_US_PER_GBPS))
    if timing.row_factors and len(plan.extents):
        dur = dur * row_factor(timing, int(np.asarray(plan.extents.length).max()))
    round_end = timing.launch_us + np.cumsum(dur)
    round_start = round_end - dur
    return round_start[rnd], round_end[rnd]


def copy_end_us(plan: CopyPlan, timing: LinkTiming) -> float:
    """When the whole copy has landed (``launch_us`` for an empty kernel)."""
    _, end = item_times(plan, timing)
    if end.size:
        return float(end.max())
    return timing.launch_us if plan.launch.kind != "memcpy_runs" else 0.0


def item_bytes_done(plan: CopyPlan, start_us: np.ndarray, end_us: np.ndarray,
                    t_us: float) -> np.ndarray:
    """Bytes of each item written by ``t_us`` (int64 per item)."""
    ib = plan.extents.item_bytes()
    start_us = np.asarray(start_us, dtype=np.float64)
    end_us = np.asarray(end_us, dtype=np.float64)
    done = np.zeros(plan.n_items, dtype=np.int64)
    complete = end_us <= t_us
    done[complete] = ib[complete]
    flying = (~complete) & (start_us < t_us)
    if flying.any():
        chunk = max(1, int(plan.launch.chunk_bytes))
        frac = (t_us - start_us[flying]) / (end_us[flying] - start_us[flying])
        part = np.floor(frac * ib[flying] / chunk).astype(np.int64) * chunk
        done[flying] = np.minimum(part, ib[flying])
    return done


def bytes_done(plan: CopyPlan, start_us: np.ndarray, end_us: np.ndarray,
               t_us: float) -> np.ndarray:
    """Bytes of each extent written by ``t_us`` (int64 per extent).

    Complete items (``end <= t``) are whole, items not started are 0, an item
    in flight has written a chunk-aligned prefix of its concatenated extents.
    """
    ext = plan.extents
    if len(ext) == 0:
        return np.zeros(0, dtype=np.int64)
    done = item_bytes_done(plan, start_us, end_us, t_us)
    return np.clip(done[ext.item] - ext.offset_in_item(), 0, ext.length).astype(np.int64)
