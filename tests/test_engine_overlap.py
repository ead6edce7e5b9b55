"""The overlap loop (``scheduler.event_loop = "overlap"``, SGLang 0.5.14's ``event_loop_overlap``):
batch N+1 is formed and launched (match, evict, ``init_load_back``, ``start_loading``) before
batch N's result is processed, which waits on an event recorded after N's forward, not on the
stream; the chunked request enters the tree chunk by chunk (``cache_unfinished_req``)."""
from __future__ import annotations

import pytest

from sim.engine import PrefillEngine
from sim.engine.scenario import load_scenario
from sim.errors import InputError

CHUNKS = "scheduler.chunked_prefill_size=256"
BUSY = "workload.concurrency=6"
SMALL = ["run.layers=2", "variant.gate_map=upstream-0.5.11", "scheduler.event_loop=overlap"]


def _engine(sets, seed=0, keep="all") -> PrefillEngine:
    return PrefillEngine(load_scenario("glm5-22811-small", sets), seed, keep=keep)


def _forward_of(op_id: str) -> int | None:
    head = op_id.split(".", 1)[0]
    return int(head[3:]) if head.startswith("fwd") and head[3:].isdigit() else None


def _loads_during_earlier_forwards(e: PrefillEngine) -> tuple[int, int]:
    """(load-back copies, those that ran while an earlier batch's forward was still running):
    a copy on the load stream whose start precedes the end of the last op of a forward issued
    before it."""
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


def test_overlap_loads_the_next_batch_while_the_forward_runs_unless_fenced():
    """Without #36738's fence the next batch's load-back runs beside the previous forward; with
    it (the default) and in the normal loop it never starts before the forwards issued before it
    have ended."""
    # NOTE: small chunks keep batches back to back (a batch formed while the previous one runs)
    unfenced = _engine([*SMALL, "variant.hypotheses=load-unfenced", CHUNKS, BUSY])
    r = unfenced.run()
    loads, overlapped = _loads_during_earlier_forwards(unfenced)
    assert r.load_backs > 0 and loads > 0 and overlapped > 0
    assert r.requests_completed == r.requests_total
    fenced = _engine([*SMALL, CHUNKS, BUSY])
    fenced.run()
    loads, overlapped = _loads_during_earlier_forwards(fenced)
    assert loads > 0 and overlapped == 0
    normal = _engine([*SMALL[:2], "variant.hypotheses=load-unfenced", CHUNKS, BUSY])
    normal.run()
    loads, overlapped = _loads_during_earlier_forwards(normal)
    assert loads > 0 and overlapped == 0


def test_overlap_processes_a_batch_one_iteration_later_on_its_event():
    """Each launched batch's result is processed in the next iteration, after a host sync on the
    event recorded after its forward: the sync op waits on an event, and no batch's requests are
    inserted before the next batch has been launched."""
    e = _engine(SMALL)
    e.start()
    launched = []
    while e.step():
        if e._pending is not None:
            launched.append(e.counts["batches"])
    r = e.finish()
    assert r.batches == len(set(launched)) and r.requests_completed == r.requests_total
    syncs = [op for op in e.session.finish().schedule.ops if op.op == "host_sync" and op.event]
    assert len(syncs) == r.batches
    assert {op.event for op in syncs} == {"copy_done.0", "copy_done.1"}
    assert r.forwards_one_step == 0


def test_overlap_stashes_the_chunked_request_per_chunk():
    """With chunks the chunked request's computed, page-aligned prefix is in the tree before its
    last chunk runs (cache_unfinished_req), and every request still completes."""
    e = _engine([*SMALL, "scheduler.chunked_prefill_size=128"])
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


@pytest.mark.parametrize("sets, seed", [
    (["run.layers=2", "variant.gate_map=upstream-0.5.10", "scheduler.event_loop=overlap"], 0),
    pytest.param([*SMALL, "variant.hypotheses=load-unfenced", CHUNKS, BUSY], 1, marks=pytest.mark.slow),
    pytest.param([*SMALL, "variant.hypotheses=load-unfenced"], 2, marks=pytest.mark.slow),
])
def test_overlap_streaming_equals_the_end_of_run_verdicts(sets, seed):
    sc = load_scenario("glm5-22811-small", sets)
    a = PrefillEngine(sc, seed, keep="all").run().signature()
    b = PrefillEngine(sc, seed, keep="report").run().signature()
    assert a["load_backs"] > 0
    if "variant.gate_map=upstream-0.5.10" in sets:
        assert a["requests_corrupted"] > 0
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
