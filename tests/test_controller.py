"""HiCacheController on the online executor, checked against SGLang 0.5.14's
``managers/cache_controller.py`` (read, not run):

* ``start_loading``: ``update_producer`` (a query of the reused slot's finish event),
  merge of the queued ops, ``start_event.record()`` on the caller's current stream,
  ``start_event.wait(load_stream)``, then per layer every pool's copies and
  ``load_events[i].record()`` on the load stream; the ack's finish event is the
  last layer's event.
* the ring of 3 producer slots: a 4th ``start_loading`` while the oldest load is
  unfinished trips the assert (never waits).
* ``write``: host slots allocated, then ``start_writing`` at once: start event on the
  current stream, wait on the write stream, one all-layer backup, finish event.
* ``move_indices`` with the direct backend and ``layer_first``: a blocking D2H of the
  device indices (the host waits for the current stream), host indices sorted and
  device indices permuted.

Expected values are derived from those rules, not read back from the controller.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from sim.cache.controller import (
    CacheOperation, EventPoolExhausted, HiCacheController, ProducerSlotBusy, SettleRequired,
)
from sim.errors import InputError, KvraceError
from sim.executor import run_programs, run_schedule
from sim.pools import MLATokenToKVPool, MLATokenToKVPoolHost, TokenToKVPoolAllocator
from sim.schedule import validate
from sim.snapshot import snapshot_of
from sim.verdicts import analyse
from tests.helpers import profile

P = profile()
ROW = 64                    # bytes of one token row: (24 + 8) x 2 B
STREAMS = ["schedule", "forward", "load", "write"]


class Setup:
    """A small MLA device pool, its allocator and host pool, and a run header."""

    def __init__(self, *, layers=3, size=16, layout="layer_first", io_backend="kernel", fence=False,
                 write_event_pool=4, host_init=None, draft_layers=None):
        self.dev = MLATokenToKVPool(size, 1, layers, kv_lora_rank=24, qk_rope_head_dim=8, itemsize=2)
        self.alloc = TokenToKVPoolAllocator(size, 1, self.dev)
        self.host = MLATokenToKVPoolHost(self.dev, 2.0, 0, 1, layout)
        self.io_backend = io_backend
        self.fence = fence
        self.write_event_pool = write_event_pool
        buffers = self.dev.buffers() + self.host.buffers()
        self.draft = None
        if draft_layers is not None:
            ddev = MLATokenToKVPool(size, 1, draft_layers, kv_lora_rank=24, qk_rope_head_dim=8, itemsize=2,
                                    prefix="draft_")
            dhost = MLATokenToKVPoolHost(ddev, 2.0, 0, 1, layout, prefix="draft_host_")
            self.draft = (ddev, dhost)
            buffers += ddev.buffers() + dhost.buffers()
        if host_init is not None:
            for b in buffers:
                if b["name"] == self.host.kv_buffer:
                    b["init"] = [host_init]
        self.header = {"kvrace_schedule": 2, "name": "controller", "buffers": buffers, "streams": STREAMS,
                       "events": HiCacheController.event_names(layers, write_event_pool=write_event_pool,
                                                               load_fence=fence),
                       "hosts": ["scheduler"]}

    def controller(self, h):
        ctl = HiCacheController(self.alloc, self.host, 1, host=h, load_stream="load", write_stream="write",
                                current_stream="schedule", io_backend=self.io_backend,
                                load_fence_stream="forward" if self.fence else None,
                                write_event_pool=self.write_event_pool)
        if self.draft is not None:
            ctl.set_draft_kv_pool(*self.draft)
        return ctl

    def run(self, body):
        """Run ``body(h, ctl)`` (a generator) as the scheduler's host program."""
        def prog(h):
            yield from body(h, self.controller(h))
        return run_programs(self.header, {"scheduler": prog}, P)


def n_issued(h):
    """How many ops the run has issued so far (the schedule being recorded)."""
    return len(h._ex.builder.ops)


def ops_of(run, *kinds):
    return [d for d in run.recorded["ops"] if not kinds or d["op"] in kinds]


def rerun_same(run):
    """The recorded schedule re-runs statically to the same Snapshot."""
    again = run_schedule(validate(json.loads(json.dumps(run.recorded))), P)
    a, b = snapshot_of(run), snapshot_of(again)
    assert a.schedule_digest == b.schedule_digest
    assert a.buffers == b.buffers and a.timings_us == b.timings_us
    assert a.reads.keys() == b.reads.keys() and all((a.reads[k] == b.reads[k]).all() for k in a.reads)


# ---------------------------------------------------------------- start_loading

def test_merged_load_issues_start_record_wait_then_per_layer_copies_and_record():
    s = Setup(layers=3)
    got = {}

    def body(h, ctl):
        d1 = ctl.load(np.array([5, 6]), node_id=11)
        d2 = ctl.load(np.array([9]), node_id=12)
        got["dev"] = np.concatenate([d1, d2])
        assert n_issued(h) == 0                       # load() allocates and queues; no op
        got["pid"] = ctl.start_loading()
        got["ack"] = ctl.ack_load_queue[-1]
        yield h.delay(0)

    def ops_of_now(h):
        return n_issued(h)

    run = s.run(body)
    assert got["pid"] == 0
    assert got["dev"].tolist() == [1, 2, 3]                 # slot 0 is padding
    assert got["ack"].node_ids == [11, 12]
    assert got["ack"].finish_event.name == "hicache.load0.L2"
    ops = ops_of(run)
    kinds = [(d["op"], d.get("stream"), d.get("event")) for d in ops]
    expected = [("host_query", None, "hicache.load0.L2"),                 # update_producer's assert
                ("record", "schedule", "hicache.load0.start"),
                ("wait", "load", "hicache.load0.start")]
    for i in range(3):
        expected += [("copy", "load", None), ("record", "load", f"hicache.load0.L{i}")]
    expected.append(("host_delay", None, None))
    assert kinds == expected
    copies = ops_of(run, "copy")
    assert [c["args"]["layer"] for c in copies] == [0, 1, 2]
    for c in copies:                                          # one merged op: both loads' indices
        assert c["args"]["src_indices"] == [5, 6, 9] and c["args"]["dst_indices"] == [1, 2, 3]
        assert (c["src"], c["dst"]) == (s.host.kv_buffer, s.dev.kv_buffer)
    # the first use of a ring slot queries an event never recorded: CUDA reports complete
    q = ops_of(run, "host_query")[0]
    assert q["outcome"] is True
    assert [u["op"] for u in run.unbound] == [q["id"]]
    rerun_same(run)


def test_start_loading_with_nothing_queued_returns_minus_one_and_issues_nothing():
    s = Setup()

    def body(h, ctl):
        assert ctl.start_loading() == -1
        assert ctl.layer_done_counter.producer_index == -1
        yield h.delay(0)

    assert [d["op"] for d in ops_of(s.run(body))] == ["host_delay"]


def test_ring_of_three_and_the_fourth_load_trips_the_assert():
    s = Setup(layers=2)
    seen = {}

    def body(h, ctl):
        pids = []
        for k in range(3):
            ctl.load(np.array([k]))
            pids.append(ctl.start_loading())
        seen["pids"] = pids
        ctl.load(np.array([3]))
        with pytest.raises(ProducerSlotBusy) as e:          # slot 0's load is still in flight
            ctl.start_loading()
        seen["msg"] = str(e.value)
        seen["index_after"] = ctl.layer_done_counter.producer_index
        seen["still_queued"] = len(ctl.load_queue)
        # wait for the oldest load, then the same call succeeds on slot 1 (the index advanced)
        ctl.ack_load_queue[0].finish_event.synchronize()
        yield from ctl.settle()
        seen["t_sync"] = h.now
        seen["slot0_done"] = h.query("hicache.load0.L1")
        ctl.layer_done_counter.producer_index = 2            # SGLang would re-raise on slot 1; reset to retry 0
        seen["pid4"] = ctl.start_loading()

    run = s.run(body)
    assert seen["pids"] == [0, 1, 2]
    assert "Producer finish event should be ready before being reused" in seen["msg"]
    assert isinstance(ProducerSlotBusy("x"), AssertionError) and isinstance(ProducerSlotBusy("x"), KvraceError)
    assert seen["index_after"] == 0                  # advanced before the assert, as in SGLang
    assert seen["still_queued"] == 1                 # the queued load was not consumed
    assert seen["slot0_done"] is True and seen["pid4"] == 0
    first_copy_end = max(run.timings[d["id"]][1] for d in ops_of(run, "copy") if d["id"].startswith("hicache.load0."))
    assert seen["t_sync"] == pytest.approx(first_copy_end)
    rerun_same(run)


def test_wait_until_waits_on_the_consumer_slot_on_the_named_stream_and_minus_one_is_a_noop():
    s = Setup(layers=2)

    def body(h, ctl):
        ctl.load(np.array([4]))
        pid = ctl.start_loading()
        n = n_issued(h)
        ctl.layer_done_counter.set_consumer(-1)
        ctl.layer_done_counter.wait_until(1, "forward")
        assert n_issued(h) == n                 # consumer -1: nothing issued
        ctl.layer_done_counter.set_consumer(pid)
        ctl.layer_done_counter.wait_until(1, "forward")
        yield h.delay(0)

    run = s.run(body)
    waits = ops_of(run, "wait")
    assert (waits[-1]["stream"], waits[-1]["event"]) == ("forward", "hicache.load0.L1")


# ---------------------------------------------------------------- bytes by provenance

def test_loaded_layer_holds_the_host_bytes_after_its_layer_event_and_not_before():
    # host slots 2, 3 hold request 12's rows (every layer); the load puts them in device slots 1, 2
    s = Setup(layers=2, host_init={"layers": "all", "indices": [2, 3], "owner": 12, "version": 1})

    def body(h, ctl):
        ctl.load(np.array([2, 3]))
        pid = ctl.start_loading()
        h.issue({"id": "early", "op": "read", "stream": "schedule", "buffer": s.dev.kv_buffer, "layer": 1,
                 "units": [1, 2]})                       # no gate: races the copy
        ctl.layer_done_counter.set_consumer(pid)
        ctl.layer_done_counter.wait_until(1, "forward")
        h.issue({"id": "gated", "op": "read", "stream": "forward", "buffer": s.dev.kv_buffer, "layer": 1,
                 "units": [1, 2]})
        yield h.delay(0)

    run = s.run(body)
    reads = {r.op_id: r for r in run.reads}
    gated = reads["gated"].views
    origins = [[run.memory.table[int(o)] for o in v.compact.pieces().origin_id] for v in gated]
    for unit, os_ in zip([0, 1], origins):
        assert [(o.owner, o.layer, o.version) for o in os_] == [(12, 1, 1)]
    assert reads["gated"].time_us >= run.timings["hicache.load0.L1.done"][1]
    rep = analyse(run)
    status = {r["op"]: r["status"] for r in rep["reads"]}
    assert status == {"early": "stale", "gated": "ok"}
    # the init fill gave host slots 2, 3 units 0, 1 of request 12's origin: device slots 1, 2 hold them
    assert [int(v.compact.pieces().stream_offset[0]) // ROW for v in gated] == [0, 1]
    rerun_same(run)


# ---------------------------------------------------------------- write path

def test_write_allocates_host_slots_and_starts_one_all_layer_backup_at_once():
    s = Setup(layers=3)
    got = {}

    def body(h, ctl):
        got["host"] = ctl.write(np.array([7, 8]), node_id=3)
        got["ack"] = ctl.ack_write_queue[-1]
        yield h.delay(0)

    run = s.run(body)
    assert got["host"].tolist() == [0, 1]              # host slots from the front, no padding slot
    assert got["ack"].node_ids == [3]
    assert (got["ack"].start_event.name, got["ack"].finish_event.name) == ("hicache.write0.start",
                                                                           "hicache.write0.finish")
    kinds = [(d["op"], d.get("stream"), d.get("event")) for d in ops_of(run)]
    assert kinds == [("record", "schedule", "hicache.write0.start"), ("wait", "write", "hicache.write0.start"),
                     ("copy", "write", None), ("record", "write", "hicache.write0.finish"),
                     ("host_delay", None, None)]
    c = ops_of(run, "copy")[0]
    assert c["routine"] == "kernel_all_layer"
    assert (c["src"], c["dst"], c["args"]["src_indices"], c["args"]["dst_indices"]) == \
        (s.dev.kv_buffer, s.host.kv_buffer, [7, 8], [0, 1])


def test_write_returns_none_when_the_host_pool_is_full_and_issues_nothing():
    s = Setup(layers=1, size=4)                          # host: int(4 * 2.0) // 1 + 1 = 9 slots

    def body(h, ctl):
        assert ctl.write(np.arange(1, 10)) is not None
        n = n_issued(h)
        assert ctl.write(np.array([1])) is None
        assert n_issued(h) == n and len(ctl.ack_write_queue) == 1
        yield h.delay(0)

    s.run(body)


def test_ack_polling_query_false_while_in_flight_then_true_and_positive_query_orders_reuse():
    s = Setup(layers=2)
    got = {}

    def body(h, ctl):
        ctl.write(np.array([1, 2]))
        ack = ctl.ack_write_queue[0]
        polls = []
        while not ack.finish_event.query():
            polls.append(h.now)
            yield h.delay(1.0)
        got["polls"] = polls
        got["t"] = h.now
        ack.finish_event.synchronize()                     # already complete: no settle needed
        assert ctl.settled
        ctl.ack_write_queue.pop(0)
        # the device slots are reused only now: a write to them does not race the backup
        h.issue({"id": "reuse", "op": "write", "stream": "forward", "buffer": s.dev.kv_buffer, "layer": 0,
                 "units": [1, 2], "owner": 40})

    run = s.run(body)
    assert len(got["polls"]) >= 1
    assert got["t"] >= run.timings["hicache.write0.finish"][1]
    queries = ops_of(run, "host_query")
    assert [q["outcome"] for q in queries] == [False] * len(got["polls"]) + [True, True]
    assert analyse(run)["latent_races"] == []
    rerun_same(run)


# ---------------------------------------------------------------- settle

def test_synchronize_of_an_unfinished_event_needs_settle_and_blocks_in_simulated_time():
    s = Setup(layers=2)
    got = {}

    def body(h, ctl):
        ctl.load(np.array([0, 1]))
        ctl.start_loading()
        ctl.ack_load_queue[0].finish_event.synchronize()
        assert not ctl.settled
        n = n_issued(h)
        for call in (ctl.start_loading, lambda: ctl.ack_load_queue[0].finish_event.query(),
                     lambda: ctl.layer_done_counter.events[0].wait(0, "forward")):
            ctl.load(np.array([5]))
            with pytest.raises(SettleRequired, match="settle"):
                call()
            ctl.load_queue.clear()
        got["host"] = ctl.write(np.array([3]))            # slots now; its ops after the block
        assert n_issued(h) == n
        t0 = h.now
        yield from ctl.settle()
        got["t0"], got["t1"] = t0, h.now
        assert ctl.settled

    run = s.run(body)
    syncs = ops_of(run, "host_sync")
    assert [d["event"] for d in syncs] == ["hicache.load0.L1"]
    assert got["t1"] == pytest.approx(run.timings["hicache.load0.L1.done"][1])
    assert got["t1"] > got["t0"]
    assert got["host"].tolist() == [0]
    kinds = [d["op"] for d in ops_of(run)]
    assert kinds[kinds.index("host_sync"):] == ["host_sync", "record", "wait", "copy", "record"]
    assert run.timings["hicache.write0.start"][0] == pytest.approx(got["t1"])
    rerun_same(run)


def test_synchronize_of_a_finished_event_is_a_positive_query_and_does_not_block():
    s = Setup(layers=1)

    def body(h, ctl):
        ctl.load(np.array([0]))
        ctl.start_loading()
        yield h.synchronize()                              # the device is idle now
        ctl.ack_load_queue[0].finish_event.synchronize()
        assert ctl.settled
        ctl.layer_done_counter.events[1].finish_event.synchronize()   # never recorded: CUDA no-op
        assert ctl.settled

    run = s.run(body)
    q = ops_of(run, "host_query")
    assert [(d["event"], d["outcome"]) for d in q[1:]] == [("hicache.load0.L0", True), ("hicache.load1.L0", True)]
    assert "host_sync" in [d["op"] for d in ops_of(run)]    # only the explicit device synchronize


# ---------------------------------------------------------------- direct backend

def test_direct_layer_first_blocks_on_the_current_stream_then_sorts_host_indices():
    s = Setup(layers=2, io_backend="direct")
    got = {}

    def body(h, ctl):
        h.issue({"id": "busy", "op": "compute", "stream": "schedule", "duration_us": 50.0})
        ctl.load(np.array([7, 3]))
        ctl.load(np.array([5]))
        ctl.start_loading()
        got["n_before_settle"] = n_issued(h)
        with pytest.raises(SettleRequired):
            ctl.ack_load_queue[0].finish_event.query()
        yield from ctl.settle()
        got["t"] = h.now

    run = s.run(body)
    ops = ops_of(run)
    kinds = [d["op"] for d in ops]
    # compute, update_producer's query, the blocking D2H (host waits for the schedule stream), then the load
    assert kinds[:4] == ["compute", "host_query", "host_sync", "record"]
    assert ops[2].get("stream") == "schedule"
    assert got["n_before_settle"] == 2           # the sync and the load wait for settle()
    assert got["t"] == pytest.approx(50.0)
    for c in ops_of(run, "copy"):
        assert c["routine"] == "direct_per_layer"
        # merged host [7, 3, 5] -> sorted [3, 5, 7]; device [1, 2, 3] permuted alike -> [2, 3, 1]
        assert c["args"]["src_indices"] == [3, 5, 7] and c["args"]["dst_indices"] == [2, 3, 1]
    assert run.timings[ops[3]["id"]][0] == pytest.approx(50.0)
    rerun_same(run)


def test_direct_backend_with_page_first_is_sglangs_unsupported_layout():
    s = Setup(layers=1, io_backend="direct", layout="page_first")

    def body(h, ctl):
        ctl.load(np.array([1]))
        with pytest.raises(InputError, match="Unsupported layout 'page_first' for io backend 'direct'"):
            ctl.start_loading()
        yield h.delay(0)

    s.run(body)


# ---------------------------------------------------------------- fence

@pytest.mark.parametrize("fence", [False, True])
def test_load_fence_orders_the_copies_after_the_forward_stream(fence):
    s = Setup(layers=1, fence=fence)

    def body(h, ctl):
        h.issue({"id": "fwd", "op": "compute", "stream": "forward", "duration_us": 40.0})
        ctl.load(np.array([2]))
        ctl.start_loading()
        yield h.delay(0)

    run = s.run(body)
    kinds = [(d["op"], d.get("stream"), d.get("event")) for d in ops_of(run, "record", "wait")]
    copy_start = run.timings["hicache.load0.L0.copy0"][0]
    if fence:
        assert kinds[:4] == [("record", "schedule", "hicache.load0.start"), ("wait", "load", "hicache.load0.start"),
                             ("record", "forward", "hicache.load_fence"), ("wait", "load", "hicache.load_fence")]
        assert copy_start >= 40.0
    else:
        assert "hicache.load_fence" not in HiCacheController.event_names(1)
        assert copy_start < 40.0


# ---------------------------------------------------------------- write events

def test_write_event_names_are_recycled_only_after_their_ack_is_processed():
    s = Setup(layers=1, write_event_pool=2)
    got = {}

    def body(h, ctl):
        ctl.write(np.array([1]))
        ctl.write(np.array([2]))
        with pytest.raises(EventPoolExhausted, match="write_event_pool"):
            ctl.write(np.array([3]))
        # process the second ack only: its pair is the one reused
        yield h.synchronize()
        ctl.ack_write_queue.pop(1)
        ctl.write(np.array([4]))
        got["names"] = [a.finish_event.name for a in ctl.ack_write_queue]

    run = s.run(body)
    assert got["names"] == ["hicache.write0.finish", "hicache.write1.finish"]
    recs = [d["event"] for d in ops_of(run, "record") if d["event"].endswith("finish")]
    assert recs == ["hicache.write0.finish", "hicache.write1.finish", "hicache.write1.finish"]


def test_header_without_the_controller_events_is_refused_naming_the_list():
    s = Setup(layers=1)
    s.header["events"] = s.header["events"][:-1]

    def body(h, ctl):
        yield h.delay(0)

    with pytest.raises(InputError, match="event_names"):
        s.run(body)


def test_invalid_write_policy_and_io_backend_are_input_errors():
    s = Setup(layers=1)

    def body(h, ctl):
        for kw, key in (({"write_policy": "lazy"}, "write_policy"), ({"io_backend": "kernel_ascend"}, "io_backend")):
            with pytest.raises(InputError) as e:
                HiCacheController(s.alloc, s.host, 1, host=h, load_stream="load", write_stream="write",
                                  current_stream="schedule", **kw)
            assert e.value.where == key
        yield h.delay(0)

    s.run(body)


# ---------------------------------------------------------------- draft and merge

def test_draft_pool_layer_follows_the_target_layer_before_its_record():
    s = Setup(layers=3, draft_layers=1)

    def body(h, ctl):
        ctl.load(np.array([1, 2]))
        ctl.start_loading()
        ctl.write(np.array([3]))
        yield h.delay(0)

    run = s.run(body)
    seq = [(d["op"], d.get("dst") or d.get("event")) for d in ops_of(run, "copy", "record")]
    dd, dh = s.draft
    assert seq[:8] == [("record", "hicache.load0.start"), ("copy", s.dev.kv_buffer), ("copy", dd.kv_buffer),
                       ("record", "hicache.load0.L0"), ("copy", s.dev.kv_buffer), ("record", "hicache.load0.L1"),
                       ("copy", s.dev.kv_buffer), ("record", "hicache.load0.L2")]
    assert [d for _, d in seq[8:]] == ["hicache.write0.start", s.host.kv_buffer, dh.kv_buffer,
                                       "hicache.write0.finish"]


def test_merge_ops_keeps_a_single_op_and_merges_several_with_min_priority():
    ids = iter(range(100, 200))
    a = CacheOperation([1], [2], 7, None, 0)
    assert CacheOperation.merge_ops([a], lambda: next(ids)) is a
    b = CacheOperation([3, 4], [5, 6], 8, 5, 1)
    c = CacheOperation([9], [10], 9, 2, 2)
    m = CacheOperation.merge_ops([a, b, c], lambda: next(ids))
    assert m.host_indices.tolist() == [1, 3, 4, 9] and m.device_indices.tolist() == [2, 5, 6, 10]
    assert m.node_ids == [7, 8, 9] and m.priority == 0 and m.id == 100


def test_direct_backend_writes_in_one_call_each_block_then_issue_in_call_order():
    # a tree's insert may back up several nodes in one call: under the direct backend each
    # write's index D2H blocks before its ops, so the record reads block, ops, block, ops
    s = Setup(layers=1, io_backend="direct")

    def body(h, ctl):
        h.issue({"id": "busy", "op": "compute", "stream": "schedule", "duration_us": 20.0})
        a = ctl.write(np.array([4, 2]), node_id=1)
        b = ctl.write(np.array([6]), node_id=2)
        assert (a.tolist(), b.tolist()) == ([0, 1], [2])     # host slots at call time, in call order
        assert n_issued(h) == 1
        yield from ctl.settle()

    run = s.run(body)
    seq = [(d["op"], d.get("stream"), d.get("event")) for d in ops_of(run)][1:]
    write0 = [("record", "schedule", "hicache.write0.start"), ("wait", "write", "hicache.write0.start"),
              ("copy", "write", None), ("record", "write", "hicache.write0.finish")]
    write1 = [(k, st, e and e.replace("write0", "write1")) for k, st, e in write0]
    assert seq == [("host_sync", "schedule", None)] + write0 + [("host_sync", "schedule", None)] + write1
    c0 = ops_of(run, "copy")[0]
    # direct + layer_first: host indices sorted, device indices permuted (already in order here)
    assert (c0["args"]["src_indices"], c0["args"]["dst_indices"]) == ([4, 2], [0, 1])
    rerun_same(run)


def test_a_write_pair_awaiting_its_synchronize_is_not_recycled():
    # the tree pops an ack and synchronizes its (unfinished) finish event; until settle()
    # issues that sync, the pair's name must not be recorded again
    s = Setup(layers=1, write_event_pool=2)
    got = {}

    def body(h, ctl):
        ctl.write(np.array([1]))
        ctl.write(np.array([2]))
        ack = ctl.ack_write_queue.pop(0)
        ack.finish_event.synchronize()                        # pending: the copy is in flight
        free = ctl.mem_pool_host.available_size()
        with pytest.raises(EventPoolExhausted):
            ctl.write(np.array([3]))                          # pair 0 is still awaited
        assert ctl.mem_pool_host.available_size() == free and ctl.write_queue == []   # nothing taken
        yield from ctl.settle()
        ctl.ack_write_queue.pop(0)
        got["host"] = ctl.write(np.array([4]))
        got["name"] = ctl.ack_write_queue[-1].finish_event.name

    run = s.run(body)
    sync = ops_of(run, "host_sync")[0]
    assert sync["event"] == "hicache.write0.finish"
    assert got["name"] == "hicache.write0.finish"              # recycled only after the sync
    rerun_same(run)
