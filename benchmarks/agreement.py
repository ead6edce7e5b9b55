"""Agreement table: the free sweep's measured stale fractions against the simulator's.

    python benchmarks/agreement.py --csv sglang=DIR/free_sweep.csv --csv builtin=DIR2/free_sweep.csv
        [--race sglang=race.json] [--out results/fidelity/agreement.md]

Each CSV is a ``benchmarks/free_sweep.py`` output with both sides filled (stale trials of the
free replays, stale runs of the seeded simulator runs).  Each point gets
``gpu_backend.agreement.agreement``: the point agrees when Newcombe's 95 % interval of
``p_sim - p_gpu`` meets the band of 5 points or the measured 95 % Wilson interval.  ``--race``
adds a ``kvrace replay --json`` report of the minimal race (its ``simulated_stale_runs``).
``--session PROVIDER=PROFILE`` gives the simulated side the run-to-run spread of one GPU session
(the profile's ``[fit.session] jitter_us``; ``gpu_backend.calibrate.session_fit``), as the GPU
agreement test does.  ``--rule PROVIDER=PROFILE`` replaces that provider's simulated column by the stale rule of the
fit (``gpu_backend.calibrate.spread_fit.rule_stale_probability``, as a count out of
``--rule-runs``): a check of a refitted profile against measured CSVs in seconds, without the
simulator's runs (the GPU agreement test runs the simulator itself).
Writes a markdown table per provider (every point, misses marked) and a summary line per
provider, after the command and commit that produced it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.free_sweep import read_csv  # noqa: E402
from gpu_backend.agreement import agreement  # noqa: E402


def csv_provenance(path: str) -> list[str]:
    """The ``# key: value`` lines of the CSV's ``.provenance.txt`` (or of the CSV itself)."""
    import os

    for p in (path + ".provenance.txt", path):
        if os.path.exists(p):
            with open(p) as f:
                lines = [line[2:].strip() for line in f if line.startswith("# ")]
            if lines:
                return lines
    return []


def provider_table(name: str, rows: list[dict], session_profile: str | None = None) -> tuple[list[str], dict]:
    """The per-point table and the summary; with ``session_profile``, each point's simulated side
    carries the run-to-run spread of that profile's ``[fit.session] jitter_us``."""
    spreads = {}
    if session_profile:
        from gpu_backend.calibrate.session_fit import point_session_spread, profile_jitter_us
        from sim.profile import load_profile

        sigma, prof = profile_jitter_us(session_profile), load_profile(session_profile)
        spreads = {i: point_session_spread(prof, (int(r["bytes_per_token"]), int(r["tokens"]), float(r["compute_us"])),
                                           sigma_us=sigma) for i, r in enumerate(rows)}
    lines = ["| compute us | B/token | tokens | GPU stale | GPU 95 % | simulated | session spread | diff 95 % | verdict |",
             "| ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- |"]
    n = miss = within = 0
    absdiff = 0.0
    order = sorted(range(len(rows)), key=lambda i: (float(rows[i]["compute_us"]), int(rows[i]["bytes_per_token"]),
                                                    int(rows[i]["tokens"])))
    for i in order:
        r, sp = rows[i], spreads.get(i, (0.0, 0.0))
        a = agreement(int(r["stale_trials"]), int(r["trials"]), int(r["sim_stale_runs"]), int(r["sim_seeds"]),
                      session=sp)
        n += 1
        miss += not a.agrees
        within += a.within
        absdiff += abs(a.p_sim - a.p_gpu)
        verdict = "agrees" if a.agrees else "**MISS**"
        lines.append(f"| {float(r['compute_us']):g} | {int(r['bytes_per_token'])} | {int(r['tokens'])} | "
                     f"{a.p_gpu:.2f} ({a.k_gpu}/{a.n_gpu}) | {a.gpu_lo:.2f}-{a.gpu_hi:.2f} | "
                     f"{a.p_sim:.2f} ({a.k_sim}/{a.n_sim}) | -{sp[0]:.2f} +{sp[1]:.2f} | "
                     f"{a.diff_lo:+.2f}..{a.diff_hi:+.2f} | {verdict} |")
    summary = {"provider": name, "points": n, "agree": n - miss, "miss": miss, "within_point_estimates": within,
               "mean_abs_diff": absdiff / n if n else float("nan")}
    return lines, summary


def rule_rows(rows: list[dict], profile: str, runs: int) -> list[dict]:
    """``rows`` with the simulated columns from the fit's stale rule under ``profile``."""
    from gpu_backend.calibrate.spread_fit import rule_stale_probability
    from sim.profile import load_profile

    prof = load_profile(profile)
    out = []
    for r in rows:
        p = rule_stale_probability(prof, int(r["bytes_per_token"]), int(r["tokens"]), float(r["compute_us"]))
        out.append({**r, "sim_seeds": runs, "sim_stale_runs": int(round(p * runs))})
    return out


def race_line(name: str, path: str, session_profile: str | None = None,
              schedule: str = "examples/index_k_ungated_race.json") -> tuple[str, dict]:
    with open(path) as f:
        rep = json.load(f)
    r = rep["reads"][0]
    sp = (0.0, 0.0)
    if session_profile:
        from gpu_backend.calibrate.session_fit import point_session_spread, profile_jitter_us
        from sim.profile import load_profile

        with open(os.path.join(ROOT, schedule)) as f:
            doc = json.load(f)
        sp = point_session_spread(load_profile(session_profile), doc, sigma_us=profile_jitter_us(session_profile))
    a = agreement(int(r["stale_trials"]), int(r["trials"]), int(r["simulated_stale_runs"]), int(r["simulated_runs"]),
                  session=sp)
    inside = a.gpu_lo <= a.p_sim <= a.gpu_hi
    text = (f"minimal race ({name}, {rep.get('profile', '?')}): GPU {a.p_gpu:.3f} ({a.k_gpu}/{a.n_gpu}, 95 % "
            f"{a.gpu_lo:.3f}-{a.gpu_hi:.3f}), simulated {a.p_sim:.3f} ({a.k_sim}/{a.n_sim}): "
            f"{'inside' if inside else 'outside'} the measured interval; session spread -{sp[0]:.2f} +{sp[1]:.2f}; test: "
            f"{'agrees' if a.agrees else 'MISS'} (difference {a.diff_lo:+.3f}..{a.diff_hi:+.3f})")
    return text, {"provider": name, "inside": inside, **a.as_dict()}


def main(argv=None) -> int:
    from benchmarks.provenance import command, git_commit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", action="append", default=[], metavar="PROVIDER=PATH", required=True)
    ap.add_argument("--race", action="append", default=[], metavar="PROVIDER=PATH")
    ap.add_argument("--out", default=None, help="markdown file (default: stdout)")
    ap.add_argument("--json", default=None, help="the summaries as JSON")
    ap.add_argument("--rule", action="append", default=[], metavar="PROVIDER=PROFILE",
                    help="simulated column from the fit's stale rule with PROFILE (no simulator runs)")
    ap.add_argument("--rule-runs", type=int, default=200, help="runs the rule's probability is counted out of")
    ap.add_argument("--session", action="append", default=[], metavar="PROVIDER=PROFILE",
                    help="the simulated side carries PROFILE's run-to-run spread ([fit.session] jitter_us)")
    args = ap.parse_args(argv)
    rules = dict(item.split("=", 1) for item in args.rule)
    sessions = dict(item.split("=", 1) for item in args.session)
    out = [f"<!-- command: {command()} -->", f"<!-- commit: {os.environ.get('KVRACE_COMMIT') or git_commit()} -->", ""]
    summaries, races = [], []
    for item in args.csv:
        name, path = item.split("=", 1)
        rows = read_csv(path)
        if name in rules:
            rows = rule_rows(rows, rules[name], args.rule_runs)
        lines, summary = provider_table(name, rows, sessions.get(name))
        summaries.append(summary)
        out.append(f"### {name}: {summary['agree']} of {summary['points']} points agree "
                   f"(mean |difference| {summary['mean_abs_diff']:.3f})")
        out.append("")
        out.append(f"Data: `{os.path.relpath(path, ROOT)}` ({'; '.join(csv_provenance(path))})")
        out.append("")
        out += lines
        out.append("")
    for item in args.race:
        name, path = item.split("=", 1)
        text, rec = race_line(name, path, sessions.get(name))
        races.append(rec)
        out.append(text)
        out.append("")
    text = "\n".join(out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    for s in summaries:
        print(f"{s['provider']}: {s['agree']}/{s['points']} agree, mean |diff| {s['mean_abs_diff']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"providers": summaries, "races": races}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
