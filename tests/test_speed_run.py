"""The fourth round of the static run's speed work (issue 7, item 5), each fast path checked
against the path it replaces:

* ``StaticRaceTracker``: live accesses dropped per buffer (the streams that still access a
  buffer are known up front) instead of by one floor for every buffer, which never drops
  anything when devices are independent;
* a static schedule's verdicts taken on demand (when a read is captured, and at the end),
  not as ops are issued;
* copy-plan cache keys with one token per layout value (``routines._layout_token``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.transfers.routines as routines
import sim.verdicts as verdicts
from sim.executor import run_schedule
from sim.hb import RaceTracker
from sim.schedule import validate
from sim.verdicts import OnlineVerdicts, StaticRaceTracker, analyse
from tests.helpers import profile
from tests.strategies import rich_schedules, schedules

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
any_schedule = st.one_of(rich_schedules(max_ops=16), schedules(max_ops=16))


def _global_floor_tracker(clocks, limit, ops, describe=None):
    """The tracker a static run used before: ``RaceTracker`` with one floor for all buffers."""
    return RaceTracker(clocks, limit, describe=describe)


def _report(s, seed, race_limit=None):
    run = run_schedule(s, P, keep="report", seed=seed, race_limit=race_limit)
    return run, analyse(run, race_limit=race_limit)


@SETTINGS
@given(any_schedule, st.integers(0, 3), st.sampled_from([None, 1, 3]))
def test_static_race_tracker_finds_what_the_global_floor_finds(doc, seed, limit):
    """Pruned per buffer after every op: the same report (races found, counted, listed, in
    the same order) as the tracker with one floor for all buffers."""
    s = validate(doc)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verdicts, "StaticRaceTracker", _global_floor_tracker)
        _, old = _report(s, seed, limit)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StaticRaceTracker, "PRUNE_EVERY", 1)
        run, new = _report(s, seed, limit)
    assert isinstance(run.online.races, StaticRaceTracker)
    assert new == old


def _devices_doc(devices: int, requests: int, gated: bool = False) -> dict:
    """Independent devices, each loading one page a request on its load stream and reading
    it on its forward stream; ``gated``: each read waits for its load and each load for the
    read before it (no race), else the reads race the loads."""
    buffers, streams, events, ops = [], [], [], []
    for d in range(devices):
        buffers += [{"name": f"h{d}", "location": "host", "kind": "kv",
                     "layout": {"kind": "host", "layout": "layer_first", "layers": 2, "units": 8, "unit_bytes": 256}},
                    {"name": f"g{d}", "location": "device", "device": d, "kind": "kv",
                     "layout": {"kind": "paged", "layers": 2, "pages": 4, "page_bytes": 256}}]
        streams += [{"name": f"load{d}", "device": d}, {"name": f"fwd{d}", "device": d}]
        events += [f"e{d}", f"f{d}"]
    for r in range(requests):
        for d in range(devices):
            page = r % 4
            if gated and r:      # the load waits for the last read too (no write-after-read race)
                ops.append({"id": f"wf{d}_{r}", "op": "wait", "stream": f"load{d}", "event": f"f{d}"})
            ops.append({"id": f"c{d}_{r}", "op": "copy", "stream": f"load{d}", "routine": "kernel_per_layer",
                        "src": f"h{d}", "dst": f"g{d}",
                        "args": {"layer": r % 2, "src_indices": [r % 8], "dst_indices": [page]}})
            ops.append({"id": f"rec{d}_{r}", "op": "record", "stream": f"load{d}", "event": f"e{d}"})
            if gated:
                ops.append({"id": f"w{d}_{r}", "op": "wait", "stream": f"fwd{d}", "event": f"e{d}"})
            ops.append({"id": f"r{d}_{r}", "op": "read", "stream": f"fwd{d}", "buffer": f"g{d}", "layer": r % 2,
                        "units": [page]})
            if gated:
                ops.append({"id": f"rf{d}_{r}", "op": "record", "stream": f"fwd{d}", "event": f"f{d}"})
    return {"kvrace_schedule": 2, "name": "devices", "buffers": buffers, "streams": streams, "events": events,
            "ops": ops}


def test_live_accesses_follow_live_state_with_independent_devices():
    """Three independent devices, reads gated on the loads: one floor for all buffers keeps
    every access (a later op of one device is not ordered after anything of another); a
    floor per buffer keeps the live ones only.  Same report either way."""
    s = validate(_devices_doc(3, 60, gated=True))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verdicts, "StaticRaceTracker", _global_floor_tracker)
        mp.setattr(RaceTracker, "PRUNE_EVERY", 64)
        old_run, old = _report(s, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StaticRaceTracker, "PRUNE_EVERY", 64)
        new_run, new = _report(s, 0)
    assert new == old and new["latent_races_total"] == 0
    accesses = sum(2 if op.op == "copy" else 1 for op in s.ops if op.op in ("copy", "read"))
    assert accesses == 540 and old_run.online.races.live_accesses() == accesses   # nothing dropped
    # at most the accesses added since the last prune, and the few live at it
    assert new_run.online.races.live_accesses() < 64 * 2 + 16


def test_ungated_reads_keep_racing_with_a_floor_per_buffer():
    """Ungated reads race every load of their page (before or after them): all found."""
    requests, devices = 24, 2
    s = validate(_devices_doc(devices, requests))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verdicts, "StaticRaceTracker", _global_floor_tracker)
        _, old = _report(s, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StaticRaceTracker, "PRUNE_EVERY", 1)
        _, new = _report(s, 0)
    # per device, the 4 (layer, page) classes each pair every load with every read
    assert new == old and new["latent_races_total"] == devices * 4 * (requests // 4) ** 2


def test_a_buffer_no_later_op_accesses_keeps_nothing():
    """After the last access of a buffer nothing of it can race: a prune drops it all."""
    s = validate(_devices_doc(2, 3))
    run = run_schedule(s, P, keep="report")
    races = run.online.races
    races.prune()
    assert races.live_accesses() == 0 and not races._accs


def _take_at_issue(self, op, clipped=None):
    """``OnlineVerdicts.issued`` before: a static schedule's ops taken as they are issued."""
    if self._ops is None:
        self._take(op, clipped)
        return
    while self._next <= op.index:
        o = self._ops[self._next]
        self._take(o, clipped if o is op else None)
        self._next += 1


@SETTINGS
@given(any_schedule, st.integers(0, 3))
def test_taken_on_demand_equals_taken_at_issue(doc, seed):
    """A static schedule's ops taken when a read needs them and at the end: the same report,
    the same reads handed to ``on_read`` in the same order, every op taken."""
    s = validate(doc)

    def run(mp):
        seen = []
        orig = OnlineVerdicts.__init__

        def init(self, *a, **kw):
            orig(self, *a, **kw)
            self.on_read(lambda cap, views, entry: seen.append((entry, [v.offset for v in views])))
        mp.setattr(OnlineVerdicts, "__init__", init)
        r = run_schedule(s, P, keep="report", seed=seed)
        return r, analyse(r), seen

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OnlineVerdicts, "issued", _take_at_issue)
        _, old, old_seen = run(mp)
    with pytest.MonkeyPatch.context() as mp:
        r, new, new_seen = run(mp)
    assert new == old and new_seen == old_seen
    assert r.online.taken == len(s.ops) == r.n_ops and not r.online._expected


def test_reads_expected_views_are_made_when_needed():
    """Taken on demand, the expected views held at once are the reads captured out of list
    order only (taken at issue, a static schedule held every read's from time 0)."""
    s = validate(_devices_doc(2, 50, gated=True))
    held = []
    orig = OnlineVerdicts.captured

    def captured(self, r, *frontier):
        held.append(len(self._expected))
        orig(self, r, *frontier)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OnlineVerdicts, "captured", captured)
        run_schedule(s, P, keep="report")
    assert len(held) == 100 and max(held) <= 2 * 2      # a few per device, not 100


# ---- copy-plan cache keys

def _layouts():
    s = validate({"kvrace_schedule": 2, "name": "l", "streams": ["s"], "events": [], "ops": [], "buffers": [
        {"name": "h", "location": "host", "kind": "kv",
         "layout": {"kind": "host", "layout": "layer_first", "layers": 2, "units": 8, "unit_bytes": 64}},
        {"name": "h2", "location": "host", "kind": "kv",
         "layout": {"kind": "host", "layout": "layer_first", "layers": 2, "units": 8, "unit_bytes": 64}},
        {"name": "g", "location": "device", "kind": "kv",
         "layout": {"kind": "paged", "layers": 2, "pages": 4, "page_bytes": 64}}]})
    return s.buffers["h"].layout, s.buffers["h2"].layout, s.buffers["g"].layout


def test_layout_tokens_follow_layout_values():
    h, h2, g = _layouts()
    assert h is not h2 and h == h2
    assert routines._layout_token(h) == routines._layout_token(h2) != routines._layout_token(g)
    args = {"layer": 1, "src_indices": [1, 2], "dst_indices": [3, 4]}
    # equal layouts share one cached plan; the key tells unequal ones apart
    assert routines._plan_key("kernel_per_layer", h, g, args) == routines._plan_key("kernel_per_layer", h2, g, args)
    assert routines._plan_key("kernel_per_layer", h, g, args) != routines._plan_key("kernel_per_layer", g, h, args)
    assert routines.plan("kernel_per_layer", h, g, args) is routines.plan("kernel_per_layer", h2, g, dict(args))


def test_forgotten_tokens_are_never_reused(monkeypatch):
    """Maps cleared when full: a layout seen again gets a new token, never another value's."""
    h, _, g = _layouts()
    monkeypatch.setattr(routines, "PLAN_CACHE_SIZE", 1)
    monkeypatch.setattr(routines, "_layout_tokens", {})
    monkeypatch.setattr(routines, "_layout_ids", {})
    th = routines._layout_token(h)
    tg = routines._layout_token(g)                 # clears both maps first
    th2 = routines._layout_token(h)                # forgotten: a new token
    assert len({th, tg, th2}) == 3
    args = {"layer": 0, "src_indices": [5], "dst_indices": [6]}
    fresh = routines._plan("kernel_per_layer", g, h, args, "")
    for _ in range(3):
        got = routines.plan("kernel_per_layer", g, h, args)
        assert (got.extents.src.tolist(), got.extents.dst.tolist()) == (fresh.extents.src.tolist(),
                                                                         fresh.extents.dst.tolist())


def test_an_unhashable_layout_is_planned_afresh():
    h, _, g = _layouts()
    odd = dataclasses.replace(g)
    object.__setattr__(odd, "layers", [2])            # an unhashable field
    with pytest.raises(TypeError):
        hash(odd)
    assert routines._layout_token(odd) is None
    assert routines._plan_key("kernel_per_layer", h, odd, {"layer": 0, "src_indices": [1],
                                                           "dst_indices": [1]}) is None


@pytest.mark.parametrize("value", [[1, True], [1.0], (1, 2), [], ["1"], [1] * (routines.PLAN_CACHE_MAX_INDICES + 1)])
def test_arg_key_types_as_before(value):
    """``_arg_key`` of index lists: the replaced ``all(type(x) is int ...)`` test."""
    t = type(value)
    before = (t, tuple(value)) if (t is list or t is tuple) and len(value) <= routines.PLAN_CACHE_MAX_INDICES \
        and all(type(x) is int for x in value) else None
    assert routines._arg_key(value) == before


# ---- unit selections memoised per layout value

def test_equal_layouts_share_unit_selections_and_unequal_ones_do_not(monkeypatch):
    """Two buffers of one layout value (two TP ranks' pools) share one memoised selection,
    equal to a fresh expansion; a buffer of another layout gets its own."""
    import sim.schedule as schedule
    monkeypatch.setattr(schedule, "_SELECTIONS", {})
    s = validate({"kvrace_schedule": 2, "name": "sel", "streams": ["s"], "events": [], "buffers": [
        {"name": "g0", "location": "device", "kind": "kv", "layout": {"kind": "paged", "layers": 2, "pages": 8,
                                                                      "page_bytes": 64}},
        {"name": "g1", "location": "device", "device": 1, "kind": "kv",
         "layout": {"kind": "paged", "layers": 2, "pages": 8, "page_bytes": 64}},
        {"name": "g2", "location": "device", "kind": "kv", "layout": {"kind": "paged", "layers": 2, "pages": 8,
                                                                      "page_bytes": 128}}],
        "ops": [{"id": f"r{b}", "op": "read", "stream": "s", "buffer": b, "layer": 1, "units": [3, 5]}
                for b in ("g0", "g1", "g2")]})
    r0, r1, r2 = s.ops
    assert s.buffers["g0"].layout is not s.buffers["g1"].layout
    assert r0.extents[0] is r1.extents[0] and r0.units is r1.units        # shared
    assert r2.extents[0] is not r0.extents[0]
    for op in s.ops:
        lay = s.buffers[op.buffer].layout
        assert op.extents[0].tolist() == lay.unit_offsets(1, np.array([3, 5])).tolist()
        assert op.extents[1].tolist() == [lay.unit_bytes] * 2
    assert len(schedule._SELECTIONS) == 2


# ---- the schedule digest, hashed as it is encoded

def _whole_document_digest(s) -> str:
    """``Schedule.digest`` before: the canonical document built whole, then hashed."""
    import hashlib

    from sim.schedule import _canonical
    return hashlib.sha256(_canonical(s.to_json()).encode()).hexdigest()


@SETTINGS
@given(any_schedule)
def test_streamed_digest_equals_the_whole_documents(doc):
    s = validate(doc)
    assert s.digest() == _whole_document_digest(s)


@pytest.mark.parametrize("n_ops", [0, 1, 255, 256, 257, 600])
def test_streamed_digest_at_batch_edges(n_ops):
    doc = _devices_doc(1, 200)
    doc["ops"] = doc["ops"][:n_ops]
    s = validate(doc)
    assert len(s.ops) == n_ops and s.digest() == _whole_document_digest(s)


# ---- a one-layer row copy's plan without the (items, layers) stack

def _row_copy_before(src, dst, layers, s, d, item_bytes):
    """``routines._row_copy`` before its one-layer path."""
    n = s.size
    keep = routines._kept(s, d)
    nl = layers.size
    so = np.stack([src.unit_offsets(int(L), s[keep]) for L in layers], axis=1) if keep.size else np.zeros((0, nl))
    do = np.stack([dst.unit_offsets(int(L), d[keep]) for L in layers], axis=1) if keep.size else np.zeros((0, nl))
    item = np.repeat(keep, nl)
    length = np.full(item.size, item_bytes, dtype=np.int64)
    return routines._extents(so.ravel(), do.ravel(), length, item, n)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 7), st.integers(-2, 3)), max_size=6), st.integers(0, 1),
       st.sampled_from([[0], [1], [0, 1], [1, 0]]))
def test_row_copy_one_layer_path_equals_the_stack(pairs, which, layers):
    h, _, g = _layouts()
    src, dst = (h, g) if which else (g, h)
    s = np.array([p[0] for p in pairs], np.int64)
    d = np.array([p[1] for p in pairs], np.int64)
    if not which:
        s, d = np.clip(s, -2, 3), d
    lay = np.array(layers, np.int64)
    new, old = routines._row_copy(src, dst, lay, s, d, 64), _row_copy_before(src, dst, lay, s, d, 64)
    for a, b in ((new.src, old.src), (new.dst, old.dst), (new.length, old.length), (new.item, old.item)):
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist() and a.flags.c_contiguous
    assert new.n_items == old.n_items


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), min_size=1, max_size=20),
       st.lists(st.tuples(st.integers(0, 70), st.integers(-3, 10)), max_size=6),
       st.lists(st.tuples(st.integers(0, 70), st.integers(-3, 10)), max_size=6))
def test_extents_met_equals_the_per_extent_test(extents, copied, filled):
    """``_extents_met`` (the torn copy's items merged, every read extent tested at once) finds
    the extents the per-extent loop it replaced overlaid: ``min(end, hi) > max(start, lo)``
    for some item of either kind (items may be empty or inverted)."""
    from sim.executor import _extents_met
    lo = np.array([o for o, _ in extents], np.int64)
    hi = lo + np.array([n for _, n in extents], np.int64)
    parts = [(np.array([a for a, _ in x], np.int64), np.array([a + n for a, n in x], np.int64))
             for x in (copied, filled)]
    got = _extents_met(lo, hi, (parts[0][0], parts[1][0]), (parts[0][1], parts[1][1]))
    want = [any(min(e, h) > max(a, l) for a, e in zip(np.concatenate([p[0] for p in parts]).tolist(),
                                                        np.concatenate([p[1] for p in parts]).tolist()))
            for l, h in zip(lo.tolist(), hi.tolist())]
    assert got.tolist() == np.flatnonzero(want).tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), min_size=1, max_size=20),
       st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70), st.integers(0, 12), st.integers(0, 14),
                          st.integers(0, 14)), min_size=1, max_size=12),
       st.sampled_from([1, 3, 7]))
def test_torn_pieces_are_each_copy_extent_met_with_each_read_extent_in_copy_extent_order(extents, copy, pairs):
    """``_torn_pieces``: every (copy extent, read extent) intersection of the done part (the
    copied bytes ``min(copy_len, done)``, then the bytes read past the source up to ``done``),
    in copy extent order, the same whether the pairs are intersected at once or in chunks of
    ``TORN_PAIRS`` (here 1, 3 or 7)."""
    import sim.executor as X
    from sim.memory import Clipped
    offs = np.array([o for o, _ in extents], np.int64)
    lens = np.array([n for _, n in extents], np.int64)
    src, dst, clen, fend, done = (np.array(x, np.int64) for x in zip(*copy))
    fend = np.maximum(fend, clen)
    c = Clipped(src, dst, fend, np.zeros(src.size, np.int64), clen, clen.copy(), fend, 100)
    want_c, want_f = [], []
    for i in range(src.size):
        n = min(int(clen[i]), int(done[i]))
        f1 = min(int(fend[i]), int(done[i]))
        for j, (lo, hi) in enumerate(zip(offs.tolist(), (offs + lens).tolist())):
            a, b = max(int(dst[i]), lo), min(int(dst[i]) + n, hi)
            if b > a:
                want_c.append((j, int(src[i]) + a - int(dst[i]), a, b - a))
            a, b = max(int(dst[i]) + int(clen[i]), lo), min(int(dst[i]) + f1, hi)
            if b > a:
                want_f.append((j, a, b - a, int(src[i]) + a - int(dst[i]) - 100))
    whole = X._torn_pieces(c, slice(None), done, offs, lens)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(X, "TORN_PAIRS", pairs)
        chunked = X._torn_pieces(c, slice(None), done, offs, lens)
    for got in (whole, chunked):
        if not (want_c or want_f):
            assert got is None
            continue
        copied, filled = got
        assert (list(zip(*(x.tolist() for x in copied))) if copied is not None else []) == want_c
        assert (list(zip(*(x.tolist() for x in filled))) if filled is not None else []) == want_f
