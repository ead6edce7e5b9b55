"""Regenerate ``examples/incident_v4_window.json``: a raced index-K read of the incident's own model.

The run: ``kvrace run incident-repro`` (DeepSeek V4-Flash at 4 layers, bf16 index-K, HiCache,
multi-turn load; docs/incident.md) under the ``graph-replay-no-waits`` hypothesis, where a batch
that loads replays a prefill CUDA graph captured without waits.  Its first raced read of the C4
indexer's bf16 index-K buffer is cut as ``kvrace run --export-races`` cuts it
(``kvrace.run_cli.race_window``: the read, the copies it raced, the buffers' contents at the
window's start).  ``kvrace schedule run`` reports the same stale bytes, and
``kvrace replay --mode controlled`` replays the engine's race on a GPU with SGLang's kernels.

    python examples/make_incident_window.py            # rewrites the JSON
    python examples/make_incident_window.py --check    # exit 1 if the file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvrace.run_cli import race_window
from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.report_io import regenerate

OUT = Path(__file__).with_name("incident_v4_window.json")
READER = "forward_c4_indexer_bf16"


def build() -> tuple[dict, dict]:
    sc = load_scenario("incident-repro", ["variant.hypotheses=graph-replay-no-waits"])
    engine = PrefillEngine(sc, 0, keep="all")
    result = engine.run()
    first = next(c for c in result.corrupted_reads
                 if c["status"] in ("stale", "torn") and c["reader"] == READER)
    doc, _ = race_window(engine.session.finish(), engine.report, first["op"])
    doc["name"] = "incident_v4_window"
    doc["description"] = (
        f"Cut by examples/make_incident_window.py from `kvrace run incident-repro` (DeepSeek V4-Flash, 4 layers, "
        f"seed 0, bf16 index-K, HiCache) under graph-replay-no-waits: read {first['op']} ({first['reader']}, "
        f"layer {first['layer']}, consumer index {first['consumer_index']}) of requests {first['requests']}, "
        f"{first['status']}, with the copies it raced and the buffers' contents at the window's start.")
    return doc, first


def main(argv: list[str]) -> int:
    return regenerate(build()[0], OUT, Path(__file__).name, "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
