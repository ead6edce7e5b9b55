"""The engine stores a batch's new KV with ONE write per pool covering its layers (SGLang's
``set_kv_buffer`` / the DSA and V4 pools' ``set_*`` take the whole batch's ``out_cache_loc``),
and the KV oracle says which request's tokens each unit holds from the engine's own per-request
bookkeeping, not from that write's single ``owner`` (the batch's first request)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.cache import CacheSession
from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario

#: a small normal-loop run whose first batch holds four requests, its third three (a 6,144-token
#: pool: admission's decode-memory reservation, sim.engine.budget, leaves room for all four)
SETS = ["run.layers=2", "variant.gate_map=upstream-0.5.11", "workload.sessions=4", "workload.max_turns=2",
        "workload.concurrency=4", "scheduler.max_total_tokens=6144"]


def _logged(sets, seed=0, drop=None):
    """An engine on ``SETS``-like settings whose stores are logged (store -> rids, in batch
    order); ``drop=(store, k)``: that store's write leaves out the ``k``-th request's slots
    (its KV is never written, while the engine still records it for the oracle)."""
    e = PrefillEngine(load_scenario("glm5-22811-small", sets), seed)
    e.stored_for = {}
    record, store_batch = e._record_store, e._store_batch

    def logged(a, slots, store):
        e.stored_for.setdefault(store, []).append(a.req.rid)
        return record(a, slots, store)

    def dropping(parts, owner, store, layer=None):
        if drop is not None and store == drop[0]:
            parts = [p for k, p in enumerate(parts) if k != drop[1]]
        return store_batch(parts, owner, store, layer)
    e._record_store, e._store_batch = logged, dropping
    return e


@pytest.fixture(scope="module")
def logged_run():
    e = _logged(SETS)
    return e, e.run()


def test_one_write_per_pool_per_batch_store_of_every_layer_owned_by_its_first_request(logged_run):
    e, r = logged_run
    assert r.requests_corrupted == 0 and r.requests_wrong_kv == 0 and r.oracle_entries > 0
    assert any(len(v) > 1 for v in e.stored_for.values()), "no batch of several requests: the test is void"
    writes = [op for op in e.session.finish().schedule.ops if op.op == "write"]
    per = {}
    for op in writes:
        for layer in op.layers:
            per.setdefault((op.version, op.buffer, layer), []).append(op)
    assert all(len(v) == 1 for v in per.values())
    # one op per pool and store: its layers in one write (CacheSession.store_kv)
    assert len({(op.version, op.buffer) for op in writes}) == len(writes)
    # every prefill store wrote each pool at each of the run's layers, its owner the first request
    pools = {name for name, _ in e.buffers.values()}
    for store, rids in e.stored_for.items():
        got = {(b, layer) for (v, b, layer) in per if v == store}
        assert got == {(b, layer) for b in pools for layer in range(2)}, store
        assert {op.owner for op in writes if op.version == store} == {rids[0]}
    # store numbers are the writes' versions, unique per store
    assert sorted({op.version for op in writes}) == list(range(1, len({op.version for op in writes}) + 1))


def test_the_oracle_flags_exactly_the_batch_member_whose_slots_the_write_left_out(logged_run):
    """The batched write leaves out the second request of the four-request store: the oracle
    (per-unit keys from the engine's record, not the write's owner) flags that request and
    none of the three others, though all four share the write's owner and version."""
    e0, _ = logged_run
    store, rids = next((s, v) for s, v in e0.stored_for.items() if len(v) >= 3)
    e = _logged(SETS, drop=(store, 1))
    r = e.run()
    wrong = {x for c in r.corrupted_reads if c["status"] == "wrong-kv" for x in c["requests"]}
    assert rids[1] in wrong
    assert not wrong & {rids[0], *rids[2:]}


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 192)), min_size=1, max_size=4))
def test_one_batched_store_writes_each_unit_as_the_per_request_stores_do_but_the_owner(reqs):
    """store_kv of a batch's slots in one call leaves every unit of every pool and layer it
    touches with the bytes the per-request calls leave (same kind, layer, version, place in
    the unit), the owner aside: the batch's first request (DSA: a token latent buffer and a
    paged index-K one).  Each request: ``pages`` allocated, its first ``n`` slots stored."""
    def build():
        s = CacheSession(model="dsa", page_size=64, layers=2, device_tokens=1024, materialise=False)
        return s, [s.allocator.alloc(64 * pages)[:min(n, 64 * pages)] for pages, n in reqs]
    one, parts = build()
    one.store_kv(np.concatenate(parts), owner=7, version=3)
    many, parts2 = build()
    for k, p in enumerate(parts2):
        many.store_kv(p, owner=7 + k, version=3)
    assert all((a == b).all() for a, b in zip(parts, parts2))
    slots = np.concatenate(parts)
    for name in one.device_pool.layouts:
        lay = one.memory.specs[name].layout
        units = np.unique(one.entries_of(name, slots) // lay.entries_per_unit)
        for layer in range(lay.layers):
            a, b = one.bytes_of(name, layer, units), many.bytes_of(name, layer, units)
            for x, y in zip(a, b):
                strip = [[{k: v for k, v in {**d, "origin": {**d["origin"], "owner": None}}.items() if k != "text"}
                          for d in u] for u in (x, y)]
                assert strip[0] == strip[1]
                assert {d["origin"]["owner"] for d in x} == {7}
