"""Array helpers the simulator shares (numpy only): one home for each.

:func:`unique_sorted` is ``np.unique`` of a 1-d array without numpy 2.4's slow hash path; the
byte model, the verdicts, the allocator, the cache session and the engine take the distinct
values of their slot, page and block sets through it.  :func:`plain_ints` is the fast test of
an index list's element types that input validation runs before its per-element loop.
"""
from __future__ import annotations

import numpy as np

__all__ = ["plain_ints", "unique_sorted"]

_INT_ONLY = frozenset({int})


def unique_sorted(a) -> np.ndarray:
    """``np.unique(a)`` of a 1-d array (sorted distinct values), by one sort.

    NOTE: ``np.unique``'s plain path (no ``return_*``) is a hash table in numpy 2.4, about 1 us
    an element: 250 ms for 300k int64 slots, where the sort takes 6 ms (numpy 2.4.6, this
    project's VM); a forward's slots of every request go through here.  It also imports
    ``numpy.ma`` on its first call (about 0.08 CPU s once per process)."""
    a = np.sort(np.asarray(a).reshape(-1))
    keep = np.empty(a.size, bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def plain_ints(seq) -> bool:
    """True when every element of ``seq`` (any iterable; True when empty) is exactly an
    ``int``: no bool, no other integer or number type.  Validation takes its vectorised path
    then, and its per-element loop (which names the bad element) otherwise.

    NOTE: the types are collected by a C loop (``set(map(type, seq))``), about 15 ns an element;
    ``all(type(x) is int for x in seq)`` runs a Python generator, several times that: 2-3 % of
    an engine run, over its copies' index lists."""
    return set(map(type, seq)) <= _INT_ONLY
