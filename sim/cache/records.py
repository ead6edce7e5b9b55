"""The argument and result records of the prefix caches, as SGLang 0.5.14 names them
(``mem_cache/base_prefix_cache.py`` and ``mem_cache/cache_init_params.py``).

Only the fields the full-attention radix caches read are kept: the Mamba, SWA, TTL and
component-tree fields of SGLang's records are left out (see docs/hicache.md, "What is
skipped").  Index arrays are numpy int64 1-D arrays where SGLang has torch tensors.
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
    """What a radix cache is built from (SGLang ``CacheInitParams``, the fields a full-KV
    cache reads).  ``token_to_kv_pool_allocator`` is the device allocator the tree frees
    evicted slots into; ``req_to_token_pool`` (a ``sim.pools.ReqToTokenPool``) is the table
    ``cache_finished_req`` / ``cache_unfinished_req`` read a request's slots from (the other
    methods do not use it)."""

    disable: bool = False
    req_to_token_pool: Any = None
    token_to_kv_pool_allocator: Any = None
    page_size: int = 1
    is_eagle: bool = False
    eviction_policy: str = "lru"
    disable_finished_insert: bool = False


@dataclasses.dataclass
class MatchPrefixParams:
    """``match_prefix``'s argument: the ``RadixKey`` to look up."""

    key: Any


@dataclasses.dataclass
class InsertParams:
    """``insert``'s argument: ``key`` (a ``RadixKey``), ``value`` (its device indices, one
    per token), ``chunked`` (a chunked-prefill insert: no hit counting) and ``priority``."""

    key: Any = None
    value: Optional[np.ndarray] = None
    chunked: bool = False
    priority: Optional[int] = 0


@dataclasses.dataclass
class InsertResult:
    """``prefix_len``: how many leading tokens of the (page-aligned) key were already in the
    tree on the device, i.e. the part of ``value`` the caller still owns and must free."""

    prefix_len: int
    total_len: int = 0
    inserted_host_node: Any = None


@dataclasses.dataclass
class EvictParams:
    """``evict``'s argument: at least how many device tokens to free."""

    num_tokens: int = 0


@dataclasses.dataclass
class EvictResult:
    """How many device tokens ``evict`` freed (or, under write_back, backed up and freed)."""

    num_tokens_evicted: int = 0


@dataclasses.dataclass
class IncLockRefResult:
    """``delta``: minus the tokens that went from evictable to protected."""

    delta: Optional[int] = None


@dataclasses.dataclass
class DecLockRefParams:
    """``dec_lock_ref``'s optional second argument (its SWA fields are not modelled)."""


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
    tail below ``last_device_node``)."""

    device_indices: np.ndarray
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
