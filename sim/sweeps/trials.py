"""One chunk of trials of one sweep point: the unit of work a worker runs.

A trial is one seeded run of the point's schedule (compute jitter, launch
skew when the profile has it, seeded order of same-instant ops, torn items)
classified as ``analyse`` classifies its reads.  Trial ``t`` of a point uses
the seed ``trial_seed(seed, key, t)``: it depends on the sweep's seed, the
point's key and the trial number only, never on which worker runs it or in
which chunk, so a sweep's numbers do not depend on the number of workers or
the backend.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

__all__ = ["ChunkResult", "Task", "point_key", "read_status", "run_chunk", "trial_seed"]

_CACHE_LIMIT = 64           # prepared points kept per worker process


def point_key(generator: str, point: dict, profile: str) -> str:
    """A point's identity: 16 hex digits of the sha256 of its canonical JSON
    (generator, every parameter value, profile)."""
    text = json.dumps({"generator": generator, "point": point, "profile": profile}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def trial_seed(seed: int, key: str, trial: int) -> int:
    """The seed of trial ``trial`` of point ``key`` in a sweep seeded ``seed``
    (a 32-bit value from numpy's SeedSequence over the three)."""
    ss = np.random.SeedSequence([int(seed), int(key, 16), int(trial)])
    return int(ss.generate_state(1, np.uint32)[0])


@dataclass(frozen=True)
class Task:
    """Trials ``[start, stop)`` of one point (``chunk`` numbers them in order)."""

    generator: str
    point: tuple[tuple[str, Any], ...]     # every parameter, in declaration order
    profile: str
    seed: int
    key: str
    chunk: int
    start: int
    stop: int
    imports: tuple[str, ...] = ()          # modules that register user generators


@dataclass(frozen=True)
class ChunkResult:
    """What a chunk's trials saw.  A trial is ``corrupt`` when a counted read
    was stale or torn; ``stale``/``torn`` count trials with at least one read
    of that status, ``indeterminate`` trials with an indeterminate read.
    ``latent_races`` (timing-independent, counted by ``sim.hb.race_scan``) is
    set on chunk 0 only."""

    key: str
    chunk: int
    trials: int
    corrupt: int
    stale: int
    torn: int
    indeterminate: int
    latent_races: int | None = None


class _Prepared:
    """A point's schedule, profile and reference reads, built once per worker."""

    def __init__(self, task: Task):
        from sim.executor import run_reference
        from sim.hb import indeterminate_read_bytes, intra_launch_races
        from sim.profile import load_profile
        from sim.schedule import validate
        from sim.sweeps.generators import PROFILE_OVERRIDES, get_generator

        for module in task.imports:
            importlib.import_module(module)
        gen = get_generator(task.generator)
        point = dict(task.point)
        self.schedule = validate(gen.build(point))
        profile = load_profile(task.profile)
        changes = {PROFILE_OVERRIDES[k]: v for k, v in point.items() if k in PROFILE_OVERRIDES and v is not None}
        self.profile = replace(profile, **changes) if changes else profile
        ref = run_reference(self.schedule, materialise=False)
        self.reference = {r.op_id: r for r in ref.reads}
        self.wanted = set(gen.reads) or set(self.reference)
        missing = sorted(set(gen.reads) - set(self.reference))
        if missing:
            from sim.errors import InputError

            raise InputError(f"generator {gen.name}.reads", f"names reads {missing} that its schedule does not "
                             f"have; expected among {sorted(self.reference)}")
        self.indeterminate = indeterminate_read_bytes(self.schedule, intra_launch_races(self.schedule))

    def trial(self, seed: int) -> tuple[bool, bool, bool]:
        """(stale, torn, indeterminate): did some counted read of one seeded run have that status?"""
        from sim.executor import TieBreak, run_schedule
        # NOTE: the classifier of sim.verdicts itself, so that a trial's status is exactly the
        # status `analyse` reports for that run (tests/test_sweep.py checks they agree).
        from sim.verdicts import _classify, _indeterminate_masks

        run = run_schedule(self.schedule, self.profile, seed=seed, ties=TieBreak("seeded", seed=seed),
                           materialise=False)
        seen = set()
        for r in run.reads:
            if r.op_id not in self.wanted:
                continue
            unit = self.schedule.buffers[r.buffer].layout.unit_bytes
            ind = self.indeterminate.get(r.index)
            if ind is None:
                seen.add(read_status(r, self.reference[r.op_id], unit))
            else:
                masks = _indeterminate_masks(r, ind)
                seen.add(_classify(r, self.reference[r.op_id], unit, masks)[0])
        return "stale" in seen, "torn" in seen, "indeterminate" in seen

    def latent_races(self) -> int:
        from sim.hb import race_scan

        return int(race_scan(self.schedule, limit=0).total)


def _pieces(view, keys: dict):
    """A view's provenance as pieces: (starts, origin keys, stream offset minus start)."""
    p = view.compact.pieces(0, view.compact.nbytes)
    ids = np.array([keys.setdefault(view.compact.table[int(i)], len(keys)) for i in p.origin_id], np.int64)
    return p.start, ids, p.stream_offset - p.start


def read_status(obs, ref, unit_bytes: int) -> str:
    """``ok``, ``stale`` or ``torn``: what ``sim.verdicts`` decides for a read
    without indeterminate bytes, computed on provenance pieces instead of per
    byte (a 1 MiB read costs its pieces, not a million-element comparison).

    A byte differs when its origin or its place in the origin's stream differs
    from the reference's; the read is ``torn`` when some buffer unit (clipped
    to the read's extent) holds both differing and matching bytes."""
    torn = differing = False
    for vo, vr in zip(obs.views, ref.views):
        n = vo.compact.nbytes
        if n == 0 or vo.compact.equals(vr.compact):
            continue
        keys: dict = {}
        so, io, do = _pieces(vo, keys)
        sr, ir, dr = _pieces(vr, keys)
        first_unit = -(-vo.offset // unit_bytes) * unit_bytes - vo.offset    # first unit start inside the view
        cuts = np.arange(first_unit, n, unit_bytes, dtype=np.int64)
        starts = np.unique(np.concatenate([so, sr, cuts[cuts > 0], [0]]))
        lengths = np.diff(np.r_[starts, n])
        a = np.searchsorted(so, starts, side="right") - 1
        b = np.searchsorted(sr, starts, side="right") - 1
        diff = (io[a] != ir[b]) | (do[a] != dr[b])
        if not diff.any():
            continue
        differing = True
        unit = (vo.offset + starts) // unit_bytes
        unit -= unit[0]
        total = np.bincount(unit, weights=lengths)
        bad = np.bincount(unit, weights=lengths * diff)
        torn = torn or bool(((bad > 0) & (bad < total)).any())
    return "torn" if torn else "stale" if differing else "ok"


_PREPARED: dict[tuple, _Prepared] = {}


def _prepared(task: Task) -> _Prepared:
    k = (task.generator, task.point, task.profile, task.imports)
    prep = _PREPARED.get(k)
    if prep is None:
        if len(_PREPARED) >= _CACHE_LIMIT:
            _PREPARED.pop(next(iter(_PREPARED)))
        prep = _PREPARED[k] = _Prepared(task)
    return prep


def run_chunk(task: Task) -> ChunkResult:
    """Run trials ``task.start .. task.stop - 1`` of one point (any process)."""
    prep = _prepared(task)
    corrupt = stale = torn = ind = 0
    for t in range(task.start, task.stop):
        s, tr, i = prep.trial(trial_seed(task.seed, task.key, t))
        corrupt += s or tr
        stale += s
        torn += tr
        ind += i
    return ChunkResult(task.key, task.chunk, task.stop - task.start, corrupt, stale, torn, ind,
                       prep.latent_races() if task.chunk == 0 else None)
