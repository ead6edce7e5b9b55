"""Forward planning's fast path (``sim.engine.forward._plan``): each (compute, layer kind, KV
bytes, ratio) costed once per batch and the keyed jitter of every op drawn together
(``CostModel.durations_us``, ``keyed_normals``) give the same floats, bit for bit, as one
``step_cost`` and one ``cost.duration_us`` per layer and step (the path it replaced, kept here
as :func:`_plan_per_layer`), on random batches of both model families, both modes, TP sizes,
seeds and jitter sigmas."""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.engine.cost import CostModel, keyed_normal, keyed_normals, step_cost
from sim.engine.forward import READERS, BatchRequest, ForwardBatch, _entries, _plan, read_ranges
from sim.engine.gates import gate_map
from sim.engine.models import model, resolve_options
from tests.helpers import H200
from tests.test_forward import world

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORD = st.integers(-(1 << 63), (1 << 63) - 1)


def _plan_per_layer(model, gate_map, options, batch, pools, buffers, cost, tp, key):
    """The per-layer planning ``_plan`` replaced: every step costed and jittered on its own."""
    plan = []
    entries, firsts = {}, {}
    for role in buffers:
        entries[role], firsts[role] = _entries(batch, pools[role], model.dims.window)
    base = {}
    for role, ent in entries.items():
        if ent:
            base[role] = read_ranges(buffers[role][1], 0, np.unique(np.concatenate(list(ent.values()))))
    for layer in range(model.n_layers):
        steps = []
        for si, step in enumerate(model.layer_steps(layer, batch.mode, options)):
            gated = False
            for acc in READERS[step.reader]:
                gated = gate_map.is_gated(acc) or gated
            reads, kv = [], 0
            for role in step.roles:
                if role not in buffers or not entries[role]:
                    continue
                pl = pools[role].pool_layer(layer)
                starts0, lens = base[role]
                reads.append((role, pl, starts0 + np.int64(pl) * np.int64(buffers[role][1].layer_bytes), lens,
                              entries[role], firsts[role]))
                kv += int(lens.sum())
            us = 0.0
            if step.compute:
                ratio = max((pools[r].tokens_per_entry for r in step.roles if r in pools), default=1)
                if step.compute == "indexer":
                    ratio = pools["index_k"].tokens_per_entry
                c = step_cost(step.compute, model.dims, model.layer_kinds[layer], batch.requests, kv, tp, ratio)
                us = cost.duration_us(c, (*key, layer, si))
            steps.append((step, gated, reads, us))
        ffn = cost.duration_us(step_cost("ffn", model.dims, model.layer_kinds[layer], batch.requests, 0, tp),
                               (*key, layer, 1 << 20))
        plan.append((steps, ffn))
    return plan


@SETTINGS
@given(st.integers(0, (1 << 64) - 1), st.lists(WORD, max_size=4),
       st.lists(st.tuples(WORD, WORD), max_size=20))
def test_keyed_normals_are_the_keyed_normals_bit_for_bit(seed, prefix, rows):
    got = keyed_normals(seed, prefix, np.array(rows, np.int64).reshape(-1, 2))
    want = [keyed_normal(seed, (*prefix, *r)) for r in rows]
    assert [x.hex() for x in got] == [x.hex() for x in want]


@st.composite
def batches(draw):
    name = draw(st.sampled_from(["dsa-v3.2", "deepseek-v4-flash"]))
    fam = model(name)
    pages = draw(st.integers(2, 6))
    _, pools, buffers, _ = world(name, pages, hosts=False)
    # a subset of the pools (a role the buffers lack is not read, its steps still cost)
    roles = sorted(buffers)
    keep = draw(st.lists(st.sampled_from(roles), min_size=1, unique=True))
    buffers = {r: buffers[r] for r in keep}
    mode = draw(st.sampled_from(["extend", "decode"]))
    reqs = []
    for rid in range(draw(st.integers(1, 4))):
        slots = {}
        for role, (_, lay) in buffers.items():
            if draw(st.booleans()):
                slots[role] = np.array(draw(st.lists(st.integers(0, lay.tokens - 1), min_size=1, max_size=12)),
                                       np.int64)
        ctx = draw(st.integers(1, 200_000))
        new = ctx if mode == "extend" and draw(st.booleans()) else draw(st.integers(1, ctx))
        reqs.append(BatchRequest(rid, slots, 1 if mode == "decode" else new, ctx))
    batch = ForwardBatch(mode, tuple(reqs), -1)
    tp = draw(st.sampled_from([1, 2, 8]))
    frac = draw(st.sampled_from([0.0, 0.05, 0.3, 2.0]))      # 2.0: some factors clamp at 0
    cost = CostModel(dataclasses.replace(CostModel.from_profile(H200).params, jitter_frac=frac),
                     seed=draw(st.integers(0, 1 << 40)))
    key = tuple(draw(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=3)))
    # the V4 model's accessors are in the incident fork's map only
    gm = gate_map(draw(st.sampled_from(["upstream-0.5.10", "upstream-0.5.11"])) if name == "dsa-v3.2"
                  else "incident-fork")
    return fam, gm, pools, buffers, batch, cost, tp, key


@SETTINGS
@given(batches())
def test_the_plan_equals_the_per_layer_plan(args):
    fam, gm, pools, buffers, batch, cost, tp, key = args
    options = resolve_options(None)
    fast = _plan(fam, gm, options, batch, pools, buffers, cost, tp, key)
    slow = _plan_per_layer(fam, gm, options, batch, pools, buffers, cost, tp, key)
    assert len(fast) == len(slow) == fam.n_layers
    for (f_steps, f_ffn), (s_steps, s_ffn) in zip(fast, slow):
        assert f_ffn.hex() == s_ffn.hex()
        assert len(f_steps) == len(s_steps)
        for (fs, fg, fr, fu), (ss, sg, sr, su) in zip(f_steps, s_steps):
            assert fs == ss and fg == sg and fu.hex() == su.hex()
            assert len(fr) == len(sr)
            for a, b in zip(fr, sr):
                assert a[:2] == b[:2] and np.array_equal(a[2], b[2]) and np.array_equal(a[3], b[3])
                assert a[4].keys() == b[4].keys() and all(np.array_equal(a[4][k], b[4][k]) for k in a[4])
                assert a[5] == b[5]
