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
