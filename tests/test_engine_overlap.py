"""The overlap loop (``scheduler.event_loop = "overlap"``, SGLang 0.5.14's ``event_loop_overlap``):
batch N+1 is formed and launched (match, evict, ``init_load_back``, ``start_loading``) before
batch N's result is processed, which waits on an event recorded after N's forward, not on the
stream; the chunked request enters the tree chunk by chunk (``cache_unfinished_req``)."""
from __future__ import annotations

import numpy as np
import pytest

from sim.engine import PrefillEngine
from sim.engine.engine import run_prefill_engine
from sim.engine.scenario import load_scenario
from sim.errors import InputError

CHUNKS = "scheduler.chunked_prefill_size=256"
BUSY = "workload.concurrency=6"
#: a small colocated run whose later turns load back into a tight device pool
TIGHT = ["workload.sessions=5", "workload.max_turns=3", "workload.concurrency=4", "scheduler.max_total_tokens=1536",
         "workload.max_context_tokens=1472"]
SMALL = ["run.layers=2", "variant.gate_map=upstream-0.5.11", "scheduler.event_loop=overlap"]
#: the fence runs' depth: a decode step's per-layer KV store (one write per layer for the whole
#: batch) lands after the unfenced load-back's H2D of that layer only from a later layer on
FENCE_LAYERS = "run.layers=4"
#: the fence runs' workload and seed: short turns over a 1,024-token pool. A finished request's
#: extra decode step writes past its committed KV into its tail page, which its release frees;
#: the next batch's load-back must get that page while the step still runs, and its per-layer
#: H2D must land before the step's late write of that layer: a small load (a few pages: here
#: the per-layer copies take less than a decode layer), which longer turns (whose output KV is
#: now cached and loaded back with the prompt) do not give
FENCE = ["workload.sessions=6", "workload.max_turns=3", "workload.concurrency=4", "scheduler.max_total_tokens=1024",
         "workload.first_turn_tokens=256", "workload.user_tokens_min=64", "workload.user_tokens_max=128",
         "workload.output_tokens_min=64", "workload.output_tokens_max=96", "workload.max_context_tokens=960"]
FENCE_SEED = 3


def _engine(sets, seed=0, keep="all") -> PrefillEngine:
    return PrefillEngine(load_scenario("glm5-22811-small", sets), seed, keep=keep)


def _forward_of(op_id: str) -> str | None:
    """The launch an op belongs to (``fwdK``: a prefill forward, ``decodeK``: a decode step)."""
    head = op_id.split(".", 1)[0]
    for p in ("fwd", "decode"):
        if head.startswith(p) and head[len(p):].isdigit():
            return head
    return None


def _loads_during_earlier_forwards(e: PrefillEngine) -> tuple[int, int]:
    """(load-back copies, those that ran while an earlier batch's forward or decode step was
    still running): a copy on the load stream whose start precedes the end of the last op of a
    forward or decode step issued before it."""
    run = e.session.finish()
    t = run.timings
    last_fwd_end, seen_end = {}, -1.0
    loads = overlapped = 0
    for op in run.schedule.ops:
        k = _forward_of(op.id)
        if k is not None:
            last_fwd_end[k] = max(last_fwd_end.get(k, 0.0), t[op.id][1])
            seen_end = max(seen_end, last_fwd_end[k])
        elif op.op == "copy" and op.stream == "load":
            loads += 1
            overlapped += t[op.id][0] < seen_end
    return loads, overlapped


def test_event_loop_is_validated_naming_the_key():
    with pytest.raises(InputError) as e:
        load_scenario("glm5-22811-small", ["scheduler.event_loop=fast"])
    assert e.value.where == "scheduler.event_loop" and "overlap" in str(e.value)
    with pytest.raises(InputError) as e:
        load_scenario("glm5-22811-small", ["scheduler.event_loop=overlap", "scheduler.overlap=false"])
    assert e.value.where == "scheduler.event_loop"
    assert load_scenario("glm5-22811-small").scheduler.event_loop == "normal"


@pytest.fixture(scope="module")
def fence_runs():
    """The small colocated run on the overlap loop without the fence and with it (``keep="all"``,
    finished), and on the normal loop without it."""
    out = {}
    for name, sets in (("unfenced", [*SMALL, *FENCE, FENCE_LAYERS, "variant.hypotheses=load-unfenced"]),
                       ("fenced", [*SMALL, *FENCE, FENCE_LAYERS]),
                       ("normal", [*SMALL[:2], *FENCE, FENCE_LAYERS, "variant.hypotheses=load-unfenced"])):
        e = _engine(sets, FENCE_SEED)
        out[name] = (e, e.run())
    return out


def test_overlap_loads_the_next_batch_while_the_forward_runs_unless_fenced(fence_runs):
    """Without #36738's fence the next launch's load-back runs beside the previous forward or
    decode step; with it (the default) and in the normal loop it never starts before the
    forwards issued before it have ended."""
    e, r = fence_runs["unfenced"]
    loads, overlapped = _loads_during_earlier_forwards(e)
    assert r.load_backs > 0 and loads > 0 and overlapped > 0
    assert r.requests_completed == r.requests_total
    for name in ("fenced", "normal"):
        loads, overlapped = _loads_during_earlier_forwards(fence_runs[name][0])
        assert loads > 0 and overlapped == 0, name


def test_overlap_processes_a_batch_one_iteration_later_on_its_event():
    """Each launch (prefill batch or colocated decode step) records an event after its forward and
    the scheduler later waits on that event, never on the forward stream (which would also wait
    for the batch launched after it); mostly the next launch has been issued already when a
    batch's result is processed."""
    e = _engine([*SMALL, *TIGHT])
    e.start()
    while e.step():
        pass
    r = e.finish()
    assert r.requests_completed == r.requests_total and r.forwards_one_step == 0
    ops = e.session.finish().schedule.ops
    syncs = [op for op in ops if op.op == "host_sync"]
    # the last: finish()'s device synchronize
    assert syncs[-1].event is None and syncs[-1].sync_stream is None
    syncs = syncs[:-1]
    records = [op for op in ops if op.op == "record" and op.id.endswith(".copy_done")]
    assert len(records) == e.counts["launches"] > r.batches
    assert all(op.event in ("copy_done.0", "copy_done.1") for op in syncs)
    assert len(syncs) == len(records)
    # the k-th sync waits on the k-th record (results in launch order); where the iteration
    # launched something, the (k+1)-th record was issued before it (with nothing to launch the
    # last batch is processed at once, as SGLang's loop does)
    pos = {op.id: i for i, op in enumerate(ops)}
    overlapped = 0
    for k, sync in enumerate(syncs):
        assert sync.event == records[k].event and pos[records[k].id] < pos[sync.id]
        overlapped += k + 1 < len(records) and pos[records[k + 1].id] < pos[sync.id]
    assert overlapped > len(syncs) // 2


@pytest.mark.slow
def test_overlap_stashes_the_chunked_request_per_chunk():
    """With chunks the chunked request's computed, page-aligned prefix is in the tree before its
    last chunk runs (cache_unfinished_req), and every request still completes."""
    e = _engine([*SMALL, *TIGHT, "scheduler.chunked_prefill_size=128"])
    e.start()
    seen_stash = False
    while e.step():
        a = e.chunked
        if a is not None and len(a.prefix) > 0:
            node, n = a.node, 0
            while node is not None and node.parent is not None:
                n += len(node.value)
                node = node.parent
            seen_stash |= n == len(a.prefix) and a.done < a.chunk + a.done
    r = e.finish()
    assert r.chunked_batches > 0 and seen_stash
    assert r.requests_completed == r.requests_total and r.requests_corrupted == 0


def test_load_unfenced_corrupts_with_the_overlap_loop_and_the_fence_stops_it(fence_runs):
    """SGLang #36738: a request that finished in decode step s ran once more in step s+1 (launched
    before s's result was processed) and its last page is freed while s+1 may still write it; the
    next prefill batch's load-back gets that page, and without the fence its H2D is ordered only
    after the scheduler stream, so s+1's late KV write lands on the restored prefix: reads that
    waited for their layer's load still see the wrong bytes.  With the fence (the default), and in
    the normal loop, nothing is corrupted and nothing races."""
    bad = fence_runs["unfenced"][1]
    assert bad.load_backs > 0 and bad.requests_completed == bad.requests_total
    assert bad.requests_corrupted > 0 and bad.stale_reads + bad.torn_reads > 0 and bad.latent_races > 0
    raced = [c for c in bad.corrupted_reads if c["status"] in ("stale", "torn")]
    # the first raced reads are a load-carrying batch's, which waited for their layer's load and
    # still see the late write; a later batch without a load that matches the clobbered prefix in
    # the tree reads it too (0.5.11 gates every read of a batch that loads: waited iff it loads)
    assert raced and raced[0]["waited"] and raced[0]["consumer_index"] >= 0
    assert all(c["waited"] == (c["consumer_index"] >= 0) for c in raced)
    # the late write is another request's decode KV: the KV oracle flags it too
    assert bad.requests_wrong_kv > 0
    fenced = fence_runs["fenced"][1]
    assert fenced.load_backs > 0
    assert fenced.requests_corrupted == fenced.latent_races == fenced.stale_reads == fenced.torn_reads == 0
    normal = fence_runs["normal"][1]
    assert normal.load_backs > 0 and normal.requests_corrupted == normal.latent_races == 0
    # streaming verdicts give the same result on the overlap loop
    streamed = PrefillEngine(load_scenario("glm5-22811-small", [*SMALL, *FENCE, FENCE_LAYERS,
                                                                  "variant.hypotheses=load-unfenced"]),
                             FENCE_SEED, keep="report").run()
    a, b = bad.signature(), streamed.signature()
    assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}


@pytest.mark.parametrize("sets, seed", [
    pytest.param(["run.layers=2", "variant.gate_map=upstream-0.5.10", "scheduler.event_loop=overlap", *TIGHT], 0,
                 marks=pytest.mark.slow),
    pytest.param([*SMALL, *FENCE, "variant.hypotheses=load-unfenced", CHUNKS, BUSY], FENCE_SEED, marks=pytest.mark.slow),
    pytest.param([*SMALL, *FENCE, "variant.hypotheses=load-unfenced"], FENCE_SEED, marks=pytest.mark.slow),
])
def test_overlap_streaming_equals_the_end_of_run_verdicts(sets, seed):
    """The overlap loop's streamed verdicts equal the end-of-run ones, on runs whose verdicts
    are not empty: the 0.5.10 gate map corrupts requests; on the fence runs' short turns the
    unfenced loads of two layers race the late decode writes (latent races: 8, and 4 with chunks,
    at seed 3) without corrupting a read. The unfenced run that corrupts (four layers) is compared
    streamed against end of run by
    ``test_load_unfenced_corrupts_with_the_overlap_loop_and_the_fence_stops_it``."""
    sc = load_scenario("glm5-22811-small", sets)
    a = PrefillEngine(sc, seed, keep="all").run().signature()
    b = PrefillEngine(sc, seed, keep="report").run().signature()
    assert a["load_backs"] > 0
    if "variant.gate_map=upstream-0.5.10" in sets:
        assert a["requests_corrupted"] > 0
    if "variant.hypotheses=load-unfenced" in sets:
        assert a["latent_races"] > 0
    diff = sorted(k for k in a if a[k] != b[k])
    assert not diff, {k: (a[k], b[k]) for k in diff}


@pytest.mark.slow
def test_normal_loop_results_do_not_depend_on_the_new_key():
    """``scheduler.event_loop = "normal"`` is the loop the engine had: the same signature as a
    scenario that does not set the key."""
    base = ["run.layers=2", "variant.gate_map=upstream-0.5.10"]
    a = PrefillEngine(load_scenario("glm5-22811-small", base), 0, keep="report").run().signature()
    b = PrefillEngine(load_scenario("glm5-22811-small", [*base, "scheduler.event_loop=normal"]), 0,
                      keep="report").run().signature()
    assert a == b


def test_stash_frees_the_slots_the_tree_already_had_and_continues_on_the_trees():
    """``cache_unfinished_req``: when another request inserted the chunk's tokens since this one
    matched, the stash frees this request's slots for them (while its chunk's forward may still
    write them), gives it the tree's slots instead and moves its lock to the new last node."""
    from sim.cache.radix import RadixKey
    from sim.cache.records import InsertParams
    from sim.engine.workload import tokens

    e = _engine([*SMALL, *TIGHT, "scheduler.chunked_prefill_size=128"])
    e.start()
    while e.step():
        a = e.chunked
        if a is not None and (len(a.prefix) + a.done) // e.page * e.page > len(a.prefix):
            break
    else:
        pytest.fail("no chunked request with a chunk to stash")
    page, alloc = e.page, e.session.allocator
    computed = len(a.prefix) + a.done
    aligned = computed // page * page
    n_total = len(a.prefix) + a.n_new
    mine = a.new[:aligned - len(a.prefix)].copy()
    # another request's KV for the same tokens, inserted into the tree first
    other = alloc.alloc(len(mine))
    e.cache.insert(InsertParams(RadixKey(tokens(a.req)[:aligned]), np.concatenate([a.prefix, other])))
    old_node, free_before = a.node, alloc.available_size()
    e._stash(a)
    assert e.counts["stash_frees"] == len(mine)
    assert alloc.available_size() == free_before + len(mine)
    free_pages = set(np.asarray(alloc.free_pages).tolist()) | set(np.asarray(getattr(alloc, "release_pages", [])).tolist())
    assert set((mine // page).tolist()) <= free_pages
    assert np.array_equal(a.prefix[-len(other):], other) and len(a.prefix) == aligned
    assert a.done == computed - aligned and len(a.prefix) + a.n_new == n_total
    assert a.node is not old_node and a.node.lock_ref > 0
    while e.step():
        pass
    r = e.finish()
    assert r.requests_completed == r.requests_total
