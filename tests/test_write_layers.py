"""A ``write`` of several ``layers`` (one kernel storing the same units in every listed layer,
as the engine's batch KV store issues it): validation names the field, and its bytes are
those of one write per layer, in that order, in every model that applies writes (the run,
the issue-order reference, the window's and the replay's writers, the GPU runner's staging)."""
import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import run_reference, run_schedule
from sim.memory import Memory
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.verdicts import analyse
from tests.helpers import profile

LAYERS, UNITS, UB = 5, 8, 64


def _buffers():
    dev = {"kind": "paged", "layers": LAYERS, "pages": UNITS, "page_bytes": UB}
    return [
        {"name": "H", "location": "host", "kind": "kv",
         "layout": {"kind": "host", "layout": "page_first", "layers": LAYERS, "units": UNITS, "unit_bytes": UB}},
        {"name": "D", "location": "device", "kind": "kv", "layout": dev},
    ]


def _doc(ops):
    return {"kvrace_schedule": 2, "name": "t", "buffers": _buffers(), "streams": ["s0", "s1"],
            "events": ["e0"], "ops": ops}


def _split(ops):
    """Each multi-layer write as one write per layer, in its order, on its stream."""
    out = []
    for op in ops:
        if op["op"] == "write" and "layers" in op:
            for layer in op["layers"]:
                w = {k: v for k, v in op.items() if k not in ("layers", "id")}
                w.update(layer=layer, id=f"{op['id']}.L{layer}")
                out.append(w)
        else:
            out.append(op)
    return out


def _err(ops) -> str:
    with pytest.raises(InputError) as e:
        validate(_doc(ops))
    return str(e.value)


def test_layers_validation_names_the_field():
    w = {"op": "write", "stream": "s0", "buffer": "D", "units": [1], "id": "w"}
    assert "ops[0] (w).layers: expected exactly one of 'layer' or 'layers'" in _err([{**w, "layer": 0, "layers": [1]}])
    assert "ops[0] (w).layers: expected at least one layer" in _err([{**w, "layers": []}])
    assert f"ops[0] (w).layers[1]: expected an index in 0..{LAYERS - 1}, got 9" in _err([{**w, "layers": [0, 9]}])
    assert "ops[0] (w).layers: expected distinct layers, got [2, 2]" in _err([{**w, "layers": [2, 2]}])
    assert "ops[0] (w).layers: expected a list" in _err([{**w, "layers": 3}])
    rd = {"op": "read", "stream": "s0", "buffer": "D", "units": [1], "layers": [0, 1], "id": "r"}
    assert "ops[0] (r)" in _err([rd]) and "layers" in _err([rd])
    tok = {"op": "write", "stream": "s0", "buffer": "D", "tokens": [1], "layers": [0, 1], "id": "w"}
    assert "ops[0] (w).units" in _err([tok])


def test_layers_extents_are_each_layers_units_in_order():
    s = validate(_doc([{"op": "write", "stream": "s0", "buffer": "H", "units": [3, 1], "layers": [4, 0, 2],
                        "id": "w", "owner": 5}]))
    op = s.op("w")
    lay = s.buffers["H"].layout
    want = np.concatenate([lay.unit_offsets(x, np.array([3, 1])) for x in (4, 0, 2)])
    assert op.extents[0].tolist() == want.tolist() and op.extents[1].tolist() == [UB] * 6
    assert op.layers == (4, 0, 2) and op.layer is None
    one = validate(_doc([{"op": "write", "stream": "s0", "buffer": "D", "units": [3], "layers": [2], "id": "w"}]))
    assert one.op("w").layer == 2 and one.op("w").layers == (2,)
    assert validate(_doc([{"op": "write", "stream": "s0", "buffer": "D", "units": [3], "layer": 2,
                           "id": "w"}])).op("w").layers == (2,)


def _ops(draw):
    """Random ops on D and H: writes of one or several layers, copies, reads, syncs."""
    ops = []
    for k in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["wl", "wl", "w1", "copy", "read"]))
        stream = draw(st.sampled_from(["s0", "s1"]))
        units = draw(st.lists(st.integers(0, UNITS - 1), min_size=1, max_size=UNITS))
        buf = draw(st.sampled_from(["D", "H"]))
        if kind == "wl":
            layers = draw(st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True))
            ops.append({"op": "write", "stream": stream, "buffer": buf, "units": units, "layers": layers,
                        "owner": k, "version": 1 + k % 3, "id": f"w{k}"})
        elif kind == "w1":
            ops.append({"op": "write", "stream": stream, "buffer": buf, "units": units,
                        "layer": draw(st.integers(0, LAYERS - 1)), "owner": k, "id": f"w{k}"})
        elif kind == "copy":
            src, dst = draw(st.sampled_from([("H", "D"), ("D", "H")]))
            ops.append({"op": "copy", "stream": stream, "routine": "kernel_all_layer", "src": src, "dst": dst,
                        "id": f"c{k}", "args": {"src_indices": units, "dst_indices": units[::-1]}})
        else:
            ops.append({"op": "read", "stream": stream, "buffer": buf, "units": units,
                        "layer": draw(st.integers(0, LAYERS - 1)), "id": f"r{k}"})
    return ops


def _prov(reads):
    return [(r.op_id, [(v.offset, v.compact.provenance_digest()) for v in r.views]) for r in reads]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_multi_layer_write_is_its_per_layer_writes_in_issue_order(data):
    ops = _ops(data.draw)
    merged, split = validate(_doc(ops)), validate(_doc(_split(ops)))
    a, b = run_reference(merged), run_reference(split)
    for name in ("D", "H"):
        assert np.array_equal(a.memory.final_bytes(name), b.memory.final_bytes(name))
        assert a.memory.compact[name].equals(b.memory.compact[name])
    assert _prov(a.reads) == _prov(b.reads)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_one_stream_runs_give_the_per_layer_bytes_and_verdicts(data):
    """On one stream nothing interleaves: the run's final bytes and every read's bytes and
    verdict are those of the per-layer writes (the schedules differ in op count only)."""
    ops = [dict(o, stream="s0") for o in _ops(data.draw)]
    merged, split = validate(_doc(ops)), validate(_doc(_split(ops)))
    p = profile()
    ra, rb = run_schedule(merged, p), run_schedule(split, p)
    assert snapshot_of(ra).buffers == snapshot_of(rb).buffers
    assert _prov(ra.reads) == _prov(rb.reads)
    va = {e["op"]: e["status"] for e in analyse(ra)["reads"]}
    vb = {e["op"]: e["status"] for e in analyse(rb)["reads"]}
    assert va == vb and set(va.values()) <= {"ok", "indeterminate"}   # a copy naming a unit twice
    online = run_schedule(merged, p, keep="report")
    assert {e["op"]: e["status"] for e in online.online.report(online)["reads"]} == va


def test_a_copy_racing_one_layer_of_a_multi_layer_write_is_one_race():
    ops = [{"op": "write", "stream": "s0", "buffer": "D", "units": [0, 1], "layers": [0, 1, 2, 3, 4],
            "owner": 3, "id": "w"},
           {"op": "copy", "stream": "s1", "routine": "kernel_per_layer", "src": "H", "dst": "D", "id": "c",
            "args": {"layer": 3, "src_indices": [1], "dst_indices": [1]}}]
    rep = analyse(run_schedule(validate(_doc(ops)), profile()))
    races = rep["latent_races"]
    assert len(races) == 1 and sorted(races[0]["ops"]) == ["c", "w"]
    assert races[0]["bytes"] == UB


def test_json_roundtrip_keeps_layers_and_the_digest():
    doc = _doc([{"op": "write", "stream": "s0", "buffer": "D", "units": [1, 2], "layers": [3, 1], "id": "w"}])
    s = validate(doc)
    again = validate(copy.deepcopy(s.to_json()))
    assert again.op("w").layers == (3, 1) and again.digest() == s.digest()


def test_fill_groups_equals_one_fill_per_group():
    s = validate(_doc([]))
    one, many = Memory(s.buffers), Memory(s.buffers)
    units = np.array([5, 2, 5])
    lay = s.buffers["D"].layout
    offs = np.concatenate([lay.unit_offsets(x, units) for x in (1, 4)])
    lens = np.full(offs.size, UB)
    many.write_units("D", (1, 4), units, offs, lens, 9, 2)
    for g, x in enumerate((1, 4)):
        one.write_units("D", x, units, offs[g * 3:(g + 1) * 3], lens[g * 3:(g + 1) * 3], 9, 2)
    assert one.compact["D"].equals(many.compact["D"])
    assert np.array_equal(one.final_bytes("D"), many.final_bytes("D"))
    with pytest.raises(InputError, match="equal groups"):
        many.compact["D"].fill_groups(offs[:5], lens[:5], ["a", "b"], offs[:5])
