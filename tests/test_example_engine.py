"""examples/engine_22811_window.json is the window examples/make_engine_window.py cuts today.

A corrupted read of a prefill-engine run (glm5-22811, 2 layers, upstream 0.5.10 gates) with the
load-back copies it raced; the GPU suite replays every example, this one too.
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
    spec = importlib.util.spec_from_file_location("make_engine_window", ROOT / "examples" / "make_engine_window.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_engine_window_is_current_and_keeps_the_corrupt_read():
    mod = _module()
    assert mod.main(["--check"]) == 0, "run: python examples/make_engine_window.py"
    doc = json.loads(mod.OUT.read_text())
    s = validate(doc)
    rep = analyse(run_schedule(s, load_profile("h200")))
    (read,) = rep["reads"]
    assert read["status"] in ("stale", "torn") and "_get_topk_ragged.index_k" in read["op"]
    assert any(read["op"] in r["ops"] for r in rep["latent_races"])
    controlled_schedule(s, run_schedule(s, load_profile("h200"), torn=False))
