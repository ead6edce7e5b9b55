"""The incident's controller switches as ``CacheSession`` keys (docs/hicache.md, "Controller
switches"; docs/engine.md's hypothesis table): each changes the bytes or the branch counts in
one case, and its default leaves SGLang's behaviour in another."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sim.cache import CacheSession
from sim.cache.controller import ROUTINE_BRANCHES, CacheOperation
from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.errors import InputError
from sim.executor import run_schedule
from sim.profile import load_profile
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.verdicts import analyse

V4 = {"model": "deepseek-v4", "page_size": 256, "layers": 3, "device_tokens": 1024, "layout": "layer_first",
      "materialise": False}
DSA = {"model": "dsa", "page_size": 64, "layers": 2, "device_tokens": 256, "layout": "layer_first",
       "materialise": False}
MLA = {"layers": 2, "device_tokens": 24, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "hicache_ratio": 1.0, "load_back_threshold": 1,
       "layout": "layer_first"}
IX = "c4_indexer_index_k_with_scale_buffer"


def same_rerun(s: CacheSession, run) -> None:
    again = run_schedule(validate(json.loads(json.dumps(s.record()))), load_profile(s.config.profile))
    a, b = snapshot_of(run), snapshot_of(again)
    assert a.schedule_digest == b.schedule_digest and a.buffers == b.buffers


def prefill(s: CacheSession, owner: int, n: int, base: int):
    slots = s.allocator.alloc(n)
    assert slots is not None
    s.store_kv(slots, owner=owner)
    key = RadixKey(np.arange(base, base + n))
    s.cache.insert(InsertParams(key, slots))
    return key, slots


def offloaded(s: CacheSession, owner: int, n: int, base: int = 1000):
    """Request ``owner``'s ``n`` tokens prefilled, backed up (ack processed), evicted from the device."""
    key, slots = prefill(s, owner, n, base)
    s.wait_idle()
    s.cache.check_hicache_events()
    assert s.cache.evict(EvictParams(n)).num_tokens_evicted == n
    return key, slots


def overwrite(s: CacheSession, owner: int, n: int) -> np.ndarray:
    """Another request takes the freed device slots, writes its KV there and releases them."""
    other = s.allocator.alloc(n)
    s.store_kv(other, owner=owner)
    s.allocator.free(other)
    return other


def load_back(s: CacheSession, key):
    m = s.cache.match_prefix(MatchPrefixParams(key))
    slots, node = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    return slots, node, s.cache.ready_to_load_host_cache()


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("cfg, key, value, models", [
    (DSA, "index_k_partial_pages", "dsv4_token", "['deepseek-v4']"),
    (MLA, "index_k_partial_pages", "dsv4_token", "['deepseek-v4']"),
    (MLA, "index_k_host_bytes_per_entry", 132, "['dsa', 'deepseek-v4']"),
])
def test_a_switch_is_refused_for_a_model_it_does_not_apply_to(cfg, key, value, models):
    with pytest.raises(InputError) as e:
        CacheSession({**cfg, key: value})
    assert e.value.where == f"config.{key}" and models in e.value.message


@pytest.mark.parametrize("cfg, key, value, expected", [
    (DSA, "index_k_host_bytes_per_entry", 256, "0 or 132 for model 'dsa'"),
    (DSA, "backup_pools", ["latent", "c4"], "['latent', 'index_k']"),
    (V4, "backup_pools", ["latent"], "['swa', 'c4', 'index_k', 'c128']"),
    (V4, "index_k_partial_pages", "token", "['dsv4_token', 'page_aligned']"),
    (V4, "host_lock_during_load", 0, "true or false"),
    (V4, "index_k_host_bytes_per_entry", -1, "an integer >= 0"),
    ({**V4, "index_k_dtype": "bf16", "io_backend": "direct"}, "index_k_host_bytes_per_entry", 132,
     "0 or 256 with the direct io backend"),
])
def test_bad_switch_values_name_the_key(cfg, key, value, expected):
    with pytest.raises(InputError) as e:
        CacheSession({**cfg, key: value})
    assert e.value.where == f"config.{key}" and expected in e.value.message


# ---------------------------------------------------------------- index_k_partial_pages

def _partial_load(partial: str, dtype: str = "fp8"):
    """A backed-up page, then a load of its first 100 tokens only (a partial page: the tree
    never hands the controller one at page 256, so the load is queued by hand)."""
    s = CacheSession({**V4, "index_k_partial_pages": partial, "index_k_dtype": dtype})
    key, _ = offloaded(s, owner=4, n=256)
    overwrite(s, owner=44, n=256)
    node = s.cache.match_prefix(MatchPrefixParams(key)).best_match_node
    dev = s.allocator.alloc(256)
    s.controller.load_queue.append(CacheOperation(node.host_value[:100], dev[:100], -1, None, 10_000))
    s.call(s.controller.start_loading)
    s.wait_idle()
    return s, dev


def test_a_partial_index_k_page_is_widened_to_the_page_routine_by_default():
    s, dev = _partial_load("page_aligned")
    loads = [d for d in s.record()["ops"] if d["op"] == "copy" and d.get("stream") == "load"]
    by_dst = {d["dst"]: d for d in loads}
    ix = by_dst[IX]
    assert ix["routine"] == "kernel_per_layer" and ix["args"]["dst_indices"] == [int(dev[0]) // 256]
    # the other V4 pools keep SGLang 0.5.14's token-granular path for a partial transfer
    assert {by_dst[b]["routine"] for b in ("swa_kv_buffer", "c4_kv_buffer")} == {"dsv4_token"}
    assert s.branches["index_k"] == {"kernel_all_layer": 1, "kernel_per_layer": 1}
    assert s.owners_of(IX, 0, [int(dev[0]) // 256]) == [4]       # the whole page came back
    run = s.finish()
    assert [o for o in run.oob if o["buffer"] == IX] == []
    same_rerun(s, run)


def test_dsv4_token_on_the_index_k_buffer_moves_wrong_bytes_out_of_bounds_and_is_reported():
    for dtype in ("fp8", "bf16"):
        s, dev = _partial_load("dsv4_token", dtype)
        assert s.branches["index_k"] == {"dsv4_token": 1, "kernel_all_layer": 1}
        assert ROUTINE_BRANCHES["dsv4_token"] == ("token", "kernel")
        run = s.finish()                          # no crash: the executor clips and reports
        oob = [o for o in run.oob if o["buffer"] == IX]
        assert oob, dtype                         # page = slot >> 6 lands far past the indexer's pages
        assert s.owners_of(IX, 0, [int(dev[0]) // 256]) != [4]
        same_rerun(s, run)


def test_under_the_tree_index_k_never_takes_the_token_path_whatever_the_switch():
    counts = []
    for partial in ("page_aligned", "dsv4_token"):
        s = CacheSession({**V4, "index_k_partial_pages": partial, "index_k_dtype": "bf16"})
        key, _ = offloaded(s, owner=4, n=512)
        load_back(s, key)
        s.wait_idle()
        counts.append(s.branches)
    assert counts[0] == counts[1] and "dsv4_token" not in counts[0]["index_k"]


# ---------------------------------------------------------------- index_k_host_bytes_per_entry

def test_host_index_k_with_132_byte_entries_under_a_bf16_device_tears_the_page():
    owners = {}
    for bpe in (0, 132):
        s = CacheSession({**V4, "index_k_dtype": "bf16", "index_k_host_bytes_per_entry": bpe})
        key, _ = offloaded(s, owner=6, n=256)
        overwrite(s, owner=66, n=256)
        slots, _, _ = load_back(s, key)
        s.wait_idle()
        hp = s.host_pool.get_pool("deepseek_v4_c4_indexer")
        page = int(slots[0]) // 256
        owners[bpe] = (hp.kv_layout.unit_bytes, s.owners_of(IX, 0, [page]),
                       {r["origin"]["owner"] for r in s.bytes_of(IX, 0, [page])[0]})
        ops = [d for d in s.record()["ops"] if d["op"] == "copy" and IX in (d["src"], d["dst"])]
        assert all(d["args"].get("item_bytes") == (8448 if bpe else None) for d in ops)
        same_rerun(s, s.finish())
    assert owners[0] == (16384, [6], {6})
    # the host rows are 8,448 B: only that much of each 16,384 B device row goes and comes back
    assert owners[132] == (8448, [None], {6, 66})


def test_132_byte_host_entries_match_an_fp8_device_and_change_nothing():
    def run(bpe, cfg):
        s = CacheSession({**cfg, "index_k_host_bytes_per_entry": bpe})
        key, _ = offloaded(s, owner=6, n=cfg["page_size"])
        load_back(s, key)
        s.wait_idle()
        return s.record()["ops"], s.snapshot().buffers
    for cfg in (V4, DSA):
        assert run(0, cfg) == run(132, cfg)


# ---------------------------------------------------------------- host_lock_during_load

def _host_reuse_during_load(lock: bool):
    """Request 12's 8 tokens offloaded; 13's resident and locked (running); 12 loaded back for
    a request that locks the path and releases it again (its forward did not wait for the
    load: finished, or retracted); while the load is in flight, device eviction, host
    eviction and request 14's backup."""
    s = CacheSession({**MLA, "host_lock_during_load": lock})
    key12, _ = offloaded(s, owner=12, n=8)
    host12 = s.cache.match_prefix(MatchPrefixParams(key12)).best_match_node.host_value.copy()
    key13, _ = prefill(s, 13, 8, base=2000)
    s.wait_idle()
    s.cache.check_hicache_events()
    s.cache.inc_lock_ref(s.cache.match_prefix(MatchPrefixParams(key13)).last_device_node)
    overwrite(s, owner=99, n=8)
    slots, node, pid = load_back(s, key12)
    assert pid == 0 and len(slots) == 8
    s.cache.inc_lock_ref(node)
    s.cache.dec_lock_ref(node)
    evicted = s.cache.evict(EvictParams(8)).num_tokens_evicted
    freed_host = s.cache.evict_host(8)
    reused = False
    if s.allocator.available_size() >= 16:
        key14, _ = prefill(s, 14, 16, base=3000)              # its backup takes the freed host slots
        back = s.cache.match_prefix(MatchPrefixParams(key14)).last_device_node.host_value
        reused = bool(set(back.tolist()) & set(host12.tolist()))
    s.wait_idle()
    s.cache.check_hicache_events()
    run = s.finish()
    host_races = [r for r in analyse(run)["latent_races"] if r["buffer"] == s.host_pool.kv_buffer]
    same_rerun(s, run)
    return evicted, freed_host, reused, host_races


def test_default_host_lock_keeps_an_in_flight_loads_host_slots():
    evicted, freed_host, reused, host_races = _host_reuse_during_load(True)
    assert (evicted, freed_host, reused, host_races) == (0, 0, False, [])


def test_without_the_lock_host_eviction_frees_and_a_backup_reuses_slots_a_load_reads():
    evicted, freed_host, reused, host_races = _host_reuse_during_load(False)
    assert (evicted, freed_host, reused) == (8, 8, True)
    assert host_races                      # the load's H2D read and the backup's D2H write, unordered


# ---------------------------------------------------------------- backup_pools

@pytest.mark.parametrize("cfg, pools, kept, left", [
    (DSA, ["latent"], "kv_buffer", "index_k_with_scale_buffer"),
    (V4, ["swa", "c4", "c128"], "c4_kv_buffer", IX),
])
def test_pools_left_out_of_backup_pools_keep_the_devices_previous_bytes(cfg, pools, kept, left):
    results = {}
    for bp in (None, pools):
        s = CacheSession({**cfg, "backup_pools": bp})
        n = cfg["page_size"]
        key, _ = offloaded(s, owner=8, n=n)
        overwrite(s, owner=88, n=n)
        slots, _, _ = load_back(s, key)
        s.wait_idle()
        unit = lambda name: [int(x) for x in np.unique(s.entries_of(name, slots) // s.device_pool.layouts[name]
                                                       .entries_per_page)] \
            if s.device_pool.layouts[name].entries_per_page > 1 else [int(x) for x in slots]
        results[bp is None] = (set(s.owners_of(kept, 0, unit(kept))), set(s.owners_of(left, 0, unit(left))),
                               set(s.branches))
        same_rerun(s, s.finish())
    assert results[True][:2] == ({8}, {8}) and "index_k" in results[True][2]
    assert results[False][:2] == ({8}, {88}) and "index_k" not in results[False][2]     # SGLang #17085


def test_backup_pools_listing_every_pool_is_the_default():
    a = CacheSession(DSA)
    b = CacheSession({**DSA, "backup_pools": ["index_k", "latent"]})
    for s in (a, b):
        key, _ = offloaded(s, owner=8, n=64)
        load_back(s, key)
        s.wait_idle()
    assert a.record()["ops"] == b.record()["ops"] and a.branches == b.branches
