"""Regenerate ``examples/pd_early_send_window.json``: SGLang #33970's race, cut from an engine run.

The run: ``incident-short`` (DeepSeek V4, PD) cut to 4 layers and 6 simulated seconds under the
hypothesis ``pd-early-send`` (``deployment.pd_send = "early_unfenced"``): right after a batch's
forward is launched, the prefill's sender reads each non-final chunk's KV on the ``rdma`` stream,
with no wait on the forward (docs/engine.md, "The PD early send"). Its first corrupted read is the
first chunk send of a request, which overtook the batch's KV store on the forward stream; it is
cut as ``kvrace run --export-races`` cuts it (``kvrace.run_cli.race_window``: the read, the store
it raced, the buffers' contents at the window's start). ``kvrace schedule run`` reports the same stale bytes, and
``kvrace replay --mode controlled`` replays the engine's race on a GPU.

    python examples/make_early_send_window.py            # rewrites the JSON
    python examples/make_early_send_window.py --check    # exit 1 if the file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvrace.run_cli import race_window
from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.report_io import regenerate

OUT = Path(__file__).with_name("pd_early_send_window.json")


def build() -> tuple[dict, dict]:
    sc = load_scenario("incident-short", ["run.duration_s=6", "variant.hypotheses=pd-early-send"])
    engine = PrefillEngine(sc, 0, layers=4, keep="all")
    result = engine.run()
    first = result.corrupted_reads[0]
    doc, _ = race_window(engine.session.finish(), engine.report, first["op"])
    doc["name"] = "pd_early_send_window"
    doc["description"] = (
        f"Cut by examples/make_early_send_window.py from a prefill-engine run of incident-short (4 layers, "
        f"seed 0, PD, hypothesis pd-early-send: SGLang #33970): the sender's read {first['op']} "
        f"({first['reader']}, every {first['role']} layer) of request {first['requests']}'s first chunk, "
        f"{first['status']}, with the KV store it overtook and the buffers' contents at the window's start.")
    return doc, first


def main(argv: list[str]) -> int:
    return regenerate(build()[0], OUT, Path(__file__).name, "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
