"""Commands: ``cli_calibrate`` (``kvrace calibrate``) and ``main`` (``python -m gpu_backend.calibrate
--refit``)."""
from __future__ import annotations

import json
import re
import sys

from gpu_backend.calibrate.levels import LEVELS, LINK_ROUTINE, MIB
from gpu_backend.calibrate.measurement import measure
from gpu_backend.calibrate.profile import build_profile, refit_file


def default_name(gpu: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    return f"{slug or 'gpu'}-calibrated"


def cli_calibrate(args) -> int:
    """``kvrace calibrate --out PROFILE.toml|- [--name N] [--quick]`` (torch + CUDA already checked).

    ``--out -`` writes the profile TOML to stdout and the summary to stderr.  Exit 0 when the
    profile was written; a bad output path is an InputError (exit 2) raised before measuring."""
    import functools

    from sim.report_io import check_output_path
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
    if level.name == "full":
        text = add_timing_tables(text, None if to_stdout else f"{args.out}.spread.json", say)
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
            say(f"  {k}: {f['gbps']:.1f} GB/s, {f['warp_gbps']:.2f} GB/s per warp, launch "
                  f"{f['launch_us']:.2f} us, {f['item_overhead_us']:.3f} us per round; median rel. error "
                  f"{f['rel_err_median']:.1%}, max {f['rel_err_max']:.1%}")
    sp = fits["spin"]
    say(f"  spin: {sp['cycles_per_us']:.0f} cycles/us, floor {sp['floor_us']:.2f} us, "
          f"median |error| {sp.get('rel_err_median_ge_20us', float('nan')):.1%} at >= 20 us")
    say(f"  d2h_gbps {prof.d2h_gbps:.1f}, hbm {prof.hbm_gbps:.0f} GB/s, "
          f"kernel_launch {prof.kernel_launch_us:.2f} us, {prof.sm_count} SMs x {prof.resident_warps_per_sm} warps, jitter {prof.jitter_frac:.4f}")
    return 0


def add_timing_tables(text: str, raw_path: str | None, say=print) -> str:
    """The profile ``text`` with the ``[timing]`` tables of a race-window scan of the builtin
    provider (``gpu_backend.calibrate.spread`` + ``spread_fit``: the read's launch skew after a
    compute op, and that skew by the bytes of the copy beside the read (``[timing.beside]``, from
    the scans alone), the per-run copy rate factor, the link refitted to the scans' timed copies); the
    raw scans go to ``raw_path``.  A scan that fails leaves the profile as it was and says why."""
    from sim.profile import profile_from_dict, tomllib

    from gpu_backend.calibrate.spread import measure_spread
    from gpu_backend.calibrate.spread_fit import apply_to_profile_text, fit_timing

    try:
        base = profile_from_dict(tomllib.loads(text), "calibrated profile")
        raw = measure_spread("builtin")
        if raw_path:
            with open(raw_path, "w") as f:
                json.dump({"provenance": {"command": "kvrace calibrate"}, "providers": {"builtin": raw}}, f, indent=1)
        fit = fit_timing(raw, base)
        new = apply_to_profile_text(text, fit, f"[timing] from builtin race-window scans on {raw['device']} "
                                               f"({raw['date']})")
        profile_from_dict(tomllib.loads(new), "calibrated profile")
    except Exception as e:  # the profile without distributions is still a profile
        say(f"  race-window scans failed ({type(e).__name__}: {e}); the profile has no [timing] tables")
        return text
    say(f"  race-window scans: {len(raw['shapes'])} shapes; read skew after compute median "
        f"{fit['timing']['read_after_compute_us'][len(fit['timing']['read_after_compute_us']) // 2]:.2f} us; "
        "offsets by the bytes beside the read: " + ", ".join(
            f"{o['offset_us']:+.2f} us" for o in fit.get("beside") or []))
    return new


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

