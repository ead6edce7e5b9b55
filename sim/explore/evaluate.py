"""What an order of a race model leaves: every read's bytes and every buffer's final bytes.

An order (a sequence of the model's nodes) is applied to a fresh
:class:`~sim.memory.Memory` with the executor's own functions (``apply_copy`` for a copy's
node, ``write_units`` for a write; a read captures views of its bytes), so the bytes are
exactly what the executor would hold had the same steps landed in that order.

An **outcome** is what the order leaves, compared by provenance: each read's
``sim.verdicts.read_digest`` (its bytes as (origin, unit, offset) runs) and each buffer's
provenance digest (``CompactBuffer.provenance_digest``: equal provenance, equal bytes).
Two orders with one outcome are one outcome whatever their traces.  Each read is judged
against the happens-before-order execution (``run_reference``) by
``sim.verdicts.read_entry``: ``ok``, ``stale``, ``torn`` (or ``indeterminate`` where an
intra-launch race leaves bytes undetermined, as the verdicts say), so the statuses are the
verdicts' own.
"""
from __future__ import annotations

import copy as _copy
import hashlib
from dataclasses import dataclass

import numpy as np

from sim.executor import ReadCapture, run_reference
from sim.bytes.compact import CompactBuffer
from sim.explore.model import RaceModel
from sim.hb import indeterminate_read_bytes
from sim.memory import Memory
from sim.verdicts import read_digest, read_entry

__all__ = ["Evaluation", "Evaluator", "outcome_key"]


@dataclass
class Evaluation:
    """One evaluated order: its memory at the end, its reads (in order of their ops) and
    its outcome key."""

    memory: Memory
    reads: list[ReadCapture]
    key: tuple


def outcome_key(reads, memory: Memory) -> tuple:
    """(read digests by read op index, buffer provenance digests by name): equal for two
    executions that leave the same bytes everywhere it looks."""
    r = tuple(sorted((c.index, read_digest(c)) for c in reads))
    b = tuple((name, memory.compact[name].provenance_digest()) for name in sorted(memory.compact))
    return r, b


def key_id(key: tuple) -> str:
    """A short stable name of an outcome key (12 hex digits of its sha256)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:12]


class Evaluator:
    """Applies orders of one model; holds the reference (happens-before order) run."""

    def __init__(self, model: RaceModel):
        self.model = model
        s = model.schedule
        self.s = s
        self.reference = run_reference(s, materialise=False)
        # NOTE: every memory shares the reference's origin table, so provenance compares by
        # origin id (the verdicts' fast path), not by hashing origins
        self.table = self.reference.memory.table
        self.ref_reads = {r.op_id: r for r in self.reference.reads}
        self.indeterminate = indeterminate_read_bytes(s)
        # the prefix: nodes that neither race nor come after a racing node.  Every order
        # applies them first (they are closed downwards, and their order against the racing
        # nodes changes no byte), so their memory and reads are computed once.
        self.prefix = _prefix(model)
        # buffers whose bytes can depend on the order: those a racing op writes, and those a
        # copy fills from such a buffer (transitively).  Every writer of another buffer is
        # ordered by happens-before against everything touching its bytes and copies from
        # buffers of the same kind, so its bytes, and the reads of them, are the reference's
        # in every order: they are taken from the reference instead of being read again.
        self.tainted = _tainted(model)
        ref_table_digest = {r.index: read_digest(r) for r in self.reference.reads}
        self._fixed_reads = {r.index: (r, ref_table_digest[r.index]) for r in self.reference.reads
                             if r.buffer not in self.tainted}
        self._fixed_buffers = {name: self.reference.memory.compact[name].provenance_digest()
                               for name in s.buffers if name not in self.tainted}
        # ... and an op writing such a buffer that no copy into an order-dependent buffer reads
        # (directly or through other copies) changes nothing an order is judged by: after the
        # prefix it is not applied again
        needed = _copy_closure(s, self.tainted, upstream=True)   # and every buffer feeding a needed one
        dead = set(s.buffers) - needed
        self._skip = {n.id for n in model.nodes
                      if (s.ops[n.op].dst if s.ops[n.op].op == "copy" else
                          s.ops[n.op].buffer if s.ops[n.op].op == "write" else None) in dead}
        self._after_prefix, self._prefix_reads = self._apply(Memory(s.buffers, materialise=False, table=self.table),
                                                             self.prefix, [])

    def _fork(self, mem: Memory) -> Memory:
        """A compact-only copy of ``mem`` sharing its specs, arena and origin table."""
        # NOTE: cheaper than re-applying every init fill and prefix node; the buffers are
        # rebuilt from their segments (CompactBuffer has no copy(); _from_segments is its
        # constructor from segment arrays, and segments() returns copies)
        new = _copy.copy(mem)
        new.material = None
        new.compact = {name: CompactBuffer._from_segments(buf.nbytes, buf.table, *buf.segments())
                       for name, buf in mem.compact.items()}
        return new

    def _apply(self, mem: Memory, order, reads: list) -> tuple[Memory, list]:
        s, nodes = self.s, self.model.nodes
        for nid in order:
            node = nodes[nid]
            op = s.ops[node.op]
            if op.op == "copy":
                mem.apply_copy(op.src, op.dst, node.clipped)
            elif op.op == "write":
                mem.apply_write(op)
            elif op.index in self._fixed_reads:
                reads.append(self._fixed_reads[op.index][0])
            else:
                offs, lens = op.extents
                views = [mem.view(op.buffer, int(o), int(n)) for o, n in zip(offs, lens)]
                reads.append(ReadCapture(op.id, op.index, op.stream, op.buffer, float(len(reads)), offs, lens,
                                         views))
        return mem, reads

    def run(self, order: list[int], materialise: bool = False) -> Evaluation:
        """Apply the nodes of ``order`` (node ids, a sequence of every node) one after the
        other; ``materialise`` also keeps real bytes (from scratch, no shared prefix).  Without
        it, the memory of a buffer no racing op can reach is not kept current (its reads and
        digest are the reference's)."""
        if materialise:
            mem, reads = self._apply(Memory(self.s.buffers, materialise=True, table=self.table), order, [])
        else:
            done = set(self.prefix) | self._skip
            rest = [u for u in order if u not in done]
            mem, reads = self._apply(self._fork(self._after_prefix), rest, list(self._prefix_reads))
        reads.sort(key=lambda r: r.index)
        return Evaluation(mem, reads, self._key(reads, mem))

    def _key(self, reads, memory: Memory) -> tuple:
        """``outcome_key``, with the order-independent reads' and buffers' digests cached."""
        fixed = self._fixed_reads
        r = tuple((c.index, fixed[c.index][1] if c.index in fixed else read_digest(c)) for c in reads)
        b = tuple((name, self._fixed_buffers.get(name) or memory.compact[name].provenance_digest())
                  for name in sorted(memory.compact))
        return r, b

    def judge(self, ev: Evaluation) -> list[dict]:
        """Each read's verdict entry (``sim.verdicts.read_entry``) against the reference."""
        out = []
        for r in ev.reads:
            fixed = self._fixed_reads.get(r.index)
            if fixed is not None and fixed[0] is r and len(fixed) == 3:
                out.append(dict(fixed[2]))          # the same entry in every order
                continue
            e = read_entry(r, self.ref_reads[r.op_id], self.s.buffers[r.buffer].layout,
                           self.indeterminate.get(r.index), detail=False)
            e.pop("time_us", None)
            e.pop("copies_in_flight", None)
            if fixed is not None and fixed[0] is r:
                self._fixed_reads[r.index] = (*fixed, e)
            out.append(e)
        return out

    def buffers_differing(self, ev: Evaluation) -> list[str]:
        """Buffers whose final provenance differs from the happens-before order's."""
        if not hasattr(self, "_ref_digests"):
            self._ref_digests = outcome_key([], self.reference.memory)[1]
        return [name for (name, d), (_, r) in zip(ev.key[1], self._ref_digests) if d != r]

    @staticmethod
    def digests(ev: Evaluation) -> dict[str, str]:
        """Final buffer digests by provenance (``"provenance:" + CompactBuffer.provenance_digest``,
        the form ``Memory.digest`` gives large buffers): equal provenance, equal bytes.  The byte
        sha256 of a witness is what ``kvrace schedule run --json`` on it reports."""
        return {name: "provenance:" + digest for name, digest in ev.key[1]}


def _tainted(model: RaceModel) -> set[str]:
    """Buffers a racing op writes, closed over copies from them."""
    s = model.schedule
    out = set()
    for i in model.racing_ops:
        op = s.ops[i]
        if op.op == "copy":
            out.add(op.dst)
        elif op.op == "write":
            out.add(op.buffer)
    return _copy_closure(s, out, upstream=False)


def _copy_closure(s, start, *, upstream: bool) -> set[str]:
    """``start`` closed over the schedule's copies: every buffer a chain of copies carries bytes
    from into ``start`` (``upstream``), or from ``start`` into (downstream)."""
    out = set(start)
    edges = [(op.dst, op.src) if upstream else (op.src, op.dst) for op in s.ops if op.op == "copy"]
    grew = True
    while grew:
        grew = False
        for a, b in edges:
            if a in out and b not in out:
                out.add(b)
                grew = True
    return out


def _prefix(model: RaceModel) -> list[int]:
    """Nodes (in issue order) that are not of a racing op and have no racing node before them."""
    racing = set(model.racing_ops)
    tainted = [model.nodes[u].op in racing for u in range(len(model.nodes))]
    succ: list[list[int]] = [[] for _ in model.nodes]
    for a, b in model.hb_edges:
        succ[a].append(b)
    for ids in model.op_nodes.values():
        for a, b in zip(ids[:-1], ids[1:]):
            succ[a].append(b)
    for u in range(len(model.nodes)):          # edges point forward: one sweep
        if tainted[u]:
            for v in succ[u]:
                tainted[v] = True
    return [u for u in range(len(model.nodes)) if not tainted[u]]


def read_bytes(ev: Evaluation) -> dict[str, np.ndarray]:
    """Each read's bytes (materialised)."""
    return {r.op_id: r.bytes() for r in ev.reads}
