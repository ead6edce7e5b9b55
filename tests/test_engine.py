"""The prefill engine (first slice): PR #22811's race end to end on the HiCache model.

Tiny runs of the ``glm5-22811-small`` preset (2 DSA layers, a few short multi-turn sessions, a device
pool small enough that later turns load their prefix back from the host)."""
from __future__ import annotations

import numpy as np
import pytest

from sim.engine import EngineResult, PrefillEngine, reduced_model, run_prefill_engine
from sim.engine.engine import EngineError, OwnershipError, _Admitted
from sim.engine.models import model
from sim.engine.scenario import load_scenario
from sim.errors import InputError

LAYERS = 2


def small(gate_map: str, *extra: str, seed: int = 0, layers: int = LAYERS) -> PrefillEngine:
    sc = load_scenario("glm5-22811-small", [f"variant.gate_map={gate_map}", *extra])
    return PrefillEngine(sc, seed, layers=layers)


@pytest.fixture(scope="module")
def r510() -> EngineResult:
    return small("upstream-0.5.10").run()


@pytest.fixture(scope="module")
def e511():
    e = small("upstream-0.5.11")
    return e, e.run()


def test_0510_corrupts_index_k_reads_before_the_layer_wait(r510):
    assert r510.load_backs > 0
    assert r510.requests_corrupted >= 1
    assert 0 < r510.corrupted_fraction < 1
    assert r510.stale_reads + r510.torn_reads == len(r510.corrupted_reads) > 0
    for c in r510.corrupted_reads:
        # PR #22811: the ungated top-k read of a batch that loads, before its layer's wait
        assert c["role"] == "index_k" and c["reader"] == "_get_topk_ragged", c
        assert c["consumer_index"] >= 0 and c["waited"] is False, c
        assert c["requests"], c
    assert r510.requests_corrupted == len({rid for c in r510.corrupted_reads for rid in c["requests"]})
    assert set(r510.latent_races_by_buffer) == {"index_k_with_scale_buffer"}


def test_0511_same_seed_has_no_corruption_and_no_index_k_race(e511, r510):
    _, r = e511
    assert r.requests_total == r510.requests_total and r.load_backs == r510.load_backs > 0
    assert r.requests_corrupted == 0 and r.stale_reads == r.torn_reads == 0
    assert r.latent_races_by_buffer.get("index_k_with_scale_buffer", 0) == 0
    assert r.latent_races == 0


def test_fused_store_on_0510_waits_before_the_read():
    # the fused index-K store fetches its buffer through a gated getter before the ragged top-k read
    r = small("upstream-0.5.10", "model.index_k_store=fused").run()
    assert r.load_backs > 0 and r.requests_corrupted == 0 and r.latent_races == 0


def test_every_request_completes_and_reads_only_its_own_slots(e511):
    e, r = e511
    assert r.requests_completed == r.requests_total == e.driver.requests_released > 0
    assert e.driver.done and not e.waiting
    assert sorted(e.completed) == list(range(r.requests_total))
    # every admitted request was checked before each of its forwards (one per chunk)
    assert r.ownership_checks == r.requests_total + e.counts["chunks"]
    # every read's entries are the slots the request was handed (no slot of another batch member's new tokens)
    for issue in e.issues:
        for info in issue.reads:
            assert info.entries, info.op_id


def test_ownership_check_catches_a_freed_slot(monkeypatch):
    e = small("upstream-0.5.11")
    orig = PrefillEngine._check_ownership

    def broken(self, batch):
        self.session.allocator.free(batch[0].new[:1])     # a bookkeeping bug: the slot goes back to the free list
        return orig(self, batch)
    monkeypatch.setattr(PrefillEngine, "_check_ownership", broken)
    with pytest.raises(OwnershipError, match="free in the allocator"):
        e.run()


def test_ownership_check_catches_a_slot_of_the_tree(monkeypatch):
    e = small("upstream-0.5.11")
    orig = PrefillEngine._check_ownership

    def broken(self, batch):
        for a in batch:
            stack = [self.session.tree.root_node]
            while stack:
                n = stack.pop()
                if n.value is not None and n.parent is not None and len(n.value):
                    a.new[0] = n.value[0]      # a bookkeeping bug: a cached slot handed out as new
                    return orig(self, batch)
                stack.extend(n.children.values())
        return orig(self, batch)
    monkeypatch.setattr(PrefillEngine, "_check_ownership", broken)
    with pytest.raises(OwnershipError, match="hold a tree node's KV"):
        e.run()


@pytest.mark.parametrize("name, sets", [
    ("incident-short", ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4"]),     # load-backs
    ("glm5-22811-small", ["run.layers=2", "workload.sessions=5", "workload.max_turns=3", "workload.concurrency=4",
                          "scheduler.max_total_tokens=1536", "workload.max_context_tokens=1472"]),   # evictions
])
def test_tree_slot_counts_kept_across_batches_equal_a_fresh_walk(name, sets, monkeypatch):
    """``_tree_slots`` counts the value arrays that appeared or went since its last walk; at
    every batch the slots it counts are exactly those of the tree's values then."""
    orig = PrefillEngine._tree_slots
    seen = {"batches": 0, "changed": 0}

    def checked(self):
        before = set(self._tree_vals)
        cnt = orig(self)
        fresh = []
        stack = [self.cache.root_node]
        while stack:
            n = stack.pop()
            if n.value is not None and n.parent is not None:
                fresh.append(np.asarray(n.value, np.int64))
            stack.extend(n.children.values())
        tree = np.unique(np.concatenate(fresh)) if fresh else np.zeros(0, np.int64)
        assert np.array_equal(np.flatnonzero(cnt > 0), tree)
        seen["batches"] += 1
        seen["changed"] += before != set(self._tree_vals)
        return cnt
    monkeypatch.setattr(PrefillEngine, "_tree_slots", checked)
    r = PrefillEngine(load_scenario(name, sets), 0, keep="report").run()
    assert seen["batches"] == r.batches and seen["changed"] > 1
    if name == "incident-short":
        assert r.load_backs > 0


def test_a_requests_ids_are_kept_read_only_until_its_prefill_is_done(monkeypatch):
    from sim.engine.workload import tokens
    seen = {}
    orig = PrefillEngine._tokens

    def spy(self, req):
        got = orig(self, req)
        assert np.array_equal(got, tokens(req)) and not got.flags.writeable
        seen[req.rid] = seen.get(req.rid, 0) + 1
        return got
    monkeypatch.setattr(PrefillEngine, "_tokens", spy)
    e = PrefillEngine(load_scenario("glm5-22811-small", [
        "run.layers=2", "workload.sessions=5", "workload.max_turns=3", "workload.concurrency=4",
        "scheduler.max_total_tokens=1536", "workload.max_context_tokens=1472"]), 0, keep="report")
    r = e.run()
    assert len(seen) == r.requests_total and max(seen.values()) > 1      # some matched more than once
    assert not e._ids                                                    # every prefill done dropped its ids


def test_same_seed_same_result(r510):
    assert small("upstream-0.5.10").run().signature() == r510.signature()


def test_branch_counters_are_the_routines_issued(e511):
    e, r = e511
    ctl = e.session.controller
    loads, backups = ctl._seq["load"], ctl._seq["write"]
    assert loads > 0 and backups == r.backups > 0
    assert set(r.branches) == {"latent", "index_k"}
    recorded: dict = {}
    for op in e.session.finish().schedule.ops:
        if op.op == "copy":
            recorded[op.routine] = recorded.get(op.routine, 0) + 1
    assert sum(sum(v.values()) for v in r.branches.values()) == sum(recorded.values())
    for role, counts in r.branches.items():
        per_layer = sum(n for name, n in counts.items() if "per_layer" in name)
        assert per_layer == loads * LAYERS, (role, counts)           # one load copy per layer per load
        assert sum(counts.values()) - per_layer == backups, (role, counts)   # one all-layer backup copy each
        assert all(name in recorded for name in counts)


V4 = ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4"]


@pytest.fixture(scope="module")
def v4():
    e = PrefillEngine(load_scenario("incident-short", V4), 0)
    return e, e.run()


def test_v4_flash_runs_on_its_own_pools(v4):
    """The incident's model: SWA, C4 latent, bf16 C4 index-K and C128 device pools, each read
    by the forward at its own entries (a compressed pool's entries are the slots that complete
    a group of its ratio, divided by it)."""
    e, r = v4
    assert set(e.buffers) == {"swa", "c4", "index_k", "c128"}
    assert r.requests_completed == r.requests_total > 0 and r.load_backs > 0
    assert set(r.branches) == {"swa", "c4", "index_k", "c128"}
    slots = np.arange(256, 768, dtype=np.int64)
    c4 = e.session.entries_of(e.buffers["c4"][0], slots)
    assert np.array_equal(c4, np.arange(256 // 4, 768 // 4))
    assert np.array_equal(e.session.entries_of(e.buffers["c128"][0], slots), np.array([2, 3, 4, 5]))
    # every read of a compressed role covers only whole groups of its entries
    reads = [info for iss in e.issues for info in iss.reads if info.role == "c4"]
    assert reads and all(len(ent) for info in reads for ent in info.entries.values())


@pytest.mark.parametrize("hyp, key, value", [
    ("host-freed-during-load", "host_lock_during_load", False),
    ("index-k-not-backed-up", "backup_pools", frozenset({"swa", "c4", "c128"})),
    ("index-k-stride-mismatch", "index_k_host_bytes_per_entry", 132),
    ("index-k-c4-token-copy", "index_k_partial_pages", "dsv4_token"),
])
def test_hypotheses_controller_switches_reach_the_session(hyp, key, value):
    e = PrefillEngine(load_scenario("incident-short", [*V4, f"variant.hypotheses={hyp}"]), 0)
    got = getattr(e.session.config, key)
    assert (frozenset(got) if key == "backup_pools" else got) == value


def test_dsa_refuses_the_v4_only_switches():
    with pytest.raises(InputError, match="variant.hypotheses"):
        small("upstream-0.5.11", "variant.hypotheses=index-k-c4-token-copy")


def test_load_unfenced_is_honoured():
    e = small("upstream-0.5.11", 'variant.hypotheses=load-unfenced')
    assert e.session.controller.load_fence_stream is None
    assert small("upstream-0.5.11").session.controller.load_fence_stream == "forward"


def test_reduced_model_cuts_layers_and_pools():
    fam = reduced_model(model("dsa-v3.2"), 3)
    assert fam.n_layers == 3 and all(p.layers == (0, 1, 2) for p in fam.pools.values())
    assert reduced_model(model("dsa-v3.2"), None) is model("dsa-v3.2")
    with pytest.raises(InputError, match="layers"):
        reduced_model(model("dsa-v3.2"), 62)


def test_run_prefill_engine_by_name_matches_engine(r510):
    r = run_prefill_engine("glm5-22811-small", 0, overrides=["variant.gate_map=upstream-0.5.10"], layers=LAYERS)
    assert r.signature() == r510.signature()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_bigger_run_0510_vs_0511(seed):
    extra = ["workload.concurrency=8", "workload.sessions=16", "workload.max_turns=6",
             "workload.max_context_tokens=8192", "scheduler.max_total_tokens=8192",
             "scheduler.chunked_prefill_size=4096"]
    bad = small("upstream-0.5.10", *extra, seed=seed, layers=4).run()
    good = small("upstream-0.5.11", *extra, seed=seed, layers=4).run()
    assert bad.requests_total == good.requests_total == bad.requests_completed
    assert bad.load_backs > 0 and bad.requests_corrupted > 0
    assert all(c["role"] == "index_k" and not c["waited"] for c in bad.corrupted_reads)
    assert good.requests_corrupted == 0 and good.latent_races == 0
    assert np.isclose(bad.corrupted_fraction, bad.requests_corrupted / bad.requests_total)


def test_a_request_larger_than_the_device_pool_is_an_error():
    sc = load_scenario("glm5-22811-small")
    with pytest.raises(EngineError, match="cannot fit the device pool"):
        PrefillEngine(sc, 0, layers=LAYERS, device_tokens=256).run()


# ---------------------------------------------------------------- one step, HiCache off, run.layers

def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


@pytest.mark.parametrize("concurrency", ["4", "1"])
def test_one_step_forwards_give_the_per_layer_results(concurrency):
    """run.one_step only merges forwards with nothing in flight: the same corrupted reads,
    bytes and verdicts as every layer issued on its own; only the read count (merged reads)
    and the last bits of the float clock differ."""
    runs = {}
    for one in ("true", "false"):
        e = small("upstream-0.5.10", f"run.one_step={one}", f"workload.concurrency={concurrency}")
        runs[one] = e.run()
    a, b = runs["true"], runs["false"]
    assert a.forwards_one_step > 0 and b.forwards_one_step == 0
    assert a.reads_total < b.reads_total
    assert _without(a.signature(), "reads_total", "sim_time_s", "forwards_one_step") == \
        _without(b.signature(), "reads_total", "sim_time_s", "forwards_one_step")
    assert a.sim_time_s == pytest.approx(b.sim_time_s, rel=1e-12)


def test_hicache_off_runs_a_plain_radix_cache_with_no_host_traffic():
    e = small("upstream-0.5.10", "hicache.prefill=false", "hicache.decode=false")
    r = e.run()
    assert not r.hicache and r.load_backs == 0 and r.backups == 0 and r.branches == {}
    assert r.requests_completed == r.requests_total > 0 and r.requests_corrupted == 0
    assert not any(op.op == "copy" for op in e.session.finish().schedule.ops)


def test_run_layers_key_cuts_the_model():
    e = PrefillEngine(load_scenario("glm5-22811-small", ["run.layers=3"]), 0)
    assert e.model.n_layers == 3
    with pytest.raises(InputError, match="run.layers"):
        PrefillEngine(load_scenario("glm5-22811-small", ["run.layers=99"]), 0)
    # DeepSeek V4 needs its first C4 layer (layer 2): the error names the user's key
    with pytest.raises(InputError, match=r"^run\.layers: expected an integer in 3\.\.43"):
        PrefillEngine(load_scenario("incident-repro", ["run.layers=2"]), 0)


def test_chunked_prefill_splits_a_long_request_over_batches():
    """A request whose new tokens exceed scheduler.chunked_prefill_size runs in page-aligned
    chunks, one per batch, keeping its lock; every request still completes, reads only its own
    slots, and each chunk's forward reads the whole context computed so far."""
    e = small("upstream-0.5.10", "scheduler.chunked_prefill_size=256")
    seen, run_batch = [], e._run_batch

    def spy(batch):
        # positions in the prompt: the stash moves computed pages from a.done into a.prefix
        seen.append([(a.req.rid, len(a.prefix) + a.done, a.chunk, len(a.prefix) + a.n_new) for a in batch])
        run_batch(batch)

    e._run_batch = spy
    r = e.run()
    assert r.chunked_batches > 0 and r.requests_completed == r.requests_total
    assert all(sum(c for _, _, c, _ in b) <= 256 for b in seen)
    # each request's chunks are contiguous and cover its prompt to the end exactly once
    per: dict = {}
    continuing = 0
    for b in seen:
        for rid, at, chunk, total in b:
            assert at == per.get(rid, at) and chunk >= 1
            continuing += rid in per
            per[rid] = at + chunk
            assert per[rid] <= total
    assert continuing == r.chunked_batches


def test_topk_verdict_tells_selection_changing_races_apart():
    """With contexts below index_topk (2048) the indexer selects every entry, so a stale
    index-K read cannot change the selection; with a top-k of 8 it does."""
    import dataclasses

    r = small("upstream-0.5.10").run()
    assert r.stale_reads + r.torn_reads > 0 and r.index_k_topk_changed == 0
    assert all(c["topk_changed"] is False for c in r.corrupted_reads if c["role"] == "index_k")
    e = small("upstream-0.5.10")
    e.model = dataclasses.replace(e.model, dims=dataclasses.replace(e.model.dims, index_topk=8))
    r8 = e.run()
    assert 0 < r8.index_k_topk_changed <= r8.stale_reads + r8.torn_reads


def test_step_api_gives_the_same_result_as_run():
    a = small("upstream-0.5.10")
    with pytest.raises(EngineError, match="start"):
        a.step()
    a.start()
    with pytest.raises(EngineError, match="in flight"):
        a.finish()
    n = 0
    while a.step():
        n += 1
    assert n > 0 and not a.step()
    ra = a.finish()
    rb = small("upstream-0.5.10").run()
    assert ra.signature() == rb.signature()


def _path_len(node) -> int:
    n = 0
    while node is not None and node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n


def _assert_no_slot_lost(e, pool_tokens: int) -> None:
    """At the end of a run every page of the pool is the tree's or free."""
    tree = np.flatnonzero(e._tree_slots() > 0)
    pages = set((tree // e.page).tolist()) | set(np.asarray(e.session.allocator.free_page_ids()).tolist())
    assert len(pages) * e.page == pool_tokens


def test_colocated_request_keeps_its_whole_prompt_locked_until_its_decode_ends():
    """SGLang's ``process_batch_result_prefill`` -> ``cache_unfinished_req``: once a request's
    prefill is done its page-aligned prompt is in the tree and its lock has moved to the node the
    prompt ends at, so an eviction during its decode never takes the KV that decode reads; it
    keeps its unaligned tail page; the lock goes when it is released."""
    e = small("upstream-0.5.11")
    assert not e.pd
    e.start()
    seen = 0
    while e.step():
        for rid, d in e._decoding.items():
            prompt = d.req.input_len
            assert _path_len(d.node) == len(d.prefix) == len(d.prefix) // e.page * e.page >= prompt // e.page * e.page, rid
            assert d.node.lock_ref > 0, rid
            assert d.ctx >= prompt and len(d.own) >= d.ctx - len(d.prefix), rid
            seen += 1
    r = e.finish()
    assert seen > 0 and r.load_backs > 0 and r.requests_completed == r.requests_total
    assert not e._decoding


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_colocated_release_inserts_the_output_and_the_next_turn_matches_it(loop, monkeypatch):
    """``cache_finished_req``: a colocated request's prompt and output KV (``kv_committed_len``:
    all but the last output token), page-aligned, enter the tree when it is released, so the
    next turn of its session (which re-sends them) matches all of it; in a pool with room for
    everything nothing is evicted and every such match is whole.  Every read is the reader's
    own KV (the KV oracle judges the output pages, written a token per decode step, right) and
    no slot is lost: at the end the tree's slots and the free ones are the whole pool."""
    from sim.engine.engine import PrefillEngine as PE
    matched = []
    admit = PE._admit

    def spy(self, req, budget, can_chunk, **kw):
        a = admit(self, req, budget, can_chunk, **kw)
        if isinstance(a, _Admitted):
            matched.append((req, len(a.prefix)))
        return a
    monkeypatch.setattr(PE, "_admit", spy)
    e = small("upstream-0.5.11", "scheduler.max_total_tokens=65536", f"scheduler.event_loop={loop}")
    r = e.run()
    assert r.requests_completed == r.requests_total and r.requests_corrupted == r.requests_wrong_kv == 0
    assert r.requests_retracted == 0
    prev = {}
    later = 0
    for req, n in sorted(matched, key=lambda x: x[0].rid):
        if req.turn > 0:
            p = prev[req.session]
            assert n == (p.input_len + p.output_len - 1) // e.page * e.page, req
            later += 1
        prev[req.session] = req
    assert later > 0
    _assert_no_slot_lost(e, 65536)


#: a colocated workload whose decode outgrows a 1,536-token pool: six sessions in flight with
#: short prompts and long outputs (three turns, contexts up to 1,400 tokens)
PRESSURE = ("scheduler.max_total_tokens=1536", "workload.max_context_tokens=1400", "workload.concurrency=6",
            "workload.first_turn_tokens=256", "workload.user_tokens_min=64", "workload.user_tokens_max=128",
            "workload.output_tokens_min=256", "workload.output_tokens_max=512", "workload.sessions=8",
            "workload.max_turns=3")


def _pressure_run(loop: str, conservativeness: float, monkeypatch=None):
    """The PRESSURE run; with ``monkeypatch``, each retraction and re-admission recorded."""
    log = dict(retracted=[], admitted=[])
    if monkeypatch is not None:
        retract, admit = PrefillEngine._retract, PrefillEngine._admit

        def spy_retract(self, rid, decoded, remaining):
            d = self._decoding[rid]
            log["retracted"].append((rid, decoded[rid], d.ctx - d.req.input_len))
            return retract(self, rid, decoded, remaining)

        def spy_admit(self, req, budget, can_chunk, **kw):
            had = self._retracted.get(req.rid)
            a = admit(self, req, budget, can_chunk, **kw)
            if isinstance(a, _Admitted) and had is not None:
                log["admitted"].append((req.rid, had, len(a.key) - req.input_len))
            return a
        monkeypatch.setattr(PrefillEngine, "_retract", spy_retract)
        monkeypatch.setattr(PrefillEngine, "_admit", spy_admit)
    e = small("upstream-0.5.11", *PRESSURE, f"scheduler.event_loop={loop}",
              f"scheduler.schedule_conservativeness={conservativeness}")
    return e, e.run(), log


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_colocated_decode_retracts_when_a_step_finds_no_page(loop, monkeypatch):
    """SGLang's ``update_running_batch`` -> ``retract_decode``: when a decode step's new pages
    do not fit, requests leave the batch with their KV freed (not inserted) and queue again;
    each prefills again its prompt and the output it had (the overlap loop: without the token
    of the step whose result was not processed yet) and goes on to finish.  Every request
    completes, every read is the reader's own KV, and no slot is lost."""
    e, r, log = _pressure_run(loop, 0.1, monkeypatch)
    assert r.requests_retracted == len(log["retracted"]) > 0
    assert r.requests_completed == r.requests_total and not r.requests_aborted
    assert r.requests_corrupted == r.requests_wrong_kv == 0
    for rid, had, wrote in log["retracted"]:
        assert 0 <= had <= wrote and wrote - had <= (loop == "overlap"), (rid, had, wrote)
    if loop == "overlap":
        assert any(wrote - had == 1 for _, had, wrote in log["retracted"])
    # every retracted request was admitted again with the output it had
    assert sorted((rid, had) for rid, had, _ in log["retracted"]) == \
        sorted((rid, had) for rid, had, n in log["admitted"] if n == had)
    assert not e._decoding and not e._retracted
    _assert_no_slot_lost(e, 1536)


PD_SPLIT = ("deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4")


@pytest.mark.parametrize("refusal", ["none", "no-token"])
@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_the_first_request_admission_cannot_add_ends_the_batch(mode, refusal, monkeypatch):
    """SGLang's ``get_new_batch_prefill`` breaks at the first ``add_one_req`` that is not
    ``CONTINUE`` (NO_TOKEN, or OTHER: say no chunk budget left for it): the requests queued
    behind it wait for the next batch even when they would fit."""
    from sim.engine.engine import _NO_TOKEN, PrefillEngine as PE
    admit, tried = PE._admit, []
    e = small("upstream-0.5.11", *PRESSURE, *(PD_SPLIT if mode == "pd" else ()))
    e.start()
    queue = sorted(e.waiting, key=lambda r: (r.arrival_us, r.rid))
    now = [r for r in queue if r.arrival_us <= e.session.now]
    assert len(now) >= 3

    def spy(self, req, budget, can_chunk, **kw):
        tried.append(req.rid)
        if req.rid == now[1].rid:
            return None if refusal == "none" else _NO_TOKEN
        return admit(self, req, budget, can_chunk, **kw)
    monkeypatch.setattr(PE, "_admit", spy)
    batch = e._form_batch()
    assert [a.req.rid for a in batch] == [now[0].rid] and tried == [now[0].rid, now[1].rid]
    assert {r.rid for r in e.waiting} == {r.rid for r in queue} - {now[0].rid}


def test_a_chunked_request_finishing_leaves_its_budget_to_a_new_chunk():
    """``rem_chunk_tokens``: when the chunked request's last chunk leaves at least a page of the
    chunk budget, the next request may start chunking in the same batch."""
    from types import SimpleNamespace as NS
    e = small("upstream-0.5.11", *PRESSURE, "scheduler.chunked_prefill_size=256")
    e.start()
    head = min((r for r in e.waiting if r.arrival_us <= e.session.now), key=lambda r: (r.arrival_us, r.rid))
    assert head.input_len > 256
    other = max(e.waiting, key=lambda r: r.rid)
    e.waiting.remove(other)
    e.chunked = NS(req=other, n_new=100, done=0, chunk=0, new=np.zeros(128, np.int64))
    batch = e._form_batch()
    assert batch[0].req is other and batch[0].chunk == 100
    assert len(batch) == 2 and batch[1].req is head
    assert batch[1].chunk == 128 < batch[1].n_new      # 156 tokens of budget left: two pages


def test_admission_offset_counts_a_requests_chunk_max_new_and_a_page():
    """PrefillAdder's ``rem_total_token_offset`` grows by a request's page-rounded chunk, its
    ``max_new`` (last chunk only) and a page (``_update_prefill_budget``); the chunk's slots
    are allocated after the batch is formed, so none is counted twice."""
    from types import SimpleNamespace as NS
    e = small("upstream-0.5.11", *PRESSURE)
    page = e.page
    req = e.driver.start(0)[0]
    max_new = e._max_new(req)
    assert max_new == min(e._max_new_tokens(req), 4096) > 1
    whole = NS(req=req, n_new=100, done=0, chunk=100, new=np.zeros(0, np.int64))
    assert e._offset(whole) == 2 * page + max_new + page
    first = NS(req=req, n_new=300, done=0, chunk=2 * page, new=np.zeros(0, np.int64))
    assert e._offset(first) == 2 * page + page                       # no max_new: not its last chunk
    last = NS(req=req, n_new=300, done=2 * page, chunk=300 - 2 * page, new=np.arange(2 * page))
    assert e._offset(last) == 3 * page + max_new + page
    pd = small("upstream-0.5.11", *PRESSURE, *PD_SPLIT)
    assert pd._max_new(req) == 1 and pd._reserve() == 0               # the PD prefill server's max_new_tokens


def test_admission_reserves_decode_memory_so_fewer_requests_are_retracted():
    """PrefillAdder's ``rem_total_tokens``: admission holds back room for the running requests'
    remaining output (the new-token ratio, from ``schedule_conservativeness``); a lower ratio
    admits more and retracts more."""
    runs = {c: _pressure_run("normal", c)[1] for c in (1.0, 0.1)}
    assert runs[1.0].requests_retracted < runs[0.1].requests_retracted
    assert all(r.requests_completed == r.requests_total for r in runs.values())


def _queue_with(e, specs, monkeypatch):
    """``e``'s waiting queue replaced by requests with the given (ids, device match, host
    match), arrived in that order (fakes for the tree's match: the order is the test)."""
    import dataclasses
    from types import SimpleNamespace as NS
    base = e.waiting[0]
    reqs = [dataclasses.replace(base, rid=1000 + k, arrival_us=k) for k in range(len(specs))]
    ids = {r.rid: np.asarray(s[0], np.int64) for r, s in zip(reqs, specs)}
    match = {tuple(ids[r.rid]): NS(device_indices=np.zeros(s[1], np.int64), host_hit_length=s[2])
             for r, s in zip(reqs, specs)}
    monkeypatch.setattr(e, "_tokens", lambda req: ids[req.rid])
    monkeypatch.setattr(e, "cache", NS(match_prefix=lambda params: match[tuple(params.key.token_ids)]))
    e.waiting = list(reqs)
    return [r.rid for r in reqs]


def test_lpm_orders_the_queue_by_cached_prefix_and_defers_shared_uncached_ones(monkeypatch):
    """SGLang's ``lpm``: the longest matched prefix (device and host tokens, at most all but
    the last) first; a request with at most 32 tokens on the device that shares at least 32
    tokens with an earlier such request goes last (in-batch prefix caching); stable on ties.
    ``fcfs`` (the default) keeps arrival order."""
    uniq = lambda k, n: np.arange(n) + 10_000 * k      # noqa: E731
    specs = {"c": (np.r_[uniq(9, 64), uniq(3, 100)], 0, 0),   # uncached, shares 64 tokens with e
             "e": (np.r_[uniq(9, 64), uniq(5, 100)], 0, 0),   # so e, behind c, goes last
             "a": (uniq(1, 600), 0, 0),                         # nothing cached
             "b": (uniq(2, 600), 512, 0),                       # 512 on the device
             "d": (uniq(4, 2000), 256, 1024),                   # 256 device + 1024 host
             "f": (uniq(6, 300), 0, 300),                       # all on the host: 299 count
             "x": (uniq(7, 400), 0, 300)}                       # 300 on the host
    for policy, want in (("fcfs", "ceabdfx"), ("lpm", "dbxfcae")):
        e = small("upstream-0.5.11", f"scheduler.schedule_policy={policy}")
        e.start()
        rids = dict(zip(specs, _queue_with(e, list(specs.values()), monkeypatch)))
        got = [r.rid for r in e._queue_order(e.session.now + 10)]
        assert got == [rids[c] for c in want], policy


def test_lpm_turns_to_fcfs_above_128_waiting_and_keeps_the_queue_as_it_was(monkeypatch):
    """Above ``LPM_MAX_QUEUE`` waiting, SGLang skips the sort: the queue stays in the order
    the last sort left it (the queue is a list kept across iterations), new arrivals at its end."""
    import dataclasses
    import sim.engine.engine as E
    uniq = lambda k, n: np.arange(n) + 10_000 * k      # noqa: E731
    e = small("upstream-0.5.11", "scheduler.schedule_policy=lpm")
    e.start()
    rids = _queue_with(e, [(uniq(1, 600), 0, 0), (uniq(2, 600), 256, 0), (uniq(3, 600), 512, 0)], monkeypatch)
    assert [r.rid for r in e._queue_order(10)] == [rids[2], rids[1], rids[0]]
    monkeypatch.setattr(E, "LPM_MAX_QUEUE", 2)
    late = dataclasses.replace(e.waiting[0], rid=2000, arrival_us=20)
    e.waiting.append(late)
    assert [r.rid for r in e._queue_order(30)] == [rids[2], rids[1], rids[0], 2000]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_every_request_completes_under_either_policy(policy, monkeypatch):
    """A whole run under each ``scheduler.schedule_policy``: every request completes and reads
    only its own slots (the ownership check runs on every batch).  Under ``fcfs`` admission
    takes requests in queue order (arrival; a retracted request's retraction) across the whole
    run, since a batch ends at the first request it cannot add; under ``lpm`` it does not."""
    from sim.engine.engine import _NO_TOKEN, PrefillEngine as PE
    admit, keys = PE._admit, []

    def spy(self, req, *a, **kw):
        got = admit(self, req, *a, **kw)
        if got is not None and got is not _NO_TOKEN:
            keys.append((self._queued.get(req.rid, req.arrival_us), req.rid))
        return got
    monkeypatch.setattr(PE, "_admit", spy)
    e = small("upstream-0.5.11", *PRESSURE, f"scheduler.schedule_policy={policy}")
    r = e.run()
    assert r.requests_total == len(e.completed) > 0 and not e.aborted
    assert e.counts["ownership_checks"] > 0
    assert (keys == sorted(keys)) == (policy == "fcfs")


@pytest.mark.parametrize("limit_pages", [3, 9, 40])
def test_without_chunking_a_batch_stops_at_max_prefill_tokens(limit_pages):
    """PrefillAdder's ``rem_input_tokens`` (``--max-prefill-tokens``) with chunked prefill off:
    the first request is always taken; a later one whose page-rounded new tokens reach what
    is left ends the batch (``OTHER``), and so does the budget running out after a request
    is added (``budget_state``)."""
    e = small("upstream-0.5.11", "scheduler.chunked_prefill_size=-1",
              f"scheduler.max_prefill_tokens={limit_pages * 64}", "workload.concurrency=8")
    e.start()
    now = e.session.now
    queue = sorted((r for r in e.waiting if r.arrival_us <= now), key=lambda r: (r.arrival_us, r.rid))
    assert len(queue) >= 4
    left, want = limit_pages * 64, []
    for r in queue:                                    # nothing is cached yet: every token is new
        paged = -(-r.input_len // 64) * 64
        if want and paged >= left:
            break
        want.append(r.rid)
        left -= paged
        if left <= 0:
            break
    batch = e._form_batch()
    assert [a.req.rid for a in batch] == want
    if limit_pages == 40:
        assert 1 < len(want) < len(queue)


def test_a_chunked_request_gets_each_chunks_slots_when_its_batch_is_formed():
    """SGLang allocates a batch's KV slots when the batch is prepared (``alloc_for_extend``),
    chunk by chunk for a chunked request: a request's slots cover what its batches have
    computed so far, never its later chunks."""
    e = small("upstream-0.5.10", "scheduler.chunked_prefill_size=256")
    seen, run_batch = [], e._run_batch

    def spy(batch):
        seen.append([(a.done, a.chunk, a.n_new, len(a.new)) for a in batch])
        run_batch(batch)

    e._run_batch = spy
    r = e.run()
    assert r.chunked_batches > 0 and r.requests_completed == r.requests_total
    page = e.page
    for b in seen:
        for done, chunk, n_new, have in b:
            assert have == -(-(done + chunk) // page) * page, (done, chunk, n_new, have)
    assert any(have < -(-n_new // page) * page for b in seen for _, _, n_new, have in b)


def test_a_batch_short_of_slots_asks_the_tree_for_its_whole_need(monkeypatch):
    """``alloc_paged_token_slots_extend`` -> ``evict_from_tree_cache``: when fewer slots are
    free than the batch's new tokens plus a page per request, the tree is asked to evict
    that whole amount (not the shortfall), once per batch."""
    e = small("upstream-0.5.11", *PRESSURE)
    asked, form, calls = [], e._form_batch, []
    tree = object.__getattribute__(e.cache, "_target")
    evict = tree.evict
    monkeypatch.setattr(tree, "evict", lambda p: (calls.append(p.num_tokens), evict(p))[1])

    def spy_form():
        free = e.session.allocator.available_size()
        calls.clear()
        batch = form()
        if batch:
            need = sum(a.chunk for a in batch) + len(batch) * e.page
            asked.append((free, need, list(calls), sum(a.loaded for a in batch)))
        return batch

    monkeypatch.setattr(e, "_form_batch", spy_form)
    r = e.run()
    assert r.requests_completed == r.requests_total
    short = [(free, need, calls) for free, need, calls, loaded in asked if free < need and not loaded]
    assert short, "the workload never ran short of slots"
    for free, need, calls in short:
        assert calls[-1] == need, (free, need, calls)
