"""``kvrace replay --trace`` on a real GPU: the measured timeline of a controlled and of a free replay.

Run with ``pytest -m gpu tests/test_trace_gpu_replay.py``; skipped without torch or CUDA.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the GPU tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from gpu_backend.replay import replay, replay_timelines, replay_trace, summary_text  # noqa: E402
from sim.schedule import load  # noqa: E402

MINIMAL = "examples/index_k_ungated_race.json"


def test_controlled_replay_timeline_is_the_forced_order():
    s = load(MINIMAL)
    rep = replay(s, "builtin", "controlled")
    assert rep["ok"], summary_text(rep)
    (_, sim), (label, gpu) = replay_timelines(s, rep)
    assert label.startswith(f"measured on {rep['device']}")
    timed = {sl.op: sl for sl in gpu.slices if not sl.args.get("inferred")}
    assert set(timed) == set(rep["timings_us"]) and all(sl.end_us >= sl.start_us >= 0 for sl in timed.values())
    # the simulator's item-atomic run reads before the load lands: forced, the GPU's read ends
    # before any segment of the load starts, and is marked stale like the simulated one
    read = timed["indexer_read_index_k_L0"]
    loads = [sl for op, sl in timed.items() if op.startswith("load_index_k_L0")]
    assert loads and all(read.end_us <= sl.start_us for sl in loads)
    assert [m.kind for m in gpu.marks] == [m.kind for m in sim.marks if m.kind != "race"] == ["stale"]
    json.dumps(replay_trace(s, rep))


def test_free_replay_timed_run():
    s = load(MINIMAL)
    rep = replay(s, "builtin", "free", trials=5, sim_seeds=0, timeline=True)
    assert set(rep["timed_run"]["reads"].values()) <= {"clean", "stale"}, rep["timed_run"]
    assert set(rep["timed_run"]["timings_us"]) == {"load_index_k_L0", "indexer_q_proj", "indexer_read_index_k_L0"}
    trace = replay_trace(s, rep)
    assert any(e["ph"] == "X" and e["pid"] == 4 and e["name"] == "load_index_k_L0" and e["dur"] > 0
               for e in trace["traceEvents"])
