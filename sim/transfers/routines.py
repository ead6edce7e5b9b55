"""Copy routines as pure extent maps.

A routine is a pure function of its arguments and the two buffers' layouts.
It yields :class:`Extents`: for every byte run it moves, the source offset,
destination offset and length, grouped into *items* (the unit one warp copies,
or one ``cudaMemcpyAsync`` run), plus the :class:`Launch` shape that decides
the order in which items land (see ``sim.transfers.timing``).

Routines and the SGLang 0.5.14 code they model (semantics read from the
source; ``reference/sglang_hicache.md`` §3.3 and §4):

* ``kernel_per_layer``: ``sgl_kernel.transfer_kv_per_layer[_mla]`` / ``_pf_lf``.
* ``kernel_all_layer``: ``transfer_kv_all_layer[_mla][_lf_pf]`` (backup D2H).
* ``direct_per_layer``: ``transfer_kv_direct`` (coalesced memcpy runs).
* ``dsa_indexer_per_layer``: ``DSAIndexerPoolHost.load_to_device_per_layer``
  (token indices -> page indices, then a page-row kernel copy).
* ``dsv4_token``: ``sglang.jit_kernel.hisparse.transfer_cache_dsv4_mla``, with
  its own fixed C4 constants, whatever buffers it is handed.
* ``token_bytewise``: the candidate fix, each token's own bytes as the layouts
  describe them.
* ``direct_page_first``: ``sgl_kernel.transfer_kv_per_layer_direct_pf_lf`` /
  ``transfer_kv_all_layer_direct_lf_pf`` (one layer): one memcpy per page of
  ``page_size`` rows between a ``page_first_direct`` host pool and a device pool.
* ``staged_all_layer_lf_pf``: ``jit_kernel.hicache.transfer_hicache_all_layer_mla_staged_lf_pf``
  (the page_first write-back SGLang 0.5.14 runs when ``can_use_write_back_jit``):
  one launch gathers whole pages into a device staging buffer, then one
  ``cudaMemcpyAsync`` per page moves the staged page to the host.

Nothing here clips: :func:`check_bounds` reports extents that leave a buffer.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from sim.arrays import plain_ints
from sim.errors import InputError, check_keys, show
from sim.pools.layouts import DSA_PAGE_SIZE, HostLayout, PagedLayout

# sgl-kernel transfer_kv_launcher defaults (CUDA): block_quota=2, 32 warps/block
BLOCK_QUOTA = 2
WARPS_PER_BLOCK = 32
WARP_SIZE = 32
#: transfer_item_warp: 32 lanes x one 8-byte ld/st per iteration
AOT_CHUNK_BYTES = WARP_SIZE * 8
#: ``TORCH_CHECK(item_size % 8 == 0, ...)`` in transfer_kv_launcher
AOT_ITEM_ALIGN = 8

# transfer_cache_dsv4_mla (jit_kernel/include/sgl_kernel/deepseek_v4/kvcacheio.cuh)
DSV4_BLOCK_THREADS = 1024
DSV4_PAGE_SIZE = 64
DSV4_VALUE_BYTES = 576
DSV4_SCALE_BYTES = 8
DSV4_PAGE_BYTES = -(-(DSV4_VALUE_BYTES + DSV4_SCALE_BYTES) * DSV4_PAGE_SIZE // 576) * 576
DSV4_SCALE_OFFSET = DSV4_VALUE_BYTES * DSV4_PAGE_SIZE
#: one transfer_item per (token, layer): a warp loads 512 B of value (2 x 32
#: lanes x 8 B), the 64 B value tail and the 8 B scale, then stores them.
DSV4_CHUNK_BYTES = DSV4_VALUE_BYTES + DSV4_SCALE_BYTES

#: HiCacheStagedWriteBackKernel: ``RuntimeCheck(kElementSize % 16 == 0, ...)``
STAGED_ITEM_ALIGN = 16
DSA_INDEXER_PAGE_ERROR = "Index buffer transfer expects page-aligned indices for DSA."


# ----------------------------------------------------------------------------
# data

@dataclass(frozen=True, eq=False)
class Extents:
    """Byte extents of one copy, int64 arrays of equal length.

    ``item[k]`` is the item (warp item / memcpy run) extent ``k`` belongs to;
    the extents of one item are contiguous and items appear in increasing
    order.  ``n_items`` counts every item, including items with no extents
    (an index pair the kernel skips because one side is negative).
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    item: np.ndarray
    n_items: int

    def __len__(self) -> int:
        return int(self.length.size)

    @functools.cached_property
    def ends(self) -> tuple[int, int]:
        """The largest end of an extent on each side, ``(max(src + length), max(dst + length))``
        as ints ((0, 0) for no extents), made once (the arrays are not modified)."""
        n = self.length
        return (int((self.src + n).max()), int((self.dst + n).max())) if n.size else (0, 0)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def item_bytes(self) -> np.ndarray:
        """Bytes each item moves (int64, length ``n_items``)."""
        return np.bincount(self.item, weights=self.length, minlength=self.n_items).astype(np.int64)

    def item_start(self) -> np.ndarray:
        """Index of each item's first extent (``len(self)`` for an empty item)."""
        return np.searchsorted(self.item, np.arange(self.n_items, dtype=np.int64), side="left")

    def offset_in_item(self) -> np.ndarray:
        """Bytes of the same item before each extent (the prefix position)."""
        if len(self) == 0:
            return np.zeros(0, dtype=np.int64)
        csum = np.cumsum(self.length) - self.length
        first = self.item_start()[self.item]
        return csum - csum[first]

    def rows(self) -> list[tuple[int, int, int, int]]:
        """``(item, src, dst, length)`` tuples, for tests and messages."""
        return [(int(i), int(s), int(d), int(n))
                for i, s, d, n in zip(self.item, self.src, self.dst, self.length)]


def _extents(src, dst, length, item, n_items: int) -> Extents:
    a = [np.ascontiguousarray(np.asarray(x, dtype=np.int64).reshape(-1))
         for x in (src, dst, length, item)]
    return Extents(*a, n_items=int(n_items))


@dataclass(frozen=True)
class Launch:
    """How the items are scheduled.

    ``kind``: ``warp_quota`` (sgl-kernel launcher: at most block_quota x
    warps_per_block warps, item ``i`` on warp ``i % warps`` in round
    ``i // warps``), ``warp_per_item`` (one warp per item, grid
    ``ceil(N/32)`` blocks of 1024 threads) or ``memcpy_runs`` (one
    ``cudaMemcpyAsync`` after another).  ``chunk_bytes``: bytes one warp
    moves per iteration (for memcpy runs: the granularity of partial progress).
    """

    kind: str
    warps: int
    chunk_bytes: int
    block_threads: int
    blocks: int = 0
    items_per_warp: int = 0

    def warp_of(self, item) -> np.ndarray:
        return np.asarray(item, dtype=np.int64) % max(self.warps, 1)

    def round_of(self, item) -> np.ndarray:
        return np.asarray(item, dtype=np.int64) // max(self.warps, 1)


@dataclass(frozen=True)
class CopyPlan:
    """A copy's extents and launch.  ``base``/``shift``: a plan derived from another layer's
    plan of the same copy (:data:`LAYER_SHIFTED`): ``extents`` are ``base``'s with ``shift``
    (bytes on the source side, on the destination side) added to every offset, the lengths,
    items and launch ``base``'s own objects, so what derives from those alone (item times)
    is ``base``'s, and what derives from offsets is ``base``'s shifted."""

    routine: str
    extents: Extents
    launch: Launch
    base: "CopyPlan | None" = field(default=None, compare=False, repr=False)
    shift: tuple[int, int] = field(default=(0, 0), compare=False, repr=False)

    @property
    def n_items(self) -> int:
        return self.extents.n_items


@dataclass(frozen=True)
class OutOfBounds:
    """An extent that reaches outside its buffer on one side."""

    side: str  # 'src' or 'dst'
    extent: int
    item: int
    offset: int
    length: int
    bytes_outside: int
    first_byte_outside: int


# ----------------------------------------------------------------------------
# launch shapes

def warp_quota_launch(n_items: int, chunk_bytes: int = AOT_CHUNK_BYTES,
                      block_quota: int = BLOCK_QUOTA,
                      warps_per_block: int = WARPS_PER_BLOCK) -> Launch:
    """sgl-kernel ``transfer_kv_launcher``: items_per_warp = ceil(N / (quota x
    warps_per_block)), blocks = ceil(N / (items_per_warp x warps_per_block)).
    N == 0 gives an empty launch (the real launcher would divide by zero)."""
    threads = warps_per_block * WARP_SIZE
    if n_items <= 0:
        return Launch("warp_quota", 0, chunk_bytes, threads, 0, 0)
    ipw = -(-n_items // (block_quota * warps_per_block))
    blocks = -(-n_items // (ipw * warps_per_block))
    return Launch("warp_quota", blocks * warps_per_block, chunk_bytes, threads, blocks, ipw)


def warp_per_item_launch(n_items: int, chunk_bytes: int = DSV4_CHUNK_BYTES,
                         block_threads: int = DSV4_BLOCK_THREADS) -> Launch:
    """transfer_cache_dsv4_mla: grid = ceil(N / warps_per_block) blocks."""
    wpb = block_threads // WARP_SIZE
    if n_items <= 0:
        return Launch("warp_per_item", 0, chunk_bytes, block_threads, 0, 0)
    blocks = -(-n_items // wpb)
    return Launch("warp_per_item", blocks * wpb, chunk_bytes, block_threads, blocks, 1)


def memcpy_launch(n_runs: int) -> Launch:
    """Host-issued copies: one in flight at a time, byte-granular progress."""
    return Launch("memcpy_runs", 1 if n_runs else 0, 1, 0, 0, n_runs)


# ----------------------------------------------------------------------------
# argument validation

def _int(v: Any, where: str, *, minimum: int | None = None) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise InputError(where, f"expected an integer, got {show(v)}")
    if minimum is not None and v < minimum:
        raise InputError(where, f"expected an integer >= {minimum}, got {v}")
    return int(v)


def _indices(v: Any, where: str) -> np.ndarray:
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or not (np.issubdtype(v.dtype, np.integer)):
            raise InputError(where, f"expected a 1-D list of integers, got array of "
                                    f"dtype {v.dtype} and shape {v.shape}")
        return v.astype(np.int64)
    if not isinstance(v, (list, tuple)):
        raise InputError(where, f"expected a list of integers, got {type(v).__name__}")
    if plain_ints(v):
        # NOTE: the common case (the cache's index lists) checked in one pass; bools, other
        # number types and values outside int64 take the loop below, which names the element.
        try:
            return np.array(v, dtype=np.int64).reshape(-1)
        except OverflowError:
            pass
    for i, x in enumerate(v):
        if not isinstance(x, numbers.Integral) or isinstance(x, bool):
            raise InputError(f"{where}[{i}]", f"expected an integer, got {show(x)}")
        if not -(1 << 63) <= x < (1 << 63):
            raise InputError(f"{where}[{i}]", f"expected an int64 value, got {x}")
    return np.array(v, dtype=np.int64).reshape(-1)


def _check_args(args: Any, routine: "Routine", where: str) -> None:
    if not isinstance(args, Mapping):
        raise InputError(where + ".args", f"expected an object of arguments, got {show(args)}")
    check_keys(args, routine.required_args + routine.optional_args, where + ".args", routine.required_args,
               context=f" for {routine.name}", missing="argument")


def _pair(args: Mapping, where: str) -> tuple[np.ndarray, np.ndarray]:
    s = _indices(args["src_indices"], where + ".args.src_indices")
    d = _indices(args["dst_indices"], where + ".args.dst_indices")
    if s.size != d.size:
        raise InputError(where + ".args.dst_indices",
                         f"src_indices and dst_indices must have equal length "
                         f"(got {s.size} and {d.size})")
    return s, d


def _layer(v: Any, src, dst, where: str) -> int:
    layer = _int(v, where, minimum=0)
    top = min(src.layers, dst.layers)
    if layer >= top:
        raise InputError(where, f"expected a layer in [0, {top}) (src has {src.layers}, "
                                f"dst has {dst.layers} layers), got {layer}")
    return layer


def _layers(v: Any, src, dst, where: str) -> np.ndarray:
    if not isinstance(v, (list, tuple)) or len(v) == 0:
        raise InputError(where, f"expected a non-empty list of layer ids, got {show(v)}")
    return np.array([_layer(x, src, dst, f"{where}[{i}]") for i, x in enumerate(v)], dtype=np.int64)


def _layout(lay: Any, where: str) -> None:
    if not isinstance(lay, (PagedLayout, HostLayout)):
        raise InputError(where, f"expected a PagedLayout or HostLayout, got {type(lay).__name__}")


def _item_bytes(args: Mapping, src, dst, where: str, *, align: int = AOT_ITEM_ALIGN) -> int:
    w = where + ".args.item_bytes"
    if args.get("item_bytes") is not None:
        ib = _int(args["item_bytes"], w, minimum=1)
        what = "item_bytes"
    else:
        if src.unit_bytes != dst.unit_bytes:
            raise InputError(w, f"expected item_bytes when the layouts' unit sizes differ "
                                f"(src {src.name}: {src.unit_bytes} B, dst {dst.name}: "
                                f"{dst.unit_bytes} B), got nothing")
        ib = src.unit_bytes
        what = "the layouts' unit_bytes (default item_bytes)"
    if align and ib % align:
        raise InputError(w, f"Item byte size must be divisible by {align} (sgl-kernel "
                            f"transfer_kv_launcher); {what} is {ib}")
    return ib


# ----------------------------------------------------------------------------
# helpers

def _kept(s: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Items the AOT kernel copies: ``if (src < 0 || dst < 0) continue;``."""
    return np.nonzero((s >= 0) & (d >= 0))[0].astype(np.int64)


def _row_copy(src, dst, layers: np.ndarray, s: np.ndarray, d: np.ndarray,
              item_bytes: int) -> Extents:
    """Item i = index pair i; one extent per layer, in layer order."""
    n = s.size
    keep = _kept(s, d)
    nl = layers.size
    if nl == 1 and keep.size:
        # NOTE: one layer (kernel_per_layer): its offsets are the extents, no (items, layers) stack
        L = int(layers[0])
        return _extents(src.unit_offsets(L, s[keep]), dst.unit_offsets(L, d[keep]),
                        np.full(keep.size, item_bytes, dtype=np.int64), keep, n)
    so = src.unit_offsets_by_layer(layers, s[keep]) if keep.size else np.zeros((0, nl))
    do = dst.unit_offsets_by_layer(layers, d[keep]) if keep.size else np.zeros((0, nl))
    item = np.repeat(keep, nl)
    length = np.full(item.size, item_bytes, dtype=np.int64)
    return _extents(so.ravel(), do.ravel(), length, item, n)


def _merge_contiguous(so: np.ndarray, do: np.ndarray, ln: np.ndarray, item: np.ndarray,
                      n_items: int) -> Extents:
    """Merge neighbouring extents of the same item that are address-contiguous
    on both sides."""
    if so.size == 0:
        return _extents(so, do, ln, item, n_items)
    cont = np.zeros(so.size, dtype=bool)
    cont[1:] = ((item[1:] == item[:-1]) & (so[1:] == so[:-1] + ln[:-1])
                & (do[1:] == do[:-1] + ln[:-1]))
    start = np.nonzero(~cont)[0]
    length = np.add.reduceat(ln, start)
    return _extents(so[start], do[start], length, item[start], n_items)


# ----------------------------------------------------------------------------
# the routines

@dataclass(frozen=True)
class Routine:
    name: str
    sglang_name: str
    doc: str
    required_args: tuple[str, ...]
    optional_args: tuple[str, ...]
    fn: Callable[[Any, Any, Mapping, str], CopyPlan]

    def plan(self, src_layout, dst_layout, args: Mapping, where: str = "") -> CopyPlan:
        return plan(self.name, src_layout, dst_layout, args, where)


def _kernel_per_layer(src, dst, args, where) -> CopyPlan:
    layer = _layer(args["layer"], src, dst, where + ".args.layer")
    s, d = _pair(args, where)
    ib = _item_bytes(args, src, dst, where)
    ext = _row_copy(src, dst, np.array([layer]), s, d, ib)
    return CopyPlan("kernel_per_layer", ext, warp_quota_launch(s.size))


def _kernel_all_layer(src, dst, args, where) -> CopyPlan:
    s, d = _pair(args, where)
    if args.get("layers") is None:
        if dst.layers < src.layers:
            raise InputError(where + ".args.layers",
                             f"expected layers when dst {dst.name} has fewer layers ({dst.layers}) "
                             f"than src {src.name} ({src.layers}), got nothing")
        layers = np.arange(src.layers, dtype=np.int64)
    else:
        layers = _layers(args["layers"], src, dst, where + ".args.layers")
    ib = _item_bytes(args, src, dst, where)
    ext = _row_copy(src, dst, layers, s, d, ib)
    return CopyPlan("kernel_all_layer", ext, warp_quota_launch(s.size))


def _direct_per_layer(src, dst, args, where) -> CopyPlan:
    layer = _layer(args["layer"], src, dst, where + ".args.layer")
    s, d = _pair(args, where)
    page_size = _int(args.get("page_size", 1), where + ".args.page_size", minimum=1)
    if s.size % page_size:
        raise InputError(where + ".args.src_indices",
                         f"Source indices size must be divisible by page size "
                         f"(got {s.size} indices, page_size {page_size})")
    for name, arr in (("src_indices", s), ("dst_indices", d)):
        neg = np.nonzero(arr < 0)[0]
        if neg.size:
            raise InputError(f"{where}.args.{name}[{int(neg[0])}]",
                             f"expected a non-negative index (transfer_kv_direct slices the "
                             f"tensor and does not skip negatives), got {int(arr[neg[0]])}")
    if src.unit_bytes != dst.unit_bytes:
        raise InputError(where + ".args",
                         f"expected equal unit sizes for a direct copy (src {src.name}: "
                         f"{src.unit_bytes} B, dst {dst.name}: {dst.unit_bytes} B)")
    n = s.size
    # a run continues while both src and dst advance by exactly one
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = ~((np.diff(s) == 1) & (np.diff(d) == 1))
    run = np.cumsum(brk) - 1
    n_runs = int(brk.sum())
    so = src.unit_offsets(layer, s)
    do = dst.unit_offsets(layer, d)
    ln = np.full(n, src.unit_bytes, dtype=np.int64)
    ext = _merge_contiguous(so, do, ln, run.astype(np.int64), n_runs)
    return CopyPlan("direct_per_layer", ext, memcpy_launch(n_runs))


def _dsa_indexer_per_layer(src, dst, args, where) -> CopyPlan:
    layer = _layer(args["layer"], src, dst, where + ".args.layer")
    s, d = _pair(args, where)
    ps = _int(args.get("page_size", DSA_PAGE_SIZE), where + ".args.page_size", minimum=1)
    if s.size % ps:
        raise InputError(where + ".args.src_indices",
                         f"{DSA_INDEXER_PAGE_ERROR} (host_indices.numel() % page_size != 0: "
                         f"got {s.size} indices, page_size {ps})")
    # host_indices.reshape(-1, page_size)[:, 0] // page_size  (floor division)
    sp = s.reshape(-1, ps)[:, 0] // ps if s.size else s
    dp = d.reshape(-1, ps)[:, 0] // ps if d.size else d
    if src.unit_bytes != dst.unit_bytes:
        raise InputError(where + ".args",
                         f"expected equal page rows (indexer_page_stride_size) on both sides "
                         f"(src {src.name}: {src.unit_bytes} B, dst {dst.name}: {dst.unit_bytes} B)")
    ib = src.unit_bytes
    if ib % AOT_ITEM_ALIGN:
        raise InputError(where + ".args",
                         f"expected a page row that is a multiple of 8 B for the kernel path "
                         f"(SGLang uses the direct backend otherwise), got {ib}")
    ext = _row_copy(src, dst, np.array([layer]), sp, dp, ib)
    return CopyPlan("dsa_indexer_per_layer", ext, warp_quota_launch(sp.size))


def dsv4_token_offsets(layer_base: int, index) -> tuple[np.ndarray, np.ndarray]:
    """(value, scale) byte offsets as transfer_cache_dsv4_mla computes them.

    The int64 index is cast to int32 (``static_cast<int32_t>``), then
    ``page = index >> 6``, ``entry = index & 63`` (two's complement, so a
    negative index addresses bytes before the base), value at
    ``page*37440 + entry*576``, scale at ``page*37440 + 36864 + entry*8``.
    """
    idx = np.asarray(index, dtype=np.int64).astype(np.int32).astype(np.int64)
    page = idx >> 6
    entry = idx & (DSV4_PAGE_SIZE - 1)
    page_base = np.int64(layer_base) + page * DSV4_PAGE_BYTES
    return (page_base + entry * DSV4_VALUE_BYTES,
            page_base + DSV4_SCALE_OFFSET + entry * DSV4_SCALE_BYTES)


def _dsv4_token(src, dst, args, where) -> CopyPlan:
    s, d = _pair(args, where)
    if args.get("layers") is None:
        layers = np.array([0], dtype=np.int64)
    else:
        layers = _layers(args["layers"], src, dst, where + ".args.layers")
    n, nl = s.size, layers.size
    # per (token, layer): value extent then scale extent
    so = np.empty((n, nl, 2), dtype=np.int64)
    do = np.empty((n, nl, 2), dtype=np.int64)
    for j, L in enumerate(layers):
        sv, ss = dsv4_token_offsets(int(src.unit_offsets(int(L), [0])[0]), s)
        dv, ds = dsv4_token_offsets(int(dst.unit_offsets(int(L), [0])[0]), d)
        so[:, j, 0], so[:, j, 1] = sv, ss
        do[:, j, 0], do[:, j, 1] = dv, ds
    ln = np.broadcast_to(np.array([DSV4_VALUE_BYTES, DSV4_SCALE_BYTES], dtype=np.int64),
                         (n, nl, 2))
    item = np.repeat(np.arange(n, dtype=np.int64), nl * 2)
    ext = _extents(so.ravel(), do.ravel(), ln.ravel(), item, n)
    return CopyPlan("dsv4_token", ext, warp_per_item_launch(n))


def _token_bytewise(src, dst, args, where) -> CopyPlan:
    layer = _layer(args["layer"], src, dst, where + ".args.layer")
    s, d = _pair(args, where)
    fs, fd = src.effective_fields, dst.effective_fields
    if len(fs) != len(fd) or any(a.entry_bytes != b.entry_bytes for a, b in zip(fs, fd)):
        raise InputError(where + ".args",
                         f"expected the two layouts' per-token fields to agree in count and "
                         f"entry_bytes, got src {src.name} "
                         f"{[(f.name, f.entry_bytes) for f in fs]} and dst {dst.name} "
                         f"{[(f.name, f.entry_bytes) for f in fd]}")
    keep = _kept(s, d)
    so, ln = src.token_extents(layer, s[keep])
    do, _ = dst.token_extents(layer, d[keep])
    item = np.repeat(keep, len(fs))
    ext = _extents(so.ravel(), do.ravel(), ln.ravel(), item, s.size)
    return CopyPlan("token_bytewise", ext, warp_quota_launch(s.size))


def _direct_page_first(src, dst, args, where) -> CopyPlan:
    layer = _layer(args["layer"], src, dst, where + ".args.layer")
    s, d = _pair(args, where)
    ps = _int(args["page_size"], where + ".args.page_size", minimum=1)
    if s.size % ps:
        raise InputError(where + ".args.src_indices",
                         f"Source indices size must be divisible by page size "
                         f"(got {s.size} indices, page_size {ps})")
    if src.unit_bytes != dst.unit_bytes:
        raise InputError(where + ".args",
                         f"expected equal unit sizes for a direct copy (src {src.name}: "
                         f"{src.unit_bytes} B, dst {dst.name}: {dst.unit_bytes} B)")
    n_pages = s.size // ps
    t = np.arange(ps, dtype=np.int64)

    def rows(lay, first):
        # a host side addresses page (index // page_size); a device side starts at the index
        if isinstance(lay, HostLayout):
            return ((first // ps) * ps)[:, None] + t[None, :]
        return first[:, None] + t[None, :]

    rs, rd = rows(src, s[::ps]), rows(dst, d[::ps])
    for name, r, lay in (("src_indices", rs, src), ("dst_indices", rd, dst)):
        neg = np.nonzero(r[:, 0] < 0)[0]
        if neg.size:
            raise InputError(f"{where}.args.{name}[{int(neg[0]) * ps}]",
                             f"expected a non-negative index (the direct copy slices the tensor), "
                             f"got {int(r[neg[0], 0])}")
    so = src.unit_offsets(layer, rs.reshape(-1))
    do = dst.unit_offsets(layer, rd.reshape(-1))
    item = np.repeat(np.arange(n_pages, dtype=np.int64), ps)
    ln = np.full(item.size, src.unit_bytes, dtype=np.int64)
    ext = _merge_contiguous(so, do, ln, item, n_pages)
    return CopyPlan("direct_page_first", ext, memcpy_launch(n_pages))


def _staged_all_layer_lf_pf(src, dst, args, where) -> CopyPlan:
    s, d = _pair(args, where)
    ps = _int(args["page_size"], where + ".args.page_size", minimum=1)
    if not isinstance(dst, HostLayout) or dst.layout != "page_first":
        raise InputError(where + ".dst_layout",
                         f"expected a page_first host layout (the staged write-back copies each page "
                         f"to host index * layers * unit_bytes), got {getattr(dst, 'layout', dst.kind)}")
    if s.size % ps:
        raise InputError(where + ".args.src_indices",
                         f"HiCache staged relayout: staging token count mismatch (got {s.size} indices, "
                         f"not a multiple of page_size {ps})")
    if src.layers != dst.layers:
        raise InputError(where + ".args",
                         f"expected one layer count on both sides (the pointer table has one entry per "
                         f"host layer), got src {src.layers} and dst {dst.layers}")
    ib = _item_bytes(args, src, dst, where, align=STAGED_ITEM_ALIGN)
    n_pages = s.size // ps
    # the first index of each page_size group decides the page on both sides
    sp = s[::ps]
    dp = d[::ps]
    t = np.arange(ps, dtype=np.int64)
    layers = np.arange(src.layers, dtype=np.int64)
    tok_s = (sp[:, None] + t[None, :]).reshape(-1)          # page-major, token within page
    tok_d = (dp[:, None] + t[None, :]).reshape(-1)
    so = src.unit_offsets_by_layer(layers, tok_s) if tok_s.size else np.zeros((0, 1))
    do = dst.unit_offsets_by_layer(layers, tok_d) if tok_d.size else np.zeros((0, 1))
    item = np.repeat(np.arange(n_pages, dtype=np.int64), ps * layers.size)
    ln = np.full(item.size, ib, dtype=np.int64)
    so, do = so.reshape(-1), do.reshape(-1)
    ext = _merge_contiguous(so.astype(np.int64), do.astype(np.int64), ln, item, n_pages)
    return CopyPlan("staged_all_layer_lf_pf", ext, memcpy_launch(n_pages))


ROUTINES: dict[str, Routine] = {r.name: r for r in (
    Routine(
        "kernel_per_layer", "sgl_kernel.transfer_kv_per_layer[_mla] / transfer_kv_per_layer[_mla]_pf_lf",
        "One layer; item i copies item_bytes from src.unit_offsets(layer, src_indices[i]) to "
        "dst.unit_offsets(layer, dst_indices[i]). Pairs with a negative index are skipped. "
        "item_bytes overrides only the length, the stride comes from the layouts.",
        ("layer", "src_indices", "dst_indices"), ("item_bytes",), _kernel_per_layer),
    Routine(
        "kernel_all_layer", "sgl_kernel.transfer_kv_all_layer[_mla][_lf_pf]",
        "Backup (D2H) in one launch: one warp per index pair, looping over `layers` "
        "(default: all layers of src); item i has one extent per layer, in layer order.",
        ("src_indices", "dst_indices"), ("layers", "item_bytes"), _kernel_all_layer),
    Routine(
        "direct_per_layer", "sgl_kernel.transfer_kv_direct",
        "Coalesce runs where both src and dst indices advance by one; one memcpy per run, "
        "in order; item = run (its extents merged where contiguous on both sides).",
        ("layer", "src_indices", "dst_indices"), ("page_size",), _direct_per_layer),
    Routine(
        "dsa_indexer_per_layer", "DSAIndexerPoolHost.load_to_device_per_layer (kernel path)",
        "Token indices -> page indices (first token of each page_size group // page_size), "
        "then a page-row copy of one layer (item_bytes = page row).",
        ("layer", "src_indices", "dst_indices"), ("page_size",), _dsa_indexer_per_layer),
    Routine(
        "dsv4_token", "sglang.jit_kernel.hisparse.transfer_cache_dsv4_mla",
        "One warp per token; for every layer pointer (layout.unit_offsets(layer, [0])[0]) "
        "the kernel's fixed C4 constants place value (576 B) and scale (8 B). Indices are "
        "cast to int32 and never skipped.",
        ("src_indices", "dst_indices"), ("layers",), _dsv4_token),
    Routine(
        "token_bytewise", "(none: candidate fix)",
        "Per token, copy the token's own bytes (token_extents on each side, field by "
        "field). Pairs with a negative index are skipped, as in the AOT kernel.",
        ("layer", "src_indices", "dst_indices"), (), _token_bytewise),
    Routine(
        "direct_page_first",
        "sgl_kernel.transfer_kv_per_layer_direct_pf_lf / transfer_kv_all_layer_direct_lf_pf (one layer)",
        "One memcpy per page_size group of indices (item = page): only the group's first index "
        "counts; on a host side it names the page index // page_size (rows page*page_size + t), "
        "on a device side the first row (rows index + t). One layer; negative indices are refused.",
        ("layer", "src_indices", "dst_indices", "page_size"), (), _direct_page_first),
    Routine(
        "staged_all_layer_lf_pf",
        "sglang.jit_kernel.hicache.transfer_hicache_all_layer_mla_staged_lf_pf (one chunk)",
        "Backup (D2H) of whole pages to a page_first host pool: item p is page p, one memcpy "
        "of page_size x layers rows; only the first index of each page_size group counts on "
        "either side (token t of the page is src_indices[p*page_size] + t). Extents are "
        "token-major, layer-minor (the host page's byte order). Nothing is skipped. Models "
        "the relayout kernel and the page memcpys as one copy: the device bytes are read as "
        "each page's memcpy runs (in SGLang the relayout kernel read them all before).",
        ("src_indices", "dst_indices", "page_size"), ("item_bytes",), _staged_all_layer_lf_pf),
)}


#: plans ``plan`` keeps (a plan is a pure function of its routine, layouts and arguments,
#: and a host program issues the same copy shape again and again: the same layer and
#: pages on every TP rank, the same ring of pages request after request)
PLAN_CACHE_SIZE = 4096
#: index lists longer than this are planned afresh (hashing them costs what planning does)
PLAN_CACHE_MAX_INDICES = 256
_plan_cache: dict = {}


def _arg_key(v, max_len: float = PLAN_CACHE_MAX_INDICES):
    """A hashable key of one argument value that tells apart every value the routines treat
    differently (the type is part of it: ``True`` is refused where ``1`` is a layer), or
    None for a value not worth caching (index lists longer than ``max_len``, arrays, anything
    else)."""
    t = type(v)
    if t is int or t is float or t is str or v is None:
        return (t, v)
    if (t is list or t is tuple) and len(v) <= max_len:
        # NOTE: a set of the element types (one int list: {int}) instead of a generator per value
        if not v or set(map(type, v)) == _INT_TYPE:
            return (t, tuple(v))
    return None


_INT_TYPE = {int}


#: layout -> its token (one int per layout value), and id(layout) -> (layout, token)
_layout_tokens: dict = {}
_layout_ids: dict = {}
_next_token = itertools.count()


def _layout_token(layout):
    """An int that stands for ``layout``'s value in plan keys (equal layouts, equal tokens),
    or None for an unhashable layout.

    NOTE: found by the layout object's id first (the entry holds the layout, so its id is
    not reused while the entry lives): hashing a layout hashes every field, on every call,
    and a cache hit then compared the layouts field by field.  Tokens are never reused, so
    forgetting them (both maps are cleared when full) only costs misses."""
    got = _layout_ids.get(id(layout))
    if got is not None and got[0] is layout:
        return got[1]
    try:
        tok = _layout_tokens.get(layout)
        if tok is None:
            if len(_layout_tokens) >= PLAN_CACHE_SIZE:
                _layout_tokens.clear()
            tok = _layout_tokens[layout] = next(_next_token)
    except TypeError:          # a layout with an unhashable field: plan afresh
        return None
    if len(_layout_ids) >= PLAN_CACHE_SIZE:
        _layout_ids.clear()
    _layout_ids[id(layout)] = (layout, tok)
    return tok


def _plan_key(routine, src_layout, dst_layout, args, skip: str | None = None,
              max_len: float = PLAN_CACHE_MAX_INDICES):
    """The cache key of a plan (every argument but ``skip``; index lists up to ``max_len``), or
    None."""
    if type(args) is not dict or type(routine) is not str:
        return None
    items = []
    for k, v in args.items():
        if k == skip:
            continue
        kv = _arg_key(v, max_len)
        if kv is None or type(k) is not str:
            return None
        items.append((k, kv))
    items.sort()
    ts, td = _layout_token(src_layout), _layout_token(dst_layout)
    if ts is None or td is None:
        return None
    # NOTE: every part is an int, str, float, None or a tuple of those: always hashable
    return (routine, ts, td, tuple(items))


def plan(routine: str, src_layout, dst_layout, args: Mapping, where: str = "") -> CopyPlan:
    """The extents and launch shape of ``routine`` with ``args`` between two layouts.

    ``where`` prefixes every InputError path (``where + '.args.<key>'``).  Plans of
    short argument lists are cached (``PLAN_CACHE_SIZE``), and those of
    :data:`LAYER_SHIFTED` routines kept by copy and layer (``_layer_shifted``): the same
    inputs give the same ``CopyPlan`` object, whose arrays callers must not modify.
    """
    if routine in LAYER_SHIFTED:
        return _layer_shifted(routine, src_layout, dst_layout, args, where)
    key = _plan_key(routine, src_layout, dst_layout, args)
    if key is not None:
        got = _plan_cache.get(key)
        if got is not None:
            return got
    out = _plan(routine, src_layout, dst_layout, args, where)
    if key is not None:
        _lock(out.extents)
        if len(_plan_cache) >= PLAN_CACHE_SIZE:
            _plan_cache.clear()     # NOTE: bounded memory; a run's working set refills it at once
        _plan_cache[key] = out
    return out


#: routines whose plan depends on their ``layer`` argument only through the layouts' layer
#: offsets: the plan of layer ``L`` is that of layer ``L0`` with every source offset moved by
#: ``(L - L0) * src_layout.layer_stride`` and every destination offset by the destination's
#: (``_row_copy`` of one layer: ``unit_offsets(L, idx)``; the kept items and the item bytes do
#: not depend on the layer).  ``tests/test_speed_plans.py`` compares them with planning afresh.
LAYER_SHIFTED = frozenset({"kernel_per_layer"})
#: copies (arguments but the layer) whose plans ``_layer_shifted`` keeps, each with its plans
#: by layer (cleared when full, as the plan cache)
LAYER_FAMILIES_SIZE = 64
_layer_families: dict = {}


def _family_key(routine, src_layout, dst_layout, args):
    """A hashable key of everything but the ``layer`` of a copy's arguments (index lists of any
    length: a load-back's lists are planned once per layer and pool), or None."""
    if type(args) is not dict or "layer" not in args:
        return None
    return _plan_key(routine, src_layout, dst_layout, args, skip="layer", max_len=math.inf)


def _layer_shifted(routine: str, src_layout, dst_layout, args: Mapping, where: str) -> CopyPlan:
    """``plan`` of a :data:`LAYER_SHIFTED` routine: the first plan of the same copy (at any
    layer) is planned, every other layer's derived from it (``CopyPlan.base``), each kept, so
    the same arguments give the same plan object, as the plan cache does.

    NOTE: a load-back issues one such copy per layer and pool with the same index lists: 43
    plans of up to hundreds of extents, where one and 42 additions do (and what the executor
    derives from a plan, item times and accesses, derives from the base's)."""
    fam = _family_key(routine, src_layout, dst_layout, args)
    if fam is None:
        return _plan(routine, src_layout, dst_layout, args, where)
    got = _layer_families.get(fam)
    if got is None:
        base = _plan(routine, src_layout, dst_layout, args, where)
        _lock(base.extents)
        if len(_layer_families) >= LAYER_FAMILIES_SIZE:
            _layer_families.clear()
        layer0 = _layer(args["layer"], src_layout, dst_layout, where)
        _layer_families[fam] = (layer0, base, {layer0: base})
        return base
    layer0, base, plans = got
    layer = _layer(args["layer"], src_layout, dst_layout, (where or "copy") + ".args.layer")
    out = plans.get(layer)
    if out is None:
        ds, dd = (layer - layer0) * src_layout.layer_stride, (layer - layer0) * dst_layout.layer_stride
        e = base.extents
        ext = Extents(e.src + np.int64(ds), e.dst + np.int64(dd), e.length, e.item, e.n_items)
        _lock(ext)
        out = plans[layer] = CopyPlan(routine, ext, base.launch, base=base, shift=(ds, dd))
    return out


def _lock(e: Extents) -> None:
    for a in (e.src, e.dst, e.length, e.item):
        a.setflags(write=False)     # shared from now on


def _plan(routine: str, src_layout, dst_layout, args: Mapping, where: str) -> CopyPlan:
    where = where or "copy"
    if routine not in ROUTINES:
        raise InputError(where + ".routine", f"expected one of {sorted(ROUTINES)}, got {show(routine)}")
    r = ROUTINES[routine]
    _layout(src_layout, where + ".src_layout")
    _layout(dst_layout, where + ".dst_layout")
    _check_args(args, r, where)
    return r.fn(src_layout, dst_layout, args, where)


# ----------------------------------------------------------------------------
# bounds

def _outside(off: np.ndarray, ln: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    end = off + ln
    below = np.clip(np.minimum(end, 0) - off, 0, None)
    above = np.clip(end - np.maximum(off, nbytes), 0, None)
    first = np.where(off < 0, off, np.maximum(off, nbytes))
    return below + above, first


def count_out_of_bounds(extents: Extents, src_nbytes: int, dst_nbytes: int) -> int:
    """How many records :func:`check_bounds` returns (extent sides outside their
    buffer), counted without building them."""
    return sum(int(np.count_nonzero(_outside(off, extents.length, int(nb))[0]))
               for off, nb in ((extents.src, src_nbytes), (extents.dst, dst_nbytes)))


def check_bounds(extents: Extents, src_nbytes: int, dst_nbytes: int) -> list[OutOfBounds]:
    """Every extent side that reaches outside ``[0, nbytes)``; never clips.

    Ordered by extent, ``src`` before ``dst`` for the same extent.
    """
    out: list[OutOfBounds] = []
    per_side = {}
    for side, off, nb in (("src", extents.src, src_nbytes), ("dst", extents.dst, dst_nbytes)):
        per_side[side] = _outside(off, extents.length, int(nb))
    bad = np.nonzero((per_side["src"][0] > 0) | (per_side["dst"][0] > 0))[0]
    for k in bad:
        for side in ("src", "dst"):
            nout, first = per_side[side]
            if nout[k] > 0:
                off = extents.src[k] if side == "src" else extents.dst[k]
                out.append(OutOfBounds(side, int(k), int(extents.item[k]), int(off),
                                       int(extents.length[k]), int(nout[k]), int(first[k])))
    return out


def item_bounds(routine: str, args: Mapping) -> np.ndarray:
    """Index position where each item of a copy starts, plus the end: item ``i``
    covers ``src_indices[b[i]:b[i+1]]``.  Items are what the simulator counts: an
    index pair, a 64-token page (``dsa_indexer_per_layer``) or a run of
    consecutive indices (``direct_per_layer``)."""
    if routine not in ROUTINES:
        raise InputError("routine", f"expected one of {sorted(ROUTINES)}, got {show(routine)}")
    s = np.asarray(args["src_indices"], dtype=np.int64).reshape(-1)
    d = np.asarray(args["dst_indices"], dtype=np.int64).reshape(-1)
    n = s.size
    if routine == "dsa_indexer_per_layer":
        return np.arange(0, n + 1, int(args.get("page_size", DSA_PAGE_SIZE)), dtype=np.int64)
    if routine in ("staged_all_layer_lf_pf", "direct_page_first"):
        return np.arange(0, n + 1, int(args["page_size"]), dtype=np.int64)
    if routine == "direct_per_layer":
        brk = np.ones(n, dtype=bool)
        if n > 1:
            brk[1:] = ~((np.diff(s) == 1) & (np.diff(d) == 1))
        return np.append(np.flatnonzero(brk), n).astype(np.int64)
    return np.arange(n + 1, dtype=np.int64)


def slice_items(routine: str, args: Mapping, a: int, b: int) -> dict:
    """Arguments of the same routine that copy items ``a..b-1`` only (the
    sub-launch SGLang would make with the sliced index arrays)."""
    bounds = item_bounds(routine, args)
    n = bounds.size - 1
    if not 0 <= a <= b <= n:
        raise InputError("item_range", f"expected 0 <= a <= b <= {n} (the copy has {n} items), got ({a}, {b})")
    lo, hi = int(bounds[a]), int(bounds[b])
    out = dict(args)
    out["src_indices"] = list(np.asarray(args["src_indices"], dtype=np.int64).reshape(-1)[lo:hi].tolist())
    out["dst_indices"] = list(np.asarray(args["dst_indices"], dtype=np.int64).reshape(-1)[lo:hi].tolist())
    if routine == "direct_per_layer" and (a, b) != (0, n):
        out["page_size"] = 1      # a cut at a run boundary need not be page-aligned; the runs are unchanged
    return out
