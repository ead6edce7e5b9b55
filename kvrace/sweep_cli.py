"""``kvrace sweep``, ``kvrace plot`` (sweep, timeline, signatures) and ``--trace``: the command-line side of
``sim.sweeps``, ``sim.plots`` and ``sim.trace`` (registered by ``kvrace/cli.py``).

The progress bar is written here, with the standard library only (no tqdm or rich: the base
install stays numpy, simpy and networkx); it is drawn on stderr when stderr is a terminal.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from kvrace.argtypes import int_at_least
from sim.errors import InputError
from sim.report_io import check_output_path

__all__ = ["ProgressBar", "add_parsers", "add_trace_option", "check_trace_option", "write_run_trace"]

SWEEP_EPILOG = """Results go to OUT/sweep.json and OUT/sweep.csv as points finish; running the same
command again skips the points already there (it refuses an OUT written with other --trials,
--seed, --until-ci or --profile). Each point reports the fraction of trials whose read was corrupt
(stale or torn) with its 95 % Wilson interval, and the number of latent races (timing-independent).
Trial t of a point is seeded from (--seed, the point, t) alone: the numbers do not depend on
--workers or --backend.

examples:
  kvrace sweep --list
  kvrace sweep minimal_race --grid bytes_per_token=64,132,256,512 --grid compute_us=3,10,30 \\
      --grid launch_jitter_us=5 --trials 1000 --out results/minimal --plot
  kvrace plot sweep results/minimal --x load_bytes --lines compute_us
"""


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 < v <= 1):
        raise argparse.ArgumentTypeError(f"expected an interval width in (0, 1], got {v:g}")
    return v




class ProgressBar:
    """A one-line progress bar with trials per second and an ETA, redrawn at most
    ``every_s`` apart; silent unless ``stream`` is a terminal (or ``force``)."""

    def __init__(self, stream=None, *, force: bool = False, width: int = 28, every_s: float = 0.2):
        self.stream = stream or sys.stderr
        self.enabled = force or bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.every_s = every_s
        self._last = -1.0
        self._drawn = False

    @staticmethod
    def eta_text(seconds: float) -> str:
        s = int(round(seconds))
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:d}:{s % 60:02d}"

    def line(self, p) -> str:
        frac = p.trials_done / p.trials_total if p.trials_total else 1.0
        fill = int(round(frac * self.width))
        rate = p.trials_done / p.elapsed_s if p.elapsed_s > 0 else 0.0
        eta = self.eta_text((p.trials_total - p.trials_done) / rate) if rate > 0 else "?"
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}%  points {p.points_done}/"
                f"{p.points_total}  trials {p.trials_done}/{p.trials_total}  {rate:,.0f}/s  "
                f"elapsed {self.eta_text(p.elapsed_s)}  ETA {eta}")

    def __call__(self, p) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        last = p.points_done == p.points_total
        if not last and now - self._last < self.every_s:
            return
        self._last = now
        self.stream.write("\r" + self.line(p) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------- sweep

def _list_generators() -> int:
    from sim.sweeps import GENERATORS

    for gen in GENERATORS.values():
        print(f"{gen.name}: {gen.description}")
        for p in gen.params:
            default = "profile's" if p.default is None else p.default
            print(f"  {p.name} ({p.expected()}; default {default}): {p.help}")
        extra = sorted(gen.columns(gen.point()))
        if extra:
            print(f"  derived columns: {', '.join(extra)}")
    return 0


def _sweep(args) -> int:
    from sim.sweeps import SweepSpec, get_generator, parse_grid, run_sweep

    for m in args.imports or ():
        import importlib

        try:
            importlib.import_module(m)
        except ImportError as e:
            raise InputError(f"--import {m}", f"cannot import it ({e}); expected an importable module") from None
    if args.list:
        return _list_generators()
    if not args.generator:
        raise InputError("generator", "expected a generator name (kvrace sweep --list lists them)")
    gen = get_generator(args.generator)
    grid = parse_grid(gen, args.grid)
    out = args.out or f"sweep_{gen.name}"
    spec = SweepSpec(gen.name, grid, trials=args.trials, seed=args.seed, profile=args.profile,
                     until_ci=args.until_ci, imports=tuple(args.imports or ()))
    from sim.profile import load_profile

    load_profile(args.profile)                 # a bad profile is exit 2 before any work
    points = spec.points()
    print(f"sweep {gen.name}: {len(points)} points x up to {args.trials} trials "
          f"({args.backend}, {args.workers or os.cpu_count()} workers) -> {out}/sweep.csv, sweep.json",
          file=sys.stderr)
    bar = ProgressBar(force=args.progress == "always") if args.progress != "never" else None
    t0 = time.perf_counter()
    try:
        rows = run_sweep(spec, out, workers=args.workers, backend=args.backend, ray_address=args.ray_address,
                         progress=bar)
    finally:
        if bar:
            bar.close()
    wall = time.perf_counter() - t0
    varying = [k for k in grid if len(grid[k]) > 1] or list(grid)[:1]
    for r in rows:
        what = "  ".join(f"{k}={r[k]}" for k in varying)
        print(f"{what:48s} corrupt {r['corrupt_fraction']:.3f} [{r['ci_lo']:.3f}, {r['ci_hi']:.3f}] of "
              f"{r['trials']} trials  (stale {r['stale_trials']}, torn {r['torn_trials']})  latent races "
              f"{r['latent_races']}")
    print(f"{len(rows)} points in {wall:.1f} s; wrote {os.path.join(out, 'sweep.csv')} and "
          f"{os.path.join(out, 'sweep.json')}")
    if args.plot:
        from sim.plots import plot_sweep

        try:
            paths = plot_sweep(rows, os.path.join(out, "plot"), x=gen.x if gen.x in grid else None,
                               lines=gen.lines if gen.lines in grid else None)
            print(f"wrote {' and '.join(paths)}")
        except InputError as e:
            if "matplotlib" not in str(e):
                raise
            print(f"kvrace: note: no plot: {e}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- plot

def _plot_sweep(args) -> int:
    from sim.plots import plot_sweep
    from sim.sweeps import load_results

    doc = load_results(args.results)
    folder = args.results if os.path.isdir(args.results) else os.path.dirname(args.results) or "."
    base = args.out or os.path.join(folder, "plot")
    check_output_path(base + ".png", "--out")
    rows = doc["points"]
    x, lines = args.x, args.lines
    if x is None or lines is None:
        from sim.sweeps import GENERATORS

        gen = GENERATORS.get(doc.get("meta", {}).get("generator"))
        if gen is not None:
            varying = {k for k in rows[0] if len({repr(r.get(k)) for r in rows}) > 1} if rows else set()
            x = x or (gen.x if gen.x in varying else None)
            lines = lines or (gen.lines if gen.lines in varying and gen.lines != x else None)
    print(f"wrote {' and '.join(plot_sweep(rows, base, x=x, lines=lines))}")
    return 0


def _plot_timeline(args) -> int:
    from sim.executor import TieBreak, run_schedule
    from sim.plots import plot_timeline
    from sim.profile import load_profile
    from sim.schedule import load
    from sim.trace import timeline

    base = args.out or os.path.splitext(os.path.basename(args.file))[0] + "_timeline"
    check_output_path(base + ".png", "--out")
    s = load(args.file)
    run = run_schedule(s, load_profile(args.profile), seed=args.seed, ties=TieBreak(args.ties, seed=args.seed))
    print(f"wrote {' and '.join(plot_timeline(timeline(run), base))}")
    return 0


def _plot_signatures(args) -> int:
    import json

    from sim.plots import signature_heatmap

    base = args.out or os.path.splitext(args.file)[0] + "_heatmap"
    check_output_path(base if base.endswith((".png", ".svg")) else base + ".png", "--out")
    try:
        with open(args.file) as f:
            table = json.load(f)
    except FileNotFoundError:
        raise InputError(args.file, "no such file; expected a signature table (kvrace signatures --json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(args.file, f"cannot read it as JSON ({e})") from None
    print(f"wrote {' and '.join(signature_heatmap(table, base))}")
    return 0


# ---------------------------------------------------------------- schedule run --trace

def add_trace_option(run_parser) -> None:
    run_parser.add_argument("--trace", metavar="FILE",
                            help="write the run's timeline as Chrome trace-event JSON (open it in "
                                 "https://ui.perfetto.dev): a track per host and stream, record->wait arrows, "
                                 "stale/torn reads and latent races marked")


def check_trace_option(args, made: tuple = ()) -> None:
    """Refuse a --trace path that cannot be written (before the simulation runs); ``made``: as
    ``check_output_path``'s (folders the command makes before it writes the trace)."""
    path = getattr(args, "trace", None)
    if path == "-":
        raise InputError("--trace", "expected a file path ('-' is not accepted: stdout carries the report)")
    check_output_path(path, "--trace", made)


def write_run_trace(args, run, rep: dict) -> None:
    if getattr(args, "trace", None):
        from sim.trace import timeline, write_trace

        write_trace(args.trace, timeline(run, rep))


# ---------------------------------------------------------------- registration

def add_parsers(sub, epilog: str) -> None:
    """Register ``sweep`` and ``plot`` on the top-level subparsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    sw = sub.add_parser("sweep", help="race probability over a grid of schedule parameters (seeded trials, "
                        "Wilson intervals, resumable)", epilog=SWEEP_EPILOG + "\n" + epilog, formatter_class=fmt)
    sw.add_argument("generator", nargs="?", help="schedule generator (kvrace sweep --list)")
    sw.add_argument("--list", action="store_true", help="list the generators and their parameters")
    sw.add_argument("--grid", action="append", metavar="KEY=V1,V2,...",
                    help="values of one parameter (repeatable; the others keep their defaults)")
    sw.add_argument("--trials", type=int_at_least(1), default=1000, help="trials per point (default 1000; "
                    "the most with --until-ci)")
    sw.add_argument("--seed", type=int_at_least(0), default=0, help="sweep seed (>= 0, default 0)")
    sw.add_argument("--until-ci", type=_positive_float, metavar="W",
                    help="stop a point once its 95 %% interval is narrower than W (checked every 100 trials)")
    sw.add_argument("--workers", type=int_at_least(1), default=None,
                    help="local processes (default: all cores) or, with --backend ray, the CPUs of the local "
                         "Ray it starts")
    sw.add_argument("--backend", choices=["local", "ray"], default="local",
                    help="local processes, or Ray tasks (pip install 'kvrace[ray]')")
    sw.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to join (default: start one here)")
    sw.add_argument("--profile", default="h200", help="hardware profile: shipped name or TOML path (default h200)")
    sw.add_argument("--out", metavar="DIR", help="results folder (default sweep_GENERATOR)")
    sw.add_argument("--plot", action="store_true", help="also draw OUT/plot.png and OUT/plot.svg")
    sw.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                    help="progress bar on stderr (auto: when stderr is a terminal)")
    sw.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                    help="import MODULE first (it registers more generators; the workers import it too)")
    sw.set_defaults(func=_sweep)

    pl = sub.add_parser("plot", help="plot a sweep's results or a run's timeline (needs matplotlib)").add_subparsers(
        dest="what", required=True)
    ps = pl.add_parser("sweep", help="corrupt fraction against a swept size, with 95 % interval bands",
                       epilog=epilog, formatter_class=fmt)
    ps.add_argument("results", help="sweep.json or the folder holding it")
    ps.add_argument("--x", help="column on the x axis (default: the generator's, e.g. bytes_per_token)")
    ps.add_argument("--lines", help="one line per value of this column (default: the generator's, e.g. compute_us)")
    ps.add_argument("--out", metavar="BASE", help="writes BASE.png and BASE.svg (default: plot next to sweep.json)")
    ps.set_defaults(func=_plot_sweep)
    pt = pl.add_parser("timeline", help="one run of a schedule: lanes per host and stream, reads and races "
                       "marked, record->wait edges", epilog=epilog, formatter_class=fmt)
    pt.add_argument("file", help="schedule file")
    pt.add_argument("--profile", default="h200", help="hardware profile (default h200)")
    pt.add_argument("--seed", type=int_at_least(0), default=0, help="seed (>= 0, default 0)")
    pt.add_argument("--ties", default="fifo", choices=["fifo", "seeded"], help="same-instant order (default fifo)")
    pt.add_argument("--out", metavar="BASE", help="writes BASE.png and BASE.svg (default FILE_timeline)")
    pt.set_defaults(func=_plot_timeline)
    pg = pl.add_parser("signatures", help="the incident's signature table as a heat map: hypotheses against "
                       "A/B configurations, the observed row on top, fitting rows marked", epilog=epilog,
                       formatter_class=fmt)
    pg.add_argument("file", help="signature table JSON (kvrace signatures --json)")
    pg.add_argument("--out", metavar="BASE", help="writes BASE.png and BASE.svg (or only BASE when it ends in "
                    ".png or .svg; default FILE_heatmap)")
    pg.set_defaults(func=_plot_signatures)

