"""The radix tree over token ids, with SGLang 0.5.14's plain (device-only) semantics
(``mem_cache/radix_cache.py``): ``RadixKey``, ``TreeNode``, ``RadixCache``.

A node's ``key`` is the token run of its edge, its ``value`` the device slots (numpy int64)
holding those tokens' KV, one per token.  ``match_prefix`` walks the tree page by page and
splits a node where the match ends inside it; ``insert`` adds the unmatched tail as a new leaf;
``evict`` frees least-recently-used unlocked leaves; ``inc_lock_ref`` / ``dec_lock_ref`` pin a
path (root excluded) and move its tokens between ``evictable_size_`` and ``protected_size_``.

Time.  SGLang stamps ``last_access_time`` (and ``creation_time``) with ``time.monotonic()``.
Here every such call is one tick of the cache's ``LogicalClock`` (a strictly increasing
integer), at exactly the places SGLang calls the clock, so the eviction order is SGLang's
whenever SGLang's own clock does not tie.  NOTE: the plain ``RadixCache`` reads the clock
once per ``match_prefix`` / ``insert`` call and stamps every node on the path with that one
value (a real tie in SGLang too), while a node created in that call (a split's upper part, a
new leaf) gets its own, later ticks.
"""
from __future__ import annotations

import heapq
import sys
from typing import Iterator, Optional, Union

import numpy as np

from sim.cache.evict_policy import get_eviction_strategy
from sim.cache.records import (
    CacheInitParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    empty_indices,
)
from sim.errors import InputError, KvraceError, show

__all__ = ["RadixKey", "TreeNode", "LogicalClock", "RadixCache", "CacheStateError", "CacheAssertionError",
           "as_indices"]


class CacheStateError(KvraceError, RuntimeError):
    """A cache operation that SGLang refuses with an exception (releasing a host reference
    that is not held, a node that is not in the tree)."""


class CacheAssertionError(CacheStateError, AssertionError):
    """Where SGLang 0.5.14 fails an ``assert`` (a node missing under its parent's key, an evicted
    node without a host copy, ...).

    NOTE: also an ``AssertionError``, so code that catches what SGLang raises catches this;
    ``tests/differential/FINDINGS.md`` F2 reaches one of them in SGLang and here alike."""


def as_indices(values, where: str = "value") -> np.ndarray:
    """``values`` as a 1-D int64 numpy array (no copy when it already is one)."""
    arr = np.asarray(values, dtype=np.int64) if not isinstance(values, np.ndarray) else values
    if arr.ndim != 1 or arr.dtype != np.int64:
        try:
            arr = np.asarray(arr, dtype=np.int64)
        except (TypeError, ValueError):
            raise InputError(where, f"expected a 1-D sequence of integers, got {show(values)}") from None
        if arr.ndim != 1:
            raise InputError(where, f"expected a 1-D sequence of integers, got shape {arr.shape}")
    return arr


class LogicalClock:
    """A deterministic stand-in for ``time.monotonic()``: ``tick()`` returns 1, 2, 3, ..."""

    def __init__(self, now: int = 0):
        self.now = int(now)

    def tick(self) -> int:
        self.now += 1
        return self.now


class RadixKey:
    """A token sequence with an optional namespace ``extra_key`` (LoRA id, cache salt):
    sequences with different ``extra_key`` never share nodes.

    ``token_ids`` is a numpy int64 array (slices are views).  ``is_bigram`` (EAGLE): the key's
    units are the pairs ``(t[i], t[i+1])``, so N+1 raw tokens make N units and a slice keeps
    its boundary token.  ``limit`` caps the raw tokens used, as if ``token_ids[:limit]``."""

    __slots__ = ("token_ids", "extra_key", "is_bigram", "limit")

    def __init__(self, token_ids, extra_key=None, is_bigram: bool = False, limit: Optional[int] = None):
        self.token_ids = as_indices(token_ids, "token_ids")
        self.extra_key = extra_key
        self.is_bigram = is_bigram
        self.limit = limit

    def _raw_len(self) -> int:
        n = len(self.token_ids)
        return self.limit if self.limit is not None and self.limit < n else n

    def raw_token_ids(self) -> np.ndarray:
        """``token_ids`` cut to ``limit``."""
        return self.token_ids[: self._raw_len()]

    def __len__(self) -> int:
        n = self._raw_len()
        if self.is_bigram:
            return n - 1 if n > 0 else 0
        return n

    def __iter__(self) -> Iterator:
        t = self.token_ids
        n = self._raw_len()
        if self.is_bigram:
            for i in range(n - 1 if n > 0 else 0):
                yield (int(t[i]), int(t[i + 1]))
        else:
            for i in range(n):
                yield int(t[i])

    def __getitem__(self, idx: Union[int, slice]) -> "RadixKey":
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if i < 0:
                i += len(self)
            if i < 0 or i >= len(self):
                raise IndexError(f"RadixKey index out of range: {idx}")
            idx = slice(i, i + 1)
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError("RadixKey slice step must be 1")
        if self.is_bigram:
            raw = self.token_ids[start: stop + 1] if stop > start else self.token_ids[:0]
            return RadixKey(raw, self.extra_key, is_bigram=True)
        return RadixKey(self.token_ids[start:stop], self.extra_key)

    def __repr__(self) -> str:
        preview = self.token_ids[:10].tolist()
        more = "..." if len(self.token_ids) > 10 else ""
        return f"RadixKey(extra_key={self.extra_key!r}, token_ids={preview}{more}, is_bigram={self.is_bigram})"

    def page_aligned(self, page_size: int) -> "RadixKey":
        """The key cut down to whole pages (itself when ``page_size == 1``)."""
        if page_size == 1:
            return self
        return self[: len(self) // page_size * page_size]

    def maybe_to_bigram_view(self, is_eagle: bool, value=None):
        """For EAGLE, turn this key into its bigram view IN PLACE and cut ``value`` to the
        bigram count; returns ``(self, value)``.  NOTE: in place, as SGLang does: the
        caller's key object changes too."""
        if is_eagle and not self.is_bigram:
            self.is_bigram = True
            if value is not None:
                value = value[: len(self)]
        return self, value

    def match(self, other: "RadixKey", page_size: int = 1) -> int:
        """Length of the common prefix with ``other`` in units, rounded down to
        ``page_size``.  Different ``extra_key`` is an ``InputError``."""
        if self.extra_key != other.extra_key:
            raise InputError("extra_key", f"RadixKey operations require matching extra_key, "
                                          f"got {show(self.extra_key)} != {show(other.extra_key)}")
        t0, t1 = self.token_ids, other.token_ids
        n = min(len(t0), len(t1))
        diff = np.flatnonzero(t0[:n] != t1[:n])
        matched_tokens = int(diff[0]) if diff.size else n
        if self.is_bigram:
            matched = max(0, min(matched_tokens - 1, len(self), len(other)))
        else:
            matched = min(matched_tokens, len(self), len(other))
        return matched // page_size * page_size if page_size > 1 else matched

    def child_key(self, page_size: int = 1):
        """The hashable dict key of the first page (first token when ``page_size == 1``),
        namespaced as ``(extra_key, page)`` when ``extra_key`` is set."""
        t = self.token_ids
        if self.is_bigram:
            if page_size == 1:
                plain = (int(t[0]), int(t[1]))
            else:
                plain = tuple((int(t[j]), int(t[j + 1])) for j in range(page_size))
        else:
            plain = int(t[0]) if page_size == 1 else tuple(t[:page_size].tolist())
        return plain if self.extra_key is None else (self.extra_key, plain)


class TreeNode:
    """One edge of the radix tree and the node below it, with SGLang's attributes.

    ``key`` (``RadixKey``), ``value`` (device slots or None), ``host_value`` (host slots or
    None), ``children`` (dict: child key of the child's first page -> child), ``parent``,
    ``lock_ref`` (device pins), ``host_ref_counter`` (host pins), ``last_access_time`` and
    ``creation_time`` (logical ticks), ``hit_count``, ``priority``, ``id``,
    ``write_through_pending_id`` (the backup in flight that covers this node),
    ``hash_value`` (kept None: page hashes serve L3 and KV events, not modelled).

    States: ``evicted`` is ``value is None``; ``backuped`` is ``host_value is not None``.
    A node is device-only, device+host, or host-only (evicted and backed up)."""

    def __init__(self, id: int, priority: int = 0, last_access_time: int = 0, creation_time: int = 0):
        self.children: dict = {}
        self.parent: Optional[TreeNode] = None
        self.key: Optional[RadixKey] = None
        self.value: Optional[np.ndarray] = None
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.creation_time = creation_time
        self.hit_count = 0
        self.host_ref_counter = 0
        self.host_value: Optional[np.ndarray] = None
        self.write_through_pending_id: Optional[int] = None
        self.hash_value = None
        self.priority = priority
        self.id = id

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def protect_host(self) -> None:
        """Pin the host copy: ``evict_host`` skips a node whose ``host_ref_counter > 0``."""
        self.host_ref_counter += 1

    def release_host(self) -> None:
        """Undo one ``protect_host``; releasing an unheld node is a ``CacheStateError``."""
        if self.host_ref_counter > 0:
            self.host_ref_counter -= 1
        else:
            raise CacheStateError(f"node {self.id}: host reference counter is already zero")

    def __lt__(self, other: "TreeNode") -> bool:
        # NOTE: heap entries are (priority, node); SGLang breaks priority ties by this, i.e.
        # by last_access_time, and an equal time then leaves the heap's own order.
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        state = ("host" if self.backuped else "gone") if self.evicted else ("dev+host" if self.backuped else "dev")
        n = 0 if self.key is None else len(self.key)
        return f"TreeNode(id={self.id}, len={n}, {state}, lock_ref={self.lock_ref})"


class RadixCache:
    """SGLang's ``RadixCache``: a prefix tree of device slots, without a host tier.

    Built from ``CacheInitParams`` (the device allocator the tree frees into, ``page_size``,
    ``eviction_policy``, ``is_eagle``, ``disable``); ``clock`` is the logical clock (a fresh
    one by default).  Public methods keep SGLang's names and semantics; see docs/hicache.md."""

    def __init__(self, params: CacheInitParams, *, clock: Optional[LogicalClock] = None):
        if not isinstance(params.page_size, (int, np.integer)) or params.page_size < 1:
            raise InputError("page_size", f"expected an integer >= 1, got {show(params.page_size)}")
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.is_eagle = params.is_eagle
        self.disable_finished_insert = params.disable_finished_insert
        self.eviction_policy = str(params.eviction_policy).lower()
        self.clock = clock if clock is not None else LogicalClock()
        self.eviction_strategy = get_eviction_strategy(self.eviction_policy)
        self.evictable_leaves: set = set()
        self._node_counter = 0
        self.reset()

    @classmethod
    def create_simulated(cls, disable: bool = False, mock_allocator=None, page_size: int = 1,
                         enable_kv_cache_events: bool = False) -> "RadixCache":
        """A plain ``RadixCache`` without memory pools (SGLang's ``create_simulated``: the
        scheduler's waiting-queue tree, inserted with ``value=None`` so the token ids serve as
        values); ``mock_allocator`` is what ``evict`` frees into."""
        return RadixCache(CacheInitParams(disable=disable, req_to_token_pool=None,
                                          token_to_kv_pool_allocator=mock_allocator, page_size=page_size,
                                          enable_kv_cache_events=enable_kv_cache_events))

    # ----------------------------------------------------------------- nodes and time

    def _new_node(self, priority: int = 0) -> TreeNode:
        """A node stamped as SGLang's ``TreeNode()`` is: last_access_time, then
        creation_time, each its own clock read; ids count up per cache."""
        access = self.clock.tick()
        created = self.clock.tick()
        node = TreeNode(self._node_counter, priority, access, created)
        self._node_counter += 1
        return node

    # ----------------------------------------------------------------- public API

    def reset(self) -> None:
        """Drop the whole tree: a new root (locked once, priority -sys.maxsize, empty key,
        value and host value) and zero sizes.  Device slots are not freed."""
        root = self._new_node(priority=-sys.maxsize)
        root.key = RadixKey(empty_indices())
        root.value = empty_indices()
        root.host_value = empty_indices()
        root.lock_ref = 1
        root.hash_value = []
        self.root_node = root
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves.clear()
        self._empty_match_result = MatchResult(
            device_indices=empty_indices(),
            last_device_node=root,
            last_host_node=root,
            best_match_node=root,
        )

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached page-aligned prefix of ``params.key``: its device slots and the
        node it ends at.  Splits the node the match ends inside; stamps the root and every
        node on the path with one clock tick."""
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        if self.disable or len(key) == 0:
            return self._empty_match_result
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._empty_match_result
        values, last_node = self._match_prefix_helper(self.root_node, key)
        device_indices = np.concatenate(values) if values else self._empty_match_result.device_indices
        return MatchResult(device_indices=device_indices, last_device_node=last_node,
                           last_host_node=last_node, best_match_node=last_node)

    def insert(self, params: InsertParams) -> InsertResult:
        """Insert ``params.key`` with device slots ``params.value`` (page-aligned first).
        Returns ``prefix_len``, the leading tokens already in the tree: the caller still
        owns those slots of ``value`` (and frees them); the tree now owns the rest.  With
        ``value`` None the token ids themselves are used (SGLang's test fallback)."""
        if self.disable:
            return InsertResult(prefix_len=0)
        key, value = params.key.maybe_to_bigram_view(self.is_eagle, params.value)
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = as_indices(value)[: len(key)]
        else:
            value = key.token_ids[: len(key)].copy()
        prefix_len = self._insert_helper(self.root_node, key, value, params.priority, params.chunked)
        return InsertResult(prefix_len=prefix_len)

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device tokens (or all that can go): pop
        evictable leaves in priority order (LRU: oldest ``last_access_time`` first), free
        their slots, delete them, and push a parent that became an unlocked leaf."""
        if self.disable:
            return EvictResult()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            self.token_to_kv_pool_allocator.free(x.value)
            num_evicted += len(x.value)
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
        return EvictResult(num_tokens_evicted=num_evicted)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Pin ``node`` and its ancestors (root excluded): each ``lock_ref += 1``; a node that
        was unlocked moves its tokens from evictable to protected.  ``delta`` is minus the
        tokens moved."""
        if self.disable:
            return IncLockRefResult(delta=0)
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            self._update_node_status(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: TreeNode, params=None) -> DecLockRefResult:
        """Undo one ``inc_lock_ref(node)``: each ``lock_ref -= 1``; a node that reaches 0
        moves its tokens back to evictable.  NOTE: as in SGLang, nothing stops a count from
        going below zero when the caller unlocks what it never locked."""
        if self.disable:
            return DecLockRefResult(delta=0)
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_node_status(node)
            if node.parent is None:
                raise CacheStateError(f"node {node.id} is not in this tree (it has no parent)")
            node = node.parent
        return DecLockRefResult(delta=delta)

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """Cache a finished request (SGLang's ``cache_finished_req``): its committed tokens
        (``req.pop_committed_kv_cache()``), page-aligned (bigram with EAGLE), enter the tree
        with the slots of its ``req_to_token`` row; the slots the tree already had
        (``[cache_protected_len, prefix_len)``) and the unaligned tail are freed; the
        request's lock on ``req.last_node`` is released.  With ``is_insert`` False (or
        ``disable_finished_insert``) nothing is inserted and the request's own slots past
        ``cache_protected_len`` are freed.  With the cache disabled every committed slot
        is freed.  The request's row itself is the caller's to free
        (``ReqToTokenPool.free``)."""
        if self.disable_finished_insert:
            is_insert = False
        kv_committed_len = req.pop_committed_kv_cache()
        row = self._req_row(req, "cache_finished_req")
        free = self.token_to_kv_pool_allocator.free
        if self.disable:
            free(row[:kv_committed_len])
            return
        token_ids = req.full_untruncated_fill_ids[:kv_committed_len]
        kv_indices = row[: len(token_ids)]
        radix_key = RadixKey(token_ids, req.extra_key, is_bigram=self.is_eagle).page_aligned(self.page_size)
        key_len = len(radix_key)
        values = kv_indices[:key_len].astype(np.int64)
        if is_insert:
            result = self.insert(InsertParams(key=radix_key, value=values, priority=getattr(req, "priority", 0) or 0))
            # the duplicates: the tree already had those tokens, under its own slots
            free(kv_indices[req.cache_protected_len: result.prefix_len])
        else:
            free(kv_indices[req.cache_protected_len: key_len])
        free(kv_indices[key_len:])          # the unaligned tail
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req, chunked: bool = False) -> None:
        """Cache a running request's computed tokens (SGLang's ``cache_unfinished_req``:
        between chunks of a chunked prefill, and where a request's KV must be in the tree while
        it runs): ``req.get_fill_ids()``, page-aligned, enter the tree with its row's slots;
        the duplicates ``[cache_protected_len, prefix_len)`` are freed; the key is matched
        again and the tree's slots written into the row; ``cache_protected_len`` becomes the
        key's length; the lock moves from ``req.last_node`` to the new last node;
        ``prefix_indices`` becomes the tree's slots plus the row's slots past them (the
        partial page, which the request still owns)."""
        if self.disable:
            return
        row = self._req_row(req, "cache_unfinished_req")
        token_ids = req.get_fill_ids()
        kv_indices = row[: len(token_ids)]
        radix_key = RadixKey(token_ids, req.extra_key, is_bigram=self.is_eagle).page_aligned(self.page_size)
        values = kv_indices[: len(radix_key)].astype(np.int64)
        result = self.insert(InsertParams(key=radix_key, value=values, chunked=chunked,
                                          priority=getattr(req, "priority", 0) or 0))
        self.token_to_kv_pool_allocator.free(kv_indices[req.cache_protected_len: result.prefix_len])
        # NOTE: the tree's slots may differ from the row's where another request inserted the
        # same tokens first: the request continues on the tree's
        match = self.match_prefix(MatchPrefixParams(key=radix_key))
        new_indices, new_last_node = match.device_indices, match.last_device_node
        if len(new_indices) != len(radix_key):
            raise CacheAssertionError(f"request {req.rid!r}: {len(new_indices)} device slots matched right after "
                                      f"inserting {len(radix_key)} tokens (SGLang asserts they are equal)")
        protected = req.cache_protected_len
        self.req_to_token_pool.write((req.req_pool_idx, slice(protected, len(new_indices))), new_indices[protected:])
        req.cache_protected_len = len(new_indices)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        if len(new_indices) < len(kv_indices):
            req.prefix_indices = np.concatenate([new_indices, kv_indices[len(new_indices):].astype(np.int64)])
        else:
            req.prefix_indices = new_indices
        req.last_node = new_last_node

    def _req_row(self, req, what: str) -> np.ndarray:
        """The ``req_to_token`` row of ``req`` (a view), or an error that says what is missing."""
        pool = self.req_to_token_pool
        if pool is None:
            raise InputError("req_to_token_pool", f"{what} reads the request's slots from the request-to-token "
                                                  "table: build the cache with CacheInitParams(req_to_token_pool="
                                                  "ReqToTokenPool(...))")
        if req.req_pool_idx is None:
            raise InputError("req.req_pool_idx", f"{what}: request {req.rid!r} holds no row of the request-to-token "
                                                 "table (ReqToTokenPool.alloc([req]) first)")
        return pool.req_to_token[req.req_pool_idx]

    # ----------------------------------------------------------------- SGLang's base-class protocol
    # NOTE: what SGLang's scheduler helpers ask any prefix cache (``BasePrefixCache``), with the
    # base class's answers, which SGLang's ``RadixCache`` keeps (so ``full_evictable_size`` is
    # 0 there too: only the SWA and Mamba caches override it); ``HiRadixCache`` overrides the
    # host-tier methods

    #: SGLang's metrics collector (metrics are not modelled: always None)
    metrics_collector = None

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return not self.is_chunk_cache()

    def supports_fast_match_prefix(self) -> bool:
        return False

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_streaming_session(self) -> bool:
        return False

    def full_evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return 0

    def full_protected_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def session_held_tokens(self, active_pool_idxs=None) -> int:
        return 0

    def session_held_full_tokens(self, active_pool_idxs=None) -> int:
        return 0

    def session_held_swa_tokens(self, active_pool_idxs=None) -> int:
        return 0

    def session_held_req_count(self, active_pool_idxs=None) -> int:
        return 0

    def session_held_mamba_slots(self, active_pool_idxs=None) -> int:
        return 0

    def release_session(self, session_id: str) -> None:
        """Streaming sessions are not modelled: nothing is held per session."""

    def take_events(self) -> list:
        """KV-cache events are not modelled: none."""
        return []

    def init_metrics_collector(self) -> None:
        """Metrics are not modelled (``metrics_collector`` stays None)."""

    def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None:
        """Metrics are not modelled."""

    def flush_write_through_acks(self) -> None:
        """No write-through without a host tier: nothing to release."""

    def init_load_back(self, params):
        raise NotImplementedError("the plain RadixCache has no host tier to load back from; use HiRadixCache")

    def ready_to_load_host_cache(self):
        raise NotImplementedError("the plain RadixCache has no host tier to load from; use HiRadixCache")

    def check_hicache_events(self):
        raise NotImplementedError("the plain RadixCache has no HiCache events; use HiRadixCache")

    def available_and_evictable_str(self) -> str:
        """SGLang's out-of-memory message line: free and evictable device tokens."""
        available_size = self.token_to_kv_pool_allocator.available_size()
        evictable_size = self.evictable_size()
        return (f"Available tokens: {available_size + evictable_size} "
                f"(available_size={available_size} + evictable_size={evictable_size})\n")

    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Device tokens in locked nodes."""
        return self.protected_size_

    def total_size(self) -> int:
        """Device tokens in the tree (nodes below an evicted node are not counted)."""
        total = 0
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            total += len(node.value)
            stack.extend(c for c in node.children.values() if not c.evicted)
        return total

    def all_values_flatten(self) -> np.ndarray:
        """Every non-root node's ``value`` concatenated, depth first."""
        values = []
        stack = list(reversed(list(self.root_node.children.values())))
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(reversed(list(node.children.values())))
        return np.concatenate(values) if values else empty_indices()

    def format_tree(self) -> str:
        """The tree as text, one node a line, children indented under their parent:
        ``[id] len=N tokens=[first ten] state lock_ref=L`` plus host details in
        ``HiRadixCache``."""
        lines = []
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            lines.append("  " * depth + self._describe_node(node))
            for child in reversed(list(node.children.values())):
                stack.append((child, depth + 1))
        return "\n".join(lines)

    def pretty_print(self) -> None:
        """Print ``format_tree()`` and the device token count."""
        print(self.format_tree())
        print(f"#tokens: {self.total_size()}")

    # ----------------------------------------------------------------- internals

    def _describe_node(self, node: TreeNode) -> str:
        head = node.key.token_ids[:10].tolist()
        state = "root" if node is self.root_node else ("evicted" if node.evicted else "device")
        return f"[{node.id}] len={len(node.key)} tokens={head} {state} lock_ref={node.lock_ref}"

    def _update_node_status(self, node: TreeNode) -> None:
        """What a lock change re-derives for ``node``: its evictable-leaf membership."""
        self._update_leaf_status(node)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey):
        access_time = self.clock.tick()
        node.last_access_time = access_time
        child_key = key.child_key(self.page_size)
        values = []
        while len(key) > 0 and child_key in node.children:
            child = node.children[child_key]
            child.last_access_time = access_time
            prefix_len = child.key.match(key, page_size=self.page_size)
            if prefix_len < len(child.key):
                new_node = self._split_node(child.key, child, prefix_len)
                values.append(new_node.value)
                node = new_node
                break
            values.append(child.value)
            node = child
            key = key[prefix_len:]
            if len(key):
                child_key = key.child_key(self.page_size)
        return values, node

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens: a new upper node (fresh clock ticks,
        the child's priority, hit count and lock count) takes the first part and the child
        object keeps the rest.  Returns the upper node."""
        new_node = self._new_node(priority=child.priority)
        new_node.hit_count = child.hit_count
        new_node.children = {key[split_len:].child_key(self.page_size): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.value = child.value[:split_len].copy()
        child.parent = new_node
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].copy()
        # NOTE: assigning to an existing dict key keeps the child's position among its
        # siblings, as SGLang's dict does.
        new_node.parent.children[key.child_key(self.page_size)] = new_node
        return new_node

    def _inc_hit_count(self, node: TreeNode, chunked: bool = False) -> None:
        if chunked:
            return
        node.hit_count += 1

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: np.ndarray, priority=0, chunked=False) -> int:
        if priority is None:
            priority = 0
        access_time = self.clock.tick()
        node.last_access_time = access_time
        node.priority = max(node.priority, priority)
        if len(key) == 0:
            return 0
        child_key = key.child_key(self.page_size)
        total_prefix_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = access_time
            prefix_len = node.key.match(key, page_size=self.page_size)
            total_prefix_length += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            if prefix_len < len(node.key):
                new_node = self._split_node(node.key, node, prefix_len)
                new_node.priority = max(new_node.priority, priority)
                self._inc_hit_count(new_node, chunked)
                node = new_node
            else:
                node.priority = max(node.priority, priority)
                self._inc_hit_count(node, chunked)
            if len(key):
                child_key = key.child_key(self.page_size)
        if len(key):
            new_node = self._new_node(priority=priority)
            new_node.parent = node
            new_node.key = key
            new_node.value = value.copy()
            self._inc_hit_count(new_node, chunked)
            node.children[child_key] = new_node
            self.evictable_size_ += len(key)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
        return total_prefix_length

    def _delete_leaf(self, node: TreeNode) -> None:
        key = node.key.child_key(self.page_size)
        removed = node.parent.children.pop(key, None)
        if removed is not node:
            raise CacheAssertionError(f"node {node.id}: its parent has no child under key {show(key)}")
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        self._update_leaf_status(node.parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        """``node`` is an evictable leaf iff it is on the device, unlocked, and has no child
        on the device."""
        if node.evicted or node.lock_ref > 0:
            self.evictable_leaves.discard(node)
            return
        for child in node.children.values():
            if not child.evicted:
                self.evictable_leaves.discard(node)
                return
        self.evictable_leaves.add(node)
