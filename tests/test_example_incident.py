"""examples/incident_v4_window.json is the window examples/make_incident_window.py cuts today.

A raced read from the incident's own model (DeepSeek V4-Flash, bf16 index-K, HiCache) under the
``graph-replay-no-waits`` hypothesis: the C4 indexer's bf16 index-K read of a batch that loads,
with the load-back and backup copies it raced.  The GPU suite replays every example, this one too
(SGLang's ``transfer_hicache_one_layer_mla`` and ``..._staged_lf_pf`` kernels on V4 page rows).
"""
import importlib.util
import json
from pathlib import Path

from sim.executor import run_schedule
from sim.profile import load_profile
from sim.replay import controlled_schedule
from sim.schedule import validate
from sim.verdicts import analyse

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("make_incident_window", ROOT / "examples" / "make_incident_window.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_incident_window_is_current_and_keeps_the_raced_index_k_read():
    mod = _module()
    assert mod.main(["--check"]) == 0, "run: python examples/make_incident_window.py"
    doc = json.loads(mod.OUT.read_text())
    s = validate(doc)
    rep = analyse(run_schedule(s, load_profile("h200")))
    (read,) = rep["reads"]
    assert read["status"] in ("stale", "torn")
    assert read["op"].endswith("forward_c4_indexer_bf16.index_k")
    assert s.buffers["c4_indexer_index_k_with_scale_buffer"].layout.unit_bytes == 64 * 256   # bf16 rows
    races = [r for r in rep["latent_races"] if read["op"] in r["ops"]]
    assert races and all(r["buffer"] == "c4_indexer_index_k_with_scale_buffer" for r in races)
    routines = {op.routine for op in s.ops if op.op == "copy"}
    assert "kernel_per_layer" in routines                  # the load-back's copy it raced
    controlled_schedule(s, run_schedule(s, load_profile("h200"), torn=False))
