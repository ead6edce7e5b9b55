"""What every kernel provider shares: the protocol, layout parameters and item slicing.

A provider runs one copy routine (``sim.transfers.routines``) between two buffers on a CUDA
stream.  ``item_range=(a, b)`` launches only items ``a..b-1`` of the routine, as the simulator
numbers them (an index pair; a page for ``dsa_indexer_per_layer``; a coalesced run for
``direct_per_layer``), so a replayer can split one copy at an item boundary and put an event
between the halves.  Splitting is done by slicing the routine's arguments (``slice_args``): the
sub-launch is the call SGLang would make with the shorter index arrays.

Everything here is plain Python and numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np

from sim.errors import InputError, KvraceError
from sim.transfers.routines import item_bounds, slice_items

ROUTINE_NAMES = ("kernel_per_layer", "kernel_all_layer", "direct_per_layer",
                 "dsa_indexer_per_layer", "dsv4_token", "token_bytewise")
INDEX_ROUTINES = ("kernel_per_layer", "kernel_all_layer", "dsa_indexer_per_layer",
                  "dsv4_token", "token_bytewise")
DSA_DEFAULT_PAGE_SIZE = 64

#: layout modes understood by the builtin kernels' address function
MODE_LAYER_MAJOR, MODE_PAGE_FIRST, MODE_PAGE_FIRST_DIRECT = 0, 1, 2


class ProviderError(KvraceError, RuntimeError):
    """A provider cannot be used or cannot run this copy; the message says why."""


class Provider(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(True, "") when it can launch here, else (False, why not)."""

    def supports(self, routine: str, src_layout, dst_layout, args: Mapping) -> tuple[bool, str]:
        """(True, "") when it can run this routine on these layouts with these arguments."""

    def launch(self, routine: str, src, dst, src_layout, dst_layout, args: Mapping,
               stream=None, item_range: tuple[int, int] | None = None) -> None:
        """Enqueue the copy on ``stream`` (a torch.cuda.Stream; None: the current stream).
        ``src``/``dst`` are :class:`gpu_backend.memory.Buffer` (or anything with ``tensor``
        and ``ptr``)."""


def torch_cuda_status() -> tuple[bool, str]:
    """Whether torch imports and sees a CUDA device (every provider needs both)."""
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not importable ({e}); expected torch with CUDA"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


def check_routine(routine: str) -> None:
    if routine not in ROUTINE_NAMES:
        raise ProviderError(f"unknown routine {routine!r}; expected one of {list(ROUTINE_NAMES)}")


# ---------------------------------------------------------------- layout parameters

@dataclass(frozen=True)
class LayoutParams:
    """The numbers an address function needs, read from a layout's own attributes (never
    from its ``unit_offsets``): ``mode`` (layer-major, page_first, page_first_direct), layer
    count, units per layer, unit bytes, host page size, entries per unit and the
    ``(offset, entry_bytes)`` of each field."""

    mode: int
    layers: int
    units: int
    unit_bytes: int
    page_size: int
    entries_per_unit: int
    fields: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.layers * self.units * self.unit_bytes


def layout_params(layout) -> LayoutParams:
    kind = getattr(layout, "kind", None)
    if kind == "paged":
        mode, units, page_size, epu = MODE_LAYER_MAJOR, layout.pages, 1, layout.entries_per_page
    elif kind == "host":
        mode = {"layer_first": MODE_LAYER_MAJOR, "page_first": MODE_PAGE_FIRST,
                "page_first_direct": MODE_PAGE_FIRST_DIRECT}.get(layout.layout)
        if mode is None:
            raise ProviderError(f"host layout {layout.name!r}: unknown layout {layout.layout!r}; "
                                "expected layer_first, page_first or page_first_direct")
        units, page_size, epu = layout.units, layout.page_size, layout.entries_per_unit
    else:
        raise ProviderError(f"expected a PagedLayout or HostLayout, got {type(layout).__name__}")
    fields = tuple((f.offset, f.entry_bytes) for f in layout.effective_fields)
    return LayoutParams(mode, layout.layers, units, layout.unit_bytes, page_size, epu, fields)


def unit_stride(p: LayoutParams) -> int | None:
    """Bytes between units i and i+1 of one layer, or None where it is not constant
    (page_first_direct with page_size > 1)."""
    if p.mode == MODE_LAYER_MAJOR:
        return p.unit_bytes
    if p.mode == MODE_PAGE_FIRST:
        return p.layers * p.unit_bytes
    return p.unit_bytes if p.page_size == 1 else None


def layer_base(p: LayoutParams, layer: int) -> int:
    """Byte offset of unit 0 of ``layer`` (the per-layer buffer pointer SGLang passes)."""
    if p.mode == MODE_LAYER_MAJOR:
        return layer * p.units * p.unit_bytes
    if p.mode == MODE_PAGE_FIRST:
        return layer * p.unit_bytes
    return layer * p.page_size * p.unit_bytes


# ---------------------------------------------------------------- arguments and items

def index_pair(args: Mapping) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(args["src_indices"], dtype=np.int64).reshape(-1)
    d = np.asarray(args["dst_indices"], dtype=np.int64).reshape(-1)
    if s.size != d.size:
        raise ProviderError(f"src_indices and dst_indices must have equal length, got {s.size} "
                            f"and {d.size}")
    return s, d


def routine_layers(routine: str, src_layout, args: Mapping) -> list[int]:
    """The layers a launch touches, in the order the kernel visits them."""
    if routine in ("kernel_per_layer", "direct_per_layer", "dsa_indexer_per_layer", "token_bytewise"):
        return [int(args["layer"])]
    if args.get("layers") is not None:
        return [int(x) for x in args["layers"]]
    return list(range(src_layout.layers)) if routine == "kernel_all_layer" else [0]


def dsa_page_size(args: Mapping) -> int:
    return int(args.get("page_size", DSA_DEFAULT_PAGE_SIZE))


def direct_run_starts(s: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Index of the first pair of each run (both indices advance by exactly one inside a run)."""
    if s.size == 0:
        return np.zeros(0, dtype=np.int64)
    brk = np.ones(s.size, dtype=bool)
    brk[1:] = ~((np.diff(s) == 1) & (np.diff(d) == 1))
    return np.flatnonzero(brk).astype(np.int64)


def n_items(routine: str, args: Mapping) -> int:
    """How many items the simulator counts for this copy."""
    check_routine(routine)
    index_pair(args)
    return int(item_bounds(routine, args).size - 1)


def slice_args(routine: str, args: Mapping, item_range: tuple[int, int] | None) -> dict:
    """The arguments of the sub-launch that copies items ``a..b-1`` only
    (``sim.transfers.routines.slice_items``, with index arrays as numpy)."""
    if item_range is None:
        return dict(args)
    check_routine(routine)
    try:
        out = slice_items(routine, args, int(item_range[0]), int(item_range[1]))
    except InputError as e:
        raise ProviderError(f"item_range {tuple(item_range)} for {routine}: {e.message}") from None
    out["src_indices"] = np.asarray(out["src_indices"], dtype=np.int64)
    out["dst_indices"] = np.asarray(out["dst_indices"], dtype=np.int64)
    return out


def direct_pieces(src_p: LayoutParams, dst_p: LayoutParams, layer: int, s: np.ndarray,
                  d: np.ndarray) -> list[tuple[int, int, int]]:
    """``(src_offset, dst_offset, nbytes)`` memcpys of a direct copy, run by run, each run cut
    where it is not contiguous on both sides.  Computed from the layout parameters with the
    builtin kernels' address rule, not from the simulator's extents."""
    so = unit_offsets(src_p, layer, s)
    do = unit_offsets(dst_p, layer, d)
    ub = src_p.unit_bytes
    pieces: list[list[int]] = []
    run_start = set(direct_run_starts(s, d).tolist())
    for k in range(s.size):
        if pieces and k not in run_start and so[k] == pieces[-1][0] + pieces[-1][2] \
                and do[k] == pieces[-1][1] + pieces[-1][2]:
            pieces[-1][2] += ub
        else:
            pieces.append([int(so[k]), int(do[k]), ub])
    return [tuple(p) for p in pieces]


def unit_offsets(p: LayoutParams, layer: int, idx: np.ndarray) -> np.ndarray:
    """Host-side twin of the kernels' ``unit_off`` (same formula, floor division)."""
    idx = np.asarray(idx, dtype=np.int64)
    ub = p.unit_bytes
    if p.mode == MODE_LAYER_MAJOR:
        return layer * p.units * ub + idx * ub
    if p.mode == MODE_PAGE_FIRST:
        return idx * p.layers * ub + layer * ub
    page, e = np.divmod(idx, p.page_size)
    return page * (p.layers * p.page_size * ub) + layer * (p.page_size * ub) + e * ub


def indices_in_range(s: np.ndarray, d: np.ndarray, src_units: int, dst_units: int,
                     skip_negative: bool) -> tuple[bool, str]:
    """Whether every (kept) index is inside its layout; the reason when not."""
    keep = (s >= 0) & (d >= 0) if skip_negative else np.ones(s.size, dtype=bool)
    for side, arr, units in (("src", s, src_units), ("dst", d, dst_units)):
        bad = arr[keep & ((arr < 0) | (arr >= units))]
        if bad.size:
            return False, (f"{side} index {int(bad[0])} is outside 0..{units - 1}: this provider "
                           "only copies in-bounds indices (use builtin or sglang to reproduce an "
                           "out-of-bounds copy)")
    return True, ""


def as_mapping(args: Any) -> Mapping:
    if not isinstance(args, Mapping):
        raise ProviderError(f"copy arguments: expected a mapping, got {type(args).__name__}")
    return args
