"""The timing model's features for synthetic copies: the rounds and end times that
``sim.transfers.timing`` gives a copy of ``n`` equal items under a routine's launch shape."""
from __future__ import annotations


import numpy as np

from sim.transfers.routines import CopyPlan, Extents, warp_per_item_launch, warp_quota_launch
from sim.transfers.timing import copy_end_us, item_rounds, LinkTiming


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
    """The simulator's end time of such a copy (``sim.transfers.timing.copy_end_us``) with no
    per-warp limit (``warp_gbps`` infinite: the linear model ``fit_kernel`` fits);
    ``fit.warp_rate_us`` is the same model with the per-warp rate."""
    plan = synthetic_plan(routine, n_items, item_bytes)
    return copy_end_us(plan, LinkTiming(gbps=gbps, launch_us=launch_us, item_overhead_us=item_overhead_us,
                                        resident_warps=int(resident_warps)))
