"""Row-size factors of the copy model and the read-skew offsets, fitted together to measured sweeps.

Round 2 of issue 12 fitted one read-skew offset per bucket of the bytes beside the read
(``spread_fit.beside_offsets``).  Shapes with the same bytes but different rows (512 B x 1,024
and 128 B x 4,096 are both 512 KiB) then share an offset, although their windows need different
ones: what the four-parameter link model leaves over depends on the row size.  This module fits,
by binomial likelihood over every point of the given measured sweeps,

* one factor ``g_r`` per row size ``r`` (``link.row_factors``: a kernel copy's rounds take
  ``g_r`` times as long; ``sim.transfers.timing.row_factor``), every one free (round 4; round 3
  held the smallest row's at 1, ``reference``), and
* one offset ``delta_b`` per bucket ``b`` of bytes beside (``BESIDE_UPTO``), added to the
  profile's plain read-skew table as in round 2,

with the stale rule of ``spread_fit`` (``P(R + delta_b < f g_r x + L - kl - c)``, ``R`` and ``f``
from the profile's tables, ``x`` the copy's run after its launch with the profile's link and
no row factor).  Coordinate ascent: each bucket's offset over a grid given the factors, then
each row's factor over a grid given the offsets, ``ROUNDS`` times; among equal likelihoods the
value nearest the start (offset 0, factor 1) wins.

NOTE: the common level needs no anchor row.  A factor scales the copy's run ``x`` and an offset
adds a constant, and shapes of one bucket have different rows and so different ``x`` (512 B x
1,024 and 128 B x 4,096 are both 512 KiB): moving every factor by one ratio changes each shape's
window by ``(ratio - 1) f g_r x``, which no offset per bucket can undo, so the likelihood fixes the
level itself, if weakly: the ascent from factor 1 finds a local maximum, and on some subsets of
the sessions a start with every factor near 1.3 ends higher (docs/timing.md, "Round 4").  Holding the smallest row at 1 (round 3) forced that row's shapes to be corrected
by their buckets' offsets alone: 128 B x 4,096 at 30 us could then only open its window by
closing 512 B x 1,024's at 10 us, and the fit chose the latter (GPU 0.08-0.23, model 0.00).

The run-to-run jitter (``session_fit``) is then fitted with the new profile and written with it
(``[fit.session] jitter_us``), for ``gpu_backend.agreement``.

    python -m gpu_backend.calibrate.row_fit --profile IN.toml --sweep CSV [--sweep CSV ...] --out OUT.toml
        [--schedule examples/index_k_ungated_race.json --replay REPORT.json ...]

Each ``--sweep`` is one device session's measured sweep (``benchmarks/free_sweep.py`` CSV or the
agreement test's), all of one provider.  Pure numpy; no GPU.
"""
from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np

from gpu_backend.calibrate import spread_fit as sf

__all__ = ["ROUNDS", "FACTOR_GRID", "read_sessions", "schedule_shape", "fit_rows", "apply_rows_to_profile_text", "main"]

ROUNDS = 10
FACTOR_GRID = np.round(np.arange(0.5, 1.5001, 0.01), 3)
OFFSET_MAX_US = 8.0
SKEW_KEY = "read_after_compute_us"


def read_sessions(paths: list[str]) -> list[dict]:
    """One dict per CSV: ``(bytes_per_token, tokens, compute_us) -> (stale trials, trials)``."""
    out = []
    for path in paths:
        with open(path) as f:
            rows = csv.DictReader(line for line in f if not line.startswith("#"))
            out.append({(int(r["bytes_per_token"]), int(r["tokens"]), float(r["compute_us"])):
                        (int(r["stale_trials"]), int(r["trials"])) for r in rows})
    return out


def _bucket(nbytes: int, upto=sf.BESIDE_UPTO) -> int:
    for i, u in enumerate(upto):
        if nbytes <= u:
            return i
    return len(upto)


def schedule_shape(doc: dict) -> tuple[int, int, float]:
    """``(row bytes, copy bytes, compute us)`` of a schedule with one copy and one compute op
    (the minimal race): its copy's largest extent, its copies' bytes, the compute's duration."""
    from sim.schedule import validate

    s = validate(doc)
    copies = [o for o in s.ops if o.op == "copy"]
    computes = [o for o in s.ops if o.op == "compute"]
    if len(copies) != 1 or len(computes) != 1:
        raise ValueError(f"schedule {doc.get('name')}: expected one copy and one compute op, got "
                         f"{len(copies)} and {len(computes)}")
    row = int(np.asarray(copies[0].plan.extents.length).max())
    compute = next(o for o in doc["ops"] if o["op"] == "compute")
    return row, sf._copy_bytes(doc), float(compute["duration_us"])


def fit_rows(profile, sessions: list[dict], rounds: int = ROUNDS, schedules=(), reference=None) -> dict:
    """Row factors and bucket offsets (module docstring) from the sessions' points, and from
    ``schedules``: ``(schedule document, [(stale trials, trials) per session])`` pairs of
    schedules with one copy and one compute op (the minimal race), each a point of its own row
    size, bytes and compute time.  ``reference``: a row size whose factor is held at 1 (round
    3's rule, with the smallest row); ``None`` (default) fits every row's factor."""
    from gpu_backend.calibrate.spread import race_doc

    base = replace(profile, timing=(), timing_beside=(), row_factors=())
    plain = profile.timing_table(SKEW_KEY)
    rate = profile.timing_table("copy_rate_factor")
    if plain is None:
        raise ValueError(f"profile {profile.name}: no timing.{SKEW_KEY} table to move per bucket")
    skew = np.asarray(plain.values, float)
    rate_v = None if rate is None else np.asarray(rate.values, float)
    lead = base.launch_us - base.kernel_launch_us
    # a point: (shape key, row bytes, copy bytes, compute us, stale trials, trials)
    points = [((b, t), b, b * t, c, k, n) for s in sessions for (b, t, c), (k, n) in s.items()]
    x = {sh: sf._copy_end(race_doc(sh[0], sh[1], 1.0), base) - base.launch_us for sh in {p[0] for p in points}}
    for doc, counts in schedules:
        row, nbytes, c = schedule_shape(doc)
        key = doc.get("name", "schedule")
        x[key] = sf._copy_end(doc, base) - base.launch_us
        points += [(key, row, nbytes, c, k, n) for k, n in counts]
    rows = sorted({p[1] for p in points})
    offsets_grid = np.round(np.concatenate([[-float(skew.min())], np.arange(
        np.ceil(-float(skew.min()) / sf.BESIDE_STEP_US) * sf.BESIDE_STEP_US, OFFSET_MAX_US + 1e-9, sf.BESIDE_STEP_US)]), 6)
    cache: dict = {}

    def margins(sh, g):
        key = (sh, round(g, 4))
        if key not in cache:
            cache[key] = sf.stale_probability(lambda f: f * g * x[sh] + lead, skew, rate_v)
        return cache[key]

    def nll(pts, g, d):
        total = 0.0
        for sh, row, nbytes, c, k, n in pts:
            p = sf.stale_at(margins(sh, g[row]), c + d[_bucket(nbytes)])
            p = min(max(float(p), 1e-6), 1 - 1e-6)
            total -= k * np.log(p) + (n - k) * np.log1p(-p)
        return total

    g = {b: 1.0 for b in rows}
    d = {i: 0.0 for i in range(len(sf.BESIDE_UPTO) + 1)}
    start = nll(points, g, d)
    for _ in range(rounds):
        for i in d:
            mine = [p for p in points if _bucket(p[2]) == i]
            if mine:
                vals = np.array([nll(mine, g, {**d, i: float(v)}) for v in offsets_grid])
                best = np.flatnonzero(vals <= vals.min() + 1e-9)
                d[i] = float(offsets_grid[best[np.argmin(np.abs(offsets_grid[best]))]])
        for b in rows:
            if b == reference:
                continue
            mine = [p for p in points if p[1] == b]
            vals = np.array([nll(mine, {**g, b: float(v)}, d) for v in FACTOR_GRID])
            best = np.flatnonzero(vals <= vals.min() + 1e-9)
            g[b] = float(FACTOR_GRID[best[np.argmin(np.abs(FACTOR_GRID[best] - 1.0))]])
    counts = {i: sum(1 for p in points if _bucket(p[2]) == i) for i in d}
    return {"row_factors": [(b, g[b]) for b in rows], "offsets_us": [d[i] for i in sorted(d)],
            "bucket_points": [counts[i] for i in sorted(d)], "upto_bytes": list(sf.BESIDE_UPTO),
            "plain_skew": skew.tolist(), "nll_start": float(start), "nll": float(nll(points, g, d)),
            "points": len(points), "sessions": len(sessions)}


def apply_rows_to_profile_text(text: str, fit: dict, session: dict | None, what: str) -> str:
    """``text`` with ``link.row_factor_bytes`` / ``link.row_factors`` set (after the ``[link]``
    table's last key), the ``[timing.beside.read_after_compute_us]`` tables replaced by the plain
    table moved by the fitted offsets, and ``[fit.rows]`` (and ``[fit.session]``) appended."""
    import re

    rb = "[" + ", ".join(str(int(b)) for b, _ in fit["row_factors"]) + "]"
    rf = "[" + ", ".join(f"{g:.4f}" for _, g in fit["row_factors"]) + "]"
    text = re.sub(r"(?m)^row_factor_bytes = [^\n]*\n", "", text)
    text = re.sub(r"(?m)^row_factors = [^\n]*\n", "", text)
    lines = text.splitlines()
    start = lines.index("[link]")
    end = start + 1
    while end < len(lines) and lines[end].strip() and not lines[end].startswith("["):
        end += 1
    lines[end:end] = [f"row_factor_bytes = {rb}".ljust(35) + "# row sizes of the fitted factors ([fit.rows])",
                      f"row_factors = {rf}".ljust(35) + "# gpu_backend.calibrate.row_fit: measured race windows"]
    out, skip = [], False
    while lines and not lines[-1].strip():
        lines.pop()
    for line in lines:
        head = re.match(r"^\[([^\]]+)\]\s*(#.*)?$", line.strip())
        if head:
            skip = head.group(1) in (f"timing.beside.{SKEW_KEY}", "fit.rows", "fit.session")
        if not skip and not (not line.strip() and out and not out[-1].strip()):
            out.append(line)
    skew = np.asarray(fit["plain_skew"])
    tables = [np.maximum(skew + o, 0.0) for o in fit["offsets_us"]]
    out += ["", f"[timing.beside.{SKEW_KEY}]", "upto_bytes = [" + ", ".join(str(u) for u in fit["upto_bytes"]) + "]",
            "tables = ["] + ["  [" + ", ".join(f"{v:.4f}" for v in t) + "]," for t in tables] + ["]"]
    out += ["", "[fit.rows]", f'what = "{what}"',
            "row_bytes = " + rb, "row_factors = " + rf,
            "offset_us = [" + ", ".join(f"{o:.2f}" for o in fit["offsets_us"]) + "]",
            "bucket_points = [" + ", ".join(str(c) for c in fit["bucket_points"]) + "]",
            f"points = {fit['points']}", f"sessions = {fit['sessions']}",
            f"nll_start = {fit['nll_start']:.3f}", f"nll = {fit['nll']:.3f}"]
    if session is not None:
        out += ["", "[fit.session]",
                'what = "run-to-run jitter of the read against the copy, per point and session '
                '(gpu_backend.calibrate.session_fit; used by gpu_backend.agreement)"',
                f"jitter_us = {session['sigma_us']:.3f}", f"loglik_gain = {session['gain']:.3f}",
                f"points = {len(session['points'])}", f"sessions = {session['sessions']}"]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv=None) -> int:
    import argparse

    from gpu_backend.calibrate.session_fit import fit_session_jitter
    from sim.profile import load_profile, profile_from_dict, tomllib

    ap = argparse.ArgumentParser(prog="python -m gpu_backend.calibrate.row_fit", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--sweep", action="append", required=True, help="one session's measured sweep CSV")
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", default="", help="provenance text for [fit.rows] (the sweeps' commits)")
    ap.add_argument("--schedule", help="a schedule with one copy and one compute op (the minimal race) ...")
    ap.add_argument("--replay", action="append", default=[],
                    help="... and one `kvrace replay --json` report of it per session (its stale trials)")
    ap.add_argument("--reference-row", type=int, default=None,
                    help="hold this row size's factor at 1 (round 3's rule); default: every factor free")
    args = ap.parse_args(argv)
    prof = load_profile(args.profile)
    sessions = read_sessions(args.sweep)
    schedules = []
    if args.schedule:
        import json

        with open(args.schedule) as f:
            doc = json.load(f)
        counts = []
        for path in args.replay:
            with open(path) as f:
                r = json.load(f)["reads"][0]
            counts.append((int(r["stale_trials"]), int(r["trials"])))
        schedules.append((doc, counts))
    fit = fit_rows(prof, sessions, schedules=schedules, reference=args.reference_row)
    with open(args.profile) as f:
        text = f.read()
    what = args.what or "gpu_backend.calibrate.row_fit from " + ", ".join(args.sweep)
    new = apply_rows_to_profile_text(text, fit, None, what)
    refit = profile_from_dict(tomllib.loads(new), args.out)
    session = fit_session_jitter(refit, sessions)
    new = apply_rows_to_profile_text(new, fit, session, what)
    profile_from_dict(tomllib.loads(new), args.out)
    with open(args.out, "w") as f:
        f.write(new)
    print(f"wrote {args.out}: row factors {fit['row_factors']}; offsets {fit['offsets_us']}; nll "
          f"{fit['nll_start']:.1f} -> {fit['nll']:.1f} over {fit['points']} points; session jitter "
          f"{session['sigma_us']:.2f} us (log-likelihood gain {session['gain']:.1f})")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
