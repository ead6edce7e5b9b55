"""kvrace's HiRadixCache, driven through its own controller and executor
(``sim.cache.session.CacheSession``), with the same recorders as the SGLang side.

Every tree call goes through ``session.cache`` (the scheduler host makes the call and the
session settles its blocking steps in simulated time).  A transfer completes when the
driver completes it: :meth:`KvraceSide.complete_acks` blocks the host on the ack's finish
event (a ``host_sync``), i.e. advances simulated time until the copy has finished; other
copies may finish meanwhile, and the comparison mirrors whatever completed here onto the
SGLang side (``SGLangSide.mirror``), so both sides see the same completed acks.
Completion is read with ``controller._record_complete`` (the executor's own rule for a
``host_query``'s outcome), which issues no op.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from tests.differential.sglang_side import DiffConfig, wrap_paged

__all__ = ["KvraceSide"]


def _to_list(a) -> list[int] | None:
    return None if a is None else [int(x) for x in np.asarray(a).reshape(-1).tolist()]


class KvraceSide:
    name = "kvrace"

    def __init__(self, cfg: DiffConfig):
        from sim.cache import records
        from sim.cache.radix import RadixKey
        from sim.cache.session import CacheSession

        self.cfg = cfg
        self.records = records
        self.RadixKey = RadixKey
        self.session = CacheSession({
            "model": cfg.model, "layers": cfg.layers, "page_size": cfg.page_size, "device_tokens": cfg.device_tokens,
            "hicache_ratio": cfg.hicache_ratio, "layout": cfg.layout, "io_backend": cfg.io_backend,
            "write_policy": cfg.write_policy, "materialise": False, "max_running_requests": cfg.req_rows,
            "eviction_policy": cfg.eviction_policy, "is_eagle": cfg.is_eagle,
            **({"kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim}
               if cfg.model == "mla" else {})})
        self.allocator = self.session.allocator
        if cfg.need_sort:
            self.allocator.need_sort = True
        self.moves: list = []
        self.req_pool = self.session.req_to_token_pool
        if not cfg.hicache:
            # HiCache off: the plain RadixCache over the session's allocator, as the engine
            # builds it (sim.engine.engine) when HiCache is off
            from sim.cache.radix import RadixCache

            self.cache = self.tree = RadixCache(records.CacheInitParams(
                page_size=cfg.page_size, token_to_kv_pool_allocator=self.allocator,
                eviction_policy=cfg.eviction_policy, is_eagle=cfg.is_eagle, req_to_token_pool=self.req_pool))
            self.controller = self.host_pool = None
            self._wrap()
            return
        self.cache = self.session.cache          # settled calls
        self.tree = self.session.tree
        self.controller = self.session.controller
        self.host_pool = self.session.host_pool
        self._wrap()

    def _wrap(self) -> None:
        moves = self.moves
        alloc, free = self.allocator.alloc, self.allocator.free

        def dev_alloc(need_size):
            out = alloc(need_size)
            if out is not None:
                moves.append(("device_alloc", _to_list(out)))
            return out

        def dev_free(indices):
            moves.append(("device_free", _to_list(indices)))
            return free(indices)

        self.allocator.alloc = dev_alloc
        self.allocator.free = dev_free
        wrap_paged(self.allocator, moves, _to_list)
        if self.host_pool is None:
            return
        halloc, hfree = self.host_pool.alloc, self.host_pool.free
        backup, load = self.host_pool.backup_from_device_all_layer, self.host_pool.load_to_device_per_layer

        def host_alloc(need_size):
            out = halloc(need_size)
            if out is not None:
                moves.append(("host_alloc", _to_list(out)))
            return out

        def host_free(indices):
            moves.append(("host_free", _to_list(indices)))
            return hfree(indices)

        def rec_backup(device_pool, host_indices, device_indices, *args, **kwargs):
            moves.append(("write_copy", _to_list(host_indices), _to_list(device_indices)))
            return backup(device_pool, host_indices, device_indices, *args, **kwargs)

        def rec_load(device_pool, host_indices, device_indices, layer_id, *args, **kwargs):
            if layer_id == 0:
                moves.append(("load_copy", _to_list(host_indices), _to_list(device_indices)))
            return load(device_pool, host_indices, device_indices, layer_id, *args, **kwargs)

        self.host_pool.alloc = host_alloc
        self.host_pool.free = host_free
        self.host_pool.backup_from_device_all_layer = rec_backup
        self.host_pool.load_to_device_per_layer = rec_load

    def take_moves(self) -> list:
        out = list(self.moves)
        self.moves.clear()
        return out

    # -------------------------------------------------------------- adapters
    def key(self, tokens, extra_key=None, is_bigram: bool = False):
        return self.RadixKey(np.asarray([int(t) for t in tokens], dtype=np.int64), extra_key, is_bigram=is_bigram)

    @staticmethod
    def new_req(rid: str, tokens, extra_key=None, priority=None):
        from sim.cache.req import Req

        return Req(rid, tokens, extra_key=extra_key, priority=priority)

    def init_round(self, req) -> None:
        req.init_next_round_input(self.cache)

    @staticmethod
    def ints(values):
        return np.asarray(values, dtype=np.int64)

    @staticmethod
    def cat(a, b):
        return np.concatenate([np.asarray(a, np.int64), np.asarray(b, np.int64)])

    @staticmethod
    def as_list(a) -> Optional[list[int]]:
        return None if a is None else _to_list(a)

    @staticmethod
    def token_list(key) -> list[int]:
        # NOTE: the raw tokens, as the SGLang side lists them (a bigram key's N units are N + 1)
        return [int(t) for t in key.raw_token_ids().tolist()]

    def root(self):
        return self.tree.root_node

    def cache_obj(self):
        return self.tree

    def allocator_obj(self):
        return self.allocator

    def host_obj(self):
        if self.host_pool is None:
            return None
        group = getattr(self.host_pool, "anchor_entry", None)
        return self.host_pool if group is None else group.host_pool

    def event_done(self, event) -> bool:
        return bool(self.controller._record_complete(event.name))

    # -------------------------------------------------------------- transfers
    def ack_done(self, queue: str) -> list[bool]:
        q = self.controller.ack_write_queue if queue == "write" else self.controller.ack_load_queue
        return [self.event_done(a[1]) for a in q]

    def slot_done(self) -> list[bool]:
        return [self.event_done(e.finish_event) for e in self.controller.layer_done_counter.events]

    def complete_acks(self, queue: str, count: int) -> None:
        q = self.controller.ack_write_queue if queue == "write" else self.controller.ack_load_queue
        for ack in list(q)[:count]:
            if not self.event_done(ack[1]):
                self.session.settle()
                self.session._block(self.session.host.synchronize(event=ack[1].name))

    def complete_all(self) -> None:
        self.session.wait_idle()
