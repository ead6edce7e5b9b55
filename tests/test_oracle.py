"""The KV oracle: a read made for a request must see that request's tokens' KV, in any order."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import PrefillEngine
from sim.engine.oracle import ContentKeyIds, ContentKeys, KVOracle, content_key
from sim.engine.scenario import load_scenario
from sim.engine.workload import Request, TokenSource
from sim.pools.layouts import PagedLayout


def req(session, n=4096, rid=0, s0=1024):
    return Request(rid, session, 0, 0, n, 16, 0, True, TokenSource(0, s0, 129280))


def test_content_keys_share_the_system_prompt_and_a_session_across_turns():
    assert content_key(req(1), 512) == content_key(req(2), 512) == (-1, 512)
    assert content_key(req(1), 2048) != content_key(req(2), 2048)
    assert content_key(req(1, rid=5), 2048) == content_key(req(1, n=8000, rid=9), 2048)


class _Listed:
    """A token source that is not a ``TokenSource`` (as a replayed trace's): position p is p."""

    def ids(self, session, start, stop):
        return np.arange(start, stop, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["one", "many"]), st.integers(0, 5), st.integers(0, 3),
                          st.lists(st.integers(0, 5000), max_size=12)), max_size=25))
def test_content_key_ids_are_the_dict_they_replaced(calls):
    """``ContentKeyIds`` numbers keys as ``dict.setdefault(key, len(dict))`` did, call for call:
    one key at a time (``id_of``) or a request's prefixes at once (``ids``, new keys in order
    of first appearance), TokenSource keys (packed) and hashed ones (a trace's requests) alike."""
    ref: dict = {}
    got = ContentKeyIds()
    for how, session, s0_k, ns in calls:
        r = req(session, n=6000, s0=(0, 1, 300, 1024)[s0_k])
        if session == 5:                                   # not a TokenSource: hashed keys
            r = Request(0, 5, 0, 0, 6000, 16, 0, True, _Listed())
        want = [ref.setdefault(content_key(r, n), len(ref)) for n in ns]
        if how == "one":
            have = [got.id_of(content_key(r, n)) for n in ns]
        else:
            have = got.ids(r, np.array(ns, np.int64)).tolist()
        assert have == want
        assert len(got) == len(ref)
    assert dict(got.items()) == ref


def test_expected_key_of_a_page_is_its_prefix_up_to_the_last_completed_entry():
    lay = PagedLayout("c4", 1, 8, 64 * 16, 64)
    o = KVOracle({"c4": ("c4buf", lay)}, {"c4buf": "c4"}, {"c4": 4})
    r = req(3, s0=300)
    pos = np.array([3, 255, 259, 1001], np.int64)       # entries completed at these positions
    ids = o.expected(r, "c4", pos, n_ctx=1002)
    keys = {v: k for k, v in o._ids.items()}
    # full pages of 256 tokens (the first inside the shared system prompt of 300), then the
    # partial page up to the last whole group of 4 (1000)
    assert [keys[int(i)] for i in ids] == [(-1, 256), (-1, 256), (3, 512), (3, 1000)]


def test_remembered_expected_keys_equal_a_fresh_lookup():
    """``_expected_entries`` (what a read's check uses) remembers keys per request, role,
    entries and context: each must equal :meth:`KVOracle.expected` computed afresh."""
    lay = PagedLayout("c4", 1, 8, 64 * 16, 64)
    o = KVOracle({"c4": ("c4buf", lay)}, {"c4buf": "c4"}, {"c4": 4})
    other = o.for_buffers({"c4": ("c4buf_1", lay)}, {"c4buf_1": "c4"})
    reqs = [req(3, s0=300, rid=1), req(4, s0=300, rid=2), req(3, n=9000, s0=300, rid=3)]
    for _ in range(2):                                   # the second pass is answered from the memo
        for r in reqs:
            for ne, n_ctx in ((10, 41), (10, 2000), (250, 1002), (250, 1003), (700, 2801)):
                want = o.expected(r, "c4", np.arange(ne, dtype=np.int64) * 4 + 3, n_ctx)
                for orc in (o, other):
                    got = orc._expected_entries(r, "c4", ne, n_ctx)
                    assert np.array_equal(got, want) and not got.flags.writeable


def test_expected_entries_number_new_keys_as_expected_does():
    """Asked first, ``_expected_entries`` (keys per unit, repeated) gives the same ids as
    :meth:`KVOracle.expected` on a fresh oracle: the same keys, numbered in the same order."""
    lay = PagedLayout("c4", 1, 8, 64 * 16, 64)
    calls = [(req(3, s0=300, rid=1), 250, 1002), (req(4, s0=300, rid=2), 10, 41), (req(3, n=9000, s0=300, rid=3), 700, 2801),
             (req(5, s0=0, rid=4), 129, 517)]
    a = KVOracle({"c4": ("c4buf", lay)}, {"c4buf": "c4"}, {"c4": 4})
    b = KVOracle({"c4": ("c4buf", lay)}, {"c4buf": "c4"}, {"c4": 4})
    for r, ne, n_ctx in calls:
        got = a._expected_entries(r, "c4", ne, n_ctx)
        want = b.expected(r, "c4", np.arange(ne, dtype=np.int64) * 4 + 3, n_ctx)
        assert got.tolist() == want.tolist()
    assert dict(a._ids.items()) == dict(b._ids.items())


@pytest.mark.parametrize("ratio, epu", [(1, 256), (4, 64)])
def test_expected_entries_from_a_later_first_entry_equal_expected(ratio, epu):
    """A read from entry ``first`` on (a sliding window's: ``ReadInfo.first``): its keys are
    :meth:`KVOracle.expected` of the entries ``first..first+ne-1``, whatever page ``first``
    falls in."""
    lay = PagedLayout("p", 1, 40, epu * 16, epu)
    o = KVOracle({"p": ("pbuf", lay)}, {"pbuf": "kv"}, {"p": ratio})
    r = req(3, n=9000, s0=300)
    for first, ne, n_ctx in ((0, 10, 41), (100, 137, 237 * ratio), (255, 2, 257 * ratio), (256, 300, 556 * ratio),
                             (873, 137, 1010 * ratio + ratio - 1), (5, 1, 6 * ratio)):
        want = o.expected(r, "p", (first + np.arange(ne, dtype=np.int64)) * ratio + ratio - 1, n_ctx)
        got = o._expected_entries(r, "p", ne, n_ctx, first)
        assert got.tolist() == want.tolist() and len(got) == ne
        assert o._expected_entries(r, "p", ne, n_ctx, first) is got          # remembered


@pytest.fixture(scope="module")
def dsa_runs():
    out = {}
    for g in ("upstream-0.5.10", "upstream-0.5.11"):
        out[g] = PrefillEngine(load_scenario("glm5-22811-small", ["run.layers=2", f"variant.gate_map={g}"]), 0).run()
    return out


def test_oracle_sees_the_race_and_nothing_when_gated(dsa_runs):
    r10, r11 = dsa_runs["upstream-0.5.10"], dsa_runs["upstream-0.5.11"]
    assert r10.requests_raced > 0 and r10.requests_wrong_kv == r10.requests_raced
    assert r10.requests_corrupted == len({x for c in r10.corrupted_reads for x in c["requests"]})
    assert r11.requests_corrupted == r11.requests_wrong_kv == 0 and r11.oracle_entries > 0


def test_a_pool_never_backed_up_is_wrong_kv_without_any_race():
    """SGLang #17085: index-K never reaches the host pool, so a load-back leaves the device's
    previous bytes in it. Every order gives the same wrong bytes: no race, but the oracle sees
    requests reading KV that is not theirs."""
    sets = ["run.layers=4", "run.duration_s=1.5", "model.index_k_dtype=fp8"]
    r = PrefillEngine(load_scenario("incident-short", [*sets, "variant.hypotheses=index-k-not-backed-up"]), 0).run()
    assert r.load_backs > 0 and r.requests_raced == 0 and r.latent_races == 0
    assert r.requests_wrong_kv > 0 and r.requests_corrupted == r.requests_wrong_kv
    assert {c["status"] for c in r.corrupted_reads} == {"wrong-kv"}
    assert {c["role"] for c in r.corrupted_reads} == {"index_k"}
    assert "index_k" not in r.branches


def test_packed_and_row_wise_dedup_agree(dsa_runs, monkeypatch):
    monkeypatch.setattr(KVOracle, "PACK_LIMIT", 0)          # force the row-wise path
    r = PrefillEngine(load_scenario("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10"]), 0).run()
    packed = dsa_runs["upstream-0.5.10"]
    assert r.requests_wrong_kv == packed.requests_wrong_kv > 0
    assert [c["wrong_kv_requests"] for c in r.corrupted_reads] == [c["wrong_kv_requests"] for c in packed.corrupted_reads]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["c4", "idx"]), st.integers(0, 6),
                          st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True)), max_size=14),
       st.lists(st.tuples(st.sampled_from(["c4", "idx", "swa"]), st.integers(-2, 8), st.integers(-1, 42)),
                max_size=30))
def test_content_keys_equal_the_dict_they_replaced(files, probes):
    """Stores filed in any order (the engine's come in increasing order; several requests of one
    store refile units, the later id standing), looked up one by one and all at once."""
    ck, ref = ContentKeys(), {}
    for n, (kind, store, units) in enumerate(files):
        units = sorted(units)
        ids = [100 * n + u for u in units]
        ck.file(kind, store, np.array(units), np.array(ids))
        ref.update({(kind, store, u): i for u, i in zip(units, ids)})
    assert len(ck) == len(ref)
    for kind, store, unit in probes:
        assert ck.get((kind, store, unit)) == ref.get((kind, store, unit))
    for kind in ("c4", "idx", "swa"):
        got = ck.lookup(kind, np.array([p[1] for p in probes], np.int64), np.array([p[2] for p in probes], np.int64))
        assert got.tolist() == [ref.get((kind, s, u), -1) for _, s, u in probes]


def test_record_store_files_each_unit_under_its_last_completed_entry():
    lay = PagedLayout("c4", 1, 8, 64 * 16, 64)
    o = KVOracle({"c4": ("c4buf", lay)}, {"c4buf": "c4"}, {"c4": 4})
    r = req(3, s0=300)
    # entries of pages 1, 0, 1 (out of order) completed at these positions
    o.record_store(r, 7, {"c4": np.array([70, 3, 65])}, {"c4": np.array([1500, 400, 1300])})
    assert o.content.get(("c4", 7, 0)) == o._key_id(content_key(r, 401))
    assert o.content.get(("c4", 7, 1)) == o._key_id(content_key(r, 1501))
    assert o.content.get(("c4", 7, 2)) is None and o.content.get(("c4", 6, 0)) is None
