"""A minimal stand-in for the HiCache controller, for the tree's bookkeeping tests.

It has the controller's names (``write``, ``load``, ``start_writing``, ``start_loading``,
``ack_write_queue``, ``ack_load_queue``, ``evict_device``, ``evict_host``, ``reset``,
``layer_done_counter``, ``mem_pool_device_allocator``, ``mem_pool_host``, ``write_policy``,
``page_size``) and allocates from the real device allocators of ``sim.pools.allocator``; it
moves no bytes.  Copies complete only when a test says so (``finish_writes`` /
``finish_loads``) or when the tree blocks on an event (``synchronize``).  It also refuses to
free a host slot an unfinished load still reads, or a device slot an unfinished backup still
reads or an unfinished load still writes (``SlotStillInUse``), so tests catch the tree
freeing too early.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sim.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


class SlotStillInUse(AssertionError):
    """A slot freed while a copy that reads or writes it has not finished."""


class FakeHostPool:
    """The host pool's slot list as ``HostKVCache`` keeps it: ``0..size-1``, ``alloc``
    takes page multiples from the front, ``free`` appends."""

    def __init__(self, size: int, page_size: int, layout: str = "layer_first"):
        self.size = size
        self.page_size = page_size
        self.layout = layout
        self.in_use_check = None
        self.clear()

    def clear(self):
        self.free_slots = np.arange(self.size, dtype=np.int64)

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, need_size):
        assert need_size % self.page_size == 0, need_size
        if need_size > len(self.free_slots):
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def free(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        if self.in_use_check is not None:
            self.in_use_check("host", indices)
        self.free_slots = np.concatenate([self.free_slots, indices])
        return len(indices)


class CheckedAllocator:
    """A real device allocator whose ``free`` first asks the controller whether a copy
    still uses the slots."""

    def __init__(self, inner, check):
        self._inner = inner
        self._check = check

    def free(self, indices):
        self._check("device", np.asarray(indices, dtype=np.int64))
        self._inner.free(indices)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class FakeEvent:
    """``query()`` says whether the copy finished; ``synchronize()`` finishes it (the host
    waits until it has).  ``syncs`` counts the blocking calls."""

    def __init__(self, fake: "FakeController", kind: str, key: int):
        self._fake, self.kind, self.key = fake, kind, key
        self.done = False
        self.syncs = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.syncs += 1
        self._fake._finish(self.kind, self.key)


class HiCacheAck(NamedTuple):
    start_event: FakeEvent
    finish_event: FakeEvent
    node_ids: list


class _Slot:
    def __init__(self, event):
        self.finish_event = event


class FakeLayerDoneCounter:
    def __init__(self):
        self.num_counters = 3
        self.events = [_Slot(FakeEvent(None, "none", -1)) for _ in range(3)]
        for s in self.events:
            s.finish_event.done = True
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self):
        self.producer_index = (self.producer_index + 1) % self.num_counters
        assert self.events[self.producer_index].finish_event.query(), "Producer finish event should be ready"
        return self.producer_index


class FakeController:
    """See the module doc.  ``writes`` / ``loads``: every copy started, in order, as dicts
    with ``host``, ``device``, ``node_ids``, ``done``."""

    def __init__(self, device_size: int, host_size: int, page_size: int = 1, write_policy: str = "write_through"):
        inner = (TokenToKVPoolAllocator(device_size) if page_size == 1
                 else PagedTokenToKVPoolAllocator(device_size, page_size))
        self.mem_pool_device_allocator = CheckedAllocator(inner, self._check_free)
        self.mem_pool_host = FakeHostPool(host_size, page_size)
        self.mem_pool_host.in_use_check = self._check_free
        self.page_size = page_size
        self.write_policy = write_policy
        self.io_backend = "kernel"
        self.write_queue, self.load_queue = [], []
        self.ack_write_queue, self.ack_load_queue = [], []
        self.writes, self.loads = [], []
        self.layer_done_counter = FakeLayerDoneCounter()
        self.resets = 0

    # --- SGLang's controller surface
    def reset(self):
        self.resets += 1
        self.write_queue.clear()
        self.load_queue.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()

    def write(self, device_indices, priority=None, node_id=-1):
        device_indices = np.asarray(device_indices, dtype=np.int64)
        host = self.mem_pool_host.alloc(len(device_indices))
        if host is None:
            return None
        self.write_queue.append((host, device_indices.copy(), node_id))
        self.start_writing()
        return host

    def start_writing(self):
        if not self.write_queue:
            return
        host = np.concatenate([h for h, _, _ in self.write_queue])
        dev = np.concatenate([d for _, d, _ in self.write_queue])
        ids = [n for _, _, n in self.write_queue]
        self.write_queue.clear()
        key = len(self.writes)
        self.writes.append({"host": host, "device": dev, "node_ids": ids, "done": False})
        ev = FakeEvent(self, "write", key)
        self.ack_write_queue.append(HiCacheAck(FakeEvent(self, "none", -1), ev, ids))

    def load(self, host_indices, priority=None, node_id=-1):
        host_indices = np.asarray(host_indices, dtype=np.int64)
        dev = self.mem_pool_device_allocator.alloc(len(host_indices))
        if dev is None:
            return None
        self.load_queue.append((host_indices.copy(), dev, node_id))
        return dev

    def start_loading(self):
        if not self.load_queue:
            return -1
        producer = self.layer_done_counter.update_producer()
        host = np.concatenate([h for h, _, _ in self.load_queue])
        dev = np.concatenate([d for _, d, _ in self.load_queue])
        ids = [n for _, _, n in self.load_queue]
        self.load_queue.clear()
        key = len(self.loads)
        self.loads.append({"host": host, "device": dev, "node_ids": ids, "done": False})
        ev = FakeEvent(self, "load", key)
        self.layer_done_counter.events[producer] = _Slot(ev)
        self.ack_load_queue.append(HiCacheAck(FakeEvent(self, "none", -1), ev, ids))
        return producer

    def evict_device(self, device_indices):
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def evict_host(self, host_indices, backup_only=True):
        return self.mem_pool_host.free(host_indices)

    # --- test controls
    def _events(self, kind):
        queue = self.ack_write_queue if kind == "write" else self.ack_load_queue
        return [a.finish_event for a in queue]

    def _finish(self, kind, key):
        if kind == "none":
            return
        (self.writes if kind == "write" else self.loads)[key]["done"] = True
        for a in self.ack_write_queue + self.ack_load_queue:
            if a.finish_event.kind == kind and a.finish_event.key == key:
                a.finish_event.done = True
        for s in self.layer_done_counter.events:
            if s.finish_event.kind == kind and s.finish_event.key == key:
                s.finish_event.done = True

    def finish_writes(self, n=None):
        """Complete the oldest ``n`` unfinished backups (all by default)."""
        todo = [i for i, w in enumerate(self.writes) if not w["done"]]
        for i in todo[: len(todo) if n is None else n]:
            self._finish("write", i)

    def finish_loads(self, n=None):
        """Complete the oldest ``n`` unfinished loads (all by default)."""
        todo = [i for i, w in enumerate(self.loads) if not w["done"]]
        for i in todo[: len(todo) if n is None else n]:
            self._finish("load", i)

    def _check_free(self, where, indices):
        idx = set(indices.tolist())
        for w in self.writes:
            if not w["done"] and where == "device" and idx & set(w["device"].tolist()):
                raise SlotStillInUse(f"device slots {sorted(idx & set(w['device'].tolist()))} freed during a backup")
        for op in self.loads + [{"host": h, "device": d, "done": False} for h, d, _ in self.load_queue]:
            if op["done"]:
                continue
            hit = idx & set(op[where].tolist())
            if hit:
                raise SlotStillInUse(f"{where} slots {sorted(hit)} freed while a load uses them")
