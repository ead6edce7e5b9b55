"""Which requests a raced read hit is decided on provenance runs (``PrefillEngine._requests_hit``:
``sim.verdicts.differing_runs`` against each request's entry extents, O(segments)), not byte by
byte.  The per-byte check it replaces is kept here as the reference; on every raced read of
engine runs that race on both sides (prefill reads under the 0.5.10 gates, the decode server's
overlap loop) both must name the same requests."""
from __future__ import annotations

import numpy as np
import pytest

from sim.engine.decode_hicache import DecodeCacheEngine
from sim.engine.engine import PrefillEngine
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


EXAMPLE = example_script("make_decode_window")
CASES = {
    # the prefill side's ungated index-K reads race the load-back (glm5-22811, 2 layers, 0.5.10 gates)
    "prefill": ("glm5-22811-small", ["run.layers=2", "run.duration_s=2"]),
    # the decode side's overlap loop (the committed example's run)
    "decode": (EXAMPLE.SCENARIO, EXAMPLE.OVERRIDES),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_requests_hit_by_runs_equals_per_byte(case, monkeypatch):
    compared = []
    real = PrefillEngine._requests_hit

    def both(self, info, obs, ref):
        got = real(self, info, obs, ref)
        assert got == requests_hit_per_byte(self, info, obs, ref), info.op_id
        compared.append(bool(got))
        return got

    monkeypatch.setattr(PrefillEngine, "_requests_hit", both)
    monkeypatch.setattr(DecodeCacheEngine, "_requests_hit", both)
    scenario, overrides = CASES[case]
    r = PrefillEngine(load_scenario(scenario, list(overrides)), 0, keep="report").run()
    side = r.decode if case == "decode" else r.to_dict()
    # raced reads were compared (every one a request's: a ride-along step's reads are judged but
    # made for no request), and some of them hit requests: not a comparison of empty sets
    assert 0 < len(compared) <= side["stale_reads"] + side["torn_reads"]
    assert any(compared)
