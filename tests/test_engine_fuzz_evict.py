"""`benchmarks/fuzz_engine.py --evict`: the generator of valid cases under heavy eviction
(issue 9 robustness).  Its cases must be valid, reach load-backs in most runs, and the runs of
SGLang 0.5.11+ as shipped (dsa-v3.2, the upstream-0.5.11 gate map, no hypothesis, the load
fence on) must show no corrupted request, stale or torn read, or latent race."""
from __future__ import annotations

import os
import random
import sys

import pytest

from sim.profile import load_profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import fuzz_engine  # noqa: E402


def test_evict_cases_are_valid_and_seeded():
    a = [fuzz_engine.draw_evict_case(random.Random(5), i) for i in range(1)]
    rng1, rng2 = random.Random(7), random.Random(7)
    for i in range(200):
        c1, c2 = fuzz_engine.draw_evict_case(rng1, i), fuzz_engine.draw_evict_case(rng2, i)
        assert c1 == c2
        assert c1.evict and not c1.invalid and fuzz_engine.must_refuse(c1) == []
        o = dict(item.split("=", 1) for item in c1.overrides)
        ps = fuzz_engine.PAGE["dsa-v3.2" if c1.preset == "glm5-22811-small" else "deepseek-v4-flash"]
        pool = int(o["scheduler.max_total_tokens"])
        # a device pool of a few contexts, a host pool larger than it, contexts that fit the pool
        assert pool % ps == 0 and pool <= 32 * ps and float(o["hicache.ratio"]) >= 2
        assert int(o["workload.max_context_tokens"]) < pool
        assert int(o["workload.concurrency"]) * int(o["workload.max_context_tokens"]) > pool
        assert int(o["deployment.simulated_ranks"]) <= min(int(o["deployment.prefill_tp"]), 3)
        if o.get("hicache.decode") == "true" and o["deployment.mode"] == "pd":
            assert c1.preset == "glm5-22811-small"
    assert a[0].overrides


def test_the_jitter_profile_loads_with_its_launch_jitter(tmp_path):
    p = tmp_path / "j.toml"
    p.write_text(fuzz_engine._jitter_profile("h200", 15.0))
    assert load_profile(str(p)).launch_jitter_us == 15.0
    assert load_profile(str(p)).h2d_gbps == load_profile("h200").h2d_gbps


def test_expected_clean_is_0511_none_with_the_fence():
    base = ["variant.gate_map=upstream-0.5.11", "variant.hypotheses=none", "hicache.load_fence=true"]
    mk = lambda over, preset="glm5-22811-small": fuzz_engine.Case(0, preset, over, evict=True)  # noqa: E731
    assert fuzz_engine.expected_clean(mk(base))
    assert not fuzz_engine.expected_clean(mk(base, "incident-repro"))
    assert not fuzz_engine.expected_clean(mk(base[:2] + ["hicache.load_fence=false"]))
    assert not fuzz_engine.expected_clean(mk(["variant.gate_map=upstream-0.5.10"] + base[1:]))
    assert not fuzz_engine.expected_clean(mk([base[0], "variant.hypotheses=load-unfenced", base[2]]))
    assert fuzz_engine.clean_violations({"requests_corrupted": 0, "stale_reads": 0, "latent_races": 0}) == []
    assert fuzz_engine.clean_violations({"latent_races": 2, "decode": {"torn_reads": 1}}) == \
        ["latent_races 2", "decode.torn_reads 1"]


def test_with_ranks_changes_only_the_ranks():
    c = fuzz_engine.draw_evict_case(random.Random(3), 0)
    two = fuzz_engine.with_ranks(c, 2)
    assert two.overrides[-1] == "deployment.simulated_ranks=2"
    assert [o for o in two.overrides if "simulated_ranks" not in o] == \
        [o for o in c.overrides if "simulated_ranks" not in o]
    assert two.profile_text == c.profile_text and two.evict


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_evict_sweep_loads_back_and_finds_no_bug(seed, tmp_path):
    rng = random.Random(seed)
    outs = [fuzz_engine.run_case(fuzz_engine.draw_evict_case(rng, i), 120, str(tmp_path)) for i in range(10)]
    assert [(o.case.overrides, o.symptom) for o in outs if o.klass != "OK"] == []
    assert sum(o.result["load_backs"] > 0 for o in outs) >= 7


@pytest.mark.slow
def test_one_and_two_ranks_agree_without_launch_jitter_only(tmp_path):
    """Seed 11's case 28 of the --evict sweep (dsa-v3.2, PD, prefill TP 2, the upstream-0.5.10
    gate map whose index-K read races): on 1 and 2 simulated ranks the KV oracle flags the same
    requests without launch jitter; with the case's launch jitter (a draw per rank from one
    sequential generator) the raced reads, and so the wrong-KV requests, differ."""
    rng = random.Random(11)
    case = [fuzz_engine.draw_evict_case(rng, i) for i in range(29)][28]
    assert case.profile_text is not None and "variant.gate_map=upstream-0.5.10" in case.overrides
    plain = fuzz_engine.Case(case.index, case.preset, case.overrides, evict=True)
    runs = {name: [fuzz_engine.run_case(fuzz_engine.with_ranks(c, n), 180, str(tmp_path)) for n in (1, 2)]
            for name, c in (("plain", plain), ("jitter", case))}
    assert fuzz_engine.rank_agreement(*runs["plain"]) == []
    assert runs["plain"][0].result["wrong_kv_rids"]
    assert any("wrong-kv" in b for b in fuzz_engine.rank_agreement(*runs["jitter"]))


def test_a_rank_disagreement_is_a_bug_only_without_jitter_and_raced_reads():
    """Seed 7001's case 12: without launch jitter, 2 ranks flag one request more because rank 1's
    own torn read (its keyed compute jitter is its own) corrupted it: reported, not a bug."""
    case = fuzz_engine.draw_evict_case(random.Random(3), 0)
    plain = fuzz_engine.Case(case.index, case.preset, case.overrides, evict=True)
    jittery = fuzz_engine.Case(case.index, case.preset, case.overrides, profile_text="[device]\n", evict=True)

    def out(c, **res):
        return fuzz_engine.Outcome(c, "OK", "", 0, 0.0, result={"stale_reads": 0, "torn_reads": 0, **res})
    broken = ["wrong-kv requests [8] (1 rank) != [8, 10] (2 ranks)"]
    assert fuzz_engine.counts_as_bug(out(plain), out(plain), broken)
    assert not fuzz_engine.counts_as_bug(out(plain), out(plain, torn_reads=23), broken)
    assert not fuzz_engine.counts_as_bug(out(plain, stale_reads=1), out(plain), broken)
    assert not fuzz_engine.counts_as_bug(out(jittery), out(jittery), broken)
    assert not fuzz_engine.counts_as_bug(out(plain), out(plain), [])
