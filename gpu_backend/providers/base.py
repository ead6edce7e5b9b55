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
from sim.transfers.routines import item_bounds, plan, slice_items

ROUTINE_NAMES = ("kernel_per_layer", "kernel_all_layer", "direct_per_layer",
                 "dsa_indexer_per_layer", "dsv4_token", "token_bytewise",
                 "direct_page_first", "staged_all_layer_lf_pf")
#: page routines: item = one page_size group of indices, only its first index counts
PAGE_ROUTINES = ("direct_page_first", "staged_all_layer_lf_pf")
#: ``_WRITE_BACK_STAGING_PAGE_CHUNK`` in SGLang's memory_pool_host.py: pages per staging chunk
STAGING_PAGE_CHUNK = 64
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
    if routine in ("kernel_per_layer", "direct_per_layer", "dsa_indexer_per_layer", "token_bytewise",
                   "direct_page_first"):
        return [int(args["layer"])]
    if args.get("layers") is not None:
        return [int(x) for x in args["layers"]]
    if routine == "staged_all_layer_lf_pf":
        return list(range(src_layout.layers))
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


def simulator_refusal(routine: str, src_layout, dst_layout, args: Mapping) -> str:
    """For the page routines: the simulator's own refusal of this copy (``routines.plan``'s
    InputError message), or "".  A provider never runs a page copy the model cannot describe;
    the older routines keep their own provider rules."""
    if routine not in PAGE_ROUTINES:
        return ""
    try:
        plan(routine, src_layout, dst_layout, args)
    except InputError as e:
        return f"the simulator refuses this {routine} copy: {e}"
    return ""


def page_rows(p: LayoutParams, first: np.ndarray, page_size: int, is_host: bool) -> np.ndarray:
    """``(pages, page_size)`` unit indices a page copy touches on one side.

    ``direct_page_first``: on a host side the first index names page ``first // page_size`` (rows
    ``page * page_size + t``, as sgl-kernel's ``select(0, index / page_size)``); on a device side
    it is the first row (rows ``first + t``).  ``staged_all_layer_lf_pf`` uses ``first + t`` on
    both sides (``is_host=False``): the relayout kernel adds the token offset to the first index,
    the page memcpy starts at the host token ``first``.
    """
    first = np.asarray(first, dtype=np.int64)
    t = np.arange(page_size, dtype=np.int64)
    start = (first // page_size) * page_size if is_host else first
    return start[:, None] + t[None, :]


def page_pieces(routine: str, src_layout, dst_layout, args: Mapping) -> list[np.ndarray]:
    """The byte pieces of a page routine, page by page: element ``p`` is an ``(n, 3)`` int64
    array of ``(src_offset, dst_offset, nbytes)`` for page ``p``, in the routine's byte order
    (``direct_page_first``: the page's rows; ``staged_all_layer_lf_pf``: token-major,
    layer-minor, the order of a page_first host page), merged where contiguous on both sides
    inside the page (never across pages: one memcpy per page).  Computed from the layout
    parameters with the builtin kernels' address rule, not from the simulator's extents."""
    if routine not in PAGE_ROUTINES:
        raise ProviderError(f"page_pieces: expected one of {list(PAGE_ROUTINES)}, got {routine!r}")
    sp, dp = layout_params(src_layout), layout_params(dst_layout)
    s, d = index_pair(args)
    ps = int(args["page_size"])
    if ps <= 0 or s.size % ps:
        raise ProviderError(f"{routine}: {s.size} indices are not whole pages of page_size {ps}")
    sf, df = s[::ps], d[::ps]
    if routine == "direct_page_first":
        rs = page_rows(sp, sf, ps, src_layout.kind == "host")
        rd = page_rows(dp, df, ps, dst_layout.kind == "host")
        layer = int(args["layer"])
        so = unit_offsets(sp, layer, rs)
        do = unit_offsets(dp, layer, rd)
        ln = np.full(so.shape, sp.unit_bytes, dtype=np.int64)
    else:
        rs, rd = page_rows(sp, sf, ps, False), page_rows(dp, df, ps, False)
        layers = np.arange(sp.layers, dtype=np.int64)
        # (pages, tokens, layers): token-major, layer-minor
        so = np.stack([unit_offsets(sp, int(L), rs) for L in layers], axis=-1).reshape(sf.size, -1)
        do = np.stack([unit_offsets(dp, int(L), rd) for L in layers], axis=-1).reshape(sf.size, -1)
        ib = int(args["item_bytes"]) if args.get("item_bytes") is not None else sp.unit_bytes
        ln = np.full(so.shape, ib, dtype=np.int64)
    return [merge_rows(so[k], do[k], ln[k]) for k in range(sf.size)]


def merge_rows(so: np.ndarray, do: np.ndarray, ln: np.ndarray) -> np.ndarray:
    """``(n, 3)`` rows ``(src, dst, nbytes)``, neighbours merged where contiguous on both sides."""
    if so.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    cont = np.zeros(so.size, dtype=bool)
    cont[1:] = (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
    start = np.flatnonzero(~cont)
    return np.stack([so[start], do[start], np.add.reduceat(ln, start)], axis=1).astype(np.int64)


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
