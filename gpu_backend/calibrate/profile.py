"""Measurements -> profile: ``fit_profile`` (the profile's values and every fit), the TOML writer
(``build_profile``, ``profile_text``) and ``refit_file``."""
from __future__ import annotations

import datetime
import json
import math
import re
from typing import Mapping

import numpy as np

from sim.profile import _SCHEMA, profile_from_dict
from gpu_backend.calibrate.fit import fit_gbps_fixed, fit_kernel, fit_kernel_warp_rate, fit_memcpy, fit_spin
from gpu_backend.calibrate.levels import LINK_ROUTINE, MIB


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
        fits["link_h2d"]["what"] = (f"{link_provider} {LINK_ROUTINE} H2D copies, no per-warp limit (the profile "
                                    f"takes {link_provider}_{LINK_ROUTINE}_h2d_warp_rate instead)")
        lf = wr
    values = {
        "link": {"h2d_gbps": lf["gbps"], "d2h_gbps": fits["link_d2h"]["gbps"], "launch_us": lf["launch_us"],
                 "memcpy_latency_us": fits["memcpy_h2d"]["latency_us"],
                 "item_overhead_us": lf["item_overhead_us"],
                 "warp_gbps": lf.get("warp_gbps", NO_WARP_LIMIT_GBPS), "gpus_per_link": 1,
                 # the worker rule of the kernels the link was fitted to (sim.transfers.timing)
                 "kernel_workers": {"sglang": "sglang_jit", "builtin": "builtin"}.get(link_provider, "launch")},
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
    "kernel_workers": "who runs a kernel copy's items: the fitted provider's launch shapes (sim.transfers.timing)",
    "d2h_gbps": "builtin kernel_per_layer D2H fit ([fit.link_d2h])",
    "launch_us": "kernel copy: stream ready -> first round starts ([fit.*_h2d_warp_rate])",
    "memcpy_latency_us": "intercept of the H2D memcpy fit ([fit.memcpy_h2d])",
    "item_overhead_us": "per warp round of the kernel copy ([fit.*_h2d_warp_rate])",
    "gpus_per_link": "not measured (one GPU): the card is assumed to have its own x16 link",
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


def calibrated_gpu(path: str) -> str | None:
    """The GPU a profile written by ``kvrace calibrate`` was measured on (its ``[calibration]
    gpu``, e.g. ``"NVIDIA H200"``), or None for a profile with no such entry (a datasheet one)."""
    with open(path, "rb") as f:
        doc = _loads(f.read().decode())
    gpu = doc.get("calibration", {}).get("gpu")
    return str(gpu) if gpu else None


def refit_file(path: str, *, name: str | None = None, link_provider: str = "builtin") -> tuple[str, dict, dict]:
    """Refit a profile written by ``kvrace calibrate`` from its own ``[measurements]`` (same
    date; ``link_provider="sglang"`` for a profile of the real SGLang kernels)."""
    with open(path, "rb") as f:
        doc = _loads(f.read().decode())
    return build_profile(doc["measurements"], doc.get("calibration", {}), name=name or doc["name"],
                         date=doc["date"], level=doc.get("calibration", {}).get("level", "full"),
                         link_provider=link_provider)
