"""The chunked request enters the tree chunk by chunk in both scheduler loops (SGLang 0.5.14's
``get_next_batch_to_run`` -> ``stash_chunked_request`` -> ``cache_unfinished_req(chunked=True)``
at the top of every iteration, ``event_loop_normal`` and ``event_loop_overlap`` alike), and a
memory-limited chunk is cut at what memory is left, not at a page (``add_chunked_req``)."""
from __future__ import annotations

import pytest

from sim.cache.radix import RadixKey
from sim.cache.records import MatchPrefixParams
from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.engine.workload import tokens

#: a small colocated run whose later turns load back into a tight device pool, chunked at 128
TIGHT = ["run.layers=2", "variant.gate_map=upstream-0.5.11", "workload.sessions=5", "workload.max_turns=3",
         "workload.concurrency=4", "scheduler.max_total_tokens=1536", "workload.max_context_tokens=1472",
         "scheduler.chunked_prefill_size=128"]


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_the_chunked_requests_computed_pages_are_in_the_tree_before_its_next_chunk(loop):
    """Whenever a batch is formed while a request is chunked, the page-aligned tokens its
    chunks computed are in the tree (matched whole on the tree's own slots, the request's
    lock on the node they end at), so a request behind it can share them; before the
    per-chunk stash the normal loop inserted them only after the last chunk."""
    e = PrefillEngine(load_scenario("glm5-22811-small", [*TIGHT, f"scheduler.event_loop={loop}"]), 0)
    form, checked = e._form_batch, []

    def checking_form_batch():
        a = e.chunked
        if a is not None:
            computed = len(a.prefix) + a.done
            aligned = computed // e.page * e.page
            m = e.cache.match_prefix(MatchPrefixParams(RadixKey(tokens(a.req)[:aligned])))
            assert len(m.device_indices) == aligned, (loop, a.req.rid, len(m.device_indices), aligned)
            assert len(a.prefix) == aligned and m.last_device_node is a.node and a.node.lock_ref > 0
            checked.append(aligned)
        return form()

    e._form_batch = checking_form_batch
    r = e.run()
    assert r.chunked_batches > 0 and any(n > 0 for n in checked)
    assert r.requests_completed == r.requests_total and r.requests_corrupted == 0


def test_a_memory_limited_chunk_ends_where_memory_does_and_the_request_goes_on_mid_page(monkeypatch):
    """``add_chunked_req``: the next chunk is ``min(rem_chunk_tokens, int(rem_total_tokens))``,
    not rounded to a page; the chunk after it starts mid-page (the stash inserts the whole
    pages only, the partial page stays the request's) and the request still completes."""
    e = PrefillEngine(load_scenario("glm5-22811-small", TIGHT), 0)
    e.start()
    while e.step():
        a = e.chunked
        if a is not None and a.n_new - a.done > 2 * e.page:
            break
    else:
        pytest.fail("no chunked request with two pages to go")
    e._stash(a)
    target = e.page + 5
    assert target < e.scenario.scheduler.chunked_prefill_size
    alloc = e.session.allocator
    real = alloc.available_size
    calls = []

    def available():        # the first call is add_chunked_req's rem_total_tokens
        calls.append(1)
        return target - e.cache.evictable_size() + e._reserve() if len(calls) == 1 else real()

    monkeypatch.setattr(alloc, "available_size", available)
    batch = e._form_batch()
    monkeypatch.setattr(alloc, "available_size", real)
    assert batch[0] is a and a.chunk == target
    e._run_batch(batch)
    assert e.chunked is a and (len(a.prefix) + a.done) % e.page == 5
    e._stash(a)
    assert len(a.prefix) % e.page == 0 and a.done == 5
    while e.step():
        pass
    r = e.finish()
    assert r.requests_completed == r.requests_total and r.requests_corrupted == 0
