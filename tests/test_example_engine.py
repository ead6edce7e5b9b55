"""examples/engine_22811_window.json is the window examples/make_engine_window.py cuts today.

A corrupted read of a prefill-engine run (glm5-22811, 2 layers, upstream 0.5.10 gates) with the
load-back copies it raced; the GPU suite replays every example, this one too.
"""
from sim.executor import run_schedule
from sim.replay import controlled_schedule
from tests.helpers import H200, current_window_read


def test_committed_engine_window_is_current_and_keeps_the_corrupt_read():
    s, rep, read = current_window_read("make_engine_window")
    assert read["status"] in ("stale", "torn") and "_get_topk_ragged.index_k" in read["op"]
    assert any(read["op"] in r["ops"] for r in rep["latent_races"])
    controlled_schedule(s, run_schedule(s, H200, torn=False))
