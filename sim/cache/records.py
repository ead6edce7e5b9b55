"""The argument and result records of the prefix caches, as SGLang 0.5.14 names them
(``mem_cache/base_prefix_cache.py`` and ``mem_cache/cache_init_params.py``).

Every field of SGLang's records is here, in SGLang's order and with its default, so that
code written against SGLang's caches builds these records unchanged.  The full-attention
caches read only some of them; the Mamba, SWA, TTL, component-tree, process-group, metrics
and KV-event fields are accepted and ignored, as SGLang's own ``RadixCache`` and
``HiRadixCache`` ignore them (docs/hicache.md, "What is skipped").  Index arrays are numpy
int64 1-D arrays where SGLang has torch tensors.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = [
    "CacheInitParams",
    "MatchPrefixParams",
    "MatchResult",
    "InsertParams",
    "InsertResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "DecLockRefParams",
    "DecLockRefResult",
    "InitLoadBackParams",
    "empty_indices",
]


def empty_indices() -> np.ndarray:
    """A fresh empty int64 index array (SGLang: ``torch.empty((0,), dtype=torch.int64)``)."""
    return np.empty(0, dtype=np.int64)


@dataclasses.dataclass
class CacheInitParams:
    """What a radix cache is built from (SGLang ``CacheInitParams``).  Read:
    ``disable``, ``token_to_kv_pool_allocator`` (the device allocator the tree frees evicted
    slots into), ``req_to_token_pool`` (a ``sim.pools.ReqToTokenPool``: the table
    ``cache_finished_req`` / ``cache_unfinished_req`` read a request's slots from),
    ``page_size``, ``is_eagle``, ``eviction_policy``, ``disable_finished_insert``, and by
    ``HiRadixCache`` ``pp_rank``.  The rest is accepted and ignored (NOTE: the process groups
    too: kvrace's ``HiRadixCache`` takes the TP all-reduce as ``all_reduce_min``)."""

    disable: bool = False
    req_to_token_pool: Any = None
    token_to_kv_pool_allocator: Any = None
    page_size: int = 1
    is_eagle: bool = False
    tp_cache_group: Any = None
    attn_cp_cache_group: Any = None
    attn_tp_cache_group: Any = None
    pp_cache_group: Any = None
    eviction_policy: str = "lru"
    disable_finished_insert: bool = False
    enable_metrics: bool = False
    enable_kv_cache_events: bool = False
    enable_mamba_extra_buffer: bool = False
    enable_mamba_extra_buffer_lazy: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    chunked_prefill_size: Optional[int] = None
    sliding_window_size: Optional[int] = None
    cache_ttl_seconds: Optional[float] = None
    tree_components: Any = None
    component_registry_override: Any = None


@dataclasses.dataclass
class MatchPrefixParams:
    """``match_prefix``'s argument: the ``RadixKey`` to look up (``cow_mamba`` and ``req``,
    Mamba's, are ignored)."""

    key: Any
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass
class InsertParams:
    """``insert``'s argument: ``key`` (a ``RadixKey``), ``value`` (its device indices, one
    per token), ``chunked`` (a chunked-prefill insert: no hit counting) and ``priority``
    (``mamba_value``, ``prev_prefix_len`` and ``swa_evicted_seqlen``, Mamba's and SWA's, are
    ignored)."""

    key: Any = None
    value: Optional[np.ndarray] = None
    mamba_value: Any = None
    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: Optional[int] = 0


@dataclasses.dataclass
class InsertResult:
    """``prefix_len``: how many leading tokens of the (page-aligned) key were already in the
    tree on the device, i.e. the part of ``value`` the caller still owns and must free."""

    prefix_len: int
    total_len: int = 0
    mamba_exist: bool = False
    inserted_host_node: Any = None


@dataclasses.dataclass
class EvictParams:
    """``evict``'s argument: at least how many device tokens to free (``swa_num_tokens`` and
    ``mamba_num`` are ignored)."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    """How many device tokens ``evict`` freed (or, under write_back, backed up and freed)."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclasses.dataclass
class IncLockRefResult:
    """``delta``: minus the tokens that went from evictable to protected (the SWA and
    component fields stay at their defaults)."""

    delta: Optional[int] = None
    swa_uuid_for_lock: Optional[int] = None
    swa_uuid_for_host_lock: Optional[int] = None
    skip_lock_node_ids: dict = dataclasses.field(default_factory=dict)

    def to_dec_params(self) -> "DecLockRefParams":
        """The ``DecLockRefParams`` that undo this lock (SGLang's helper)."""
        return DecLockRefParams(self.swa_uuid_for_lock, self.swa_uuid_for_host_lock,
                                {k: set(v) for k, v in self.skip_lock_node_ids.items()})


@dataclasses.dataclass
class DecLockRefParams:
    """``dec_lock_ref``'s optional second argument (its SWA and component fields are ignored)."""

    swa_uuid_for_lock: Optional[int] = None
    swa_uuid_for_host_lock: Optional[int] = None
    skip_lock_node_ids: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DecLockRefResult:
    """``delta``: the tokens that went from protected to evictable."""

    delta: Optional[int] = None


@dataclasses.dataclass
class InitLoadBackParams:
    """``init_load_back``'s argument: the match's ``best_match_node``, its
    ``host_hit_length``, and ``mem_quota`` (device tokens the caller may still spend, or
    None for no limit)."""

    best_match_node: Any
    host_hit_length: int
    mem_quota: Optional[int] = None
    req: Any = None


class MatchResult(NamedTuple):
    """``match_prefix``'s result.

    ``device_indices``: the device slots of the matched prefix that is resident on the device
    (the concatenation of the non-evicted nodes' values on the matched path);
    ``last_device_node``: the deepest matched node that is on the device;
    ``last_host_node``: the deepest matched node that has a host copy (the root counts as
    backed up); ``best_match_node``: the node ``init_load_back`` starts from (in 0.5.14 the
    same as ``last_host_node``; for the plain ``RadixCache`` all three nodes are the same);
    ``host_hit_length``: tokens of the matched path that are only on the host (the evicted
    tail below ``last_device_node``).  The SWA and Mamba fields are always their defaults;
    ``cache_protected_len`` None means ``len(device_indices)`` (``Req.init_next_round_input``)."""

    device_indices: np.ndarray
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: Optional[int] = None
    cache_protected_len: Optional[int] = None
