"""Interleavings of a schedule beyond the schedule itself (same-instant tie order, per-op delays,
seed, torn or item-atomic landing), drawn by Hypothesis so it shrinks them with the schedule."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from hypothesis import strategies as st

from sim.errors import InputError, show
from sim.testing.programs import LoadForward
from sim.testing.schedules import schedules

__all__ = ["Interleaving", "apply_interleaving", "interleavings", "run_interleaving", "schedules_with_interleavings"]

# ================================================================ interleavings


@dataclass(frozen=True)
class Interleaving:
    """How one run of a schedule interleaves, beyond the schedule itself.

    * ``first``: op ids that go first, in this order, whenever ops become ready at the same
      simulated instant (``TieBreak("explicit", first=...)``; empty: issue order, ``fifo``);
    * ``delays``: ``(op id, us)`` pairs: a ``compute`` of ``us`` microseconds on the op's stream
      right before it (:func:`apply_interleaving`), which holds the op back against the other
      streams without changing happens-before (compute ops touch no bytes, and stream order is
      already transitive);
    * ``seed``: the run's seed (compute jitter, launch skew);
    * ``item_atomic``: copy items land whole (``torn=False``: what a controlled GPU replay can
      force) instead of a read seeing an in-flight item's landed prefix.

    ``kvrace schedule run FILE --seed SEED [--first A,B] [--item-atomic]`` on the document
    :func:`apply_interleaving` returns runs exactly this interleaving (:meth:`cli_args`)."""

    first: tuple[str, ...] = ()
    delays: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    item_atomic: bool = False

    def cli_args(self) -> list[str]:
        """The ``kvrace schedule run`` options that select this interleaving."""
        args = ["--seed", str(self.seed)]
        if self.first:
            args += ["--first", ",".join(self.first)]
        if self.item_atomic:
            args.append("--item-atomic")
        return args

    def to_json(self) -> dict:
        return {"first": list(self.first), "delays": [[k, v] for k, v in self.delays], "seed": self.seed,
                "item_atomic": self.item_atomic}

    def describe(self) -> str:
        ties = f"first {', '.join(self.first)}" if self.first else "fifo"
        delays = ", ".join(f"{k} +{v:g} us" for k, v in self.delays) or "none"
        return (f"seed {self.seed}, ties {ties}, delays {delays}, "
                f"{'item-atomic' if self.item_atomic else 'torn items'}")


#: stream ops an interleaving may order at ties (the executor's same-instant gate takes these)
_GATED = ("copy", "read", "write")
#: stream ops an interleaving may delay
_DELAYABLE = ("copy", "read", "write", "record")


def _doc_of(schedule) -> dict:
    from sim.schedule import Schedule, load

    if isinstance(schedule, Schedule):
        return schedule.to_json()
    if isinstance(schedule, (str, os.PathLike)):
        return load(str(schedule)).to_json()
    if isinstance(schedule, Mapping):
        return dict(schedule)
    raise InputError("schedule", f"expected a Schedule, a schedule document or a file path, got "
                     f"{type(schedule).__name__}")


def _schedule_of(schedule):
    from sim.schedule import Schedule, validate

    return schedule if isinstance(schedule, Schedule) else validate(_doc_of(schedule))


@st.composite
def interleavings(draw, schedule, *, max_delay_us: float = 50.0, max_delays: int = 4,
                  item_atomic: bool | None = None):
    """An :class:`Interleaving` of ``schedule`` (a ``Schedule``, a document or a path): a tie
    order over its copies, reads and writes, up to ``max_delays`` delays of at most
    ``max_delay_us`` before its copies, reads, writes and records, a seed, and torn or
    item-atomic landing (``item_atomic``: fixed, or ``None`` to draw it).  Everything shrinks
    toward the plain run: no tie order (fifo), no delay, seed 0, torn items."""
    s = _schedule_of(schedule)
    gated = [op.id for op in s.ops if op.op in _GATED]
    delayable = [op.id for op in s.ops if op.op in _DELAYABLE]
    first = tuple(draw(st.lists(st.sampled_from(gated), unique=True, max_size=len(gated)))) if gated else ()
    delays: tuple = ()
    if delayable and max_delays > 0:
        pairs = draw(st.lists(st.tuples(st.sampled_from(delayable),
                                        st.floats(0.0, max_delay_us, allow_nan=False, allow_infinity=False)),
                              unique_by=lambda p: p[0], max_size=max_delays))
        order = {k: i for i, k in enumerate(delayable)}
        delays = tuple(sorted(((k, float(v)) for k, v in pairs if v > 0), key=lambda p: order[p[0]]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    atomic = draw(st.booleans()) if item_atomic is None else bool(item_atomic)
    return Interleaving(first, delays, seed, atomic)


@st.composite
def schedules_with_interleavings(draw, schedule_strategy=None, **interleaving_kw):
    """``(schedule document, Interleaving)`` pairs: a schedule from ``schedule_strategy``
    (default :func:`schedules`; one drawing :class:`LoadForward` programs is recorded first)
    and an interleaving of it, in one draw, so Hypothesis shrinks them together."""
    doc = draw(schedules() if schedule_strategy is None else schedule_strategy)
    if isinstance(doc, LoadForward):
        doc = doc.schedule()
    return doc, draw(interleavings(doc, **interleaving_kw))


def apply_interleaving(schedule, interleaving: Interleaving | None = None) -> dict:
    """The schedule document with the interleaving's delays as ``compute`` ops (id
    ``delay.OP``, on OP's stream and host, right before OP).  Refuses op ids the schedule does
    not have."""
    doc = _doc_of(schedule)
    il = interleaving or Interleaving()
    ops = list(doc.get("ops", []))
    ids = {o.get("id") for o in ops}
    for k in il.first:
        if k not in ids:
            raise InputError("interleaving.first", f"unknown op id {show(k)} in schedule {doc.get('name')!r}")
    if not il.delays:
        return doc
    delay = {}
    for k, us in il.delays:
        if k not in ids:
            raise InputError("interleaving.delays", f"unknown op id {show(k)} in schedule {doc.get('name')!r}")
        if not (isinstance(us, (int, float)) and 0 <= us <= 1e9):
            raise InputError(f"interleaving.delays.{k}", f"expected 0..1e9 us, got {show(us)}")
        delay[k] = float(us)
    out = []
    for o in ops:
        us = delay.get(o.get("id"))
        if us:
            if o.get("stream") is None:
                raise InputError(f"interleaving.delays.{o['id']}", "expected a stream op (a delay is a compute "
                                 "on its stream)")
            name = f"delay.{o['id']}"
            while name in ids:
                name += "'"
            ids.add(name)
            d = {"id": name, "op": "compute", "stream": o["stream"], "duration_us": us,
                 "note": f"interleaving delay before {o['id']}"}
            if "host" in o:
                d["host"] = o["host"]
            out.append(d)
        out.append(o)
    doc = dict(doc)
    doc["ops"] = out
    if isinstance(doc.get("kvrace_schedule"), int) and doc["kvrace_schedule"] < 2 and "hosts" not in doc:
        doc["kvrace_schedule"] = 1
    return doc


def run_interleaving(schedule, interleaving: Interleaving | None = None, *, profile="h200",
                     materialise: bool = True):
    """Run ``schedule`` under ``interleaving``: ``(Schedule with the delays, RunResult)``;
    ``materialise=False`` keeps provenance only (verdicts compare provenance, so they agree)."""
    from sim.executor import TieBreak, run_schedule
    from sim.profile import Profile, load_profile
    from sim.schedule import validate

    il = interleaving or Interleaving()
    s = validate(apply_interleaving(schedule, il))
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    ties = TieBreak("explicit" if il.first else "fifo", seed=il.seed, first=tuple(il.first))
    return s, run_schedule(s, prof, seed=il.seed, ties=ties, torn=not il.item_atomic, materialise=materialise)
