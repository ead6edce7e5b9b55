"""Hardware profiles: the timing model's parameters, read from TOML.

Shipped profiles live in ``sim/profiles/``; ``load_profile`` takes a shipped
name (``h200``, ``rtx-pro-6000``) or a path to a TOML file (e.g. one written by
``kvrace calibrate``).  Units are in the key names: ``_gbps`` is 1e9 bytes per
second (1 GB/s = 1e3 bytes per microsecond), ``_us`` microseconds.
"""
from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, replace
from importlib import resources

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from sim.errors import InputError, require

__all__ = ["BesideTable", "Profile", "QuantileTable", "TIMING_KINDS", "TIMING_AFTER", "load_profile", "profile_from_dict",
           "shipped_profiles", "timing_key"]

_SCHEMA = {
    "link": {"h2d_gbps": float, "d2h_gbps": float, "launch_us": float, "memcpy_latency_us": float,
             "item_overhead_us": float, "warp_gbps": float, "gpus_per_link": int},
    "device": {"sm_count": int, "resident_warps_per_sm": int, "hbm_gbps": float,
               "kernel_launch_us": float},
    "compute": {"jitter_frac": float},
}
# Optional keys (absent: the default, which is the model before they existed).
#   link.sharing: "fifo" serves one copy per link (and direction) at a time, first come first
#     served; "submission" one at a time in issue order: when the link frees, the waiting copy
#     issued first (a burst's next copy, ready the moment the one before it ends, goes before a
#     copy issued after the burst that waited longer: a copy engine running the work submitted
#     to it, SGLang #38448); "concurrent" lets copies on one link run at once, each at the link's
#     rate (SM-driven copy kernels on different streams interleave their items on a GPU; the
#     link's total rate is then over-counted, so use it to explore orders, not to predict
#     durations).
#   link.kernel_workers: "launch" runs a warp_quota kernel copy's items on the launch's warps (the
#     sgl-kernel AOT shape); "sglang_jit" on SGLang's JIT hicache kernel's workers (256, 128 or 64
#     items at once by element size; sim.transfers.timing), for a profile of SGLang's kernels;
#     "builtin" as "launch" below 16 MiB and on one block of 32 warps per SM (resident_warps
#     items at once) for a row copy of 16 MiB or more: kvrace's builtin kernels.
#   link.row_factor_bytes, link.row_factors (optional, together): a kernel copy's rounds take the
#     factor of its row size (largest extent) times as long, interpolated in log2 of the row
#     between the points, held outside them (sim.transfers.timing.row_factor): fitted to measured
#     race windows by gpu_backend.calibrate.row_fit.
#   device.launch_jitter_us: every kernel (copy, read, write) starts after an extra delay drawn
#     from an exponential distribution of this mean by the run's seeded generator: the launch
#     skew between streams that a GPU shows (kernel starts measured 9-23 us after a gate on an
#     H200; heavy-tailed, so a kernel queued behind k others can still start first).
#   compute.* (the roofline cost model of sim.engine.cost; 0 means "not given", and the cost
#     model refuses a profile that lacks one it needs, naming the key):
#     peak_bf16_tflops, peak_fp8_tflops: dense tensor-core peaks (1e12 FLOP/s, datasheets);
#     mem_gbps: device memory bandwidth for kernel reads (datasheet; not hbm_gbps, which counts
#       a device-to-device copy's read + write); flops_efficiency, mem_efficiency: the fraction
#       of those peaks a kernel reaches (0 < x <= 1); op_launch_us: per-kernel launch overhead;
#     roofline_jitter_frac: sigma of the cost model's own multiplicative jitter, keyed by
#       (seed, op) so a forward's per-layer durations sum to its one-step duration (0: use
#       compute.jitter_frac; the forward's compute ops are issued with jitter false).
_OPTIONAL = {"link": {"sharing": ("fifo", ("fifo", "submission", "concurrent")),
                      "kernel_workers": ("launch", ("launch", "sglang_jit", "builtin"))},
             "device": {"launch_jitter_us": (0.0, None)},
             "compute": {"peak_bf16_tflops": (0.0, None), "peak_fp8_tflops": (0.0, None),
                         "mem_gbps": (0.0, None), "flops_efficiency": (0.0, None),
                         "mem_efficiency": (0.0, None), "op_launch_us": (0.0, None),
                         "roofline_jitter_frac": (0.0, None)}}

# Optional [timing] table: measured distributions (docs/timing.md).  Every key holds a quantile
# table, a list of 1 to 1001 finite numbers, non-decreasing: the values at the probabilities
# 0, 1/(n-1), ..., 1 (one value: a constant, drawn without touching the generator).
#   <kind>_after_<after>_us (kind: copy, read, write; after: an op kind, host or first): the
#     extra delay before a kernel of that kind starts when ``after`` preceded it on its stream
#     (Profile.launch_skew; it replaces launch_jitter_us for that context);
#   <kind>_us: the same for every context of that kind without its own key;
#   copy_rate_factor: drawn once per run (Profile.for_run); every copy's rate terms (h2d_gbps,
#     d2h_gbps, warp_gbps) are divided by it and item_overhead_us multiplied by it for that run
#     (> 0; 1.2 = every round of a kernel copy 20 % longer).
# Optional [timing.beside.<key>] tables (<key> one of the skew keys above): the same skew drawn
# from a table chosen by the bytes of the copies in flight beside the kernel (BesideTable):
#   upto_bytes: 1 to 64 strictly increasing integers > 0; tables: len(upto_bytes) + 1 quantile
#   tables; a kernel with b bytes beside it draws from tables[i] for the first i with
#   b <= upto_bytes[i], from the last table above them all.  It takes the place of the plain
#   table of the same key (Profile.launch_skew; Profile.skew_by_beside is then true).
TIMING_KINDS = ("copy", "read", "write")
TIMING_AFTER = ("compute", "wait", "record", "copy", "read", "write", "host", "first")
MAX_QUANTILES = 1001
MAX_BESIDE_BUCKETS = 64


def timing_key(kind: str, after: str | None) -> str:
    """The [timing] key of a kernel of ``kind`` after ``after`` (None: the stream's first op)."""
    return f"{kind}_after_{after or 'first'}_us"


_SKEW_KEYS = frozenset([timing_key(k, a) for k in TIMING_KINDS for a in TIMING_AFTER]
                       + [f"{k}_us" for k in TIMING_KINDS])
_TIMING_KEYS = _SKEW_KEYS | {"copy_rate_factor"}


@dataclass(frozen=True)
class QuantileTable:
    """A distribution given by its quantiles at equally spaced probabilities: ``values[i]`` is
    the quantile at ``i / (n - 1)``.  ``sample`` draws one uniform number and interpolates
    linearly between the two neighbouring quantiles (inverse-CDF sampling of the piecewise
    linear CDF through the points); a table of one value is a constant and draws nothing."""

    values: tuple

    def sample(self, rng) -> float:
        v = self.values
        if len(v) == 1:
            return float(v[0])
        x = float(rng.random()) * (len(v) - 1)
        i = min(int(x), len(v) - 2)
        return float(v[i] + (v[i + 1] - v[i]) * (x - i))

    def quantile(self, q: float) -> float:
        """The table's quantile at probability ``q`` (0 <= q <= 1), interpolated linearly."""
        v = self.values
        return float(np.interp(q * (len(v) - 1), np.arange(len(v)), v)) if len(v) > 1 else float(v[0])

    def mean(self) -> float:
        v = np.asarray(self.values, dtype=np.float64)
        return float(v[0]) if v.size == 1 else float(((v[:-1] + v[1:]) / 2).mean())


@dataclass(frozen=True)
class BesideTable:
    """A skew distribution conditional on the bytes beside the kernel: ``tables[i]`` holds for
    ``upto_bytes[i-1] < bytes <= upto_bytes[i]`` (``tables[0]`` from 0, the last one above
    ``upto_bytes[-1]``); ``len(tables) == len(upto_bytes) + 1``."""

    upto_bytes: tuple
    tables: tuple

    def table_for(self, beside_bytes: int) -> QuantileTable:
        """The table of the first bucket whose upper bound is at least ``beside_bytes``."""
        return self.tables[bisect.bisect_left(self.upto_bytes, beside_bytes)]


def _beside_table(v, where: str, key: str) -> BesideTable:
    name = f"{where}: timing.beside.{key}"
    require(key in _SKEW_KEYS, name, f"unknown key; a beside table is keyed like a skew table: "
                                     f"<kind>_after_<after>_us or <kind>_us (kind one of {list(TIMING_KINDS)})")
    require(isinstance(v, dict), name, f"expected a table with upto_bytes and tables, got {v!r}")
    extra = sorted(set(v) - {"upto_bytes", "tables"})
    require(not extra, f"{name}.{extra[0] if extra else ''}", "unknown key; expected upto_bytes and tables")
    upto = v.get("upto_bytes")
    ok = isinstance(upto, list) and 1 <= len(upto) <= MAX_BESIDE_BUCKETS and all(
        isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in upto)
    require(ok, f"{name}.upto_bytes", f"expected a list of 1 to {MAX_BESIDE_BUCKETS} integers > 0, got {upto!r}")
    require(all(b > a for a, b in zip(upto, upto[1:])), f"{name}.upto_bytes",
            f"expected strictly increasing bounds, got {upto!r}")
    tables = v.get("tables")
    require(isinstance(tables, list) and len(tables) == len(upto) + 1, f"{name}.tables",
            f"expected a list of len(upto_bytes) + 1 = {len(upto) + 1} quantile tables, got "
            f"{len(tables) if isinstance(tables, list) else repr(tables)}")
    return BesideTable(tuple(upto), tuple(_quantile_table(t, where, f"beside.{key}.tables[{i}]", False)
                                          for i, t in enumerate(tables)))


def _quantile_table(v, where: str, key: str, positive: bool) -> QuantileTable:
    name = f"{where}: timing.{key}"
    ok = isinstance(v, list) and 1 <= len(v) <= MAX_QUANTILES and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
    require(ok, name, f"expected a list of 1 to {MAX_QUANTILES} finite numbers (quantiles at equally spaced "
                      f"probabilities 0..1), got {v!r}")
    require(all(b >= a for a, b in zip(v, v[1:])), name, f"expected non-decreasing quantiles, got {v!r}")
    low = min(v)
    require(low > 0 if positive else low >= 0, name,
            f"expected every value {'> 0' if positive else '>= 0'}, got {low}")
    return QuantileTable(tuple(float(x) for x in v))


@dataclass(frozen=True)
class Profile:
    name: str
    calibrated: bool
    source: str
    date: str
    h2d_gbps: float
    d2h_gbps: float
    launch_us: float
    memcpy_latency_us: float
    item_overhead_us: float
    warp_gbps: float
    gpus_per_link: int
    sm_count: int
    resident_warps_per_sm: int
    hbm_gbps: float
    kernel_launch_us: float
    jitter_frac: float
    link_sharing: str = "fifo"
    kernel_workers: str = "launch"
    launch_jitter_us: float = 0.0
    peak_bf16_tflops: float = 0.0
    peak_fp8_tflops: float = 0.0
    mem_gbps: float = 0.0
    flops_efficiency: float = 0.0
    mem_efficiency: float = 0.0
    op_launch_us: float = 0.0
    roofline_jitter_frac: float = 0.0
    #: link.row_factor_bytes / link.row_factors as ((row bytes, factor), ...) (sim.transfers.timing)
    row_factors: tuple = ()
    #: the [timing] table: (key, QuantileTable) pairs, sorted by key (a tuple: the profile stays
    #: hashable and frozen)
    timing: tuple = ()
    #: the [timing.beside] tables: (key, BesideTable) pairs, sorted by key
    timing_beside: tuple = ()

    def timing_table(self, key: str) -> QuantileTable | None:
        """The [timing] quantile table of ``key``, or None."""
        for k, t in self.timing:
            if k == key:
                return t
        return None

    def for_run(self, rng) -> "Profile":
        """The profile one run uses, drawn from ``rng`` (the run's seeded generator) before the
        run starts, for terms that vary from run to run.  With ``timing.copy_rate_factor``: one
        factor ``f`` drawn from it, and the profile returned has ``h2d_gbps``, ``d2h_gbps`` and
        ``warp_gbps`` divided by ``f``, ``item_overhead_us`` multiplied by it (every round of a
        kernel copy takes ``f`` times as long; launch and memcpy latency stay) and no rate-factor
        table (so it draws nothing more).
        Without it: the profile itself, and no draw, so every run draws the same numbers as
        before this hook existed."""
        table = self.timing_table("copy_rate_factor")
        if table is None:
            return self
        f = table.sample(rng)
        rest = tuple((k, t) for k, t in self.timing if k != "copy_rate_factor")
        return replace(self, h2d_gbps=self.h2d_gbps / f, d2h_gbps=self.d2h_gbps / f,
                       warp_gbps=self.warp_gbps / f, item_overhead_us=self.item_overhead_us * f, timing=rest)

    @property
    def skew_by_beside(self) -> bool:
        """Whether ``launch_skew`` depends on the bytes of the copies in flight beside the kernel
        (the executor works them out only then): exactly when the profile has a
        ``[timing.beside]`` table."""
        return bool(self.timing_beside)

    def beside_table(self, key: str) -> BesideTable | None:
        """The [timing.beside] table of ``key``, or None."""
        for k, t in self.timing_beside:
            if k == key:
                return t
        return None

    def launch_skew(self, rng, kind: str, after: str | None, beside_bytes: int = 0) -> float:
        """The extra delay before a kernel of op ``kind`` (copy, read, write) starts, drawn from
        ``rng`` (the run's seeded generator); ``after`` is what preceded it on its stream (an op
        kind, ``"host"`` when the stream had run dry, None for the stream's first op);
        ``beside_bytes`` the bytes of the copies in flight on the kernel's device when it is ready
        (the executor passes 0 unless ``skew_by_beside``).  The first of: the beside table
        ``<kind>_after_<after>_us`` (its bucket of ``beside_bytes``), the plain table of that key,
        the beside table ``<kind>_us``, the plain table ``<kind>_us``; else exponential of mean
        ``launch_jitter_us``, with no draw when that is 0, so runs of a profile without tables
        draw the same numbers as before this hook existed.  Every table draws one uniform."""
        if self.timing or self.timing_beside:
            for key in (timing_key(kind, after), f"{kind}_us"):
                beside = self.beside_table(key) if self.timing_beside else None
                if beside is not None:
                    return beside.table_for(beside_bytes).sample(rng)
                table = self.timing_table(key)
                if table is not None:
                    return table.sample(rng)
        j = self.launch_jitter_us
        return float(rng.exponential(j)) if j > 0 else 0.0

    @property
    def resident_warps(self) -> int:
        return self.sm_count * self.resident_warps_per_sm

    def link_timing(self, gbps: float):
        """The timing parameters of a copy on a path of ``gbps`` (see sim.transfers.timing)."""
        from sim.transfers.timing import LinkTiming

        return LinkTiming(gbps=gbps, launch_us=self.launch_us, item_overhead_us=self.item_overhead_us,
                          memcpy_latency_us=self.memcpy_latency_us, resident_warps=self.resident_warps,
                          warp_gbps=self.warp_gbps, workers=self.kernel_workers, row_factors=self.row_factors)


def shipped_profiles() -> list[str]:
    files = resources.files("sim") / "profiles"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> Profile:
    if os.path.isdir(name_or_path):
        raise InputError("profile", f"{name_or_path!r} is a directory; give a profile TOML file or a shipped "
                         f"profile name, one of {shipped_profiles()}")
    if os.path.exists(name_or_path):
        try:
            with open(name_or_path, "rb") as f:
                text = f.read()
        except OSError as e:
            raise InputError("profile", f"cannot read {name_or_path!r}: {e.strerror}") from None
        where = name_or_path
    else:
        res = resources.files("sim") / "profiles" / f"{name_or_path}.toml"
        if not res.is_file():
            raise InputError("profile", f"no profile file {name_or_path!r} and no shipped profile of that "
                             f"name; expected a path or one of {shipped_profiles()}")
        text = res.read_bytes()
        where = f"profile {name_or_path}"
    try:
        doc = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(where, f"not a UTF-8 text file (byte {e.start}: {e.reason}); a profile is TOML "
                         "as `kvrace calibrate` writes it") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(where, f"not valid TOML: {e}") from None
    return profile_from_dict(doc, where)


def _row_factors(link: dict, where: str) -> tuple:
    """``link.row_factor_bytes`` (increasing integers > 0) and ``link.row_factors`` (numbers > 0,
    as many) as ((row bytes, factor), ...); both absent: ()."""
    rb, rf = link.get("row_factor_bytes"), link.get("row_factors")
    if rb is None and rf is None:
        return ()
    ok = (isinstance(rb, list) and 1 <= len(rb) <= 64
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in rb)
          and all(a < b for a, b in zip(rb, rb[1:])))
    require(ok, f"{where}: link.row_factor_bytes", f"expected 1 to 64 increasing integers > 0, got {rb!r}")
    ok = (isinstance(rf, list) and len(rf) == len(rb)
          and all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in rf))
    require(ok, f"{where}: link.row_factors", f"expected {len(rb)} finite numbers > 0 (one per row_factor_bytes), "
                                              f"got {rf!r}")
    return tuple((int(b), float(f)) for b, f in zip(rb, rf))


def profile_from_dict(doc: dict, where: str = "profile") -> Profile:
    values = {}
    for key, typ in (("name", str), ("calibrated", bool), ("source", str), ("date", str)):
        require(isinstance(doc.get(key), typ), f"{where}: {key}", f"expected a {typ.__name__}, got {doc.get(key)!r}")
        values[key] = doc[key]
    for section, keys in _SCHEMA.items():
        sec = doc.get(section)
        require(isinstance(sec, dict), f"{where}: [{section}]", "missing table")
        for key, typ in keys.items():
            v = sec.get(key)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and (typ is float or isinstance(v, int))
                  and math.isfinite(v))
            require(ok, f"{where}: {section}.{key}", f"expected a finite {'number' if typ is float else 'integer'}, got {v!r}")
            positive = key != "jitter_frac" and not key.endswith("overhead_us")
            require(v > 0 if positive else v >= 0, f"{where}: {section}.{key}",
                    f"expected {'> 0' if positive else '>= 0'}, got {v}")
            values[key] = typ(v)
    for section, keys in _OPTIONAL.items():
        for key, (default, choices) in keys.items():
            v = doc[section].get(key, default)
            if choices is not None:
                require(v in choices, f"{where}: {section}.{key}", f"expected one of {list(choices)}, got {v!r}")
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                require(ok, f"{where}: {section}.{key}", f"expected a finite number >= 0, got {v!r}")
                v = float(v)
            values["link_sharing" if key == "sharing" else key] = v
    values["row_factors"] = _row_factors(doc["link"], where)
    timing = doc.get("timing", {})
    require(isinstance(timing, dict), f"{where}: [timing]", f"expected a table, got {timing!r}")
    beside = timing.get("beside", {})
    require(isinstance(beside, dict), f"{where}: [timing.beside]", f"expected a table, got {beside!r}")
    values["timing_beside"] = tuple((key, _beside_table(beside[key], where, key)) for key in sorted(beside))
    timing = {k: v for k, v in timing.items() if k != "beside"}
    for key in timing:
        require(key in _TIMING_KEYS, f"{where}: timing.{key}",
                f"unknown key; expected <kind>_after_<after>_us (kind one of {list(TIMING_KINDS)}, after one "
                f"of {list(TIMING_AFTER)}), <kind>_us or copy_rate_factor")
    values["timing"] = tuple((key, _quantile_table(timing[key], where, key, key == "copy_rate_factor"))
                             for key in sorted(timing))
    return Profile(**values)
