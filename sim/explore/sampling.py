"""Sampling orders when exhaustive exploration is too big: PCT, and the timing model's own runs.

**PCT** (probabilistic concurrency testing; Burckhardt, Kothari, Musuvathi, Nagarakatte,
ASPLOS 2010): each op of the race model is a thread (``n`` threads: the copies, reads and
writes) whose steps are its nodes (``k`` steps in all: a racing copy's blocks, one step for
every other op).  A run gives the threads random distinct priorities ``d .. d+n-1``, picks
``d - 1`` change points among the steps ``1 .. k``, and at every step runs one step of the
highest-priority thread whose happens-before predecessors have completed; when the ``i``-th
change point is reached, the running thread's priority drops to ``i`` (below every initial
one).  A bug of depth ``d`` (``d`` ordering constraints between steps that make it
manifest) is found by one run with probability at least ``1 / (n * k**(d-1))`` (the
paper's Theorem), whatever the schedule; ``n`` runs' chance of missing it is at most
``(1 - p)**runs``.

**Random** (:func:`timing_order`): the schedule runs on the executor with seeded jitter,
seeded tie-breaks and torn items, one seed per run, so the outcome frequencies estimate how
often each outcome happens under the timing model (its probabilities, not a guarantee).
"""
from __future__ import annotations

import numpy as np

from sim.explore.model import RaceModel

__all__ = ["pct_bound", "pct_order"]


def pct_bound(n: int, k: int, depth: int) -> float:
    """PCT's lower bound on the probability that one run finds a bug of depth ``depth``."""
    return 1.0 / (max(1, n) * max(1, k) ** max(0, depth - 1))


def pct_order(model: RaceModel, depth: int, rng: np.random.Generator) -> list[int]:
    """One PCT run over the model's nodes (see the module doc): the sequence of node ids."""
    nodes = model.nodes
    ops = sorted(model.op_nodes)
    n, k = len(ops), len(nodes)
    prio = {op: depth + int(p) for op, p in zip(ops, rng.permutation(n))}
    change = {}
    if depth > 1 and k > 0:
        steps = rng.choice(np.arange(1, k + 1), size=min(depth - 1, k), replace=False)
        change = {int(st): i + 1 for i, st in enumerate(steps)}
    preds: dict[int, set] = {op: set() for op in ops}      # byte ops that must finish first
    for a, b in model.hb_edges:
        preds[nodes[b].op].add(nodes[a].op)
    succs: dict[int, list] = {op: [] for op in ops}
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    waiting = {op: len(preds[op]) for op in ops}
    next_block = {op: 0 for op in ops}
    enabled = {op for op in ops if waiting[op] == 0}
    order = []
    step = 0
    while enabled:
        step += 1
        t = max(enabled, key=lambda o: prio[o])
        if step in change:
            prio[t] = change[step]
            t = max(enabled, key=lambda o: prio[o])
        ids = model.op_nodes[t]
        order.append(ids[next_block[t]])
        next_block[t] += 1
        if next_block[t] == len(ids):
            enabled.discard(t)
            for b in succs[t]:
                waiting[b] -= 1
                if waiting[b] == 0:
                    enabled.add(b)
    if len(order) != k:
        raise AssertionError("PCT left steps unscheduled")
    return order
