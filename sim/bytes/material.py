"""Materialised byte model: a buffer as real bytes (``numpy.uint8``).

Same operations and semantics as ``CompactBuffer`` (the differential tests
keep the two equal); used for small configurations and for GPU replay.
Copies gather with numpy fancy indexing over a strided "window" view whose
elements are ``length``-byte voids, so a batch of equal extents moves as one
numpy call; large extents are moved with slice assignment.
"""
from __future__ import annotations

import numpy as np

from sim.bytes.compact import (OriginTable, check_range, disjoint_in_order, extents, gather_extents,
                               move_extents, pattern_runs, resolve_later_wins, scatter_extents)
from sim.bytes.pattern import Origin
from sim.errors import InputError

_I64 = np.int64
_COPY_BATCH_BYTES = 64 << 20


def _intersect(s_off, d_off, lens) -> bool:
    """Does any source extent overlap any destination extent?"""
    order = np.argsort(s_off, kind="stable")
    s_start = s_off[order]
    reach = np.maximum.accumulate(s_start + lens[order])   # furthest end of sources so far
    last = np.searchsorted(s_start, d_off + lens, side="left") - 1
    return bool(((last >= 0) & (reach[np.maximum(last, 0)] > d_off)).any())


class MaterialBuffer:
    """A buffer of ``nbytes`` real bytes, initially ``origin``'s stream from
    ``stream_offset`` (zeros when ``origin`` is None).  ``table`` is kept for
    signature compatibility with ``CompactBuffer`` and may be None."""

    def __init__(self, nbytes: int, table: OriginTable | None = None, origin: Origin | None = None,
                 stream_offset: int = 0):
        nbytes, stream_offset = int(nbytes), int(stream_offset)
        if nbytes < 0:
            raise InputError("nbytes", f"expected nbytes >= 0, got {nbytes}")
        if stream_offset < 0:
            raise InputError("stream_offset", f"expected stream_offset >= 0, got {stream_offset}")
        self.nbytes = nbytes
        self.table = table
        if origin is None:
            self.data = np.zeros(nbytes, dtype=np.uint8)
        else:
            if table is not None:
                table.intern(origin)
            self.data = pattern_runs(origin, [stream_offset], [nbytes]) if nbytes else \
                np.zeros(0, dtype=np.uint8)

    @classmethod
    def from_bytes(cls, data, table: OriginTable | None = None) -> "MaterialBuffer":
        buf = cls(0, table)
        buf.data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1).copy()
        buf.nbytes = len(buf.data)
        return buf

    def __repr__(self) -> str:
        return f"MaterialBuffer({self.nbytes} bytes)"

    def _range(self, offset: int, nbytes: int | None, where: str):
        return check_range(self.nbytes, offset, nbytes, where)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        offset, nbytes = self._range(offset, nbytes, "read")
        return self.data[offset:offset + nbytes].copy()

    def materialise(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        offset, nbytes = self._range(offset, nbytes, "materialise")
        return self.data[offset:offset + nbytes].copy()

    def slice(self, offset: int, nbytes: int) -> "MaterialBuffer":
        return MaterialBuffer.from_bytes(self.read(offset, nbytes), self.table)

    def equals(self, other) -> bool:
        """Same bytes (``other`` a MaterialBuffer or a CompactBuffer)."""
        data = other.data if isinstance(other, MaterialBuffer) else other.materialise()
        return bool(np.array_equal(self.data, data))

    def fill(self, dst_offsets, lengths, origin: Origin, stream_offsets) -> None:
        lens, dst, soff = extents("fill", lengths, ("dst_offsets", dst_offsets, self.nbytes),
                                  ("stream_offsets", stream_offsets, np.iinfo(_I64).max))
        if not len(lens):
            return
        if self.table is not None:
            self.table.intern(origin)
        order = disjoint_in_order(dst, dst + lens)
        if order is None:
            ps, pe, owner = resolve_later_wins(dst, dst + lens)
            dst, soff, lens = ps, soff[owner] + (ps - dst[owner]), pe - ps
        scatter_extents(self.data, dst, lens, pattern_runs(origin, soff, lens))

    def fill_groups(self, dst_offsets, lengths, origins, stream_offsets) -> None:
        """``CompactBuffer.fill_groups``: one :meth:`fill` per origin's group, in group order."""
        lens, dst, soff = (np.atleast_1d(np.asarray(a, _I64)) for a in (lengths, dst_offsets, stream_offsets))
        k = len(origins)
        if not (k > 0 and lens.size % k == 0 and dst.size == lens.size == soff.size):
            raise InputError("origins", f"expected the {lens.size} extents in {k} equal groups (one per origin)")
        n = lens.size // k
        for g, origin in enumerate(origins):
            self.fill(dst[g * n:(g + 1) * n], lens[g * n:(g + 1) * n], origin, soff[g * n:(g + 1) * n])

    def copy_from(self, src: "MaterialBuffer", src_offsets, dst_offsets, lengths) -> None:
        """Copy extents of ``src``: all source bytes are read first (``src`` may
        be ``self``), then written in extent order (later extent wins)."""
        if not isinstance(src, MaterialBuffer):
            raise InputError("src", f"expected a MaterialBuffer, got {type(src).__name__}")
        lens, s_off, d_off = extents("copy_from", lengths,
                                     ("src_offsets", src_offsets, src.nbytes),
                                     ("dst_offsets", dst_offsets, self.nbytes))
        if not len(lens):
            return
        if disjoint_in_order(d_off, d_off + lens) is None:
            ps, pe, owner = resolve_later_wins(d_off, d_off + lens)
            s_off, d_off, lens = s_off[owner] + (ps - d_off[owner]), ps, pe - ps
        if np.may_share_memory(src.data, self.data) and _intersect(s_off, d_off, lens):
            flat = gather_extents(src.data, s_off, lens)   # read everything, then write
            scatter_extents(self.data, d_off, lens, flat)
            return
        ends = np.cumsum(lens)
        lo = 0
        while lo < len(lens):                              # bounded temporaries
            base = int(ends[lo - 1]) if lo else 0
            hi = max(lo + 1, int(np.searchsorted(ends, base + _COPY_BATCH_BYTES, side="right")))
            move_extents(src.data, s_off[lo:hi], self.data, d_off[lo:hi], lens[lo:hi])
            lo = hi
