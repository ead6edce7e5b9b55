"""Happens-before over a schedule's ops, and the latent races it leaves.

Edges (never timing): consecutive ops of one stream; a ``record`` to every
``wait`` bound to it; a ``host_sync``'s targets to the ``host_sync``; a
``host_sync`` to every op issued after it.  Issue order is a topological order
of these edges, so vector clocks are computed in one pass: ``clock[op][s]`` is
the number of ops of stream ``s`` that happen before or at ``op``.
``hb_graph`` builds the same relation as a networkx DiGraph, for explanation
(``networkx.shortest_path`` gives the chain that orders two ops) and for the
differential test that keeps the two equal.

A latent race: two ops whose byte accesses overlap on one buffer, at least one
a write, with no happens-before path either way.  A copy reads its source
extents and writes its destination extents (clipped to the buffers: bytes past
the end are out-of-bounds writes, reported separately).
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from sim.memory import clip_extents
from sim.schedule import Schedule


class HappensBefore:
    def __init__(self, schedule: Schedule):
        self.s = schedule
        names = list(schedule.streams)
        self.stream_idx = {n: i for i, n in enumerate(names)}
        n_ops, n_streams = len(schedule.ops), len(names)
        self.clock = np.zeros((n_ops, n_streams), dtype=np.int64)
        self.pos = np.zeros(n_ops, dtype=np.int64)        # 1-based position on its stream
        host = np.zeros(n_streams, dtype=np.int64)          # clock of the last host_sync
        last: dict[str, int] = {}
        count = np.zeros(n_streams, dtype=np.int64)
        for op in schedule.ops:
            i = op.index
            if op.stream is not None:
                si = self.stream_idx[op.stream]
                c = host.copy()
                if op.stream in last:
                    c = np.maximum(c, self.clock[last[op.stream]])
                if op.op == "wait":
                    c = np.maximum(c, self.clock[op.bound_record])
                count[si] += 1
                c[si] = count[si]
                self.clock[i] = c
                self.pos[i] = count[si]
                last[op.stream] = i
            elif op.op == "host_sync":
                for t in op.sync_targets:
                    host = np.maximum(host, self.clock[t])
                self.clock[i] = host
            else:  # host_delay orders nothing
                self.clock[i] = host

    def ordered(self, a: int, b: int) -> bool:
        """True if op a happens before op b (both stream ops)."""
        op = self.s.ops[a]
        return op.stream is not None and self.clock[b][self.stream_idx[op.stream]] >= self.pos[a]

    def concurrent(self, a: int, b: int) -> bool:
        return not self.ordered(a, b) and not self.ordered(b, a)


def hb_graph(schedule: Schedule) -> nx.DiGraph:
    """Happens-before as an explicit graph (nodes are op indices)."""
    g = nx.DiGraph()
    last: dict[str, int] = {}
    last_sync = None
    for op in schedule.ops:
        g.add_node(op.index, id=op.id, op=op.op, stream=op.stream)
        if op.stream is not None:
            if op.stream in last:
                g.add_edge(last[op.stream], op.index, why="stream order")
            if op.op == "wait":
                g.add_edge(op.bound_record, op.index, why="record -> wait")
            if last_sync is not None:
                g.add_edge(last_sync, op.index, why="issued after host_sync")
            last[op.stream] = op.index
        elif op.op == "host_sync":
            for t in op.sync_targets:
                g.add_edge(t, op.index, why="host_sync target")
            if last_sync is not None:
                g.add_edge(last_sync, op.index, why="host order")
            last_sync = op.index
    return g


@dataclass
class Access:
    op: int
    buffer: str
    write: bool
    starts: np.ndarray      # merged, sorted, disjoint
    ends: np.ndarray


def _merge(starts, lengths):
    starts = np.asarray(starts, np.int64)
    ends = starts + np.asarray(lengths, np.int64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    run_end = np.maximum.accumulate(ends)
    new = np.r_[True, starts[1:] > run_end[:-1]]
    idx = np.flatnonzero(new)
    return starts[idx], np.maximum.reduceat(run_end, idx)


def accesses(schedule: Schedule) -> list[Access]:
    out = []
    for op in schedule.ops:
        if op.op == "copy":
            src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
            c = clip_extents(op.plan.extents, src.nbytes, dst.nbytes)
            out.append(Access(op.index, op.src, False, *_merge(c.src, np.minimum(c.length, c.fill_start))))
            out.append(Access(op.index, op.dst, True, *_merge(c.dst, c.fill_end)))
        elif op.op in ("read", "write"):
            out.append(Access(op.index, op.buffer, op.op == "write", *_merge(*op.extents)))
    return out


def intersect(a: Access, b: Access):
    """Intersection of two merged interval sets: (starts, ends)."""
    lo = np.searchsorted(b.ends, a.starts, side="right")
    hi = np.searchsorted(b.starts, a.ends, side="left")
    counts = np.maximum(hi - lo, 0)
    if counts.sum() == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ai = np.repeat(np.arange(a.starts.size), counts)
    bj = np.concatenate([np.arange(l, h) for l, h in zip(lo[counts > 0], hi[counts > 0])])
    s = np.maximum(a.starts[ai], b.starts[bj])
    e = np.minimum(a.ends[ai], b.ends[bj])
    keep = e > s
    return s[keep], e[keep]


def latent_races(schedule: Schedule, hb: HappensBefore | None = None) -> list[dict]:
    """Every unordered pair of conflicting accesses, one entry per (op pair, buffer)."""
    hb = hb or HappensBefore(schedule)
    by_buffer: dict[str, list[Access]] = {}
    for acc in accesses(schedule):
        if acc.starts.size:
            by_buffer.setdefault(acc.buffer, []).append(acc)
    races = []
    for buf, accs in by_buffer.items():
        for i in range(len(accs)):
            for j in range(i + 1, len(accs)):
                a, b = accs[i], accs[j]
                if a.op == b.op or not (a.write or b.write) or not hb.concurrent(a.op, b.op):
                    continue
                s, e = intersect(a, b)
                if s.size == 0:
                    continue
                races.append({"buffer": buf, "a": a, "b": b, "starts": s, "ends": e,
                              "bytes": int((e - s).sum())})
    return races
