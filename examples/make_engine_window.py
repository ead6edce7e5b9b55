"""Regenerate ``examples/engine_22811_window.json``: the window around a corrupted read of an engine run.

The run: the first prefill-engine slice (``sim.engine.PrefillEngine``) on the ``glm5-22811``
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
SMALL = ["workload.sessions=6", "workload.concurrency=4", "workload.max_turns=4",
         "workload.first_turn_tokens=512", "workload.user_tokens_min=128", "workload.user_tokens_max=384",
         "workload.output_tokens_min=64", "workload.output_tokens_max=128", "workload.max_context_tokens=4096",
         "workload.think_time_s=0.0", "workload.system_prompt_tokens=128",
         "scheduler.max_total_tokens=3072", "scheduler.chunked_prefill_size=2048",
         "variant.gate_map=upstream-0.5.10"]


def build() -> tuple[dict, dict]:
    engine = PrefillEngine(load_scenario("glm5-22811", SMALL), 0, layers=2)
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
