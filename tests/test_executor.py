"""CUDA stream/event semantics and copy timing of the SimPy executor.

Expected times are derived from CUDA's rules and the profile's numbers, not read
back from the executor.
"""
import numpy as np
import pytest

from sim.executor import TieBreak, run_schedule
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile, schedule_doc

P = profile()
UNIT = 64


def run(ops, **kw):
    s = validate(schedule_doc(ops, **{k: kw.pop(k) for k in ("buffers", "streams", "events") if k in kw}))
    return run_schedule(s, kw.pop("profile", P), **kw)


def test_stream_is_fifo():
    r = run([{"id": "a", "op": "compute", "stream": "s0", "duration_us": 5},
             {"id": "b", "op": "compute", "stream": "s0", "duration_us": 3},
             {"id": "c", "op": "compute", "stream": "s1", "duration_us": 2}])
    assert r.timings["a"] == (0, 5)
    assert r.timings["b"] == (5, 8)
    assert r.timings["c"] == (0, 2)          # other streams are not held


def test_wait_holds_until_record_position():
    r = run([{"op": "compute", "stream": "s0", "duration_us": 10},
             {"id": "rec", "op": "record", "stream": "s0", "event": "e0"},
             {"id": "w", "op": "wait", "stream": "s1", "event": "e0"},
             {"id": "after", "op": "compute", "stream": "s1", "duration_us": 1}])
    assert r.timings["rec"][1] == 10
    assert r.timings["after"] == (10, 11)


def test_wait_binds_to_latest_earlier_record():
    ops = [{"id": "r1", "op": "record", "stream": "s0", "event": "e0"},
           {"id": "w1", "op": "wait", "stream": "s1", "event": "e0"},
           {"id": "x", "op": "compute", "stream": "s1", "duration_us": 1},
           {"op": "compute", "stream": "s0", "duration_us": 10},
           {"id": "r2", "op": "record", "stream": "s0", "event": "e0"},
           {"id": "w2", "op": "wait", "stream": "s2", "event": "e0"},
           {"id": "y", "op": "compute", "stream": "s2", "duration_us": 1}]
    r = run(ops)
    assert r.timings["x"] == (0, 1)          # bound to r1, recorded at 0
    assert r.timings["y"] == (10, 11)        # bound to r2, after the 10 us compute


def test_host_sync_blocks_later_issue():
    r = run([{"op": "compute", "stream": "s0", "duration_us": 10},
             {"op": "host_sync", "stream": "s0"},
             {"id": "b", "op": "compute", "stream": "s1", "duration_us": 1}])
    assert r.timings["b"] == (10, 11)


def test_device_synchronize_and_host_delay():
    r = run([{"op": "compute", "stream": "s0", "duration_us": 4},
             {"op": "compute", "stream": "s1", "duration_us": 9},
             {"op": "host_sync"},
             {"op": "host_delay", "duration_us": 2},
             {"id": "c", "op": "compute", "stream": "s2", "duration_us": 1}])
    assert r.timings["c"] == (11, 12)


def test_copy_time_follows_launch_shape_and_link():
    # 100 items of 64 B, H2D: sgl-kernel launcher gives 2 blocks x 32 warps = 64 warps -> 2 rounds.
    n = 100
    buffers = schedule_doc([])["buffers"]
    buffers[0]["layout"]["units"] = 128
    buffers[1]["layout"]["pages"] = 128
    buffers[0]["init"] = []
    r = run([{"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
              "args": {"layer": 0, "src_indices": list(range(n)), "dst_indices": list(range(n))}}],
            buffers=buffers)
    expected = P.launch_us + 2 * P.item_overhead_us + n * UNIT / (P.h2d_gbps * 1e3)
    # by hand with the h200 link (launch 10 us, 0.5 us per round, 55 GB/s = 55,000 B/us):
    # 10 + 2 x 0.5 + 6,400 / 55,000 = 11.116364 us
    assert expected == pytest.approx(11.116364, abs=1e-6)
    assert r.timings["cp"][0] == 0
    assert r.timings["cp"][1] == pytest.approx(expected)


def test_copies_on_one_link_serialise_and_d2h_is_another_link():
    ops = [{"id": "a", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": [0], "dst_indices": [0]}},
           {"id": "b", "op": "copy", "stream": "s1", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 1, "src_indices": [0], "dst_indices": [0]}},
           {"id": "c", "op": "copy", "stream": "s2", "routine": "kernel_per_layer", "src": "D2", "dst": "H",
            "args": {"layer": 0, "src_indices": [1], "dst_indices": [1]}}]
    r = run(ops)
    one = P.launch_us + P.item_overhead_us + UNIT / (P.h2d_gbps * 1e3)
    assert one == pytest.approx(10 + 0.5 + 64 / 55_000, abs=1e-9)     # 10.501164 us
    assert r.timings["a"][1] == pytest.approx(one)
    assert r.timings["b"] == pytest.approx((one, 2 * one))
    assert r.timings["c"][0] == 0


def _race_ops(delay_us):
    return [{"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
             "args": {"layer": 0, "src_indices": [0, 1, 2, 3], "dst_indices": [0, 1, 2, 3]}},
            {"op": "compute", "stream": "s1", "duration_us": delay_us},
            {"id": "rd", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [0, 1, 2, 3]}]


def test_read_before_copy_lands_is_stale_after_is_ok():
    rep = analyse(run(_race_ops(0.0)))
    assert rep["reads"][0]["status"] == "stale"
    assert rep["reads"][0]["bytes_differing"] == 4 * UNIT
    assert "initial" in rep["reads"][0]["first_mismatch"]["observed"]
    assert "request 1" in rep["reads"][0]["first_mismatch"]["expected"]
    rep = analyse(run(_race_ops(50.0)))
    assert rep["reads"][0]["status"] == "ok"
    assert len(rep["latent_races"]) == 1      # the race is there either way


def test_read_mid_item_is_torn_in_chunks_unless_item_atomic():
    # one 8,448 B page item; read lands halfway through it
    buffers = schedule_doc([])["buffers"]
    for b in buffers:
        key = "unit_bytes" if b["location"] == "host" else "page_bytes"
        b["layout"][key] = 8448
    one_item_us = P.item_overhead_us + 8448 / (P.h2d_gbps * 1e3)
    t_read = P.launch_us + one_item_us / 2
    ops = [{"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": [0], "dst_indices": [0]}},
           {"op": "compute", "stream": "s1", "duration_us": t_read - P.kernel_launch_us},
           {"id": "rd", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [0]}]
    rep = analyse(run(ops, buffers=buffers))
    r = rep["reads"][0]
    assert r["status"] == "torn"
    done = int(0.5 * 8448 / 256) * 256        # whole 256 B chunks (32 lanes x 8 B)
    assert r["bytes_differing"] == 8448 - done
    assert r["copies_in_flight"][0]["items_in_flight"] == 1
    rep = analyse(run(ops, buffers=buffers, torn=False))
    assert rep["reads"][0]["status"] == "stale"
    assert rep["reads"][0]["bytes_differing"] == 8448


def test_same_instant_order_is_chosen_and_recorded():
    ops = [{"id": "w", "op": "write", "stream": "s0", "buffer": "D", "layer": 0, "units": [2], "owner": 7},
           {"id": "rd", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [2]}]
    fifo = analyse(run(ops))
    assert fifo["reads"][0]["status"] == "ok"            # write issued first goes first
    assert fifo["tie_orders"] == [[0.0, ["w", "rd"]]]
    flipped = analyse(run(ops, ties=TieBreak("explicit", first=("rd",))))
    assert flipped["reads"][0]["status"] == "stale"
    assert flipped["tie_orders"] == [[0.0, ["rd", "w"]]]
    seen = {analyse(run(ops, ties=TieBreak("seeded", seed=k)))["reads"][0]["status"] for k in range(12)}
    assert seen == {"ok", "stale"}
    a = analyse(run(ops, ties=TieBreak("seeded", seed=3)))
    b = analyse(run(ops, ties=TieBreak("seeded", seed=3)))
    assert a["tie_orders"] == b["tie_orders"] and a["reads"] == b["reads"]


def test_read_bytes_are_the_pattern_bytes_of_their_origin():
    from sim.bytes.pattern import Origin, pattern_bytes

    r = run(_race_ops(50.0))
    got = r.reads[0].bytes()
    want = np.concatenate([pattern_bytes(Origin("kv", 0, 1, 1, UNIT), u * UNIT, UNIT) for u in range(4)])
    assert np.array_equal(got, want)


def test_compact_only_gives_the_same_report():
    a = analyse(run(_race_ops(0.0)))
    b = analyse(run(_race_ops(0.0), materialise=False))
    assert a == b


def test_compute_jitter_false_takes_the_duration_as_given():
    """A compute op issued pre-jittered (``"jitter": false``) lasts exactly its duration and
    draws nothing from the executor's RNG (the jittered ops' draws do not depend on it)."""
    from sim.executor import run_schedule
    from sim.profile import load_profile
    from sim.schedule import validate

    def doc(first_jitter):
        return {"kvrace_schedule": 2, "name": "j", "buffers": [], "streams": ["s", "t"], "events": [],
                "ops": [{"op": "compute", "stream": "s", "duration_us": 100.0, "jitter": first_jitter, "id": "a"},
                        {"op": "compute", "stream": "t", "duration_us": 100.0, "id": "b"}]}
    p = load_profile("h200")
    assert p.jitter_frac > 0
    r = run_schedule(validate(doc(False)), p, seed=3)
    t0, t1 = r.timings["a"]
    assert t1 - t0 == 100.0
    r2 = run_schedule(validate(doc(True)), p, seed=3)
    assert r2.timings["a"][1] - r2.timings["a"][0] != 100.0
    # no draw: b's jitter is the one it gets in a run without op a at all
    alone = validate({**doc(False), "ops": doc(False)["ops"][1:]})
    assert run_schedule(alone, p, seed=3).timings["b"] == r.timings["b"] != (0.0, 100.0)
    with pytest.raises(Exception, match="jitter"):
        validate({**doc(False), "ops": [{"op": "compute", "stream": "s", "duration_us": 1, "jitter": 1}]})


def _two_stream_copies():
    # s0: a burst of two H2D copies; s1: one H2D copy issued after the burst
    def cp(i, stream, unit):
        return {"id": i, "op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": "H", "dst": "D",
                "args": {"layer": 0, "src_indices": [unit], "dst_indices": [unit]}}
    return validate(schedule_doc([cp("a0", "s0", 0), cp("a1", "s0", 1), cp("b", "s1", 2)]))


def test_a_submission_link_serves_the_copy_issued_first():
    """``link.sharing = "submission"``: when a0 ends, a1 (ready at that instant) goes before b,
    which has waited since the start but was issued later; first come, first served lets b in
    between. One stream alone gives the same times either way."""
    s = _two_stream_copies()
    ends = {}
    for sharing in ("fifo", "submission"):
        run = run_schedule(s, profile(sharing=sharing))
        ends[sharing] = {k: run.timings[k][1] for k in ("a0", "a1", "b")}
    assert ends["fifo"]["b"] < ends["fifo"]["a1"]
    assert ends["submission"]["a0"] < ends["submission"]["a1"] < ends["submission"]["b"]
    one = validate(schedule_doc([op for op in _two_stream_copies().raw["ops"] if op["stream"] == "s0"]))
    assert run_schedule(one, profile(sharing="fifo")).timings == run_schedule(one, profile(sharing="submission")).timings
