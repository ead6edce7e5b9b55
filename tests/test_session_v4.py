"""``CacheSession(model="deepseek-v4")``: DeepSeek V4-Flash's device pools (SWA, C4 latent, C4
indexer index-K, C128 latent), SGLang 0.5.14's V4 HiCache stack (``build_deepseek_v4_hicache_stack``:
a logical anchor and one ``DeepSeekV4PagedHostPool`` per pool), the per-layer loads, the branch
counters, the full-slot -> entry mapping, and the recorded run's static re-run."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.cache import CacheSession, ProducerSlotBusy
from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.engine.models import model as model_family
from sim.errors import InputError
from sim.executor import run_schedule
from sim.pools.device import deepseek_v4_flash_ratios
from sim.pools.host import deepseek_v4_num_host_pages
from sim.profile import load_profile
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.verdicts import analyse

V4 = {"model": "deepseek-v4", "page_size": 256, "layers": 5, "device_tokens": 1024, "layout": "layer_first",
      "materialise": False}
SWA, C4, IX, C128 = "swa_kv_buffer", "c4_kv_buffer", "c4_indexer_index_k_with_scale_buffer", "c128_kv_buffer"


def same_snapshot(a, b) -> None:
    assert a.schedule_digest == b.schedule_digest
    assert a.buffers == b.buffers
    assert a.timings_us == b.timings_us
    assert a.reads.keys() == b.reads.keys()
    for k in a.reads:
        assert (a.reads[k] == b.reads[k]).all(), k


def rerun(s: CacheSession):
    return run_schedule(validate(json.loads(json.dumps(s.record()))), load_profile(s.config.profile))


def cached_then_evicted(s: CacheSession, owner: int, pages: int = 1, base: int = 1000):
    """Request ``owner`` prefills ``pages`` full pages, the tree backs them up (write_through),
    the ack is processed, then the device copy is evicted.  Returns (key, device slots)."""
    n = pages * 256
    slots = s.allocator.alloc(n)
    s.store_kv(slots, owner=owner)
    key = RadixKey(np.arange(base, base + n))
    s.cache.insert(InsertParams(key, slots))
    s.wait_idle()
    s.cache.check_hicache_events()
    assert s.cache.evict(EvictParams(n)).num_tokens_evicted == n
    return key, slots


def recount_branches(s: CacheSession) -> dict:
    """{role: {routine: n}} counted from the recorded copies (as the engine's metric does)."""
    out: dict = {}
    for d in s.record()["ops"]:
        if d["op"] == "copy":
            role = s.roles.get(d["dst"]) or s.roles.get(d["src"])
            out.setdefault(role, {}).setdefault(d["routine"], 0)
            out[role][d["routine"]] += 1
    return {r: dict(sorted(v.items())) for r, v in sorted(out.items())}


def test_dsa_branch_counters_are_the_recorded_copies_per_role():
    s = CacheSession(model="dsa", page_size=64, layers=2, device_tokens=256, materialise=False)
    slots = s.allocator.alloc(128)
    s.store_kv(slots, owner=1)
    key = RadixKey(np.arange(128))
    s.cache.insert(InsertParams(key, slots))
    s.wait_idle()
    s.cache.check_hicache_events()
    s.cache.evict(EvictParams(128))
    m = s.cache.match_prefix(MatchPrefixParams(key))
    s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    s.cache.ready_to_load_host_cache()
    assert s.branches == recount_branches(s) == {
        "index_k": {"dsa_indexer_per_layer": 2, "staged_all_layer_lf_pf": 1},
        "latent": {"kernel_per_layer": 2, "staged_all_layer_lf_pf": 1}}


def load_back(s: CacheSession, key):
    m = s.cache.match_prefix(MatchPrefixParams(key))
    slots, _ = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    return slots, s.cache.ready_to_load_host_cache()


# ---------------------------------------------------------------- config and pools

@pytest.mark.parametrize("bad, where, expected", [
    ({"page_size": 64}, "config.page_size", "256 for model 'deepseek-v4'"),
    ({"layers": 2}, "config.layers", "3..43"),
    ({"layers": 44}, "config.layers", "3..43"),
    ({"device_tokens": 1000}, "config.device_tokens", "multiple of page_size"),
    ({"hicache_size": 4.0}, "config.hicache_size", "--hicache-size"),
    ({"index_k_dtype": "fp16"}, "config.index_k_dtype", "'fp8' or 'bf16'"),
])
def test_v4_config_errors_name_the_key(bad, where, expected):
    with pytest.raises(InputError) as e:
        CacheSession({**V4, **bad})
    assert e.value.where == where and expected in e.value.message


def test_bf16_index_k_is_the_v4_forks_only():
    with pytest.raises(InputError) as e:
        CacheSession(model="dsa", page_size=64, layers=2, device_tokens=128, index_k_dtype="bf16")
    assert e.value.where == "config.index_k_dtype" and "deepseek-v4" in e.value.message


def test_layers_follow_the_v4_flash_layer_kinds():
    fam = model_family("deepseek-v4-flash")
    kinds = {"swa": 0, "c4": 4, "c128": 128}
    assert deepseek_v4_flash_ratios() == [kinds[k] for k in fam.layer_kinds]
    s = CacheSession(V4)                                   # layers 0-4: swa swa c4 c128 c4
    dp = s.device_pool
    assert s.roles == {SWA: "swa", C4: "c4", IX: "index_k", C128: "c128"}
    assert {n: dp.model_layers_of(n) for n in dp.layouts} == {SWA: [0, 1, 2, 3, 4], C4: [2, 4], IX: [2, 4],
                                                              C128: [3]}
    for name in dp.layouts:                                 # the engine's pool role per layer matches the family
        spec = fam.pools[s.roles[name]]
        assert dp.model_layers_of(name) == [x for x in spec.layers if x < 5]
    lays = dp.layouts
    assert (lays[C4].page_bytes, lays[C4].entries_per_page) == (37440, 64)
    assert (lays[IX].page_bytes, lays[IX].entries_per_page) == (8448, 64)
    assert (lays[C128].page_bytes, lays[C128].entries_per_page) == (1728, 2)
    assert (lays[SWA].page_bytes, lays[SWA].entries_per_page) == (149760, 256)    # 256 x 584 B padded to 576 B
    assert [lays[n].layers for n in (SWA, C4, IX, C128)] == [5, 2, 2, 1]
    assert all(lay.pages == 1024 // 256 + 1 for lay in lays.values())             # page row p = full page p
    b = CacheSession({**V4, "index_k_dtype": "bf16"})
    ix = b.device_pool.layouts[IX]
    assert (ix.page_bytes, ix.entries_per_page) == (64 * 256, 64) and b.device_pool.kind_of(IX) == "index_k_bf16"
    assert b.device_pool.role_of(IX) == "index_k"
    # no C128 pool without a C128 layer
    assert set(CacheSession({**V4, "layers": 3}).roles.values()) == {"swa", "c4", "index_k"}


def test_v4_host_stack_is_sglangs_sizing_and_entry_order():
    s = CacheSession({**V4, "hicache_ratio": 1.5})
    g = s.host_pool
    pages = deepseek_v4_num_host_pages(1024, 256, 1.5)
    assert pages == max(int(4 * 1.5), 4 + 1) == 6
    assert [e.name for e in g.entries] == ["kv", "swa", "deepseek_v4_c4", "deepseek_v4_c4_indexer",
                                           "deepseek_v4_c128"]
    assert g.size == pages * 256 and g.anchor_entry.host_pool.buffers() == []
    for e in g.entries[1:]:
        hp = e.host_pool
        assert (hp.num_host_pages, hp.slot_page_size, hp.item_bytes) == (pages, 256, hp.device_layout.page_bytes)
    assert [c4_layer for c4_layer in map(g.entry_map["deepseek_v4_c4"].layer_mapper, range(5))] == \
        [None, None, 0, None, 1]


def test_entries_of_maps_full_slots_to_each_pools_entries():
    s = CacheSession(V4)
    slots = np.arange(256, 512)
    assert s.entries_of(SWA, slots).tolist() == slots.tolist()
    assert s.entries_of(C4, slots).tolist() == list(range(64, 128))
    assert s.entries_of(IX, slots).tolist() == list(range(64, 128))
    assert s.entries_of(C128, slots).tolist() == [2, 3]
    # a group of r raw tokens has its entry once its last slot is there
    assert s.entries_of(C4, np.arange(256, 262)).tolist() == [64]
    assert s.entries_of(C128, np.arange(256, 300)).tolist() == []
    # the C4 entries of full page p are C4 page row p
    lay = s.device_pool.layouts[C4]
    assert set((s.entries_of(C4, slots) // lay.entries_per_page).tolist()) == {1}
    with pytest.raises(InputError) as e:
        s.entries_of("kv_buffer", slots)
    assert e.value.where == "buffer"


# ---------------------------------------------------------------- a load-back

@pytest.mark.parametrize("layout, backend, load_routine, backup_routine", [
    ("layer_first", "kernel", "kernel_per_layer", "kernel_all_layer"),
    ("page_first", "kernel", "kernel_per_layer", "staged_all_layer_lf_pf"),
    ("page_first_direct", "direct", "direct_page_first", "direct_page_first"),
])
def test_v4_load_back_copies_every_pool_of_a_layer_before_its_event(layout, backend, load_routine, backup_routine):
    s = CacheSession({**V4, "layout": layout, "io_backend": backend})
    key, _ = cached_then_evicted(s, owner=12)
    slots, pid = load_back(s, key)
    assert pid == 0 and len(slots) == 256
    ops = [d for d in s.record()["ops"] if d.get("stream") == "load" and d["op"] in ("copy", "record")]
    per_layer, cur = [], []
    for d in ops:
        if d["op"] == "copy":
            cur.append((d["dst"], d["routine"], d["args"]["layer"]))
        elif d["event"].startswith("hicache.load0.L"):
            per_layer.append(cur)
            cur = []
    r = load_routine
    assert per_layer == [
        [(SWA, r, 0)], [(SWA, r, 1)], [(SWA, r, 2), (C4, r, 0), (IX, r, 0)], [(SWA, r, 3), (C128, r, 0)],
        [(SWA, r, 4), (C4, r, 1), (IX, r, 1)]]
    s.wait_idle()
    page = [int(slots[0]) // 256]
    for name in s.device_pool.layouts:
        for layer in range(s.device_pool.layouts[name].layers):
            assert s.owners_of(name, layer, page) == [12], (name, layer)
    n_backups = {"kernel_all_layer": 1, "staged_all_layer_lf_pf": 1, "direct_page_first": None}[backup_routine]
    layers = {"swa": 5, "c4": 2, "index_k": 2, "c128": 1}
    expect = {}
    for role, n in layers.items():
        backups = n_backups if n_backups is not None else n          # the direct backup: one copy per layer
        expect[role] = ({load_routine: n + backups} if load_routine == backup_routine
                        else {load_routine: n, backup_routine: backups})
    assert s.branches == expect
    run = s.finish()
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s)))


def test_v4_gated_reads_see_the_prefix_and_an_ungated_index_k_read_races_the_load():
    s = CacheSession(V4)
    key, _ = cached_then_evicted(s, owner=7)
    other = s.allocator.alloc(256)                          # the freed page, reused and released again
    s.store_kv(other, owner=99)
    s.allocator.free(other)
    slots, pid = load_back(s, key)
    assert slots.tolist() == other.tolist()
    ent = s.entries_of(IX, slots)
    page = np.unique(ent // 64)
    s.read(IX, 1, page, id="topk_ungated")                  # compress layer 1 = model layer 4
    s.read(IX, 1, page, gate=pid, id="topk_gated")
    s.read(C4, 1, page, gate=pid, id="core_c4")
    s.read(SWA, 4, page, gate=pid, id="core_swa")
    s.wait_idle()
    assert s.owners_of(IX, 1, page) == [7]
    runs = s.bytes_of(IX, 1, page)[0]
    assert len(runs) == 1 and runs[0]["origin"]["kind"] == "c4_indexer"
    s.cache.check_hicache_events()
    run = s.finish()
    rep = analyse(run)
    status = {r["op"]: r["status"] for r in rep["reads"]}
    assert status == {"topk_ungated": "stale", "topk_gated": "ok", "core_c4": "ok", "core_swa": "ok"}
    assert any("topk_ungated" in r["ops"] for r in rep["latent_races"])
    # the gated read of the C4 buffer's compress layer 1 waited on model layer 4's event
    waits = [d for d in s.record()["ops"] if d["op"] == "wait" and d.get("stream") == "forward"]
    assert {d["event"] for d in waits} == {"hicache.load0.L4"}
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s)))


def test_store_kv_writes_each_pool_on_its_own_layers_and_entries():
    s = CacheSession(V4)
    slots = s.allocator.alloc(256)
    ids = s.store_kv(slots[:130], owner=3, layers=[3, 4])
    writes = [d for d in s.record()["ops"] if d["op"] == "write"]
    assert [(d["buffer"], d.get("layer", d.get("layers"))) for d in writes] == \
        [(SWA, [3, 4]), (C4, 1), (IX, 1), (C128, 0)]
    assert len(ids) == 4 and all(d["units"] == [int(slots[0]) // 256] for d in writes)
    # the launch merged away (SWA's second layer) is one compute on the forward stream
    computes = [d for d in s.record()["ops"] if d["op"] == "compute"]
    assert [d["duration_us"] for d in computes] == [s.host.profile.kernel_launch_us]
    # slots completing no C128 entry: no C128 write at all
    s.store_kv(slots[:100], owner=4, layers=[3])
    assert [d["buffer"] for d in s.record()["ops"] if d["op"] == "write"][4:] == [SWA]


def test_v4_bf16_index_k_pages_round_trip():
    s = CacheSession({**V4, "index_k_dtype": "bf16", "materialise": True})     # real bytes too
    key, _ = cached_then_evicted(s, owner=5)
    slots, pid = load_back(s, key)
    s.wait_idle()
    page = [int(slots[0]) // 256]
    assert s.owners_of(IX, 0, page) == [5] and s.owners_of(IX, 1, page) == [5]
    assert s.branches["index_k"] == {"kernel_all_layer": 1, "kernel_per_layer": 2}
    run = s.finish()
    assert run.oob == [] and run.memory.material is not None
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s)))


# ---------------------------------------------------------------- any sequence re-runs

_KEYS = [np.arange(k * 10_000, k * 10_000 + 256 * n) for k, n in ((1, 1), (2, 2), (3, 1))]
_step = st.one_of(
    st.tuples(st.just("prefill"), st.integers(0, len(_KEYS) - 1), st.integers(1, 50)),
    st.tuples(st.just("offload"),),
    st.tuples(st.just("load_back"), st.integers(0, len(_KEYS) - 1), st.booleans()),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 20.0])),
    st.tuples(st.just("check"),),
    st.tuples(st.just("evict_host"), st.just(256)),
)


def _drive(s: CacheSession, steps) -> None:
    for step in steps:
        kind = step[0]
        if kind == "prefill":
            key = RadixKey(_KEYS[step[1]])
            slots = s.allocator.alloc(len(key))
            if slots is None:
                s.cache.evict(EvictParams(len(key)))
                slots = s.allocator.alloc(len(key))
            if slots is None:
                continue
            s.store_kv(slots, owner=step[2])
            r = s.cache.insert(InsertParams(key, slots))
            if r.prefix_len:
                s.allocator.free(slots[:r.prefix_len])
        elif kind == "offload":
            s.wait_idle()
            s.cache.check_hicache_events()
            s.cache.evict(EvictParams(s.config.device_tokens))
        elif kind == "load_back":
            m = s.cache.match_prefix(MatchPrefixParams(RadixKey(_KEYS[step[1]])))
            if m.host_hit_length == 0:
                continue
            s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
            try:
                pid = s.cache.ready_to_load_host_cache()
            except ProducerSlotBusy:
                continue
            if pid >= 0 and step[2]:
                page = np.unique(m.best_match_node.value // 256)
                s.read(IX, 0, page, gate=pid)
                s.read(C128, 0, page, gate=pid)
        elif kind == "advance":
            s.advance(step[1])
        elif kind == "check":
            s.cache.check_hicache_events()
        else:
            s.cache.evict_host(step[1])


_LIO = st.sampled_from([("layer_first", "kernel"), ("page_first", "kernel"), ("page_first_direct", "direct")])
_POLICY = st.sampled_from(["write_through", "write_back"])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_LIO, _POLICY, st.lists(_step, min_size=1, max_size=8))
def test_any_v4_cache_sequence_reruns_from_its_record_to_the_same_snapshot(lio, policy, steps):
    _v4_sequence_reruns(lio, policy, steps)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_LIO, _POLICY, st.lists(_step, min_size=1, max_size=30))
def test_any_v4_cache_sequence_reruns_from_its_record_deep(lio, policy, steps):
    _v4_sequence_reruns(lio, policy, steps)


def _v4_sequence_reruns(lio, policy, steps) -> None:
    s = CacheSession({**V4, "layers": 4, "layout": lio[0], "io_backend": lio[1], "write_policy": policy,
                      "materialise": False})
    _drive(s, steps)
    run = s.finish()
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s)))
    assert s.branches == recount_branches(s)
    assert all(r["status"] == "ok" for r in analyse(run)["reads"])       # every read was gated
    assert run.oob == []
