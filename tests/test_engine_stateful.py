"""Stateful exploration of the prefill engine over random small workloads.

Hypothesis draws a small workload on the ``glm5-22811-small`` preset cut to 2 layers
(concurrency, sessions, turns, prompt sizes, the device pool, the seed, the gate map) and
``target()`` steers it toward runs with more load-backs (where the race lives).
The stepped runs use ``run(progress=...)`` (called once per scheduler iteration) to check the
cache's invariants there and apply an action Hypothesis draws (an extra device eviction, an extra
ack poll, the scheduler host busy for a while, or nothing); ``EngineMachine`` is the same as a
``RuleBasedStateMachine`` over the engine's step API (``start``/``step``/``finish``), so
Hypothesis chooses and shrinks the sequence of scheduler iterations and actions itself.  Every
run must satisfy:

* every request ends completed (the engine has no aborts) and nothing is left waiting;
* no request reads a slot it does not own: the engine checks every admitted request before its
  forward (``OwnershipError`` otherwise) and the run counts those checks; and, independently, in
  the run's happens-before order every byte a request reads for its entries is KV written by
  itself or by a request of an earlier batch (never a slot's initial contents);
* between iterations, no slot is held twice (two tree nodes, or a node and the free list), lock
  counts are never negative, evictable + protected sizes add up to the resident tokens;
* the metrics agree with each other: corrupted requests <= requests, ``stale + torn`` = the
  corrupted reads listed, each corrupted read is an ungated read of a batch that loaded, its
  requests are the corrupted ones, the reads counted are the forward's reads;
* the gated map (``upstream-0.5.11``) gives no corrupted read and no index-K race, extra
  evictions and delays included;
* the same seed gives the same ``signature()``.

The slow tier draws more examples.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st, target

from sim.bytes.describe import describe
from sim.cache.records import EvictParams
from sim.engine import PrefillEngine
from sim.engine.scenario import SCHEDULE_POLICIES, load_scenario
from sim.executor import run_reference

PRESET = "glm5-22811-small"
LAYERS = 2
GATED, UNGATED = "upstream-0.5.11", "upstream-0.5.10"
PAGE = 64
#: drawn for ``variant.hypotheses`` (shrinking towards ``none``): a batch that loads may replay a
#: graph without waits, whatever the gate map
HYPOTHESES = ("none", "none", "graph-replay-no-waits")


@st.composite
def workloads(draw, gate_maps=(UNGATED, GATED), event_loop=None):
    """``(overrides, seed)`` for a small run of the preset: a few sessions of a few turns over a
    device pool of 1.5k to 3k tokens, so later turns find their prefix evicted to the host,
    under any schedule policy, chunked often or never, now and then with the prefill batches
    that load replaying a graph without waits.  ``event_loop``: also set
    ``scheduler.event_loop``."""
    pool = draw(st.sampled_from([1536, 2048, 3072]))
    user_min = draw(st.integers(32, 256))
    overrides = [
        f"variant.gate_map={draw(st.sampled_from(gate_maps))}",
        f"workload.concurrency={draw(st.integers(1, 6))}",
        f"workload.sessions={draw(st.integers(1, 8))}",
        f"workload.max_turns={draw(st.integers(1, 5))}",
        f"workload.first_turn_tokens={draw(st.sampled_from([256, 384, 512, 768]))}",
        f"workload.user_tokens_min={user_min}",
        f"workload.user_tokens_max={user_min + draw(st.integers(0, 256))}",
        f"workload.think_time_s={draw(st.sampled_from([0.0, 0.0005]))}",
        f"scheduler.max_total_tokens={pool}",
        # NOTE: a turn always fits the device pool with room for its last page
        f"workload.max_context_tokens={pool - PAGE}",
        f"scheduler.schedule_policy={draw(st.sampled_from(SCHEDULE_POLICIES))}",
        # NOTE: both loops stash a chunked request per chunk: chunk often in either
        f"scheduler.chunked_prefill_size={draw(st.sampled_from([128, 256, 2048, 8192]))}",
        f"variant.hypotheses={draw(st.sampled_from(HYPOTHESES))}",
    ]
    if event_loop is not None:
        overrides.append(f"scheduler.event_loop={event_loop}")
    return overrides, draw(st.integers(0, 2 ** 16))


def _engine(overrides, seed) -> PrefillEngine:
    e = PrefillEngine(load_scenario(PRESET, overrides), seed, layers=LAYERS)
    # which requests each store wrote for (a prefill batch's or a colocated decode step's store
    # is one write per pool whose owner is only its first request; its version is the store's
    # number)
    e.stored_for = {}
    record = e._record_kv

    def logged(req, slots, pos, store):
        e.stored_for.setdefault(store, set()).add(req.rid)
        return record(req, slots, pos, store)
    e._record_kv = logged
    return e


def _check_run(e: PrefillEngine, r, gate_map: str) -> None:
    # every request ends completed; nothing left
    assert r.requests_total == e.driver.requests_released > 0
    assert r.requests_completed == r.requests_total
    assert e.driver.done and not e.waiting
    assert sorted(e.completed) == list(range(r.requests_total))
    # ownership: every admitted request was checked before its forward (a failed check raises)
    assert r.ownership_checks >= r.requests_total
    # metrics agree
    assert 0 <= r.requests_corrupted <= r.requests_total
    assert r.corrupted_fraction == pytest.approx(r.requests_corrupted / r.requests_total)
    assert r.stale_reads + r.torn_reads == len(r.corrupted_reads)
    hit = {rid for c in r.corrupted_reads for rid in c["requests"]}
    assert len(hit) == r.requests_corrupted and hit <= set(range(r.requests_total))
    for c in r.corrupted_reads:
        assert c["status"] in ("stale", "torn")
        # only a read that did not wait, in a batch that loaded something, can see a load mid-way
        assert c["waited"] is False and c["consumer_index"] >= 0, c
        assert c["requests"], c
    assert r.reads_total == sum(len(i.reads) for i in e.issues)
    assert r.load_back_tokens % PAGE == 0 and r.load_back_tokens >= r.load_backs
    assert r.oob_writes == 0
    # a replayed graph is a batch that loaded (one forward issue per batch: one simulated rank)
    replays = e.config.graph_replay_max_tokens > 0
    if replays:
        assert r.graph_replays <= sum(issue.consumer_index >= 0 for issue in e.issues)
    else:
        assert r.graph_replays == 0
    if gate_map == GATED and not replays:
        assert r.requests_corrupted == 0 and r.stale_reads == r.torn_reads == 0 and not r.corrupted_reads
        assert r.latent_races_by_buffer.get("index_k_with_scale_buffer", 0) == 0


def _check_read_bytes_are_owned(e: PrefillEngine) -> None:
    """In the happens-before order of the run (what every read should see), every byte a
    request's forward reads for its own entries is KV some request wrote: never a slot's
    initial contents, and never the KV of a request first computed in a later batch (a slot
    handed over before its KV existed), nor of a store of the same batch that did not write for
    it.  (A batch's store is one write for all its requests, so which of its units a request's
    own are is the KV oracle's per-unit check, not this one.)"""
    run = e.session.finish()                      # the finished run (finish() returns it again)
    ref = run_reference(run.schedule, materialise=False, table=run.memory.table)
    ref_reads = {r.op_id: r for r in ref.reads}
    first_batch: dict[int, int] = {}
    for k, issue in enumerate(e.issues):
        for info in issue.reads:
            for rid in info.entries:
                first_batch.setdefault(rid, k)
    for k, issue in enumerate(e.issues):
        for info in issue.reads:
            runs = [(v.offset + d["offset"], d["nbytes"], d["origin"]["owner"], d["origin"]["version"])
                    for v in ref_reads[info.op_id].views for d in describe(v.compact, 0, v.compact.nbytes, 1 << 30)]
            starts = np.array([r[0] for r in runs], np.int64)
            ends = starts + np.array([r[1] for r in runs], np.int64)
            owners = np.array([r[2] for r in runs], np.int64)
            stores = np.array([r[3] for r in runs], np.int64)
            lay = e.buffers[info.role][1]
            for rid, ent in info.entries.items():
                for pl in info.pool_layers:
                    offs, lens = lay.token_extents(pl, ent)
                    lo, hi = offs.ravel(), (offs + lens).ravel()
                    # the runs that overlap any of this request's entry extents
                    a = np.searchsorted(ends, lo, side="right")
                    b = np.searchsorted(starts, hi, side="left")
                    idx = np.unique(np.concatenate([np.arange(x, y) for x, y in zip(a, b)]))
                    assert idx.size and starts[idx].min() <= lo.min() and ends[idx].max() >= hi.max(), \
                        (info.op_id, rid, "entries outside the read")
                    for owner, store in set(zip(owners[idx].tolist(), stores[idx].tolist())):
                        assert owner >= 0, (info.op_id, rid, "reads a slot's initial contents")
                        # the requests the store wrote for
                        wrote = e.stored_for[store]
                        assert rid in wrote or all(first_batch.get(w, k) < k for w in wrote), \
                            (info.op_id, rid, owner, store)


def _gate_map(overrides) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("variant.gate_map="))


def _explore(case) -> None:
    overrides, seed = case
    e = _engine(overrides, seed)
    r = e.run()
    _check_run(e, r, _gate_map(overrides))
    _check_read_bytes_are_owned(e)
    event(f"{_gate_map(overrides)}: {'some' if r.requests_corrupted else 'no'} request corrupted, "
          f"{'some' if r.load_backs else 'no'} load-back")
    target(float(r.load_backs), label="load-backs")
    target(float(r.load_back_tokens), label="tokens loaded back")


def _determinism_and_gated_twin(case) -> None:
    overrides, seed = case
    a = _engine(overrides, seed).run()
    b = _engine(overrides, seed).run()
    assert a.signature() == b.signature()
    twin_overrides = [o for o in overrides if not o.startswith("variant.gate_map=")] + [f"variant.gate_map={GATED}"]
    e = _engine(twin_overrides, seed)
    twin = e.run()
    _check_run(e, twin, GATED)
    # the gate map changes what the forward waits on, never the workload's plan
    assert twin.requests_total == a.requests_total
    target(float(a.load_backs), label="load-backs")


# ---------------------------------------------------------------- stepped runs
#
# PrefillEngine.run calls ``progress`` once per scheduler iteration, before it polls the acks and
# forms a batch.  A stepped run uses that hook as the state machine's step: it checks the cache's
# invariants, then applies an action Hypothesis draws for this step (nothing, an extra device
# eviction as memory pressure from elsewhere would cause, an extra ack poll, or the scheduler host
# busy for a while), so Hypothesis explores and shrinks sequences of actions between the engine's
# own steps.  target() steers toward steps with more load-backs in flight.


ACTIONS = st.one_of(st.just(("none", 0)), st.tuples(st.just("evict"), st.integers(1, 2048)),
                    st.just(("poll", 0)), st.tuples(st.just("advance"), st.integers(1, 400)))
#: steps at which an action is drawn (the rest of the run only checks the invariants)
DRAWN_STEPS = 40


def _tree_nodes(tree):
    out, stack = [], [tree.root_node]
    while stack:
        n = stack.pop()
        if n is not tree.root_node:
            out.append(n)
        stack.extend(n.children.values())
    return out


def _check_cache(e: PrefillEngine) -> None:
    """Between two scheduler iterations: no device or host slot is held by two tree nodes or by
    a node and the free list; lock and host reference counts are never negative; an evicted node
    has a host copy and no resident node hangs below an evicted one; the evictable and protected
    sizes add up to the resident tokens (protected: those of locked nodes)."""
    s = e.session
    tree = s.tree
    nodes = _tree_nodes(tree)
    dev = [d for n in nodes if not n.evicted for d in np.asarray(n.value).tolist()]
    alloc = s.allocator
    pages = np.concatenate([np.asarray(alloc.free_pages), np.asarray(getattr(alloc, "release_pages", []))])
    free = (pages.astype(np.int64)[:, None] * PAGE + np.arange(PAGE)).reshape(-1).tolist()
    assert len(set(dev)) == len(dev), "a device slot in two tree nodes"
    assert not set(dev) & set(free), "a device slot of the tree is on the free list"
    host = [h for n in nodes if n.backuped for h in np.asarray(n.host_value).tolist()]
    assert len(set(host)) == len(host), "a host slot in two tree nodes"
    assert not set(host) & set(np.asarray(s.host_pool.free_slots).tolist()), "a host slot of the tree is free"
    resident = locked = 0
    for n in nodes:
        assert n.lock_ref >= 0 and n.host_ref_counter >= 0
        assert n.backuped or not n.evicted, "an evicted node without a host copy"
        if not n.evicted:
            assert n.parent is tree.root_node or not n.parent.evicted, "a resident node below an evicted one"
            resident += len(n.value)
            locked += len(n.value) if n.lock_ref > 0 else 0
    assert tree.evictable_size() + tree.protected_size() == resident
    assert tree.protected_size() == locked


def _stepped_run(data, case):
    overrides, seed = case
    e = _engine(overrides, seed)
    steps, most_in_flight = [0], [0]

    def step(_now_us):
        _check_cache(e)
        s = e.session
        most_in_flight[0] = max(most_in_flight[0], len(s.controller.ack_load_queue))
        steps[0] += 1
        if steps[0] > DRAWN_STEPS:
            return
        kind, amount = data.draw(ACTIONS, label=f"action at step {steps[0]}")
        if kind == "evict":
            s.cache.evict(EvictParams(amount))
        elif kind == "poll":
            s.cache.check_hicache_events()
        elif kind == "advance":
            s.advance(float(amount))

    r = e.run(progress=step)
    _check_cache(e)
    _check_run(e, r, _gate_map(overrides))
    _check_read_bytes_are_owned(e)
    target(float(most_in_flight[0]), label="load-backs in flight at a step")
    target(float(r.load_backs), label="load-backs")


FAST = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEEP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(workloads())
def test_random_small_workloads_complete_own_their_slots_and_agree(case):
    _explore(case)


@settings(FAST, max_examples=2)
@given(workloads(gate_maps=(UNGATED,)))
def test_same_seed_same_signature_and_the_gated_twin_is_clean(case):
    _determinism_and_gated_twin(case)


@pytest.mark.slow
@DEEP
@given(workloads())
def test_random_small_workloads_deep(case):
    _explore(case)


@pytest.mark.slow
@settings(DEEP, max_examples=20)
@given(workloads(gate_maps=(UNGATED,)))
def test_same_seed_and_gated_twin_deep(case):
    _determinism_and_gated_twin(case)


def test_the_owned_bytes_check_catches_a_request_whose_kv_was_never_stored(monkeypatch):
    from sim.cache.session import CacheSession

    store = CacheSession.store_kv

    def store_all_but_request_0(self, slots, owner, **kw):
        if owner != 0:
            return store(self, slots, owner, **kw)
    monkeypatch.setattr(CacheSession, "store_kv", store_all_but_request_0)
    e = _engine([f"variant.gate_map={GATED}", "workload.sessions=1", "workload.max_turns=1"], 0)
    e.run()
    with pytest.raises(AssertionError, match="initial contents"):
        _check_read_bytes_are_owned(e)


@settings(FAST, max_examples=3)
@given(st.data(), workloads())
def test_stepped_runs_with_extra_evictions_polls_and_delays_keep_the_invariants(data, case):
    _stepped_run(data, case)


@pytest.mark.slow
@settings(DEEP, max_examples=40)
@given(st.data(), workloads())
def test_stepped_runs_deep(data, case):
    _stepped_run(data, case)


# ---------------------------------------------------------------- a RuleBasedStateMachine over the step API

from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402


class EngineMachine(RuleBasedStateMachine):
    """The engine driven one scheduler iteration at a time (``PrefillEngine.step``), with
    Hypothesis choosing what happens between iterations: another iteration (arrivals, turns,
    batches, load-backs and decode happen there, as the workload and the scheduler decide), an
    extra device eviction, an extra ack poll, or the scheduler host busy for a while.  The cache
    invariants hold after every rule; at the end the run is driven to completion and every
    request must be completed, own what it read, and the metrics must agree."""

    @initialize(case=workloads())
    def start(self, case):
        self.case = case
        self.e = _engine(*case)
        self.e.start()
        self.running = True
        self.most_in_flight = 0

    @rule()
    def scheduler_iteration(self):
        if self.running:
            self.running = self.e.step()
        n = len(self.e.session.controller.ack_load_queue)
        self.most_in_flight = max(self.most_in_flight, n)

    @rule(tokens=st.sampled_from([64, 256, 1024]))
    def extra_eviction(self, tokens):
        if self.running:
            self.e.session.cache.evict(EvictParams(tokens))

    @rule()
    def ack_poll(self):
        if self.running:
            self.e.session.cache.check_hicache_events()

    @rule(us=st.sampled_from([5.0, 50.0, 500.0]))
    def host_busy(self, us):
        if self.running:
            self.e.session.advance(us)

    @invariant()
    def cache_is_consistent(self):
        if hasattr(self, "e"):
            _check_cache(self.e)

    def teardown(self):
        if not hasattr(self, "e"):
            return
        for _ in range(100_000):
            if not self.running or not self.e.step():
                break
            _check_cache(self.e)
        r = self.e.finish()
        _check_run(self.e, r, _gate_map(self.case[0]))
        _check_read_bytes_are_owned(self.e)
        # NOTE: once per test case (target() refuses a second observation of a label)
        target(float(self.most_in_flight), label="load-backs in flight")


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = _settings(3, 25)


@pytest.mark.slow
class TestEngineMachineDeep(EngineMachine.TestCase):
    settings = _settings(40, 80)


class OverlapEngineMachine(EngineMachine):
    """The same machine on the overlap loop (``scheduler.event_loop = "overlap"``: each batch's
    result processed one iteration later, the chunked request stashed into the tree per chunk):
    every request ends, owns what it read, and with the gated map (the load fenced, the
    default) nothing is corrupted."""

    @initialize(case=workloads(event_loop="overlap"))
    def start(self, case):
        super().start(case)


TestOverlapEngineMachine = OverlapEngineMachine.TestCase
TestOverlapEngineMachine.settings = _settings(3, 25)


@pytest.mark.slow
class TestOverlapEngineMachineDeep(OverlapEngineMachine.TestCase):
    settings = _settings(30, 80)
