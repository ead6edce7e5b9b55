"""A request's life in the prefix cache: ``Req``, ``ReqToTokenPool``, ``cache_unfinished_req`` and
``cache_finished_req`` (SGLang 0.5.14's ``radix_cache.py``; ``memory_pool.py``'s ``ReqToTokenPool``;
``schedule_batch.py``'s ``Req``).  Each case is written from SGLang's code: which slots each call
frees, what it writes into the request's row, where the lock ends up.  The differential harness
(tests/differential) runs the same calls against SGLang's own cache."""
from __future__ import annotations

import numpy as np
import pytest

from sim.cache import CacheInitParams, InsertParams, MatchPrefixParams, RadixCache, RadixKey, Req
from sim.cache.radix import CacheAssertionError
from sim.errors import InputError
from sim.pools import PagedTokenToKVPoolAllocator, ReqPoolError, ReqToTokenPool, TokenToKVPoolAllocator


def _cache(page: int = 1, size: int = 64, **kw):
    alloc = TokenToKVPoolAllocator(size) if page == 1 else PagedTokenToKVPoolAllocator(size, page)
    pool = ReqToTokenPool(8, size)
    cache = RadixCache(CacheInitParams(page_size=page, token_to_kv_pool_allocator=alloc, req_to_token_pool=pool,
                                       **kw))
    return cache, alloc, pool


def _admit(cache, alloc, pool, tokens, *, fill: int | None = None, extra=None):
    """Admit a request as the scheduler does: match (at most len - 1 tokens), lock the last node,
    take a row, allocate the new tokens' slots and write the row."""
    req = Req(f"r{len(pool.free_slots)}", tokens, extra_key=extra)
    req.init_next_round_input(cache)
    cache.inc_lock_ref(req.last_node)
    assert pool.alloc([req]) == [req.req_pool_idx]
    req.fill_len = len(tokens) if fill is None else fill
    _extend(cache, alloc, pool, req)
    return req


def _extend(cache, alloc, pool, req):
    """Slots for ``[len(prefix_indices), fill_len)`` (alloc_extend from the row's last slot)."""
    pre, seq = len(req.prefix_indices), req.fill_len
    if cache.page_size == 1:
        new = alloc.alloc(seq - pre)
    else:
        last = int(pool.req_to_token[req.req_pool_idx, pre - 1]) if pre else -1
        new = alloc.alloc_extend([pre], [pre], [seq], [seq], [last], seq - pre)
    assert new is not None
    pool.write((req.req_pool_idx, slice(0, pre)), req.prefix_indices)
    pool.write((req.req_pool_idx, slice(pre, seq)), new)
    req.kv_committed_len = seq
    return new


def _free_set(alloc) -> set[int]:
    """The free slots (token allocator) or free pages (paged)."""
    return set(alloc.free_pages.tolist())


def test_finished_request_enters_the_tree_and_releases_its_lock():
    cache, alloc, pool = _cache()
    req = _admit(cache, alloc, pool, list(range(10, 18)))
    slots = pool.req_to_token[req.req_pool_idx, :8].tolist()
    before = alloc.available_size()
    cache.cache_finished_req(req)
    assert alloc.available_size() == before                 # nothing duplicated, no tail
    m = cache.match_prefix(MatchPrefixParams(RadixKey(list(range(10, 18)))))
    assert m.device_indices.tolist() == slots
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    with pytest.raises(CacheAssertionError, match="already freed"):
        cache.cache_finished_req(req)                       # committed KV is handed over once


def test_duplicates_of_the_tree_are_freed_and_the_tree_keeps_its_own_slots():
    """Two requests computed the same tokens; the one finishing second frees its copies
    ``[cache_protected_len, prefix_len)``: here all of them (it matched nothing at admission)."""
    cache, alloc, pool = _cache()
    a = _admit(cache, alloc, pool, [1, 2, 3, 4, 5, 6])
    b = _admit(cache, alloc, pool, [1, 2, 3, 4, 5, 6])
    a_slots = pool.req_to_token[a.req_pool_idx, :6].tolist()
    b_slots = pool.req_to_token[b.req_pool_idx, :6].tolist()
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert set(b_slots) <= _free_set(alloc) and not set(a_slots) & _free_set(alloc)
    assert cache.match_prefix(MatchPrefixParams(RadixKey([1, 2, 3, 4, 5, 6]))).device_indices.tolist() == a_slots


def test_a_matched_prefix_is_protected_and_not_freed_again():
    """A request that matched 4 tokens owns only its new ones: finishing frees nothing the tree owns."""
    cache, alloc, pool = _cache()
    a = _admit(cache, alloc, pool, [1, 2, 3, 4, 5])
    cache.cache_finished_req(a)
    b = _admit(cache, alloc, pool, [1, 2, 3, 4, 5, 9, 9])    # matches 5 (up to len - 1 = 6 may match)
    assert b.cache_protected_len == 5 and len(b.prefix_indices) == 5
    assert cache.protected_size() == 5                       # b's lock on the matched path
    free_before = alloc.available_size()
    cache.cache_finished_req(b)
    assert alloc.available_size() == free_before             # its two new tokens went into the tree
    assert cache.protected_size() == 0 and cache.evictable_size() == 7


def test_match_at_admission_leaves_one_token_to_compute():
    cache, alloc, pool = _cache()
    cache.cache_finished_req(_admit(cache, alloc, pool, [7, 7, 7, 7]))
    r = Req("again", [7, 7, 7, 7])
    r.init_next_round_input(cache)
    assert len(r.prefix_indices) == 3 and r.extend_input_len == 1 and r.cache_protected_len == 3


def test_paged_finish_frees_the_unaligned_tail():
    """Page 4, 10 committed tokens: the key is 8 tokens; slots 8 and 9 (the partial third
    page) are freed, the first two pages stay in the tree."""
    cache, alloc, pool = _cache(page=4)
    req = _admit(cache, alloc, pool, list(range(100, 110)))
    row = pool.req_to_token[req.req_pool_idx, :10].tolist()
    cache.cache_finished_req(req)
    assert row[8] // 4 in _free_set(alloc)
    assert cache.evictable_size() == 8
    m = cache.match_prefix(MatchPrefixParams(RadixKey(list(range(100, 110)))))
    assert m.device_indices.tolist() == row[:8]


def test_not_inserted_frees_the_request_own_slots():
    cache, alloc, pool = _cache()
    req = _admit(cache, alloc, pool, [3, 1, 4, 1, 5])
    total = alloc.available_size()
    cache.cache_finished_req(req, is_insert=False)
    assert alloc.available_size() == total + 5 and cache.total_size() == 0
    cache2, alloc2, pool2 = _cache(disable_finished_insert=True)
    req2 = _admit(cache2, alloc2, pool2, [3, 1, 4])
    cache2.cache_finished_req(req2)                          # the flag wins over is_insert
    assert cache2.total_size() == 0


def test_disabled_cache_frees_every_committed_slot():
    cache, alloc, pool = _cache(disable=True)
    req = Req("d", [1, 2, 3])
    pool.alloc([req])
    req.fill_len = 3
    _extend(cache, alloc, pool, req)
    before = alloc.available_size()
    cache.cache_finished_req(req)
    assert alloc.available_size() == before + 3


def test_chunked_request_between_chunks():
    """Page 4, a 13-token prompt in chunks of 6: after the first chunk the tree holds 4 tokens
    (one page), the request keeps the partial page's two slots in ``prefix_indices`` and the
    lock moves to the new node; the next chunk extends from there."""
    cache, alloc, pool = _cache(page=4)
    tokens = list(range(50, 63))
    req = _admit(cache, alloc, pool, tokens, fill=6)
    first = pool.req_to_token[req.req_pool_idx, :6].tolist()
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 4
    assert req.prefix_indices.tolist() == first              # tree's 4 (its own) + the partial page's 2
    assert req.last_node is not cache.root_node and req.last_node.lock_ref == 1
    assert cache.protected_size() == 4
    req.fill_len = 12
    _extend(cache, alloc, pool, req)
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 12 and cache.protected_size() == 12
    req.fill_len = 13
    _extend(cache, alloc, pool, req)
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and cache.evictable_size() == 12


def test_unfinished_request_continues_on_the_tree_slots_another_request_inserted():
    """Another request inserted the same first page meanwhile: the chunk's own copies of it are
    freed and the tree's slots are written into the row."""
    cache, alloc, pool = _cache(page=4)
    tokens = [9] * 4 + [8] * 4
    a = _admit(cache, alloc, pool, tokens, fill=4)
    b = _admit(cache, alloc, pool, tokens[:4] + [1])        # matched nothing: a has not inserted yet
    b_page = pool.req_to_token[b.req_pool_idx, :4].tolist()
    cache.cache_finished_req(b)                              # b's first page enters the tree
    a_page = pool.req_to_token[a.req_pool_idx, :4].tolist()
    cache.cache_unfinished_req(a, chunked=True)
    assert pool.req_to_token[a.req_pool_idx, :4].tolist() == b_page
    assert a_page[0] // 4 in _free_set(alloc)
    assert a.prefix_indices.tolist() == b_page and a.cache_protected_len == 4


def test_eagle_finish_caches_bigrams():
    """EAGLE: N committed tokens make N - 1 bigram units; the last slot is the tail and is freed."""
    cache, alloc, pool = _cache(is_eagle=True)
    req = _admit(cache, alloc, pool, [1, 2, 3, 4, 5])
    last = int(pool.req_to_token[req.req_pool_idx, 4])
    cache.cache_finished_req(req)
    assert cache.evictable_size() == 4 and last in _free_set(alloc)


def test_extra_key_namespaces_a_finished_request():
    cache, alloc, pool = _cache()
    cache.cache_finished_req(_admit(cache, alloc, pool, [1, 2, 3, 4], extra="lora-a"))
    plain = Req("p", [1, 2, 3, 4, 5])
    plain.init_next_round_input(cache)
    assert len(plain.prefix_indices) == 0
    salted = Req("s", [1, 2, 3, 4, 5], extra_key="lora-a")
    salted.init_next_round_input(cache)
    assert len(salted.prefix_indices) == 4


def test_errors_say_what_is_missing():
    alloc = TokenToKVPoolAllocator(16)
    cache = RadixCache(CacheInitParams(token_to_kv_pool_allocator=alloc))
    req = Req("x", [1, 2])
    with pytest.raises(InputError, match="req_to_token_pool"):
        cache.cache_unfinished_req(req)
    cache, alloc, pool = _cache()
    with pytest.raises(InputError, match=r"req\.req_pool_idx"):
        cache.cache_finished_req(Req("y", [1]))
    with pytest.raises(InputError, match="origin_input_ids"):
        Req("z", ["a"])


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(2, 8)
    a, b, c = Req("a", [1]), Req("b", [1]), Req("c", [1])
    assert pool.alloc([a, b]) == [1, 2] and pool.available_size() == 0
    assert pool.alloc([c]) is None and c.req_pool_idx is None
    with pytest.raises(ReqPoolError, match="chunked nor has committed KV"):
        pool.alloc([a])
    a.kv_committed_len = 1
    assert pool.alloc([a]) == [1]                           # keeps its row
    pool.free(a)
    assert a.req_pool_idx is None and pool.free_slots == [1]
    with pytest.raises(ReqPoolError, match="holds no row"):
        pool.free(a)
    with pytest.raises(InputError, match="indices"):
        pool.write((2, slice(0, 3)), np.arange(5))
    pool.clear()
    assert pool.free_slots == [1, 2]
    with pytest.raises(InputError, match="size"):
        ReqToTokenPool(0, 8)


def test_a_session_caches_requests_through_hicache():
    """The HiCache tree of a CacheSession takes requests too (its own insert: write-through
    backups start when the finished request enters the tree)."""
    from sim.cache import CacheSession

    s = CacheSession({"model": "mla", "layers": 2, "device_tokens": 64, "max_running_requests": 4})
    cache, alloc, pool = s.cache, s.allocator, s.req_to_token_pool
    req = _admit(cache, alloc, pool, list(range(20, 32)))
    s.store_kv(pool.req_to_token[req.req_pool_idx, :12].astype(np.int64), owner=1)
    cache.cache_finished_req(req)
    pool.free(req)
    assert s.tree.evictable_size() + s.tree.protected_size() == 12
    assert s.controller.writes_started >= 1
    with pytest.raises(InputError, match="max_running_requests"):
        CacheSession({"max_running_requests": 0})


def test_records_take_sglangs_call_shapes():
    """Code written against SGLang's caches builds kvrace's records unchanged: the fields the
    full-attention caches ignore (Mamba, SWA, process groups, metrics) are accepted, with
    SGLang's defaults, and change nothing."""
    from sim.cache import EvictParams
    from sim.cache.records import IncLockRefResult

    alloc = TokenToKVPoolAllocator(32)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                       page_size=1, tp_cache_group=None, eviction_policy="lru",
                                       enable_metrics=False, enable_kv_cache_events=False, pp_rank=0, pp_size=1))
    slots = alloc.alloc(4)
    res = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=slots, prev_prefix_len=0,
                                    swa_evicted_seqlen=0, chunked=False, priority=0))
    assert res.prefix_len == 0 and res.mamba_exist is False
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 9]), cow_mamba=False, req=None))
    assert m.device_indices.tolist() == slots[:3].tolist() and m.swa_host_hit_length == 0
    assert m.cache_protected_len is None
    lock = cache.inc_lock_ref(m.last_device_node)
    assert isinstance(lock, IncLockRefResult) and lock.to_dec_params().swa_uuid_for_lock is None
    cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
    out = cache.evict(EvictParams(num_tokens=4, swa_num_tokens=0, mamba_num=0))
    assert out.num_tokens_evicted == 4 and out.swa_num_tokens_evicted == 0


def test_base_protocol_of_a_full_attention_cache():
    """The answers SGLang's BasePrefixCache gives (its RadixCache keeps them); the plain
    cache refuses host-tier calls as SGLang's does (NotImplementedError)."""
    cache, alloc, pool = _cache()
    cache.cache_finished_req(_admit(cache, alloc, pool, [1, 2, 3]))
    assert cache.is_tree_cache() and not cache.is_chunk_cache()
    assert not (cache.supports_swa() or cache.supports_mamba() or cache.supports_streaming_session())
    assert cache.full_evictable_size() == 0 and cache.session_held_tokens() == 0 and cache.take_events() == []
    assert cache.available_and_evictable_str() == (
        f"Available tokens: {alloc.available_size() + 3} (available_size={alloc.available_size()} "
        "+ evictable_size=3)\n")
    for name in ("ready_to_load_host_cache", "check_hicache_events"):
        with pytest.raises(NotImplementedError, match="HiRadixCache"):
            getattr(cache, name)()


def test_create_simulated_tree_uses_token_ids_as_values():
    tree = RadixCache.create_simulated()
    tree.insert(InsertParams(key=RadixKey([5, 6, 7])))
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey([5, 6, 8])))
    assert m.device_indices.tolist() == [5, 6] and type(tree) is RadixCache
