"""SGLang 0.5.14's ``--schedule-policy`` orders of the waiting queue beyond ``fcfs`` and ``lpm``
(``managers/schedule_policy.py``, ``SchedulePolicy.calc_priority``): ``dfs-weight``
(``_sort_by_dfs_weight``), ``lof`` (``_sort_by_longest_output``) and ``random``
(``_sort_randomly``).  The expected orders were worked out by reading those functions."""
from __future__ import annotations

import numpy as np
import pytest

from sim.cache.radix import RadixCache, RadixKey
from sim.cache.records import CacheInitParams, InsertParams, MatchPrefixParams
from sim.engine import PrefillEngine
from sim.engine.engine import dfs_weight_order
from sim.engine.scenario import load_scenario
from sim.errors import InputError
from sim.pools.allocator import TokenToKVPoolAllocator

SMALL = ["run.layers=2", "variant.gate_map=upstream-0.5.11", "workload.sessions=6", "workload.concurrency=6"]


def _engine(policy: str, seed: int = 0, *sets) -> PrefillEngine:
    e = PrefillEngine(load_scenario("glm5-22811-small", [*SMALL, f"scheduler.schedule_policy={policy}", *sets]),
                      seed)
    e.start()
    return e


def _arrived(e: PrefillEngine) -> list:
    """Every request of the run that has arrived once time passes them all, in arrival order
    (the queue's order the first time it is read: SGLang's waiting_queue is append-ordered)."""
    return sorted(e.waiting, key=lambda r: (r.arrival_us, r.rid))


def test_dfs_weight_visits_heavier_subtrees_first_and_a_nodes_own_requests_after_its_children():
    """``_sort_by_dfs_weight``: each waiting request counts for the node its match ends at
    (``last_node``); a node's weight is its count plus its children's (``_calc_weight``); the
    queue is rebuilt depth first from the root, children in descending weight (ties keep the
    children's order), a node's own requests after its subtree's (``_get_dfs_priority``)."""
    alloc = TokenToKVPoolAllocator(64)
    cache = RadixCache(CacheInitParams(token_to_kv_pool_allocator=alloc, page_size=1))
    for toks in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8]):
        v = alloc.alloc(len(toks))
        res = cache.insert(InsertParams(RadixKey(toks), v))
        alloc.free(v[:res.prefix_len])
    reqs = {0: [1, 2, 3, 4, 9], 1: [1, 2, 5, 6, 9], 2: [1, 2, 5, 6, 10], 3: [7, 8, 9], 4: [11, 12], 5: [1, 2, 13]}
    last = [(rid, cache.match_prefix(MatchPrefixParams(RadixKey(t))).last_device_node) for rid, t in reqs.items()]
    # weights: [1,2] 4 (r5 + [3,4] 1 + [5,6] 2), [7,8] 1; root's own: r4
    assert dfs_weight_order(cache.root_node, last) == [1, 2, 0, 5, 3, 4]


def test_dfs_weight_runs_the_engine_to_the_end():
    e = _engine("dfs-weight")
    while e.step():
        pass
    r = e.finish()
    assert r.requests_completed == r.requests_total > 0


def test_lof_puts_the_longest_max_new_tokens_first_ties_in_queue_order():
    """``_sort_by_longest_output``: a stable sort by ``-max_new_tokens``."""
    e = _engine("lof")
    queue = _arrived(e)
    got = [r.rid for r in e._queue_order(float(max(r.arrival_us for r in queue)))]
    want = [r.rid for r in sorted(queue, key=lambda r: -e._max_new_tokens(r))]
    assert got == want and len(set(e._max_new_tokens(r) for r in queue)) > 1


def test_lof_on_a_pd_prefill_engine_is_the_queue_order():
    """The PD prefill server sets every request's ``max_new_tokens`` to 1, so ``lof`` sorts
    nothing."""
    e = _engine("lof", 0, "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4")
    queue = _arrived(e)
    got = [r.rid for r in e._queue_order(float(max(r.arrival_us for r in queue)))]
    assert got == [r.rid for r in queue]


def test_random_shuffles_the_queue_reproducibly_per_seed():
    """``_sort_randomly``: the queue shuffled in place at every ``calc_priority`` (SGLang uses
    Python's global ``random``; here a generator seeded from the run's seed, so a run repeats)."""
    orders = {}
    for seed in (0, 0, 1):
        e = _engine("random", seed)
        queue = _arrived(e)
        now = float(max(r.arrival_us for r in queue))
        first = [r.rid for r in e._queue_order(now)]
        second = [r.rid for r in e._queue_order(now)]
        assert sorted(first) == sorted(r.rid for r in queue) == sorted(second)
        orders.setdefault(seed, []).append((first, second))
    assert orders[0][0] == orders[0][1]
    assert orders[0][0] != orders[1][0]
    assert orders[0][0][0] != orders[0][0][1] or orders[1][0][0] != orders[1][0][1]


@pytest.mark.parametrize("policy", ["lof", "random", "dfs-weight"])
def test_every_policy_completes_a_run(policy):
    e = _engine(policy, 1)
    while e.step():
        pass
    r = e.finish()
    assert r.requests_completed == r.requests_total > 0


def test_routing_key_is_refused_by_name():
    with pytest.raises(InputError, match=r"scheduler\.schedule_policy"):
        load_scenario("glm5-22811-small", ["scheduler.schedule_policy=routing-key"])
