"""``kvrace run`` (one engine run of a scenario) and ``kvrace signatures`` (the A/B table).

``kvrace run [SCENARIO|FILE] [--set k=v]... [--seed N] [--json PATH|-] [--export-races DIR]``
prints a summary table (and a progress bar in simulated time on a terminal); ``--json``
writes the metrics (docs/engine.md).  ``--export-races DIR`` writes, for each of the first
``--export-limit`` raced reads of each side (prefill, and a byte-level decode side), the window
schedule around it (``sim.window.cut_window``), which ``kvrace schedule run`` and ``kvrace replay``
take unchanged.

``kvrace signatures [MATRIX] [--scenario S] [--trials N] [--json PATH|-]`` runs the A/B matrix
(default: the incident's) under every hypothesis and prints the corrupted fraction per cell
with its 95 % interval and which hypotheses fit the observations.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvrace.argtypes import int_at_least
from kvrace.sweep_cli import ProgressBar, add_trace_option, check_trace_option, write_run_trace
from sim.engine.decode_hicache import format_decode_side
from sim.report_io import check_output_dir, check_output_path, emit

__all__ = ["add_parser", "format_run", "format_signatures", "export_races"]

#: the scenario `kvrace run` runs without an argument (the incident, shortened, under the
#: explanation its A/B table fits: docs/scenarios.md)
DEFAULT_SCENARIO = "incident-repro"
#: the JSON keys of `kvrace run --json` that issue 9 names, first; the rest follow
_RUN_KEYS = ("scenario", "seed", "requests_total", "requests_corrupted", "corrupted_fraction", "stale_reads",
             "torn_reads", "latent_races", "oob_writes", "load_backs", "branches", "sim_time_s", "wall_time_s")


class _SimTimeBar(ProgressBar):
    """The sweep's progress bar, in simulated time."""

    def __init__(self, duration_us: float, **kw):
        super().__init__(**kw)
        self.duration_us = duration_us
        self.t0 = time.monotonic()

    def line(self, p) -> str:
        frac = min(1.0, p.now_us / self.duration_us) if self.duration_us else 1.0
        fill = int(round(frac * self.width))
        elapsed = time.monotonic() - self.t0
        eta = self.eta_text(elapsed * (1 - frac) / frac) if frac > 0 else "?"
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}%  simulated "
                f"{p.now_us / 1e6:.3f}/{self.duration_us / 1e6:g} s  elapsed {self.eta_text(elapsed)}  ETA {eta}")

    def update(self, now_us: float) -> None:
        self(SimpleNamespace(now_us=now_us, points_done=0, points_total=1))


def format_run(d: dict) -> str:
    """The summary table of one run's metrics (``EngineResult.to_dict()``)."""
    rows = [
        ("scenario", f"{d['scenario']} (seed {d['seed']}, {d['layers']} layers)"),
        ("requests", f"{d['requests_total']} ({d['requests_completed']} completed"
                     + (f", {d['requests_aborted']} aborted: {d['aborted_requests'][0]['reason']}"
                        if d.get("requests_aborted") else "") + ")"),
        ("corrupted requests", f"{d['requests_corrupted']} ({100 * d['corrupted_fraction']:.1f} %): "
                               f"{d['requests_raced']} raced, {d['requests_wrong_kv']} read KV not theirs"
                               # the byte-level decode side's own count is in its rows below
                               + (f" on prefill; {d['decode']['requests_corrupted']} on the decode side"
                                  if d.get("decode") else "")),
        ("reads", f"{d['reads_total']}: {d['stale_reads']} stale, {d['torn_reads']} torn"),
        ("latent races", f"{d['latent_races']}" + (f"  {d['latent_races_by_buffer']}" if d['latent_races'] else "")),
        ("out-of-bounds writes", f"{d['oob_writes']}"),
        ("load-backs", f"{d['load_backs']} ({d['load_back_tokens']} tokens); backups {d['backups']}"),
        ("batches", f"{d['batches']} ({d['forwards_one_step']} forwards in one step"
                    + (f" over {d['simulated_ranks']} ranks" if d.get("simulated_ranks", 1) > 1 else "") + ", "
                    f"{d['chunked_batches']} with a chunk of a longer prefill"
                    + (f", {d['graph_replays']} that loaded replayed a graph without waits"
                       if d.get("graph_replays") else "")
                    + (f", {d['early_sends']} chunks sent before the host saw their forward end"
                       if d.get("early_sends") else "") + ")"),
        ("simulated time", f"{d['sim_time_s']:.3f} s (wall {d['wall_time_s']:.1f} s)"),
    ]
    if d.get("simulated_ranks", 1) > 1:
        rows.insert(3, ("ranks", f"{d['simulated_ranks']} simulated in lockstep; corrupted reads by rank "
                                 f"{d['corrupted_reads_by_rank']}"))
    w = max(len(k) for k, _ in rows)
    out = [f"{k:<{w}}  {v}" for k, v in rows]
    out.extend(format_decode_side(d.get("decode")))
    out.append("copy branches (pool: routine x copies" + (", per rank" if d.get("simulated_ranks", 1) > 1 else "")
               + "):")
    if not d["branches"]:
        out.append("  none (no HiCache copies)")
    for pool, routines in d["branches"].items():
        out.append(f"  {pool}: " + ", ".join(f"{r} x {n}" for r, n in routines.items()))
    for c in d["corrupted_reads"][:10]:
        where = (f"layer {c['layer']} {c['reader']}" if c["layer"] >= 0 else
                 "every layer (PD sender)" if c["reader"] == "pd_send" else "every layer (one-step forward)")
        rank = f" rank {c['rank']}" if "rank" in c else ""
        out.append(f"corrupted: {c['op']} {where}{rank} ({c['role']}) {c['status']}, "
                   f"{'waited' if c['waited'] else 'no wait'}, consumer {c['consumer_index']}, requests {c['requests']}")
    if len(d["corrupted_reads"]) > 10:
        out.append(f"... {len(d['corrupted_reads']) - 10} more corrupted reads (--json lists them all)")
    return "\n".join(out)


def _races_before(run, report: dict, read_id: str) -> list[list[str]]:
    """The op pairs of the latent races on a read's buffer whose listed ranges meet the read's
    bytes and whose ops both started before the read touched them, latest first."""
    s = run.schedule
    read = next(o for o in s.ops if o.id == read_id)
    t = run.access_us[read_id]
    offs, lens = (np.asarray(x, np.int64) for x in read.extents)
    found = []
    for race in report["latent_races"]:
        if race["buffer"] != read.buffer or read_id in race["ops"]:
            continue
        starts = [run.timings[o][0] for o in race["ops"]]
        if max(starts) < t and any(bool(np.any((offs < hi) & (offs + lens > lo))) for lo, hi in race["ranges"]):
            found.append((max(starts), list(race["ops"])))
    return [ops for _, ops in sorted(found, key=lambda x: -x[0])]


def _read_status(doc: dict, read_id: str, profile) -> str:
    """The read's verdict when the window ``doc`` runs as `kvrace schedule run` runs it."""
    from sim.executor import run_schedule
    from sim.schedule import validate
    from sim.verdicts import analyse

    rep = analyse(run_schedule(validate(doc), profile))
    return next(e["status"] for e in rep["reads"] if e["op"] == read_id)


def race_window(run, report: dict, read_id: str) -> tuple[dict, bool]:
    """The window schedule around a raced read of a finished run (``sim.window.cut_window``)
    and whether the read is corrupt in it.  NOTE: a read that raced no op itself can still be
    stale: two writers of its bytes raced each other before it (a late forward write and a
    load-back into a reused page, the overlap loop's `load-unfenced`).  A window of the read
    alone takes that race's outcome as its initial contents and finds the read OK, so the
    races on the read's bytes are added, latest first, until the window shows the read corrupt
    (or the next one would make the window too large to cut)."""
    from sim.errors import InputError
    from sim.window import cut_window

    ids = [read_id]
    doc = cut_window(run, ops=ids)
    for ops in _races_before(run, report, read_id):
        if _read_status(doc, read_id, run.profile) in ("stale", "torn"):
            return doc, True
        try:
            wider = [*ids, *(o for o in ops if o not in ids)]
            doc, ids = cut_window(run, ops=wider), wider
        except InputError:
            break
    return doc, _read_status(doc, read_id, run.profile) in ("stale", "torn")


def export_races(engine, result, directory, limit: int = 3) -> tuple[list[Path], list[dict]]:
    """Write the window schedule around each of the first ``limit`` raced (stale or torn)
    reads of a finished ``engine`` run (``keep="all"``) into ``directory``, on the prefill side
    (``race_K_OP.json``) and, up to ``limit`` more, on a byte-level decode side
    (``decode_race_K_OP.json``, cut from the decode session's run); returns the paths written
    and the reads skipped (``{"op", "side", "reason"}``).  (A ``wrong-kv`` read that did not
    race has no race window: its bytes are wrong in every order, so the whole run, not a
    window, is its witness.)

    NOTE: a read whose window cannot be a schedule (its buffers hold more provenance segments
    at the window's start than a schedule's ``init`` may fill: ``MAX_INIT_FILLS``) is skipped
    with the reason and the next raced read taken, so ``limit`` counts windows written and the
    run's summary is never lost to one window."""
    from sim.errors import InputError

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sides = [("prefill", "", engine.session.finish(), engine.report, result.corrupted_reads)]
    dec = _decode_kept(engine)
    if dec is not None:
        sides.append(("decode", "decode_", dec.run, dec.report, result.decode["corrupted_reads"]))
    paths: list[Path] = []
    skipped: list[dict] = []
    for side, prefix, run, report, corrupted in sides:
        k = 0
        for c in corrupted:
            if k >= limit:
                break
            if c["status"] not in ("stale", "torn"):
                continue
            try:
                doc, shown = race_window(run, report, c["op"])
            except InputError as e:
                skipped.append({"op": c["op"], "side": side, "reason": str(e)})
                continue
            doc["name"] = f"{result.scenario}_{prefix}race_{k}"
            reader = "the decode step" if c["reader"] == "*" else c["reader"]
            layer = "every layer" if c["layer"] == -1 else f"layer {c['layer']}"
            doc["description"] = (f"Cut by `kvrace run --export-races` from {result.scenario} (seed {result.seed}), "
                                  f"{side} side: read {c['op']} ({reader}, {layer}, consumer index "
                                  f"{c['consumer_index']}) of requests {c['requests']}, {c['status']}, with the ops "
                                  "it raced"
                                  + (" and the races on its bytes before it." if shown else
                                     "; the race that decided its bytes lies before this window, whose initial "
                                     "contents carry its outcome, so here the read is OK."))
            p = out / f"{prefix}race_{k}_{c['op']}.json"
            p.write_text(json.dumps(doc, indent=1) + "\n")
            paths.append(p)
            k += 1
    return paths, skipped


def _decode_kept(engine):
    """The engine's byte-level decode side when its run was kept whole (``keep="all"``), else None."""
    dec = engine.decode
    return dec if getattr(dec, "report", None) is not None else None


def write_engine_trace(args, engine) -> None:
    """``--trace``: the prefill session's timeline, and a byte-level decode side's beside it
    (``sim.trace.combined_trace``: processes ``prefill: ...`` and ``decode: ...``, one time
    axis: the decode session follows the engine's clock)."""
    dec = _decode_kept(engine)
    if dec is None:
        write_run_trace(args, engine.session.finish(), engine.report)
        return
    if getattr(args, "trace", None):
        from sim.trace import timeline, write_trace

        write_trace(args.trace, [("prefill", timeline(engine.session.finish(), engine.report)),
                                 ("decode", timeline(dec.run, dec.report))])


def _nothing_to_export(d: dict) -> str:
    """Why ``--export-races`` wrote no window for the run ``d`` (``EngineResult.to_dict()``)."""
    why = ["no stale or torn read on the prefill side"]
    if d["wrong_kv_reads"]:
        why.append(f"its {d['wrong_kv_reads']} wrong-KV reads are wrong in every order, so they have no race window")
    dec = d.get("decode")
    if dec:
        why.append("none on the decode side" + (f" (its {dec['wrong_kv_reads']} wrong-KV reads have no race window)"
                                                if dec["wrong_kv_reads"] else ""))
    return "; ".join(why)


def _run(args) -> int:
    from sim.engine.engine import PrefillEngine
    from sim.engine.scenario import load_scenario

    from sim.errors import InputError

    # output paths are checked before the run (the export folder is made before the JSON and the
    # trace are written, so either may go into it)
    check_output_dir(args.export_races, "--export-races")
    check_trace_option(args, made=(args.export_races,))
    check_output_path(args.json, "--json", made=(args.export_races,))
    if args.seed is not None and args.seed < 0:
        raise InputError("--seed", f"expected an integer >= 0, got {args.seed}")
    sc = load_scenario(args.scenario, args.set)
    # NOTE: the whole run (every op, read and timing) is kept only when an output needs it:
    # the exported windows and the trace are cut from it; otherwise the engine streams
    keep = "all" if (args.export_races or getattr(args, "trace", None)) else "report"
    engine = PrefillEngine(sc, args.seed, keep=keep)
    bar = _SimTimeBar(sc.run.duration_s * 1e6, force=args.progress == "always") if args.progress != "never" else None
    bar = bar if bar is not None and bar.enabled else None     # not a terminal: no per-iteration callback
    try:
        result = engine.run(progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    d = result.to_dict()
    doc = {k: d[k] for k in _RUN_KEYS} | {k: v for k, v in d.items() if k not in _RUN_KEYS}
    if args.export_races:
        paths, skipped = export_races(engine, result, args.export_races, args.export_limit)
        doc["exported_races"] = [str(p) for p in paths]
        if skipped:
            doc["exported_races_skipped"] = skipped
    if keep == "all":
        write_engine_trace(args, engine)
    emit(doc, args.json, lambda _: format_run(d))
    if args.json != "-":
        for p in doc.get("exported_races", []):
            print(f"exported: {p}  (kvrace schedule run {p}; kvrace replay {p})")
        for s in doc.get("exported_races_skipped", []):
            print(f"not exported: {s['op']}, {s['side']} side ({s['reason']})")
        if args.export_races and not doc["exported_races"] and "exported_races_skipped" not in doc:
            print(f"nothing exported: {_nothing_to_export(d)}")
    kinds = {"corrupt": d["requests_corrupted"], "race": d["latent_races"], "oob": d["oob_writes"]}
    return 1 if any(kinds[k] for k in args.fail_on) else 0


def format_signatures(t: dict) -> str:
    """The signature table (``SignatureTable.to_dict()``) as text: one row per hypothesis,
    one column per A/B configuration, the observed row on top."""
    cols = t["columns"]
    head = ["hypothesis"] + [c["name"] for c in cols] + ["score", "fits"]
    obs = ["observed"] + ["-" if o["fraction"] is None else f"{100 * o['fraction']:.0f} %" for o in t["observed"]]
    obs += ["", ""]
    body = [head, obs]
    for r in t["rows"]:
        cells = []
        for c, m in zip(r["cells"], r["matched"]):
            mark = "" if m is None else (" ok" if m else " X")
            cells.append(f"{100 * c['fraction']:.1f} [{100 * c['ci'][0]:.0f},{100 * c['ci'][1]:.0f}]{mark}")
        body.append([r["hypothesis"]] + cells + ["-" if r["score"] is None else f"{r['score']:.2f}",
                                                 "yes" if r["fits"] else "no"])
    widths = [max(len(row[i]) for row in body) for i in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in body]
    lines.insert(2, "  ".join("-" * w for w in widths))
    fits = [r["hypothesis"] for r in t["rows"] if r["fits"]]
    lines.append("")
    lines.append(f"{t['scenario']}: {t['trials']} trial(s) per cell, {t['runs']} distinct runs, "
                 f"{t['wall_time_s']:.1f} s. Cells: corrupted % [95 % interval]; ok/X: matches the observation or not.")
    lines.append("fits the observations: " + (", ".join(fits) if fits else "none"))
    return "\n".join(lines)


def _signatures(args) -> int:
    from sim.engine.signatures import run_signatures

    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())

    def progress(done, total):
        if show:
            sys.stderr.write(f"\rruns {done}/{total}\x1b[K")
            sys.stderr.flush()

    check_output_path(args.json, "--json")
    hyps = [h.strip() for h in args.hypotheses.split(",")] if args.hypotheses else None
    try:
        t = run_signatures(args.matrix, scenario=args.scenario, overrides=args.set, hypotheses=hyps,
                           trials=args.trials, seed=args.seed, workers=args.workers, progress=progress)
    finally:
        if show:
            sys.stderr.write("\n")
    emit(t.to_dict(), args.json, format_signatures)
    return 0




#: what `kvrace run --fail-on` can name
FAIL_ON = ("corrupt", "race", "oob")


def _fail_on(text: str) -> list[str]:
    import argparse

    kinds = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    bad = [k for k in kinds if k not in FAIL_ON]
    if bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(FAIL_ON)} or none, got {bad[0]!r}")
    return kinds


def add_parser(sub, epilog: str) -> None:
    """Add ``run`` and ``signatures`` to the argparse subparsers ``sub``."""
    import argparse

    fmt = argparse.RawDescriptionHelpFormatter
    r = sub.add_parser("run", help="run a scenario through the engine and report corrupted requests",
                       description="Run a scenario (a shipped preset: `kvrace scenarios`; or a TOML file) "
                                   "through the prefill engine on the HiCache model and report corrupted requests, "
                                   "stale and torn reads, races, load-backs and the copy branches taken.\n\n"
                                   "Memory: the engine judges each read when it completes and keeps only live "
                                   "state, so memory does not grow with the run's length; --export-races and "
                                   "--trace need the whole run (every op, read and timing) and keep it, which "
                                   "grows with the run (docs/engine.md, \"Streaming verdicts\").",
                       epilog=epilog, formatter_class=fmt)
    r.add_argument("scenario", nargs="?", default=DEFAULT_SCENARIO,
                   help=f"a shipped scenario or a scenario TOML file (default {DEFAULT_SCENARIO})")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key, e.g. --set workload.concurrency=1 (repeatable)")
    r.add_argument("--seed", type=int, default=None, help="seed (default the scenario's run.seed)")
    r.add_argument("--json", metavar="PATH|-", help="write the metrics as JSON (- for stdout: no table)")
    r.add_argument("--export-races", metavar="DIR",
                   help="write a window schedule around each raced (stale or torn) read, prefill and byte-level "
                        "decode side (keeps the whole run in memory)")
    r.add_argument("--export-limit", type=int_at_least(1), default=3, metavar="N",
                   help="how many to export per side (3)")
    r.add_argument("--fail-on", default=[], type=_fail_on,
                   help="exit 1 when any of corrupt,race,oob is found (default none: exit 0)")
    r.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    add_trace_option(r)
    r.set_defaults(func=_run)
    s = sub.add_parser("signatures", help="the A/B signature table: every hypothesis against the observations",
                       description="Run an A/B matrix (default: the incident's, sim/scenarios/ab/incident.toml) under "
                                   "every hypothesis and score each against what the deployment observed.",
                       epilog=epilog, formatter_class=fmt)
    s.add_argument("matrix", nargs="?", default="incident", help="a shipped A/B matrix or a TOML file (incident)")
    s.add_argument("--scenario", help="base scenario instead of the matrix's")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every cell")
    s.add_argument("--hypotheses", metavar="A,B,...", help="rows (default every registered hypothesis)")
    s.add_argument("--trials", type=int_at_least(1), default=1, help="seeds per cell (1)")
    s.add_argument("--seed", type=int, default=0, help="first seed (0)")
    s.add_argument("--workers", type=int_at_least(1), default=None, help="processes (default: every core)")
    s.add_argument("--json", metavar="PATH|-", help="write the table as JSON (- for stdout)")
    s.add_argument("--progress", choices=["auto", "always", "never"], default="auto")
    s.set_defaults(func=_signatures)
