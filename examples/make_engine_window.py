"""Regenerate ``examples/engine_22811_window.json``: the window around a corrupted read of an engine run.

The run: the first prefill-engine slice (``sim.engine.PrefillEngine``) on the ``glm5-22811-small``
scenario (DSA V3.2 geometry, page 64, HiCache, the upstream 0.5.10 gate map, the fallback
index-K store) cut to 2 layers and a small seeded workload. Its first corrupted read is the
indexer's ungated ``_get_topk_ragged`` index-K read of a batch that loads a prefix back from the
host; ``sim.window.cut_window`` cuts it with the copies it raced and the buffers' contents at the
window's start. ``kvrace schedule run`` reports the same stale bytes, and
``kvrace replay --mode controlled`` replays the engine's race on a GPU.

    python examples/make_engine_window.py            # rewrites the JSON
    python examples/make_engine_window.py --check    # exit 1 if the file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path

from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.report_io import regenerate
from sim.window import cut_window

OUT = Path(__file__).with_name("engine_22811_window.json")


def build() -> tuple[dict, dict]:
    engine = PrefillEngine(load_scenario("glm5-22811-small", ["variant.gate_map=upstream-0.5.10"]), 0, layers=2)
    result = engine.run()
    first = result.corrupted_reads[0]
    doc = cut_window(engine.session.finish(), ops=[first["op"]])
    doc["name"] = "engine_22811_window"
    doc["description"] = (
        f"Cut by examples/make_engine_window.py from a prefill-engine run of glm5-22811 (2 layers, seed 0, "
        f"upstream 0.5.10 gate map): read {first['op']} ({first['reader']}, layer {first['layer']}, "
        f"consumer index {first['consumer_index']}) of requests {first['requests']}, {first['status']}, "
        "with the load-back copies it raced and the buffers' contents at the window's start.")
    return doc, first


def main(argv: list[str]) -> int:
    return regenerate(build()[0], OUT, Path(__file__).name, "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
