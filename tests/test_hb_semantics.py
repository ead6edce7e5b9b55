"""Happens-before and latent-race verdicts with hand-derived expectations.

Every expected value here follows from CUDA's semantics, not from sim.hb:

* ops of one stream run in issue order;
* a ``host_sync`` blocks the host until its target has completed (an event's
  record; every op issued so far on a stream; everything: device synchronize),
  so every op issued after it starts after the target completes;
* a copy reads its source bytes and writes its destination bytes; two accesses
  to one byte race when at least one writes and neither happens before the other.

Geometry (tests.strategies.base_buffers with 64 B units): layer 0 of the
device buffers ``D`` and ``D2`` is units 0-7 at bytes ``64 u``; a copy or write
of ``n`` units of layer 0 touches ``64 n`` bytes.  These tests are the ones
that fail when the host_sync rule or copy-source reads are dropped from either
happens-before implementation (the differential test alone cannot see a rule
dropped from both).
"""
import networkx as nx
import pytest

from sim.executor import run_schedule
from sim.hb import HappensBefore, hb_graph, latent_races
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile, schedule_doc

UNIT = 64


def copy(op_id, stream, src, dst, units, layer=0):
    return {"id": op_id, "op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": src,
            "dst": dst, "args": {"layer": layer, "src_indices": list(units), "dst_indices": list(units)}}


def write(op_id, stream, buffer, units, owner=7):
    return {"id": op_id, "op": "write", "stream": stream, "buffer": buffer, "layer": 0,
            "units": list(units), "owner": owner}


def read(op_id, stream, buffer, units):
    return {"id": op_id, "op": "read", "stream": stream, "buffer": buffer, "layer": 0, "units": list(units)}


def races(s):
    """{(buffer, frozenset of the two op ids)): bytes} from the report and from sim.hb directly."""
    rep = analyse(run_schedule(s, profile()))
    from_report = {(r["buffer"], frozenset(r["ops"])): r["bytes"] for r in rep["latent_races"]}
    direct = {(r["buffer"], frozenset((s.ops[r["a"].op].id, s.ops[r["b"].op].id))): r["bytes"]
              for r in latent_races(s)}
    assert from_report == direct
    return from_report


def ordered(s, a, b):
    """(vector clocks, networkx graph) verdicts on "a happens before b"."""
    ia, ib = s.op(a).index, s.op(b).index
    return HappensBefore(s).ordered(ia, ib), nx.has_path(hb_graph(s), ia, ib)


SYNCS = {
    "event": [{"id": "rec", "op": "record", "stream": "s0", "event": "e0"},
              {"id": "sync", "op": "host_sync", "event": "e0"}],
    "stream": [{"id": "sync", "op": "host_sync", "stream": "s0"}],
    "device": [{"id": "sync", "op": "host_sync"}],
}


@pytest.mark.parametrize("kind", sorted(SYNCS))
def test_a_host_sync_on_the_copy_orders_a_later_write_on_another_stream(kind):
    # the host waits for the copy to land before it issues the write: no race
    s = validate(schedule_doc([copy("cp", "s0", "H", "D", range(4)), *SYNCS[kind],
                               write("wr", "s1", "D", range(4))]))
    assert ordered(s, "cp", "wr") == (True, True)
    assert ordered(s, "wr", "cp") == (False, False)
    assert races(s) == {}


@pytest.mark.parametrize("kind", sorted(SYNCS))
def test_a_host_sync_orders_a_later_read_of_the_copied_bytes(kind):
    s = validate(schedule_doc([copy("cp", "s0", "H", "D", range(4)), *SYNCS[kind],
                               read("rd", "s2", "D", [1, 2])]))
    assert ordered(s, "cp", "rd") == (True, True)
    assert races(s) == {}
    # and the read sees the copied bytes under any timing (here: a very slow link)
    rep = analyse(run_schedule(s, profile(h2d_gbps=0.001)))
    assert rep["reads"][0]["status"] == "ok"


def test_without_a_host_sync_the_copy_and_the_write_race_on_every_shared_byte():
    s = validate(schedule_doc([copy("cp", "s0", "H", "D", range(4)), write("wr", "s1", "D", range(2, 6))]))
    assert ordered(s, "cp", "wr") == (False, False) and ordered(s, "wr", "cp") == (False, False)
    assert races(s) == {("D", frozenset({"cp", "wr"})): 2 * UNIT}      # units 2 and 3


def test_a_host_sync_on_another_stream_does_not_order_the_copy():
    # host_sync(stream s1) waits for s1's ops only; the copy on s0 may still be in flight
    s = validate(schedule_doc([copy("cp", "s0", "H", "D", range(4)),
                               {"id": "sync", "op": "host_sync", "stream": "s1"},
                               write("wr", "s1", "D", range(4))]))
    assert ordered(s, "cp", "wr") == (False, False)
    assert races(s) == {("D", frozenset({"cp", "wr"})): 4 * UNIT}


def test_a_host_sync_does_not_order_ops_issued_before_it():
    # the write is issued before the sync: only the host waits, the write is not held back
    s = validate(schedule_doc([write("wr", "s1", "D", range(4)), copy("cp", "s0", "H", "D", range(4)),
                               *SYNCS["device"]]))
    assert ordered(s, "cp", "wr") == (False, False) and ordered(s, "wr", "cp") == (False, False)
    assert races(s) == {("D", frozenset({"cp", "wr"})): 4 * UNIT}


def test_a_copy_reading_its_source_races_a_write_to_that_source():
    # D -> D2 on s0 reads D's units 0-3; s1 writes D's units 2-5: units 2 and 3 race on D
    s = validate(schedule_doc([copy("cp", "s0", "D", "D2", range(4)), write("wr", "s1", "D", range(2, 6))]))
    assert races(s) == {("D", frozenset({"cp", "wr"})): 2 * UNIT}


def test_a_copy_reading_its_source_races_a_copy_into_that_source():
    # H -> D on s0 writes D's units 0-7; D -> D2 on s1 reads D's units 4-5: 2 units race on D
    s = validate(schedule_doc([copy("load", "s0", "H", "D", range(8)), copy("fwd", "s1", "D", "D2", [4, 5])]))
    assert races(s) == {("D", frozenset({"load", "fwd"})): 2 * UNIT}


def test_two_reads_of_a_copy_source_never_race():
    s = validate(schedule_doc([copy("cp", "s0", "D", "D2", range(4)), read("rd", "s1", "D", range(4))]))
    assert races(s) == {}


def test_an_event_wait_orders_the_copy_source_read_before_the_write():
    s = validate(schedule_doc([copy("cp", "s0", "D", "D2", range(4)),
                               {"id": "rec", "op": "record", "stream": "s0", "event": "e0"},
                               {"id": "wt", "op": "wait", "stream": "s1", "event": "e0"},
                               write("wr", "s1", "D", range(2, 6))]))
    assert ordered(s, "cp", "wr") == (True, True)
    assert races(s) == {}
