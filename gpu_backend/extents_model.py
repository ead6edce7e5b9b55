"""The numpy model of a copy: apply a plan's extents to byte arrays.

Used to check a GPU copy byte for byte: the same input bytes, the simulator's extents
(``sim.transfers.routines.plan``) applied here, against what the provider wrote.  Arrays may
include guard regions (``pad`` bytes before the logical start), so an out-of-bounds extent is
modelled too, exactly where a guarded buffer would take it.
"""
from __future__ import annotations

import numpy as np


def apply_extents(src: np.ndarray, dst: np.ndarray, extents, item_range=None, *,
                  src_pad: int = 0, dst_pad: int = 0) -> np.ndarray:
    """A copy of ``dst`` after copying every extent (of items ``a..b-1`` when ``item_range``).

    Offsets are logical; ``src_pad``/``dst_pad`` say where logical byte 0 sits in the arrays.
    Reads all come from ``src`` as given (src and dst are distinct buffers).  Raises ValueError
    when an extent leaves the arrays, naming it.
    """
    out = dst.copy()
    sel = np.ones(len(extents), dtype=bool)
    if item_range is not None:
        a, b = item_range
        sel = (extents.item >= a) & (extents.item < b)
    for k in np.flatnonzero(sel):
        so, do, n = int(extents.src[k]) + src_pad, int(extents.dst[k]) + dst_pad, int(extents.length[k])
        if so < 0 or so + n > src.size or do < 0 or do + n > dst.size:
            raise ValueError(f"extent {k} (item {int(extents.item[k])}: src {so - src_pad}, dst "
                             f"{do - dst_pad}, {n} bytes) leaves the modelled arrays (src {src.size} B "
                             f"with {src_pad} before, dst {dst.size} B with {dst_pad} before); "
                             "expected larger guards")
        out[do:do + n] = src[so:so + n]
    return out


def oob_dst_bytes(extents, dst_nbytes: int, item_range=None) -> tuple[int, int]:
    """(bytes before the start, bytes past the end) the extents write outside ``[0, dst_nbytes)``,
    each byte counted once."""
    sel = np.ones(len(extents), dtype=bool)
    if item_range is not None:
        a, b = item_range
        sel = (extents.item >= a) & (extents.item < b)
    before: set[int] = set()
    after: set[int] = set()
    for k in np.flatnonzero(sel):
        o, n = int(extents.dst[k]), int(extents.length[k])
        if o < 0:
            before.update(range(o, min(o + n, 0)))
        if o + n > dst_nbytes:
            after.update(range(max(o, dst_nbytes), o + n))
    return len(before), len(after)
