"""examples/hicache_load_back_session.json is what examples/make_session_example.py records today.

It is a whole CacheSession run (the HiCache model: backups, eviction, a load-back, gated and
ungated reads) as a schedule; the GPU suite replays every example, this one too.
"""
import json
from pathlib import Path

from sim.executor import run_schedule
from sim.profile import load_profile
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import example_script

ROOT = Path(__file__).resolve().parent.parent


def test_committed_session_example_is_current():
    mod = example_script("make_session_example")
    assert mod.main(["--check"]) == 0, "run: python examples/make_session_example.py"


def test_ungated_reads_race_the_load_and_gated_reads_see_the_loaded_prefix():
    doc = json.loads((ROOT / "examples" / "hicache_load_back_session.json").read_text())
    rep = analyse(run_schedule(validate(doc), load_profile("h200")))
    status = {r["op"]: r["status"] for r in rep["reads"]}
    assert status == {"ungated_read_L0": "stale", "ungated_read_L1": "stale",
                      "gated_read_L0": "ok", "gated_read_L1": "ok"}
    routines = {o["routine"] for o in doc["ops"] if o["op"] == "copy"}
    assert routines == {"kernel_per_layer", "staged_all_layer_lf_pf"}    # loads, page_first backups
