"""TP ranks in lockstep at the session level (``CacheSession(ranks=n)``, ``sim.cache.ranks``).

SGLang facts (0.5.14 ``mem_cache/hiradix_cache.py``): ``writing_check`` and ``loading_check``
count, on each rank, the leading acks whose finish event that rank's ``query()`` saw complete,
and ``all_reduce`` the count with MIN over the TP group; so an ack is processed (its lock
released, its node marked backed up / loaded) only when EVERY rank has finished the copy.  Each
rank has its own device pool, host pool, streams and events (its own ``HiCacheController``).
"""
from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.cache import CacheSession
from sim.cache.radix import RadixKey
from sim.cache.ranks import RankedHost, rank_name
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.errors import InputError
from sim.snapshot import snapshot_of
from sim.verdicts import analyse
from tests.test_cache_session import SMALL, _configs, _drive, _step, rerun, same_snapshot


def h200_variant(tmp_path_factory, pattern: str, replacement: str, name: str) -> str:
    """The shipped h200 profile with the one line matching ``pattern`` replaced, written to a
    temporary ``name``.toml; its path."""
    text = (resources.files("sim") / "profiles" / "h200.toml").read_text()
    text, n = re.subn(pattern, replacement, text)
    assert n == 1
    path = tmp_path_factory.mktemp("prof") / f"{name}.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def shared_link(tmp_path_factory):
    """The h200 profile with two GPUs per PCIe link: rank 1's copies queue behind rank 0's."""
    return h200_variant(tmp_path_factory, r"(?m)^gpus_per_link = 1\b", "gpus_per_link = 2", "h200-shared")


def _done(s: CacheSession, event: str, rank: int) -> bool:
    return s.controller._record_complete_one(rank_name(event, rank))


def _poll_until_both_ranks_done(s: CacheSession, name: str, queue: list, locked: int) -> None:
    """Poll ``check_hicache_events`` every 0.5 us until ``name`` is complete on both ranks; while
    only one rank has finished, the ack stays in ``queue`` and the tree's ``protected_size`` at
    ``locked``.  Asserts that rank 0 was seen done before rank 1 at least once."""
    seen = 0
    for _ in range(4000):
        r0, r1 = _done(s, name, 0), _done(s, name, 1)
        if r0 and r1:
            break
        s.cache.check_hicache_events()
        assert len(queue) == 1 and s.tree.protected_size() == locked
        seen += r0 and not r1
        s.advance(0.5)
    assert seen > 0, "rank 0 never finished before rank 1 (the link is not shared?)"


def test_rank_names_and_header():
    s = CacheSession(SMALL, ranks=3)
    names = {b["name"]: b for b in s.header["buffers"]}
    dev = s.device_pool.kv_buffer
    assert dev in names and names[dev].get("device", 0) == 0
    assert names[f"{dev}@1"]["device"] == 1 and names[f"{dev}@2"]["device"] == 2
    streams = {st_["name"]: st_["device"] for st_ in s.header["streams"]}
    assert streams["load"] == 0 and streams["load@1"] == 1 and streams["forward@2"] == 2
    assert "hicache.load0.L1@2" in s.header["events"]
    # one rank: the header is the single-rank session's, names untouched
    one = CacheSession(SMALL)
    assert one.header["streams"] == ["schedule", "forward", "load", "write"]
    assert isinstance(one.host, RankedHost) and one.host.ranks == 1


def test_every_op_is_issued_on_every_rank_with_suffixed_names():
    s = CacheSession(SMALL, ranks=2)
    slots = s.allocator.alloc(8)
    s.store_kv(slots, owner=3)
    s.cache.insert(InsertParams(RadixKey(np.arange(100, 108)), slots))
    s.wait_idle()
    ops = s.record()["ops"]
    writes = [o for o in ops if o["op"] == "write"]
    assert sorted({o["buffer"] for o in writes}) == sorted([s.device_pool.kv_buffer, s.device_pool.kv_buffer + "@1"])
    copies = [o for o in ops if o["op"] == "copy"]
    assert len(copies) % 2 == 0 and copies
    rank1 = [o for o in copies if o["stream"] == "write@1"]
    assert len(rank1) == len(copies) // 2
    assert all(o["src"].endswith("@1") and o["dst"].endswith("@1") and o["id"].endswith("@1") for o in rank1)
    # branch counters count one rank's copies (every rank issues the same)
    assert sum(n for per in s.branches.values() for n in per.values()) == len(copies) // 2


def test_store_kv_on_chosen_ranks_only():
    s = CacheSession(SMALL, ranks=2)
    s.store_kv(s.allocator.alloc(4), owner=1, ranks=[1], sync=False)
    assert {o["buffer"] for o in s.record()["ops"] if o["op"] == "write"} == {s.device_pool.kv_buffer + "@1"}
    with pytest.raises(InputError) as e:
        s.store_kv(s.allocator.alloc(4), owner=1, ranks=[2])
    assert e.value.where == "ranks"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_ranks_config_names_the_key(bad):
    with pytest.raises(InputError) as e:
        CacheSession(SMALL, ranks=bad)
    assert e.value.where == "config.ranks" and ">= 1" in e.value.message


def test_write_ack_waits_for_the_slowest_rank(shared_link):
    """Rank 1's backup queues behind rank 0's on the shared link: while rank 0 has finished and
    rank 1 has not, ``check_hicache_events`` keeps the ack (and the node's lock)."""
    s = CacheSession(SMALL, ranks=2, profile=shared_link)
    slots = s.allocator.alloc(16)
    s.store_kv(slots, owner=7)
    s.cache.insert(InsertParams(RadixKey(np.arange(500, 516)), slots))
    ack = s.controller.ack_write_queue[0]
    name = ack.finish_event.name
    assert s.tree.protected_size() == 16               # write_backup locks the node
    _poll_until_both_ranks_done(s, name, s.controller.ack_write_queue, 16)
    s.cache.check_hicache_events()
    assert s.controller.ack_write_queue == [] and s.tree.protected_size() == 0
    # both ranks' finish events were queried positively before the ack was processed
    q = [o["event"] for o in s.record()["ops"] if o["op"] == "host_query"]
    assert name in q and name + "@1" in q


def test_load_ack_waits_for_the_slowest_rank_and_each_rank_reads_its_own_load(shared_link):
    s = CacheSession(SMALL, ranks=2, profile=shared_link, layout="layer_first")
    slots = s.allocator.alloc(16)
    s.store_kv(slots, owner=12)
    key = RadixKey(np.arange(1000, 1016))
    s.cache.insert(InsertParams(key, slots))
    s.wait_idle()
    s.cache.check_hicache_events()
    assert s.cache.evict(EvictParams(16)).num_tokens_evicted == 16
    m = s.cache.match_prefix(MatchPrefixParams(key))
    new, _node = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    locked = s.tree.protected_size()
    pid = s.cache.ready_to_load_host_cache()
    dev = s.device_pool.kv_buffer
    s.read(dev, 1, new, gate=pid, id="gated")
    name = s.controller.ack_load_queue[0].finish_event.name
    _poll_until_both_ranks_done(s, name, s.controller.ack_load_queue, locked)
    s.cache.check_hicache_events()
    assert s.controller.ack_load_queue == []
    s.wait_idle()
    assert s.owners_of(dev, 1, new) == [12] * 16 and s.owners_of(dev + "@1", 1, new) == [12] * 16
    run = s.finish()
    ops = {o.get("id"): o for o in s.record()["ops"]}
    assert ops["gated@1"]["buffer"] == dev + "@1"
    rep = analyse(run)
    assert {r["op"]: r["status"] for r in rep["reads"]} == {"gated": "ok", "gated@1": "ok"}
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s.record(), shared_link)))


def _session_reruns_ranks(config, steps, ranks) -> None:
    s = CacheSession({**SMALL, "device_tokens": 64, **config}, ranks=ranks)
    _drive(s, steps)
    run = s.finish()
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s.record(), s.config.profile)))
    for r in analyse(run)["reads"]:
        assert r["status"] == "ok"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs, st.lists(_step, min_size=1, max_size=12))
def test_two_rank_session_reruns_from_its_record_to_the_same_snapshot(config, steps):
    _session_reruns_ranks(config, steps, 2)


def test_two_rank_session_on_a_shared_link_reruns_to_the_same_snapshot(shared_link):
    steps = [("cycle", 0, 3, True), ("check",), ("cycle", 1, 4, True), ("advance", 2.0), ("check",),
             ("load_back", 0, True), ("wait_idle",)]
    _session_reruns_ranks({"profile": shared_link, "layout": "page_first"}, steps, 2)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs, st.lists(_step, max_size=30), st.integers(2, 3))
def test_multi_rank_session_reruns_deep(config, steps, ranks):
    _session_reruns_ranks(config, steps, ranks)
