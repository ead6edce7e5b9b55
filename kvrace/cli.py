"""The ``kvrace`` command line (the console script ``kvrace`` and ``python -m kvrace``).

It lives outside ``sim`` so that ``sim`` never imports ``gpu_backend``: ``replay`` and
``calibrate`` import ``gpu_backend`` here, only when asked and only after torch and a CUDA device
were found.

Exit codes (the same for every command): 0 clean, 1 the run found what ``--fail-on`` names
(``schedule run``) or the GPU disagreed with the simulator (``replay``), 2 bad input or usage,
3 no GPU.  Every user error is an ``InputError`` that ``main`` prints as ``kvrace: error: ...``.
"""
from __future__ import annotations

import argparse
import os
import sys

from sim.errors import InputError
from sim.report_io import check_output_path, emit, write_json  # noqa: F401  (emit: re-exported)

from kvrace.sweep_cli import add_parsers, add_trace_option, check_trace_option, write_run_trace
from kvrace.argtypes import int_at_least
from kvrace.explore_cli import add_parser as add_explore_parser
from kvrace.mutate_cli import add_parser as add_mutate_parser
from kvrace.run_cli import add_parser as add_run_parser
from kvrace.scenarios_cli import add_scenarios_parser

EXIT_OK, EXIT_FOUND, EXIT_INPUT, EXIT_NO_GPU = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 141          # 128 + SIGPIPE, what a shell reports for `yes | head -1`

FAIL_ON = ("corrupt", "race", "oob", "none")

EXIT_CODES = """exit codes:
  0  clean: nothing that --fail-on names was found (replay: the GPU agreed)
  1  found: corrupt reads, races or out-of-bounds accesses as --fail-on names
     (replay: the GPU disagreed with the simulator)
  2  bad input or usage (the message names the file, key or option)
  3  no GPU (replay, calibrate)
  141  stdout was closed early (e.g. piped into head): kvrace stops without an error message
"""

RUN_EPILOG = """--fail-on KIND (repeatable or comma-separated; default: corrupt):
  corrupt  a read saw stale or torn bytes
  race     a latent race (two unordered accesses to the same bytes, one a write),
           including races between items of one launch
  oob      an out-of-bounds copy write or read
  none     always exit 0 when the run completes (cannot be combined)
--first OP (repeatable or comma-separated) implies --ties explicit; every OP must be an op id
of the schedule. PATH '-' means stdout for --json and --snapshot (not both at once); the text
summary is printed only when neither goes to stdout.

""" + EXIT_CODES

REPLAY_EPILOG = """--json - writes the JSON result to stdout instead of the text summary.

""" + EXIT_CODES


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvrace")
    except metadata.PackageNotFoundError:
        import kvrace

        return kvrace.__version__


# ---- argument types and checks (all errors are InputError or argparse usage errors: exit 2) ----





def _split(values) -> list[str]:
    """Values of a repeatable option that also takes comma-separated lists."""
    return [x.strip() for v in values or () for x in v.split(",") if x.strip()]


def fail_on_kinds(values) -> set[str]:
    kinds = _split(values) or ["corrupt"]
    bad = [k for k in kinds if k not in FAIL_ON]
    if bad:
        raise InputError("--fail-on", f"unknown kind {bad[0]!r}; expected one or more of {', '.join(FAIL_ON)}")
    if "none" in kinds and len(set(kinds)) > 1:
        raise InputError("--fail-on", "'none' cannot be combined with other kinds")
    return set(kinds) - {"none"}


def _count(rep: dict, key: str) -> int:
    v = rep.get(key)
    if isinstance(v, (list, tuple)):
        return len(v)
    return int(v or 0)


def findings(rep: dict) -> dict[str, int]:
    """How many of each --fail-on kind a ``sim.verdicts.analyse`` report holds."""
    races = rep["latent_races_total"] if "latent_races_total" in rep else len(rep.get("latent_races", ()))
    intra = (_count(rep, "intra_launch_races_total") if "intra_launch_races_total" in rep
             else _count(rep, "intra_launch_races"))
    return {"corrupt": int(rep.get("corrupt_reads", 0)),
            "race": int(races) + intra,
            "oob": _count(rep, "oob_writes") + _count(rep, "oob_reads")}


# ---- commands ----

def _schedule_validate(args) -> int:
    from sim.schedule import load

    check_output_path(args.json, "--json")
    s = load(args.file)
    n_copy = sum(op.op == "copy" for op in s.ops)
    version = s.raw["kvrace_schedule"]
    if args.json:
        write_json({"file": args.file, "valid": True, "version": version, "name": s.name,
                    "buffers": len(s.buffers), "streams": len(s.streams), "events": len(s.events),
                    "hosts": len(s.hosts), "ops": len(s.ops), "copies": n_copy,
                    "unbound_waits": [u["op"] for u in s.unbound]}, args.json)
        if args.json == "-":
            return EXIT_OK
    print(f"{args.file}: valid kvrace schedule v{version} '{s.name}': {len(s.buffers)} buffers, "
          f"{len(s.streams)} streams, {len(s.events)} events, {len(s.hosts)} host(s), {len(s.ops)} ops "
          f"({n_copy} copies)")
    for u in s.unbound:
        print(f"  note: {u['kind']} {u['op']} on event {u['event']} has no record issued before it: a no-op "
              "in CUDA (it orders nothing)")
    return EXIT_OK


def _schedule_run(args) -> int:
    from sim.executor import TieBreak, run_schedule
    from sim.profile import load_profile
    from sim.schedule import load
    from sim.verdicts import analyse, summary_text

    # Everything the user typed is checked before the simulation runs.
    fail_on = fail_on_kinds(args.fail_on)
    if args.json == "-" and args.snapshot == "-":
        raise InputError("--json - --snapshot -", "only one of them can go to stdout; give the other a file path")
    check_output_path(args.json, "--json")
    check_output_path(args.snapshot, "--snapshot")
    check_trace_option(args)
    if args.json and args.snapshot and args.json != "-" and \
            os.path.realpath(args.json) == os.path.realpath(args.snapshot):
        raise InputError("--json/--snapshot", f"both name {args.json!r}; the snapshot would overwrite the "
                         "report: give them different paths")
    first = _split(args.first)
    ties = args.ties
    if first and ties is None:
        ties = "explicit"
    elif first and ties != "explicit":
        raise InputError("--first", f"orders ops only with --ties explicit (got --ties {ties}); "
                         "drop --ties or use --ties explicit")
    s = load(args.file)
    known = [op.id for op in s.ops]
    for op_id in first:
        if op_id not in known:
            raise InputError("--first", f"unknown op id {op_id!r} in {args.file}; known op ids: {', '.join(known)}")
    profile = load_profile(args.profile)
    run = run_schedule(s, profile, seed=args.seed, ties=TieBreak(ties or "fifo", seed=args.seed, first=tuple(first)),
                       torn=not args.item_atomic, materialise=not args.compact_only)
    rep = analyse(run)
    write_run_trace(args, run, rep)
    if args.snapshot:
        from sim.snapshot import snapshot_of

        snap = snapshot_of(run)
        if args.snapshot == "-":
            write_json(snap.to_json(), "-")
        else:
            snap.dump(args.snapshot)
    if args.snapshot == "-":
        if args.json:
            write_json(rep, args.json)
    else:
        emit(rep, args.json, summary_text)
    found = {k: n for k, n in findings(rep).items() if k in fail_on and n}
    if found:
        what = ", ".join(f"{n} {dict(corrupt='corrupt read', race='race', oob='out-of-bounds access')[k]}"
                         f"{'s' if n != 1 else ''}" for k, n in found.items())
        print(f"kvrace: {args.file}: found {what} (--fail-on {','.join(sorted(fail_on))}): exit 1",
              file=sys.stderr)
        return EXIT_FOUND
    return EXIT_OK


def _profiles(args) -> int:
    from dataclasses import asdict

    from sim.profile import load_profile, shipped_profiles

    check_output_path(args.json, "--json")
    profiles = [load_profile(name) for name in shipped_profiles()]
    if args.json:
        write_json([asdict(pr) for pr in profiles], args.json)
        if args.json == "-":
            return EXIT_OK
    for pr in profiles:
        print(f"{pr.name}: {'calibrated' if pr.calibrated else 'uncalibrated'}; H2D {pr.h2d_gbps} GB/s, "
              f"launch {pr.launch_us} us; {pr.source}")
    return EXIT_OK


def _cli_replay(args) -> int:
    from gpu_backend.replay import cli_replay

    return cli_replay(args)


def _cli_calibrate(args) -> int:
    from gpu_backend.calibrate import cli_calibrate

    return cli_calibrate(args)


def _gpu_command(command):
    """GPU commands live in gpu_backend/; import it only when asked (sim never needs torch)."""
    def run(args) -> int:
        for opt in ("json", "out", "trace"):   # bad paths are exit 2, before looking for a GPU
            check_output_path(getattr(args, opt, None), f"--{opt}")
        try:
            import torch
        except ImportError:
            print(f"kvrace: error: '{args.command}' needs a GPU: torch is not installed "
                  "(pip install 'kvrace[gpu]' on a machine with CUDA)", file=sys.stderr)
            return EXIT_NO_GPU
        if not torch.cuda.is_available():
            print(f"kvrace: error: '{args.command}' needs a GPU: torch {torch.__version__} sees no CUDA "
                  "device", file=sys.stderr)
            return EXIT_NO_GPU
        return command(args)
    return run


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="kvrace", description="Find, explain and prove KV-cache transfer races.",
                                epilog=EXIT_CODES, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"kvrace {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    add_run_parser(sub, EXIT_CODES)

    sched = sub.add_parser("schedule", help="validate or run a schedule file").add_subparsers(
        dest="action", required=True)
    v = sched.add_parser("validate", help="check a schedule file and say what is wrong",
                         epilog=EXIT_CODES, formatter_class=fmt)
    v.add_argument("file")
    v.add_argument("--json", metavar="PATH", help="write the summary as JSON to PATH ('-' for stdout only)")
    v.set_defaults(func=_schedule_validate)
    r = sched.add_parser("run", help="simulate a schedule and report reads, races and out-of-bounds writes",
                         epilog=RUN_EPILOG, formatter_class=fmt)
    r.add_argument("file")
    r.add_argument("--json", metavar="PATH", help="write the JSON report to PATH ('-' for stdout only)")
    r.add_argument("--snapshot", metavar="PATH",
                   help="also write the predicted Snapshot (read bytes, buffer digests) to PATH ('-' for stdout only)")
    r.add_argument("--profile", default="h200", help="hardware profile: shipped name or TOML path (default h200)")
    r.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seed (>= 0) for jitter and seeded tie-breaking (default 0)")
    r.add_argument("--ties", default=None, choices=["fifo", "seeded", "explicit"],
                   help="order of ops ready at the same instant (default fifo; explicit when --first is given)")
    r.add_argument("--first", action="append", metavar="OP",
                   help="op id that goes first when ops tie (repeatable or comma-separated, in order; "
                        "implies --ties explicit)")
    r.add_argument("--fail-on", action="append", metavar="KIND",
                   help=f"exit 1 when the run finds KIND: {', '.join(FAIL_ON)} (repeatable or comma-separated; "
                        "default corrupt)")
    r.add_argument("--item-atomic", action="store_true",
                   help="items land whole (no torn items): the view a controlled GPU replay can force")
    r.add_argument("--compact-only", action="store_true",
                   help="keep provenance only, no materialised bytes (for large schedules)")
    add_trace_option(r)
    r.set_defaults(func=_schedule_run)

    rp = sub.add_parser("replay", help="replay a schedule on a GPU and compare with the simulator (needs torch + CUDA)",
                        epilog=REPLAY_EPILOG, formatter_class=fmt)
    rp.add_argument("file")
    rp.add_argument("--provider", default="builtin", choices=["builtin", "torch", "sglang"],
                    help="copy kernels: kvrace's own (builtin), torch indexed copies, or the installed SGLang's")
    rp.add_argument("--mode", default="controlled", choices=["controlled", "free"],
                    help="controlled: force the simulator's interleaving and require equal bytes; "
                         "free: no added synchronisation, measure how often reads are stale")
    rp.add_argument("--trials", type=int_at_least(1), default=100, help="free mode: number of runs (default 100)")
    rp.add_argument("--profile", default="h200", help="hardware profile for the simulator's prediction")
    rp.add_argument("--seed", type=int_at_least(0), default=0, help="seed (>= 0, default 0)")
    rp.add_argument("--json", metavar="PATH", help="write the JSON result to PATH ('-' for stdout only)")
    add_trace_option(rp)
    rp.set_defaults(func=_gpu_command(_cli_replay))

    cal = sub.add_parser("calibrate", help="measure this GPU and write a hardware profile (needs torch + CUDA)",
                         epilog="--out - writes the profile TOML to stdout and the summary to stderr.\n\n" + EXIT_CODES,
                         formatter_class=fmt)
    cal.add_argument("--out", required=True, metavar="PROFILE.toml", help="where to write the profile ('-' for stdout)")
    cal.add_argument("--name", default=None, help="profile name (default: from the GPU's name)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    cal.set_defaults(func=_gpu_command(_cli_calibrate))

    prof = sub.add_parser("profiles", help="list the shipped hardware profiles", epilog=EXIT_CODES, formatter_class=fmt)
    prof.add_argument("--json", metavar="PATH", help="write every profile's parameters as JSON to PATH ('-' for stdout only)")
    prof.set_defaults(func=_profiles)
    add_parsers(sub, EXIT_CODES)
    add_explore_parser(sub, EXIT_CODES)
    add_mutate_parser(sub, EXIT_CODES)
    add_scenarios_parser(sub, EXIT_CODES)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()
        return rc
    except InputError as e:
        print(f"kvrace: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except BrokenPipeError:
        # The reader went away (`kvrace profiles | head -1`): stop quietly, as Unix tools do.
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
