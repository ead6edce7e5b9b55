"""examples/incident_v4_window.json is the window examples/make_incident_window.py cuts today.

A raced read from the incident's own model (DeepSeek V4-Flash, bf16 index-K, HiCache) under the
``graph-replay-no-waits`` hypothesis: the C4 indexer's bf16 index-K read of a batch that loads,
with the load-back copy it raced (and a backup of the buffer, ordered after the read).  The GPU
suite replays every example, this one too (SGLang's ``transfer_hicache_one_layer_mla`` and
``..._staged_lf_pf`` kernels on V4 page rows).
"""
from sim.executor import run_schedule
from sim.replay import controlled_schedule
from tests.helpers import H200, current_window_read


def test_committed_incident_window_is_current_and_keeps_the_raced_index_k_read():
    s, rep, read = current_window_read("make_incident_window")
    assert read["status"] in ("stale", "torn")
    assert read["op"].endswith("forward_c4_indexer_bf16.index_k")
    assert s.buffers["c4_indexer_index_k_with_scale_buffer"].layout.unit_bytes == 64 * 256   # bf16 rows
    races = [r for r in rep["latent_races"] if read["op"] in r["ops"]]
    assert races and all(r["buffer"] == "c4_indexer_index_k_with_scale_buffer" for r in races)
    routines = {op.routine for op in s.ops if op.op == "copy"}
    assert "kernel_per_layer" in routines                  # the load-back's copy it raced
    controlled_schedule(s, run_schedule(s, H200, torn=False))
