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


def test_wait_or_sync_on_a_never_recorded_event_is_a_cuda_noop_and_a_finding():
    """CUDA: cudaStreamWaitEvent / cudaEventSynchronize on an event with no record
    issued yet return at once (they order nothing); kvrace accepts the schedule and
    lists the ops, since a consumer's wait issued before the producer's record is a bug."""
    s = sched_mod.validate(schedule_doc([{"id": "w", "op": "wait", "stream": "s0", "event": "e0"},
                                         {"id": "r", "op": "record", "stream": "s0", "event": "e0"},
                                         {"id": "hs", "op": "host_sync", "event": "e1"},
                                         {"id": "w2", "op": "wait", "stream": "s1", "event": "e0"}]))
    assert [(u["op"], u["kind"], u["event"]) for u in s.unbound] == [("w", "wait", "e0"), ("hs", "host_sync", "e1")]
    assert s.op("w").bound_record is None and s.op("hs").sync_targets == ()
    assert s.op("w2").bound_record == s.op("r").index      # bound: not a finding


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
    assert "ops[0] (op0).units[0]: expected an index in 0..7, got 9" in err(schedule_doc([rd]))
    rd = {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": [1], "ranges": [[0, 4]]}
    assert "exactly one of" in err(schedule_doc([rd]))
    rd = {"op": "read", "stream": "s0", "buffer": "D", "ranges": [[1000, 100]]}
    assert "ops[0] (op0).ranges" in err(schedule_doc([rd]))


def test_version_and_duplicates():
    doc = schedule_doc([])
    doc["kvrace_schedule"] = 3
    assert "kvrace_schedule: expected format version 1 or 2, got 3" in err(doc)
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
    from tests.helpers import example_files

    files = example_files()
    assert len(files) >= 3
    for f in files:
        s = load(f)
        assert s.digest() == validate(json.load(open(f))).digest()


# ---------------------------------------------------------------- hardening: bad input never crashes

import pickle  # noqa: E402
import time  # noqa: E402

import simpy  # noqa: E402

from sim import schedule as sched_mod  # noqa: E402
from sim.errors import show  # noqa: E402


def load_err(tmp_path, data: bytes) -> str:
    p = tmp_path / "s.json"
    p.write_bytes(data)
    with pytest.raises(InputError) as e:
        load(str(p))
    return str(e.value)


def test_input_error_survives_recreation_from_its_args():
    e = InputError("ops[1] (x).args", "bad")
    for again in (type(e)(*e.args), pickle.loads(pickle.dumps(e))):
        assert isinstance(again, InputError) and str(again) == str(e) == "ops[1] (x).args: bad"
        assert (again.where, again.message) == ("ops[1] (x).args", "bad")
    assert str(InputError("just a message")) == "just a message"

    def proc(env):       # SimPy re-raises a process's exception re-created from its args
        yield env.timeout(1)
        raise InputError("ops[0]", "refused")
    env = simpy.Environment()
    env.process(proc(env))
    with pytest.raises(InputError) as ex:
        env.run()
    assert str(ex.value) == "ops[0]: refused"


def test_show_truncates_echoed_values():
    assert show("abc") == "'abc'"
    out = show("x" * 5_000_000)
    assert len(out) < 120 and out.endswith("(5000002 chars)")
    doc = schedule_doc([{"op": "compute", "stream": "s0", "duration_us": "y" * 5_000_000}])
    assert len(err(doc)) < 300
    doc = schedule_doc([{"op": "compute", "stream": "z" * 5_000_000, "duration_us": 1}])
    assert len(err(doc)) < 400


def test_file_level_errors_are_input_errors(tmp_path):
    good = json.dumps(schedule_doc([])).encode()
    assert "not UTF-8" in load_err(tmp_path, good[:20] + b"\xff\xfe" + good[20:])
    assert "too deeply" in load_err(tmp_path, b"[" * 100_000 + b"]" * 100_000)
    assert "not valid JSON" in load_err(tmp_path, good[: len(good) // 2])
    assert "a number JSON cannot hold" in load_err(tmp_path, good.replace(b'"t"', b"1" + b"0" * 5000))
    for bad in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
        doc = schedule_doc([{"op": "compute", "stream": "s0", "duration_us": 0}])
        text = json.dumps(doc).encode().replace(b'"duration_us": 0', b'"duration_us": ' + bad)
        assert "finite" in load_err(tmp_path, text), bad


def test_durations_are_finite_and_bounded():
    for v in (float("inf"), float("nan"), 1e308, 2 ** 70, sched_mod.MAX_DURATION_US * 2):
        msg = err(schedule_doc([{"op": "compute", "stream": "s0", "duration_us": v}]))
        assert "ops[0] (op0).duration_us" in msg and "MAX_DURATION_US" in msg, v


def test_integers_beyond_int64_are_refused_by_name():
    big = 2 ** 70
    rd = {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": {"start": big, "count": 1}}
    assert "ops[0] (op0).units.start: expected an int64" in err(schedule_doc([rd]))
    rd["units"] = {"start": 0, "count": 3, "step": 2 ** 62}
    assert "ops[0] (op0).units: expected indices in 0..7" in err(schedule_doc([rd]))
    rd["units"] = [1, big]
    assert "ops[0] (op0).units[1]: expected an index in 0..7" in err(schedule_doc([rd]))
    rd = {"op": "read", "stream": "s0", "buffer": "D", "ranges": [[2 ** 63 - 1, 2 ** 63 - 1]]}
    assert "ops[0] (op0).ranges[0]: expected offset >= 0" in err(schedule_doc([rd]))
    rd = {"op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [0], "owner": big}
    assert "ops[0] (op0).owner: expected an int64" in err(schedule_doc([rd]))
    for key, msg in (("first_unit", "first_unit: expected 0.."), ("owner", "owner: expected an int64"),
                     ("version", "version: expected an int64")):
        doc = schedule_doc([])
        doc["buffers"][0]["init"][0][key] = 2 ** 63 - 1 if key == "first_unit" else big
        assert f"buffers[0].init[0].{msg}" in err(doc), key
    doc = schedule_doc([])
    doc["buffers"][1]["device"] = big
    assert "buffers[1].device" in err(doc)


def test_host_to_host_copy_is_refused_at_validation():
    bufs = schedule_doc([])["buffers"]
    bufs.append(dict(bufs[0], name="H2", init=[]))
    doc = schedule_doc([copy_op(dst="H2")], buffers=bufs)
    assert "ops[0] (op0): host-to-host copies are not modelled" in err(doc)


@pytest.mark.parametrize("mutate,limit", [
    (lambda d: d["ops"].append({"op": "read", "stream": "s0", "buffer": "D", "layer": 0,
                                "units": {"start": 0, "count": 16_777_216}}), "MAX_INDICES"),
    (lambda d: d.update(ops=[{"op": "record", "stream": "s0", "event": "e0"}] * (sched_mod.MAX_OPS + 1)),
     "MAX_OPS"),
    (lambda d: d.update(streams=[f"s{i}" for i in range(sched_mod.MAX_STREAMS + 1)]), "MAX_STREAMS"),
    (lambda d: d.update(events=[f"e{i}" for i in range(sched_mod.MAX_EVENTS + 1)]), "MAX_EVENTS"),
    (lambda d: d["buffers"][1]["layout"].update(layers=sched_mod.MAX_LAYERS + 1), "MAX_LAYERS"),
    (lambda d: d["buffers"][1]["layout"].update(pages=2 ** 50), "MAX_BUFFER_BYTES"),
])
def test_limits_are_named_and_checked_before_expansion(mutate, limit):
    doc = schedule_doc([])
    mutate(doc)
    # NOTE: CPU time of this process, not wall time: a loaded CI machine must not fail it, and
    # expanding the limit's input first would cost far more than 2 CPU s
    t0 = time.process_time()
    assert limit in err(doc)
    assert time.process_time() - t0 < 2.0


def test_total_indices_and_read_limits():
    big = {"kind": "paged", "layers": 64, "pages": 1 << 20, "page_bytes": 8}
    bufs = [{"name": "D", "location": "device", "layout": big},
            {"name": "E", "location": "device", "layout": big}]
    cp = {"op": "copy", "stream": "s0", "routine": "kernel_all_layer", "src": "D", "dst": "E",
          "args": {"src_indices": {"start": 0, "count": 1 << 20}, "dst_indices": {"start": 0, "count": 1 << 20}}}
    t0 = time.process_time()
    assert "MAX_TOTAL_INDICES" in err(schedule_doc([cp], buffers=bufs))
    assert time.process_time() - t0 < 2.0
    rd = {"op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": {"start": 0, "count": 1 << 17}}
    assert "MAX_READ_EXTENTS" in err(schedule_doc([rd], buffers=bufs))
    rd = {"op": "read", "stream": "s0", "buffer": "D", "ranges": [[0, 1 << 28]]}
    assert "MAX_READ_BYTES" in err(schedule_doc([rd], buffers=bufs))


def test_memory_digest_equals_sha256_of_bytes_and_materialise_fits_the_limit(monkeypatch):
    import hashlib

    from sim import memory as memory_mod
    from sim.memory import Memory

    s = validate(schedule_doc([]))
    full = Memory(s.buffers, materialise=True)
    compact = Memory(s.buffers, materialise=False)
    assert full.material is not None and compact.material is None
    monkeypatch.setattr(memory_mod, "DIGEST_CHUNK_BYTES", 100)      # several chunks, one partial
    for name in s.buffers:
        want = hashlib.sha256(full.final_bytes(name).tobytes()).hexdigest()
        assert full.digest(name) == compact.digest(name) == want
    # real bytes only when every copy a run holds (run + reference) fits the limit
    total = sum(b.nbytes for b in s.buffers.values())
    monkeypatch.setattr(memory_mod, "MATERIALISE_LIMIT_BYTES", memory_mod.MATERIALISED_COPIES * total - 1)
    assert Memory(s.buffers, materialise=True).material is None


def test_a_pool_of_tens_of_gigabytes_is_accepted_and_digested_by_provenance():
    """A buffer costs its segments, not its bytes: a 61-layer, 1M-token index-K pool
    (about 8 GB) validates and runs; its digest is a provenance digest, while a
    small buffer's is the sha256 of its bytes (what a GPU run computes)."""
    import hashlib

    from sim.executor import run_schedule
    from sim.memory import BYTE_DIGEST_LIMIT
    from tests.helpers import profile

    pages = (1 << 20) // 64
    doc = {"kvrace_schedule": 1, "name": "big", "streams": ["s0"], "ops": [],
           "buffers": [{"name": "idx", "location": "device", "kind": "index_k",
                        "layout": {"preset": "dsa_index_k", "layers": 61, "pages": pages}},
                       {"name": "small", "location": "device", "kind": "kv",
                        "layout": {"kind": "paged", "layers": 1, "pages": 4, "page_bytes": 64}}]}
    s = sched_mod.validate(doc)
    assert s.buffers["idx"].nbytes == 61 * pages * 8448 > BYTE_DIGEST_LIMIT
    run = run_schedule(s, profile(), materialise=False)
    big = run.memory.digest("idx")
    assert big.startswith("provenance:")
    assert run.memory.digest("small") == hashlib.sha256(run.memory.final_bytes("small").tobytes()).hexdigest()
    # the same contents reached another way (a fresh Memory, its own origin table) digest the same
    again = run_schedule(sched_mod.validate(doc), profile(), materialise=False)
    assert again.memory.digest("idx") == big
    doc["ops"] = [{"op": "write", "stream": "s0", "buffer": "idx", "layer": 60, "units": [pages - 1], "owner": 3}]
    written = run_schedule(sched_mod.validate(doc), profile(), materialise=False)
    assert written.memory.digest("idx") not in (big, None)


def test_a_routine_whose_addresses_wrap_below_zero_is_refused_at_validation():
    """dsv4_token with an index >= 2**31: the kernel's 32-bit index arithmetic gives
    negative offsets; validate refuses it (naming the argument) instead of run failing."""
    import json

    with open("examples/c4_routine_on_bf16_index_k.json") as f:
        doc = json.load(f)
    copy = next(o for o in doc["ops"] if o["op"] == "copy")
    copy["args"]["dst_indices"] = [2 ** 31]
    copy["args"]["src_indices"] = [0]
    msg = err(doc)
    assert ".args.dst_indices" in msg and "before its start" in msg
