"""sim.explore: outcomes of every interleaving, the reduction's semantics, fix verification."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from sim.errors import InputError
from sim.executor import run_schedule
from sim.explore import Explorer, build_model, pct_bound
from sim.explore.model import copy_atoms
from sim.explore.sampling import pct_order
from sim.explore.search import linearize, traces
from sim.memory import clip_extents
from sim.schedule import load, validate
from sim.verdicts import read_digest
from tests.helpers import profile, schedule_doc

UNGATED = "examples/index_k_ungated_race.json"
GATED = "examples/index_k_gated.json"
ENGINE = "examples/engine_22811_window.json"
C4 = "examples/c4_routine_on_bf16_index_k.json"


def statuses(res):
    return sorted((o.status, tuple(r["status"] for r in o.reads)) for o in res.outcomes)


# ---------------------------------------------------------------- the model's cuts

def test_atoms_are_chunks_of_the_concatenated_extents_rounded_to_the_kernel_granule():
    s = load(UNGATED)
    op = s.op("load_index_k_L0")
    c = clip_extents(op.plan.extents, s.buffers[op.src].nbytes, s.buffers[op.dst].nbytes)
    # an 8,448 B page: keys 0-8191 then scales (one extent each): 4096-byte chunks cut it at 4096
    # and 8192; the last chunk is the 256 B of scales
    atoms = copy_atoms(op, c, 4096)
    assert [a[0] for a in atoms[:4]] == [(0, 0), (0, 4096), (0, 8192), (1, 0)]
    assert atoms[2][1] == (1, 0) and int(atoms[2][2].length.sum()) == 256
    assert atoms[-1][1] == (4, 0)
    # 100 B is rounded up to the sgl-kernel warp's 256 B: 33 chunks per page
    assert len(copy_atoms(op, c, 100)) == 4 * 33
    # 0: whole items
    assert [(a[0], a[1]) for a in copy_atoms(op, c, 0)] == [((i, 0), (i + 1, 0)) for i in range(4)]


def test_only_racing_ops_are_cut_and_nonconflicting_atoms_join_a_block():
    # s0 copies rows 0-3 of layer 0; s1 reads row 2 only, unordered: only item 2 conflicts, so
    # the copy is one block (items 0-1 go with item 2, item 3 joins the last block: moving them
    # changes no byte the read sees); the other copy races nothing
    doc = schedule_doc([
        {"id": "c", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
         "args": {"layer": 0, "src_indices": [0, 1, 2, 3], "dst_indices": [0, 1, 2, 3]}},
        {"id": "r", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [2]},
        {"id": "c2", "op": "copy", "stream": "s2", "routine": "kernel_per_layer", "src": "H", "dst": "D2",
         "args": {"layer": 1, "src_indices": [0], "dst_indices": [0]}},
    ])
    m = build_model(validate(doc), 0)
    s = m.schedule
    blocks = [(n.first, n.end) for n in (m.nodes[u] for u in m.op_nodes[s.op("c").index])]
    assert blocks == [((0, 0), (4, 0))]
    assert len(m.op_nodes[s.op("c2").index]) == 1
    assert len(m.pairs) == 1
    res = Explorer(s, 0).exhaustive()
    assert res.orders == 2 and len(res.outcomes) == 2


def test_trace_count_follows_the_races_not_the_ops():
    # 40 non-racing compute/write ops around one race: still one order per tear position
    ops = [{"id": f"w{i}", "op": "write", "stream": "s2", "buffer": "D2", "layer": 0, "units": [i % 8],
            "owner": 100 + i} for i in range(40)]
    ops += [{"id": "c", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
             "args": {"layer": 0, "src_indices": [0, 1, 2], "dst_indices": [0, 1, 2]}},
            {"id": "r", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": [0, 1, 2]}]
    m = build_model(validate(schedule_doc(ops)), 0)
    assert sum(1 for _ in traces(m)) == 4


# ---------------------------------------------------------------- fix verification

def test_ungated_minimal_race_lists_clean_and_corrupt_outcomes_each_with_a_forcible_witness():
    s = load(UNGATED)
    res = Explorer(s, 0).exhaustive()
    assert res.complete and res.orders == 5
    # the read sees 0..4 of the 4 pages loaded: one clean outcome, four stale ones
    assert statuses(res) == [("clean", ("ok",))] + [("corrupt", ("stale",))] * 4
    differing = sorted(o.reads[0]["bytes_differing"] for o in res.corrupt)
    assert differing == [8448, 16896, 25344, 33792]
    assert all(o.witness is not None for o in res.outcomes)


def test_chunks_add_the_torn_outcomes():
    res = Explorer(load(UNGATED)).exhaustive()       # 4096 B chunks: 3 per page
    assert res.orders == 13 and len(res.outcomes) == 13
    kinds = [r["status"] for o in res.outcomes for r in o.reads]
    assert kinds.count("torn") == 8 and kinds.count("stale") == 4 and kinds.count("ok") == 1
    # a torn outcome cannot be forced by controlled replay and says why
    torn = [o for o in res.outcomes if o.reads[0]["status"] == "torn"]
    assert all(o.witness is None and "inside item" in o.witness_reason for o in torn)


def test_gated_twin_lists_only_clean_outcomes():
    res = Explorer(load(GATED)).exhaustive()
    assert res.complete and not res.corrupt and len(res.outcomes) == 1
    assert res.model.racing == []


def _gated(doc: dict, raced: dict[str, list[str]]) -> dict:
    """``doc`` with SGLang 0.5.11's gate: every load copy a read raced records an event on its
    stream right after it, and the read waits on those events first (``wait_until(layer)``)."""
    doc = copy.deepcopy(doc)
    ops = []
    events = list(doc.get("events", []))
    by_id = {d["id"]: d for d in doc["ops"]}
    for d in doc["ops"]:
        for c in raced.get(d["id"], ()):
            ops.append({"id": f"gate_wait_{c}", "op": "wait", "stream": d["stream"], "host": d["host"],
                        "event": f"{c}_done"})
        ops.append(d)
        if any(d["id"] in cs for cs in raced.values()):
            events.append(f"{d['id']}_done")
            ops.append({"id": f"gate_record_{d['id']}", "op": "record", "stream": by_id[d["id"]]["stream"],
                        "host": d["host"], "event": f"{d['id']}_done"})
    doc["ops"], doc["events"] = ops, events
    doc["name"] += "_gated"
    return doc


def test_engine_window_ungated_lists_corrupt_outcomes_and_its_gated_variant_none():
    s = load(ENGINE)
    res = Explorer(s, 0).exhaustive()
    m = res.model
    # one order per item boundary of the raced load (the read before item k), one outcome each:
    # the read after the whole copy is clean, every other one is corrupt
    (copy_op, read_op), = [tuple(sorted(p, key=lambda i: s.ops[i].op)) for p in m.racing]
    assert s.ops[copy_op].op == "copy" and s.ops[read_op].op == "read"
    assert "_get_topk_ragged.index_k" in s.ops[read_op].id          # the 0.5.10 ungated reader
    assert res.complete and res.orders == len(m.op_nodes[copy_op]) + 1 == len(res.outcomes)
    assert len(res.clean) == 1 and len(res.corrupt) == res.orders - 1
    assert {r["op"] for o in res.corrupt for r in o.reads if r["status"] in ("stale", "torn")} == \
        {s.ops[read_op].id}
    gated = validate(_gated(json.load(open(ENGINE)), {s.ops[read_op].id: [s.ops[copy_op].id]}))
    gres = Explorer(gated).exhaustive()
    assert gres.complete and not gres.corrupt
    assert gres.model.racing == [] and len(gres.outcomes) == 1


def _c4_variant(routine: str, gated: bool, tokens: int = 300) -> dict:
    doc = json.load(open(C4))
    ops = []
    for d in doc["ops"]:
        d = copy.deepcopy(d)
        if d["op"] == "read":
            d["tokens"]["count"] = tokens
        if d["op"] == "copy":
            d["routine"] = routine
            d["args"]["src_indices"]["count"] = d["args"]["dst_indices"]["count"] = tokens
            if routine == "token_bytewise":
                d["args"] = {"layer": 0, "src_indices": d["args"]["src_indices"],
                             "dst_indices": d["args"]["dst_indices"]}
        if d["op"] == "wait" and not gated:
            continue
        ops.append(d)
    doc["ops"] = ops
    return doc


def test_bytewise_routine_gated_gives_no_corrupt_outcome_and_the_ungated_one_does():
    # the incident's copy (dsv4_token's C4 constants on a 256 B/token buffer) moves the wrong
    # bytes in every order alike: a geometry bug, not a race, so exploration finds one clean
    # outcome (placement and out-of-bounds writes are what report it)
    c4 = Explorer(validate(_c4_variant("dsv4_token", gated=True))).exhaustive()
    assert c4.complete and len(c4.outcomes) == 1 and not c4.corrupt
    fixed = Explorer(validate(_c4_variant("token_bytewise", gated=True))).exhaustive()
    assert fixed.complete and len(fixed.outcomes) == 1 and not fixed.corrupt
    assert fixed.outcomes[0].reads[0]["status"] == "ok"
    # the byte-wise copy puts request 40's tokens where the read looks; the C4 copy does not
    assert fixed.outcomes[0].key[0] != c4.outcomes[0].key[0]
    # the right geometry alone does not fix a missing gate
    ungated = Explorer(validate(_c4_variant("token_bytewise", gated=False, tokens=6)), 0).exhaustive()
    assert ungated.complete and len(ungated.corrupt) == 6 and len(ungated.clean) == 1


# ---------------------------------------------------------------- witnesses

def _check_witness(s, o):
    ws = validate(o.witness)
    assert ws.hosts == ("host",)
    run = run_schedule(ws, profile(launch_jitter_us=3.0), seed=11)
    assert {r.op_id: read_digest(r) for r in run.reads} == {s.ops[i].id: d for i, d in o.key[0]}
    assert tuple((n, run.memory.compact[n].provenance_digest()) for n in sorted(run.memory.compact)) == o.key[1]


def test_every_witness_of_the_engine_window_runs_to_its_outcome():
    s = load(ENGINE)
    res = Explorer(s, 0).exhaustive()
    for o in res.outcomes:
        assert o.witness is not None, o.witness_reason
        _check_witness(s, o)


def test_witness_order_is_a_sequence_of_steps_with_item_bounds():
    res = Explorer(load(UNGATED), 0).exhaustive()
    orders = sorted(json.dumps(o["witness"]["order"]) for o in res.to_json()["outcomes"])
    assert json.dumps([{"op": "load_index_k_L0", "from": [0, 0], "to": [2, 0]},
                       {"op": "indexer_read_index_k_L0"},
                       {"op": "load_index_k_L0", "from": [2, 0], "to": [4, 0]}]) in orders


# ---------------------------------------------------------------- sampling

def test_pct_bound_and_orders_respect_happens_before():
    assert pct_bound(4, 10, 1) == 0.25
    assert pct_bound(4, 10, 3) == pytest.approx(1 / 400)
    m = build_model(load(ENGINE))
    rng = np.random.default_rng(0)
    for _ in range(20):
        order = pct_order(m, 3, rng)
        pos = {u: k for k, u in enumerate(order)}
        assert sorted(order) == list(range(len(m.nodes)))
        assert all(pos[a] < pos[b] for a, b in m.hb_edges)
        for ids in m.op_nodes.values():
            assert [pos[u] for u in ids] == sorted(pos[u] for u in ids)


def test_pct_finds_both_sides_and_prints_its_guarantee():
    res = Explorer(load(UNGATED), 0).pct(40, 2, seed=1)
    assert res.orders == 40 and res.corrupt and res.clean
    p = res.params
    assert p["threads_n"] == 2 and p["steps_k"] == 5 and p["p_per_run"] == pytest.approx(1 / 10)
    assert "1/(n k^(d-1))" in p["guarantee"]


def test_random_runs_estimate_frequencies_under_the_timing_model():
    res = Explorer(load(UNGATED)).random(5, seed=0)
    assert sum(o.orders for o in res.outcomes) == 5
    # with the h200 profile the read always runs before any page lands (README: STALE)
    assert len(res.outcomes) == 1 and res.outcomes[0].reads[0]["status"] == "stale"
    assert res.outcomes[0].seed == 0 and res.outcomes[0].witness is not None


def test_max_orders_stops_and_says_so():
    res = Explorer(load(UNGATED)).exhaustive(max_orders=4)
    assert res.orders == 4 and not res.complete
    assert Explorer(load(UNGATED), 0).exhaustive(max_orders=5).complete


def test_bad_parameters_are_input_errors():
    s = load(UNGATED)
    with pytest.raises(InputError, match="chunk_bytes"):
        Explorer(s, -1)
    with pytest.raises(InputError, match="depth"):
        Explorer(s).pct(3, 0)
    with pytest.raises(InputError, match="n_runs"):
        Explorer(s).random(0)


def test_linearize_respects_the_trace():
    m = build_model(load(UNGATED), 0)
    for t in traces(m):
        order = linearize(m, t)
        pos = {u: k for k, u in enumerate(order)}
        assert all((pos[u] < pos[v]) == fwd for (u, v), fwd in zip(m.pairs, t))
