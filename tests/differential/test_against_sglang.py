"""kvrace's HiRadixCache against SGLang 0.5.14's own, op by op, on random sequences (and
the plain RadixCache, HiCache off, against SGLang's ``RadixCache``).

Skipped unless torch and SGLang 0.5.14 import (tests/differential/README.md says how to
get them); slow tier.  Each test runs N seeded sequences for one configuration on both
caches and asserts the canonical observations (tests/differential/compare.py) are equal
after every op; a failure prints the op sequence up to the divergence and the differing
fields.
"""
from __future__ import annotations

import pytest

from tests.differential.sglang_side import DiffConfig, device_tokens_for, sglang_available

_ok, _why = sglang_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _ok, reason=_why or "SGLang 0.5.14 not importable")]

N_SEQUENCES = 4
LENGTH = 50

CONFIGS = [
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), write_policy=pol, layout=lay, io_backend=io)
    for ps in (1, 64)
    for pol in ("write_through", "write_through_selective", "write_back")
    for lay, io in (("layer_first", "kernel"), ("page_first_direct", "direct"))
] + [
    # host pool barely larger than the device pool: backups fail, evict_host runs inside them
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), write_policy=pol, hicache_ratio=1.1)
    for ps in (1, 64) for pol in ("write_through", "write_back")
] + [
    # allocators with need_sort (PD disaggregation): frees go to release_pages, merged sorted
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), layout="page_first", need_sort=True)
    for ps in (1, 64)
] + [
    # DSA: SGLang's DSATokenToKVPool + HostPoolGroup (latent anchor, index-K sidecar) +
    # HybridCacheController
    DiffConfig(model="dsa", page_size=64, device_tokens=512, write_policy=pol, layout=lay, io_backend=io)
    for pol in ("write_through", "write_back")
    for lay, io in (("page_first", "kernel"), ("page_first_direct", "direct"))
] + [
    # the other eviction strategies (hit counts, creation order, priorities, SLRU segments)
    DiffConfig(page_size=1, device_tokens=48, write_policy="write_through_selective", eviction_policy=e)
    for e in ("lfu", "fifo", "mru", "filo", "priority", "slru")
] + [
    # the incident's HiCache page (256 tokens), and a page of 16
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), write_policy=pol, layout=lay, io_backend=io)
    for ps, pol, lay, io in ((256, "write_through", "page_first", "kernel"),
                             (256, "write_back", "page_first_direct", "direct"),
                             (16, "write_through_selective", "layer_first", "kernel"))
]


def _report(cfg, ops, div) -> str:
    from tests.differential.compare import format_diff

    i, op, d, _a, _b = div
    lines = [f"{cfg.describe()}: diverged at op {i} {op}"]
    lines += [f"  {k:3d} {o}" for k, o in enumerate(ops[:i + 1])]
    return "\n".join(lines) + "\n" + format_diff(d)


def _id(c) -> str:
    if not c.hicache:
        return (f"radix-p{c.page_size}" + ("-eagle" if c.is_eagle else "") + ("-sorted" if c.need_sort else "")
                + f"-{c.eviction_policy}")
    return (f"{c.model}-p{c.page_size}-{c.write_policy}-{c.layout}-{c.io_backend}-r{c.hicache_ratio}"
            + ("-eagle" if c.is_eagle else "") + ("-sorted" if c.need_sort else "") + (f"-{c.eviction_policy}" if c.eviction_policy != "lru" else ""))


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_random_sequences_agree_op_by_op(cfg):
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate

    for seed in range(N_SEQUENCES):
        ops = generate(seed, LENGTH, page_size=cfg.page_size, device_tokens=cfg.device_tokens)
        res = run_pair(cfg, ops)
        assert not res, _report(cfg, ops, res[0])


#: a few configurations with extra_key namespaces in their sequences (LoRA ids, cache salts)
EXTRA_KEY_CONFIGS = [c for c in CONFIGS if c.eviction_policy == "lru" and not c.need_sort and c.hicache_ratio == 2.0
                     and (c.write_policy, c.layout) in (("write_back", "layer_first"), ("write_through", "page_first"),
                                                        ("write_through_selective", "page_first_direct"))]


@pytest.mark.parametrize("cfg", EXTRA_KEY_CONFIGS, ids=_id)
def test_namespaced_sequences_agree_op_by_op(cfg):
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate

    for seed in range(N_SEQUENCES):
        ops = generate(seed, 2 * LENGTH, page_size=cfg.page_size, device_tokens=cfg.device_tokens, extra_keys=True)
        assert any("extra" in op for op in ops)
        res = run_pair(cfg, ops)
        assert not res, _report(cfg, ops, res[0])


#: EAGLE's bigram keys with HiCache: the host tier's nodes, backups and load-backs over bigram keys
EAGLE_HICACHE_CONFIGS = [
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), write_policy=pol, layout=lay, io_backend=io,
               is_eagle=True, eviction_policy=ev)
    for ps, pol, lay, io, ev in ((1, "write_through", "layer_first", "kernel", "lru"),
                                 (16, "write_through_selective", "page_first_direct", "direct", "slru"),
                                 (64, "write_back", "page_first", "kernel", "lru"))
]


@pytest.mark.parametrize("cfg", EAGLE_HICACHE_CONFIGS, ids=_id)
def test_eagle_with_hicache_agrees_op_by_op(cfg):
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate, generate_requests

    for seed in range(N_SEQUENCES):
        for ops in (generate(seed, 2 * LENGTH, page_size=cfg.page_size, device_tokens=cfg.device_tokens,
                             extra_keys=True),
                    generate_requests(seed, 2 * LENGTH, page_size=cfg.page_size, device_tokens=cfg.device_tokens)):
            res = run_pair(cfg, ops)
            assert not res, _report(cfg, ops, res[0])


@pytest.mark.parametrize("name", ["fourth_load", "split_pending_backup", "load_back_evicts_its_source"])
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.hicache_ratio == 2.0 and not c.need_sort
                                 and c.eviction_policy == "lru"], ids=_id)
def test_scenarios_agree_op_by_op(cfg, name):
    """The hand-written sequences: a fourth load while producer slot 0 is busy (both raise
    an AssertionError-kind error and leave the same state), and a split of a node whose
    backup is in flight."""
    from tests.differential.compare import run_pair
    from tests.differential.ops import SCENARIOS

    ops = SCENARIOS[name](cfg.page_size, cfg.device_tokens)
    res = run_pair(cfg, ops)
    assert not res, _report(cfg, ops, res[0])


def test_fourth_load_asserts_in_sglang():
    """The scenario really reaches SGLang's producer-slot assert (so its agreement means
    something)."""
    from tests.differential.ops import SideDriver, scenario_fourth_load
    from tests.differential.sglang_side import SGLangSide

    side = SGLangSide(DiffConfig())
    d = SideDriver(side)
    results = [d.apply(op) for op in scenario_fourth_load(1, 48)]
    assert ("raise", "AssertionError") in results


def test_harness_detects_a_changed_rule(monkeypatch):
    """The comparison can fail: a kvrace tree with a lower load-back threshold than
    SGLang's hard-coded 10 diverges on some sequence (a load-back of 1..9 host tokens)."""
    import tests.differential.kvrace_side as ks
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate

    real_init = ks.KvraceSide.__init__

    def init(self, cfg):
        real_init(self, cfg)
        self.tree.load_back_threshold = 1

    monkeypatch.setattr(ks.KvraceSide, "__init__", init)
    cfg = DiffConfig(page_size=1, device_tokens=48)
    fields = set()
    for seed in range(10):
        res = run_pair(cfg, generate(seed, 80, page_size=1, device_tokens=48))
        if res:
            fields |= {f for f, _, _ in res[0][2]}
            break
    assert fields, "no sequence exercised a short load-back"
    assert fields & {"result", "tree", "moves"}


def test_sglang_side_is_sglangs_code():
    """The SGLang side runs SGLang's classes, not look-alikes."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost

    from tests.differential.sglang_side import SGLangSide

    side = SGLangSide(DiffConfig())
    assert type(side.cache) is HiRadixCache
    assert type(side.controller) is HiCacheController
    assert type(side.host_pool) is MLATokenToKVPoolHost
    assert side.host_pool.size == int(48 * 2.0) // 1 + 1   # page_num = size // page_size + 1


# ---------------------------------------------------------------- FINDINGS.md F2

F2_CONFIGS = [DiffConfig(page_size=1, device_tokens=48, write_policy="write_back", hicache_ratio=1.1),
              DiffConfig(page_size=64, device_tokens=512, write_policy="write_back", hicache_ratio=1.1)]


@pytest.mark.parametrize("cfg", F2_CONFIGS, ids=_id)
def test_f2_sglang_load_back_reads_host_slots_its_own_eviction_reused(cfg):
    """SGLang 0.5.14 itself: the load-back of A frees A's host slots (evict_host inside the
    write-back its own eviction started), hands them to C's backup, and then loads from
    them; A's node is in ongoing_load_back but no longer in the tree."""
    from tests.differential.compare import observe
    from tests.differential.ops import SideDriver, scenario_load_back_evicts_its_source
    from tests.differential.sglang_side import SGLangSide

    ops = scenario_load_back_evicts_its_source(cfg.page_size, cfg.device_tokens)
    side = SGLangSide(cfg)
    d = SideDriver(side)
    seen = []
    for op in ops[:7]:                                   # up to and including ready
        seen.append(observe(side, d.apply(op), side.take_moves()))
    load_op = seen[5]
    assert load_op["ongoing_load_back"] == ["<detached>"]
    freed = [set(m[1]) for m in load_op["moves"] if m[0] == "host_free"]
    backup_host = {h for m in load_op["copies"] if m[0] == "write_copy" for h in m[1]}
    load_host = {h for m in seen[6]["copies"] if m[0] == "load_copy" for h in m[1]}
    assert load_host in freed                            # A's own host slots were freed ...
    assert load_host & backup_host                       # ... C's backup wrote into them ...
    assert seen[6]["result"][0] == "producer"            # ... and the load reads them after


@pytest.mark.parametrize("cfg", F2_CONFIGS, ids=_id)
def test_f2_kvrace_reproduces_it_up_to_the_crash(cfg):
    """kvrace's tree takes the same steps (same slots freed, reused and loaded, the same
    detached node) through every op before the final evict_host."""
    from tests.differential.compare import run_pair
    from tests.differential.ops import scenario_load_back_evicts_its_source

    ops = scenario_load_back_evicts_its_source(cfg.page_size, cfg.device_tokens)
    res = run_pair(cfg, ops[:-1])
    assert not res, _report(cfg, ops, res[0])


@pytest.mark.parametrize("cfg", F2_CONFIGS, ids=_id)
def test_f2_crash_has_sglangs_exception_kind(cfg):
    """At the detached node SGLang's evict_host fails an assert; kvrace raises
    CacheAssertionError, an AssertionError too (FINDINGS.md F2)."""
    from tests.differential.compare import run_pair
    from tests.differential.ops import scenario_load_back_evicts_its_source

    ops = scenario_load_back_evicts_its_source(cfg.page_size, cfg.device_tokens)
    res = run_pair(cfg, ops)
    assert not res, _report(cfg, ops, res[0])


#: FINDINGS.md F3: the sequences of the 2026-12-03 eighteenth-session run that reached F2's
#: state and went on (seed, configuration): a node evicted a second time (SGLang frees its
#: None device value: AttributeError), and a load whose host indices repeat (torch's sort,
#: not stable, orders the tied pairs its own way on the direct backend's layer_first path)
F3_RUNS = [
    (1800154005, DiffConfig(page_size=64, device_tokens=512, write_policy="write_back", hicache_ratio=1.1,
                            layout=lay, io_backend=io, eviction_policy="filo"))
    for lay, io in (("layer_first", "kernel"), ("layer_first", "direct"))
] + [
    (1800154006, DiffConfig(page_size=64, device_tokens=512, write_policy="write_back", hicache_ratio=1.1,
                            layout="layer_first", io_backend="direct", eviction_policy="fifo")),
]


@pytest.mark.parametrize("seed,cfg", F3_RUNS, ids=lambda x: str(x) if isinstance(x, int) else _id(x))
def test_f3_past_f2_the_caches_still_agree(seed, cfg):
    """Past F2's double-owned host slots both caches go on alike: the second eviction of the
    detached node fails with SGLang's exception kind, and a load's tied host indices copy
    the same (host, device) pairs."""
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate

    ops = generate(seed, 250, page_size=cfg.page_size, device_tokens=cfg.device_tokens)
    res = run_pair(cfg, ops)
    assert not res, _report(cfg, ops, res[0])


# ---------------------------------------------------------------- the plain RadixCache (HiCache off)

#: SGLang's ``RadixCache`` over the same allocators: what a deployment with HiCache off (and
#: kvrace's engine then) caches in; every eviction policy, page 1 and 64, EAGLE bigram keys,
#: need_sort
RADIX_CONFIGS = [
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), hicache=False, eviction_policy=e,
               is_eagle=eagle, need_sort=sort)
    for ps in (1, 64)
    for e in ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
    for eagle, sort in ((False, False), (True, e == "lru"))
] + [DiffConfig(page_size=256, device_tokens=device_tokens_for(256), hicache=False, is_eagle=eagle) for eagle in (False, True)]


@pytest.mark.parametrize("cfg", RADIX_CONFIGS, ids=_id)
def test_plain_radix_cache_agrees_op_by_op(cfg):
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate_radix

    for seed in range(N_SEQUENCES):
        ops = generate_radix(seed, 2 * LENGTH, page_size=cfg.page_size, device_tokens=cfg.device_tokens)
        res = run_pair(cfg, ops)
        assert not res, _report(cfg, ops, res[0])


def test_plain_radix_side_is_sglangs_radix_cache():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from tests.differential.sglang_side import SGLangSide

    side = SGLangSide(DiffConfig(hicache=False, is_eagle=True))
    assert type(side.cache) is RadixCache and side.cache.is_eagle
    assert side.controller is None and side.host_pool is None


@pytest.mark.parametrize("mutant", ["evict_parent_not_pushed", "bigram_off"])
def test_harness_detects_a_changed_plain_radix_rule(monkeypatch, mutant):
    """The plain-cache comparison can fail: a kvrace tree whose eviction never goes on to a
    parent that became a leaf, or one that ignores EAGLE, diverges on some sequence."""
    import tests.differential.kvrace_side as ks
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate_radix

    real_init = ks.KvraceSide.__init__

    def init(self, cfg):
        real_init(self, cfg)
        if mutant == "bigram_off":
            self.tree.is_eagle = False
        else:
            tree = self.tree

            def evict(params):
                # the same frees, leaf by leaf, but a parent left childless stays
                from sim.cache.records import EvictResult

                leaves = sorted(tree.evictable_leaves, key=tree.eviction_strategy.get_priority)
                done = 0
                for x in leaves:
                    if done >= params.num_tokens:
                        break
                    tree.token_to_kv_pool_allocator.free(x.value)
                    done += len(x.value)
                    tree._delete_leaf(x)
                return EvictResult(num_tokens_evicted=done)

            tree.evict = evict

    monkeypatch.setattr(ks.KvraceSide, "__init__", init)
    cfg = DiffConfig(page_size=1, device_tokens=48, hicache=False, is_eagle=mutant == "bigram_off")
    for seed in range(10):
        if run_pair(cfg, generate_radix(seed, 120, page_size=1, device_tokens=48)):
            return
    pytest.fail(f"no sequence told the {mutant} mutant apart")


# ---------------------------------------------------------------- requests: cache_unfinished_req / cache_finished_req

#: a request's life through both caches (``ops.generate_requests``): SGLang's own ``Req`` and
#: ``ReqToTokenPool`` on its side, kvrace's on the other; HiCache on and off, chunked prefill,
#: decode, EAGLE, page 1 to 256 (the paged allocator's Triton kernels run in Triton's interpreter)
REQUEST_CONFIGS = [
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), hicache=False, is_eagle=eagle)
    for ps in (1, 16, 64) for eagle in (False, True)
] + [
    DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), write_policy=pol, layout=lay, io_backend=io)
    for ps, pol, lay, io in ((1, "write_through", "layer_first", "kernel"),
                             (1, "write_back", "page_first_direct", "direct"),
                             (16, "write_through_selective", "page_first", "kernel"),
                             (64, "write_through", "page_first", "kernel"),
                             (256, "write_back", "page_first", "kernel"))
] + [
    DiffConfig(page_size=1, device_tokens=48, write_policy="write_through", hicache_ratio=1.1),
    DiffConfig(model="dsa", page_size=64, device_tokens=512, layout="page_first"),
]


@pytest.mark.parametrize("cfg", REQUEST_CONFIGS, ids=_id)
def test_requests_agree_op_by_op(cfg):
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate_requests

    for seed in range(N_SEQUENCES):
        ops = generate_requests(seed, 3 * LENGTH, page_size=cfg.page_size, device_tokens=cfg.device_tokens,
                                hicache=cfg.hicache)
        res = run_pair(cfg, ops)
        assert not res, _report(cfg, ops, res[0])


def test_request_side_is_sglangs_req_and_pool():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from tests.differential.sglang_side import SGLangSide

    side = SGLangSide(DiffConfig())
    assert type(side.new_req("r", [1, 2])) is Req
    assert type(side.req_pool) is ReqToTokenPool and side.cache.req_to_token_pool is side.req_pool


@pytest.mark.parametrize("mutant", ["tail_kept", "row_not_rewritten", "lock_not_moved"])
def test_harness_detects_a_changed_request_rule(monkeypatch, mutant):
    """The request comparison can fail: a kvrace cache that keeps a finished request's
    unaligned tail (its last free skipped), one whose ``cache_unfinished_req`` leaves the row
    on the request's own slots, or one that moves the lock to the root instead of the new last
    node, diverges on some sequence."""
    import sys

    from sim.cache.radix import RadixCache
    from sim.pools.req_to_token import ReqToTokenPool
    from tests.differential.compare import run_pair
    from tests.differential.ops import generate_requests

    def called_from(name: str) -> bool:
        return sys._getframe(2).f_code.co_name == name

    if mutant == "tail_kept":
        real = RadixCache.cache_finished_req

        def finished(self, req, is_insert=True):
            alloc, calls = self.token_to_kv_pool_allocator, []
            real_free = alloc.free
            alloc.free = calls.append
            try:
                real(self, req, is_insert)
            finally:
                alloc.free = real_free
            for idx in calls[:-1]:                   # the last free, the tail's, is dropped
                real_free(idx)
        monkeypatch.setattr(RadixCache, "cache_finished_req", finished)
    elif mutant == "row_not_rewritten":
        real_write = ReqToTokenPool.write

        def write(self, indices, values):
            if not called_from("cache_unfinished_req"):
                real_write(self, indices, values)
        monkeypatch.setattr(ReqToTokenPool, "write", write)
    else:
        real_inc = RadixCache.inc_lock_ref

        def inc(self, node):
            return real_inc(self, self.root_node if called_from("cache_unfinished_req") else node)
        monkeypatch.setattr(RadixCache, "inc_lock_ref", inc)
    for ps in (4, 16):
        cfg = DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), hicache=False)
        for seed in range(10):
            if run_pair(cfg, generate_requests(seed, 150, page_size=ps, device_tokens=cfg.device_tokens,
                                               hicache=False)):
                return
    pytest.fail(f"no sequence told the {mutant} mutant apart")


@pytest.mark.parametrize("name", ["CacheInitParams", "MatchPrefixParams", "InsertParams", "InsertResult", "EvictParams",
                                  "EvictResult", "IncLockRefResult", "DecLockRefParams", "DecLockRefResult",
                                  "InitLoadBackParams", "MatchResult"])
def test_records_have_sglangs_fields(name):
    """kvrace's records list SGLang 0.5.14's fields, in its order, with its plain defaults, so
    code written against SGLang builds them unchanged (positionally too)."""
    import dataclasses

    from sglang.srt.mem_cache import base_prefix_cache, cache_init_params

    from sim.cache import records

    theirs = getattr(cache_init_params if name == "CacheInitParams" else base_prefix_cache, name)
    ours = getattr(records, name)
    if name == "MatchResult":
        assert ours._fields == theirs._fields
        assert ours._field_defaults == theirs._field_defaults
        return
    t, o = dataclasses.fields(theirs), dataclasses.fields(ours)
    assert [f.name for f in o] == [f.name for f in t]
    for a, b in zip(t, o):
        if a.default is not dataclasses.MISSING and isinstance(a.default, (bool, int, float, str, type(None))):
            assert b.default == a.default, f"{name}.{a.name}: {b.default!r} != {a.default!r}"


#: what SGLang's scheduler helpers ask any prefix cache (BasePrefixCache), without arguments
PROTOCOL = ("is_chunk_cache", "is_tree_cache", "supports_fast_match_prefix", "supports_swa", "supports_mamba",
            "supports_streaming_session", "full_evictable_size", "swa_evictable_size", "full_protected_size",
            "swa_protected_size", "session_held_tokens", "session_held_full_tokens", "session_held_swa_tokens",
            "session_held_req_count", "session_held_mamba_slots", "take_events", "available_and_evictable_str",
            "evictable_size", "protected_size", "total_size")


@pytest.mark.parametrize("hicache", [False, True], ids=["radix", "hiradix"])
def test_base_protocol_answers_as_sglang(hicache):
    """After the same ops, both caches give the same answers to the base-class questions, and
    the plain cache refuses the host-tier calls with SGLang's exception kind."""
    from tests.differential.kvrace_side import KvraceSide
    from tests.differential.ops import SideDriver, generate, generate_radix
    from tests.differential.sglang_side import SGLangSide

    cfg = DiffConfig(hicache=hicache)
    sides = [SGLangSide(cfg), KvraceSide(cfg)]
    ops = (generate if hicache else generate_radix)(7, 60, page_size=1, device_tokens=48)
    for side in sides:
        d = SideDriver(side)
        for op in ops:
            d.apply(op)
    answers = [{name: getattr(s.cache_obj(), name)() for name in PROTOCOL} for s in sides]
    assert answers[0] == answers[1]
    if not hicache:
        for name in ("ready_to_load_host_cache", "check_hicache_events"):
            for s in sides:
                with pytest.raises(NotImplementedError):
                    getattr(s.cache_obj(), name)()
