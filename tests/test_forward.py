"""The forward model: accessor order, gates, reads, one-step mode and the indexer's top-k.

Facts from SGLang (``reference/sglang_hicache.md`` sections 1.2 and 6-7, the 0.5.10 and 0.5.14
wheels): a gated accessor makes the current stream wait on that layer's load event only when
the batch carries a consumer index; decode batches carry -1; in a DSA layer the indexer reads
index-K before attention waits and reads the latent.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.engine.cost import CostModel
from sim.engine.forward import (BatchRequest, ForwardBatch, can_advance_in_one_step, coalesce, copies_in_flight,
                                entry_bytes,
                                indexer_topk, issue_forward, read_ranges, stand_in_scores, topk_verdict)
from sim.engine.gates import gate_map
from sim.engine.models import PoolSpec, model, resolve_options
from sim.errors import InputError
from sim.executor import run_programs, run_reference
from sim.pools.layouts import host_mirror, layout_to_json
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import H200, profile

COST = CostModel.from_profile(H200)


# ---------------------------------------------------------------- small worlds

def world(model_name: str, pages: int, options=None, roles=None, hosts=True):
    """Device buffers (role -> (name, layout)) of the model's pools with ``pages`` page rows
    per layer, their host mirrors (every row owned by request 7, v1), and a schedule header
    with streams forward/load/schedule and one load event per layer."""
    fam = model(model_name)
    pools = fam.pools_for(resolve_options(options))
    buffers, docs = {}, []
    for role, spec in pools.items():
        if roles is not None and role not in roles:
            continue
        lay = spec.layout(pages)
        buffers[role] = (f"dev_{role}", lay)
        docs.append({"name": f"dev_{role}", "location": "device", "kind": role, "layout": layout_to_json(lay)})
        if not hosts:
            continue
        host = host_mirror(lay, "layer_first")
        docs.append({"name": f"host_{role}", "location": "host", "kind": role, "layout": layout_to_json(host),
                     "init": [{"layers": "all", "indices": {"start": 0, "count": lay.pages}, "owner": 7,
                               "version": 1, "first_unit": 0}]})
    events = ["start"] + [f"load_L{i}" for i in range(fam.n_layers)]
    header = {"kvrace_schedule": 2, "name": "forward", "buffers": docs,
              "streams": ["forward", "load", "schedule"], "events": events}
    return fam, pools, buffers, header


def events_of(fam):
    return [f"load_L{i}" for i in range(fam.n_layers)]


def issue_load(h, fam, pools, buffers, units):
    """start_loading: for every layer, every pool's layer-i copy of page rows ``units`` (host
    unit u -> device unit u), then record load_L{i}; on the load stream, after 'start'."""
    h.issue({"op": "record", "stream": "schedule", "event": "start"})
    h.issue({"op": "wait", "stream": "load", "event": "start"})
    u = [int(x) for x in units]
    for layer in range(fam.n_layers):
        for role, (name, lay) in buffers.items():
            if layer in pools[role].layers:
                h.issue({"op": "copy", "stream": "load", "routine": "kernel_per_layer", "src": f"host_{role}",
                         "dst": name, "id": f"load.{role}.L{layer}",
                         "args": {"layer": pools[role].pool_layer(layer), "src_indices": u, "dst_indices": u}})
        h.issue({"op": "record", "stream": "load", "event": f"load_L{layer}"})


def make_batch(buffers, mode, consumer, pages, rid=7):
    """One request reading every entry of page rows ``pages`` of each pool."""
    slots, ctx = {}, 1
    for role, (_, lay) in buffers.items():
        e = (np.asarray(pages, np.int64)[:, None] * lay.entries_per_page
             + np.arange(lay.entries_per_page)[None, :]).ravel()
        slots[role] = e
        ctx = max(ctx, int(e.size))
    return ForwardBatch(mode, (BatchRequest(rid, slots, ctx if mode == "extend" else 1, ctx),), consumer)


def run_forward(model_name, gm, mode, consumer, *, pages=4, load=True, sync_first=False, one_step=False,
                options=None, roles=None, prof=None):
    fam, pools, buffers, header = world(model_name, pages, options, roles, hosts=load)
    b = make_batch(buffers, mode, consumer, range(pages))
    out = {}

    def program(h):
        if load:
            issue_load(h, fam, pools, buffers, range(pages))
        if sync_first:
            yield h.synchronize()
            out["in_flight"] = copies_in_flight(h, [n for n, _ in buffers.values()])
        out["issue"] = issue_forward(h, "forward", b, model=fam, gate_map=gate_map(gm), buffers=buffers,
                                     cost=COST, layer_events=events_of(fam), options=options, one_step=one_step)
        yield h.synchronize()

    run = run_programs(header, {"host": program}, prof or profile(), materialise=False)
    return run, out["issue"], buffers, out


class RecordingHost:
    """Records the op dicts issue_forward issues, without running them (order-only tests)."""

    def __init__(self):
        self.ops = []

    def issue(self, d):
        self.ops.append(d)
        return d.get("id")


def issue_only(model_name, gm, mode, consumer, *, pages=4, options=None, gate=None):
    fam, _, buffers, _ = world(model_name, pages, options)
    b = make_batch(buffers, mode, consumer, range(pages))
    h = RecordingHost()
    issue = issue_forward(h, "forward", b, model=fam, gate_map=gate or gate_map(gm), buffers=buffers, cost=COST,
                          layer_events=events_of(fam), options=options)
    assert [d["id"] for d in h.ops] == [o[1] for o in issue.ops]
    return issue, buffers


def position(issue, kind, layer, contains=""):
    for k, (kd, op_id, ly) in enumerate(issue.ops):
        if kd == kind and ly == layer and contains in op_id:
            return k
    return None


# ---------------------------------------------------------------- model facts

def test_v4_flash_layer_kinds_and_pools():
    # dsa_geometry.md 2.1-2.2: 43 layers, 0-1 sliding window only, then C4 and C128 alternating
    fam = model("deepseek-v4-flash")
    kinds = fam.layer_kinds
    assert len(kinds) == 43 and kinds[:2] == ("swa", "swa")
    assert set(kinds[2::2]) == {"c4"} and set(kinds[3::2]) == {"c128"}
    assert kinds.count("c4") == 21 and kinds.count("c128") == 20
    p = fam.pools
    assert p["index_k"].layers == p["c4"].layers == fam.layers_of("c4")
    assert p["c128"].layers == fam.layers_of("c128") and p["swa"].layers == tuple(range(43))
    assert (p["c4"].layout(1).page_bytes, p["index_k"].layout(1).page_bytes, p["c128"].layout(1).page_bytes) \
        == (37440, 8448, 1728)
    assert p["index_k"].bytes_per_token == 33.0                     # 132 B per 4-token entry
    bf16 = fam.pools_for(resolve_options({"index_k_dtype": "bf16"}))["index_k"]
    assert bf16.layout(4).page_bytes == 256 and bf16.bytes_per_token == 64.0   # twice the fp8 bytes
    assert p["c4"].pool_layer(2) == 0 and p["c4"].pool_layer(42) == 20 and p["c128"].pool_layer(3) == 0
    with pytest.raises(InputError, match="c128"):
        p["c128"].pool_layer(2)


def test_dsa_layers_and_pools():
    fam = model("dsa-v3.2")
    assert fam.n_layers == 61 and set(fam.layer_kinds) == {"dsa"}
    assert fam.pools["latent"].bytes_per_token == 656 and fam.pools["index_k"].bytes_per_token == 132
    assert fam.pools["index_k"].layout(1).page_bytes == 8448
    with pytest.raises(InputError, match="bf16"):
        fam.pools_for({"index_k_dtype": "bf16"})
    with pytest.raises(InputError, match="options.index_k_store"):
        resolve_options({"index_k_store": "fast"})


# ---------------------------------------------------------------- order and gates

def test_dsa_extend_ungated_map_reads_index_k_before_the_layer_wait():
    # 0.5.10, CUDA ragged path, fallback store: the top-k read is the layer's first access
    issue, _ = issue_only("dsa-v3.2", "upstream-0.5.10", "extend", 0)
    for layer in range(61):
        r_ik = position(issue, "read", layer, "_get_topk_ragged.index_k")
        w = position(issue, "wait", layer)
        r_lat = position(issue, "read", layer, "forward_extend.latent")
        assert r_ik is not None and w is not None and r_lat is not None
        assert r_ik < w < r_lat
    exposed = issue.exposed_reads
    assert len(exposed) == 61 and {(r.reader, r.role) for r in exposed} == {("_get_topk_ragged", "index_k")}


def test_dsa_extend_gated_map_waits_before_every_read():
    issue, _ = issue_only("dsa-v3.2", "upstream-0.5.11", "extend", 0)
    for layer in range(61):
        w = position(issue, "wait", layer)
        assert w is not None
        assert all(position(issue, "read", layer, c) > w for c in ("index_k", "latent"))
    assert all(r.waited for r in issue.reads) and issue.exposed_reads == []


def test_fused_store_gate_precedes_the_ungated_topk_read_in_0510():
    # nsa_indexer.py: the fused JIT store fetches the buffer through the gated getter first
    issue, _ = issue_only("dsa-v3.2", "upstream-0.5.10", "extend", 0, options={"index_k_store": "fused"})
    for layer in (0, 30, 60):
        assert position(issue, "wait", layer) < position(issue, "read", layer, "index_k")


@pytest.mark.parametrize("gm", ["upstream-0.5.10", "upstream-0.5.11"])
def test_decode_batches_issue_no_waits(gm):
    issue, _ = issue_only("dsa-v3.2", gm, "decode", -1)
    assert not [o for o in issue.ops if o[0] == "wait"]
    readers = {r.reader for r in issue.reads}
    assert readers == {"_get_topk_paged", "forward_decode"}


def test_extend_without_a_load_issues_no_waits():
    issue, _ = issue_only("deepseek-v4-flash", "upstream-0.5.11", "extend", -1)
    assert not [o for o in issue.ops if o[0] == "wait"]


def test_v4_flash_layer_reads_in_model_order():
    issue, _ = issue_only("deepseek-v4-flash", "upstream-0.5.11", "extend", 0)
    fam = model("deepseek-v4-flash")
    for layer, kind in enumerate(fam.layer_kinds):
        roles = [r.role for r in issue.reads if r.layer == layer]
        expected = {"swa": ["swa"], "c4": ["index_k", "swa", "c4"], "c128": ["swa", "c128"]}[kind]
        assert roles == expected, (layer, kind)
        assert position(issue, "wait", layer) < min(k for k, o in enumerate(issue.ops)
                                                   if o[0] == "read" and o[2] == layer)


def test_v4_bf16_index_k_uses_the_fork_reader_and_its_gate():
    opts = {"index_k_dtype": "bf16"}
    issue, buffers = issue_only("deepseek-v4-flash", "incident-fork", "extend", 0, options=opts)
    assert buffers["index_k"][1].page_bytes == 256
    ik = [r for r in issue.reads if r.role == "index_k"]
    assert ik and {r.reader for r in ik} == {"forward_c4_indexer_bf16"} and all(r.waited for r in ik)
    ungated = gate_map("incident-fork").override({"get_index_k_bf16_buffer": False})
    issue, _ = issue_only("deepseek-v4-flash", "", "extend", 0, options=opts, gate=ungated)
    # NOTE: 0.5.14's order: forward_indexer_compressor fetches the indexer's compress state
    # through the gated get_indexer_compress_states before the index-K read, on the same
    # stream, so ungating only the index-K getter leaves the layer's wait in front of it
    ik = [r for r in issue.reads if r.role == "index_k"]
    assert ik and all(position(issue, "wait", r.layer) < position(issue, "read", r.layer, "index_k") for r in ik)
    both = ungated.override({"get_indexer_compress_states": False})
    issue, _ = issue_only("deepseek-v4-flash", "", "extend", 0, options=opts, gate=both)
    assert all(position(issue, "read", r.layer, "index_k") < position(issue, "wait", r.layer)
               for r in issue.reads if r.role == "index_k")


def test_upstream_map_refuses_the_fork_only_accessor():
    with pytest.raises(InputError, match="get_index_k_bf16_buffer"):
        issue_only("deepseek-v4-flash", "upstream-0.5.11", "extend", 0, options={"index_k_dtype": "bf16"})


def test_consumer_without_layer_events_is_refused():
    fam, _, buffers, _ = world("dsa-v3.2", 2)
    with pytest.raises(InputError, match="layer_events"):
        issue_forward(RecordingHost(), "forward", make_batch(buffers, "extend", 0, range(2)), model=fam,
                      gate_map=gate_map("upstream-0.5.11"), buffers=buffers, cost=COST, layer_events=None)


def test_bad_buffers_and_slots_are_refused_naming_the_key():
    fam, _, buffers, _ = world("deepseek-v4-flash", 2)
    ok = make_batch(buffers, "decode", -1, range(2))
    kw = dict(model=fam, gate_map=gate_map("upstream-0.5.11"), cost=COST)
    with pytest.raises(InputError, match="buffers.latent"):
        issue_forward(RecordingHost(), "forward", ok, buffers={**buffers, "latent": buffers["swa"]}, **kw)
    with pytest.raises(InputError, match="buffers.c4"):
        issue_forward(RecordingHost(), "forward", ok, buffers={**buffers, "c4": buffers["swa"]}, **kw)
    over = ForwardBatch("decode", (BatchRequest(1, {"c128": np.array([0, 4])}, 1, 300),))
    with pytest.raises(InputError, match=r"requests\[0\]\.slots\.c128"):
        issue_forward(RecordingHost(), "forward", over, buffers=buffers, **kw)


def test_v4_reads_the_swa_window_only_and_every_compressed_entry():
    """SGLang's V4 backend gives each query token the ``SWA_WINDOW`` (128) positions ending
    at it, so an extend of 10 tokens after 490 reads SWA entries 363..499 (10 + 127) and a
    decode step the last 128; the compressed pools are read whole, and a context shorter than
    the window is read whole."""
    fam = model("deepseek-v4-flash")
    pools = fam.pools_for(resolve_options(None))
    assert fam.dims.window == 128 and pools["swa"].windowed and not pools["c4"].windowed
    buffers = {role: (f"dev_{role}", pools[role].layout(1200)) for role in ("swa", "c4")}
    swa = np.arange(600, 1100, dtype=np.int64)            # the request's 500 tokens' SWA slots
    c4 = np.arange(125, dtype=np.int64)
    for mode, new, first in (("extend", 10, 363), ("decode", 1, 372), ("extend", 500, 0)):
        b = ForwardBatch(mode, (BatchRequest(7, {"swa": swa, "c4": c4}, new, 500),))
        issue = issue_forward(RecordingHost(), "forward", b, model=fam, gate_map=gate_map("upstream-0.5.11"),
                              buffers=buffers, cost=COST)
        for r in issue.reads:
            lay = buffers[r.role][1]
            want, want_first = (swa[first:], first) if r.role == "swa" else (c4, 0)
            assert r.entries[7].tolist() == want.tolist(), (mode, r.op_id)
            assert r.first.get(7, 0) == want_first and (7 in r.first) == (want_first > 0)
            starts, lens = read_ranges(lay, r.pool_layers[0], want)
            assert r.starts.tolist() == starts.tolist() and r.lengths.tolist() == lens.tolist()
    with pytest.raises(InputError, match="tokens_per_entry 1"):
        PoolSpec("c4", (0,), 37440, 64, 4, windowed=True)


def test_reads_cover_exactly_the_field_bytes_of_the_slots():
    fam = model("deepseek-v4-flash")
    lay = fam.pools["c4"].layout(8)
    starts, lens = read_ranges(lay, 3, np.array([64 * 2 + 5, 64 * 2 + 6]))
    # two adjacent entries: their values touch (one extent), their scales touch (another)
    assert lens.tolist() == [2 * 576, 2 * 8]
    assert starts[0] == 3 * lay.layer_bytes + 2 * lay.page_bytes + 5 * 576
    # a whole index-K page has no padding: consecutive pages coalesce into one range
    ik = fam.pools["index_k"].layout(8)
    s2, l2 = read_ranges(ik, 0, np.arange(64 * 2, 64 * 5))
    assert l2.tolist() == [3 * 8448]


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(1, 40)), min_size=1, max_size=30))
@settings(max_examples=60, deadline=None)
def test_coalesce_keeps_exactly_the_covered_bytes(ext):
    o = np.array([e[0] for e in ext]); n = np.array([e[1] for e in ext])
    s, l = coalesce(o, n)
    covered = np.zeros(600, bool)
    for a, b in ext:
        covered[a:a + b] = True
    got = np.zeros(600, bool)
    for a, b in zip(s, l):
        assert not got[a:a + b].any()
        got[a:a + b] = True
    assert (got == covered).all()
    assert (s[1:] > (s + l)[:-1]).all()           # sorted, and touching extents are joined


# ---------------------------------------------------------------- races end to end

def _index_k_races(run):
    rep = analyse(run)
    by = {}
    for race in rep["latent_races"]:
        ops = race["ops"] if "ops" in race else None
        by.setdefault(race["buffer"], []).append(race)
    return rep, by


@pytest.mark.slow
def test_0510_map_races_index_k_with_the_load_and_0511_does_not():
    run10, _, _, _ = run_forward("dsa-v3.2", "upstream-0.5.10", "extend", 0)
    rep10, by10 = _index_k_races(run10)
    run11, _, _, _ = run_forward("dsa-v3.2", "upstream-0.5.11", "extend", 0)
    rep11, by11 = _index_k_races(run11)
    assert len(by10.get("dev_index_k", [])) == 61        # one per layer: the load copy vs the top-k read
    assert "dev_latent" not in by10                      # the latent reader waits
    assert rep11["latent_races_total"] == 0


def test_0510_race_manifests_on_the_first_layer_and_the_topk_tells_it():
    run, issue, buffers, _ = run_forward("dsa-v3.2", "upstream-0.5.10", "extend", 0)
    rep = analyse(run)
    status = {r["op"] if "op" in r else r["id"]: r["status"] for r in rep["reads"]}
    first = issue.reads[0]
    assert first.role == "index_k" and first.layer == 0
    assert status[first.op_id] in ("stale", "torn")
    # a latent race per layer: the load copy vs the top-k read; the latent reader waits
    idx = [r for r in rep["latent_races"] if r["buffer"] == "dev_index_k"]
    assert len(idx) == 61 and not [r for r in rep["latent_races"] if r["buffer"] == "dev_latent"]
    # right bytes: the happens-before-order execution
    ref = run_reference(run.schedule, materialise=False)
    seen = next(r for r in run.reads if r.op_id == first.op_id).bytes()
    right = next(r for r in ref.reads if r.op_id == first.op_id).bytes()
    lay = buffers["index_k"][1]
    ent = first.entries[7]
    ks, kr = (entry_bytes(x, first, lay, ent, field_name="key") for x in (seen, right))
    v = topk_verdict(ks, kr, k=32)
    assert v.differing == ent.size and v.changed


# ---------------------------------------------------------------- one step

def _by_role(issue, run):
    got = {r.op_id: r.bytes() for r in run.reads}
    out = {}
    for info in issue.reads:
        out.setdefault(info.role, []).append(got[info.op_id])
    return {k: np.concatenate(v) for k, v in out.items()}


@pytest.mark.parametrize("model_name,mode,load", [
    ("dsa-v3.2", "decode", False), ("deepseek-v4-flash", "extend", True),
    pytest.param("deepseek-v4-flash", "decode", True, marks=pytest.mark.slow),
    pytest.param("dsa-v3.2", "extend", True, marks=pytest.mark.slow)])
def test_one_step_equals_per_layer(model_name, mode, load):
    runs = {}
    for one in (False, True):
        run, issue, _, out = run_forward(model_name, "upstream-0.5.11", mode, -1, sync_first=True, load=load,
                                         one_step=one, prof=profile(jitter_frac=0.0))
        assert out["in_flight"] == []
        runs[one] = (run, issue, analyse(run))
    (r0, i0, a0), (r1, i1, a1) = runs[False], runs[True]
    b0, b1 = _by_role(i0, r0), _by_role(i1, r1)
    assert b0.keys() == b1.keys()
    for role in b0:
        assert np.array_equal(b0[role], b1[role]), role
    for name in r0.schedule.buffers:
        assert r0.memory.digest(name) == r1.memory.digest(name)
    for key in ("stale_reads", "torn_reads", "latent_races_total", "oob_writes"):
        assert a0[key] == a1[key] == (0 if key != "oob_writes" else a0[key])
    assert i1.compute_us == pytest.approx(i0.compute_us, rel=1e-12)
    assert r1.end_us == pytest.approx(r0.end_us, rel=1e-9)
    assert len(i1.ops) < len(i0.ops) / 10


def test_one_step_is_refused_for_a_batch_that_waits():
    fam, _, buffers, _ = world("dsa-v3.2", 2)
    with pytest.raises(InputError, match="one_step"):
        issue_forward(RecordingHost(), "forward", make_batch(buffers, "extend", 0, range(2)), model=fam,
                      gate_map=gate_map("upstream-0.5.11"), buffers=buffers, cost=COST,
                      layer_events=events_of(fam), one_step=True)


def test_copies_in_flight_sees_the_load_until_it_lands():
    fam, pools, buffers, header = world("dsa-v3.2", 2)
    seen = {}
    b = make_batch(buffers, "decode", -1, range(2))

    def program(h):
        seen["before"] = can_advance_in_one_step(h, b, buffers)
        issue_load(h, fam, pools, buffers, range(2))
        seen["can"] = can_advance_in_one_step(h, b, buffers)
        seen["during"] = copies_in_flight(h, ["dev_index_k"])
        seen["other"] = copies_in_flight(h, ["no_such_buffer"])
        yield h.synchronize()
        seen["after"] = copies_in_flight(h, ["dev_index_k", "dev_latent"])
        seen["can_after"] = can_advance_in_one_step(h, b, buffers)
    run_programs(header, {"host": program}, profile(), materialise=False)
    assert seen["before"] and not seen["can"] and seen["can_after"]
    assert len(seen["during"]) == 61 and all(".index_k." in c for c in seen["during"])
    assert seen["other"] == [] and seen["after"] == []


# ---------------------------------------------------------------- top-k

def test_stand_in_scores_depend_only_on_the_bytes_and_the_query():
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 256, (16, 128), dtype=np.uint8)
    assert np.array_equal(stand_in_scores(keys, 3), stand_in_scores(keys.copy(), 3))
    assert not np.array_equal(stand_in_scores(keys, 3), stand_in_scores(keys, 4))
    k2 = keys.copy(); k2[5, 0] ^= 1
    s1, s2 = stand_in_scores(keys, 3), stand_in_scores(k2, 3)
    assert s1[5] != s2[5] and np.array_equal(np.delete(s1, 5), np.delete(s2, 5))


def test_topk_tells_a_selection_changing_stale_read_from_a_harmless_one():
    rng = np.random.default_rng(2)
    right = rng.integers(0, 256, (32, 128), dtype=np.uint8)
    k = 8
    sel = indexer_topk(right, k)
    outside = next(i for i in range(32) if i not in sel)
    harmless = changing = None
    for trial in range(200):                   # stale bytes: another owner's pattern row
        seen = right.copy()
        seen[outside] = rng.integers(0, 256, 128, dtype=np.uint8)
        v = topk_verdict(seen, right, k)
        assert v.differing == 1 and v.right.tolist() == sel.tolist()
        if v.changed and changing is None:
            changing = v
        if not v.changed and harmless is None:
            harmless = v
    assert harmless is not None and changing is not None
    assert changing.selected_differing == 1 and harmless.selected_differing == 0
    assert not topk_verdict(right, right, k).changed


@pytest.mark.slow
@given(data=st.data())
@settings(max_examples=6, deadline=None)
def test_one_step_equals_per_layer_for_random_batches(data):
    """Property: any batch with no copy in flight gives the same bytes per pool, the same final
    buffers, the same verdict counts and the same end time in both modes; entry_bytes finds
    each request's entries in both reads alike."""
    name = data.draw(st.sampled_from(["dsa-v3.2", "deepseek-v4-flash"]))
    mode = data.draw(st.sampled_from(["extend", "decode"]))
    pages = 6
    fam, pools, buffers, header = world(name, pages)
    reqs = []
    for rid in range(data.draw(st.integers(1, 3))):
        slots = {}
        for role, (_, lay) in buffers.items():
            ent = data.draw(st.lists(st.integers(0, lay.tokens - 1), max_size=40, unique=True))
            if ent:
                slots[role] = np.array(ent, np.int64)
        ctx = data.draw(st.integers(1, 5000))
        reqs.append(BatchRequest(rid, slots, ctx if mode == "extend" else 1, ctx))
    b = ForwardBatch(mode, tuple(reqs), -1)
    loaded = data.draw(st.lists(st.integers(0, pages - 1), max_size=pages, unique=True))
    results = {}
    for one in (False, True):
        out = {}

        def program(h):
            if loaded:
                issue_load(h, fam, pools, buffers, loaded)
                yield h.synchronize()
            out["issue"] = issue_forward(h, "forward", b, model=fam, gate_map=gate_map("upstream-0.5.11"),
                                         buffers=buffers, cost=COST, one_step=one)
            yield h.synchronize()
        run = run_programs(header, {"host": program}, profile(), materialise=False)
        results[one] = (run, out["issue"], analyse(run))
    (r0, i0, a0), (r1, i1, a1) = results[False], results[True]
    b0, b1 = _by_role(i0, r0), _by_role(i1, r1)
    assert b0.keys() == b1.keys()
    for role in b0:
        assert np.array_equal(b0[role], b1[role])
    for bname in r0.schedule.buffers:
        assert r0.memory.digest(bname) == r1.memory.digest(bname)
    for key in ("stale_reads", "torn_reads", "latent_races_total"):
        assert a0[key] == a1[key]
    assert r1.end_us == pytest.approx(r0.end_us, rel=1e-9)
    got0 = {r.op_id: r.bytes() for r in r0.reads}
    got1 = {r.op_id: r.bytes() for r in r1.reads}
    one_step = {info.role: info for info in i1.reads}
    for info in i0.reads:
        lay = buffers[info.role][1]
        for rid, ent in info.entries.items():
            x = entry_bytes(got0[info.op_id], info, lay, ent)
            y = entry_bytes(got1[one_step[info.role].op_id], one_step[info.role], lay, ent,
                            pool_layer=info.pool_layers[0])
            assert np.array_equal(x, y)
