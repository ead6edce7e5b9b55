import numpy as np
import pytest

from sim.errors import InputError
from sim.executor import run_reference, run_schedule
from sim.schedule import load
from sim.snapshot import Snapshot, first_difference, snapshot_of
from tests.helpers import profile


def test_snapshot_roundtrip_and_difference(tmp_path):
    s = load("examples/index_k_ungated_race.json")
    sim = snapshot_of(run_schedule(s, profile()))
    path = tmp_path / "snap.json"
    sim.dump(str(path))
    back = Snapshot.load(str(path))
    assert first_difference(sim, back) is None
    ref = snapshot_of(run_reference(s))
    d = first_difference(ref, sim)      # the racy run saw stale bytes
    assert d["what"] == "read bytes" and d["read"] == "indexer_read_index_k_L0" and d["byte"] == 0
    back.reads["indexer_read_index_k_L0"] = np.zeros(3, np.uint8)
    assert first_difference(sim, back)["bytes_differing"] > 0


def test_bad_snapshot_is_named():
    with pytest.raises(InputError, match="kvrace_snapshot"):
        Snapshot.from_json({"x": 1})
    with pytest.raises(InputError, match="reads"):
        Snapshot.from_json({"kvrace_snapshot": 1, "schedule_digest": "a", "source": "s",
                            "reads": {"r": "%%%"}, "buffers": {}})
