"""The prefill engine with TP ranks in lockstep (``deployment.simulated_ranks``; docs/engine.md,
"TP ranks in lockstep").

SGLang 0.5.14: every TP rank runs the same scheduler decisions (one tree, one allocator state,
so the same slot indices), each on its own GPU with its own pools, streams and link; an ack is
processed only when every rank finished it (``writing_check`` / ``loading_check``: MIN over
the group; tests/test_engine_tp_session.py).  A request is corrupted when a read made for it
on ANY rank is."""
from __future__ import annotations

import json

import pytest

from kvrace.cli import main
from sim.engine import PrefillEngine
from sim.engine.engine import run_prefill_engine
from sim.engine.scenario import load_scenario
from sim.errors import InputError
from sim.executor import run_schedule
from sim.profile import load_profile
from sim.schedule import validate
from tests.test_engine_overlap import FENCE, FENCE_SEED
from tests.test_engine_tp_session import h200_variant
from sim.snapshot import snapshot_of
from tests.test_cache_session import same_snapshot

#: glm5-22811-small cut to 2 layers and 4 sessions of 3 turns (about a second a run of two ranks;
#: upstream 0.5.10's ungated index-K reads race load-backs on both ranks)
BASE = ["run.layers=2", "workload.sessions=4", "workload.max_turns=3"]
TWO = [*BASE, "deployment.simulated_ranks=2"]


@pytest.fixture(scope="module")
def jitter_profile(tmp_path_factory):
    """h200 with a 30 us mean launch skew per kernel (``device.launch_jitter_us``): the ranks'
    kernels start at different, independently drawn times, so a race can show on one rank only."""
    return h200_variant(tmp_path_factory, r"(?m)^kernel_launch_us = ", "launch_jitter_us = 30.0\nkernel_launch_us = ",
                        "h200-jitter")


def _requests_by_rank(result) -> dict[int, set]:
    out: dict[int, set] = {}
    for c in result.corrupted_reads:
        out.setdefault(c["rank"], set()).update(c["requests"])
    return out


# ---------------------------------------------------------------- the key

@pytest.mark.parametrize("value, message", [("0", "1..4"), ("5", "1..4"), ("-1", "1..4"), ("x", "an integer"),
                                            ("true", "an integer")])
def test_bad_simulated_ranks_names_the_key_and_the_range(value, message):
    with pytest.raises(InputError) as e:
        load_scenario("incident", [f"deployment.simulated_ranks={value}"])
    assert e.value.where == "deployment.simulated_ranks" and message in e.value.message


def test_the_range_follows_prefill_tp():
    assert load_scenario("incident", ["deployment.simulated_ranks=4"]).deployment.simulated_ranks == 4
    with pytest.raises(InputError) as e:
        load_scenario("incident", ["deployment.prefill_tp=2", "deployment.decode_tp=2",
                                   "deployment.simulated_ranks=3"])
    assert e.value.where == "deployment.simulated_ranks" and "1..2" in e.value.message


def test_one_rank_is_the_default_and_its_result_has_no_rank_keys():
    a = run_prefill_engine("glm5-22811-small", 0, overrides=BASE)
    b = run_prefill_engine("glm5-22811-small", 0, overrides=[*BASE, "deployment.simulated_ranks=1"])
    assert a.signature() == b.signature()
    d = a.to_dict()
    assert "simulated_ranks" not in d and "corrupted_reads_by_rank" not in d
    assert all("rank" not in c for c in d["corrupted_reads"])


# ---------------------------------------------------------------- two ranks

@pytest.fixture(scope="module")
def two_all():
    e = PrefillEngine(load_scenario("glm5-22811-small", TWO), 0, keep="all")
    return e, e.run()


def test_every_rank_runs_the_same_batches_on_its_own_buffers_and_streams(two_all):
    e, r = two_all
    ops = e.session.record()["ops"]
    reads = [o for o in ops if o["op"] == "read"]
    r0 = [o for o in reads if "@" not in o["id"]]
    r1 = [o for o in reads if o["id"].split(".", 1)[0].endswith("@1")]
    assert r0 and len(r0) == len(r1) and len(r0) + len(r1) == len(reads)
    assert all(o["buffer"].endswith("@1") and o["stream"] == "forward@1" for o in r1)
    assert all(not o["buffer"].endswith("@1") and o["stream"] == "forward" for o in r0)
    # the same ranges (same slot indices: one allocator state) on both ranks
    by_id = {o["id"]: o for o in r1}
    for o in r0:
        twin = by_id[o["id"].replace(".", "@1.", 1)]
        assert twin["ranges"] == o["ranges"]
    writes = [o for o in ops if o["op"] == "write"]
    assert sum(o["stream"] == "forward@1" for o in writes) * 2 == len(writes)
    assert r.simulated_ranks == 2 and len(r.corrupted_reads_by_rank) == 2
    assert r.corrupted_reads_by_rank == [sum(c["rank"] == k for c in r.corrupted_reads) for k in (0, 1)]


def test_ranks_draw_different_compute_jitter(two_all):
    e, _ = two_all
    ops = {o["id"]: o for o in e.session.record()["ops"] if o["op"] == "compute"}
    pairs = [(o["duration_us"], ops[i.replace(".", "@1.", 1)]["duration_us"]) for i, o in ops.items()
             if i.startswith("fwd") and "@" not in i]
    assert pairs and sum(a != b for a, b in pairs) > len(pairs) // 2


def test_streaming_and_keep_all_give_the_same_result_on_two_ranks(two_all):
    _, r = two_all
    s = run_prefill_engine("glm5-22811-small", 0, overrides=TWO)
    assert s.signature() == r.signature()


def test_the_recorded_two_rank_engine_run_reruns_statically_to_the_same_snapshot(two_all):
    e, _ = two_all
    run = e.session.finish()
    doc = json.loads(json.dumps(e.session.record()))
    same_snapshot(snapshot_of(run), snapshot_of(run_schedule(validate(doc), load_profile(e.session.config.profile))))


def test_one_step_forwards_give_the_per_layer_results_per_rank():
    runs = {one: run_prefill_engine("glm5-22811-small", 0, overrides=[*TWO, f"run.one_step={one}"])
            for one in ("true", "false")}
    a, b = runs["true"], runs["false"]
    assert a.forwards_one_step > 0 and b.forwards_one_step == 0
    skip = ("reads_total", "sim_time_s", "forwards_one_step")
    assert {k: v for k, v in a.signature().items() if k not in skip} == \
        {k: v for k, v in b.signature().items() if k not in skip}


def test_a_race_on_rank_one_only_marks_the_request_corrupted(jitter_profile):
    """With launch skew the ranks' kernels start at different times, so a load-back can race an
    ungated read on one rank and not the other: such a request is corrupted (union over ranks)."""
    r = run_prefill_engine("glm5-22811-small", 0, overrides=["run.layers=2", "deployment.simulated_ranks=2",
                                                             f"deployment.profile={jitter_profile}"])
    by_rank = _requests_by_rank(r)
    only1 = by_rank.get(1, set()) - by_rank.get(0, set())
    assert only1, "no request raced on rank 1 only at this seed"
    union = by_rank.get(0, set()) | by_rank.get(1, set())
    assert r.requests_corrupted == len(union) and r.requests_raced == len(union)
    hits = [c for c in r.corrupted_reads if set(c["requests"]) & only1]
    assert hits and all(c["buffer"].endswith("@1") and c["status"] in ("stale", "torn") for c in hits)


def test_exported_races_of_either_rank_rerun_with_the_same_verdict(tmp_path):
    """``--export-races`` cuts a window around a corrupted read of any rank (rank 1's reads name
    rank 1's buffers and streams), and ``kvrace schedule run`` gives the read the same verdict.
    (A profile with launch skew draws new skews in the window's run, so the default profile.)"""
    sets = [x for k in TWO for x in ("--set", k)]
    rc = main(["run", "glm5-22811-small", "--progress", "never", *sets, "--json", str(tmp_path / "run.json"),
               "--export-races", str(tmp_path / "races"), "--export-limit", "2", "--fail-on", "none"])
    assert rc == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    raced = [c for c in doc["corrupted_reads"] if c["status"] in ("stale", "torn")]
    paths = doc["exported_races"]
    assert len(paths) == min(2, len(raced)) and any(c["rank"] == 1 for c in raced[:len(paths)])
    for p, c in zip(paths, raced):
        assert main(["schedule", "run", p, "--json", str(tmp_path / "rep.json"), "--fail-on", "none"]) == 0
        rep = json.loads((tmp_path / "rep.json").read_text())
        assert {x["op"]: x["status"] for x in rep["reads"]}[c["op"]] == c["status"]


@pytest.mark.slow
def test_overlap_loop_on_two_ranks_streams_the_same_result_as_keep_all():
    """The overlap loop (per-layer KV stores issued on each rank inside its own forward,
    ``copy_done`` recorded and waited for on every rank) under ``load-unfenced``."""
    # NOTE: test_engine_overlap.py's fence run: the freed page reaches a load-back in time
    sets = ["variant.gate_map=upstream-0.5.11", "scheduler.event_loop=overlap", *FENCE, "run.layers=4",
            "variant.hypotheses=load-unfenced", "deployment.simulated_ranks=2"]
    e = PrefillEngine(load_scenario("glm5-22811-small", sets), FENCE_SEED, keep="all")
    a = e.run()
    b = run_prefill_engine("glm5-22811-small", FENCE_SEED, overrides=sets)
    assert a.signature() == b.signature() and a.requests_corrupted > 0
    events = [o["event"] for o in e.session.record()["ops"] if o["op"] == "host_sync" and "event" in o]
    assert "copy_done.0" in events and "copy_done.0@1" in events
