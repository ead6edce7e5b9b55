"""The ``kvrace`` command line."""
from __future__ import annotations

import argparse
import json
import sys

from sim.errors import InputError


def _schedule_validate(args) -> int:
    from sim.schedule import load

    s = load(args.file)
    n_copy = sum(op.op == "copy" for op in s.ops)
    print(f"{args.file}: valid kvrace schedule v1 '{s.name}': {len(s.buffers)} buffers, "
          f"{len(s.streams)} streams, {len(s.events)} events, {len(s.ops)} ops ({n_copy} copies)")
    return 0


def _schedule_run(args) -> int:
    from sim.executor import TieBreak, run_schedule
    from sim.profile import load_profile
    from sim.schedule import load
    from sim.verdicts import analyse, summary_text

    s = load(args.file)
    profile = load_profile(args.profile)
    ties = TieBreak(args.ties, seed=args.seed, first=tuple(args.first or ()))
    run = run_schedule(s, profile, seed=args.seed, ties=ties, torn=not args.item_atomic,
                       materialise=not args.compact_only)
    rep = analyse(run)
    if args.snapshot:
        from sim.snapshot import snapshot_of

        snapshot_of(run).dump(args.snapshot)
    emit(rep, args.json, summary_text)
    return 0


def emit(rep: dict, json_path: str | None, text, default=None) -> None:
    """Write a report: JSON to ``json_path`` ('-' = stdout only) and the human text
    to stdout unless the JSON went there."""
    if json_path:
        doc = json.dumps(rep, indent=1, default=default)
        if json_path == "-":
            print(doc)
        else:
            with open(json_path, "w") as f:
                f.write(doc + "\n")
    if json_path != "-":
        print(text(rep))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrace", description="Find, explain and prove KV-cache transfer races.")
    sub = p.add_subparsers(dest="command", required=True)

    sched = sub.add_parser("schedule", help="validate or run a schedule file").add_subparsers(
        dest="action", required=True)
    v = sched.add_parser("validate", help="check a schedule file and say what is wrong")
    v.add_argument("file")
    v.set_defaults(func=_schedule_validate)
    r = sched.add_parser("run", help="simulate a schedule and report reads, races and out-of-bounds writes")
    r.add_argument("file")
    r.add_argument("--json", metavar="PATH", help="write the JSON report to PATH ('-' for stdout only)")
    r.add_argument("--snapshot", metavar="PATH", help="also write the predicted Snapshot (read bytes, buffer digests)")
    r.add_argument("--profile", default="h200", help="hardware profile: shipped name or TOML path (default h200)")
    r.add_argument("--seed", type=int, default=0, help="seed for jitter and seeded tie-breaking (default 0)")
    r.add_argument("--ties", default="fifo", choices=["fifo", "seeded", "explicit"],
                   help="order of ops ready at the same instant (default fifo)")
    r.add_argument("--first", nargs="*", metavar="OP_ID", help="with --ties explicit: op ids that go first")
    r.add_argument("--item-atomic", action="store_true",
                   help="items land whole (no torn items): the view a controlled GPU replay can force")
    r.add_argument("--compact-only", action="store_true",
                   help="keep provenance only, no materialised bytes (for large schedules)")
    r.set_defaults(func=_schedule_run)

    rp = sub.add_parser("replay", help="replay a schedule on a GPU and compare with the simulator (needs torch + CUDA)")
    rp.add_argument("file")
    rp.add_argument("--provider", default="builtin", choices=["builtin", "torch", "sglang"],
                    help="copy kernels: kvrace's own (builtin), torch indexed copies, or the installed SGLang's")
    rp.add_argument("--mode", default="controlled", choices=["controlled", "free"],
                    help="controlled: force the simulator's interleaving and require equal bytes; "
                         "free: no added synchronisation, measure how often reads are stale")
    rp.add_argument("--trials", type=int, default=100, help="free mode: number of runs (default 100)")
    rp.add_argument("--profile", default="h200", help="hardware profile for the simulator's prediction")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--json", metavar="PATH", help="write the JSON result to PATH ('-' for stdout only)")
    rp.set_defaults(func=_gpu_command("gpu_backend.replay", "cli_replay"))

    cal = sub.add_parser("calibrate", help="measure this GPU and write a hardware profile (needs torch + CUDA)")
    cal.add_argument("--out", required=True, metavar="PROFILE.toml")
    cal.add_argument("--name", default=None, help="profile name (default: from the GPU's name)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    cal.set_defaults(func=_gpu_command("gpu_backend.calibrate", "cli_calibrate"))

    prof = sub.add_parser("profiles", help="list the shipped hardware profiles")
    prof.set_defaults(func=_profiles)
    return p


def _gpu_command(module: str, func: str):
    """GPU commands live in gpu_backend/; import it only when asked (sim never needs torch)."""
    def run(args) -> int:
        import importlib

        try:
            import torch
        except ImportError:
            print(f"kvrace: error: '{args.command}' needs a GPU: torch is not installed "
                  "(pip install 'kvrace[gpu]' on a machine with CUDA)", file=sys.stderr)
            return 3
        if not torch.cuda.is_available():
            print(f"kvrace: error: '{args.command}' needs a GPU: torch {torch.__version__} sees no CUDA "
                  "device", file=sys.stderr)
            return 3
        return getattr(importlib.import_module(module), func)(args)
    return run


def _profiles(args) -> int:
    from sim.profile import load_profile, shipped_profiles

    for name in shipped_profiles():
        pr = load_profile(name)
        print(f"{name}: {'calibrated' if pr.calibrated else 'uncalibrated'}; H2D {pr.h2d_gbps} GB/s, "
              f"launch {pr.launch_us} us; {pr.source}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:
        print(f"kvrace: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
