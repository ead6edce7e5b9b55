"""Schedule validation: every error names the op and the field."""
import json

import pytest

from sim.errors import InputError
from sim.schedule import load, validate
from tests.helpers import schedule_doc


def err(doc) -> str:
    with pytest.raises(InputError) as e:
        validate(doc)
    return str(e.value)


def copy_op(**kw):
    op = {"op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
          "args": {"layer": 0, "src_indices": [0], "dst_indices": [0]}}
    op.update(kw)
    return op


def test_unknown_buffer_stream_event_routine_are_named():
    assert "ops[0] (op0).src: unknown buffer 'X'" in err(schedule_doc([copy_op(src="X")]))
    assert "ops[0] (op0).stream: unknown stream 'zz'" in err(schedule_doc([copy_op(stream="zz")]))
    assert "ops[0] (op0).routine: unknown routine 'memcpy'" in err(schedule_doc([copy_op(routine="memcpy")]))
    assert "ops[0] (op0).event: unknown event 'nope'" in err(
        schedule_doc([{"op": "record", "stream": "s0", "event": "nope"}]))


def test_wait_on_never_recorded_event_is_a_deadlock_error():
    msg = err(schedule_doc([{"op": "wait", "stream": "s0", "event": "e0"},
                            {"op": "record", "stream": "s0", "event": "e0"}]))
    assert "ops[0] (op0).event" in msg and "deadlock" in msg
    msg = err(schedule_doc([{"op": "host_sync", "event": "e1"}]))
    assert "ops[0] (op0).event" in msg and "deadlock" in msg


def test_bad_routine_args_name_the_arg():
    msg = err(schedule_doc([copy_op(args={"layer": 0, "src_indices": [0, 1], "dst_indices": [0]})]))
    assert "ops[0] (op0).args.dst_indices" in msg
    msg = err(schedule_doc([copy_op(args={"layer": 5, "src_indices": [0], "dst_indices": [0]})]))
    assert "args.layer" in msg


def test_impossible_geometry_is_named():
    doc = schedule_doc([])
    doc["buffers"][1]["layout"] = {"kind": "paged", "layers": 1, "pages": 2, "page_bytes": 100,
                                   "entries_per_page": 4,
                                   "fields": [{"name": "k", "offset": 0, "entry_bytes": 30}]}
    msg = err(doc)
    assert msg.startswith("buffers[1].layout")
    doc["buffers"][1]["layout"] = {"preset": "c4_paged", "layers": 1, "pages": 0}
    assert err(doc).startswith("buffers[1].layout")


def test_selection_errors():
    rd = {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [9]}
    assert "ops[0] (op0).units: expected 0..7" in err(schedule_doc([rd]))
    rd = {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [1], "ranges": [[0, 4]]}
    assert "exactly one of" in err(schedule_doc([rd]))
    rd = {"op": "read", "stream": "s0", "buffer": "D", "ranges": [[1000, 100]]}
    assert "ops[0] (op0).ranges" in err(schedule_doc([rd]))


def test_version_and_duplicates():
    doc = schedule_doc([])
    doc["kvrace_schedule"] = 2
    assert "kvrace_schedule: expected format version 1" in err(doc)
    doc = schedule_doc([{"id": "a", "op": "compute", "stream": "s0", "duration_us": 1},
                        {"id": "a", "op": "compute", "stream": "s0", "duration_us": 1}])
    assert "duplicate op id 'a'" in err(doc)


def test_host_layout_on_device_buffer_is_refused():
    doc = schedule_doc([])
    doc["buffers"][1]["layout"] = doc["buffers"][0]["layout"]
    assert "buffers[1].layout" in err(doc)


def test_load_reports_missing_and_malformed_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load(str(tmp_path / "none.json"))
    p = tmp_path / "bad.json"
    p.write_text('{"kvrace_schedule": 1,,}')
    with pytest.raises(InputError, match="line 1 column"):
        load(str(p))


def test_examples_validate_and_roundtrip_digest():
    import glob

    files = sorted(glob.glob("examples/*.json"))
    assert len(files) >= 3
    for f in files:
        s = load(f)
        assert s.digest() == validate(json.load(open(f))).digest()
