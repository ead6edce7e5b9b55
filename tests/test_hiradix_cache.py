"""The HiCache radix tree (``sim.cache.hiradix``) against SGLang 0.5.14's
``hiradix_cache.py``, with a fake controller (``tests/hicache_fakes.py``) whose copies finish
only when a test says so.

Each test names the SGLang function whose behaviour it pins down; the expected values were
worked out by reading that function."""
from __future__ import annotations

import pytest

from sim.cache.hiradix import HiRadixCache
from sim.cache.radix import RadixKey
from sim.cache.records import (CacheInitParams, EvictParams, InitLoadBackParams, InsertParams,
                               MatchPrefixParams)
from sim.errors import InputError
from tests.hicache_fakes import FakeController


def make(policy="write_through", device=128, host=256, page_size=1, **kw):
    ctl = FakeController(device, host, page_size, policy)
    return HiRadixCache(CacheInitParams(page_size=page_size), ctl, **kw), ctl


def put(cache, tokens, priority=0, chunked=False):
    """Insert as ``cache_finished_req`` does for a request that matched nothing: fresh slots
    for every token, then free the ``prefix_len`` duplicates."""
    alloc = cache.cache_controller.mem_pool_device_allocator
    key = RadixKey(tokens)
    n = len(key.page_aligned(cache.page_size))
    value = alloc.alloc(n)
    assert value is not None, "test device pool too small"
    res = cache.insert(InsertParams(key=key, value=value, priority=priority, chunked=chunked))
    alloc.free(value[: res.prefix_len])
    return value, res.prefix_len


def match(cache, tokens):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))


def settle(cache, ctl):
    ctl.finish_writes()
    ctl.finish_loads()
    cache.check_hicache_events()


def node_at(cache, tokens):
    """The node whose path spells ``tokens`` exactly."""
    node, rest = cache.root_node, list(tokens)
    while rest:
        node = node.children[RadixKey(rest).child_key(cache.page_size)]
        n = len(node.key)
        assert node.key.token_ids.tolist() == rest[:n]
        rest = rest[n:]
    return node


def check_sizes(cache):
    """evictable + protected == device-resident tokens; protected == locked resident tokens."""
    resident = locked = 0
    stack = list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if not n.evicted:
            resident += len(n.value)
            locked += len(n.value) if n.lock_ref > 0 else 0
    assert cache.evictable_size() + cache.protected_size() == resident
    assert cache.protected_size() == locked


# ----------------------------------------------------------------- write policies

def test_write_through_backs_up_on_insert_and_locks_until_ack():
    # HiRadixCache.insert -> _inc_hit_count (threshold 1) -> write_backup: host slots at
    # once, inc_lock_ref until writing_check sees the finish event
    cache, ctl = make("write_through")
    v, _ = put(cache, list(range(12)))
    node = node_at(cache, range(12))
    assert node.backuped and node.host_value.tolist() == list(range(12))
    assert node.lock_ref == 1 and cache.protected_size() == 12 and cache.evictable_size() == 0
    assert ctl.writes[0]["device"].tolist() == v.tolist()
    assert list(cache.ongoing_write_through) == [node.id]
    cache.check_hicache_events()                       # not finished: nothing released
    assert node.lock_ref == 1
    ctl.finish_writes()
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.evictable_size() == 12 and not cache.ongoing_write_through
    assert ctl.ack_write_queue == []
    check_sizes(cache)


def test_writing_check_consumes_only_leading_finished_acks():
    # HiRadixCache.writing_check: counts acks from the front until the first unfinished one
    cache, ctl = make("write_through")
    put(cache, [1] * 5)
    put(cache, [2] * 5)
    ctl._finish("write", 1)                            # the second finishes first
    cache.writing_check()
    assert len(ctl.ack_write_queue) == 2
    assert node_at(cache, [2] * 5).lock_ref == 1
    ctl._finish("write", 0)
    cache.writing_check()
    assert ctl.ack_write_queue == [] and cache.protected_size() == 0


def test_all_reduce_min_hook_and_pp_rank():
    # writing_check / loading_check: the count is all-reduced (MIN) over ranks; PP ranks > 0
    # count nothing themselves and take the reduced value
    seen = []
    cache, ctl = make("write_through", all_reduce_min=lambda n: (seen.append(n), 0)[1])
    put(cache, [1] * 5)
    ctl.finish_writes()
    cache.check_hicache_events()
    assert seen == [1, 0] and len(ctl.ack_write_queue) == 1      # another rank had not finished
    cache2, ctl2 = make("write_through", pp_rank=1, all_reduce_min=lambda n: (seen.append(n), 1)[1])
    put(cache2, [1] * 5)
    ctl2.finish_writes()
    seen.clear()
    cache2.writing_check()
    assert seen == [0] and ctl2.ack_write_queue == []


def test_write_through_selective_needs_two_hits():
    # _inc_hit_count: write_through_threshold is 2 unless the policy is write_through;
    # match_prefix counts no hit, insert does
    cache, ctl = make("write_through_selective")
    put(cache, list(range(10)))
    node = node_at(cache, range(10))
    assert not node.backuped and node.hit_count == 1
    match(cache, list(range(10)))
    assert not node.backuped and node.hit_count == 1
    put(cache, list(range(10)))
    assert node.backuped and node.hit_count == 2 and len(ctl.writes) == 1


def test_chunked_inserts_count_no_hits():
    # _inc_hit_count(node, chunked=True) returns at once
    cache, ctl = make("write_through")
    put(cache, list(range(10)), chunked=True)
    assert not node_at(cache, range(10)).backuped and ctl.writes == []


def test_backups_form_a_contiguous_prefix():
    # write_backup: skipped (returns 0, allocates nothing) when the parent is not the root and
    # has no backup.  The parent's backup fails here because the host pool is full.
    cache, ctl = make("write_through", host=16)
    put(cache, [1] * 10)                               # backed up: 10 host slots
    put(cache, [2] * 10)                               # 6 host slots left: backup fails
    b = node_at(cache, [2] * 10)
    assert not b.backuped and b.lock_ref == 0
    put(cache, [2] * 10 + [3] * 4)                     # B hit (fails again); leaf C skipped
    c = node_at(cache, [2] * 10 + [3] * 4)
    assert not c.backuped
    assert ctl.mem_pool_host.available_size() == 6
    assert len(ctl.writes) == 1
    check_sizes(cache)


def test_write_backup_evicts_host_when_full():
    # write_backup: a failed host allocation runs evict_host(len) and tries once more
    cache, ctl = make("write_through", host=20)
    put(cache, [1] * 10)
    put(cache, [2] * 10)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=10))            # [1]*10 is LRU: now host-only
    assert node_at(cache, [1] * 10).evicted
    put(cache, [3] * 10)                               # host full -> evict_host frees [1]*10
    assert 1 not in cache.root_node.children
    assert node_at(cache, [3] * 10).host_value.tolist() == list(range(10))    # reused slots
    check_sizes(cache)


def test_split_during_backup_covers_both_parts():
    # _split_node + _replace_pending_write_through_node: host_value split too; the ack
    # releases the lock through the lower (original) node, which walks through the upper one
    cache, ctl = make("write_through")
    put(cache, list(range(10)))
    orig = node_at(cache, range(10))
    upper = match(cache, list(range(4)) + [99]).last_device_node
    assert upper.host_value.tolist() == [0, 1, 2, 3] and orig.host_value.tolist() == list(range(4, 10))
    assert upper.lock_ref == orig.lock_ref == 1
    assert cache.ongoing_write_through[orig.id][2] == [upper, orig]
    assert upper.write_through_pending_id == orig.id
    settle(cache, ctl)
    assert upper.lock_ref == orig.lock_ref == 0 and upper.write_through_pending_id is None
    check_sizes(cache)


def test_write_back_backs_up_only_inside_evict_and_blocks():
    # _inc_hit_count returns at once under write_back; evict() backs up unbacked leaves
    # (write_backup(write_back=True): no lock), pushes the parent at once, then
    # writing_check(write_back=True) synchronizes every ack and the nodes become host-only
    cache, ctl = make("write_back")
    put(cache, list(range(6)))
    put(cache, list(range(6)) + [50, 51, 52, 53])
    parent, leaf = node_at(cache, range(6)), node_at(cache, list(range(6)) + [50, 51, 52, 53])
    assert ctl.writes == [] and parent.hit_count == 0
    res = cache.evict(EvictParams(num_tokens=5))
    # leaf written (4 < 5), parent pushed although the leaf is still on device, parent written
    assert res.num_tokens_evicted == 10
    assert [w["node_ids"] for w in ctl.writes] == [[leaf.id], [parent.id]]
    assert ctl.ack_write_queue == [] and not cache.ongoing_write_through
    assert parent.evicted and leaf.evicted and parent.backuped and leaf.backuped
    assert parent.lock_ref == leaf.lock_ref == 0
    assert cache.evictable_size() == 0 and cache.evictable_host_leaves == {leaf}
    check_sizes(cache)


def test_write_back_synchronizes_each_ack():
    # writing_check(write_back=True): finish_event.synchronize() per queued ack
    cache, ctl = make("write_back")
    put(cache, [1] * 4)
    put(cache, [2] * 4)
    acks = []
    real_start = ctl.start_writing

    def spy():
        real_start()
        acks.append(ctl.ack_write_queue[-1])
    ctl.start_writing = spy
    cache.evict(EvictParams(num_tokens=8))
    assert len(acks) == 2 and [a.finish_event.syncs for a in acks] == [1, 1]


# ----------------------------------------------------------------- device eviction

def test_evict_backed_up_leaf_becomes_host_only():
    # _evict_backuped: device slots freed, value None, host copy kept; the node joins
    # evictable_host_leaves and its parent becomes an evictable device leaf
    cache, ctl = make("write_through")
    put(cache, list(range(4)))
    v, _ = put(cache, list(range(4)) + [7, 7, 7])
    settle(cache, ctl)
    leaf = node_at(cache, list(range(4)) + [7, 7, 7])
    free_before = ctl.mem_pool_device_allocator.available_size()
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 3
    assert leaf.evicted and leaf.backuped and leaf.parent is node_at(cache, range(4))
    assert ctl.mem_pool_device_allocator.available_size() == free_before + 3
    assert cache.evictable_leaves == {leaf.parent} and cache.evictable_host_leaves == {leaf}
    assert cache.total_size() == 4
    check_sizes(cache)


def test_evict_regular_deletes_unbacked_leaf():
    # _evict_regular (write_through policies): a leaf with no backup is deleted
    cache, ctl = make("write_through_selective")
    put(cache, [5] * 8)
    assert cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8
    assert cache.root_node.children == {} and cache.evictable_size() == 0


def test_evict_order_follows_per_node_touches():
    # HiRadixCache.insert stamps each node on the path with its own monotonic() read, before a
    # split; the new leaf is created after.  Inserting A=[1,2,3,4] then B=[1,2,5,6] leaves the
    # lower part [3,4] older than leaf [5,6]; matching [1,2,3,4] reverses that.
    cache, ctl = make("write_through_selective")
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    a, b = node_at(cache, [1, 2, 3, 4]), node_at(cache, [1, 2, 5, 6])
    assert a.last_access_time < a.parent.last_access_time < b.last_access_time
    cache.evict(EvictParams(num_tokens=1))
    assert 3 not in node_at(cache, [1, 2]).children and 5 in node_at(cache, [1, 2]).children
    put(cache, [1, 2, 3, 4])
    match(cache, [1, 2, 3, 4])
    cache.evict(EvictParams(num_tokens=1))
    assert list(node_at(cache, [1, 2]).children) == [3]


def test_match_touches_root_then_path_in_order():
    # HiRadixCache._match_prefix_helper: root, then each child, one monotonic() read each
    cache, ctl = make("write_through_selective")
    put(cache, [1, 2])
    put(cache, [1, 2, 3, 4])
    put(cache, [9])
    t0 = cache.clock.now
    match(cache, [1, 2, 3, 4, 8])
    a, b = node_at(cache, [1, 2]), node_at(cache, [1, 2, 3, 4])
    assert (cache.root_node.last_access_time, a.last_access_time, b.last_access_time) == (t0 + 1, t0 + 2, t0 + 3)
    assert node_at(cache, [9]).last_access_time < t0


def test_evict_skips_locked_nodes():
    # HiRadixCache.evict: a popped node with lock_ref > 0 is skipped
    cache, ctl = make("write_through")
    put(cache, [1] * 3)
    settle(cache, ctl)
    m = match(cache, [1] * 3)
    cache.inc_lock_ref(m.last_device_node)
    assert cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 0
    cache.dec_lock_ref(m.last_device_node)
    assert cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 3


# ----------------------------------------------------------------- match with a host tier

def test_match_reports_host_hit_length_and_nodes():
    # HiRadixCache.match_prefix: device_indices skip evicted nodes; host_hit_length sums the
    # evicted tail; last_host_node = best_match_node = deepest backed-up node
    cache, ctl = make("write_through")
    put(cache, list(range(5)))
    put(cache, list(range(5)) + [8] * 6)
    settle(cache, ctl)
    top, leaf = node_at(cache, range(5)), node_at(cache, list(range(5)) + [8] * 6)
    cache.evict(EvictParams(num_tokens=1))
    m = match(cache, list(range(5)) + [8] * 6 + [1])
    assert m.device_indices.tolist() == top.value.tolist()
    assert m.last_device_node is top
    assert m.last_host_node is leaf and m.best_match_node is leaf
    assert m.host_hit_length == 6


def test_match_splits_a_host_only_node():
    # HiRadixCache._split_node on an evicted node: both parts stay evicted, host_value is cut
    cache, ctl = make("write_through")
    put(cache, list(range(10)))
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=10))
    m = match(cache, list(range(4)))
    upper = m.best_match_node
    assert upper.evicted and upper.host_value.tolist() == [0, 1, 2, 3]
    assert m.host_hit_length == 4 and m.last_device_node is cache.root_node
    assert len(m.device_indices) == 0
    assert upper not in cache.evictable_host_leaves              # it has a backed-up child


def test_last_host_node_stops_at_a_device_only_node():
    # match_prefix: last_host_node walks up past nodes without a backup (root counts as one)
    cache, ctl = make("write_through_selective")
    put(cache, [1] * 5)
    m = match(cache, [1] * 5)
    assert m.last_device_node is node_at(cache, [1] * 5)
    assert m.last_host_node is cache.root_node and m.host_hit_length == 0


# ----------------------------------------------------------------- load-back

def _host_only(cache, ctl, tokens):
    put(cache, tokens)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=10 ** 6))
    return node_at(cache, tokens)


def test_init_load_back_marks_resident_before_any_copy():
    # load_back: cache_controller.load allocates device slots and queues; the nodes get
    # their values at once and last_hit_node is locked until loading_check
    cache, ctl = make("write_through")
    node = _host_only(cache, ctl, list(range(12)))
    m = match(cache, list(range(12)))
    dev, last = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    assert last is node and len(dev) == 12 and node.value.tolist() == dev.tolist()
    assert ctl.loads == [] and len(ctl.load_queue) == 1          # nothing copied yet
    assert node.lock_ref == 1 and cache.protected_size() == 12
    assert cache.ongoing_load_back == {node.id: node}
    # a second request in the same round matches it as resident before its copy starts
    m2 = match(cache, list(range(12)))
    assert m2.device_indices.tolist() == dev.tolist() and m2.host_hit_length == 0
    assert m2.last_device_node is node
    assert cache.ready_to_load_host_cache() == 0
    assert ctl.loads[0]["host"].tolist() == node.host_value.tolist()
    cache.check_hicache_events()
    assert node.lock_ref == 1                                     # copy not finished
    ctl.finish_loads()
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.ongoing_load_back == {} and cache.evictable_size() == 12
    check_sizes(cache)


def test_ready_to_load_with_nothing_queued():
    # HiCacheController.start_loading returns -1 with an empty load queue
    cache, ctl = make()
    assert cache.ready_to_load_host_cache() == -1


def test_load_back_collects_the_evicted_chain_top_first():
    # load_back: evicted ancestors loaded with the node, ancestor first, one allocation
    cache, ctl = make("write_through")
    put(cache, [1] * 6)
    put(cache, [1] * 6 + [2] * 6)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=100))
    top, leaf = node_at(cache, [1] * 6), node_at(cache, [1] * 6 + [2] * 6)
    m = match(cache, [1] * 6 + [2] * 6)
    assert m.host_hit_length == 12
    dev, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, 12))
    assert top.value.tolist() == dev[:6].tolist() and leaf.value.tolist() == dev[6:].tolist()
    assert ctl.load_queue[0][0].tolist() == top.host_value.tolist() + leaf.host_value.tolist()
    assert ctl.load_queue[0][2] == leaf.id
    check_sizes(cache)


def test_load_back_threshold():
    # load_back: fewer than load_back_threshold (10) host tokens: no load, lock undone;
    # init_load_back then returns the deepest resident ancestor
    cache, ctl = make("write_through")
    put(cache, [1] * 4)
    put(cache, [1] * 4 + [2] * 9)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=1))                       # only the 9-token leaf
    m = match(cache, [1] * 4 + [2] * 9)
    dev, last = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    assert len(dev) == 0 and last is node_at(cache, [1] * 4)
    assert ctl.load_queue == [] and cache.protected_size() == 0
    cache2, ctl2 = make("write_through", load_back_threshold=9)
    put(cache2, [1] * 4)
    put(cache2, [1] * 4 + [2] * 9)
    settle(cache2, ctl2)
    cache2.evict(EvictParams(num_tokens=1))
    m = match(cache2, [1] * 4 + [2] * 9)
    assert len(cache2.init_load_back(InitLoadBackParams(m.best_match_node, 9))[0]) == 9


def test_load_back_mem_quota_counts_the_ancestor_lock():
    # load_back: skipped when len > mem_quota + delta, delta being minus the tokens the
    # ancestor lock just protected (so an unlocked resident prefix eats into the quota)
    cache, ctl = make("write_through")
    put(cache, [1] * 20)
    put(cache, [1] * 20 + [2] * 15)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=1))
    m = match(cache, [1] * 20 + [2] * 15)
    dev, last = cache.init_load_back(InitLoadBackParams(m.best_match_node, 15, mem_quota=30))
    assert len(dev) == 0 and last is node_at(cache, [1] * 20)    # 15 > 30 - 20
    cache.inc_lock_ref(last)                                     # already locked: delta 0
    dev, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, 15, mem_quota=30))
    assert len(dev) == 15


def test_load_back_evicts_when_device_is_full():
    # load_back: a failed cache_controller.load runs evict(len) and tries once more
    cache, ctl = make("write_through", device=24, host=64)
    put(cache, [1] * 12)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=12))
    put(cache, [2] * 12)
    put(cache, [3] * 12)                                         # device full now
    settle(cache, ctl)
    assert ctl.mem_pool_device_allocator.available_size() == 0
    m = match(cache, [1] * 12)
    dev, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, 12))
    assert len(dev) == 12 and node_at(cache, [2] * 12).evicted   # the LRU leaf made room
    check_sizes(cache)


def test_load_back_fails_when_nothing_can_be_evicted():
    # load_back: returns None (init_load_back: empty + resident ancestor) if load fails twice
    cache, ctl = make("write_through", device=16, host=64)
    _host_only(cache, ctl, [1] * 12)
    put(cache, [2] * 16)
    m = match(cache, [1] * 12)
    dev, last = cache.init_load_back(InitLoadBackParams(m.best_match_node, 12))
    assert len(dev) == 0 and last is cache.root_node and cache.ongoing_load_back == {}


# ----------------------------------------------------------------- insert over host-only nodes

def test_insert_takes_over_slots_of_host_only_nodes():
    # HiRadixCache.insert: a fully matched evicted node takes the caller's slots (not counted
    # in prefix_len, so the caller keeps them out of its free); host copy kept
    cache, ctl = make("write_through")
    node = _host_only(cache, ctl, [4] * 10)
    host = node.host_value.tolist()
    alloc = ctl.mem_pool_device_allocator
    value = alloc.alloc(14)
    res = cache.insert(InsertParams(key=RadixKey([4] * 10 + [5] * 4), value=value))
    assert res.prefix_len == 0
    assert node.value.tolist() == value[:10].tolist() and node.host_value.tolist() == host
    assert node not in cache.evictable_host_leaves
    assert node_at(cache, [4] * 10 + [5] * 4).value.tolist() == value[10:].tolist()
    assert node.hit_count == 1                                    # no hit counted on take-over
    check_sizes(cache)


def test_insert_splits_a_host_only_node_and_takes_the_upper_part():
    # HiRadixCache.insert, partial match on an evicted node: split, the upper part takes the
    # caller's slots, the lower part stays host-only
    cache, ctl = make("write_through")
    node = _host_only(cache, ctl, list(range(10)))
    alloc = ctl.mem_pool_device_allocator
    value = alloc.alloc(6)
    res = cache.insert(InsertParams(key=RadixKey([0, 1, 2, 3, 70, 71]), value=value))
    assert res.prefix_len == 0
    upper = node.parent
    assert upper.value.tolist() == value[:4].tolist() and upper.host_value.tolist() == [0, 1, 2, 3]
    assert node.evicted and node in cache.evictable_host_leaves
    leaf = upper.children[70]
    assert leaf.backuped                                          # parent backed up: write allowed
    check_sizes(cache)


def test_prefix_len_counts_only_resident_matches():
    # HiRadixCache.insert: total_prefix_length grows only for non-evicted matched nodes
    cache, ctl = make("write_through")
    put(cache, [1] * 4)
    put(cache, [1] * 4 + [2] * 10)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=1))
    _, p = put(cache, [1] * 4 + [2] * 10 + [3])
    assert p == 4


# ----------------------------------------------------------------- host eviction

def test_evict_host_only_on_unprotected_host_leaves():
    # evict_host: heap over evictable_host_leaves (evicted, unlocked, no backed-up child);
    # host_ref_counter > 0 is skipped; a parent left evicted and childless is pushed
    cache, ctl = make("write_through")
    put(cache, [1] * 5)
    put(cache, [1] * 5 + [2] * 5)
    put(cache, [3] * 5)
    settle(cache, ctl)
    cache.evict(EvictParams(num_tokens=10))                      # the [1]-chain is LRU
    top, leaf, other = node_at(cache, [1] * 5), node_at(cache, [1] * 5 + [2] * 5), node_at(cache, [3] * 5)
    assert top.evicted and leaf.evicted and not other.evicted
    assert cache.evictable_host_leaves == {leaf}
    leaf.protect_host()
    assert cache.evict_host(100) == 0 and top.parent is cache.root_node and 2 in top.children
    leaf.release_host()
    free_before = ctl.mem_pool_host.available_size()
    assert cache.evict_host(6) == 10                             # leaf, then its parent
    assert 1 not in cache.root_node.children and not other.evicted
    assert ctl.mem_pool_host.available_size() == free_before + 10
    assert ctl.mem_pool_host.free_slots[-10:].tolist() == leaf.host_value.tolist() + top.host_value.tolist()


def test_evict_host_leaves_a_parent_with_a_resident_child():
    # evict_host never takes a device+host node; evictable_host_leaves holds evicted nodes only
    cache, ctl = make("write_through")
    put(cache, [1] * 5)
    settle(cache, ctl)
    assert cache.evict_host(100) == 0 and not node_at(cache, [1] * 5).evicted


def test_locked_host_only_node_is_not_a_host_leaf():
    # _update_host_leaf_status: lock_ref > 0 removes a node from evictable_host_leaves
    cache, ctl = make("write_through")
    node = _host_only(cache, ctl, [1] * 10)
    m = match(cache, [1] * 10)
    cache.init_load_back(InitLoadBackParams(m.best_match_node, 10))
    assert node not in cache.evictable_host_leaves
    assert cache.evict_host(100) == 0


def test_insert_helper_host_adds_host_only_suffix():
    # _insert_helper_host: walk down (touching, splitting), hang the rest as a host-only leaf
    cache, ctl = make("write_through")
    put(cache, [1] * 4)
    settle(cache, ctl)
    host = ctl.mem_pool_host.alloc(8)
    matched = cache._insert_helper_host(cache.root_node, RadixKey([1] * 4 + [6] * 4), host)
    assert matched == 4
    leaf = node_at(cache, [1] * 4 + [6] * 4)
    assert leaf.evicted and leaf.host_value.tolist() == host[4:].tolist()
    assert cache.evictable_host_leaves == {leaf}
    m = match(cache, [1] * 4 + [6] * 4)
    assert m.host_hit_length == 4 and m.best_match_node is leaf


# ----------------------------------------------------------------- pages, locks, misc

def test_paged_tree_with_host_tier():
    # page_size 4: keys page-aligned; host allocations are page multiples
    cache, ctl = make("write_through", device=128, host=128, page_size=4)
    put(cache, list(range(10)))
    settle(cache, ctl)
    node = node_at(cache, range(8))
    assert len(node.host_value) == 8
    cache.evict(EvictParams(num_tokens=8))
    m = match(cache, list(range(8)) + [1, 2, 3, 4])
    assert m.host_hit_length == 8 and m.best_match_node is node
    dev, _ = cache.init_load_back(InitLoadBackParams(node, 8, None))
    assert len(dev) == 0                                          # 8 < threshold 10
    m = match(cache, list(range(4)) + [9, 9, 9, 9])
    assert m.host_hit_length == 4 and m.best_match_node.host_value.tolist() == node.parent.host_value.tolist()


def test_lock_walks_update_host_leaf_status():
    # HiRadixCache.inc_lock_ref/dec_lock_ref also call _update_host_leaf_status on the path
    cache, ctl = make("write_through")
    put(cache, [1] * 10)
    put(cache, [1] * 10 + [2] * 3)
    settle(cache, ctl)
    leaf = node_at(cache, [1] * 10 + [2] * 3)
    cache.evict(EvictParams(num_tokens=1))
    assert cache.evictable_host_leaves == {leaf}
    r = cache.inc_lock_ref(leaf.parent)
    assert r.delta == -10 and cache.evictable_host_leaves == {leaf}
    check_sizes(cache)
    assert cache.dec_lock_ref(leaf.parent).delta == 10


def test_reset_restarts_ids_and_clears_controller_and_host():
    # HiRadixCache.reset: TreeNode.counter = 0, cache_controller.reset(), host pool clear()
    cache, ctl = make("write_through")
    put(cache, [1] * 5)
    cache.reset()
    assert cache.root_node.id == 0 and ctl.resets == 2                 # construction + reset
    assert ctl.mem_pool_host.available_size() == 256
    put(cache, [1] * 5)
    assert node_at(cache, [1] * 5).id == 1


def test_get_height_and_format_tree():
    cache, ctl = make("write_through")
    put(cache, [1] * 3)
    put(cache, [1] * 3 + [2] * 3)
    leaf = node_at(cache, [1] * 3 + [2] * 3)
    assert cache.get_height(leaf) == 2
    text = cache.format_tree()
    assert "device+host" in text and "lock_ref=2" in text


def test_constructor_checks():
    ctl = FakeController(16, 32, 1, "write_through")
    with pytest.raises(InputError):
        HiRadixCache(CacheInitParams(page_size=1), ctl, write_policy="write_back")
    with pytest.raises(InputError):
        HiRadixCache(CacheInitParams(page_size=2), ctl)
    ctl.write_policy = "sometimes"
    with pytest.raises(InputError):
        HiRadixCache(CacheInitParams(page_size=1), ctl)
    cache, _ = make()
    with pytest.raises(InputError):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=None))
    with pytest.raises(InputError):
        cache.load_back(cache.root_node)


def test_release_aborted_request_forgets_loaded_tokens():
    cache, _ = make()
    cache.prefetch_loaded_tokens_by_reqid["r1"] = 5
    cache.release_aborted_request("r1")
    cache.release_aborted_request("r2")
    assert cache.prefetch_loaded_tokens_by_reqid == {}


def test_write_back_can_leave_a_backup_below_an_unbacked_parent():
    # HiRadixCache.evict under write_back: write_backup(x, write_back=True) skips the parent
    # check, and the loop stops once enough tokens are counted, so the parent (pushed as a
    # candidate) may never be backed up: the contiguous-prefix rule does not hold here
    cache, ctl = make("write_back")
    put(cache, [1] * 6)
    put(cache, [1] * 6 + [2] * 4)
    parent, leaf = node_at(cache, [1] * 6), node_at(cache, [1] * 6 + [2] * 4)
    assert cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 4
    assert leaf.evicted and leaf.backuped
    assert not parent.evicted and not parent.backuped
    assert cache.evictable_leaves == {parent}
    m = match(cache, [1] * 6 + [2] * 4)
    assert m.last_device_node is parent and m.best_match_node is leaf and m.host_hit_length == 4
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 6
    assert parent.evicted and parent.backuped
    check_sizes(cache)


def test_docs_example_prints_what_the_docs_say(capsys):
    # docs/hicache.md: the load-back example and its printed output, kept true
    import pathlib
    import re
    text = (pathlib.Path(__file__).parent.parent / "docs" / "hicache.md").read_text()
    code, printed = re.search(r"```python\n(.*?)```\n\nprints\n\n```\n(.*?)```", text, re.S).groups()
    exec(compile(code, "docs/hicache.md", "exec"), {})
    assert capsys.readouterr().out == printed


# ----------------------------------------------------------------- with the real controller

def _session(**kw):
    from sim.cache import CacheSession
    return CacheSession(model="mla", layers=2, device_tokens=32, kv_lora_rank=24, qk_rope_head_dim=8,
                        overlap=False, **kw)


def _prefill(s, tokens, owner):
    slots = s.allocator.alloc(len(tokens))
    s.store_kv(slots, owner=owner)
    s.cache.insert(InsertParams(RadixKey(tokens), slots))
    return slots


def test_session_write_back_evict_blocks_until_the_backup_landed():
    # HiRadixCache.evict under write_back: writing_check(write_back=True) synchronizes the
    # backup's finish event, so the host waits (simulated time passes) and the host copy
    # holds the request's bytes when the node becomes host-only
    s = _session(write_policy="write_back")
    slots = _prefill(s, list(range(12)), owner=5)
    t0 = s.now
    assert s.cache.evict(EvictParams(num_tokens=12)).num_tokens_evicted == 12
    assert s.now > t0
    node = node_at(s.tree, range(12))
    assert node.evicted and s.controller.ack_write_queue == []
    runs = s.bytes_of("host_kv_buffer", 1, node.host_value)
    assert [(r[0]["origin"]["owner"], r[0]["first_unit"]) for r in runs] == [(5, d) for d in slots.tolist()]


def test_session_resident_slots_hold_stale_bytes_until_the_load_runs():
    # load_back marks the nodes resident at init_load_back; a second request matching the
    # prefix gets the new slots before start_loading has issued a copy, and loading_check
    # releases the lock only once the last layer's event has completed
    s = _session()
    _prefill(s, list(range(12)), owner=7)
    s.wait_idle()
    s.cache.check_hicache_events()
    s.cache.evict(EvictParams(num_tokens=12))
    m = s.cache.match_prefix(MatchPrefixParams(RadixKey(list(range(12)))))
    loaded, node = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    second = s.cache.match_prefix(MatchPrefixParams(RadixKey(list(range(12)))))
    assert second.device_indices.tolist() == loaded.tolist() and second.host_hit_length == 0
    assert s.owners_of("kv_buffer", 0, loaded) == [-1] * 12        # nothing copied yet
    assert s.cache.ready_to_load_host_cache() == 0
    s.cache.check_hicache_events()
    assert node.lock_ref == 1                                        # the copy is still running
    s.wait_idle()
    s.cache.check_hicache_events()
    assert node.lock_ref == 0 and s.tree.ongoing_load_back == {}
    assert s.owners_of("kv_buffer", 1, loaded) == [7] * 12
