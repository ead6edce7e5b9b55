"""Which requests a raced read hit is decided on provenance runs (``PrefillEngine._requests_hit``:
``sim.verdicts.differing_runs`` against each request's entry extents, O(segments)), not byte by
byte; the indexer's top-k of a raced index-K read is taken from the request's own entries'
bytes, not from the whole read's (``_topk_changed``).  The per-byte check and the whole-read
bytes they replace are kept here as the references; on every raced read of engine runs that race
on both sides (prefill reads under the 0.5.10 gates, the decode server's overlap loop) both must
name the same requests and give the same entry bytes."""
from __future__ import annotations

import numpy as np
import pytest

from sim.engine.decode_hicache import DecodeCacheEngine
from sim.engine.engine import PrefillEngine, _entries_read
from sim.engine.forward import entry_bytes
from sim.engine.scenario import load_scenario
from tests.helpers import differing_bytes, example_script


def requests_hit_per_byte(engine, info, obs, ref) -> set[int]:
    """The per-byte check: every differing byte's offset looked up in each request's extents."""
    bad = [vo.offset + np.flatnonzero(d) for vo, vr in zip(obs.views, ref.views)
           if (d := differing_bytes(vo, vr)).any()]
    if not bad:
        return set()
    bad_offs = np.concatenate(bad)
    lay = engine.buffers[info.role][1]
    out = set()
    for rid, ent in info.entries.items():
        for pl in info.pool_layers:
            offs, lens = lay.token_extents(pl, ent)
            for s, e in zip(offs.ravel().tolist(), (offs + lens).ravel().tolist()):
                if ((bad_offs >= s) & (bad_offs < e)).any():
                    out.add(rid)
                    break
            if rid in out:
                break
    return out


def entry_bytes_both_ways(engine, info, obs, ref, rids) -> int:
    """Each request's key bytes in the read and in its reference, from the whole read's bytes
    and from the entries' own extents: equal; returns how many (request, layer) were compared."""
    lay = engine.buffers["index_k"][1]
    field = "key" if "key" in [f.name for f in lay.effective_fields] else None
    whole = [engine._read_bytes(x, info) for x in (obs, ref)]
    n = 0
    for rid in sorted(rids):
        ent = info.entries.get(rid)
        if ent is None or not len(ent):
            continue
        for pl in info.pool_layers:
            sub = _entries_read(lay, ent, pl, field)
            for x, wb in zip((obs, ref), whole):
                assert np.array_equal(entry_bytes(engine._read_bytes(x, sub), sub, lay, ent, pl, field),
                                      entry_bytes(wb, info, lay, ent, pl, field)), (info.op_id, rid, pl)
            n += 1
    return n


EXAMPLE = example_script("make_decode_window")
CASES = {
    # the prefill side's ungated index-K reads race the load-back (glm5-22811, 2 layers, 0.5.10 gates)
    "prefill": ("glm5-22811-small", ["run.layers=2", "run.duration_s=2"]),
    # the decode side's overlap loop (the committed example's run)
    "decode": (EXAMPLE.SCENARIO, EXAMPLE.OVERRIDES),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_requests_hit_and_topk_bytes_equal_the_references(case, monkeypatch):
    compared = []
    real = PrefillEngine._requests_hit

    def both(self, info, obs, ref):
        got = real(self, info, obs, ref)
        assert got == requests_hit_per_byte(self, info, obs, ref), info.op_id
        compared.append(bool(got))
        return got

    topk = []
    real_topk = PrefillEngine._topk_changed

    def topk_both(self, info, obs, ref, rids):
        topk.append(entry_bytes_both_ways(self, info, obs, ref, rids))
        return real_topk(self, info, obs, ref, rids)

    for cls in (PrefillEngine, DecodeCacheEngine):
        monkeypatch.setattr(cls, "_requests_hit", both)
        monkeypatch.setattr(cls, "_topk_changed", topk_both)
    scenario, overrides = CASES[case]
    r = PrefillEngine(load_scenario(scenario, list(overrides)), 0, keep="report").run()
    side = r.decode if case == "decode" else r.to_dict()
    # raced reads were compared (every one a request's: a ride-along step's reads are judged but
    # made for no request), and some of them hit requests: not a comparison of empty sets
    assert 0 < len(compared) <= side["stale_reads"] + side["torn_reads"]
    assert any(compared)
    # raced index-K reads that hit requests had their entries' bytes compared
    assert sum(topk) > 0
