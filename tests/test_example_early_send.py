"""examples/pd_early_send_window.json is the window examples/make_early_send_window.py cuts today.

SGLang #33970's race from an engine run (incident-short, 4 layers, hypothesis pd-early-send):
the prefill sender's first chunk read, on the ``rdma`` stream, overtaking the batch's KV store;
the GPU suite replays every example, this one too."""
from sim.executor import run_schedule
from sim.replay import controlled_schedule
from tests.helpers import H200, current_window_read


def test_committed_early_send_window_is_current_and_keeps_the_stale_send():
    s, rep, read = current_window_read("make_early_send_window")
    assert read["status"] == "stale" and read["op"].startswith("send0.")
    # the read raced the forward stream's store, and nothing else
    races = [r for r in rep["latent_races"] if read["op"] in r["ops"]]
    assert races and all(set(r["streams"]) == {"rdma", "forward"} for r in races)
    controlled_schedule(s, run_schedule(s, H200, torn=False))
