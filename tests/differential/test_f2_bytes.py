"""FINDINGS.md F2 on kvrace's byte model (no SGLang needed; default tier).

SGLang 0.5.14, write_back, host pool nearly full: a load-back whose own eviction backs up
another request's KV evicts its source nodes from the host and hands their host slots to
that backup, then loads from them.  kvrace's HiRadixCache takes the same steps (the slow
differential test checks that op by op against SGLang); here the bytes show the result:
the request that hit prefix A on the host receives request C's KV for the slots C's backup
overwrote.
"""
from __future__ import annotations

import numpy as np

from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.cache.session import CacheSession


def _cache(session, tokens, owner):
    """A finished request: the forward pass writes its KV, then the tree takes it."""
    cache = session.cache
    if session.allocator.available_size() < len(tokens):
        cache.evict(EvictParams(num_tokens=len(tokens)))
    slots = session.allocator.alloc(len(tokens))
    session.store_kv(slots, owner=owner)
    cache.insert(InsertParams(key=RadixKey(np.asarray(tokens, dtype=np.int64)), value=slots))
    return slots


def test_load_back_delivers_another_requests_kv():
    s = CacheSession({"model": "mla", "layers": 2, "page_size": 1, "device_tokens": 48, "hicache_ratio": 1.1,
                      "layout": "layer_first", "io_backend": "kernel", "write_policy": "write_back",
                      "kv_lora_rank": 16, "qk_rope_head_dim": 8})
    c = s.cache
    a, b, fill = [1] * 20, [2] * 28, [3] * 48
    _cache(s, a, owner=101)
    c.evict(EvictParams(num_tokens=48))           # A backed up (host 0..19), host-only
    _cache(s, b, owner=102)
    c.evict(EvictParams(num_tokens=28))           # B backed up (host 20..47), host-only
    _cache(s, fill, owner=103)                    # C fills the device; 5 host slots free
    m = c.match_prefix(MatchPrefixParams(key=RadixKey(np.asarray(a, dtype=np.int64))))
    assert m.host_hit_length == 20
    c.inc_lock_ref(m.last_device_node)
    slots, node = c.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                      host_hit_length=m.host_hit_length))
    c.dec_lock_ref(m.last_device_node)
    c.inc_lock_ref(node)
    # the loaded node is no longer in the tree: evict_host removed it during the load-back
    assert node.parent.children.get(node.key.child_key(1)) is not node
    assert c.ready_to_load_host_cache() == 0
    s.wait_idle()
    owners = s.owners_of("kv_buffer", 0, slots)
    # host slots 0..14 went to C's backup before the load read them
    assert owners == [103] * 15 + [101] * 5
