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
from typing import Any

from sim.errors import InputError, show
from sim.pools import layouts as _layouts
from sim.pools.layouts import (
    DSA_PAGE_SIZE, INDEX_HEAD_DIM, INDEX_SCALE_BYTES, Layout, PagedLayout, dsa_index_k, layout_to_json,
    token_rows,
)

__all__ = [
    "KVCache",
    "MLATokenToKVPool",
    "DSATokenToKVPool",
    "DeepSeekV4SingleKVPool",
    "DeepSeekV4IndexerPool",
    "DeepSeekV4TokenToKVPool",
    "buffer_decl",
]


def _int(v: Any, where: str, minimum: int = 1) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < minimum:
        raise InputError(where, f"expected an integer >= {minimum}, got {show(v)}")
    return int(v)


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
        return self._kinds[name]


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
    """One DeepSeek V4 compressed latent pool (``deepseek_v4_memory_pool.py``
    ``DeepSeekV4SingleKVPool``): per layer ``(size + page_size + 1) // page_size``
    page rows of ``bytes_per_page_padded`` bytes (584 B entries, padded to a
    multiple of 576 B).  ``page_size`` counts compressed entries per page: 64
    for C4 (preset ``c4_paged``), 2 for C128 (preset ``c128_paged``), i.e.
    SGLang's ``page_size // 4`` and ``page_size // 128`` at page_size 256.
    Buffer ``<prefix><name>_kv_buffer``.
    """

    PRESETS = {"c4": (_layouts.c4_paged, 64), "c128": (_layouts.c128_paged, 2)}

    def __init__(self, name: str, size: int, layer_num: int, *, start_layer: int = 0, prefix: str = "",
                 device: int = 0):
        if name not in self.PRESETS:
            raise InputError("name", f"expected one of {sorted(self.PRESETS)}, got {show(name)}")
        preset, entries = self.PRESETS[name]
        super().__init__(size, entries, layer_num, start_layer=start_layer, prefix=prefix, device=device)
        self.name = name
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
    ``c4_kv_pool``, ``c128_kv_pool`` (None without C128 layers) and
    ``c4_indexer_kv_pool``.  Not modelled: the SWA pool, the compressor state
    pools and the unified-KV (Triton) variant.

    ``size`` is the full-token capacity (the allocator's); ``page_size`` must
    be 256 (the presets fix 64 C4 entries and 2 C128 entries per page, i.e.
    256 tokens).  NOTE: SGLang receives ``c4_size`` / ``c128_size`` from its
    memory profiler; here ``c4_size = size // 4`` and ``c128_size =
    size // 128`` (so a C4 page row p holds the entries of full page p), and
    the indexer has ``c4_logical_size = c128_size * 32`` entries as on CUDA.
    ``compression_ratios`` (0, 4 or 128 per layer) gives ``layer_mapping``:
    per layer ``(compress_ratio, compress_layer_id)``; buffers are indexed by
    ``compress_layer_id``.
    """

    PAGE_SIZE = 256

    def __init__(self, size: int, page_size: int, compression_ratios, *, bf16_index_k: bool = False,
                 start_layer: int = 0, prefix: str = "", device: int = 0):
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
        self.c4_kv_pool = DeepSeekV4SingleKVPool("c4", self.c4_size, counts[4], **kw)
        self.c128_kv_pool = (DeepSeekV4SingleKVPool("c128", self.c128_size, counts[128], **kw)
                             if counts[128] else None)
        self.c4_indexer_kv_pool = DeepSeekV4IndexerPool(self.c4_logical_size, counts[4],
                                                        bf16_index_k=bf16_index_k, **kw)
        for sub in self.sub_pools():
            self.layouts.update(sub.layouts)
            self._kinds.update(sub._kinds)

    def sub_pools(self) -> list[KVCache]:
        """C4, C4 indexer, then C128 (when present)."""
        out = [self.c4_kv_pool, self.c4_indexer_kv_pool]
        return out + ([self.c128_kv_pool] if self.c128_kv_pool is not None else [])

    def layers_of(self, ratio: int) -> dict[int, int]:
        """Global layer -> compress_layer_id for the layers of one ratio."""
        return {i: cid for i, (r, cid) in enumerate(self.layer_mapping) if r == ratio}
