"""``kvrace explore``: every outcome a schedule's interleavings can give (``sim.explore``).

Registered by ``kvrace/cli.py`` through :func:`add_parser`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvrace.argtypes import int_at_least
from sim.errors import InputError
from sim.report_io import check_output_dir, check_output_path, write_json

__all__ = ["EXPLORE_EPILOG", "add_parser", "run_explore"]

EXPLORE_EPILOG = """modes (one of them; default --exhaustive):
  --exhaustive       every order of the racing accesses that happens-before allows, one per
                     trace (partial-order reduction); --max-orders N stops after N
  --pct N --depth D  N probabilistic-concurrency-testing runs for bugs of depth D (default 2);
                     prints the guarantee 1/(n k^(D-1)) per run
  --random N         N runs under the timing model (seeded jitter, ties and torn items, seeds
                     --seed .. --seed+N-1): outcome frequencies estimate probabilities

--chunk BYTES cuts each racing copy item into chunks of BYTES of its bytes (rounded up to
the routine's own write granularity) so torn reads appear; 0 keeps items whole (every
outcome then has a GPU-forcible witness). --witness-dir DIR writes each forcible witness as
DIR/outcome_<n>_<id>.json: a controlled schedule that `kvrace schedule run` and
`kvrace replay --mode controlled` take unchanged. Exit 1 when any outcome is corrupt (a
stale or torn read).

"""




def add_parser(sub, epilog: str) -> argparse.ArgumentParser:
    """Add ``explore`` to the subparsers ``sub``; ``epilog`` is the exit-code text."""
    from sim.explore.model import DEFAULT_CHUNK_BYTES

    p = sub.add_parser("explore", help="every outcome of a schedule's interleavings (exhaustive, PCT, random)",
                       epilog=EXPLORE_EPILOG + epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--exhaustive", action="store_true", help="every trace (the default)")
    mode.add_argument("--pct", type=int_at_least(1), metavar="N", help="N PCT runs")
    mode.add_argument("--random", type=int_at_least(1), metavar="N", help="N runs under the timing model")
    p.add_argument("--depth", type=int_at_least(1), default=None, metavar="D", help="PCT bug depth (default 2)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed for --pct and --random (default 0)")
    p.add_argument("--chunk", type=int_at_least(0), default=DEFAULT_CHUNK_BYTES, metavar="BYTES",
                   help=f"chunk of a copy item explored as one step (default {DEFAULT_CHUNK_BYTES}; 0: whole items)")
    p.add_argument("--max-orders", type=int_at_least(1), default=None, metavar="N",
                   help="exhaustive: stop after N orders (the report says it stopped)")
    p.add_argument("--profile", default="h200", help="hardware profile for --random (default h200)")
    p.add_argument("--json", metavar="PATH", help="write the JSON report to PATH ('-' for stdout only)")
    p.add_argument("--witness-dir", metavar="DIR", help="write each forcible witness schedule into DIR")
    p.add_argument("--max-listed", type=int_at_least(1), default=50, metavar="N",
                   help="outcomes listed in the text report (default 50; --json lists all)")
    p.set_defaults(func=run_explore)
    return p


def run_explore(args) -> int:
    from sim.explore import Explorer
    from sim.explore.explorer import summary_text
    from sim.schedule import load

    check_output_path(args.json, "--json")
    if args.depth is not None and args.pct is None:
        raise InputError("--depth", "is the PCT bug depth; expected it with --pct N")
    if args.max_orders is not None and (args.pct is not None or args.random is not None):
        raise InputError("--max-orders", "bounds --exhaustive only; --pct and --random run N times")
    check_output_dir(args.witness_dir, "--witness-dir")
    s = load(args.file)
    ex = Explorer(s, args.chunk, profile=args.profile)
    if args.pct is not None:
        res = ex.pct(args.pct, args.depth or 2, args.seed)
    elif args.random is not None:
        res = ex.random(args.random, args.seed)
    else:
        res = ex.exhaustive(args.max_orders)
    paths = {}
    if args.witness_dir is not None:
        os.makedirs(args.witness_dir, exist_ok=True)
        for k, o in enumerate(res.outcomes, 1):
            if o.witness is not None:
                path = os.path.join(args.witness_dir, f"outcome_{k:03d}_{o.id}.json")
                with open(path, "w") as f:
                    json.dump(o.witness, f, indent=1, sort_keys=True)
                    f.write("\n")
                paths[o.id] = path
    rep = res.to_json()
    for o in rep["outcomes"]:
        if o["id"] in paths:
            o["witness"]["path"] = paths[o["id"]]
    if args.json:
        write_json(rep, args.json)
    if args.json != "-":
        print(summary_text(res, paths, max_outcomes=args.max_listed))
    if res.corrupt:
        print(f"kvrace: {args.file}: {len(res.corrupt)} of {len(res.outcomes)} outcomes corrupt: exit 1",
              file=sys.stderr)
        return 1
    return 0
