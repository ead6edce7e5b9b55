"""The KV oracle's incremental check (``KVOracle(incremental=True)``, what the streaming engine
uses) against its full check, read by read: every read the engine judges is judged both ways
and the wrong entries per request must be equal; the engine results equal too.  Also what
``written`` forgets and the session's write watcher."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sim.cache.session import CacheSession
from sim.engine import PrefillEngine
from sim.engine.layer_reads import LayerReads
from sim.engine.oracle import KVOracle, LayerContents
from sim.engine.scenario import load_scenario
from sim.pools.layouts import PagedLayout

V4 = ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4", "model.index_k_dtype=fp8"]
TIGHT = ["workload.sessions=5", "workload.max_turns=3", "workload.concurrency=4", "scheduler.max_total_tokens=1536",
         "workload.max_context_tokens=1472"]


def judged_both_ways(name: str, sets: list[str], seed: int = 0):
    """Run ``name`` streaming with the incremental oracle, judging every read also with the
    full check (same arguments); returns the engine, its result and counts."""
    e = PrefillEngine(load_scenario(name, sets), seed, keep="report")
    o = e.oracle
    assert o.incremental
    orig = o.check_reads
    n = {"reads": 0, "as_it_stands": 0, "flagged": 0, "merged_calls": 0}

    def full_check(info, obs, made_for, contents):
        counters = o.entries_checked, o.entries_sampled, o.pairs_one_piece, o.pairs_by_sample
        o.incremental = False
        full = orig(info, obs, made_for, contents)
        o.incremental = True
        o.entries_checked, o.entries_sampled, o.pairs_one_piece, o.pairs_by_sample = counters
        return full

    def spy(info, obs, made_for, contents=None, by_layer=False):
        got = orig(info, obs, made_for, contents, by_layer=by_layer)
        if not by_layer:
            full = full_check(info, obs, made_for, contents)
            assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in full.items()}, info.op_id
            n["reads"] += 1
            n["flagged"] += any(v.any() for v in full.values())
        else:
            # reads of several pool layers judged in one call (sim.engine.layer_reads): each
            # row is what the full check of that pool layer's read, on its own bytes, gives
            assert isinstance(contents, LayerContents)
            n["merged_calls"] += 1
            for j, pl in enumerate(info.pool_layers):
                one = dataclasses.replace(info, pool_layers=(pl,))
                full = full_check(one, obs, made_for, contents.parts[pl])
                assert {k: v[j].tolist() for k, v in got.items()} == {k: v.tolist() for k, v in full.items()}, \
                    (info.op_id, pl)
                n["reads"] += 1
                n["flagged"] += any(v.any() for v in full.values())
        n["as_it_stands"] += contents is not None
        return got
    o.check_reads = spy
    return e, e.run(), n


def full_result(name: str, sets: list[str], seed: int = 0):
    e = PrefillEngine(load_scenario(name, sets), seed, keep="report")
    e.oracle.incremental = False
    return e.run()


@pytest.mark.parametrize("name, sets, flagged", [
    ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10"], True),     # raced index-K reads
    ("incident-short", [*V4, "variant.hypotheses=index-k-not-backed-up"], True),           # wrong KV, no race
])
def test_incremental_oracle_equals_the_full_check_read_by_read(name, sets, flagged):
    e, r, n = judged_both_ways(name, sets)
    assert n["reads"] == r.reads_total and n["as_it_stands"] > 0
    assert (n["flagged"] > 0) == flagged
    assert n["merged_calls"] > 0            # per-layer reads judged together (sim.engine.layer_reads)
    o = e.oracle
    # it did skip: fewer entries looked up than judged, most pages judged from one piece
    assert 0 < o.entries_sampled < o.entries_checked
    assert o.pairs_one_piece > 0


@pytest.mark.slow
@pytest.mark.parametrize("name, sets", [
    ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10", "workload.concurrency=6"]),
    ("glm5-22811-small", ["run.layers=4", "variant.gate_map=upstream-0.5.11", "scheduler.event_loop=overlap",
                          "variant.hypotheses=load-unfenced", *TIGHT]),
    ("incident-repro", ["run.duration_s=1"]),
    ("incident-short", ["run.layers=4", "run.duration_s=3", "model.index_k_dtype=bf16",
                        "variant.hypotheses=index-k-stride-mismatch"]),
    ("incident-short", [*V4[:3], "model.index_k_dtype=bf16", "variant.hypotheses=index-k-c4-token-copy"]),
    ("incident-short", [*V4, "variant.hypotheses=host-freed-during-load"]),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_oracle_equals_the_full_check_deep(name, sets, seed):
    e, r, n = judged_both_ways(name, sets, seed)
    assert n["reads"] == r.reads_total
    # and the run's result (oracle_entries included: entries judged, remembered or not)
    assert r.signature() == full_result(name, sets, seed).signature()


@pytest.mark.slow
def test_sample_by_sample_pairs_are_exercised():
    """``incident-repro`` has pages whose sampled bytes span several pieces (partial pages
    written by two stores): those pairs go sample by sample and still agree."""
    e, r, n = judged_both_ways("incident-repro", ["run.duration_s=0.3"])
    assert e.oracle.pairs_by_sample > 0 and n["flagged"] > 0


def _oracle(pages=8, layers=2, epu=4):
    lay = PagedLayout("b", layers, pages, 64, epu)
    return KVOracle({"r": ("b", lay)}, {"b": "kv"}, {"r": 1}), lay


@pytest.mark.parametrize("few", [0, KVOracle.FEW_EXTENTS])       # numpy, then plain Python, for a few extents
def test_written_forgets_every_page_a_write_touches(few):
    o, lay = _oracle()
    o.FEW_EXTENTS = few
    assert o.judged("b")[0].size == lay.layers * lay.pages == 16
    key, n = o.judged("b")
    key[:] = 7
    n[:] = 4
    o.written("b", np.array([64 * 3 + 5]), np.array([10]))                 # inside page 3 of layer 0
    o.written("b", np.array([64 * 9 + 60]), np.array([68]))                # layer 1 pages 1..2 (crosses into the next)
    o.written("b", np.array([64 * 12, 64 * 15]), np.array([0, 1 << 20]))   # empty extent; one past the end
    o.written("other", np.array([0]), np.array([64]))                     # a buffer the oracle does not check
    assert np.flatnonzero(key == -1).tolist() == [3, 9, 10, 15]
    key[:] = 7
    o.written("b", np.array([0]), np.array([64 * 16]))                     # a whole-buffer copy
    assert (key == -1).all()
    key[:] = 7
    o.written("b", np.array([64 * 2 + 10, -64, 64 * 20]), np.array([64, 10, 64]))   # pages 2, 3; outside
    assert np.flatnonzero(key == -1).tolist() == [2, 3]
    o2, _ = _oracle()
    o2.written("b", np.array([0]), np.array([64]))                         # nothing remembered yet: no arrays made
    assert "b" not in o2._judged


@pytest.mark.parametrize("few", [0, KVOracle.FEW_EXTENTS])
def test_written_many_wide_extents_use_the_difference_array(few):
    o, lay = _oracle(pages=4, layers=1)
    o.FEW_EXTENTS = few
    key, _ = o.judged("b")
    key[:] = 1
    # wider in all than the buffer has pages: the marks are summed, not expanded
    o.written("b", np.array([0, 64 * 2, 64 * 2]), np.array([64 * 2, 64 * 2, 64 * 2]))
    assert (key == -1).all()
    key[:] = 1
    o.written("b", np.array([64, 64]), np.array([64 * 2, 64 * 2]))
    assert key.tolist() == [1, -1, -1, 1]


def test_session_write_watcher_sees_writes_and_copies():
    seen = []
    s = CacheSession({"model": "mla", "layers": 2, "device_tokens": 64, "keep": "report"})
    s.watch_writes(lambda buf, offs, lens: seen.append((buf, np.asarray(offs).tolist(), np.asarray(lens).tolist())))
    from sim.cache.radix import RadixKey
    from sim.cache.records import InsertParams

    slots = s.allocator.alloc(8)
    s.store_kv(slots, owner=1)                      # one write of both layers
    s.cache.insert(InsertParams(RadixKey(np.arange(8)), slots))   # write_through: a backup copy D2H
    s.wait_idle()
    lay = s.device_pool.layouts["kv_buffer"]
    # the write's two layers, each unit's bytes; then the backup's copy items into the host pool
    assert seen[0] == ("kv_buffer", [o for k in (0, 1) for o in lay.unit_offsets(k, slots).tolist()],
                       [lay.unit_bytes] * 16)
    copied = seen[1:]
    assert {b for b, _, _ in copied} == {"host_kv_buffer"}
    assert sum(len(o) for _, o, _ in copied) == 16 and {n for _, _, ln in copied for n in ln} == {lay.unit_bytes}
    # a watcher of some buffers only hears of those
    only = []
    s.watch_writes(lambda buf, offs, lens: only.append(buf), buffers=["kv_buffer"])
    s.store_kv(slots[:2], owner=2)
    s.wait_idle()
    assert only == ["kv_buffer"] and seen[-1] == ("kv_buffer", [o for k in (0, 1)
                                                                for o in lay.unit_offsets(k, slots[:2]).tolist()],
                                                  [lay.unit_bytes] * 4)


# ---------------------------------------------------------------- a random buffer history

from hypothesis import given, settings, strategies as st  # noqa: E402

from sim.bytes.compact import CompactBuffer, OriginTable  # noqa: E402
from sim.bytes.pattern import Origin  # noqa: E402
from sim.engine.forward import ReadInfo  # noqa: E402
from sim.engine.workload import Request, TokenSource  # noqa: E402
from sim.pools.layouts import Field  # noqa: E402

EPU, PAGES, LAYERS = 4, 6, 2
#: two fields and padding: entries 0..3 of 8 B at 0, of 2 B at 32; 48 B pages
LAY = PagedLayout("b", LAYERS, PAGES, 48, EPU, (Field("value", 0, 8), Field("scale", 32, 2)))
SRC = TokenSource(0, 6, 1000)          # a 6-token system prompt shared by the sessions
REQS = [Request(rid, rid % 2, 0, 0, 16, 1, 0, True, SRC) for rid in range(3)]
# request rid's page j lives in device page PERM[rid][j] (requests 0 and 2 share a session,
# so their pages hold the same KV; request 2's later pages are its own)
PERM = {0: [0, 1, 2, 3], 1: [4, 5, 1, 0], 2: [0, 1, 5, 4]}

write_op = st.tuples(st.just("write"), st.integers(0, 2), st.integers(0, 3), st.integers(0, LAYERS - 1),
                     st.sampled_from(["right"] * 4 + ["shifted", "partial", "layer", "kind", "unit", "none"]),
                     st.integers(1, 40))
read_op = st.tuples(st.just("read"), st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
                    st.one_of(st.sampled_from([4, 8, 12, 16]), st.integers(1, 16)),
                    st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=2, unique=True),
                    st.one_of(st.just(0), st.integers(0, 15)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(write_op, read_op), min_size=1, max_size=25),
       st.lists(st.integers(0, 2), min_size=1, max_size=3))
def test_incremental_oracle_equals_the_full_check_on_a_random_history(ops, first):
    """Stores that write the right KV, pages written shifted (misaligned in their unit), in
    part, at the wrong layer, of another kind or unit size, no owner; reads of 1..16 tokens of
    up to three requests (shared pages, partial pages, several pool layers), from the first
    entry or from a later one (a sliding window's read: ``ReadInfo.first``): every read's
    verdict, incremental and full, must agree, with the incremental oracle's memory kept from
    read to read (and told of every write)."""
    table = OriginTable()
    buf = CompactBuffer(LAY.nbytes, table, Origin("kv", 0, -1, 0, LAY.unit_bytes))
    inc = KVOracle({"r": ("b", LAY)}, {"b": "kv"}, {"r": 1})
    full = KVOracle({"r": ("b", LAY)}, {"b": "kv"}, {"r": 1}, incremental=False)
    store = 0
    # the requests ``first`` have stored all their pages right, then the history runs
    start = [("write", rid, j, pl, "right", 1) for rid in first for j in range(4) for pl in range(LAYERS)]
    for k, op in enumerate(start + ops):
        if op[0] == "write":
            _, rid, j, pl, how, shift = op
            store += 1
            page = PERM[rid][j]
            for o in (inc, full):       # the store's content key: the request's page j, whole
                o.record_store(REQS[rid], store, {"r": np.array([page * EPU + EPU - 1])},
                               {"r": np.array([j * EPU + EPU - 1])})
            ub = LAY.unit_bytes
            origin = Origin("other" if how == "kind" else "kv", (pl + 1) % LAYERS if how == "layer" else pl,
                            -1 if how == "none" else rid, store, ub // 2 if how == "unit" else ub)
            dst = int(LAY.unit_offsets(pl, page))
            n, so = ub, page * ub
            if how == "shifted":
                dst = min(dst + shift, LAY.nbytes - ub)
            elif how == "partial":
                dst, n, so = dst + shift, ub - shift, so + shift
            buf.fill(np.array([dst]), np.array([n]), origin, np.array([so]))
            inc.written("b", np.array([dst]), np.array([n]))
            continue
        _, rids, n_ctx, pls, skip = op
        skip = min(skip, n_ctx - 1)
        entries = {rid: np.array([PERM[rid][t // EPU] * EPU + t % EPU for t in range(skip, n_ctx)], np.int64)
                   for rid in rids}
        info = ReadInfo(f"r{k}", 0, "x", "r", "b", tuple(pls), False, np.zeros(0, np.int64),
                        np.zeros(0, np.int64), entries, {rid: skip for rid in rids} if skip else {})
        made_for = {rid: (REQS[rid], n_ctx) for rid in rids}
        a = inc.check_reads(info, None, made_for, buf)
        b = full.check_reads(info, None, made_for, buf)
        assert {r: v.tolist() for r, v in a.items()} == {r: v.tolist() for r, v in b.items()}, (k, op)
    assert inc.entries_checked == full.entries_checked


@pytest.mark.parametrize("name, sets, flagged", [
    # raced reads (at concurrency 6: at 4 no read with copies in flight is flagged since a colocated
    # request keeps its whole prompt locked through its decode)
    ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10", "workload.concurrency=6"], True),
    ("incident-short", ["run.layers=4", "run.duration_s=1.5", "model.index_k_dtype=bf16",
                        "variant.hypotheses=index-k-stride-mismatch"], False),
])
def test_a_read_with_copies_in_flight_but_nothing_torn_is_judged_from_the_buffer(name, sets, flagged, monkeypatch):
    """A read that caught no copy item mid-flight (``capture.torn`` False) saw the buffer as it
    stands, copies in flight or not, so the engine hands the oracle the buffer: each such read's
    verdict equals the check of its own views (``contents=None``).  (Every read is judged at its
    capture here, with its capture: none is kept to be judged with its forward's others.)"""
    monkeypatch.setattr(LayerReads, "keep", lambda self, op_id, rec, contents: False)
    e = PrefillEngine(load_scenario(name, sets), 0, keep="report")
    o = e.oracle
    orig = o.check_reads
    n = {"in_flight": 0, "flagged": 0}

    def spy(info, obs, made_for, contents=None):
        got = orig(info, obs, made_for, contents)
        if contents is not None and obs.in_flight:
            assert not obs.torn
            counters = o.entries_checked, o.entries_sampled, o.pairs_one_piece, o.pairs_by_sample
            views = orig(info, obs, made_for, None)
            o.entries_checked, o.entries_sampled, o.pairs_one_piece, o.pairs_by_sample = counters
            assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in views.items()}, info.op_id
            n["in_flight"] += 1
            n["flagged"] += any(v.any() for v in views.values())
        return got
    o.check_reads = spy
    e.run()
    assert n["in_flight"] > 0 and (n["flagged"] > 0) == flagged, n


def test_page_runs_are_remembered_per_entries_and_keys():
    """A request's page runs (``KVOracle._page_runs``) are remembered per (entries, expected
    keys) object: the same entries with other keys (another forward's context) are cut anew,
    and every result equals a fresh oracle's cut of the same arrays."""
    e = PrefillEngine(load_scenario("incident-short", V4), 0, keep="report")
    o, fresh = e.oracle, PrefillEngine(load_scenario("incident-short", V4), 0, keep="report").oracle
    ent = np.array([5, 6, 7, 64, 65, 130, 131, 132, 133], np.int64)
    w1 = np.array([1, 1, 1, 1, 1, 2, 2, 2, 2], np.int64)
    w2 = np.array([1, 1, 3, 3, 3, 3, 3, 4, 4], np.int64)
    for w in (w1, w2, w1):
        got = o._page_runs(ent, w, 64)
        fresh._expected_memo.clear()
        want = fresh._page_runs(ent, w, 64)
        assert [a.tolist() for a in got] == [a.tolist() for a in want]
        assert got[-1].tolist() == w[got[2]].tolist()           # each run's key is its first entry's
    assert o._page_runs(ent, w1, 64) is o._page_runs(ent, w1, 64)
    # runs of one page and one key: pages 0 (entries 5-7), 1 (64-65), 2 (130-133) under w1
    assert o._page_runs(ent, w1, 64)[2].tolist() == [0, 3, 5]
    assert o._page_runs(ent, w2, 64)[2].tolist() == [0, 2, 3, 5, 7]
