"""``kvrace scenarios``: the shipped scenario presets, one line each (registered by ``kvrace/cli.py``).

Each line: the preset's name, its one-line description, then model and deployment.  ``--json PATH``
(``-`` for stdout) writes, per preset, its name, description, summary (model and deployment),
digest and the whole resolved scenario (``Scenario.to_dict()``)."""
from __future__ import annotations

from sim.report_io import check_output_path, write_json

__all__ = ["add_scenarios_parser", "scenarios_command"]

EPILOG = """A preset runs as `kvrace run NAME [--set section.key=value]...` (the engine session);
docs/scenarios.md lists every section and key.  --json - writes JSON to stdout only.
"""


def scenarios_command(args) -> int:
    from sim.engine.scenario import load_scenario, shipped_scenarios

    check_output_path(args.json, "--json")
    presets = [load_scenario(name) for name in shipped_scenarios()]
    if args.json:
        write_json([{"name": s.name, "description": s.description, "summary": s.summary(), "digest": s.digest(),
                     "scenario": s.to_dict()} for s in presets], args.json)
        if args.json == "-":
            return 0
    width = max(len(s.name) for s in presets)
    for s in presets:
        print(f"{s.name:<{width}}  {s.description}  [{s.summary()}]")
    return 0


def add_scenarios_parser(sub, exit_codes: str) -> None:
    import argparse

    p = sub.add_parser("scenarios", help="list the shipped scenario presets", epilog=EPILOG + "\n" + exit_codes,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the presets as JSON to PATH ('-' for stdout only)")
    p.set_defaults(func=scenarios_command)
