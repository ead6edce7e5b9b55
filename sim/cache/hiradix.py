"""The radix cache with a host tier, SGLang 0.5.14's ``HiRadixCache``
(``mem_cache/hiradix_cache.py``), without L3 storage.

Every node may hold device slots (``value``) and host slots (``host_value``): device-only,
device+host, or host-only ("evicted but backuped").  The tree talks to a cache controller
(``sim.cache.controller.HiCacheController`` or anything with its names) for every slot it
gains or loses and every copy:

* backup (D2H): ``write_backup`` -> ``cache_controller.write`` (allocates host slots, queues
  and launches the copy at once); the ack comes back on ``ack_write_queue`` and
  ``writing_check`` consumes it;
* load-back (H2D): ``load_back`` -> ``cache_controller.load`` (allocates device slots, queues,
  copies nothing); the tree marks the nodes resident at once; ``ready_to_load_host_cache``
  -> ``start_loading`` launches the copies; ``loading_check`` consumes the ack;
* device / host frees: ``cache_controller.evict_device`` / ``evict_host`` and the device
  allocator ``cache_controller.mem_pool_device_allocator``.

Event handles on the ack queues are used as SGLang uses CUDA events: ``query()`` to poll,
``synchronize()`` where SGLang blocks (the controller turns that into a host sync the host
program settles; docs/hicache_controller.md).  The all-reduce MIN that SGLang runs over TP
(and CP) ranks in ``writing_check`` / ``loading_check`` is the ``all_reduce_min`` hook
(default: one rank, the identity).

Times are logical clock ticks (see ``sim.cache.radix``).  NOTE: unlike the plain
``RadixCache``, HiRadixCache reads the clock once per node it touches, so the nodes of one
path get increasing times, root first, and a split's upper part (created after its lower
part was touched) is newer than the lower part.
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

import numpy as np

from sim.cache.controller import WRITE_POLICIES
from sim.cache.radix import CacheAssertionError, RadixCache, RadixKey, TreeNode, as_indices
from sim.cache.records import (
    CacheInitParams,
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sim.errors import InputError, show

__all__ = ["HiRadixCache"]

#: SGLang's ``--hicache-write-policy`` choices


def _single_rank(count: int) -> int:
    return count


class HiRadixCache(RadixCache):
    """SGLang 0.5.14's ``HiRadixCache`` over a given cache controller.

    ``params``: ``CacheInitParams`` (``token_to_kv_pool_allocator`` may be left None: the
    controller's ``mem_pool_device_allocator`` is used).  ``cache_controller``: the
    controller (its ``mem_pool_host`` is the host pool, its ``write_policy`` the policy).
    ``write_policy``: if given, must equal the controller's (SGLang reads the server arg for
    the hit threshold and the controller's attribute for the rest; they are one value there).
    ``load_back_threshold``: loads shorter than this many tokens are skipped (10).
    ``all_reduce_min``: the TP/CP all-reduce MIN of ``writing_check`` / ``loading_check``,
    ``int -> int`` (default: identity, one rank).  ``pp_rank`` (None: ``params.pp_rank``, as
    SGLang reads it): ranks other than 0 count no acks themselves and take the reduced count.  ``clock``: the logical clock."""

    def __init__(self, params: CacheInitParams, cache_controller, *, write_policy: Optional[str] = None,
                 load_back_threshold: int = 10, all_reduce_min: Optional[Callable[[int], int]] = None,
                 pp_rank: Optional[int] = None, clock=None, host_lock_during_load: bool = True):
        policy = cache_controller.write_policy
        if policy not in WRITE_POLICIES:
            raise InputError("cache_controller.write_policy", f"expected one of {list(WRITE_POLICIES)}, got {show(policy)}")
        if write_policy is not None and write_policy != policy:
            raise InputError("write_policy", f"expected the controller's write policy {policy!r}, got {show(write_policy)}")
        allocator = cache_controller.mem_pool_device_allocator
        if params.token_to_kv_pool_allocator is None:
            params = CacheInitParams(**{**params.__dict__, "token_to_kv_pool_allocator": allocator})
        elif params.token_to_kv_pool_allocator is not allocator:
            raise InputError("params.token_to_kv_pool_allocator",
                             "expected the controller's mem_pool_device_allocator (or None)")
        if cache_controller.page_size != params.page_size:
            raise InputError("params.page_size", f"expected the controller's page size "
                                                 f"{cache_controller.page_size}, got {show(params.page_size)}")
        self.cache_controller = cache_controller
        self.token_to_kv_pool_host = cache_controller.mem_pool_host
        self.pp_rank = params.pp_rank if pp_rank is None else pp_rank
        self.all_reduce_min = all_reduce_min if all_reduce_min is not None else _single_rank
        self.enable_storage = False
        #: node id -> (node whose lock the ack releases, backed-up length, nodes it covers)
        self.ongoing_write_through: dict = {}
        #: node id -> the deepest node of a load-back in flight (locked until its ack)
        self.ongoing_load_back: dict = {}
        self.ongoing_prefetch: dict = {}          # L3 only; stays empty
        self.ongoing_backup: dict = {}            # L3 only; stays empty
        self.prefetch_loaded_tokens_by_reqid: dict = {}
        self.write_through_threshold = 1 if policy == "write_through" else 2
        self.load_back_threshold = load_back_threshold
        if not isinstance(host_lock_during_load, bool):
            raise InputError("host_lock_during_load", f"expected true or false, got {show(host_lock_during_load)}")
        #: the incident's switch (docs/hicache.md, "Controller switches"): False drops the lock
        #: ``load_back`` holds on the loaded path until ``loading_check``
        self.host_lock_during_load = host_lock_during_load
        self.evictable_host_leaves: set = set()
        super().__init__(params, clock=clock)

    # ----------------------------------------------------------------- lifecycle

    def reset(self) -> None:
        """SGLang's reset: node ids restart at 0, the controller is reset, the host pool
        cleared, then a new tree.  NOTE: as in SGLang, ``ongoing_write_through`` and
        ``ongoing_load_back`` are not cleared (reset with transfers in flight is misuse)."""
        self._node_counter = 0
        self.cache_controller.reset()
        self.token_to_kv_pool_host.clear()
        self.prefetch_loaded_tokens_by_reqid.clear()
        self.evictable_host_leaves.clear()
        super().reset()

    def get_height(self, node: TreeNode) -> int:
        """Edges from ``node`` up to the root."""
        height = 0
        while node is not self.root_node:
            node = node.parent
            height += 1
        return height

    # ----------------------------------------------------------------- backup (D2H)

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back ``node``'s device slots up to the host; returns the tokens written (0 if
        skipped).  Not under write_back: skipped when the parent (other than the root) has no
        backup, so backups form a contiguous prefix from the root; the node is locked until
        the ack.  Host slots come from ``cache_controller.write``; if the host pool is full,
        ``evict_host`` frees that many tokens and the write is tried once more."""
        if not write_back and (node.parent is not self.root_node and not node.parent.backuped):
            return 0
        host_indices = self.cache_controller.write(device_indices=node.value, node_id=node.id)
        if host_indices is None:
            self.evict_host(len(node.value))
            host_indices = self.cache_controller.write(device_indices=node.value, node_id=node.id)
        if host_indices is None:
            return 0
        node.host_value = as_indices(host_indices).copy()
        if len(node.host_value) == 0:
            raise CacheAssertionError(f"node {node.id}: the controller returned no host slots for a backup")
        self._track_write_through_node(node, len(node.key))
        if not write_back:
            self.inc_lock_ref(node)
        return len(host_indices)

    def _track_write_through_node(self, node: TreeNode, backup_len: int) -> None:
        node.write_through_pending_id = node.id
        self.ongoing_write_through[node.id] = (node, backup_len, [node])

    def _replace_pending_write_through_node(self, old_node: TreeNode, new_nodes: list) -> None:
        """A split of a node whose backup is in flight: the ack now covers both parts (the
        lock it releases stays on the lower part, the original node object)."""
        ack_id = old_node.write_through_pending_id
        if ack_id is None:
            return
        pending = self.ongoing_write_through.get(ack_id)
        if pending is None:
            return
        lock_node, backup_len, publish_nodes = pending
        if not any(n is old_node for n in publish_nodes):
            return
        updated = []
        for n in publish_nodes:
            if n is old_node:
                updated.extend(new_nodes)
            else:
                updated.append(n)
        for n in new_nodes:
            n.write_through_pending_id = ack_id
        self.ongoing_write_through[ack_id] = (lock_node, backup_len, updated)

    def _finish_write_through_ack(self, ack_id: int, *, release_lock: bool) -> None:
        lock_node, _backup_len, publish_nodes = self.ongoing_write_through.pop(ack_id)
        for n in publish_nodes:
            if n.write_through_pending_id == ack_id:
                n.write_through_pending_id = None
        if release_lock:
            self.dec_lock_ref(lock_node)

    def _inc_hit_count(self, node: TreeNode, chunked: bool = False) -> None:
        """Count a hit (not under write_back, not for chunked inserts); a node without a
        backup that reaches ``write_through_threshold`` hits (1 for write_through, 2 for
        write_through_selective) is backed up."""
        if self.cache_controller.write_policy == "write_back" or chunked:
            return
        node.hit_count += 1
        if not node.backuped and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    def writing_check(self, write_back: bool = False) -> None:
        """Consume backup acks.  Normally: count the leading acks whose finish event has
        completed (``query``, on PP rank 0), agree on the count over ranks
        (``all_reduce_min``), then for each: ``synchronize`` its event and release the lock
        ``write_backup`` took.  With ``write_back=True`` (from ``evict``): block on every
        queued ack (``synchronize``) and finish them all without releasing locks."""
        controller = self.cache_controller
        if write_back:
            while len(self.ongoing_write_through) > 0:
                for _, finish_event, ack_list in controller.ack_write_queue:
                    finish_event.synchronize()
                    for ack_id in ack_list:
                        self._finish_write_through_ack(ack_id, release_lock=False)
                controller.ack_write_queue.clear()
                if self.ongoing_write_through:
                    raise CacheAssertionError(f"write-back acks missing for nodes {sorted(self.ongoing_write_through)}")
            return
        finish_count = self._finished_acks(controller.ack_write_queue)
        finish_count = int(self.all_reduce_min(finish_count))
        while finish_count > 0:
            _, finish_event, ack_list = controller.ack_write_queue.pop(0)
            finish_event.synchronize()
            for ack_id in ack_list:
                self._finish_write_through_ack(ack_id, release_lock=True)
            finish_count -= 1

    def _finished_acks(self, queue) -> int:
        """The leading acks of ``queue`` whose finish event has completed, agreed over the
        simulated TP ranks: each rank (PP rank 0 only) counts its own, querying its own events
        until its first pending one, and the count is their minimum (SGLang's ``all_reduce``
        MIN; ranks not simulated are ``all_reduce_min``'s).  So an ack is processed only once
        EVERY rank has finished it.  One rank: one query per ack up to the first pending."""
        if self.pp_rank != 0:
            return 0
        ranks = int(getattr(self.cache_controller, "ranks", 1))
        counts = []
        for r in range(ranks):
            n = 0
            for _, finish_event, _ack_list in queue:
                if not (finish_event.query() if ranks == 1 else finish_event.query(r)):
                    break
                n += 1
            counts.append(n)
        return min(counts)

    def flush_write_through_acks(self) -> None:
        """``writing_check()``."""
        self.writing_check()

    # ----------------------------------------------------------------- load-back (H2D)

    def loading_check(self) -> None:
        """Consume load acks: count the leading acks whose finish event (the last layer's
        event) has completed, agree over ranks, then for each: ``synchronize`` and release
        the lock ``load_back`` took on the loaded path."""
        controller = self.cache_controller
        finish_count = self._finished_acks(controller.ack_load_queue)
        finish_count = int(self.all_reduce_min(finish_count))
        while finish_count > 0:
            _, finish_event, ack_list = controller.ack_load_queue.pop(0)
            finish_event.synchronize()
            for ack_id in ack_list:
                end_node = self.ongoing_load_back.pop(ack_id)
                if self.host_lock_during_load:
                    self.dec_lock_ref(end_node)
            finish_count -= 1

    def is_load_back_event_done(self, consumer_index: int) -> bool:
        """True when the load in producer slot ``consumer_index`` has finished (then runs
        ``loading_check``); a negative index means no load."""
        if consumer_index < 0:
            return True
        finish_event = self.cache_controller.layer_done_counter.events[consumer_index].finish_event
        if not finish_event.query():
            return False
        self.loading_check()
        return True

    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[np.ndarray]:
        """Bring the evicted path ending at ``node`` back to the device; returns its new
        device slots, or None.  Collects the evicted ancestors (top first) up to the first
        resident one, locks that one (``delta`` = minus the tokens newly protected), and
        gives up if the host tokens are fewer than ``load_back_threshold`` or more than
        ``mem_quota + delta``.  ``cache_controller.load`` allocates the device slots (after
        one ``evict`` of that many tokens if the first try fails) and queues the copy; the
        nodes get their slices of the slots at once (resident before any byte moves),
        ``evictable_size_`` grows, and ``node`` is locked until ``loading_check`` (not with
        ``host_lock_during_load=False``, the incident's switch: docs/hicache.md)."""
        last_hit_node = node
        nodes_to_load = []
        while node.evicted:
            if not node.backuped:
                raise CacheAssertionError(f"node {node.id} is evicted without a host copy")
            nodes_to_load.insert(0, node)
            node = node.parent
        ancester_node = node
        if not nodes_to_load:
            raise InputError("node", f"expected an evicted node to load back, got resident node {node.id}")
        delta = self.inc_lock_ref(ancester_node).delta
        host_indices = np.concatenate([n.host_value for n in nodes_to_load])
        if len(host_indices) < self.load_back_threshold or (
            mem_quota is not None and len(host_indices) > mem_quota + delta
        ):
            self.dec_lock_ref(ancester_node)
            return None
        device_indices = self.cache_controller.load(host_indices=host_indices, node_id=last_hit_node.id)
        if device_indices is None:
            self.evict(EvictParams(num_tokens=len(host_indices)))
            device_indices = self.cache_controller.load(host_indices=host_indices, node_id=last_hit_node.id)
        self.dec_lock_ref(ancester_node)
        if device_indices is None:
            return None
        device_indices = as_indices(device_indices)
        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        offset = 0
        for n in nodes_to_load:
            n.value = device_indices[offset: offset + len(n.host_value)].copy()
            offset += len(n.host_value)
        self.evictable_size_ += len(device_indices)
        if self.host_lock_during_load:
            # NOTE: this lock is all that keeps an in-flight load's host slots alive in 0.5.14:
            # evict_host skips nodes that are on the device, and the lock keeps the loaded path
            # on the device until loading_check (PR #26728 proposed an explicit host lock).
            # Without it a device eviction can evict the path again mid-load, and evict_host
            # then frees (and a backup reuses) host slots the H2D copy is still reading.
            self.inc_lock_ref(last_hit_node)
        return device_indices

    def init_load_back(self, params: InitLoadBackParams):
        """Start a load-back for a match: if ``best_match_node`` is evicted, ``load_back`` it;
        returns ``(device slots loaded, node)``; when nothing loads, ``(empty, deepest
        resident ancestor)``."""
        last_node = params.best_match_node
        if last_node.evicted:
            loading_values = self.load_back(last_node, params.mem_quota)
            if loading_values is not None:
                return loading_values, last_node
            while last_node.evicted:
                last_node = last_node.parent
        return self._empty_match_result.device_indices, last_node

    def ready_to_load_host_cache(self) -> int:
        """Launch the queued loads (``cache_controller.start_loading()``); returns the
        producer slot the forward pass waits on, or -1 when nothing was queued."""
        return self.cache_controller.start_loading()

    def check_hicache_events(self) -> None:
        """Once per scheduler iteration: ``writing_check()`` then ``loading_check()``."""
        self.writing_check()
        self.loading_check()

    def release_aborted_request(self, rid: str) -> None:
        """Forget an aborted request's L3 bookkeeping (without L3: only the per-request
        loaded-token count)."""
        self.prefetch_loaded_tokens_by_reqid.pop(rid, None)

    # ----------------------------------------------------------------- locks

    def _update_node_status(self, node: TreeNode) -> None:
        self._update_leaf_status(node)
        self._update_host_leaf_status(node)

    def _update_host_leaf_status(self, node: TreeNode) -> None:
        """``node`` is an evictable host leaf iff it is evicted (host-only), unlocked, and
        has no backed-up child."""
        if not node.evicted or node.lock_ref > 0:
            self.evictable_host_leaves.discard(node)
            return
        for child in node.children.values():
            if child.backuped:
                self.evictable_host_leaves.discard(node)
                return
        self.evictable_host_leaves.add(node)

    # ----------------------------------------------------------------- eviction

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device tokens.  Leaves pop in priority order
        (locked ones are skipped).  A backed-up leaf becomes host-only
        (``_evict_backuped``); one without a backup is deleted (``_evict_regular``), except
        under write_back, where it is backed up first (counted as evicted at once) and, after
        the loop, every such backup is waited for (``writing_check(write_back=True)``) and
        the node becomes host-only.  A parent whose children are all evicted (or being
        written back) is pushed as a candidate."""
        controller = self.cache_controller
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted = 0
        write_back_nodes = []
        while num_evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            if x.lock_ref > 0:
                continue
            if not x.backuped:
                if controller.write_policy == "write_back":
                    written = self.write_backup(x, write_back=True)
                    num_evicted += written
                    if written > 0:
                        write_back_nodes.append(x)
                else:
                    num_evicted += self._evict_regular(x)
            else:
                num_evicted += self._evict_backuped(x)
            for child in x.parent.children.values():
                if child in write_back_nodes:      # identity: TreeNode has no __eq__
                    continue
                if not child.evicted:
                    break
            else:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
        if controller.write_policy == "write_back":
            self.writing_check(write_back=True)
            for n in write_back_nodes:
                if not n.backuped:
                    raise CacheAssertionError(f"node {n.id} written back without a host copy")
                self._evict_backuped(n)
        return EvictResult(num_tokens_evicted=num_evicted)

    def _evict_backuped(self, node: TreeNode) -> int:
        num_evicted = self.cache_controller.evict_device(node.value)
        if num_evicted <= 0:
            raise CacheAssertionError(f"node {node.id}: evicting its device copy freed no slots")
        self.evictable_size_ -= num_evicted
        node.value = None
        self._update_leaf_status(node)
        self._update_host_leaf_status(node)
        self._update_leaf_status(node.parent)
        return num_evicted

    def _evict_regular(self, node: TreeNode) -> int:
        if len(node.children) != 0:
            raise CacheAssertionError(f"node {node.id}: regular eviction of a non-leaf")
        self.cache_controller.mem_pool_device_allocator.free(node.value)
        num_evicted = len(node.value)
        self._delete_leaf(node)
        return num_evicted

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens: pop evictable host leaves (host-only,
        unlocked, no backed-up child) in priority order, skip any that came back to the
        device or are host-protected (``host_ref_counter > 0``), free their host slots
        (``cache_controller.evict_host``) and delete them; a parent left host-only with no
        children is pushed.  Returns the tokens freed (SGLang returns None)."""
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_host_leaves]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, x = heapq.heappop(heap)
            if x is self.root_node:
                break
            if not x.evicted:
                continue
            if x.host_ref_counter > 0:
                continue
            num_evicted += self.cache_controller.evict_host(x.host_value)
            key = x.key.child_key(self.page_size)
            removed = x.parent.children.pop(key, None)
            if removed is not x:
                raise CacheAssertionError(f"node {x.id}: its parent has no child under key {show(key)}")
            self.evictable_host_leaves.discard(x)
            self._update_host_leaf_status(x.parent)
            if len(x.parent.children) == 0 and x.parent.evicted:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
        return num_evicted

    # ----------------------------------------------------------------- match and insert

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached page-aligned prefix of ``params.key``, on device or host.
        ``device_indices`` covers the resident part; ``last_device_node`` is the deepest
        resident node; ``host_hit_length`` sums the host slots of the evicted tail below it;
        ``last_host_node`` = ``best_match_node`` is the deepest node with a host copy (root
        counts).  Touches the root and each node on the path (one tick each) and splits the
        node the match ends inside."""
        if self.disable:
            return self._empty_match_result
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._empty_match_result
        values, last_node = self._match_prefix_helper(self.root_node, key)
        device_indices = np.concatenate(values) if values else self._empty_match_result.device_indices
        host_hit_length = 0
        last_host_node = last_node
        while last_node.evicted:
            host_hit_length += len(last_node.host_value)
            last_node = last_node.parent
        while not last_host_node.backuped:
            last_host_node = last_host_node.parent
        return MatchResult(device_indices=device_indices, last_device_node=last_node,
                           last_host_node=last_host_node, best_match_node=last_host_node,
                           host_hit_length=host_hit_length)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey):
        node.last_access_time = self.clock.tick()
        child_key = key.child_key(self.page_size)
        values = []
        while len(key) > 0 and child_key in node.children:
            child = node.children[child_key]
            child.last_access_time = self.clock.tick()
            prefix_len = child.key.match(key, page_size=self.page_size)
            if prefix_len < len(child.key):
                new_node = self._split_node(child.key, child, prefix_len)
                if not new_node.evicted:
                    values.append(new_node.value)
                node = new_node
                break
            if not child.evicted:
                values.append(child.value)
            node = child
            key = key[prefix_len:]
            if len(key):
                child_key = key.child_key(self.page_size)
        return values, node

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        """As ``RadixCache._split_node``, for both tiers: device and host slots are cut where
        present.  NOTE: as in SGLang, the upper part does not inherit ``host_ref_counter``;
        a backup in flight on the child now covers both parts."""
        new_node = self._new_node(priority=child.priority)
        new_node.children = {key[split_len:].child_key(self.page_size): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.hit_count = child.hit_count
        if child.evicted:
            new_node.value = None
        else:
            new_node.value = child.value[:split_len].copy()
            child.value = child.value[split_len:].copy()
        if child.backuped:
            new_node.host_value = child.host_value[:split_len].copy()
            child.host_value = child.host_value[split_len:].copy()
        child.parent = new_node
        child.key = child.key[split_len:]
        new_node.parent.children[key.child_key(self.page_size)] = new_node
        if child.backuped:
            self._replace_pending_write_through_node(child, [new_node, child])
        return new_node

    def insert(self, params: InsertParams) -> InsertResult:
        """Insert ``params.key`` with device slots ``params.value``.  Walking down, each node
        on the path is touched and its priority raised; a resident node that matches counts
        a hit (which may start its backup) and adds to ``prefix_len``; a host-only node (or
        the upper part of a split one) TAKES OVER the caller's slots for its tokens (they
        are not counted in ``prefix_len``, so the caller does not free them).  The unmatched
        tail becomes a new leaf, which counts a hit unless the policy is write_back."""
        key, value = params.key, params.value
        chunked = params.chunked
        priority = 0 if params.priority is None else params.priority
        key, value = key.maybe_to_bigram_view(self.is_eagle, value)
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return InsertResult(prefix_len=0)
        if value is None:
            raise InputError("params.value", "expected the device indices of the key's tokens, got None")
        value = as_indices(value, "params.value")[: len(key)]
        if len(value) < len(key):
            raise InputError("params.value", f"expected at least {len(key)} indices (one per page-aligned "
                                             f"token), got {len(value)}")
        node = self.root_node
        child_key = key.child_key(self.page_size)
        total_prefix_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = self.clock.tick()
            node.priority = max(node.priority, priority)
            prefix_len = node.key.match(key, page_size=self.page_size)
            if prefix_len == len(node.key):
                if node.evicted:
                    # NOTE: the caller's slots replace the evicted device copy (KV
                    # recomputed for a host-only prefix); the host copy stays.
                    node.value = value[:prefix_len].copy()
                    self.evictable_size_ += len(node.value)
                    self._update_leaf_status(node)
                    self._update_host_leaf_status(node)
                    self._update_leaf_status(node.parent)
                else:
                    self._inc_hit_count(node, chunked)
                    total_prefix_length += prefix_len
            else:
                new_node = self._split_node(node.key, node, prefix_len)
                new_node.priority = max(new_node.priority, priority)
                if new_node.evicted:
                    new_node.value = value[:prefix_len].copy()
                    self.evictable_size_ += len(new_node.value)
                    self._update_leaf_status(new_node)
                    self._update_host_leaf_status(new_node)
                    self._update_leaf_status(new_node.parent)
                else:
                    self._inc_hit_count(new_node, chunked)
                    total_prefix_length += prefix_len
                node = new_node
            key = key[prefix_len:]
            value = value[prefix_len:]
            if len(key):
                child_key = key.child_key(self.page_size)
        if len(key):
            new_node = self._new_node(priority=priority)
            new_node.parent = node
            new_node.key = key
            new_node.value = value.copy()
            node.children[child_key] = new_node
            self.evictable_size_ += len(value)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
            if self.cache_controller.write_policy != "write_back":
                self._inc_hit_count(new_node, chunked)
        return InsertResult(prefix_len=total_prefix_length)

    def _insert_helper_host(self, node: TreeNode, key: RadixKey, host_value, hash_value=None) -> int:
        """Add a host-only suffix below ``node`` (SGLang uses it for L3 prefetch results):
        walk down as far as ``key`` matches (touching and splitting), then hang the rest as
        a host-only leaf with ``host_value``.  Returns the tokens that already matched (the
        caller frees those host slots).  ``hash_value`` (page hashes) may be None."""
        node.last_access_time = self.clock.tick()
        if len(key) == 0:
            return 0
        host_value = as_indices(host_value, "host_value")
        child_key = key.child_key(self.page_size)
        matched_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = self.clock.tick()
            prefix_len = node.key.match(key, page_size=self.page_size)
            key = key[prefix_len:]
            host_value = host_value[prefix_len:]
            if hash_value is not None:
                hash_value = hash_value[prefix_len // self.page_size:]
            matched_length += prefix_len
            if prefix_len < len(node.key):
                node = self._split_node(node.key, node, prefix_len)
            if len(key):
                child_key = key.child_key(self.page_size)
        if len(key):
            new_node = self._new_node(priority=node.priority)
            new_node.parent = node
            new_node.key = key
            new_node.value = None
            new_node.host_value = host_value.copy()
            new_node.hash_value = hash_value
            node.children[child_key] = new_node
            self._update_host_leaf_status(new_node)
            self._update_leaf_status(node)
            self._update_host_leaf_status(node)
        return matched_length

    # ----------------------------------------------------------------- text

    def _describe_node(self, node: TreeNode) -> str:
        head = node.key.token_ids[:10].tolist()
        if node is self.root_node:
            state = "root"
        elif node.evicted:
            state = "host" if node.backuped else "gone"
        else:
            state = "device+host" if node.backuped else "device"
        parts = [f"[{node.id}] len={len(node.key)} tokens={head} {state} lock_ref={node.lock_ref}"]
        if node is not self.root_node:
            if node.value is not None:
                parts.append(f"dev={_span(node.value)}")
            if node.host_value is not None:
                parts.append(f"host={_span(node.host_value)}")
            if node.host_ref_counter:
                parts.append(f"host_ref={node.host_ref_counter}")
        return " ".join(parts)


def _span(indices: np.ndarray) -> str:
    """Slots as text: ``a..b`` for a consecutive run, else the first few."""
    if len(indices) and indices[-1] - indices[0] == len(indices) - 1 and np.all(np.diff(indices) == 1):
        return f"{indices[0]}..{indices[-1]}"
    head = ",".join(str(i) for i in indices[:6].tolist())
    return f"[{head}{',...' if len(indices) > 6 else ''}]"
