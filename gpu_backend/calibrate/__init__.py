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
  (``torch.cuda._sleep``): cycles per microsecond, then requested against measured durations;
* at the full level, race-window scans of the builtin provider (``gpu_backend.calibrate.spread``):
  the free sweep's two-stream race run untimed over a grid of compute times, whose stale fractions
  give the ``[timing]`` tables (the read's launch skew after a compute op, the per-run copy rate
  factor) and a link refit (``spread_fit``; docs/timing.md).

Each timed operation runs behind a spin kernel on its stream, so the host has enqueued it before
the stream reaches it and the event pair around it sees what the stream sees: from the moment the
previous operation ended to the moment the copy's last byte landed.  Kernel copies are timed
"staged": their index arrays are already on the device (``staged_launch``), as the provider
would hold them, so the time is the kernel's, not the index upload's.

The fit (``fit_profile``, pure numpy; tested on synthetic data) uses ``sim.transfers.timing``'s
own model.  A warp-kernel copy runs in rounds of concurrent warps; a round takes
``item_overhead_us + max(round_bytes / gbps, largest_item_bytes / warp_gbps)`` (no warp moves its
own item faster than ``warp_gbps``, however idle the link is) and the copy ends ``launch_us`` plus
its rounds after the stream reaches it; one memcpy ends at ``memcpy_latency_us + B / gbps``.
Without the per-warp term both are linear in the parameters (``launch_us + R * item_overhead_us +
B / gbps`` for ``R`` rounds and ``B`` bytes), so each is fitted by non-negative least squares on
relative error, with ``R`` and ``B`` computed by the simulator's own launch shapes for the same
copy (``fit_kernel``, ``fit_memcpy``); the per-warp rate is fitted by a grid over ``gbps`` and
``warp_gbps`` with the other two by NNLS (``fit_kernel_warp_rate``):

* ``h2d_gbps``, ``warp_gbps``, ``launch_us``, ``item_overhead_us``: the builtin ``kernel_per_layer``
  H2D copies, all item sizes together, fitted with the per-warp rate
  (``[fit.builtin_kernel_per_layer_h2d_warp_rate]``); with a single item size the rate cannot be
  fitted, and the linear fit (``[fit.link_h2d]``) is written with ``warp_gbps =
  NO_WARP_LIMIT_GBPS``.  These are the hicache-family kernels (``kernel_per_layer``,
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
* ``gpus_per_link``: not measurable on one GPU; 1 (the card is assumed to have its own x16 link, as each H200
  and H100 SXM has).

``fit_profile(meas, "sglang")`` takes the link from SGLang's kernels instead (the
``[fit.<provider>_kernel_per_layer_h2d_warp_rate]`` fit of every measured provider is written).

The written TOML holds every key of ``sim.profile``'s schema, ``calibrated = true``, the source,
the date, and extra tables that ``sim.profile`` ignores: ``[calibration]`` (GPU, driver, torch,
CUDA), ``[spin]`` (cycles per microsecond for the replayer's spin), ``[fit]`` (every fit with its
residuals) and ``[measurements]`` (the raw size -> time data the fits used; ``refit_file`` refits
a written profile from them).

The package: ``levels`` (what to measure), ``model`` (the timing model's features for synthetic
copies), ``fit`` (NNLS and the warp-rate grid), ``profile`` (measurements -> profile values and
TOML; ``refit_file``), ``staged`` and ``measurement`` (GPU side: staged launches, timing,
``measure``), ``cli`` (``cli_calibrate``, ``main``).  Every name is importable from
``gpu_backend.calibrate`` itself; to replace one in a test, patch the submodule that uses it.
"""

from __future__ import annotations

from gpu_backend.calibrate.levels import (  # noqa: F401
    _LARGE_N,
    _shape_bytes,
    _SMALL_N,
    DSV4_TOKEN_BYTES,
    GIB,
    INDEX_K_PAGES,
    KIB,
    Level,
    LEVELS,
    LINK_ROUTINE,
    MIB,
    Shapes,
)
from gpu_backend.calibrate.model import (  # noqa: F401
    model_kernel_us,
    model_rounds,
    synthetic_plan,
)
from gpu_backend.calibrate.fit import (  # noqa: F401
    _rel_stats,
    _round_split,
    fit_gbps_fixed,
    fit_kernel,
    fit_kernel_warp_rate,
    fit_memcpy,
    fit_spin,
    nnls,
    spin_cycles_for,
    warp_rate_us,
)
from gpu_backend.calibrate.profile import (  # noqa: F401
    _get,
    _loads,
    _select,
    _toml_key,
    _toml_value,
    build_profile,
    fit_profile,
    KEY_COMMENTS,
    MEASUREMENT_TABLES,
    MIN_POSITIVE_US,
    NO_WARP_LIMIT_GBPS,
    profile_text,
    refit_file,
    toml_table,
)
from gpu_backend.calibrate.staged import (  # noqa: F401
    _PROVIDERS,
    _view,
    NotStaged,
    provider,
    staged_launch,
)
from gpu_backend.calibrate.measurement import (  # noqa: F401
    _append,
    _log,
    Arena,
    device_info,
    h2d_case,
    measure,
    resident_warps_per_sm,
    summary,
    Timer,
)
from gpu_backend.calibrate.cli import (  # noqa: F401
    cli_calibrate,
    default_name,
    main,
)
