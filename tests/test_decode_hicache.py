"""The PD decode engine at byte level (sim/engine/decode_hicache.py): SGLang 0.5.14's decode side
with HiCache (docs/engine.md, "Decode-side HiCache in SGLang 0.5.14")."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.engine.decode_hicache import DecodeCacheEngine, format_decode_side
from sim.engine.engine import PrefillEngine
from sim.engine.scenario import Scenario, load_scenario

#: PD glm5 (dsa-v3.2), 2 layers, short outputs: a few dozen decode steps
PD = ["run.layers=2", "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
      "workload.output_tokens_min=4", "workload.output_tokens_max=8", "workload.sessions=4",
      "variant.gate_map=upstream-0.5.11"]


def pd_scenario(*extra: str) -> Scenario:
    return load_scenario("glm5-22811-small", [*PD, "hicache.decode=true", *extra])


def run(sc: Scenario, seed: int = 0, *, hicache: bool = True):
    e = PrefillEngine(sc, seed)
    assert isinstance(e.decode, DecodeCacheEngine)
    e.decode.hicache = hicache
    return e, e.run()


@pytest.fixture(scope="module")
def on():
    return run(pd_scenario())


def test_decode_side_hicache_matches_restores_backs_up_and_reads_no_race(on):
    e, r = on
    d = r.decode
    assert r.requests_completed == r.requests_total == d["requests"] > 0
    # multi-turn: the decode tree holds earlier turns' KV, so the transfer moves only the rest
    assert d["device_hit_tokens"] > 0
    assert d["device_hit_tokens"] + d["host_hit_tokens"] + d["transfer_tokens"] == d["input_tokens"]
    # the 3k-token decode pool evicts to host: prefixes come back by load-back
    assert d["host_hit_tokens"] > 0 and d["load_backs"] > 0 and d["load_back_tokens"] > 0
    assert d["backups"] > 0 and d["restores_failed"] == 0
    # every step reads every pool role once for the running batch
    assert d["reads_total"] == d["steps"] * 2 and d["ownership_checks"] > 0
    # SGLang admits a request only after its load's finish event: no decode read races it
    assert d["stale_reads"] == d["torn_reads"] == d["wrong_kv_reads"] == d["requests_corrupted"] == 0
    assert d["latent_races"] == d["oob_writes"] == 0
    # upstream 0.5.11 on prefill too: nothing corrupted anywhere
    assert r.requests_corrupted == 0
    assert e.decode.idle
    lines = format_decode_side(d)
    assert lines[0].startswith("decode side") and "HiCache on" in lines[0]
    assert f"{d['load_backs']} ({d['load_back_tokens']} tokens)" in "\n".join(lines)
    assert format_decode_side(None) == []


def test_a_first_step_that_does_not_wait_for_the_restore_races_it(monkeypatch):
    """The wait is what keeps the decode reads clean: a restore marked READY as soon as its
    copy is queued lets the request's first step read slots the H2D is still writing (8
    sessions: with 4 the decode side's load-backs all finish before the first step that reads
    them, since the prefill admission breaks at the first request it cannot add)."""
    orig = DecodeCacheEngine._queue_load_back

    def no_wait(self, d):
        queued = orig(self, d)
        if queued:
            d.restore = "ready"
        return queued

    monkeypatch.setattr(DecodeCacheEngine, "_queue_load_back", no_wait)
    _, r = run(pd_scenario("workload.sessions=8"))
    d = r.decode
    assert d["stale_reads"] + d["torn_reads"] > 0 and d["requests_corrupted"] > 0
    assert all(c["consumer_index"] == -1 and not c["waited"] for c in d["corrupted_reads"])
    # a request corrupted on the decode side counts as corrupted in the run
    assert set(d["corrupted_rids"]) <= set(range(r.requests_total)) and r.requests_corrupted >= d["requests_corrupted"]


def test_without_decode_hicache_the_byte_level_pool_is_clean_and_empties():
    e, r = run(pd_scenario("workload.sessions=2"), hicache=False)
    d = r.decode
    assert d["device_hit_tokens"] == d["host_hit_tokens"] == d["load_backs"] == d["backups"] == 0
    assert d["reads_total"] > 0 and d["requests_corrupted"] == 0 and d["stale_reads"] == 0
    # every slot of every request freed at its end
    s = e.decode.session
    assert s.allocator.available_size() == s.allocator.size_full


def test_decode_off_keeps_the_result_keys():
    sc = load_scenario("glm5-22811-small", [*PD, "hicache.decode=false"])
    e = PrefillEngine(sc, 0)
    assert not isinstance(e.decode, DecodeCacheEngine)
    r = e.run()
    assert r.decode is None and "decode" not in r.to_dict()


@pytest.mark.slow
def test_same_seed_same_decode_side():
    a, b = run(pd_scenario())[1], run(pd_scenario())[1]
    assert a.signature() == b.signature()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_decode_side_hicache_never_races_across_seeds_and_pool_sizes(seed):
    for tokens in ("2048", "3072"):
        _, r = run(pd_scenario(f"scheduler.max_total_tokens={tokens}", "workload.sessions=6"), seed)
        d = r.decode
        assert r.requests_completed == r.requests_total
        assert d["stale_reads"] == d["torn_reads"] == d["requests_corrupted"] == d["latent_races"] == 0
        assert np.isfinite(r.sim_time_s)


@pytest.mark.slow
def test_index_k_never_backed_up_is_wrong_kv_on_the_decode_side():
    """SGLang #17085's hypothesis reaches the decode side's controller too: a restored prefix's
    index-K was never backed up, so the decode reads see KV that is not the request's (the KV
    oracle), in every order (no race)."""
    _, r = run(pd_scenario("variant.hypotheses=index-k-not-backed-up"))
    d = r.decode
    assert d["load_backs"] > 0 and d["wrong_kv_reads"] > 0 and d["requests_wrong_kv"] > 0
    assert d["stale_reads"] == d["torn_reads"] == d["latent_races"] == 0
    assert {c["role"] for c in d["corrupted_reads"]} == {"index_k"}
    assert set(d["corrupted_rids"]) <= set(range(r.requests_total))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 1000), tokens=st.sampled_from([2048, 2560, 3072]), sessions=st.integers(2, 5),
       concurrency=st.integers(1, 4), ratio=st.sampled_from([1.0, 2.0]))
def test_decode_side_properties(seed, tokens, sessions, concurrency, ratio):
    """Every request ends (completed, or aborted by a failed restore), no decode step uses a slot
    it does not own (the engine's ownership check raises), no decode read races, and at the end
    every decode device slot is free or held, unlocked, by the decode tree."""
    e, r = run(pd_scenario(f"scheduler.max_total_tokens={tokens}", f"workload.sessions={sessions}",
                           f"workload.concurrency={concurrency}", f"hicache.ratio={ratio}"), seed)
    d = r.decode
    assert r.requests_completed + r.requests_aborted == r.requests_total == d["requests"]
    assert r.requests_aborted == d["restores_failed"] == len(r.aborted_requests)
    assert d["ownership_checks"] >= d["steps"] > 0
    assert d["stale_reads"] == d["torn_reads"] == d["latent_races"] == d["requests_corrupted"] == 0
    a, tree = e.decode.session.allocator, e.decode.cache._target
    assert tree.protected_size() == 0
    assert a.available_size() + tree.evictable_size() == a.size_full
