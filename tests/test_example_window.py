"""examples/window_load_back_race.json is what examples/make_window_example.py cuts today.

The example is a window cut from a two-rank host-program run (queries, barriers, slot reuse
after acknowledgement); the GPU suite replays every example, this one included, so the file
must stay the cut the current code produces.
"""
from tests.helpers import example_script


def test_committed_window_is_the_current_cut():
    mod = example_script("make_window_example")
    assert mod.main(["--check"]) == 0, "run: python examples/make_window_example.py"


def test_source_run_has_the_stale_read_and_clean_gated_reads():
    mod = example_script("make_window_example")
    doc, status = mod.build()
    assert status[mod.STALE_READ] == "stale"
    # exactly rank 0's ungated index-K reads of iteration 2 are stale (layer 0 too: nothing
    # was waited on before it); the gated latent reads and rank 1 are clean
    stale = {k for k, v in status.items() if v != "ok"}
    assert stale == {"rank0.it2.indexer_read_index_k_L0", mod.STALE_READ}
    assert len(status) == 16
    assert {o["id"] for o in doc["ops"] if o["op"] != "host_delay"} == {
        mod.STALE_READ, "rank0.it2.load_index_k_L1"}
