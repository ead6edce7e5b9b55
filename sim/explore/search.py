"""Enumerating the orders of a race model: with partial-order reduction, and without.

**With reduction** (:func:`traces`): the unknowns are the conflict pairs' orders (see
``sim.explore.model``).  A depth-first search keeps the transitive closure of
happens-before, the copies' block chains and the orders chosen so far (one bitset of
descendants and one of ancestors per node); at each step it takes the first conflict pair
the closure leaves unordered and tries both orders.  Adding an edge between two unordered
nodes of a DAG never closes a cycle, so both branches always lead to complete orders: the
search tree is binary with one leaf per Mazurkiewicz trace (a distinct order of the
conflict pairs) and fewer than twice as many nodes as leaves.  The cost therefore grows
with the traces (the races and how finely their copies are cut), not with the ops: an op
that races nothing adds no branch.

**Without reduction** (:func:`linearizations`): every interleaving of the nodes that
happens-before and the chains allow, one node at a time (what a naive explorer of the
same model would run); equivalent orders are visited again and again.  It exists to be
measured against and to check the reduction (same outcomes).

:func:`linearize` turns a complete order of the conflict pairs into one sequence of nodes
(a topological order, ties by issue order), which is what evaluation and witnesses take.
"""
from __future__ import annotations

import heapq
from typing import Iterator

from sim.explore.model import RaceModel

__all__ = ["Trace", "linearize", "linearizations", "orientation_of", "traces"]


class Trace(tuple):
    """A complete order of a model's conflict pairs: ``trace[j]`` is True when
    ``pairs[j] = (u, v)`` runs ``u`` before ``v``."""


def _bits(x: int):
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def _closure(model: RaceModel) -> tuple[list[int], list[int]]:
    """Descendant and ancestor bitsets of happens-before plus chains (no conflict orders yet)."""
    n = len(model.nodes)
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in model.hb_edges:
        succ[a].append(b)
    for ids in model.op_nodes.values():
        for a, b in zip(ids[:-1], ids[1:]):
            succ[a].append(b)
    desc = [0] * n
    # nodes are in issue order and every edge points forward (issue order is a topological
    # order of happens-before; a chain is consecutive): sweep backwards
    for u in range(n - 1, -1, -1):
        d = 0
        for v in succ[u]:
            d |= desc[v] | (1 << v)
        desc[u] = d
    anc = [0] * n
    for u in range(n):
        for v in _bits(desc[u]):
            anc[v] |= 1 << u
    return desc, anc


def _add_edge(desc: list[int], anc: list[int], u: int, v: int) -> None:
    """Close ``u -> v`` into the bitsets (in place)."""
    down = desc[v] | (1 << v)
    up = anc[u] | (1 << u)
    for w in _bits(up):
        desc[w] |= down
    for w in _bits(down):
        anc[w] |= up


def traces(model: RaceModel, max_orders: int | None = None) -> Iterator[Trace]:
    """Every complete order of the conflict pairs, once each (see the module doc); stops
    after ``max_orders``."""
    pairs = model.pairs
    desc0, anc0 = _closure(model)
    count = 0
    # explicit stack: (desc, anc, next pair to look at)
    stack = [(desc0, anc0, 0)]
    while stack:
        desc, anc, j = stack.pop()
        while j < len(pairs):
            u, v = pairs[j]
            if not ((desc[u] >> v) & 1 or (desc[v] >> u) & 1):
                break
            j += 1
        if j == len(pairs):
            yield Trace(bool((desc[u] >> v) & 1) for u, v in pairs)
            count += 1
            if max_orders is not None and count >= max_orders:
                return
            continue
        u, v = pairs[j]
        d2, a2 = list(desc), list(anc)
        _add_edge(d2, a2, v, u)
        stack.append((d2, a2, j + 1))        # v before u: explored second
        _add_edge(desc, anc, u, v)
        stack.append((desc, anc, j + 1))     # u before v: explored first


def _base_graph(model: RaceModel):
    n = len(model.nodes)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    edges = list(model.hb_edges)
    for ids in model.op_nodes.values():
        edges.extend(zip(ids[:-1], ids[1:]))
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    return succ, indeg


def linearize(model: RaceModel, trace: Trace) -> list[int]:
    """One sequence of every node that respects happens-before, the chains and ``trace``
    (Kahn's algorithm, ready nodes by issue order)."""
    succ, indeg = _base_graph(model)
    succ = [list(x) for x in succ]
    for (u, v), fwd in zip(model.pairs, trace):
        a, b = (u, v) if fwd else (v, u)
        succ[a].append(b)
        indeg[b] += 1
    ready = [u for u, d in enumerate(indeg) if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        u = heapq.heappop(ready)
        out.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, v)
    if len(out) != len(indeg):
        raise AssertionError("the conflict orders closed a cycle")   # traces() never yields one
    return out


def orientation_of(model: RaceModel, order: list[int]) -> Trace:
    """The trace of a sequence of nodes: which side of each conflict pair runs first."""
    pos = {u: k for k, u in enumerate(order)}
    return Trace(pos[u] < pos[v] for u, v in model.pairs)


def linearizations(model: RaceModel, max_orders: int | None = None) -> Iterator[list[int]]:
    """Every sequence of the nodes that happens-before and the chains allow (no reduction);
    stops after ``max_orders``."""
    succ, indeg = _base_graph(model)
    n = len(indeg)
    order: list[int] = []
    count = 0
    ready = sorted(u for u in range(n) if indeg[u] == 0)
    # iterative DFS over (ready set, index of the next choice)
    stack = [(ready, 0)]
    while stack:
        ready, k = stack[-1]
        if len(order) == n:
            yield list(order)
            count += 1
            if max_orders is not None and count >= max_orders:
                return
            stack.pop()
            if order:
                _undo(order, succ, indeg)
            continue
        if k == len(ready):
            stack.pop()
            if order:
                _undo(order, succ, indeg)
            continue
        stack[-1] = (ready, k + 1)
        u = ready[k]
        order.append(u)
        nxt = [x for x in ready if x != u]
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                nxt.append(v)
        stack.append((sorted(nxt), 0))


def _undo(order: list[int], succ, indeg) -> None:
    u = order.pop()
    for v in succ[u]:
        indeg[v] += 1
