"""The streaming engine (``keep="report"``: each read judged when the run captures it, nothing
of the run kept) against the engine that keeps the whole run and judges it at the end
(``keep="all"``, the path the engine had before): the same ``EngineResult`` but the wall time,
on several scenarios, gate maps, hypotheses and seeds.  Also the session's keep modes and the
KV oracle's batched check against the per-request, per-view one it replaced."""
from __future__ import annotations

import numpy as np
import pytest

from sim.cache.radix import RadixKey
from sim.cache.records import InsertParams
from sim.cache.session import CacheSession
from sim.engine import PrefillEngine
from sim.engine.engine import run_prefill_engine
from sim.engine.scenario import load_scenario
from sim.errors import InputError
from sim.executor import run_reference

GLM = ["run.layers=2"]
V4 = ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4", "model.index_k_dtype=fp8"]


def both(name: str, sets: list[str], seed: int):
    sc = load_scenario(name, sets)
    return (PrefillEngine(sc, seed, keep="all").run().signature(),
            PrefillEngine(sc, seed, keep="report").run().signature())


def assert_same(a: dict, b: dict) -> None:
    diff = sorted(k for k in a if a[k] != b[k])
    assert not diff, {k: (a[k], b[k]) for k in diff}


@pytest.mark.parametrize("sets, seed", [
    ([*GLM, "variant.gate_map=upstream-0.5.10"], 0),     # stale index-K reads, latent races
    pytest.param([*GLM, "variant.gate_map=upstream-0.5.10"], 3, marks=pytest.mark.slow),
    pytest.param([*GLM, "variant.gate_map=upstream-0.5.11"], 1, marks=pytest.mark.slow),   # no corruption
])
def test_streaming_equals_the_end_of_run_verdicts_glm5(sets, seed):
    a, b = both("glm5-22811-small", sets, seed)
    assert a["load_backs"] > 0
    if "variant.gate_map=upstream-0.5.10" in sets:
        assert a["requests_corrupted"] > 0 and a["latent_races"] > 0
    assert_same(a, b)


@pytest.mark.slow
def test_streaming_equals_the_end_of_run_verdicts_incident_repro():
    a, b = both("incident-repro", ["run.duration_s=0.5"], 0)
    assert a["requests_corrupted"] > 0
    assert_same(a, b)


def test_streaming_equals_the_end_of_run_verdicts_wrong_kv():
    """A pool never backed up: wrong KV in every order (the oracle, no race)."""
    a, b = both("incident-short", [*V4, "variant.hypotheses=index-k-not-backed-up"], 0)
    assert a["requests_wrong_kv"] > 0
    assert_same(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name, sets", [
    ("glm5-22811-small", [*GLM, "variant.gate_map=upstream-0.5.10", "workload.concurrency=6"]),
    ("glm5-22811-small", ["run.layers=4", "variant.gate_map=upstream-0.5.10"]),
    ("incident-repro", ["run.duration_s=2"]),
    ("incident-short", [*V4, "variant.hypotheses=index-k-stride-mismatch"]),
    ("incident-short", [*V4, "model.index_k_dtype=bf16", "variant.hypotheses=index-k-c4-token-copy"]),
    ("incident-short", [*V4, "variant.hypotheses=host-freed-during-load"]),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_equals_the_end_of_run_verdicts_deep(name, sets, seed):
    assert_same(*both(name, sets, seed))


def test_run_prefill_engine_streams_and_refuses_a_bad_keep():
    r = run_prefill_engine("glm5-22811-small", 0, overrides=["variant.gate_map=upstream-0.5.10"], layers=2)
    e = PrefillEngine(load_scenario("glm5-22811-small", ["variant.gate_map=upstream-0.5.10"]), 0, layers=2,
                      keep="report")
    assert e.run().signature() == r.signature()
    # nothing per read is left once the run is judged, and no record is kept
    assert not e.read_rids and not e.issues and e.report is None
    assert e.session.finish().online.reads == []
    with pytest.raises(InputError, match="keep"):
        e.session.record()
    with pytest.raises(InputError, match="keep"):
        PrefillEngine(load_scenario("glm5-22811-small"), 0, keep="some")


def _session(keep: str) -> CacheSession:
    return CacheSession({"model": "mla", "layers": 2, "device_tokens": 64, "keep": keep})


def test_session_read_sink_sees_every_read_once_with_its_verdict():
    seen = []
    s = _session("report")
    s.set_read_sink(lambda cap, exp, entry: seen.append((cap.op_id, len(cap.views), len(exp), entry["status"])))
    slots = s.allocator.alloc(8)
    s.store_kv(slots, owner=1)
    s.cache.insert(InsertParams(RadixKey(np.arange(8)), slots))
    ids = [s.read(name, 0, slots) for name in s.roles]
    s.wait_idle()
    run = s.finish()
    assert [x[0] for x in seen] == ids and all(x[1] == x[2] >= 1 and x[3] == "ok" for x in seen)
    assert run.online is not None and run.digest and run.online.reads == []
    # digest=False: the same run, no digest hashed (the engine's sessions)
    s2 = CacheSession({"model": "mla", "layers": 2, "device_tokens": 64, "keep": "report", "digest": False})
    seen2 = []
    s2.set_read_sink(lambda cap, exp, entry: seen2.append(entry["status"]))
    slots = s2.allocator.alloc(8)
    s2.store_kv(slots, owner=1)
    [s2.read(name, 0, slots) for name in s2.roles]
    s2.wait_idle()
    assert s2.finish().digest is None and seen2 == ["ok"] * len(s2.roles)
    with pytest.raises(InputError, match="config.digest"):
        CacheSession({"model": "mla", "layers": 2, "device_tokens": 64, "digest": "no"})
    with pytest.raises(InputError, match="keep"):
        _session("all").set_read_sink(print)
    with pytest.raises(InputError, match="config.keep"):
        _session("most")


def test_session_report_mode_keeps_the_verdicts_of_the_whole_run():
    """Without a sink, a keep="report" session's analyse equals the keep="all" session's on
    what both list (the statuses and races of the same calls)."""
    from sim.verdicts import analyse

    out = {}
    for keep in ("all", "report"):
        s = _session(keep)
        slots = s.allocator.alloc(8)
        s.store_kv(slots, owner=1, sync=False)
        s.read(next(iter(s.roles)), 0, slots, stream="load")      # unordered after the writes: a race
        s.wait_idle()
        run = s.finish()
        rep = analyse(run, race_limit=None) if keep == "report" else analyse(
            run, reference=run_reference(run.schedule, table=run.memory.table), race_limit=None)
        out[keep] = ([r["status"] for r in rep["reads"]], rep["latent_races_total"], rep["schedule_digest"])
    assert out["all"] == out["report"] and out["all"][1] > 0


# ---------------------------------------------------------------- the oracle's batched check

def _reference_check_read(oracle, info, obs_read, req, n_ctx):
    """The oracle's check as it was before the batched form: per request, per view, a mask."""
    ent = np.asarray(info.entries[req.rid], np.int64)
    if not len(ent):
        return np.zeros(0, bool)
    name, lay = oracle.buffers[info.role]
    kind = oracle.kinds[name]
    r = oracle.ratios[info.role]
    # a windowed pool's read starts at entry ``info.first[rid]`` of the sequence (SWA's window)
    seq = info.first.get(req.rid, 0) + np.arange(len(ent), dtype=np.int64)
    want = oracle.expected(req, info.role, seq * r + (r - 1), n_ctx)
    views = sorted(obs_read.views, key=lambda v: v.offset)
    v_off = np.array([v.offset for v in views], np.int64)
    unit_dest = ent // lay.entries_per_unit
    nf = len(lay.effective_fields)
    offs, in_unit, entry, pls = [], [], [], []
    for pl in info.pool_layers:
        o, _ = lay.token_extents(pl, ent)
        offs.append(o.ravel())
        in_unit.append((o - lay.unit_offsets(pl, unit_dest)[:, None]).ravel())
        entry.append(np.repeat(np.arange(len(ent)), nf))
        pls.append(np.full(o.size, pl, np.int64))
    offs, in_unit, entry, pls = (np.concatenate(x) for x in (offs, in_unit, entry, pls))
    k = np.searchsorted(v_off, offs, side="right") - 1
    ok = np.zeros(offs.size, bool)
    for kk in np.unique(k).tolist():
        m = np.flatnonzero(k == kk)
        v = views[kk]
        p = v.compact.pieces(0, v.compact.nbytes)
        for j in m.tolist():
            rel = int(offs[j] - v_off[kk])
            i = int(np.searchsorted(p.start, rel, side="right")) - 1
            og = v.compact.table[int(p.origin_id[i])]
            so = int(p.stream_offset[i]) + rel - int(p.start[i])
            u, b = divmod(so, og.unit_bytes)
            ok[j] = (og.owner >= 0 and og.kind == kind and og.layer == pls[j] and b == in_unit[j]
                     and oracle.content.get((kind, og.version, u)) == int(want[entry[j]]))
    bad = np.zeros(len(ent), bool)
    np.logical_or.at(bad, entry, ~ok)
    return bad


@pytest.mark.parametrize("name, sets", [
    ("glm5-22811-small", [*GLM, "variant.gate_map=upstream-0.5.10"]),
    pytest.param("incident-short", [*V4, "variant.hypotheses=index-k-not-backed-up"], marks=pytest.mark.slow),
])
def test_batched_oracle_check_equals_the_per_request_check(name, sets):
    e = PrefillEngine(load_scenario(name, sets), 0, keep="all")
    infos = {}
    orig = e.oracle.check_reads

    def spy(info, obs, made_for, contents=None):
        infos[info.op_id] = (info, dict(made_for))
        return orig(info, obs, made_for, contents)
    e.oracle.check_reads = spy
    e.run()
    run = e.session.finish()
    assert infos
    flagged = 0
    for obs in run.reads:
        if obs.op_id not in infos:
            continue
        info, made_for = infos[obs.op_id]
        got = e.oracle.check_reads(info, obs, made_for)
        e.oracle.CHUNK_SAMPLES = 64                 # one request per group
        assert {k: v.tolist() for k, v in e.oracle.check_reads(info, obs, made_for).items()} == \
            {k: v.tolist() for k, v in got.items()}
        del e.oracle.CHUNK_SAMPLES
        for rid, (req, n_ctx) in made_for.items():
            want = _reference_check_read(e.oracle, info, obs, req, n_ctx)
            assert np.array_equal(got[rid], want), (obs.op_id, rid)
            flagged += int(want.any())
    if "index-k-not-backed-up" in " ".join(sets) or "0.5.10" in " ".join(sets):
        assert flagged > 0
