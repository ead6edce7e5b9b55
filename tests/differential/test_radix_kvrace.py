"""The plain-RadixCache comparison's own parts on kvrace alone (no SGLang needed; default
tier): the sequences ``generate_radix`` draws, and the kvrace side with HiCache off.  The
slow test ``test_plain_radix_cache_agrees_op_by_op`` runs them against SGLang's
``RadixCache``."""
from __future__ import annotations

from tests.differential.compare import observe
from tests.differential.kvrace_side import KvraceSide
from tests.differential.ops import RADIX_OPS, SideDriver, generate_radix
from tests.differential.sglang_side import DiffConfig

HOST_FIELDS = {"evictable_host_leaves", "ongoing_write_through", "ongoing_load_back", "acks", "load_queue",
               "write_queue", "producer_index", "slots_done", "host_free"}


def test_generated_sequences_are_seeded_and_keep_handles_consistent():
    for seed in range(20):
        ops = generate_radix(seed, 150, page_size=1, device_tokens=48)
        assert ops == generate_radix(seed, 150, page_size=1, device_tokens=48)
        assert {op["op"] for op in ops} <= set(RADIX_OPS)
        held = set()
        for op in ops:
            if op["op"] == "lock":
                assert op["h"] not in held and len(held) < 3
                held.add(op["h"])
            elif op["op"] == "unlock":
                held.remove(op["h"])
            elif op["op"] == "flush":
                assert not held                     # flush_cache runs on an idle cache
        assert not held                             # every sequence ends released
    kinds = [op["op"] for seed in range(20) for op in generate_radix(seed, 150, page_size=64, device_tokens=512)]
    assert all(k in kinds for k in RADIX_OPS)
    extras = {op.get("extra") for seed in range(20) for op in generate_radix(seed, 150)}
    assert extras == {None, "a", "b"}
    assert not any("extra" in op for op in generate_radix(3, 150, extra_keys=False))


def test_the_kvrace_side_without_hicache_is_the_plain_tree():
    from sim.cache.hiradix import HiRadixCache
    from sim.cache.radix import RadixCache

    side = KvraceSide(DiffConfig(hicache=False))
    assert type(side.tree) is RadixCache and not isinstance(side.tree, HiRadixCache)
    assert side.tree.token_to_kv_pool_allocator is side.allocator
    d = SideDriver(side)
    ops = [{"op": "insert", "tokens": [1, 2, 3, 4]}, {"op": "insert", "tokens": [1, 2, 3, 4], "extra": "a"},
           {"op": "lock", "tokens": [1, 2, 9], "h": 0}, {"op": "evict", "n": 48}]
    obs = [observe(side, d.apply(op), side.take_moves()) for op in ops]
    assert all(not (HOST_FIELDS & set(o)) for o in obs)
    # the namespaced copy is its own subtree, named after its extra key
    assert [t[0] for t in obs[1]["tree"]] == [[1, 2, 3, 4], ["a", 1, 2, 3, 4]]
    # the lock split [1, 2, 3, 4] at [1, 2] and pinned it; the evict freed the rest
    assert obs[2]["result"][0] == "locked" and obs[2]["protected_size"] == 2
    assert obs[3]["result"] == ("evicted", 6)
    freed = sorted(x for m in obs[3]["moves"] if m[0] == "device_free" for x in m[1])
    assert len(freed) == 6
    assert [t[0] for t in obs[3]["tree"]] == [[1, 2]]


def test_an_eagle_insert_holds_one_slot_per_bigram():
    side = KvraceSide(DiffConfig(hicache=False, is_eagle=True))
    d = SideDriver(side)
    before = side.allocator.available_size()
    assert d.apply({"op": "insert", "tokens": [5, 6, 7, 8, 9]}) == ("inserted", 0)
    assert before - side.allocator.available_size() == 4     # 5 tokens, 4 bigrams
    assert side.tree.evictable_size() == 4
    got = d.apply({"op": "match", "tokens": [5, 6, 7, 1]})
    assert got[0] == "match" and len(got[1]) == 2             # bigrams (5, 6) and (6, 7)
