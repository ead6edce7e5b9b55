"""A read that differs from its expected bytes is classified by provenance segments (issue 7's
speed): ``verdicts._classify`` in O(segments + units) instead of one provenance entry per byte.
The per-byte classification it replaces is kept here as the reference; both must give the
same status, bytes differing and first mismatch on random views."""
from types import SimpleNamespace

import numpy as np
import pytest

from sim.bytes.compact import CompactBuffer, OriginTable
from sim.bytes.pattern import Origin
import sim.verdicts as verdicts
from sim.memory import View
from sim.verdicts import _classify, _describe_view
from tests.helpers import provenance_per_byte

def _classify_per_byte(obs, ref, unit_bytes, masks=None):
    """The per-byte classification (every byte's origin and stream offset compared)."""
    first, differing, torn = None, 0, False
    masks = masks or [np.zeros(v.compact.nbytes, bool) for v in obs.views]
    for vo, vr, ind in zip(obs.views, ref.views, masks):
        keys: dict = {}
        oo, so = provenance_per_byte(vo, keys)
        orr, sr = provenance_per_byte(vr, keys)
        diff = ((oo != orr) | (so != sr)) & ~ind
        if not diff.any():
            continue
        differing += int(diff.sum())
        unit_id = (vo.offset + np.arange(diff.size)) // unit_bytes
        bounds = np.flatnonzero(np.diff(unit_id)) + 1
        for part, part_ind in zip(np.split(diff, bounds), np.split(ind, bounds)):
            det = part[~part_ind]
            if det.any() and not det.all():
                torn = True
        if first is None:
            k = int(np.argmax(diff))
            first = {"offset": vo.offset + k, "observed": _describe_view(vo, k, 1, 1)[0]["text"],
                     "expected": _describe_view(vr, k, 1, 1)[0]["text"]}
    if differing == 0:
        return ("indeterminate" if any(m.any() for m in masks) else "ok"), None, 0
    return ("torn" if torn else "stale"), first, differing


ORIGINS = [Origin(k, layer, owner, v, ub) for k in ("index_k", "kv") for layer in (0, 1)
           for owner, v, ub in ((-1, 0, 64), (3, 1, 64), (5, 2, 96))]


def _scribble(rng, buf: CompactBuffer, n_writes: int) -> None:
    n = buf.nbytes
    for _ in range(n_writes):
        k = int(rng.integers(1, 6))
        lens = rng.integers(1, max(2, n // 8), k)
        offs = rng.integers(0, n, k)
        lens = np.minimum(lens, n - offs)
        origin = ORIGINS[int(rng.integers(len(ORIGINS)))]
        # stream offsets often continue the place (a copy of the same bytes), sometimes not
        soff = offs if rng.random() < 0.5 else rng.integers(0, 4 * n, k)
        buf.fill(offs, lens, origin, soff)


def _case(seed: int):
    """Random views of a read and of its reference, a unit size and indeterminate masks (or None)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(16, 3000))
    t_obs = OriginTable()
    t_ref = t_obs if seed % 3 else OriginTable()           # a third: two origin tables
    base = CompactBuffer(n, t_obs, ORIGINS[0])
    _scribble(rng, base, int(rng.integers(0, 6)))
    obs = base.clone()
    _scribble(rng, obs, int(rng.integers(0, 5)))
    ref = CompactBuffer(n, t_ref, ORIGINS[0])
    ref.copy_from(base, [0], [0], [n])
    _scribble(rng, ref, int(rng.integers(0, 3)))
    views_o, views_r, masks = [], [], []
    for _ in range(int(rng.integers(1, 4))):
        off = int(rng.integers(0, n - 1))
        m = int(rng.integers(1, n - off + 1))
        views_o.append(View(obs.slice(off, m), None, off))
        views_r.append(View(ref.slice(off, m), None, off))
        mask = np.zeros(m, bool)
        for _ in range(int(rng.integers(0, 3))):
            a = int(rng.integers(0, m))
            mask[a:a + int(rng.integers(1, 40))] = True
        masks.append(mask)
    unit = int(rng.choice([1, 7, 64, 96, 4096, 10 ** 6]))
    return SimpleNamespace(views=views_o), SimpleNamespace(views=views_r), unit, (None if seed % 2 else masks)


@pytest.mark.parametrize("path", ["python", "numpy"])
@pytest.mark.parametrize("seed", range(120))
def test_classify_by_segments_equals_per_byte(seed, path, monkeypatch):
    """Both ways of cutting runs (``differing_runs``: plain Python for views of a few segments
    without indeterminate bytes, numpy otherwise) give the per-byte classification."""
    if path == "numpy":
        monkeypatch.setattr(verdicts, "_small_runs", lambda view, keys: None)
    o, r, unit, masks = _case(seed)
    assert _classify(o, r, unit, masks) == _classify_per_byte(o, r, unit, masks)


def test_the_python_path_is_taken_by_many_cases():
    """Many of the cases above cut runs in plain Python (both views of a few segments, no mask)."""
    small = 0
    for seed in range(120):
        o, r, _, masks = _case(seed)
        small += masks is None and sum(verdicts._small_runs(a, None) is not None and
                                       verdicts._small_runs(b, None) is not None for a, b in zip(o.views, r.views))
    assert small >= 50


def test_the_cases_are_not_all_alike():
    """The random views above give every status, so the comparison is not of one kind."""
    seen = set()
    for seed in range(120):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(16, 3000))
        t = OriginTable()
        a = CompactBuffer(n, t, ORIGINS[0])
        _scribble(rng, a, 3)
        b = a.clone()
        _scribble(rng, b, int(rng.integers(0, 3)))
        mask = np.zeros(n, bool)
        mask[: int(rng.integers(0, n))] = seed % 4 == 0
        unit = int(rng.choice([1, 64, 10 ** 6]))
        seen.add(_classify(SimpleNamespace(views=[View(a, None, 0)]), SimpleNamespace(views=[View(b, None, 0)]),
                           unit, [mask])[0])
    assert seen == {"ok", "stale", "torn", "indeterminate"}
