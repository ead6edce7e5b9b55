"""The PD decode side in SGLang's overlap loop (``scheduler.decode_event_loop = "overlap"``,
``event_loop_overlap_disagg_decode``): step ``k`` is launched before step ``k - 1``'s result is
processed, so a request that step ``k - 1`` finished rides in step ``k`` (whose KV store writes one
slot past its output), and its pages are freed while that store may still be in flight: the PD
transfer of a newly pre-allocated request into a freed page is then unordered with it, and a
layer stored after the transfer landed leaves the new request reading the finished one's KV."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.engine.decode_hicache import DecodeCacheEngine, format_decode_side
from sim.engine.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.errors import InputError
from sim.profile import load_profile

#: glm5 (dsa-v3.2) in PD at byte level, 2 layers, short outputs, a decode pool small enough that
#: freed pages are reused at once
DSA = ["run.layers=2", "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
       "workload.output_tokens_min=4", "workload.output_tokens_max=8", "workload.sessions=6",
       "variant.gate_map=upstream-0.5.11", "deployment.decode_bytes=true", "run.duration_s=1.5"]


def run(*sets):
    e = PrefillEngine(load_scenario("glm5-22811-small", list(DSA) + list(sets)), 0)
    return e, e.run()


@pytest.fixture(scope="module")
def normal():
    return run()


@pytest.fixture(scope="module")
def overlapped():
    return run("scheduler.decode_event_loop=overlap")


def test_overlap_loop_runs_every_request_with_one_ride_along_step_per_finish(normal, overlapped):
    (e0, r0), (e1, r1) = normal, overlapped
    assert isinstance(e1.decode, DecodeCacheEngine) and e1.decode.overlap and not e0.decode.overlap
    d0, d1 = r0.decode, r1.decode
    assert r1.requests_completed == r1.requests_total == d1["requests"] == d0["requests"] > 0
    # a finished request rides in the next step: more steps, never more than one per request
    assert d0["steps"] < d1["steps"] <= d0["steps"] + d1["requests"]
    assert d1["event_loop"] == "overlap" and "event_loop" not in d0
    assert format_decode_side(d1)[0].endswith("steps (overlap loop)")
    # every request released: the pool holds what the normal loop's run leaves (the decode tree's pages)
    assert e1.decode.session.allocator.available_size() == e0.decode.session.allocator.available_size()


def test_pages_freed_under_a_ride_along_store_race_the_transfer_only_in_the_overlap_loop(normal, overlapped):
    """Without the overlap loop every step is waited for before its requests' pages are freed:
    nothing on the decode side races.  With it, the ride-along step's store into a page that the
    finished request's release freed is unordered with the PD transfer that lands into that page
    for the next request (the transfer stands for the RDMA engine: no stream orders it after the
    forward stream)."""
    assert normal[1].decode["latent_races"] == 0
    assert overlapped[1].decode["latent_races"] > 0
    races = overlapped[0].decode.latent_races()
    # the ride-along step's KV store (forward) against the PD transfer's (the schedule stream)
    assert any(tuple(r["streams"]) == ("forward", "schedule")
               and tuple(r["kinds"]) == ("write (write)", "write (write)") for r in races)


def test_decode_event_loop_is_checked():
    base = ["run.layers=2", "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
            "run.duration_s=0.1"]
    load_scenario("glm5-22811-small", base + ["scheduler.decode_event_loop=overlap"])     # decode-side HiCache
    with pytest.raises(InputError, match="scheduler.decode_event_loop") as e:
        load_scenario("glm5-22811-small", base + ["hicache.decode=false", "scheduler.decode_event_loop=overlap"])
    assert "byte level" in str(e.value) and "deployment.decode_bytes" in str(e.value)
    with pytest.raises(InputError, match="scheduler.decode_event_loop"):
        load_scenario("glm5-22811-small", ["deployment.mode=colocated", "deployment.decode_tp=8",
                                           "scheduler.decode_event_loop=overlap"])
    with pytest.raises(InputError, match="scheduler.decode_event_loop"):
        load_scenario("glm5-22811-small", base + ["deployment.decode_bytes=true", "scheduler.overlap=false",
                                                  "scheduler.decode_event_loop=overlap"])
    with pytest.raises(InputError, match="scheduler.decode_event_loop"):
        load_scenario("glm5-22811-small", base + ["scheduler.decode_event_loop=sometimes"])


#: one-token outputs (every request rides along once), one request running, a decode pool small
#: enough that the freed page goes to the next request, whose transfer is short (a decode-tree
#: hit leaves part of the input to send)
RIDE = ["workload.output_tokens_min=1", "workload.output_tokens_max=2", "hicache.decode=true",
        "scheduler.max_total_tokens=1536", "scheduler.max_running_requests=1", "run.duration_s=1.0"]


def test_a_late_layer_store_of_the_ride_along_overwrites_the_next_requests_transferred_kv():
    """The race at byte level: the overlap loop's step stores layer by layer, so the ride-along's
    layer-1 store can land after the next request's transfer into the freed page, and that
    request's layer-1 reads then see the finished request's KV (stale: a race; and not its own
    KV: the oracle).  The normal loop, on the same workload, corrupts nothing."""
    _, r0 = run(*RIDE)
    assert r0.decode["requests_corrupted"] == r0.decode["latent_races"] == 0
    _, r1 = run(*RIDE, "scheduler.decode_event_loop=overlap")
    d = r1.decode
    assert d["requests_corrupted"] > 0
    assert d["requests_raced"] == d["requests_wrong_kv"] == d["requests_corrupted"]
    assert all(".L1." in c["op"] and c["status"] == "stale" for c in d["corrupted_reads"])


def test_the_race_corrupts_only_while_the_transfer_lands_inside_the_ride_along_step(overlapped):
    """``deployment.pd_transfer_latency_us``: a transfer that takes longer than the ride-along
    step lands after its stores; the writes stay unordered (latent races) but none lands last
    over the transfer, so nothing is corrupted.  The default (-1) is the profile's memcpy latency,
    and ``pd_transfer_gbps = 0`` the profile's H2D rate: spelled out, the same run."""
    d = overlapped[1].decode
    assert d["requests_corrupted"] > 0
    prof = load_profile(overlapped[0].scenario.deployment.profile)
    _, same = run("scheduler.decode_event_loop=overlap", f"deployment.pd_transfer_latency_us={prof.memcpy_latency_us}",
                  f"deployment.pd_transfer_gbps={prof.h2d_gbps}")
    assert same.decode == d
    _, late = run("scheduler.decode_event_loop=overlap", "deployment.pd_transfer_latency_us=1000")
    assert late.decode["requests_corrupted"] == late.decode["stale_reads"] == 0
    assert late.decode["latent_races"] > 0


def test_pd_transfer_keys_are_checked():
    base = ["deployment.mode=pd"]
    for bad, key in (("deployment.pd_transfer_latency_us=-0.5", "pd_transfer_latency_us"),
                     ("deployment.pd_transfer_latency_us=-2", "pd_transfer_latency_us"),
                     ("deployment.pd_transfer_latency_us=1e15", "pd_transfer_latency_us"),
                     ("deployment.pd_transfer_gbps=-1", "pd_transfer_gbps"),
                     ("deployment.pd_transfer_gbps=1e-9", "pd_transfer_gbps")):
        with pytest.raises(InputError, match=f"deployment.{key}"):
            load_scenario("glm5-22811-small", base + [bad])
    with pytest.raises(InputError, match="deployment.pd_transfer_gbps") as e:
        load_scenario("glm5-22811-small", ["deployment.mode=colocated", "deployment.decode_tp=4",
                                           "deployment.pd_transfer_gbps=25"])
    assert "colocated" in str(e.value)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outs=st.sampled_from([(1, 2), (2, 6), (4, 8)]), pool=st.sampled_from([1536, 3072]),
       decode=st.sampled_from(["hicache.decode=true", "deployment.decode_bytes=true"]),
       running=st.sampled_from([1, 2, 128]))
def test_overlap_loop_ends_every_request_and_corrupts_only_by_the_race(outs, pool, decode, running):
    """Random short outputs (one-token outputs ride along at once), decode pools and batch caps:
    every request completes (but those the prefill server aborts before its prefill: an input
    that can never fit its pool), every step's ownership check passes (a slot of a running request
    that is free, or shared with another running request, raises ``DecodeSideError``), and every
    corrupted request raced: wrong KV only where a ride-along's store and a transfer raced, never
    from a slot handed out twice."""
    lo, hi = outs
    e, r = run(f"workload.output_tokens_min={lo}", f"workload.output_tokens_max={hi}", decode,
               f"scheduler.max_total_tokens={pool}", f"scheduler.max_running_requests={running}",
               "scheduler.decode_event_loop=overlap", "run.duration_s=1.0")
    d = r.decode
    assert r.requests_completed + r.requests_aborted == r.requests_total
    assert r.requests_completed == d["requests"] > 0 and d["restores_failed"] == 0
    assert d["ownership_checks"] > 0
    assert d["requests_corrupted"] == d["requests_raced"]
    assert not e.decode.running and e.decode.idle
