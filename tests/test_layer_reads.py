"""A forward's per-layer reads judged by the KV oracle together (``sim.engine.layer_reads``):
the engine's result is the same as judging every read at its capture, field by field (the
corrupted reads in the same order), on runs where merged calls find wrong KV, races, two
simulated ranks and the overlap loop; and what a write makes it judge first."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sim.engine import PrefillEngine
from sim.engine.layer_reads import LayerReads
from sim.engine.scenario import load_scenario

V4 = ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4", "model.index_k_dtype=fp8"]
TIGHT = ["workload.sessions=5", "workload.max_turns=3", "workload.concurrency=4", "scheduler.max_total_tokens=1536",
         "workload.max_context_tokens=1472"]


def _result(name, sets, seed, merge: bool, monkeypatch):
    calls = {"kept": 0, "flush_calls": 0}
    if merge:
        keep = LayerReads.keep

        def counted(self, op_id, rec, contents):
            got = keep(self, op_id, rec, contents)
            calls["kept"] += got
            return got
        monkeypatch.setattr(LayerReads, "keep", counted)
    else:
        monkeypatch.setattr(LayerReads, "keep", lambda self, op_id, rec, contents: False)
    e = PrefillEngine(load_scenario(name, sets), seed, keep="report")
    r = e.run()
    calls["flush_calls"] = e._layer_reads.calls
    monkeypatch.undo()
    d = dataclasses.asdict(r)
    d.pop("wall_time_s")
    return d, calls


CASES = [
    ("incident-short", ["run.layers=4", "run.duration_s=3", "model.index_k_dtype=bf16",
                        "variant.hypotheses=index-k-stride-mismatch"], 0),           # wrong KV on per-layer reads
    ("incident-short", [*V4, "variant.hypotheses=index-k-not-backed-up"], 0),        # wrong KV, no race
    ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10"], 0),   # raced reads among them
    ("incident-repro", ["run.duration_s=1"], 0),                                     # two simulated ranks
]


@pytest.mark.parametrize("name, sets, seed", CASES)
def test_judging_a_forwards_reads_together_gives_the_same_result(name, sets, seed, monkeypatch):
    alone, _ = _result(name, sets, seed, False, monkeypatch)
    together, calls = _result(name, sets, seed, True, monkeypatch)
    assert together == alone
    # reads were kept and judged several to a call
    assert calls["kept"] > calls["flush_calls"] > 0
    if "mismatch" in " ".join(sets) or "not-backed-up" in " ".join(sets):
        assert together["wrong_kv_reads"] > 0 and together["corrupted_reads"]


@pytest.mark.slow
@pytest.mark.parametrize("name, sets, seed", [
    ("glm5-22811-small", ["run.layers=4", "variant.gate_map=upstream-0.5.11", "scheduler.event_loop=overlap",
                          "variant.hypotheses=load-unfenced", *TIGHT], 0),     # the overlap loop, raced and wrong KV
    ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10", "workload.concurrency=6"], 1),
    ("incident-short", [*V4[:3], "model.index_k_dtype=bf16", "variant.hypotheses=index-k-c4-token-copy"], 0),
    ("incident-short", [*V4, "variant.hypotheses=host-freed-during-load"], 1),
    ("incident", ["run.duration_s=45"], 0),                                         # load-backs of 43 layers
])
def test_judging_a_forwards_reads_together_gives_the_same_result_deep(name, sets, seed, monkeypatch):
    alone, _ = _result(name, sets, seed, False, monkeypatch)
    together, calls = _result(name, sets, seed, True, monkeypatch)
    assert together == alone and calls["kept"] > calls["flush_calls"]


class _Oracle:
    def can_merge(self, role):
        return True


@dataclasses.dataclass
class _Info:
    layer: int
    pool_layers: tuple
    role: str = "c4"
    buffer: str = "c4_buf"
    entries: dict = dataclasses.field(default_factory=dict)
    op_id: str = "r"


class _Snap:
    table = None

    def clone(self):
        return self


def _recording(lr: LayerReads, flushed: list) -> None:
    """``lr.flush`` records how many reads it would judge and drops them."""
    def flush():
        flushed.append(len(lr))
        lr._kept, lr._layers, lr._entries = [], {}, {}
    lr.flush = flush


def test_a_write_flushes_only_when_it_touches_a_pool_layer_kept():
    flushed = []
    lr = LayerReads([_Oracle()], {"c4_buf": 1000, "swa_buf": 500}, lambda *a: None)
    _recording(lr, flushed)
    made_for, ent = {}, {}
    for layer in (2, 3):
        assert lr.keep(f"r{layer}", (_Info(layer, (layer,), entries=ent), -1, made_for, 0), _Snap())
    # bytes of pool layers 4-5 and of another buffer: nothing to judge first
    lr.written("c4_buf", np.array([4000, 5100]), np.array([100, 10]))
    lr.written("swa_buf", np.array([1000]), np.array([500]))
    lr.written("c4_buf", np.array([3990]), np.array([0]))          # empty: touches nothing
    assert not flushed and len(lr) == 2
    # the last byte of pool layer 3
    lr.written("c4_buf", np.array([3999]), np.array([1]))
    assert flushed == [2]


def test_a_second_read_of_a_pool_layer_or_another_forward_flushes_first():
    flushed = []
    lr = LayerReads([_Oracle()], {"c4_buf": 1000}, lambda *a: None)
    _recording(lr, flushed)
    made_for, ent = {}, {}
    assert lr.keep("a", (_Info(0, (0,), entries=ent), -1, made_for, 0), _Snap())
    assert lr.keep("b", (_Info(1, (1,), entries=ent), -1, made_for, 0), _Snap())
    assert not flushed
    assert lr.keep("c", (_Info(1, (1,), entries=ent), -1, made_for, 0), _Snap())      # pool layer 1 again
    assert flushed == [2]
    assert lr.keep("d", (_Info(0, (0,), entries=ent), -1, {}, 0), _Snap())           # another forward
    assert flushed == [2, 1]
    assert lr.keep("e", (_Info(1, (1,), entries={}), -1, lr._made_for, 0), _Snap())  # other entries
    assert flushed == [2, 1, 1]
    # a one-step read (every layer) is not kept, and flushes nothing
    assert not lr.keep("f", (_Info(-1, (0, 1)), -1, lr._made_for, 0), _Snap())
    assert flushed == [2, 1, 1]


class _RowOracle(_Oracle):
    """Finds request 7 wrong in odd pool layers only; records its calls."""

    def __init__(self):
        self.calls = []

    def check_reads(self, info, obs, made_for, contents=None, by_layer=False):
        self.calls.append((tuple(info.pool_layers), by_layer))
        rows = np.array([[pl % 2 == 1] * 3 for pl in info.pool_layers])
        return {7: rows if by_layer else rows[0]}


def test_each_read_gets_its_own_row_in_capture_order():
    """Reads of two roles kept in turn (layer 0 c4, layer 0 swa, layer 1 c4, ...), and one
    read alone in its role: one call per role (one pool layer: a plain check), each read's
    verdict its own row, applied in capture order."""
    oracle, tallied = _RowOracle(), []
    lr = LayerReads([oracle], {"c4_buf": 1000, "swa_buf": 1000, "idx_buf": 1000},
                    lambda op_id, status, info, consumer, rank, rids, kv_wrong, topk: tallied.append((op_id, kv_wrong)))
    made_for, ent = {7: None}, {7: np.arange(3)}
    order = []
    for layer in range(4):
        for role in ("c4", "swa"):
            op = f"L{layer}.{role}"
            order.append(op)
            assert lr.keep(op, (_Info(layer, (layer,), role, f"{role}_buf", ent), -1, made_for, 0), _Snap())
    assert lr.keep("L2.idx", (_Info(2, (2,), "idx", "idx_buf", ent), -1, made_for, 0), _Snap())
    order.append("L2.idx")
    lr.flush()
    assert sorted(oracle.calls) == [((0, 1, 2, 3), True), ((0, 1, 2, 3), True), ((2,), False)]
    assert [op for op, _ in tallied] == order
    assert [w for _, w in tallied] == [({7} if op[1] in "13" else set()) for op in order]
    assert len(lr) == 0 and lr.calls == 3
