"""Hardware profiles: the timing model's parameters, read from TOML.

Shipped profiles live in ``sim/profiles/``; ``load_profile`` takes a shipped
name (``h200``, ``rtx-pro-6000``) or a path to a TOML file (e.g. one written by
``kvrace calibrate``).  Units are in the key names: ``_gbps`` is 1e9 bytes per
second (1 GB/s = 1e3 bytes per microsecond), ``_us`` microseconds.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from sim.errors import InputError, require

_SCHEMA = {
    "link": {"h2d_gbps": float, "d2h_gbps": float, "launch_us": float, "memcpy_latency_us": float,
             "item_overhead_us": float, "warp_gbps": float, "gpus_per_link": int},
    "device": {"sm_count": int, "resident_warps_per_sm": int, "hbm_gbps": float,
               "kernel_launch_us": float},
    "compute": {"jitter_frac": float},
}
# Optional keys (absent: the default, which is the model before they existed).
#   link.sharing: "fifo" serves one copy per link (and direction) at a time, first come first
#     served; "concurrent" lets copies on one link run at once, each at the link's rate (SM-driven
#     copy kernels on different streams interleave their items on a GPU; the link's total rate is
#     then over-counted, so use it to explore orders, not to predict durations).
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
_OPTIONAL = {"link": {"sharing": ("fifo", ("fifo", "concurrent"))},
             "device": {"launch_jitter_us": (0.0, None)},
             "compute": {"peak_bf16_tflops": (0.0, None), "peak_fp8_tflops": (0.0, None),
                         "mem_gbps": (0.0, None), "flops_efficiency": (0.0, None),
                         "mem_efficiency": (0.0, None), "op_launch_us": (0.0, None),
                         "roofline_jitter_frac": (0.0, None)}}


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
    launch_jitter_us: float = 0.0
    peak_bf16_tflops: float = 0.0
    peak_fp8_tflops: float = 0.0
    mem_gbps: float = 0.0
    flops_efficiency: float = 0.0
    mem_efficiency: float = 0.0
    op_launch_us: float = 0.0
    roofline_jitter_frac: float = 0.0

    def for_run(self, rng) -> "Profile":
        """The profile one run uses, drawn from ``rng`` (the run's seeded generator) before the
        run starts, for terms that vary from run to run.  Here there are none: the profile
        itself, and no draw, so every run draws the same numbers as before this hook existed."""
        return self

    def launch_skew(self, rng, kind: str, after: str | None) -> float:
        """The extra delay before a kernel of op ``kind`` (copy, read, write) starts, drawn from
        ``rng`` (the run's seeded generator); ``after`` is what preceded it on its stream (an op
        kind, ``"host"`` when the stream had run dry, None for the stream's first op).  Here:
        exponential of mean ``launch_jitter_us`` whatever the context; no draw when that is 0,
        so runs without it draw the same numbers as before it existed."""
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
                          warp_gbps=self.warp_gbps)


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
    return Profile(**values)
