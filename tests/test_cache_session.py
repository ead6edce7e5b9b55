"""CacheSession: SGLang's HiRadixCache over the controller and the executor, from plain
Python.  The load-back order follows ``reference/sglang_hicache.md`` §1.2 (match ->
init_load_back allocates and marks resident before any byte moves -> start_loading ->
gated reads -> ack polling); every session run re-runs from its record to the same
Snapshot (what ``kvrace schedule run`` predicts for the recorded file).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrace.cli import main
from sim.cache import CacheSession, ProducerSlotBusy, SettleRequired
from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.cache.session import SessionClosed
from sim.errors import InputError
from sim.executor import run_schedule
from sim.profile import load_profile
from sim.schedule import validate
from sim.snapshot import Snapshot, snapshot_of
from sim.verdicts import analyse

SMALL = {"layers": 2, "device_tokens": 32, "kv_lora_rank": 24, "qk_rope_head_dim": 8}   # 64 B rows


def same_snapshot(a: Snapshot, b: Snapshot) -> None:
    assert a.schedule_digest == b.schedule_digest
    assert a.buffers == b.buffers
    assert a.timings_us == b.timings_us
    assert a.reads.keys() == b.reads.keys()
    for k in a.reads:
        assert (a.reads[k] == b.reads[k]).all(), k


def rerun(doc, profile="h200"):
    return run_schedule(validate(json.loads(json.dumps(doc))), load_profile(profile))


def cached_then_evicted(s: CacheSession, owner: int = 12, n: int = 16):
    """Request ``owner`` prefills ``n`` tokens (its KV written), inserts them (write_through
    backs them up at once), the backup is acknowledged, then device eviction leaves the
    node host-only.  Returns the key."""
    slots = s.allocator.alloc(n)
    s.store_kv(slots, owner=owner)
    key = RadixKey(np.arange(1000, 1000 + n))
    s.cache.insert(InsertParams(key, slots))
    assert len(s.controller.ack_write_queue) == 1          # write_through: the backup starts at insert
    s.wait_idle()
    s.cache.check_hicache_events()
    assert s.controller.ack_write_queue == []
    assert s.cache.evict(EvictParams(n)).num_tokens_evicted == n
    return key


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("bad, where, expected", [
    ({"model": "mha"}, "config.model", "one of ['mla', 'dsa', 'deepseek-v4']"),
    ({"model": "dsa", "page_size": 1}, "config.page_size", "64 for model 'dsa'"),
    ({"device_tokens": 30, "page_size": 4}, "config.device_tokens", "multiple of page_size"),
    ({"layout": "page_head"}, "config.layout", "layer_first"),
    ({"io_backend": "kernel_ascend"}, "config.io_backend", "['kernel', 'direct']"),
    ({"write_policy": "lazy"}, "config.write_policy", "write_back"),
    ({"hicache_ratio": 0}, "config.hicache_ratio", "> 0"),
    ({"layers": True}, "config.layers", "an integer"),
    ({"colour": "red"}, "config.colour", "expected one of"),
])
def test_config_errors_name_the_key_and_the_expected_value(bad, where, expected):
    with pytest.raises(InputError) as e:
        CacheSession({**SMALL, **bad})
    assert e.value.where == where and expected in e.value.message


def test_layout_and_io_backend_are_resolved_as_sglangs_server_args_do():
    s = CacheSession(SMALL, layout="page_first", io_backend="direct")
    assert (s.config.layout, s.config.io_backend) == ("page_first_direct", "direct")
    assert s.host_pool.layout == "page_first_direct" and s.controller.io_backend == "direct"


# ---------------------------------------------------------------- a load-back

def test_load_back_marks_nodes_resident_before_bytes_move_and_a_gated_read_sees_the_prefix():
    s = CacheSession(SMALL, layout="layer_first")
    key = cached_then_evicted(s)
    m = s.cache.match_prefix(MatchPrefixParams(key))
    assert m.device_indices.size == 0 and m.host_hit_length == 16
    slots, node = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    assert len(slots) == 16 and len(s.controller.load_queue) == 1
    # resident already: a second match finds the prefix on the device, though nothing moved yet
    again = s.cache.match_prefix(MatchPrefixParams(key))
    assert again.device_indices.tolist() == slots.tolist()
    dev = s.device_pool.kv_buffer
    assert set(s.owners_of(dev, 1, slots)) == {-1}       # still the slots' previous bytes
    t0 = s.now
    pid = s.cache.ready_to_load_host_cache()
    assert pid == 0 and s.now == t0                      # start_loading does not block (kernel)
    s.read(dev, 1, slots, id="ungated")                  # no wait_until: the #22811 class
    s.read(dev, 1, slots, gate=pid, id="gated")
    s.wait_idle()
    assert s.owners_of(dev, 0, slots) == [12] * 16 and s.owners_of(dev, 1, slots) == [12] * 16
    # the copy carried request 12's units 0..15 (its prefill wrote device slots 1..16)
    assert [runs[0]["first_unit"] for runs in s.bytes_of(dev, 1, slots)] == list(range(1, 17))
    s.cache.check_hicache_events()                        # the load ack: the path is unlocked
    assert s.controller.ack_load_queue == [] and s.tree.protected_size() == 0
    run = s.finish()
    rep = analyse(run)
    status = {r["op"]: r["status"] for r in rep["reads"]}
    assert status == {"ungated": "stale", "gated": "ok"}
    assert any("ungated" in r["ops"] for r in rep["latent_races"])
    assert not any("gated" in r["ops"] for r in rep["latent_races"])
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s.record())))


def test_recorded_session_reruns_through_kvrace_schedule_run_to_the_same_snapshot(tmp_path):
    s = CacheSession(SMALL, layout="page_first")
    key = cached_then_evicted(s, owner=7)
    m = s.cache.match_prefix(MatchPrefixParams(key))
    s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    pid = s.cache.ready_to_load_host_cache()
    s.read(s.device_pool.kv_buffer, 0, m.best_match_node.value, gate=pid, id="layer0")
    s.advance(3.0)
    s.cache.check_hicache_events()
    doc_path, snap_path = tmp_path / "session.json", tmp_path / "snap.json"
    doc_path.write_text(json.dumps(s.record()))
    expected = s.snapshot()
    assert main(["schedule", "run", str(doc_path), "--profile", "h200", "--snapshot", str(snap_path),
                 "--fail-on", "none"]) == 0
    same_snapshot(expected, Snapshot.load(str(snap_path)))


def test_advance_and_wait_idle_are_recorded_host_ops():
    s = CacheSession(SMALL)
    s.advance(12.5)
    s.wait_idle()
    assert s.now == 12.5
    assert [(d["op"], d.get("duration_us")) for d in s.record()["ops"]] == [("host_delay", 12.5),
                                                                           ("host_sync", None)]


def test_an_advance_longer_than_one_host_delay_is_recorded_as_several():
    """A scheduler idle longer than one ``host_delay`` may last (``MAX_DURATION_US``: a long think
    time or a slow Poisson arrival) is recorded as several delays, each valid, summing to it, and
    the record re-runs; the error used to name an op the user never wrote."""
    from sim.schedule import MAX_DURATION_US

    s = CacheSession(SMALL)
    s.advance(2.5 * MAX_DURATION_US)
    assert s.now == 2.5 * MAX_DURATION_US
    delays = [d["duration_us"] for d in s.record()["ops"] if d["op"] == "host_delay"]
    assert delays == [MAX_DURATION_US, MAX_DURATION_US, 0.5 * MAX_DURATION_US]
    validate(s.record())
    with pytest.raises(InputError, match="us"):
        s.advance(-1.0)


def test_write_back_eviction_blocks_on_the_backup_inside_the_call():
    s = CacheSession(SMALL, write_policy="write_back")
    slots = s.allocator.alloc(16)
    s.store_kv(slots, owner=3)
    s.cache.insert(InsertParams(RadixKey(np.arange(16)), slots))
    assert s.controller.ack_write_queue == []             # write_back: no backup at insert
    assert s.cache.evict(EvictParams(16)).num_tokens_evicted == 16
    ops = s.record()["ops"]
    kinds = [d["op"] for d in ops]
    assert kinds[-5:] == ["record", "wait", "copy", "record", "host_sync"]   # backup, then the block
    finish = next(d for d in ops if d["op"] == "record" and d["event"].endswith("finish"))
    run = s.finish()
    # the host was blocked until the backup's finish event: the sync ends when it does
    assert run.timings[ops[-1]["id"]][1] == pytest.approx(run.timings[finish["id"]][1])
    assert s.tree.evictable_size() == 0 and s.host_pool.available_size() == s.host_pool.size - 16


def test_direct_backend_session_blocks_on_the_index_d2h_and_reruns_the_same():
    s = CacheSession(SMALL, layout="layer_first", io_backend="direct")
    key = cached_then_evicted(s, owner=5)
    m = s.cache.match_prefix(MatchPrefixParams(key))
    slots, _ = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    s.cache.ready_to_load_host_cache()
    kinds = [(d["op"], d.get("stream")) for d in s.record()["ops"]]
    i = kinds.index(("host_sync", "schedule"), len(kinds) - 2 * s.device_pool.layer_num - 6)
    assert kinds[i + 1] == ("record", "schedule")        # the load's start event, after the block
    s.wait_idle()
    assert s.owners_of(s.device_pool.kv_buffer, 1, slots) == [5] * 16
    run = s.finish()
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s.record())))


def test_dsa_session_loads_the_index_k_sidecar_with_the_latent():
    s = CacheSession(model="dsa", page_size=64, layers=2, device_tokens=128, layout="page_first")
    key = cached_then_evicted(s, owner=9, n=64)
    m = s.cache.match_prefix(MatchPrefixParams(key))
    slots, _ = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    pid = s.cache.ready_to_load_host_cache()
    copies = [d for d in s.record()["ops"] if d["op"] == "copy" and d["stream"] == "load"]
    assert [c["dst"] for c in copies] == [s.device_pool.kv_buffer, s.device_pool.index_k_buffer] * 2
    s.read(s.device_pool.index_k_buffer, 1, [int(slots[0]) // 64], gate=pid, id="index_k")
    s.wait_idle()
    assert s.owners_of(s.device_pool.index_k_buffer, 1, [int(slots[0]) // 64]) == [9]
    assert analyse(s.finish())["reads"][0]["status"] == "ok"


# ---------------------------------------------------------------- driving and closing

def test_call_drives_a_host_program_and_plain_calls_are_settled():
    s = CacheSession(SMALL)

    def program():
        yield s.host.delay(4.0)
        return s.now

    assert s.call(program) == 4.0
    s.controller.load(np.arange(3))
    s.controller.start_loading()
    s.controller.ack_load_queue[0].finish_event.synchronize()
    with pytest.raises(SettleRequired):
        s.controller.ack_load_queue[0].finish_event.query()
    s.settle()
    assert s.controller.settled and s.now > 4.0


def test_a_finished_session_takes_no_more_calls():
    s = CacheSession(SMALL)
    s.finish()
    with pytest.raises(SessionClosed):
        s.advance(1.0)
    with pytest.raises(SessionClosed):
        s.cache.check_hicache_events()


# ---------------------------------------------------------------- property: any operation sequence

#: token sequences share prefixes (matches, splits, load-backs of partial paths)
_KEYS = [np.arange(0, 24), np.arange(0, 12), np.r_[np.arange(0, 8), np.arange(50, 62)], np.arange(100, 116),
         np.arange(200, 212), np.arange(300, 312)]
_prefill = st.tuples(st.just("prefill"), st.integers(0, len(_KEYS) - 1), st.integers(1, 99))
_load_back = st.tuples(st.just("load_back"), st.integers(0, len(_KEYS) - 1), st.booleans())
_offload = st.tuples(st.just("offload"),)       # acks processed, then the whole device evicted
_cycle = st.tuples(st.just("cycle"), st.integers(0, len(_KEYS) - 1), st.integers(1, 99), st.booleans())
_step = st.one_of(
    _prefill, _cycle, _load_back, _load_back, _offload,
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 10.0, 40.0])),
    st.tuples(st.just("check"),),
    st.tuples(st.just("evict"), st.sampled_from([4, 12, 32])),
    st.tuples(st.just("evict_host"), st.sampled_from([8, 24])),
    st.tuples(st.just("wait_idle"),),
)


def _drive(s: CacheSession, steps) -> None:
    dev = s.device_pool.kv_buffer
    for step in steps:
        kind = step[0]
        if kind == "cycle":          # a prefill, its offload, and a load-back of the same key
            _drive(s, [("prefill",) + step[1:3], ("offload",), ("load_back", step[1], step[3])])
        elif kind == "prefill":
            key = RadixKey(_KEYS[step[1]])
            slots = s.allocator.alloc(len(key))
            if slots is None:
                s.cache.evict(EvictParams(len(key)))
                slots = s.allocator.alloc(len(key))
            if slots is None:
                continue
            s.store_kv(slots, owner=step[2])
            r = s.cache.insert(InsertParams(key, slots))
            s.allocator.free(slots[:r.prefix_len])               # the caller's duplicates
        elif kind == "offload":
            s.wait_idle()
            s.cache.check_hicache_events()
            s.cache.evict(EvictParams(s.config.device_tokens))
        elif kind == "advance":
            s.advance(step[1])
        elif kind == "check":
            s.cache.check_hicache_events()
        elif kind == "evict":
            s.cache.evict(EvictParams(step[1]))
        elif kind == "evict_host":
            s.cache.evict_host(step[1])
        elif kind == "load_back":
            m = s.cache.match_prefix(MatchPrefixParams(RadixKey(_KEYS[step[1]])))
            if m.host_hit_length == 0:
                continue
            s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
            try:
                pid = s.cache.ready_to_load_host_cache()
            except ProducerSlotBusy:
                continue                                       # SGLang's assert: a real outcome
            if pid >= 0 and step[2]:
                node = m.best_match_node
                s.read(dev, s.device_pool.layer_num - 1, node.value, gate=pid)
        else:
            s.wait_idle()


def _session_reruns(config, steps) -> None:
    s = CacheSession({**SMALL, "device_tokens": 64, **config})
    _drive(s, steps)
    run = s.finish()
    same_snapshot(snapshot_of(run), snapshot_of(rerun(s.record(), s.config.profile)))
    for r in analyse(run)["reads"]:
        assert r["status"] == "ok"                    # every read was gated on its layer event


_configs = st.fixed_dictionaries({
    "layout": st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
    "io_backend": st.sampled_from(["kernel", "direct"]),
    "write_policy": st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    "overlap": st.booleans(),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs, st.lists(_step, min_size=1, max_size=14))
def test_any_cache_operation_sequence_reruns_from_its_record_to_the_same_snapshot(config, steps):
    _session_reruns(config, steps)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs, st.lists(_step, max_size=40))
def test_any_cache_operation_sequence_reruns_from_its_record_deep(config, steps):
    _session_reruns(config, steps)


def test_the_docs_example_runs_and_its_record_reruns(capsys):
    import pathlib
    import re

    text = pathlib.Path(__file__).resolve().parents[1].joinpath("docs", "hicache_controller.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/hicache_controller.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "kv layer 1 request 12 unit 1 v1" in out
    s = scope["s"]
    same_snapshot(s.snapshot(), snapshot_of(rerun(scope["doc"])))


def test_backup_without_waiting_for_the_forward_races_its_kv_writes():
    # the scheduler inserts (starting the backup) before the forward's KV writes are known to
    # be done: the write stream's copy reads the slots unordered after the writes
    for sync, races in ((True, 0), (False, 1)):
        s = CacheSession(SMALL)
        slots = s.allocator.alloc(16)
        ids = s.store_kv(slots, owner=4, sync=sync)
        s.cache.insert(InsertParams(RadixKey(np.arange(16)), slots))
        rep = analyse(s.finish())
        pairs = [r for r in rep["latent_races"] if r["ops"][1].startswith("hicache.write0.copy")]
        assert len(pairs) == races                        # one: every layer is one write op
        assert all(r["ops"][0] == ids[0] for r in pairs)
        assert len(ids) == 1                              # one buffer, its two layers in one op


def test_tree_keys_eviction_policy_and_eagle():
    """``eviction_policy`` and ``is_eagle`` reach the session's tree (its CacheInitParams); bad
    values name their key."""
    from sim.cache import CacheSession
    from sim.cache.evict_policy import SLRUStrategy
    from sim.errors import InputError

    s = CacheSession({"eviction_policy": "slru", "is_eagle": True, "device_tokens": 32})
    assert isinstance(s.tree.eviction_strategy, SLRUStrategy) and s.tree.is_eagle
    for key, bad in (("eviction_policy", "oldest"), ("is_eagle", 1)):
        with pytest.raises(InputError, match=f"config.{key}"):
            CacheSession({key: bad})
