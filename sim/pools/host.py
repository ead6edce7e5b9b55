"""Host (pinned CPU) KV pools and the copies SGLang 0.5.14 launches for them.

Models ``sglang/srt/mem_cache/pool_host/base.py`` (``HostKVCache``) and
``memory_pool_host.py`` (``MLATokenToKVPoolHost``, ``DSAIndexerPoolHost``,
``PoolEntry``, ``HostPoolGroup``).  A host pool owns its slot bookkeeping
(``free_slots``) and its geometry (a :class:`~sim.pools.layouts.HostLayout`);
the bytes live in the executor's Memory under the names ``buffers()`` declares.

``load_to_device_per_layer`` and ``backup_from_device_all_layer`` do not move
bytes: they return the copy ops SGLang would launch, as schedule op dicts
without ``stream``/``host``/``id`` (the cache controller adds those), in
launch order.  Each op carries a ``note`` naming the SGLang/sgl-kernel
function that would run (JIT and AOT kernels have the same byte effect; the
``note`` records which one 0.5.14 picks).  The routine is chosen per
io backend and layout exactly as 0.5.14 chooses it; an unsupported
(backend, layout) pair raises :class:`UnsupportedTransfer` where SGLang raises
``ValueError``.

Platform assumptions (documented in ``docs/pools.md``): CUDA, the JIT HiCache
modules load (``can_use_hicache_jit_kernel`` iff element_size % 128 == 0,
``can_use_write_back_jit_kernel`` iff element_size % 16 == 0).
"""
from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from sim.errors import InputError, KvraceError, show
from sim.pools.device import (
    DeepSeekV4IndexerPool, DeepSeekV4SingleKVPool, DeepSeekV4TokenToKVPool, DSATokenToKVPool, KVCache,
    MLATokenToKVPool, buffer_decl,
)
from sim.pools.layouts import (
    HOST_LAYOUTS, INDEX_HEAD_DIM, INDEX_SCALE_BYTES, Field, HostLayout, PagedLayout, c4_indexer, host_mirror,
)

__all__ = [
    "HICACHE_HOST_MEMORY_RESERVE_BYTES",
    "MAX_HOST_POOL_TOKENS",
    "WRITE_BACK_STAGING_PAGE_CHUNK",
    "IO_BACKENDS",
    "PARTIAL_PAGE_MODES",
    "UnsupportedTransfer",
    "HostKVCache",
    "MLATokenToKVPoolHost",
    "DSAIndexerPoolHost",
    "LogicalHostPool",
    "DeepSeekV4PagedHostPool",
    "deepseek_v4_num_host_pages",
    "PoolEntry",
    "PoolTransfer",
    "HostPoolGroup",
    "resolve_layout_io_compatibility",
    "can_use_hicache_jit_kernel",
    "can_use_write_back_jit_kernel",
]

#: pool_host/base.py: host RAM left free when sizing the pool
HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 * (1024 ** 3)
#: the largest host pool the model builds, in tokens (a host of a few TB holds tens of millions;
#: the pool's free list and mappings are arrays of this length)
MAX_HOST_POOL_TOKENS = 1 << 27
#: memory_pool_host.py ``_WRITE_BACK_STAGING_PAGE_CHUNK``: pages per staged launch
WRITE_BACK_STAGING_PAGE_CHUNK = 64
IO_BACKENDS = ("kernel", "direct")


class UnsupportedTransfer(KvraceError):
    """A (pool, io backend, layout) combination SGLang 0.5.14 rejects with
    ``ValueError`` ("Unsupported layout" / "Unsupported IO backend")."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def can_use_hicache_jit_kernel(element_size: int) -> bool:
    """``jit_kernel.hicache.can_use_hicache_jit_kernel`` on CUDA: element_size % 128 == 0."""
    return element_size % 128 == 0


def can_use_write_back_jit_kernel(element_size: int) -> bool:
    """``can_use_write_back_jit_kernel`` on CUDA: element_size % 16 == 0."""
    return element_size % 16 == 0


def resolve_layout_io_compatibility(layout: str, io_backend: str, *, is_hip: bool = False) -> tuple[str, str]:
    """``ServerArgs._resolve_layout_io_compatibility``: the (layout, io_backend)
    SGLang actually runs for the requested pair.

    In order: ``page_first_direct`` + ``kernel`` -> backend ``direct``;
    ``page_first`` + ``direct`` -> layout ``page_first_direct``; on ROCm
    (``is_hip``) ``page_first`` + ``kernel`` -> layout ``layer_first``.
    Everything else is returned unchanged.
    """
    if layout not in HOST_LAYOUTS:
        raise InputError("layout", f"expected one of {list(HOST_LAYOUTS)}, got {show(layout)}")
    if io_backend not in IO_BACKENDS:
        raise InputError("io_backend", f"expected one of {list(IO_BACKENDS)}, got {show(io_backend)}")
    if layout == "page_first_direct" and io_backend == "kernel":
        io_backend = "direct"
    if layout == "page_first" and io_backend == "direct":
        layout = "page_first_direct"
    if layout == "page_first" and io_backend == "kernel" and is_hip:
        layout = "layer_first"
    return layout, io_backend


def _ints(v: Any, where: str) -> np.ndarray:
    """``v`` as a 1-D int64 array, the caller's own array when it is one already.

    NOTE: not copied (a load-back converts the same indices once per layer and pool: 43 x 5
    copies of tens of thousands of indices); nothing here writes an index array in place."""
    a = np.asarray(v)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise InputError(where, f"expected integer indices, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False).reshape(-1)


def _copy(routine: str, src: str, dst: str, args: dict, note: str) -> dict:
    return {"op": "copy", "routine": routine, "src": src, "dst": dst, "args": args, "note": note}


def _direct_routine(layout: str) -> str:
    """``transfer_kv_direct`` (coalesced runs) for layer_first;
    ``transfer_kv_*_direct_pf_lf`` / ``_lf_pf`` (one memcpy per page) for page_first_direct."""
    return "direct_per_layer" if layout == "layer_first" else "direct_page_first"


def _lst(a: np.ndarray) -> list[int]:
    return a.tolist()


#: how a V4 paged host pool copies a transfer whose index count is not a multiple of its
#: slot page: SGLang 0.5.14's token-granular ``transfer_cache_dsv4_mla`` (``dsv4_token``), or
#: widened to the whole pages it touches and copied by the page routine (``page_aligned``)
PARTIAL_PAGE_MODES = ("dsv4_token", "page_aligned")


def _first_touch(pages: np.ndarray) -> np.ndarray:
    """The distinct values of ``pages`` in order of first appearance."""
    _, first = np.unique(pages, return_index=True)
    return pages[np.sort(first)]


def _check_pair(host_indices, device_indices) -> tuple[np.ndarray, np.ndarray]:
    h = _ints(host_indices, "host_indices")
    d = _ints(device_indices, "device_indices")
    if h.size != d.size:
        raise InputError("device_indices", f"expected as many device indices as host indices "
                                           f"({h.size}), got {d.size}")
    return h, d


class _FreeSlots:
    """SGLang's host free list (``pool_host/base.py``, ``LogicalHostPool``): ``free_slots``, an
    int64 array; allocations are taken from its front, frees appended to its back."""

    size: int

    def clear(self) -> None:
        self.free_slots = np.arange(self.size, dtype=np.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    def _take(self, need_size: int) -> Optional[np.ndarray]:
        if need_size > self.available_size():
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def _give(self, idx: np.ndarray) -> int:
        self.free_slots = np.concatenate([self.free_slots, idx])
        return int(idx.size)


class HostKVCache(_FreeSlots, abc.ABC):
    """``pool_host/base.py`` ``HostKVCache``: sizing and the host slot free list.

    Sizing (exactly as SGLang): with ``host_size > 0`` (GB, 1e9 bytes)
    ``size = int(host_size * 1e9 // size_per_token)``, else
    ``size = int(device_pool.size * host_to_device_ratio)``; then
    ``page_num = size // page_size + 1`` and ``size = page_num * page_size``
    (NOTE: always one page more, even when size was already aligned).
    ``size`` must exceed ``device_pool.size``.  SGLang checks the request
    against ``psutil`` available memory minus
    :data:`HICACHE_HOST_MEMORY_RESERVE_BYTES`; here the available memory is
    the parameter ``host_memory_available`` (bytes; ``None`` skips the check).

    Slots: ``free_slots`` starts as ``0..size-1`` (no padding slot on the
    host).  ``alloc(n)`` needs ``n % page_size == 0`` and takes the first
    ``n``; ``free`` appends to the back and returns the count.
    """

    def __init__(self, device_pool: KVCache, host_to_device_ratio: float, host_size: float,
                 page_size: int, layout: str, *, prefix: str = "host_",
                 host_memory_available: Optional[int] = None):
        if layout not in HOST_LAYOUTS:
            raise InputError("layout", f"expected one of {list(HOST_LAYOUTS)}, got {show(layout)}")
        if not isinstance(page_size, numbers.Integral) or page_size < 1:
            raise InputError("page_size", f"expected an integer >= 1, got {show(page_size)}")
        self.device_pool = device_pool
        self.page_size = int(page_size)
        self.layout = layout
        self.prefix = prefix
        self.device = device_pool.device
        self.size_per_token = self.get_size_per_token()
        if host_size > 0:
            self.size = int(host_size * 1e9 // self.size_per_token)
        else:
            self.size = int(device_pool.size * host_to_device_ratio)
        _check_host_tokens(self.size, "hicache_size" if host_size > 0 else "hicache_ratio")
        self.page_num = self.size // self.page_size + 1
        self.size = self.page_num * self.page_size
        self.start_layer = device_pool.start_layer
        self.end_layer = device_pool.end_layer
        if not self.size > device_pool.size:
            # NOTE: the key is the input that sized the pool: hicache_size when given, else the ratio
            raise InputError("hicache_size" if host_size > 0 else "hicache_ratio",
                             f"expected a host pool larger than the device pool (SGLang: the host memory should be "
                             f"larger than the device memory with the current protocol), got host size {self.size} "
                             f"tokens <= device size {device_pool.size}")
        if host_memory_available is not None:
            requested = self.size * self.size_per_token
            available = host_memory_available - HICACHE_HOST_MEMORY_RESERVE_BYTES
            if requested > available:
                raise InputError("host_memory_available",
                                 f"Not enough host memory available. Requesting {requested / 1e9:.2f} GB "
                                 f"but only have {available / 1e9:.2f} GB free")
        self.layouts: dict[str, HostLayout] = {}
        self._kinds: dict[str, str] = {}
        self.init_kv_buffer()
        self.clear()

    # ---- geometry hooks
    @abc.abstractmethod
    def get_size_per_token(self) -> int:
        """Host bytes of one token (all layers), as SGLang sizes the pool."""

    @abc.abstractmethod
    def init_kv_buffer(self) -> None:
        """Declare this pool's host buffers and their layouts (``_add``)."""

    def _add(self, attr: str, kind: str, layout: HostLayout) -> str:
        name = f"{self.prefix}{attr}"
        self.layouts[name] = layout
        self._kinds[name] = kind
        return name

    def buffers(self) -> list[dict]:
        """Schedule-header buffer declarations (location ``host``)."""
        return [buffer_decl(n, "host", self._kinds[n], lay, self.device) for n, lay in self.layouts.items()]

    # ---- slots
    def alloc(self, need_size: int) -> Optional[np.ndarray]:
        if not isinstance(need_size, numbers.Integral) or need_size < 0:
            raise InputError("need_size", f"expected an integer >= 0, got {show(need_size)}")
        if need_size % self.page_size != 0:
            raise InputError("need_size", f"The requested size should be a multiple of the page size "
                                          f"({self.page_size}), got {need_size}")
        return self._take(need_size)

    def free(self, indices) -> int:
        return self._give(_ints(indices, "indices"))

    def _backend(self, io_backend: str) -> str:
        if io_backend not in IO_BACKENDS:
            raise UnsupportedTransfer(f"Unsupported IO backend: {io_backend}")
        return io_backend


class MLATokenToKVPoolHost(HostKVCache):
    """Host mirror of an :class:`MLATokenToKVPool` (``memory_pool_host.py``).

    One unit per token (``token_stride_size = kv_cache_dim * itemsize``
    bytes per layer); ``size_per_token = token_stride_size * layer_num``.
    Buffer ``<prefix>kv_buffer``, kind ``kv`` (the device pool's kind), in
    ``layer_first`` ``(L, size)``, ``page_first`` ``(size, L)`` or
    ``page_first_direct`` ``(page_num, L, page_size)``.
    """

    def __init__(self, device_pool: MLATokenToKVPool, host_to_device_ratio: float, host_size: float,
                 page_size: int, layout: str, *, prefix: str = "host_",
                 host_memory_available: Optional[int] = None):
        if not isinstance(device_pool, MLATokenToKVPool):
            raise InputError("device_pool", f"expected an MLATokenToKVPool, got {type(device_pool).__name__}")
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, prefix=prefix,
                         host_memory_available=host_memory_available)
        self.can_use_jit = can_use_hicache_jit_kernel(self.token_stride_size)
        self.can_use_write_back_jit = (self.layout == "page_first"
                                       and can_use_write_back_jit_kernel(self.token_stride_size))
        self.staging_page_capacity = (min(self.page_num, WRITE_BACK_STAGING_PAGE_CHUNK)
                                      if self.can_use_write_back_jit else 0)

    def get_size_per_token(self) -> int:
        dp = self.device_pool
        self.layer_num = dp.layer_num
        self.kv_cache_dim = dp.kv_cache_dim
        self.token_stride_size = dp.token_stride_size
        return self.token_stride_size * self.layer_num

    def init_kv_buffer(self) -> None:
        dp = self.device_pool
        self.kv_layout = host_mirror(dp.kv_layout, self.layout, units=self.size, page_size=self.page_size,
                                     name=f"host_{dp.kv_layout.name}")
        self.kv_buffer = self._add("kv_buffer", dp.kind_of(dp.kv_buffer), self.kv_layout)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend: str) -> list[dict]:
        """H2D copy ops of layer ``layer_id`` (a local layer index)."""
        h, d = _check_pair(host_indices, device_indices)
        be = self._backend(io_backend)
        args = {"layer": int(layer_id), "src_indices": _lst(h), "dst_indices": _lst(d)}
        if be == "kernel":
            if self.layout == "layer_first":
                note = ("jit_transfer_hicache_one_layer_mla" if self.can_use_jit
                        else "sgl_kernel.transfer_kv_per_layer_mla")
            elif self.layout == "page_first":
                note = ("jit_transfer_hicache_one_layer_mla (page_first per-layer view)" if self.can_use_jit
                        else "sgl_kernel.transfer_kv_per_layer_mla_pf_lf")
            else:
                raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend kernel)")
            return [_copy("kernel_per_layer", self.kv_buffer, device_pool.kv_buffer, args, note)]
        if self.layout == "layer_first":
            note = "sgl_kernel.transfer_kv_direct"
        elif self.layout == "page_first_direct":
            note = "sgl_kernel.transfer_kv_per_layer_direct_pf_lf"
        else:
            raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend direct)")
        args["page_size"] = self.page_size
        return [_copy(_direct_routine(self.layout), self.kv_buffer, device_pool.kv_buffer, args, note)]

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend: str) -> list[dict]:
        """D2H copy ops of one backup of all layers."""
        h, d = _check_pair(host_indices, device_indices)
        be = self._backend(io_backend)
        src, dst = device_pool.kv_buffer, self.kv_buffer
        if be == "kernel":
            if self.layout == "layer_first":
                note = ("jit_transfer_hicache_all_layer_mla" if self.can_use_jit
                        else "sgl_kernel.transfer_kv_all_layer_mla")
                return [_copy("kernel_all_layer", src, dst,
                              {"src_indices": _lst(d), "dst_indices": _lst(h)}, note)]
            if self.layout == "page_first":
                if self.can_use_write_back_jit:
                    return _staged_ops(src, dst, d, h, self.page_size, self.staging_page_capacity,
                                       "jit_transfer_hicache_all_layer_mla_staged_lf_pf")
                return [_copy("kernel_all_layer", src, dst, {"src_indices": _lst(d), "dst_indices": _lst(h)},
                              "sgl_kernel.transfer_kv_all_layer_mla_lf_pf")]
            raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend kernel)")
        if self.layout == "layer_first":
            note = "sgl_kernel.transfer_kv_direct (all layers)"
        elif self.layout == "page_first_direct":
            note = "sgl_kernel.transfer_kv_all_layer_direct_lf_pf"
        else:
            raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend direct)")
        return [_copy(_direct_routine(self.layout), src, dst,
                      {"layer": L, "src_indices": _lst(d), "dst_indices": _lst(h), "page_size": self.page_size},
                      f"{note}, layer {L}") for L in range(self.layer_num)]


def _staged_ops(src: str, dst: str, d: np.ndarray, h: np.ndarray, page_size: int, capacity: int,
                note: str) -> list[dict]:
    """The chunks of the staged write-back: ``capacity`` pages per launch.

    NOTE: SGLang walks ``src_indices[::page_size]`` in chunks of
    ``staging_page_capacity`` pages and slices ``dst_indices`` to the same
    pages; each chunk is one relayout launch plus one memcpy per page.
    """
    n_pages = -(-d.size // page_size)
    ops = []
    for begin in range(0, n_pages, capacity):
        chunk = min(capacity, n_pages - begin)
        lo, hi = begin * page_size, (begin + chunk) * page_size
        ops.append(_copy("staged_all_layer_lf_pf", src, dst,
                         {"src_indices": _lst(d[lo:hi]), "dst_indices": _lst(h[lo:hi]), "page_size": page_size},
                         f"{note} (pages {begin}..{begin + chunk - 1} of {n_pages})"))
    return ops


class DSAIndexerPoolHost(HostKVCache):
    """Host mirror of a :class:`DSATokenToKVPool`'s index-K pages (sidecar of
    the MLA host pool ``anchor_host``, sharing its slot numbers).

    Unit = one index-K page row of ``indexer_page_stride_size`` bytes (8,448);
    ``indexer_page_num = (size + page_size + 1) // page_size`` units.
    ``page_first`` and ``page_first_direct`` have the same shape
    ``(pages, L, 1, stride)``.  Token indices become page indices by
    ``indices.reshape(-1, page_size)[:, 0] // page_size`` (the first token of
    each group decides).  The kernel path needs the stride % 8 == 0; with the
    kernel backend and another stride SGLang raises (ValueError), as here.
    Slots are never allocated from this pool: the group's anchor does it.
    """

    def __init__(self, device_pool: DSATokenToKVPool, anchor_host: MLATokenToKVPoolHost, layout: str, *,
                 prefix: str = "host_"):
        if not isinstance(device_pool, DSATokenToKVPool):
            raise InputError("device_pool", f"expected a DSATokenToKVPool, got {type(device_pool).__name__}")
        if device_pool.bf16_index_k:
            raise InputError("device_pool", "DSAIndexerPoolHost models SGLang's fp8 index-K pages; the bf16 "
                                            "index-K variant has no SGLang host pool")
        if layout not in HOST_LAYOUTS:
            raise InputError("layout", f"expected one of {list(HOST_LAYOUTS)}, got {show(layout)}")
        # NOTE: SGLang does not call HostKVCache.__init__ here: size and page_num
        # are the anchor's, and there is no size > device check of its own.
        self.device_pool = device_pool
        self.page_size = anchor_host.page_size
        self.layout = layout
        self.prefix = prefix
        self.device = device_pool.device
        self.start_layer = device_pool.start_layer
        self.end_layer = device_pool.end_layer
        self.layer_num = device_pool.layer_num
        self.size = anchor_host.size
        self.page_num = anchor_host.page_num
        self.indexer_page_stride_size = device_pool.index_page_bytes
        self.indexer_layout_dim = self.indexer_page_stride_size * self.layer_num
        self.indexer_page_num = (self.size + self.page_size + 1) // self.page_size
        self.size_per_token = self.get_size_per_token()
        self.layouts = {}
        self._kinds = {}
        self.init_kv_buffer()
        self.can_use_jit = False
        self.can_use_write_back_jit = (self.layout == "page_first"
                                       and can_use_write_back_jit_kernel(self.indexer_page_stride_size))
        self.staging_page_capacity = (min(self.indexer_page_num, WRITE_BACK_STAGING_PAGE_CHUNK)
                                      if self.layout == "page_first" else 0)
        self.clear()

    def get_size_per_token(self) -> int:
        return self.indexer_page_stride_size // self.page_size * self.layer_num

    def init_kv_buffer(self) -> None:
        dp = self.device_pool
        shape = "layer_first" if self.layout == "layer_first" else "page_first"
        self.index_k_layout = host_mirror(dp.index_k_layout, shape, units=self.indexer_page_num, page_size=1,
                                          name=f"host_{dp.index_k_layout.name}")
        self.index_k_with_scale_buffer = self._add("index_k_with_scale_buffer", dp.kind_of(dp.index_k_buffer),
                                                   self.index_k_layout)

    def _get_indexer_page_indices(self, host_indices: np.ndarray, device_indices: np.ndarray):
        if host_indices.size == 0:
            return host_indices, device_indices
        if host_indices.size % self.page_size != 0:
            raise InputError("host_indices", "Index buffer transfer expects page-aligned indices for DSA.")
        return (host_indices.reshape(-1, self.page_size)[:, 0] // self.page_size,
                device_indices.reshape(-1, self.page_size)[:, 0] // self.page_size)

    def _use_kernel(self, io_backend: str) -> bool:
        be = self._backend(io_backend)
        use = be == "kernel" and self.indexer_page_stride_size % 8 == 0
        if be == "kernel" and not use:
            raise UnsupportedTransfer(f"Unsupported IO backend: {io_backend} (indexer page stride "
                                      f"{self.indexer_page_stride_size} is not a multiple of 8)")
        return use

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend: str) -> list[dict]:
        h, d = _check_pair(host_indices, device_indices)
        hp, dp = self._get_indexer_page_indices(h, d)
        src, dst = self.index_k_with_scale_buffer, device_pool.index_k_buffer
        if self._use_kernel(io_backend):
            if self.layout == "layer_first":
                note = "sgl_kernel.transfer_kv_per_layer_mla (index-K pages)"
            elif self.layout == "page_first":
                note = "sgl_kernel.transfer_kv_per_layer_mla_pf_lf (index-K pages)"
            else:
                raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend kernel)")
            return [_copy("dsa_indexer_per_layer", src, dst,
                          {"layer": int(layer_id), "src_indices": _lst(h), "dst_indices": _lst(d),
                           "page_size": self.page_size}, note)]
        if self.layout == "layer_first":
            note = "sgl_kernel.transfer_kv_direct (index-K pages, page_size 1)"
        elif self.layout == "page_first_direct":
            note = "sgl_kernel.transfer_kv_per_layer_direct_pf_lf (index-K pages, page_size 1)"
        else:
            raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend direct)")
        return [_copy(_direct_routine(self.layout), src, dst,
                      {"layer": int(layer_id), "src_indices": _lst(hp), "dst_indices": _lst(dp), "page_size": 1},
                      note)]

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend: str) -> list[dict]:
        h, d = _check_pair(host_indices, device_indices)
        hp, dp = self._get_indexer_page_indices(h, d)
        src, dst = device_pool.index_k_buffer, self.index_k_with_scale_buffer
        if self._use_kernel(io_backend):
            if self.layout == "layer_first":
                return [_copy("kernel_all_layer", src, dst, {"src_indices": _lst(dp), "dst_indices": _lst(hp)},
                              "sgl_kernel.transfer_kv_all_layer_mla (index-K pages)")]
            if self.layout == "page_first":
                if self.can_use_write_back_jit:
                    # NOTE: SGLang passes page_size=1: each index-K page row is one "page".
                    return _staged_ops(src, dst, dp, hp, 1, self.staging_page_capacity,
                                       "jit_transfer_hicache_all_layer_mla_staged_lf_pf (index-K pages)")
                return [_copy("kernel_all_layer", src, dst, {"src_indices": _lst(dp), "dst_indices": _lst(hp)},
                              "sgl_kernel.transfer_kv_all_layer_mla_lf_pf (index-K pages)")]
            raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend kernel)")
        if self.layout == "layer_first":
            note = "sgl_kernel.transfer_kv_direct (index-K pages, all layers)"
        elif self.layout == "page_first_direct":
            note = "sgl_kernel.transfer_kv_all_layer_direct_lf_pf (index-K pages)"
        else:
            raise UnsupportedTransfer(f"Unsupported layout: {self.layout} (io backend direct)")
        return [_copy(_direct_routine(self.layout), src, dst,
                      {"layer": L, "src_indices": _lst(dp), "dst_indices": _lst(hp), "page_size": 1},
                      f"{note}, layer {L}") for L in range(self.layer_num)]


# ----------------------------------------------------------------------------
# DeepSeek V4

class LogicalHostPool(_FreeSlots):
    """``memory_pool_host.LogicalHostPool``: the V4 group's anchor, slots only,
    no bytes.  ``alloc`` and ``free`` must be page-aligned (InputError where
    SGLang raises ValueError); loads and backups launch nothing."""

    def __init__(self, size: int, page_size: int, layout: str = "layer_first"):
        if size % page_size != 0:
            raise InputError("size", f"LogicalHostPool size must be page-aligned, got size={size}, "
                                     f"page_size={page_size}")
        self.size = int(size)
        self.page_size = int(page_size)
        self.layout = layout
        self.layer_num = 0
        self.start_layer = self.end_layer = 0
        self.size_per_token = 0
        self.device = 0
        self.can_use_write_back_jit = True
        self.clear()

    def buffers(self) -> list[dict]:
        return []

    def alloc(self, need_size: int) -> Optional[np.ndarray]:
        if need_size % self.page_size != 0:
            raise InputError("need_size", f"LogicalHostPool allocation must be page-aligned, got "
                                          f"need_size={need_size}, page_size={self.page_size}")
        return self._take(need_size)

    def free(self, indices) -> int:
        idx = _ints(indices, "indices")
        if idx.size % self.page_size != 0:
            raise InputError("indices", f"LogicalHostPool free must be page-aligned, got len(indices)="
                                        f"{idx.size}, page_size={self.page_size}")
        return self._give(idx)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend):
        return []

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        return []


def deepseek_v4_num_host_pages(size_full: int, page_size: int, hicache_ratio: float,
                               hicache_size: float = 0) -> int:
    """``hybrid_pool_assembler._deepseek_v4_num_host_pages`` (full pool):
    ``max(int(device_pages * ratio), device_pages + 1)`` with ``device_pages =
    ceil(size_full / page_size)``; ``hicache_size`` is refused as in 0.5.14."""
    if hicache_size > 0:
        raise InputError("hicache_size", "DeepSeek V4 HiCache currently does not support --hicache-size; "
                                         "use --hicache-ratio instead.")
    pages = -(-int(size_full) // int(page_size))
    out = max(int(pages * hicache_ratio), pages + 1)
    _check_host_tokens(out * int(page_size), "hicache_ratio")
    return out


def _check_host_tokens(tokens: int, key: str) -> None:
    """Refuse a host pool past ``MAX_HOST_POOL_TOKENS``, naming the input that sized it."""
    if tokens > MAX_HOST_POOL_TOKENS:
        got = f"{tokens:,}" if tokens < 10 ** 15 else f"{float(tokens):.3g}"
        raise InputError(key, f"expected a host pool of at most {MAX_HOST_POOL_TOKENS:,} tokens "
                              f"(MAX_HOST_POOL_TOKENS), got {got} tokens from it")


class DeepSeekV4PagedHostPool(HostKVCache):
    """``memory_pool_host.DeepSeekV4PagedHostPool``: host mirror of one V4
    paged pool (C4 latent, C4 indexer, C128), one unit per device PAGE ROW.

    ``num_host_pages`` rows of ``item_bytes`` (the device page row) per layer;
    ``size = num_host_pages * slot_page_size`` slots.  ``alloc`` ROUNDS UP to a
    multiple of ``slot_page_size`` (no assertion, unlike HostKVCache).

    Transfers take slot indices (the anchor's full-token indices).  When both
    index counts are multiples of ``slot_page_size``, rows are
    ``indices.reshape(-1, slot_page_size)[:, 0] // slot_page_size`` and the
    page-row routines run (kernel / direct, layer_first / page_first /
    page_first_direct, staged write-back for page_first).  Otherwise the
    token-granular ``transfer_cache_dsv4_mla`` (``dsv4_token``) runs on the RAW
    indices, whatever the io backend, with the C4 constants; it needs the
    per-layer host pointer table, which SGLang builds only for
    ``layer_first`` (for the other layouts ``data_ptrs`` is None and SGLang
    fails: :class:`UnsupportedTransfer` here).  Empty or mismatched index
    lists: nothing is launched / InputError.
    """

    def __init__(self, pool_name: str, device_pool: KVCache, num_host_pages: int, slot_page_size: int,
                 layout: str = "layer_first", *, prefix: str = "host_",
                 host_memory_available: Optional[int] = None, host_bytes_per_entry: int = 0,
                 partial_pages: str = "dsv4_token"):
        if partial_pages not in PARTIAL_PAGE_MODES:
            raise InputError("partial_pages", f"expected one of {list(PARTIAL_PAGE_MODES)}, got {show(partial_pages)}")
        if not isinstance(host_bytes_per_entry, numbers.Integral) or isinstance(host_bytes_per_entry, bool) \
                or host_bytes_per_entry < 0:
            raise InputError("host_bytes_per_entry", f"expected an integer >= 0 (0: the device's), "
                                                     f"got {show(host_bytes_per_entry)}")
        if not isinstance(device_pool, (DeepSeekV4SingleKVPool, DeepSeekV4IndexerPool)):
            raise InputError("device_pool", f"expected a DeepSeekV4SingleKVPool or DeepSeekV4IndexerPool, "
                                            f"got {type(device_pool).__name__}")
        if layout not in HOST_LAYOUTS:
            raise InputError("layout", f"expected one of {list(HOST_LAYOUTS)}, got {show(layout)}")
        # NOTE: SGLang does not run HostKVCache.__init__ for this pool either.
        self.pool_name = pool_name
        self.device_pool = device_pool
        self.layer_num = device_pool.layer_num
        self.device_layout = (device_pool.kv_layout if isinstance(device_pool, DeepSeekV4SingleKVPool)
                              else device_pool.index_k_layout)
        self.device_buffer = (device_pool.kv_buffer if isinstance(device_pool, DeepSeekV4SingleKVPool)
                              else device_pool.index_k_buffer)
        self.partial_pages = partial_pages
        self.host_bytes_per_entry = int(host_bytes_per_entry)
        self.device_item_bytes = self.device_layout.page_bytes
        entries = self.device_layout.entries_per_page
        self.item_bytes = entries * self.host_bytes_per_entry if self.host_bytes_per_entry else self.device_item_bytes
        self.num_host_pages = int(num_host_pages)
        self.slot_page_size = int(slot_page_size)
        self.page_size = self.slot_page_size
        self.size = self.num_host_pages * self.slot_page_size
        self.layout = layout
        self.size_per_token = self.item_bytes
        self.start_layer, self.end_layer = 0, self.layer_num
        self.prefix = prefix
        self.device = device_pool.device
        if host_memory_available is not None:
            requested = self.layer_num * self.num_host_pages * self.item_bytes
            if requested > host_memory_available - HICACHE_HOST_MEMORY_RESERVE_BYTES:
                raise InputError("host_memory_available",
                                 f"Not enough host memory for V4 paged pool {pool_name}")
        self.layouts, self._kinds = {}, {}
        self.init_kv_buffer()
        self.can_use_jit = False
        self.can_use_write_back_jit = (layout == "page_first" and can_use_write_back_jit_kernel(self.item_bytes))
        self.staging_page_capacity = (min(self.num_host_pages, WRITE_BACK_STAGING_PAGE_CHUNK)
                                      if layout == "page_first" else 0)
        self.clear()

    def get_size_per_token(self) -> int:
        return self.item_bytes

    def _host_page_layout(self) -> PagedLayout:
        """The page row the host pool is built with: the device's, or (``host_bytes_per_entry``
        set and different) a row of ``entries_per_page`` entries of that many bytes: 132 B is
        the fp8 indexer packing (128 B keys, then 4 B scales), any other size one field."""
        dev = self.device_layout
        if self.item_bytes == dev.page_bytes and self.host_bytes_per_entry in (0, dev.page_bytes // dev.entries_per_page):
            return dev
        n = dev.entries_per_page
        if self.host_bytes_per_entry == INDEX_HEAD_DIM + INDEX_SCALE_BYTES:
            return c4_indexer(dev.layers, dev.pages) if n == 64 else PagedLayout(
                f"host_{self.host_bytes_per_entry}B_entries", dev.layers, dev.pages, page_bytes=self.item_bytes,
                entries_per_page=n, fields=(Field("key", 0, INDEX_HEAD_DIM),
                                            Field("scale", n * INDEX_HEAD_DIM, INDEX_SCALE_BYTES)))
        return PagedLayout(f"host_{self.host_bytes_per_entry}B_entries", dev.layers, dev.pages,
                           page_bytes=self.item_bytes, entries_per_page=n,
                           fields=(Field("key", 0, self.host_bytes_per_entry),))

    def init_kv_buffer(self) -> None:
        shape = "layer_first" if self.layout == "layer_first" else "page_first"
        row = self._host_page_layout()
        self.kv_layout = host_mirror(row, shape, units=self.num_host_pages, page_size=1, name=f"host_{row.name}")
        self.kv_buffer = self._add(f"{self.pool_name}_kv_buffer", self.device_pool.kind_of(self.device_buffer),
                                   self.kv_layout)

    @property
    def stride_mismatch(self) -> bool:
        """True when the host page row differs in size from the device's (the kernels then
        copy ``item_bytes``, the host's, per row: SGLang passes ``self.item_bytes``)."""
        return self.item_bytes != self.device_item_bytes

    def _item_args(self) -> dict:
        return {"item_bytes": self.item_bytes} if self.stride_mismatch else {}

    def _no_direct_mismatch(self, io_backend: str) -> None:
        if io_backend == "direct" and self.stride_mismatch:
            raise UnsupportedTransfer(
                f"{self.pool_name}: the direct backend copies whole tensor rows (torch index_copy), which "
                f"fails when the host row ({self.item_bytes} B) and the device row ({self.device_item_bytes} B) "
                "differ")

    def _page_rows(self, h: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Page rows of a transfer: whole pages as SGLang reads them (first index of each
        ``slot_page_size`` group // slot_page_size); a partial transfer under
        ``partial_pages="page_aligned"`` is widened to every page its indices touch (in
        order of first touch; host and device must touch as many)."""
        if not self._token_granular(h, d):
            return self._to_page_indices(h), self._to_page_indices(d)
        hr = _first_touch(h // self.slot_page_size)
        dr = _first_touch(d // self.slot_page_size)
        if hr.size != dr.size:
            raise InputError("host_indices", f"{self.pool_name}: widening a partial transfer to whole pages needs "
                                             f"as many host pages as device pages, got {hr.size} and {dr.size}")
        return hr, dr

    def alloc(self, need_size: int) -> Optional[np.ndarray]:
        if not isinstance(need_size, numbers.Integral) or need_size < 0:
            raise InputError("need_size", f"expected an integer >= 0, got {show(need_size)}")
        return self._take(-(-int(need_size) // self.slot_page_size) * self.slot_page_size)

    def _to_page_indices(self, indices: np.ndarray) -> np.ndarray:
        return indices.reshape(-1, self.slot_page_size)[:, 0] // self.slot_page_size

    def _token_granular(self, h: np.ndarray, d: np.ndarray) -> bool:
        return h.size % self.slot_page_size != 0 or d.size % self.slot_page_size != 0

    def _token_path_check(self) -> None:
        if self.layout != "layer_first":
            raise UnsupportedTransfer(
                f"{self.pool_name}: a token-granular transfer uses the per-layer host pointer table, "
                f"which SGLang 0.5.14 builds only for layer_first (data_ptrs is None for {self.layout})")

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend: str) -> list[dict]:
        h, d = _check_pair(host_indices, device_indices)
        if h.size == 0:
            return []
        src, dst = self.kv_buffer, self.device_buffer
        if self._token_granular(h, d) and self.partial_pages == "dsv4_token":
            self._token_path_check()
            return [_copy("dsv4_token", src, dst, {"src_indices": _lst(h), "dst_indices": _lst(d),
                                                   "layers": [int(layer_id)]},
                          f"transfer_cache_dsv4_mla ({self.pool_name}, token-granular)")]
        self._no_direct_mismatch(io_backend)
        hr, dr = self._page_rows(h, d)
        args = {"layer": int(layer_id), "src_indices": _lst(hr), "dst_indices": _lst(dr), **self._item_args()}
        pair = (io_backend, self.layout)
        if pair == ("kernel", "layer_first"):
            return [_copy("kernel_per_layer", src, dst, args, "sgl_kernel.transfer_kv_per_layer_mla (page rows)")]
        if pair == ("kernel", "page_first"):
            return [_copy("kernel_per_layer", src, dst, args,
                          "sgl_kernel.transfer_kv_per_layer_mla_pf_lf (page rows)")]
        if pair in (("direct", "layer_first"), ("direct", "page_first_direct")):
            args["page_size"] = 1
            fn = "transfer_kv_direct" if self.layout == "layer_first" else "transfer_kv_per_layer_direct_pf_lf"
            return [_copy(_direct_routine(self.layout), src, dst, args, f"sgl_kernel.{fn} (page rows)")]
        raise UnsupportedTransfer(f"Unsupported V4 paged host layout/backend: {self.layout}/{io_backend}")

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend: str) -> list[dict]:
        h, d = _check_pair(host_indices, device_indices)
        if h.size == 0:
            return []
        src, dst = self.device_buffer, self.kv_buffer
        if self._token_granular(h, d) and self.partial_pages == "dsv4_token":
            self._token_path_check()
            return [_copy("dsv4_token", src, dst, {"src_indices": _lst(d), "dst_indices": _lst(h),
                                                   "layers": list(range(self.layer_num))},
                          f"transfer_cache_dsv4_mla ({self.pool_name}, token-granular, all layers)")]
        self._no_direct_mismatch(io_backend)
        hr, dr = self._page_rows(h, d)
        pair = (io_backend, self.layout)
        item = self._item_args()
        if pair == ("kernel", "layer_first"):
            return [_copy("kernel_all_layer", src, dst, {"src_indices": _lst(dr), "dst_indices": _lst(hr), **item},
                          "sgl_kernel.transfer_kv_all_layer_mla (page rows)")]
        if pair == ("kernel", "page_first"):
            if self.can_use_write_back_jit and not item:
                return _staged_ops(src, dst, dr, hr, 1, self.staging_page_capacity,
                                   f"jit_transfer_hicache_all_layer_mla_staged_lf_pf ({self.pool_name} page rows)")
            return [_copy("kernel_all_layer", src, dst, {"src_indices": _lst(dr), "dst_indices": _lst(hr), **item},
                          "sgl_kernel.transfer_kv_all_layer_mla_lf_pf (page rows)")]
        if pair in (("direct", "layer_first"), ("direct", "page_first_direct")):
            fn = "transfer_kv_direct" if self.layout == "layer_first" else "transfer_kv_all_layer_direct_lf_pf"
            return [_copy(_direct_routine(self.layout), src, dst,
                          {"layer": L, "src_indices": _lst(dr), "dst_indices": _lst(hr), "page_size": 1},
                          f"sgl_kernel.{fn} (page rows), layer {L}") for L in range(self.layer_num)]
        raise UnsupportedTransfer(f"Unsupported V4 paged host layout/backend: {self.layout}/{io_backend}")


# ----------------------------------------------------------------------------
# groups

@dataclass
class PoolEntry:
    """``memory_pool_host.PoolEntry``: one pool of a :class:`HostPoolGroup`.

    ``layer_mapper(global layer) -> local layer or None`` (None: the pool has
    no such layer, nothing is copied).  The anchor (``is_primary_index_anchor``,
    else the first entry) owns the host slots.
    """

    name: str
    host_pool: Any
    device_pool: Any
    layer_mapper: Callable[[int], Optional[int]]
    is_primary_index_anchor: bool = False


@dataclass
class PoolTransfer:
    """``hicache_storage.PoolTransfer`` (the fields a load or backup uses):
    the sidecar pool ``name`` and its own host/device indices."""

    name: str
    host_indices: Optional[np.ndarray]
    device_indices: Optional[np.ndarray] = None


def _identity(layer: int) -> Optional[int]:
    return layer


class HostPoolGroup:
    """``memory_pool_host.HostPoolGroup``: an anchor host pool plus sidecars.

    ``alloc``/``free``/``available_size``/``size``/``page_size``/``layout``
    are the anchor's.  A load of layer i emits the anchor's layer-i copy
    (skipped when no host indices, as in SGLang), then each pool transfer's
    layer-i copy in the order of ``pool_transfers``.  A backup emits the
    anchor's backup, then each pool transfer's.

    ``pool_transfers=None`` means what the DSA stack's controller builds in
    0.5.14: every sidecar, in entry order, with the anchor's indices
    (``SidecarPoolSpec(indices_from_pool=KV)``).  Pass ``[]`` for none.
    """

    def __init__(self, entries: list[PoolEntry]):
        if not entries:
            raise InputError("entries", "HostPoolGroup requires at least one pool entry.")
        self.entries = list(entries)
        self.entry_map = {e.name: e for e in self.entries}
        self.anchor_entry = next((e for e in self.entries if e.is_primary_index_anchor), self.entries[0])
        anchor = self.anchor_entry.host_pool
        self.layout = anchor.layout
        self.page_size = anchor.page_size
        self.device = anchor.device
        self.size = anchor.size
        self.can_use_write_back_jit = all(getattr(e.host_pool, "can_use_write_back_jit", False)
                                          for e in self.entries)

    @property
    def start_layer(self) -> int:
        return self.anchor_entry.host_pool.start_layer

    @property
    def end_layer(self) -> int:
        return self.anchor_entry.host_pool.end_layer

    @property
    def size_per_token(self) -> int:
        return self.anchor_entry.host_pool.size_per_token

    @property
    def free_slots(self) -> np.ndarray:
        return self.anchor_entry.host_pool.free_slots

    def get_pool(self, name: str):
        return self.entry_map[name].host_pool

    def buffers(self) -> list[dict]:
        """Every entry's host buffers, anchor first, then the others in entry order."""
        out = list(self.anchor_entry.host_pool.buffers())
        for e in self.entries:
            if e is not self.anchor_entry:
                out.extend(e.host_pool.buffers())
        return out

    def device_buffers(self) -> list[dict]:
        """The device buffers of every entry's device pool (each buffer once,
        anchor's pool first)."""
        seen, out = set(), []
        for e in [self.anchor_entry] + [e for e in self.entries if e is not self.anchor_entry]:
            for b in e.device_pool.buffers():
                if b["name"] not in seen:
                    seen.add(b["name"])
                    out.append(b)
        return out

    def clear(self) -> None:
        for e in self.entries:
            e.host_pool.clear()

    def available_size(self) -> int:
        return self.anchor_entry.host_pool.available_size()

    def alloc(self, need_size: int):
        return self.anchor_entry.host_pool.alloc(need_size)

    def free(self, indices) -> int:
        return self.anchor_entry.host_pool.free(indices)

    def _transfers(self, host_indices, device_indices, pool_transfers):
        if pool_transfers is None:
            return [PoolTransfer(e.name, host_indices, device_indices)
                    for e in self.entries if e is not self.anchor_entry]
        return pool_transfers

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend: str, pool_transfers: Optional[list] = None) -> list[dict]:
        """Layer ``layer_id``'s copies: anchor, then each sidecar (SGLang order).
        ``device_pool`` is accepted for SGLang's signature; each entry's own
        device pool is used, as in SGLang."""
        h = _ints(host_indices, "host_indices")
        ops: list[dict] = []
        anchor = self.anchor_entry
        local = anchor.layer_mapper(layer_id)
        if local is not None and h.size > 0:
            ops += anchor.host_pool.load_to_device_per_layer(anchor.device_pool, h, device_indices, local,
                                                             io_backend)
        for t in self._transfers(h, device_indices, pool_transfers):
            entry = self.entry_map.get(t.name)
            if entry is None or t.host_indices is None:
                continue
            local = entry.layer_mapper(layer_id)
            if local is None:
                continue
            ops += entry.host_pool.load_to_device_per_layer(entry.device_pool, t.host_indices, t.device_indices,
                                                            local, io_backend)
        return ops

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend: str,
                                     pool_transfers: Optional[list] = None) -> list[dict]:
        """One backup: the anchor's all-layer copy, then each sidecar's."""
        anchor = self.anchor_entry
        ops = list(anchor.host_pool.backup_from_device_all_layer(anchor.device_pool, host_indices,
                                                                 device_indices, io_backend))
        for t in self._transfers(host_indices, device_indices, pool_transfers):
            entry = self.entry_map.get(t.name)
            if entry is None or t.host_indices is None:
                continue
            ops += entry.host_pool.backup_from_device_all_layer(entry.device_pool, t.host_indices,
                                                                t.device_indices, io_backend)
        return ops

    @classmethod
    def for_dsa(cls, device_pool: DSATokenToKVPool, host_to_device_ratio: float, host_size: float,
                layout: str, *, prefix: str = "host_",
                host_memory_available: Optional[int] = None) -> "HostPoolGroup":
        """The DSA stack of 0.5.14 (``hybrid_pool_assembler._DsaStrategy``):
        anchor ``kv`` = MLATokenToKVPoolHost, sidecar ``indexer`` =
        DSAIndexerPoolHost, identity layer mapping."""
        kv = MLATokenToKVPoolHost(device_pool, host_to_device_ratio, host_size, device_pool.page_size, layout,
                                  prefix=prefix, host_memory_available=host_memory_available)
        ix = DSAIndexerPoolHost(device_pool, kv, layout, prefix=prefix)
        return cls([PoolEntry("kv", kv, device_pool, _identity, True),
                    PoolEntry("indexer", ix, device_pool, _identity)])

    @classmethod
    def for_deepseek_v4(cls, device_pool: DeepSeekV4TokenToKVPool, hicache_ratio: float, layout: str, *,
                        size_full: Optional[int] = None, hicache_size: float = 0, prefix: str = "host_",
                        host_memory_available: Optional[int] = None, index_k_host_bytes_per_entry: int = 0,
                        index_k_partial_pages: str = "dsv4_token") -> "HostPoolGroup":
        """The V4 stack of 0.5.14 (``build_deepseek_v4_hicache_stack``) without the
        compressor-state pools: anchor ``kv`` = LogicalHostPool of ``num_host_pages *
        page_size`` slots, then ``swa`` (when the device pool has its SWA pool; every
        layer, identity mapping), ``deepseek_v4_c4``, ``deepseek_v4_c4_indexer`` and (with
        C128 layers) ``deepseek_v4_c128``, each a DeepSeekV4PagedHostPool with
        ``slot_page_size = page_size`` and a layer mapper global layer -> its pool layer
        (None for other layers).  ``size_full`` defaults to the device pool's ``size``.

        NOTE: SGLang sizes the SWA host pool from the SWA pool's own pages
        (``swa_num_host_pages``, same formula); with the identity SWA mapping of
        :class:`DeepSeekV4TokenToKVPool` that is ``num_host_pages``.  SGLang moves SWA as a
        tree component of its own (indices from the SWA allocator, only the trailing pages
        on a hit); here it is a sidecar with the anchor's indices, like C4 and C128.

        The incident's switches act on the indexer entry only:
        ``index_k_host_bytes_per_entry`` (0: the device's row) builds its host rows of
        ``64 * n`` bytes; ``index_k_partial_pages`` picks how it copies a partial page
        (:data:`PARTIAL_PAGE_MODES`; default SGLang's ``dsv4_token``)."""
        ps = device_pool.page_size
        pages = deepseek_v4_num_host_pages(device_pool.size if size_full is None else size_full, ps,
                                           hicache_ratio, hicache_size)
        n_layers = device_pool.layer_num

        def mapper(mapping: dict[int, int]) -> Callable[[int], Optional[int]]:
            return lambda layer: mapping.get(layer) if 0 <= layer < n_layers else None

        entries = [PoolEntry("kv", LogicalHostPool(pages * ps, ps, layout), device_pool,
                             mapper({i: i for i in range(n_layers)}), True)]
        kw = dict(prefix=prefix, host_memory_available=host_memory_available)
        if device_pool.swa_kv_pool is not None:
            entries.append(PoolEntry("swa", DeepSeekV4PagedHostPool(
                "swa", device_pool.swa_kv_pool, pages, ps, layout, **kw), device_pool.swa_kv_pool,
                mapper({i: i for i in range(n_layers)})))
        c4 = device_pool.layers_of(4)
        entries.append(PoolEntry("deepseek_v4_c4", DeepSeekV4PagedHostPool(
            "deepseek_v4_c4", device_pool.c4_kv_pool, pages, ps, layout, **kw), device_pool.c4_kv_pool, mapper(c4)))
        entries.append(PoolEntry("deepseek_v4_c4_indexer", DeepSeekV4PagedHostPool(
            "deepseek_v4_c4_indexer", device_pool.c4_indexer_kv_pool, pages, ps, layout,
            host_bytes_per_entry=index_k_host_bytes_per_entry, partial_pages=index_k_partial_pages, **kw),
            device_pool.c4_indexer_kv_pool, mapper(c4)))
        if device_pool.c128_kv_pool is not None:
            entries.append(PoolEntry("deepseek_v4_c128", DeepSeekV4PagedHostPool(
                "deepseek_v4_c128", device_pool.c128_kv_pool, pages, ps, layout, **kw),
                device_pool.c128_kv_pool, mapper(device_pool.layers_of(128))))
        return cls(entries)
