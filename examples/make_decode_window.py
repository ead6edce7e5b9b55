"""Regenerate ``examples/decode_overlap_window.json``: a raced read of the decode server's overlap loop.

The run: ``glm5-22811-small`` (dsa-v3.2, 2 layers) in PD with a byte-level decode side in SGLang's
overlap loop (``scheduler.decode_event_loop = "overlap"``, 0.5.14's
``event_loop_overlap_disagg_decode``; docs/engine.md, "The decode side's overlap loop").  A request
that step k-1 finished rides in step k, whose KV store writes one slot past its output; its pages
are freed while that store may still be in flight, and the next request's PD transfer lands in
them unordered with it.  The decode side's first raced read is cut as ``kvrace run
--export-races`` cuts it (``kvrace.run_cli.race_window``); ``kvrace schedule run`` reports it
stale, and ``kvrace replay --mode controlled`` replays it byte-exact on a GPU (H100, SGLang's
kernels and the builtin ones: results/session_2026-12-07_30/gpu_bugs_and_decode_window/).

    python examples/make_decode_window.py            # rewrites the JSON
    python examples/make_decode_window.py --check    # exit 1 if the file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvrace.run_cli import race_window
from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.report_io import regenerate

OUT = Path(__file__).with_name("decode_overlap_window.json")
SCENARIO = "glm5-22811-small"
#: PD, a byte-level decode side in the overlap loop, 2 layers, short outputs and a decode pool
#: small enough that freed pages are reused at once
OVERRIDES = ["run.layers=2", "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
             "workload.output_tokens_min=4", "workload.output_tokens_max=8", "workload.sessions=6",
             "variant.gate_map=upstream-0.5.11", "deployment.decode_bytes=true", "run.duration_s=1.5",
             "scheduler.decode_event_loop=overlap"]


def build() -> tuple[dict, dict]:
    engine = PrefillEngine(load_scenario(SCENARIO, OVERRIDES), 0, keep="all")
    result = engine.run()
    first = next(c for c in result.decode["corrupted_reads"] if c["status"] in ("stale", "torn"))
    doc, _ = race_window(engine.decode.run, engine.decode.report, first["op"])
    doc["name"] = "decode_overlap_window"
    doc["description"] = (
        f"Cut by examples/make_decode_window.py from `kvrace run {SCENARIO}` (dsa-v3.2, 2 layers, seed 0) in PD "
        f"with a byte-level decode side in SGLang's overlap loop: the decode step's read {first['op']} (layer "
        f"{first['layer']}) of requests {first['requests']}, {first['status']}: a finished request's ride-along "
        "KV store, unordered with the next request's PD transfer into the page its release freed, landed after "
        "that transfer.")
    return doc, first


def main(argv: list[str]) -> int:
    return regenerate(build()[0], OUT, Path(__file__).name, "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
