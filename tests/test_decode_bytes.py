"""The PD decode engine at byte level without decode-side HiCache (``deployment.decode_bytes``),
DeepSeek V4's compressed pools included, and the PD transfer's pools (``transfer_pools``, the
``index-k-not-transferred`` hypothesis: SGLang #24878's class)."""
from __future__ import annotations

import pytest

from kvrace.run_cli import format_run
from sim.engine.decode import transfer_size
from sim.engine.decode_hicache import DecodeCacheEngine, format_decode_side
from sim.engine.engine import PrefillEngine
from sim.engine.hypotheses import configuration, hypothesis
from sim.engine.models import model, resolve_options, window_start
from sim.engine.scenario import load_scenario
from sim.errors import InputError

#: incident-short (DeepSeek V4, PD) cut to its first 4 layers: SWA, C4 with its indexer, C128
V4 = ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4", "model.index_k_dtype=fp8"]
#: glm5 (dsa-v3.2) in PD, 2 layers, short outputs
DSA = ["run.layers=2", "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
       "workload.output_tokens_min=4", "workload.output_tokens_max=8", "workload.sessions=4",
       "variant.gate_map=upstream-0.5.11"]


def run(name, *sets):
    e = PrefillEngine(load_scenario(name, list(sets)), 0)
    return e, e.run()


@pytest.fixture(scope="module")
def v4_clean():
    return run("incident-short", *V4, "deployment.decode_bytes=true")


@pytest.fixture(scope="module")
def v4_not_sent():
    return run("incident-short", *V4, "variant.hypotheses=index-k-not-transferred")


def test_v4_decode_side_at_byte_level_is_clean_and_empties(v4_clean):
    e, r = v4_clean
    assert isinstance(e.decode, DecodeCacheEngine) and not e.decode.hicache
    d = r.decode
    assert d is not None and d["hicache"] is False and "transfer_pools" not in d
    assert r.requests_completed == r.requests_total == d["requests"] > 0
    # no decode tree: the transfer moves every input token, and nothing is loaded or backed up
    assert d["transfer_tokens"] == d["input_tokens"] > 0
    assert d["device_hit_tokens"] == d["host_hit_tokens"] == d["load_backs"] == d["backups"] == 0
    # every step reads each of the four V4 pool roles (SWA, C4, its indexer, C128) once
    assert d["steps"] > 0 and d["reads_total"] == 4 * d["steps"]
    assert d["stale_reads"] == d["torn_reads"] == d["wrong_kv_reads"] == d["requests_corrupted"] == 0
    assert d["latent_races"] == d["oob_writes"] == 0
    s = e.decode.session
    assert s.allocator.available_size() == s.allocator.size_full
    assert "HiCache off" in format_decode_side(d)[0]


def test_v4_transfer_sends_the_swa_window_only(monkeypatch):
    """SGLang's ``_swa_payload`` sends SWA from the page holding ``seq_len - 128`` on: the
    transfer lands SWA from there (a store of its own), every other pool from the first
    token; the decode reads, SWA in its window, still see only their own KV; the transfer's
    bytes count the same."""
    landed = []
    orig = DecodeCacheEngine._store

    def spy(self, pairs, stream, roles=None):
        if stream == "schedule":
            d, _, pos = pairs[0]
            landed.append((d.req.input_len, frozenset(roles), int(pos[0]), len(pos)))
        return orig(self, pairs, stream, roles)
    monkeypatch.setattr(DecodeCacheEngine, "_store", spy)
    e, r = run("incident-short", *V4, "deployment.decode_bytes=true")
    assert r.decode["wrong_kv_reads"] == r.decode["stale_reads"] == r.decode["requests_corrupted"] == 0
    assert any(n > 384 for n, *_ in landed)
    for n, roles, first, count in landed:
        start = window_start(n, 128, 256)
        if roles == {"swa"}:
            assert (first, count) == (start, n - start)
        else:
            assert roles == {"c4", "index_k", "c128"} if start else roles == {"swa", "c4", "index_k", "c128"}
            assert (first, count) == (0, n)
    ts = e.decode.transfer_size
    assert ts.window == 128 and ts.page == 256 and ts.window_per_token == 584 * 4    # 4 layers
    assert ts.nbytes(0, 1000) == 1000 * ts.per_token + (1000 - 768) * ts.window_per_token
    assert ts.nbytes(0, 100) == 100 * (ts.per_token + ts.window_per_token)
    assert ts.nbytes(900, 1000) == 100 * (ts.per_token + ts.window_per_token)


def test_transfer_size_without_a_window_is_per_token():
    ts = transfer_size(model("dsa-v3.2"), resolve_options(None), 64)
    assert ts.window_per_token == 0 and ts.nbytes(10, 1010) == 1000 * ts.per_token == 1000 * (656 + 132) * 61
    assert window_start(1000, 128, 256) == 768 and window_start(300, 128, 256) == 0 \
        and window_start(384, 128, 256) == 256


def test_decode_bytes_off_keeps_the_decode_side_in_simulated_time():
    e, r = run("incident-short", *V4)
    assert not isinstance(e.decode, DecodeCacheEngine) and r.decode is None and "decode" not in r.to_dict()


def test_index_k_not_transferred_is_wrong_kv_on_the_decode_indexer_only(v4_clean, v4_not_sent):
    e, r = v4_not_sent
    assert isinstance(e.decode, DecodeCacheEngine)      # a pool left out brings the decode side to bytes
    d = r.decode
    assert d["transfer_pools"] == ["c128", "c4", "swa"]
    assert "(pools sent: c128, c4, swa)" in "\n".join(format_decode_side(d))
    # the run's summary says where its corrupted requests were
    assert (f"0 raced, 0 read KV not theirs on prefill; {d['requests_corrupted']} on the decode side"
            in format_run(r.to_dict()))
    assert d["wrong_kv_reads"] > 0 and d["requests_corrupted"] > 0
    # what was not sent is read as KV that is not the request's, not as a race
    assert d["stale_reads"] == d["torn_reads"] == d["latent_races"] == 0
    assert {c["role"] for c in d["corrupted_reads"]} == {"index_k"}
    # the prefill side reads the right KV (its reads are judged as before); every corrupted
    # request is the decode side's, and with no index-K sent every request's decode is
    assert r.wrong_kv_reads == r.stale_reads == r.torn_reads == 0 and not r.corrupted_reads
    assert r.requests_corrupted == d["requests_corrupted"] == d["requests"] == r.requests_total
    assert v4_clean[1].requests_corrupted == 0


def test_index_k_not_transferred_on_dsa_with_and_without_decode_hicache():
    for dec in (False, True):
        _, r = run("glm5-22811-small", *DSA, f"hicache.decode={str(dec).lower()}",
                   "variant.hypotheses=index-k-not-transferred")
        d = r.decode
        assert d["transfer_pools"] == ["latent"] and d["hicache"] is dec
        assert d["wrong_kv_reads"] > 0 and {c["role"] for c in d["corrupted_reads"]} == {"index_k"}
        assert d["stale_reads"] == d["torn_reads"] == 0


def test_colocated_has_no_transfer_and_refuses_decode_bytes():
    with pytest.raises(InputError) as e:
        load_scenario("glm5-22811-small", ["deployment.decode_bytes=true"])
    assert e.value.where == "deployment.decode_bytes"
    # the hypothesis states what the PD transfer sends: colocated, nothing crosses, nothing changes
    _, r = run("glm5-22811-small", "run.layers=2", "workload.sessions=2", "variant.gate_map=upstream-0.5.11",
               "variant.hypotheses=index-k-not-transferred")
    assert r.decode is None and r.requests_corrupted == 0


def test_transfer_pools_validated_and_the_default_is_every_pool():
    c = configuration("deepseek-v4-flash")
    assert c.transfer_pools == frozenset({"swa", "c4", "index_k", "c128"})
    assert hypothesis("index-k-not-transferred").apply(c).transfer_pools == frozenset({"swa", "c4", "c128"})
    with pytest.raises(InputError) as e:
        configuration("dsa-v3.2", transfer_pools=["c4"])
    assert e.value.where == "configuration.transfer_pools" and "latent" in e.value.message


@pytest.mark.slow
@pytest.mark.parametrize("name, sets", [
    ("incident-short", ["run.layers=3", "workload.concurrency=2", "model.index_k_dtype=bf16", "hicache.prefill=false",
                        "scheduler.max_total_tokens=8192", "hicache.layout=page_first_direct", "run.seed=7"]),
    ("incident-short", ["run.layers=4", "workload.concurrency=4", "model.index_k_dtype=bf16",
                        "scheduler.max_total_tokens=16384", "scheduler.overlap=true", "scheduler.event_loop=overlap",
                        "deployment.simulated_ranks=2", "run.seed=3"]),
    ("glm5-22811-small", [*DSA[:-2], "workload.output_tokens_max=32", "workload.sessions=6", "hicache.decode=false",
                          "variant.gate_map=upstream-0.5.11", "scheduler.max_total_tokens=3072",
                          "hicache.layout=layer_first", "run.seed=11"]),
])
def test_decode_bytes_without_a_hypothesis_is_clean_and_frees_every_slot(name, sets):
    """Without a hypothesis nothing the decode side reads is wrong: no race (a request joins
    after its transfer landed, a step waits for nothing in flight), no KV that is not the
    request's (compressed pools included), and every slot comes back."""
    e, r = run(name, *sets, "run.duration_s=1", "deployment.decode_bytes=true")
    d = r.decode
    assert d["requests"] > 0 and d["steps"] > 0 and r.requests_completed == r.requests_total
    assert d["requests_corrupted"] == d["stale_reads"] == d["torn_reads"] == d["wrong_kv_reads"] == 0
    assert d["latent_races"] == d["oob_writes"] == 0 and r.requests_corrupted == 0
    s = e.decode.session
    assert s.allocator.available_size() == s.allocator.size_full
