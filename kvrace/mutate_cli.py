"""``kvrace mutate``: remove one synchronisation at a time and report whether kvrace detects it
(``sim.explore.mutate``).

Registered by ``kvrace/cli.py`` through :func:`add_parser`.
"""
from __future__ import annotations

import argparse
import os

from kvrace.argtypes import int_at_least
from sim.errors import InputError
from sim.report_io import check_output_path, write_json

__all__ = ["MUTATE_EPILOG", "add_parser", "run_mutate"]

MUTATE_EPILOG = """TARGET is a schedule file (.json) or an engine scenario (a preset name or a .toml path).

schedule: one mutant per wait, record (its waits rebind to an earlier record or become
unbound no-ops, as CUDA does), host_sync, positive host_query and barrier instance removed.
Per mutant: a latent race the original lacks; a corrupt outcome (one whose reads the original
cannot give) in the exhaustive exploration (--max-orders caps it; the table says whether it
completed); P(corrupt) over --trials seeded timing runs with a 95 % Wilson interval.
detected = new latent race or new corrupt outcome; equivalent = not detected, both
explorations complete and every read sees only bytes some order of the original gives;
missed = neither.  mutation score = detected / mutants.

scenario: one mutant per gated accessor of the gate map made ungated, and
hicache.load_fence=false when on; --trials engine seeds each; --set overrides the base;
gate mutants no model step depends on are equivalent by construction (--run-all runs them).
Exit 0 on success (whatever the score).

"""




def add_parser(sub, epilog: str) -> argparse.ArgumentParser:
    """Add ``mutate`` to the subparsers ``sub``; ``epilog`` is the exit-code text."""
    from sim.explore.model import DEFAULT_CHUNK_BYTES

    p = sub.add_parser("mutate", help="remove one synchronisation at a time: is each removal detected?",
                       epilog=MUTATE_EPILOG + epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="FILE|SCENARIO")
    p.add_argument("--trials", type=int_at_least(0), default=None, metavar="N",
                   help="timing runs per mutant (schedule, default 100) or engine seeds (scenario, default 1)")
    p.add_argument("--max-orders", type=int_at_least(1), default=10_000, metavar="N",
                   help="schedule: stop each exhaustive exploration after N orders (default 10000)")
    p.add_argument("--chunk", type=int_at_least(0), default=DEFAULT_CHUNK_BYTES, metavar="BYTES",
                   help=f"schedule: exploration chunk (default {DEFAULT_CHUNK_BYTES}; 0: whole items)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="schedule: first timing seed (default 0)")
    p.add_argument("--profile", default="h200", help="schedule: hardware profile of the timing runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set",
                   help="scenario: override a key of the base scenario (repeatable)")
    p.add_argument("--workers", type=int_at_least(1), default=1, metavar="N",
                   help="scenario: engine runs in N processes (results do not depend on it)")
    p.add_argument("--run-all", action="store_true",
                   help="scenario: also run gate mutants that are equivalent by construction")
    p.add_argument("--json", metavar="PATH", help="write the JSON report to PATH ('-' for stdout only)")
    p.set_defaults(func=run_mutate)
    return p


def _is_schedule(target: str) -> bool:
    return target.endswith(".json") or (os.path.isfile(target) and not target.endswith(".toml"))


def run_mutate(args) -> int:
    from sim.explore.mutate import mutate_scenario, mutate_schedule, scenario_text, schedule_text

    check_output_path(args.json, "--json")
    if _is_schedule(args.target):
        from sim.schedule import load

        for opt, bad in (("--set", args.set), ("--workers", args.workers != 1), ("--run-all", args.run_all)):
            if bad:
                raise InputError(opt, f"applies to a scenario; {args.target!r} is a schedule file")
        rep = mutate_schedule(load(args.target), trials=100 if args.trials is None else args.trials,
                              max_orders=args.max_orders, chunk_bytes=args.chunk, seed=args.seed,
                              profile=args.profile)
        text = schedule_text(rep)
    else:
        trials = 1 if args.trials is None else args.trials
        if trials < 1:
            raise InputError("--trials", f"expected at least 1 engine seed for a scenario, got {trials}")
        rep = mutate_scenario(args.target, args.set, trials=trials, workers=args.workers, run_all=args.run_all)
        text = scenario_text(rep)
    if args.json:
        write_json(rep.to_json(), args.json)
    if args.json != "-":
        print(text)
    return 0
