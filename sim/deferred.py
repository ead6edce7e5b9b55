"""The run's memory, deferred while nothing has raced (``Executor.DEFER_RUN_MEMORY``).

A program run with streamed verdicts (``keep="report"``, compact-only memory) applies every
writing op twice: to the happens-before-order reference when it is issued
(:class:`~sim.verdicts.OnlineVerdicts`) and to the run's memory as its items land.  While the
verdicts have found no race, no indeterminate byte and no intra-launch double write, the two
agree wherever the run has landed what the reference applied, so the run's memory need not be
kept: :class:`DeferredRunMemory` keeps the ops issued and not landed instead, and builds the
run's memory from the reference only when something needs it (a race found, a torn read, a
caller asking for the memory, the run's end).

Why the run's memory is then what this module builds, byte ``x`` by byte (the argument of
``OnlineVerdicts.captured``'s fresh reads):

* every writer of ``x`` taken so far is ordered with every other (no write-write race; a
  copy's source read counts as its op's), and ordered ops are issued in happens-before order,
  so the writers of ``x`` the run has landed are a prefix of them in issue order (a later one
  lands only after an earlier one completed), and the run's ``x`` is the last landed one's;
* so a buffer none of whose issued writers is still unlanded holds what the reference holds;
  another holds the reference's contents just before its first unlanded writer, then each
  landed writer after it in issue order (a copy's landed items only), skipping the unlanded;
* a landed copy read its source when it landed; no writer of those bytes raced it, so they
  were the reference's source bytes when the copy was issued, kept with it here.

A copy whose source is its destination is not deferred (its items read what earlier items of
it wrote, group by group as they land): the memory is built when one is issued."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from sim.bytes.compact import CompactBuffer
from sim.memory import Clipped, Memory

__all__ = ["DeferredRunMemory"]


@dataclass
class _Issued:
    """A writing op issued while the run's memory is deferred, with the reference's
    destination (and a copy's source) just before it."""

    op: Any
    c: Optional[Clipped]                 # a copy's clipped extents
    dst_before: CompactBuffer
    src_before: Optional[CompactBuffer]
    landed: Any = None                   # a copy's landed extents so far (a slice), if any
    done: bool = False                   # every item landed (a write: applied)

    @property
    def dst(self) -> str:
        return self.op.dst if self.c is not None else self.op.buffer


class DeferredRunMemory:
    """The run's memory of an executor whose verdicts found nothing that makes the run's bytes
    differ from the reference's: the ops issued and not all landed, in issue order (what the
    run's memory lacks or holds part of), each with the reference's buffers just before it.

    ``mem`` is the executor's Memory object: its watchers are told of every landing as if the
    bytes were applied (``Memory.notify``), and :meth:`materialise` hands them to the memory it
    builds."""

    def __init__(self, mem: Memory, ref: Memory):
        self.mem = mem
        self.ref = ref
        self._issued: deque[_Issued] = deque()
        self._by_index: dict[int, _Issued] = {}

    def issued(self, op, c: Optional[Clipped]) -> bool:
        """A copy or write is being issued (before the reference applies it); False when it
        cannot be deferred (a copy within one buffer)."""
        if c is not None:
            if op.src == op.dst:
                return False
            e = _Issued(op, c, self.ref.compact[op.dst].clone(), self.ref.compact[op.src].clone())
        else:
            e = _Issued(op, None, self.ref.compact[op.buffer].clone(), None)
        self._issued.append(e)
        self._by_index[op.index] = e
        return True

    def copy_landed(self, cp, landed: slice, now: slice) -> None:
        """Copy ``cp`` (the executor's ``_Copy``) has landed extents ``landed`` (its first
        items), ``now`` of them just now."""
        self._by_index[cp.op.index].landed = landed
        if self.mem.watched:
            self.mem.notify(cp.op.dst, cp.c.dst[now], cp.c.length[now])

    def copy_done(self, op) -> None:
        """Every item of copy ``op`` has landed."""
        self._by_index[op.index].done = True
        self._trim()

    def write_landed(self, op) -> None:
        """Write ``op`` has been applied by the run."""
        self._by_index[op.index].done = True
        if self.mem.watched:
            offs, lens = op.extents
            self.mem.notify(op.buffer, offs, lens)
        self._trim()

    def _trim(self) -> None:
        q = self._issued
        while q and q[0].done:
            del self._by_index[q.popleft().op.index]

    def materialise(self) -> Memory:
        """The run's memory now (module doc), holding ``mem``'s watchers."""
        out = self.ref.copy_compact()
        out.adopt_watchers(self.mem)
        issued = list(self._issued)
        first: dict[str, int] = {}
        for k, e in enumerate(issued):
            if not e.done:
                first.setdefault(e.dst, k)
        for name, k0 in first.items():
            buf = issued[k0].dst_before.clone()
            for e in issued[k0:]:
                if e.dst != name or not (e.done or e.landed is not None):
                    continue
                if e.c is None:
                    out.over({name: buf}).apply_write(e.op)
                else:
                    sel = slice(None) if e.done else e.landed
                    out.over({e.op.src: e.src_before, name: buf}).apply_copy(e.op.src, name, e.c, sel)
            out.compact[name] = buf
        return out
