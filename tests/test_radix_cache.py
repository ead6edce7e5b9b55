"""The plain radix cache (``sim.cache.radix``) against SGLang 0.5.14's ``radix_cache.py``.

Each test names the SGLang function whose behaviour it pins down; the expected values were
worked out by reading that function, not by running this code."""
from __future__ import annotations

import numpy as np
import pytest

from sim.cache.evict_policy import get_eviction_strategy
from sim.cache.radix import CacheStateError, LogicalClock, RadixCache, RadixKey, TreeNode
from sim.cache.records import CacheInitParams, EvictParams, InsertParams, MatchPrefixParams
from sim.errors import InputError
from sim.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def make(page_size=1, size=256, **kw):
    alloc = TokenToKVPoolAllocator(size) if page_size == 1 else PagedTokenToKVPoolAllocator(size, page_size)
    return RadixCache(CacheInitParams(token_to_kv_pool_allocator=alloc, page_size=page_size, **kw)), alloc


def put(cache, alloc, tokens, extra_key=None):
    """A request's life in miniature: slots for every token, insert, free the duplicates
    (``cache_finished_req`` with nothing matched beforehand)."""
    key = RadixKey(tokens, extra_key)
    n = len(key.page_aligned(cache.page_size))
    value = alloc.alloc(n)
    res = cache.insert(InsertParams(key=key, value=value))
    alloc.free(value[: res.prefix_len])
    return value, res.prefix_len


def match(cache, tokens, extra_key=None):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra_key)))


def device_tokens(cache):
    out, stack = 0, list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        if not n.evicted:
            out += len(n.value)
        stack.extend(n.children.values())
    return out


# ----------------------------------------------------------------- RadixKey

def test_key_match_rounds_down_to_pages():
    # RadixKey.match: common prefix length, rounded down to page_size
    a = RadixKey([1, 2, 3, 4, 5, 6, 7])
    b = RadixKey([1, 2, 3, 4, 5, 9, 9, 9])
    assert a.match(b) == 5
    assert a.match(b, page_size=2) == 4
    assert a.match(b, page_size=4) == 4
    assert a.match(b, page_size=8) == 0
    assert a.match(RadixKey([1, 2, 3])) == 3          # bounded by the shorter key


def test_key_extra_key_namespaces():
    # RadixKey.child_key: (extra_key, page) when extra_key is set; match refuses mixed keys
    assert RadixKey([5, 6], "lora1").child_key() == ("lora1", 5)
    assert RadixKey([5, 6, 7], None).child_key(2) == (5, 6)
    with pytest.raises(InputError):
        RadixKey([1], "a").match(RadixKey([1], "b"))


def test_key_bigram_view():
    # RadixKey with is_bigram: N+1 raw tokens are N units; a slice keeps its boundary token
    k = RadixKey([10, 11, 12, 13], is_bigram=True)
    assert len(k) == 3
    assert list(k) == [(10, 11), (11, 12), (12, 13)]
    assert k[1:].token_ids.tolist() == [11, 12, 13]
    assert k.child_key() == (10, 11)
    assert len(k[3:]) == 0 and k[3:].token_ids.tolist() == []
    other = RadixKey([10, 11, 12, 99], is_bigram=True)
    assert k.match(other) == 2                         # 3 raw tokens agree -> 2 bigrams


def test_key_limit_and_page_aligned():
    # RadixKey.limit caps the raw tokens; page_aligned cuts to whole pages
    k = RadixKey([1, 2, 3, 4, 5, 6, 7], limit=5)
    assert len(k) == 5 and k.raw_token_ids().tolist() == [1, 2, 3, 4, 5]
    assert len(k.page_aligned(2)) == 4
    assert k.page_aligned(1) is k


def test_maybe_to_bigram_view_mutates_in_place():
    # RadixKey.maybe_to_bigram_view flips the caller's key object and cuts value to N
    k = RadixKey([1, 2, 3])
    k2, v = k.maybe_to_bigram_view(True, np.arange(3))
    assert k2 is k and k.is_bigram and v.tolist() == [0, 1]


# ----------------------------------------------------------------- match / insert

def test_insert_then_match_returns_the_tree_slots():
    # RadixCache.insert / match_prefix: the tree keeps the first inserter's slots
    cache, alloc = make()
    v1, p1 = put(cache, alloc, [1, 2, 3, 4])
    assert p1 == 0
    v2, p2 = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    assert p2 == 4                                     # the caller frees its 4 duplicate slots
    m = match(cache, [1, 2, 3, 4, 5, 6, 7])
    assert m.device_indices.tolist() == v1.tolist() + v2[4:].tolist()
    assert m.last_device_node is m.last_host_node is m.best_match_node
    assert m.host_hit_length == 0
    assert cache.total_size() == 6 == cache.evictable_size()


def test_match_splits_on_partial_match():
    # RadixCache._match_prefix_helper + _split_node: a match ending inside a node splits it;
    # the upper part is the new node, the original object keeps the lower part
    cache, alloc = make()
    v, _ = put(cache, alloc, [1, 2, 3, 4, 5])
    (orig,) = cache.root_node.children.values()
    m = match(cache, [1, 2, 9])
    upper = m.last_device_node
    assert m.device_indices.tolist() == v[:2].tolist()
    assert upper is not orig and upper.key.token_ids.tolist() == [1, 2]
    assert upper.value.tolist() == v[:2].tolist()
    assert orig.parent is upper and orig.key.token_ids.tolist() == [3, 4, 5]
    assert orig.value.tolist() == v[2:].tolist()
    assert list(upper.children) == [3] and cache.root_node.children[1] is upper
    assert cache.evictable_leaves == {orig}


def test_page_alignment_of_match_and_insert():
    # RadixKey.page_aligned in match_prefix / insert; child keys are whole first pages
    cache, alloc = make(page_size=4, size=256)
    v, _ = put(cache, alloc, list(range(10)))          # 8 tokens stored, 2 dropped
    assert cache.total_size() == 8
    (node,) = cache.root_node.children.values()
    assert list(cache.root_node.children) == [(0, 1, 2, 3)]
    assert len(match(cache, list(range(7))).device_indices) == 4
    assert len(match(cache, [0, 1, 2]).device_indices) == 0
    # a mismatch inside the second page: matched length rounds down to one page, split at 4
    m = match(cache, [0, 1, 2, 3, 4, 5, 99, 7])
    assert m.device_indices.tolist() == v[:4].tolist()
    assert node.key.token_ids.tolist() == [4, 5, 6, 7]


def test_extra_keys_never_share_nodes():
    # RadixKey.child_key namespacing in _insert_helper
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3], "a")
    _, p = put(cache, alloc, [1, 2, 3], "b")
    assert p == 0 and len(cache.root_node.children) == 2
    assert len(match(cache, [1, 2, 3], "a").device_indices) == 3
    assert len(match(cache, [1, 2, 3]).device_indices) == 0


def test_insert_without_value_uses_token_ids():
    # RadixCache.insert: value None is SGLang's debug fallback (token ids as values)
    cache, _ = make()
    cache.insert(InsertParams(key=RadixKey([7, 8, 9])))
    assert match(cache, [7, 8, 9]).device_indices.tolist() == [7, 8, 9]


def test_hit_count_and_priority_on_insert():
    # RadixCache._insert_helper: every node on the path counts a hit (not when chunked) and
    # takes the max priority; a split's upper part inherits hit_count and priority
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=alloc.alloc(4), priority=5))
    (n,) = cache.root_node.children.values()
    assert n.hit_count == 2 and n.priority == 5 and cache.root_node.priority == 5
    cache.insert(InsertParams(key=RadixKey([1, 2, 9]), value=alloc.alloc(3), chunked=True))
    upper = cache.root_node.children[1]
    assert upper.hit_count == 2                        # copied, chunked adds nothing
    assert upper.children[9].hit_count == 0


# ----------------------------------------------------------------- time and eviction

def test_plain_cache_stamps_a_path_with_one_time():
    # RadixCache._match_prefix_helper reads time.monotonic() once for the whole path
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    put(cache, alloc, [1, 2, 3, 4])
    before = cache.clock.now
    m = match(cache, [1, 2, 3, 4])
    a = cache.root_node.children[1]
    b = m.last_device_node
    assert cache.root_node.last_access_time == a.last_access_time == b.last_access_time == before + 1


def test_split_upper_part_is_newer_than_lower_part():
    # _split_node creates the upper TreeNode (fresh monotonic stamps) after the walk stamped
    # the lower one
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    (orig,) = cache.root_node.children.values()
    upper = match(cache, [1, 2]).last_device_node
    assert upper.last_access_time > orig.last_access_time
    assert upper.creation_time > orig.creation_time


def test_lru_evicts_the_least_recently_matched_leaf():
    # RadixCache.evict: heap over evictable_leaves by LRUStrategy (last_access_time)
    cache, alloc = make()
    va, _ = put(cache, alloc, [1, 1, 1])
    vb, _ = put(cache, alloc, [2, 2, 2])
    vc, _ = put(cache, alloc, [3, 3, 3])
    match(cache, [1, 1, 1])                             # A is now the newest
    free_before = alloc.available_size()
    res = cache.evict(EvictParams(num_tokens=4))       # B (3) then C (3): 6 >= 4
    assert res.num_tokens_evicted == 6
    assert set(cache.root_node.children) == {1}
    assert alloc.available_size() == free_before + 6
    assert alloc.free_pages[-6:].tolist() == vb.tolist() + vc.tolist()     # freed in eviction order


def test_evict_pushes_a_parent_that_becomes_a_leaf():
    # RadixCache.evict: after deleting x, its parent is pushed if childless and unlocked
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [9])
    match(cache, [9])
    res = cache.evict(EvictParams(num_tokens=5))
    assert res.num_tokens_evicted == 5                 # [4,5] then its parent [1,2,3]
    assert list(cache.root_node.children) == [9]


def test_locks_move_tokens_between_evictable_and_protected():
    # RadixCache.inc_lock_ref / dec_lock_ref: only 0 <-> 1 transitions move sizes; delta
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 3, 4, 5])
    leaf = match(cache, [1, 2, 3, 4, 5]).last_device_node
    assert cache.inc_lock_ref(leaf).delta == -5
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)
    assert cache.inc_lock_ref(leaf.parent).delta == 0
    assert leaf.parent.lock_ref == 2 and leaf.lock_ref == 1
    assert cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 0
    assert cache.dec_lock_ref(leaf).delta == 2
    assert (cache.evictable_size(), cache.protected_size()) == (2, 3)
    assert cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 2    # parent still locked
    assert cache.dec_lock_ref(leaf.parent).delta == 3
    assert cache.evictable_leaves == {leaf.parent}


def test_split_copies_lock_count():
    # _split_node: new_node.lock_ref = child.lock_ref, sizes unchanged
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    node = match(cache, [1, 2, 3, 4]).last_device_node
    cache.inc_lock_ref(node)
    upper = match(cache, [1, 2]).last_device_node
    assert upper.lock_ref == 1 and cache.protected_size() == 4
    cache.dec_lock_ref(node)
    assert upper.lock_ref == 0 and cache.evictable_size() == 4 and cache.protected_size() == 0


def test_dec_lock_ref_below_zero_is_not_refused():
    # RadixCache.dec_lock_ref has no guard: unlocking an unlocked node goes negative
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    node = match(cache, [1, 2]).last_device_node
    cache.dec_lock_ref(node)
    assert node.lock_ref == -1 and cache.evictable_size() == 2


def test_sizes_and_flatten():
    # total_size counts device tokens; all_values_flatten lists every node's value
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4, 5])
    assert cache.total_size() == 5 == device_tokens(cache)
    assert sorted(cache.all_values_flatten().tolist()) == sorted(match(cache, [1, 2, 3]).device_indices.tolist()
                                                                 + match(cache, [1, 2, 4, 5]).device_indices[2:].tolist())
    assert "len=2" in cache.format_tree()


def test_disabled_cache_does_nothing():
    # RadixCache with disable=True: empty matches, prefix_len 0, nothing evicted
    cache, alloc = make(disable=True)
    assert cache.insert(InsertParams(key=RadixKey([1, 2]), value=alloc.alloc(2))).prefix_len == 0
    assert len(match(cache, [1, 2]).device_indices) == 0
    assert cache.evict(EvictParams(5)).num_tokens_evicted == 0
    assert cache.inc_lock_ref(cache.root_node).delta == 0


def test_root_and_reset():
    # RadixCache.reset: root locked once with empty value and host value, lowest priority
    cache, alloc = make()
    put(cache, alloc, [1])
    cache.reset()
    root = cache.root_node
    assert root.lock_ref == 1 and not root.evicted and root.backuped and root.children == {}
    assert root.priority < -(2 ** 40)
    assert cache.evictable_size() == cache.protected_size() == 0


def test_protect_host_counts_and_refuses_underflow():
    # TreeNode.protect_host / release_host
    node = TreeNode(1)
    node.protect_host()
    node.release_host()
    with pytest.raises(CacheStateError):
        node.release_host()


@pytest.mark.parametrize("name", ["lru", "LFU", "fifo", "mru", "filo", "priority", "slru"])
def test_eviction_strategies(name):
    # evict_policy.py: the priority tuple of each strategy
    n = TreeNode(1, priority=3, last_access_time=7, creation_time=2)
    n.hit_count = 4
    expected = {"lru": 7, "lfu": (4, 7), "fifo": 2, "mru": -7, "filo": -2, "priority": (3, 7), "slru": (1, 7)}
    assert get_eviction_strategy(name).get_priority(n) == expected[name.lower()]


def test_bad_inputs():
    with pytest.raises(InputError):
        get_eviction_strategy("random")
    with pytest.raises(InputError):
        RadixCache(CacheInitParams(page_size=0))
    clock = LogicalClock()
    assert [clock.tick(), clock.tick()] == [1, 2]
