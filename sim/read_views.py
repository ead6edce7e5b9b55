"""A read's views, sliced from a snapshot of its buffer on first use.

The executor captures every read's views (``ReadCapture.views``: one ``memory.View`` per
extent) at the instant the read touches its bytes.  Slicing them (``CompactBuffer.slices``)
costs about one small buffer per extent, and a streamed run's common reader does not look at
them: a fresh read is not compared (``OnlineVerdicts.captured``), and the engine's KV oracle
reads the buffer itself unless a copy item mid-flight lies in the read (``ReadCapture.torn``).
:class:`LazyViews` keeps instead an O(blocks) clone of the buffer's compact model at the
capture instant (``CompactBuffer.clone``: it shares the block arrays, which no write modifies
in place) and slices it the first time anything looks at the views, so they are exactly the
views the capture instant gives, whenever they are built.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sim.bytes.compact import CompactBuffer
from sim.memory import View

__all__ = ["LazyViews"]


def _ints(a) -> list:
    return a.tolist() if isinstance(a, np.ndarray) else [int(x) for x in a]


class LazyViews(Sequence):
    """``Memory.views(name, offsets, lengths)`` of a compact-only Memory, as a sequence built
    on first use from ``buffer``, a snapshot (``CompactBuffer.clone``) of buffer ``name`` at
    the capture instant that nothing else writes.

    ``len()`` is the number of extents without building; indexing, iteration (so ``zip``,
    ``sorted``, ...) build the views once and keep them (the snapshot is then dropped), so
    every use sees the same ``View`` objects.  Materialised memories and reads with a copy
    item mid-flight in their buffer keep eager views (the executor decides: ``Executor._capture``)."""

    __slots__ = ("_buffer", "_offsets", "_lengths", "_views")

    def __init__(self, buffer: CompactBuffer, offsets: np.ndarray, lengths: np.ndarray):
        self._buffer = buffer
        self._offsets = offsets
        self._lengths = lengths
        self._views: list | None = None

    @property
    def built(self) -> bool:
        """Whether the views have been sliced."""
        return self._views is not None

    def _build(self) -> list:
        views = self._views
        if views is None:
            offs, lens = _ints(self._offsets), _ints(self._lengths)
            # NOTE: CompactBuffer.slices of one range slices it alone (CompactBuffer.slice): the
            # same view Memory.view gives a single-extent read
            views = self._views = [View(c, None, o)
                                   for c, o in zip(self._buffer.slices(offs, lens), offs)]
            self._buffer = None
        return views

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i):
        return self._build()[i]

    def __iter__(self):
        return iter(self._build())

    def __repr__(self) -> str:
        state = "built" if self._views is not None else "not built"
        return f"LazyViews({len(self)} extents, {state})"
