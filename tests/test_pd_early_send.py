"""The PD early send (``deployment.pd_send``, hypothesis ``pd-early-send``; SGLang #33970).

SGLang 0.5.14's prefill sends a chunk's KV only after the host saw the chunk's forward complete,
so the sender's RDMA read is not an op of the run (``after_forward``). With an early send, a
non-final chunk's KV is read by the sender as soon as the chunk's forward is launched, on the
``rdma`` stream: behind a wait on an event recorded after the forward (``early``: the backend
that uses the early-send wait event) or with no wait (``early_unfenced``: #33970, corruption on
prefill chunk boundaries). A request an early send covered is released (its slots freed, its
node unlocked) only once the sender's reads have completed, as SGLang's inflight queue waits
for ``KVPoll.Success``.

Short runs of ``incident-short`` cut to 4 layers (SWA, SWA, C4, C128: every pool)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from sim.engine import PrefillEngine
from sim.engine.engine import SEND_READER
from sim.engine.hypotheses import configuration, hypothesis
from sim.engine.models import MODELS
from sim.engine.scenario import load_scenario
from sim.errors import InputError

LAYERS = 4


def run(mode: str, *extra: str):
    sc = load_scenario("incident-short", ["run.duration_s=6", f"deployment.pd_send={mode}", *extra])
    e = PrefillEngine(sc, layers=LAYERS)
    return e, e.run()


@pytest.fixture(scope="module")
def runs():
    return {m: run(m) for m in ("after_forward", "early", "early_unfenced")}


def test_the_hypothesis_sets_the_unfenced_early_send_only():
    c = configuration("deepseek-v4-flash", "incident-fork")
    assert c.pd_send == "after_forward"
    h = hypothesis("pd-early-send")
    assert h.keys == ("pd_send",)
    after = h.apply(c)
    assert after.pd_send == "early_unfenced"
    assert {k: v for k, v in after.to_dict().items() if k not in ("pd_send", "hypotheses")} == \
        {k: v for k, v in c.to_dict().items() if k not in ("pd_send", "hypotheses")}


def test_the_sender_moves_the_pools_sglang_sends_with_every_chunk():
    # get_contiguous_buf_infos: DSA its latent (index-K is state, sent with the last chunk);
    # V4 C4, its indexer and C128 (SWA is state: the window, with the last chunk)
    assert MODELS["dsa-v3.2"].chunk_sent_roles == ("latent",)
    assert MODELS["deepseek-v4-flash"].chunk_sent_roles == ("c4", "index_k", "c128")


def test_after_forward_issues_no_send_and_runs_as_before(runs):
    e, r = runs["after_forward"]
    assert e.counts["early_sends"] == r.early_sends == 0 and "early_sends" not in r.to_dict()
    assert "rdma" not in e.session.header["streams"]
    assert r.requests_corrupted == 0 and r.latent_races == 0


def test_the_early_sends_happen_and_are_judged(runs):
    e, r = runs["early"]
    assert r.early_sends == e.counts["early_sends"] >= 3 and r.to_dict()["early_sends"] == r.early_sends
    # one read per pool the sender moves with every chunk, per send
    assert r.reads_total - runs["after_forward"][1].reads_total == 3 * e.counts["early_sends"]


def test_a_fenced_early_send_races_nothing(runs):
    # the wait orders each read after the chunk's forward (its KV stores), and the request's
    # slots are freed only after the sender's reads completed: nothing reused under them
    _, r = runs["early"]
    assert r.requests_corrupted == 0 and r.stale_reads == 0 and r.torn_reads == 0
    assert r.latent_races == 0 and r.wrong_kv_reads == 0


def test_an_unfenced_early_send_reads_stale_kv_of_its_chunk(runs):
    e, r = runs["early_unfenced"]
    assert e.counts["early_sends"] == runs["early"][0].counts["early_sends"]
    sends = [c for c in r.corrupted_reads if c["reader"] == SEND_READER]
    assert sends, "an unfenced early send read no stale KV"
    assert r.requests_corrupted >= 1 and r.stale_reads >= len(sends)
    for c in sends:
        # the send's own request, its read not behind any wait, no load consumer
        rid = int(c["op"].split(".")[1][1:])
        assert c["requests"] == [rid] and not c["waited"] and c["consumer_index"] == -1
        assert c["role"] in MODELS["deepseek-v4-flash"].chunk_sent_roles
    # every other read of the run is as clean as without the switch
    assert all(c["reader"] == SEND_READER for c in r.corrupted_reads)


def test_the_overlap_loop_sends_early_too():
    _, fenced = run("early", "scheduler.event_loop=overlap")
    _, unfenced = run("early_unfenced", "scheduler.event_loop=overlap")
    assert fenced.requests_corrupted == 0 and fenced.latent_races == 0
    assert any(c["reader"] == SEND_READER for c in unfenced.corrupted_reads)


@pytest.mark.parametrize("value", ["early", "early_unfenced"])
def test_colocated_refuses_an_early_send(value):
    with pytest.raises(InputError) as ei:
        load_scenario("incident-short", ["deployment.mode=colocated", "deployment.decode_tp=4",
                                         f"deployment.pd_send={value}"])
    assert ei.value.where == "deployment.pd_send"


def test_a_bad_value_names_the_key():
    with pytest.raises(InputError) as ei:
        load_scenario("incident-short", ["deployment.pd_send=sometimes"])
    assert "deployment.pd_send" in str(ei.value)


# ---------------------------------------------------------------- random PD workloads

@st.composite
def pd_workloads(draw):
    """Small PD runs of ``glm5-22811-small`` (2 DSA layers, every accessor gated, so only a send
    can race): a few sessions chunked often, a tight device pool (prefixes evicted to the host and
    loaded back), either loop, HiCache on or off, an early send fenced or not."""
    pool = draw(st.sampled_from([1536, 2048, 3072]))
    overrides = [
        "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
        "variant.gate_map=upstream-0.5.11",
        f"deployment.pd_send={draw(st.sampled_from(['early', 'early_unfenced']))}",
        f"scheduler.event_loop={draw(st.sampled_from(['normal', 'overlap']))}",
        f"hicache.prefill={draw(st.sampled_from(['true', 'false']))}",
        f"workload.concurrency={draw(st.integers(1, 4))}",
        f"workload.sessions={draw(st.integers(1, 6))}",
        f"workload.max_turns={draw(st.integers(1, 4))}",
        f"workload.first_turn_tokens={draw(st.sampled_from([256, 512, 768]))}",
        "workload.think_time_s=0.0", f"scheduler.max_total_tokens={pool}",
        f"workload.max_context_tokens={pool - 64}",
        f"scheduler.chunked_prefill_size={draw(st.sampled_from([128, 256, 8192]))}",
    ]
    return overrides, draw(st.integers(0, 2 ** 16))


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pd_workloads())
def test_early_sends_in_random_pd_workloads(case):
    overrides, seed = case
    e = PrefillEngine(load_scenario("glm5-22811-small", overrides), seed, layers=2)
    r = e.run()
    # every request completes, and every early send's release has happened (nothing held)
    assert r.requests_completed == r.requests_total == e.driver.requests_released > 0
    assert not e._send_pending
    # nothing locked, and every slot free or the tree's (the session is finished: its tree is
    # read directly, past the session's call wrapper)
    s = e.session
    tree = e.cache._target if e.hicache else e.cache
    assert tree.protected_size_ == 0
    assert s.allocator.available_size() + tree.total_size() == s.allocator.size_full
    if e.config.pd_send == "early":
        assert r.requests_corrupted == 0 and r.latent_races == 0 and not r.corrupted_reads
    # with every accessor gated, only a send can be corrupted, and only for its own request
    for c in r.corrupted_reads:
        assert c["reader"] == SEND_READER and not c["waited"], c
        assert c["requests"] == [int(c["op"].split(".")[1][1:])], c
