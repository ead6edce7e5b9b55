"""``graph-replay-no-waits``: a load-carrying prefill batch replays a CUDA graph captured without
waits (reference/sglang_hicache.md section 7.3: waits are host-issued ``wait_event`` calls, so a
graph captured with consumer index -1 holds none; SGLang 0.5.14's scheduler notes that graph
execution should be turned off when a HiCache load is triggered, and does not do it).

Tiny runs of ``glm5-22811-small`` (2 DSA layers) under the 0.5.11 gate map, where every accessor
waits: without the switch nothing is corrupted; with it the batches that load replay a graph and
their reads, latent and index-K alike, race the load."""
from __future__ import annotations

import pytest

import sim.engine.hypotheses as hypotheses
from sim.engine import PrefillEngine
from sim.engine.hypotheses import Hypothesis, configuration, hypothesis, hypothesis_names, register
from sim.engine.scenario import load_scenario
from sim.errors import InputError

LAYERS = 2


def engine(*extra: str, seed: int = 0) -> PrefillEngine:
    sc = load_scenario("glm5-22811-small", ["variant.gate_map=upstream-0.5.11", *extra])
    return PrefillEngine(sc, seed, layers=LAYERS)


@pytest.fixture(scope="module")
def replayed():
    e = engine("variant.hypotheses=graph-replay-no-waits")
    return e, e.run()


def test_the_switch_sets_the_replay_bound_only():
    c = configuration("dsa-v3.2", "upstream-0.5.11")
    assert c.graph_replay_max_tokens == 0
    h = hypothesis("graph-replay-no-waits")
    assert h.keys == ("graph_replay_max_tokens",)
    out = h.apply(c)
    # NOTE: SGLang's prefill graph runner captures up to 8,192 tokens when no sizes are given
    assert out.graph_replay_max_tokens == 8192
    assert out.gate_map == c.gate_map           # the gate map is the engine version's; the replay drops its waits


def test_replayed_batches_read_without_waiting_and_corrupt(replayed):
    e, r = replayed
    assert r.load_backs > 0
    # every batch that loaded (one consumer index per batch, however many load-backs it merged)
    # fits the captured graph: 2,048-token chunks under an 8,192 bound
    loading = sum(issue.consumer_index >= 0 for issue in e.issues)
    assert 0 < r.graph_replays == loading <= r.load_backs
    assert r.requests_corrupted >= 1
    roles = set()
    for c in r.corrupted_reads:
        assert c["consumer_index"] >= 0 and c["waited"] is False, c
        roles.add(c["role"])
    # the whole forward lost its waits: the latent read races too, not only the indexer's
    assert "index_k" in roles and roles - {"index_k"}, roles
    assert r.latent_races > 0


def test_without_the_switch_the_same_seed_is_clean():
    r = engine().run()
    assert r.load_backs > 0 and r.graph_replays == 0
    assert r.requests_corrupted == 0 and r.latent_races == 0
    assert "graph_replays" not in r.to_dict()     # results without replays read as they did before


def test_batches_over_the_bound_run_eagerly_and_wait(monkeypatch):
    # NOTE: registered for this test only (the registry is global: a signature table built later
    # in this process would grow a row)
    monkeypatch.setattr(hypotheses, "_REGISTRY", dict(hypotheses._REGISTRY))
    register(Hypothesis("graph-replay-tiny", "only batches of at most 1 token replay a graph",
                        lambda c: c.replace(graph_replay_max_tokens=1), ("graph_replay_max_tokens",)))
    r = engine("variant.hypotheses=graph-replay-tiny").run()
    base = engine().run()
    # no loading batch has a single token: none replays, and the run is the unswitched run
    assert r.graph_replays == 0
    assert r.signature() == base.signature()


def test_the_test_switch_left_the_registry():
    assert "graph-replay-tiny" not in hypothesis_names()


def test_the_bound_is_validated():
    c = configuration("dsa-v3.2", "upstream-0.5.11")
    with pytest.raises(InputError, match="graph_replay_max_tokens"):
        c.replace(graph_replay_max_tokens=-1)
    with pytest.raises(InputError, match="graph_replay_max_tokens"):
        c.replace(graph_replay_max_tokens="8192")

