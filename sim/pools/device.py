"""Device KV pools: geometry and schedule buffer declarations.

Models the buffers of SGLang 0.5.14's ``MLATokenToKVPool`` and
``DSATokenToKVPool`` (``mem_cache/memory_pool.py``) and the parts of
``DeepSeekV4TokenToKVPool`` (``mem_cache/deepseek_v4_memory_pool.py``) that the
HiCache incident needs.  A pool holds no bytes: the executor's Memory does.  A
pool knows its geometry (a :mod:`sim.pools.layouts` preset per buffer) and
declares its buffers in the schedule-header format of :mod:`sim.schedule`,
every name prefixed by ``prefix`` so several devices or ranks coexist in one run.

Every pool has ``size``, ``page_size``, ``layer_num``, ``start_layer``,
``end_layer``, ``device`` (the device ordinal of its buffers), ``buffers()``
and ``layouts`` (buffer name -> layout).
"""
from __future__ import annotations

import numbers
from types import MappingProxyType
from typing import Any

import numpy as np

from sim.errors import InputError, show
from sim.pools import layouts as _layouts
from sim.pools.layouts import (
    DSA_PAGE_SIZE, INDEX_HEAD_DIM, INDEX_SCALE_BYTES, Layout, PagedLayout, dsa_index_k, layout_to_json,
    token_rows,
)

__all__ = [
    "MAX_DEVICE_POOL_TOKENS",
    "POOL_ROLE_OF_KIND",
    "DEEPSEEK_V4_FLASH_LAYERS",
    "deepseek_v4_flash_ratios",
    "KVCache",
    "MLATokenToKVPool",
    "DSATokenToKVPool",
    "DeepSeekV4SingleKVPool",
    "DeepSeekV4IndexerPool",
    "DeepSeekV4TokenToKVPool",
    "buffer_decl",
]


#: device buffer kind -> the forward model's pool role (``sim.engine.models`` ``PoolSpec.role``):
#: the MLA/DSA latent is ``latent``; every index-K variant (DSA fp8 pages, V4 C4 indexer fp8
#: pages, the fork's bf16 rows) is ``index_k``; the V4 pools keep their names.
POOL_ROLE_OF_KIND = MappingProxyType({
    "kv": "latent", "index_k": "index_k", "c4_indexer": "index_k", "index_k_bf16": "index_k",
    "swa": "swa", "c4": "c4", "c128": "c128",
})

#: the largest device pool the model builds, in tokens (a GPU's pool holds a few million; the
#: allocator's free list and the request-to-token rows are arrays of this length)
MAX_DEVICE_POOL_TOKENS = 1 << 26

#: layers of DeepSeek V4-Flash (``sim.engine.models`` family ``deepseek-v4-flash``)
DEEPSEEK_V4_FLASH_LAYERS = 43


def deepseek_v4_flash_ratios(layers: int = DEEPSEEK_V4_FLASH_LAYERS) -> list[int]:
    """The compression ratio of each of the first ``layers`` layers of DeepSeek V4-Flash:
    layers 0-1 sliding-window only (0), then C4 (4) and C128 (128) alternating, starting
    with C4 (the layer kinds of ``sim.engine.models``' ``deepseek-v4-flash``; a test keeps
    the two equal)."""
    n = _int(layers, "layers")
    if n > DEEPSEEK_V4_FLASH_LAYERS:
        raise InputError("layers", f"expected at most {DEEPSEEK_V4_FLASH_LAYERS} (DeepSeek V4-Flash), got {n}")
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n)]


def _int(v: Any, where: str, minimum: int = 1) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < minimum:
        raise InputError(where, f"expected an integer >= {minimum}, got {show(v)}")
    return int(v)


def _slots(token_slots) -> np.ndarray:
    a = np.asarray(token_slots)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise InputError("token_slots", f"expected integer slot indices, got dtype {a.dtype}")
    return a.astype(np.int64).reshape(-1)


def buffer_decl(name: str, location: str, kind: str, layout: Layout, device: int = 0,
                description: str | None = None) -> dict:
    """One ``buffers`` entry of a schedule header (explicit layout form)."""
    d = {"name": name, "location": location, "device": int(device), "kind": kind,
         "layout": layout_to_json(layout)}
    if description:
        d["description"] = description
    return d


class KVCache:
    """Common attributes of a device pool (SGLang ``KVCache``).

    ``start_layer`` is the first global layer this pool holds (pipeline
    parallelism); buffers are indexed by the local layer ``layer_id -
    start_layer`` as in SGLang.
    """

    def __init__(self, size: int, page_size: int, layer_num: int, *, start_layer: int = 0,
                 prefix: str = "", device: int = 0):
        self.size = _int(size, "size")
        self.page_size = _int(page_size, "page_size")
        self.layer_num = _int(layer_num, "layer_num")
        self.start_layer = _int(start_layer, "start_layer", 0)
        self.end_layer = self.start_layer + self.layer_num - 1
        if not isinstance(prefix, str):
            raise InputError("prefix", f"expected a string, got {show(prefix)}")
        self.prefix = prefix
        self.device = _int(device, "device", 0)
        self.layouts: dict[str, Layout] = {}
        self._kinds: dict[str, str] = {}

    def _add(self, attr: str, kind: str, layout: PagedLayout) -> str:
        name = f"{self.prefix}{attr}"
        self.layouts[name] = layout
        self._kinds[name] = kind
        return name

    def buffers(self) -> list[dict]:
        """Schedule-header buffer declarations of this pool, in declaration order."""
        return [buffer_decl(n, "device", self._kinds[n], lay, self.device) for n, lay in self.layouts.items()]

    def kind_of(self, name: str) -> str:
        """The kind of device buffer ``name`` (schedule-header ``kind``)."""
        if name not in self._kinds:
            raise InputError("buffer", f"unknown device buffer {show(name)}; expected one of {sorted(self._kinds)}")
        return self._kinds[name]

    def role_of(self, name: str) -> str:
        """The forward model's pool role of device buffer ``name``
        (:data:`POOL_ROLE_OF_KIND` of its kind)."""
        return POOL_ROLE_OF_KIND[self.kind_of(name)]

    def entries_of(self, name: str, token_slots) -> np.ndarray:
        """The entry indices of buffer ``name``'s layout that hold the KV of the full
        pool's ``token_slots`` (what a kernel reading those tokens reads; pass them to
        ``layout.token_extents``).  Uncompressed pools: the slots themselves."""
        self.kind_of(name)
        return _slots(token_slots)

    def model_layers_of(self, name: str) -> list[int]:
        """The model layers (global, ``start_layer`` based) that own a slice of buffer
        ``name``, in pool-layer order: pool layer ``k`` of the buffer is model layer
        ``model_layers_of(name)[k]``.  Plain pools: every layer."""
        self.kind_of(name)
        return list(range(self.start_layer, self.start_layer + self.layer_num))


class MLATokenToKVPool(KVCache):
    """MLA latent pool: per layer ``size + page_size`` token rows of
    ``kv_cache_dim * itemsize`` bytes (slot 0 and the tail page are padding).

    ``kv_cache_dim`` is ``kv_lora_rank + qk_rope_head_dim`` unless overridden
    (DSA's fp8 latent: 656 elements of 1 byte).  Buffer ``<prefix>kv_buffer``,
    kind ``kv``.  ``token_stride_size`` is the row in bytes.
    """

    def __init__(self, size: int, page_size: int, layer_num: int, *, kv_lora_rank: int = 512,
                 qk_rope_head_dim: int = 64, itemsize: int = 2, override_kv_cache_dim: int | None = None,
                 start_layer: int = 0, prefix: str = "", device: int = 0):
        super().__init__(size, page_size, layer_num, start_layer=start_layer, prefix=prefix, device=device)
        self.kv_lora_rank = _int(kv_lora_rank, "kv_lora_rank")
        self.qk_rope_head_dim = _int(qk_rope_head_dim, "qk_rope_head_dim", 0)
        self.itemsize = _int(itemsize, "itemsize")
        self.kv_cache_dim = (_int(override_kv_cache_dim, "override_kv_cache_dim")
                             if override_kv_cache_dim is not None else self.kv_lora_rank + self.qk_rope_head_dim)
        self.token_stride_size = self.kv_cache_dim * self.itemsize
        self.kv_layout = token_rows(self.token_stride_size, self.layer_num, self.size, self.page_size)
        self.kv_buffer = self._add("kv_buffer", "kv", self.kv_layout)


class DSATokenToKVPool(MLATokenToKVPool):
    """DSA (DeepSeek V3.2 / GLM-5) pool: the MLA latent plus the indexer's
    index-K buffer, the sidecar HiCache moves beside the latent.

    SGLang asserts ``page_size == 64`` on CUDA.  Index-K: per layer
    ``(index_buf_size + page_size + 1) // page_size`` pages of 64 x 128 B fp8
    keys then 64 x 4 B scales (``dsa_index_k`` preset); buffer
    ``<prefix>index_k_with_scale_buffer``, kind ``index_k``.  With
    ``bf16_index_k=True`` (the incident's fork, not in SGLang) it is instead
    ``size + page_size`` rows of 256 B (``bf16_index_k`` preset), buffer
    ``<prefix>index_k_buffer``.  Default latent: fp8 ``kv_cache_dim`` 656
    (512 nope + 4 x 4 B scales + 64 x 2 B rope) at itemsize 1.
    """

    quant_block_size = 128

    def __init__(self, size: int, page_size: int, layer_num: int, *, kv_cache_dim: int = 656,
                 itemsize: int = 1, index_head_dim: int = INDEX_HEAD_DIM, index_buf_size: int | None = None,
                 bf16_index_k: bool = False, start_layer: int = 0, prefix: str = "", device: int = 0):
        if page_size != DSA_PAGE_SIZE:
            raise InputError("page_size", f"DSATokenToKVPool needs page_size {DSA_PAGE_SIZE} "
                                          f"(SGLang asserts it on CUDA), got {show(page_size)}")
        if index_head_dim != INDEX_HEAD_DIM:
            raise InputError("index_head_dim", f"expected {INDEX_HEAD_DIM} (SGLang asserts it), "
                                               f"got {show(index_head_dim)}")
        super().__init__(size, page_size, layer_num, kv_lora_rank=512, qk_rope_head_dim=64,
                         itemsize=itemsize, override_kv_cache_dim=kv_cache_dim, start_layer=start_layer,
                         prefix=prefix, device=device)
        self.index_head_dim = index_head_dim
        self.index_buf_size = self.size if index_buf_size is None else _int(index_buf_size, "index_buf_size")
        self.bf16_index_k = bool(bf16_index_k)
        if self.bf16_index_k:
            self.index_k_layout = _layouts.bf16_index_k(self.layer_num, self.size + self.page_size)
            self.index_k_buffer = self._add("index_k_buffer", "index_k", self.index_k_layout)
        else:
            self.index_page_num = (self.index_buf_size + self.page_size + 1) // self.page_size
            self.index_k_layout = dsa_index_k(self.layer_num, self.index_page_num)
            self.index_k_buffer = self._add("index_k_with_scale_buffer", "index_k", self.index_k_layout)
        #: bytes of one index-K page row (SGLang ``indexer_page_stride_size``)
        self.index_page_bytes = self.page_size * (index_head_dim + index_head_dim // self.quant_block_size
                                                  * INDEX_SCALE_BYTES)


class DeepSeekV4SingleKVPool(KVCache):
    """One DeepSeek V4 latent pool (``deepseek_v4_memory_pool.py``
    ``DeepSeekV4SingleKVPool``): per layer ``(size + page_size + 1) // page_size``
    page rows of ``bytes_per_page_padded`` bytes (584 B entries: 576 B value, 8 B
    scale, the page padded to a multiple of 576 B).  ``page_size`` counts entries per
    page: 64 for C4 (preset ``c4_paged``), 2 for C128 (preset ``c128_paged``), i.e.
    SGLang's ``page_size // 4`` and ``page_size // 128`` at page_size 256, and 256 for the
    sliding-window pool ``swa`` (preset ``swa_paged``: paged SWA, ``swa_page_size`` =
    page_size = 256, one entry per token).  ``ratio``: raw tokens per entry (4, 128, 1).
    Buffer ``<prefix><name>_kv_buffer``, kind ``name``.
    """

    PRESETS = {"c4": (_layouts.c4_paged, 64, 4), "c128": (_layouts.c128_paged, 2, 128),
               "swa": (_layouts.swa_paged, 256, 1)}

    def __init__(self, name: str, size: int, layer_num: int, *, start_layer: int = 0, prefix: str = "",
                 device: int = 0):
        if name not in self.PRESETS:
            raise InputError("name", f"expected one of {sorted(self.PRESETS)}, got {show(name)}")
        preset, entries, ratio = self.PRESETS[name]
        super().__init__(size, entries, layer_num, start_layer=start_layer, prefix=prefix, device=device)
        self.name = name
        self.ratio = ratio
        self.num_pages = (self.size + self.page_size + 1) // self.page_size
        self.kv_layout = preset(self.layer_num, self.num_pages)
        self.bytes_per_page_padded = self.kv_layout.page_bytes
        self.kv_buffer = self._add(f"{name}_kv_buffer", name, self.kv_layout)


class DeepSeekV4IndexerPool(KVCache):
    """The C4 indexer pool (``DeepSeekV4IndexerPool``): per layer
    ``(size + page_size + 1) // page_size`` pages of 64 x (128 B fp8 key +
    4 B scale) = 8,448 B (preset ``c4_indexer``).  Buffer
    ``<prefix>c4_indexer_index_k_with_scale_buffer``, kind ``c4_indexer``.

    ``bf16_index_k=True`` models the incident's fork instead: 64 contiguous
    bf16 rows of 256 B per page (16,384 B; the row is the ``bf16_index_k``
    preset's), kind ``index_k_bf16``.  Not in SGLang.
    """

    def __init__(self, size: int, layer_num: int, *, bf16_index_k: bool = False, start_layer: int = 0,
                 prefix: str = "", device: int = 0):
        super().__init__(size, 64, layer_num, start_layer=start_layer, prefix=prefix, device=device)
        self.num_pages = (self.size + self.page_size + 1) // self.page_size
        self.bf16_index_k = bool(bf16_index_k)
        if self.bf16_index_k:
            row = _layouts.bf16_index_k(1, 1).page_bytes
            self.index_k_layout = PagedLayout("bf16_index_k_paged", self.layer_num, self.num_pages,
                                              page_bytes=self.page_size * row, entries_per_page=self.page_size,
                                              fields=(_layouts.Field("key", 0, row),))
            kind = "index_k_bf16"
        else:
            self.index_k_layout = _layouts.c4_indexer(self.layer_num, self.num_pages)
            kind = "c4_indexer"
        self.bytes_per_page = self.index_k_layout.page_bytes
        self.index_k_buffer = self._add("c4_indexer_index_k_with_scale_buffer", kind, self.index_k_layout)


class DeepSeekV4TokenToKVPool(KVCache):
    """The parts of ``DeepSeekV4TokenToKVPool`` the HiCache incident needs:
    ``swa_kv_pool`` (only with ``with_swa=True``), ``c4_kv_pool``, ``c128_kv_pool``
    (None without C128 layers) and ``c4_indexer_kv_pool``.  Not modelled: the
    compressor state pools and the unified-KV (Triton) variant.

    ``size`` is the full-token capacity (the allocator's); ``page_size`` must
    be 256 (the presets fix 64 C4 entries and 2 C128 entries per page, i.e.
    256 tokens).  NOTE: SGLang receives ``c4_size`` / ``c128_size`` from its
    memory profiler; here ``c4_size = size // 4`` and ``c128_size =
    size // 128`` (so a C4 page row p holds the entries of full page p), and
    the indexer has ``c4_logical_size = c128_size * 32`` entries as on CUDA.
    NOTE: SGLang's SWA pool has its own size and allocator (``swa_attn_allocator``,
    ``full_to_swa_index_mapping``); here ``swa_size = size`` and a full slot's SWA
    slot is the same number (identity mapping), so SWA page row p is full page p.
    ``compression_ratios`` (0, 4 or 128 per layer) gives ``layer_mapping``:
    per layer ``(compress_ratio, compress_layer_id)``; the C4/C128 buffers are indexed
    by ``compress_layer_id``, the SWA buffer by the layer itself (every layer has one).

    Full slot -> entries (:meth:`entries_of`): SWA entry = the slot; a C4 (C4 indexer)
    / C128 entry ``e`` holds the compressed token of slots ``e*r .. e*r + r - 1`` and is
    written when its last slot is (SGLang's ``translate_loc_from_full_to_compressed``:
    slots with ``(slot + 1) % r == 0`` give entry ``slot // r``).
    """

    PAGE_SIZE = 256

    def __init__(self, size: int, page_size: int, compression_ratios, *, bf16_index_k: bool = False,
                 with_swa: bool = False, start_layer: int = 0, prefix: str = "", device: int = 0):
        ratios = list(compression_ratios) if isinstance(compression_ratios, (list, tuple)) else None
        if not ratios or any(r not in (0, 4, 128) for r in ratios):
            raise InputError("compression_ratios", f"expected a non-empty list of 0, 4 or 128 per layer, "
                                                   f"got {show(compression_ratios)}")
        if page_size != self.PAGE_SIZE:
            raise InputError("page_size", f"expected {self.PAGE_SIZE} (64 C4 entries and 2 C128 entries "
                                          f"per page, as the presets fix them), got {show(page_size)}")
        super().__init__(size, page_size, len(ratios), start_layer=start_layer, prefix=prefix, device=device)
        self.compression_ratios = ratios
        counts = {0: 0, 4: 0, 128: 0}
        self.layer_mapping: list[tuple[int, int]] = []
        for r in ratios:
            self.layer_mapping.append((r, counts[r]))
            counts[r] += 1
        self.c4_size = self.size // 4
        self.c128_size = self.size // 128
        self.c4_logical_size = self.c128_size * 32
        if counts[4] == 0:
            raise InputError("compression_ratios", "expected at least one C4 layer (ratio 4)")
        kw = dict(prefix=prefix, device=device)
        self.swa_kv_pool = DeepSeekV4SingleKVPool("swa", self.size, len(ratios), **kw) if with_swa else None
        self.c4_kv_pool = DeepSeekV4SingleKVPool("c4", self.c4_size, counts[4], **kw)
        self.c128_kv_pool = (DeepSeekV4SingleKVPool("c128", self.c128_size, counts[128], **kw)
                             if counts[128] else None)
        self.c4_indexer_kv_pool = DeepSeekV4IndexerPool(self.c4_logical_size, counts[4],
                                                        bf16_index_k=bf16_index_k, **kw)
        #: buffer name -> (raw tokens per entry, model layers in pool-layer order)
        self._geometry: dict[str, tuple[int, list[int]]] = {}
        ratio_layers = {r: [self.start_layer + i for i, (rr, _) in enumerate(self.layer_mapping) if rr == r]
                        for r in (4, 128)}
        for sub in self.sub_pools():
            self.layouts.update(sub.layouts)
            self._kinds.update(sub._kinds)
            if sub is self.swa_kv_pool:
                geo = (1, list(range(self.start_layer, self.start_layer + len(ratios))))
            elif sub is self.c128_kv_pool:
                geo = (128, ratio_layers[128])
            else:
                geo = (4, ratio_layers[4])
            for name in sub.layouts:
                self._geometry[name] = geo

    def sub_pools(self) -> list[KVCache]:
        """SWA (when present), C4, C4 indexer, then C128 (when present): the order of
        SGLang's V4 HiCache stack entries."""
        out = [self.swa_kv_pool] if self.swa_kv_pool is not None else []
        out += [self.c4_kv_pool, self.c4_indexer_kv_pool]
        return out + ([self.c128_kv_pool] if self.c128_kv_pool is not None else [])

    def layers_of(self, ratio: int) -> dict[int, int]:
        """Global layer -> compress_layer_id for the layers of one ratio."""
        return {i: cid for i, (r, cid) in enumerate(self.layer_mapping) if r == ratio}

    def ratio_of(self, name: str) -> int:
        """Raw tokens per entry of buffer ``name`` (1 for SWA)."""
        self.kind_of(name)
        return self._geometry[name][0]

    def entries_of(self, name: str, token_slots) -> np.ndarray:
        """Entries of buffer ``name`` holding the KV of full slots ``token_slots`` (see the
        class doc): SWA the slots; compressed pools ``slot // r`` of the slots that complete
        their group of ``r`` (an incomplete group has no entry yet), in slot order."""
        r = self.ratio_of(name)
        s = _slots(token_slots)
        if r == 1:
            return s
        return s[(s + 1) % r == 0] // r

    def model_layers_of(self, name: str) -> list[int]:
        self.kind_of(name)
        return list(self._geometry[name][1])
