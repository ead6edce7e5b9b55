"""SGLang 0.5.14's ``HiCacheController`` (``managers/cache_controller.py``) on the online executor.

The controller owns the load and write queues, the acknowledgement queues and the
``LayerDoneCounter``.  Every copy it starts is an op issued through a
:class:`sim.executor.Host` (the scheduler thread), so every byte it moves lands in the
run's buffers with its provenance, and the run records it as a schedule.

Order of operations (SGLang 0.5.14, ``reference/sglang_hicache.md`` §1.2-1.3):

``load(host_indices)``
    allocates device slots at once and queues a :class:`CacheOperation`; no copy.
``start_loading()``
    ``update_producer()`` (a ``host_query`` of the reused slot's finish event; a
    pending one raises :class:`ProducerSlotBusy`, as SGLang's ``assert`` does), merge
    the queued ops, ``move_indices``, ``record`` of the slot's start event on the
    *current* stream, ``wait`` of it on the load stream, then for every layer ``i``:
    every host pool's layer-``i`` copies (``mem_pool_host.load_to_device_per_layer``),
    the draft pool's layer ``i`` if one is registered, and ``record`` of
    ``load_events[i]`` on the load stream.  The ack is appended; the producer id is
    returned.
``write(device_indices)``
    allocates host slots, queues, and calls ``start_writing()`` at once: a fresh start
    event recorded on the current stream, ``wait`` on the write stream, one
    ``backup_from_device_all_layer`` (all its ops), the draft pool's backup, then the
    finish event's ``record``.

Branch counters and pools left out.  Every copy op issued is counted per device pool role
(``sim.pools.device.POOL_ROLE_OF_KIND`` of its device-side buffer) and routine
(:attr:`HiCacheController.branches`; :data:`ROUTINE_BRANCHES` classifies the routines).
``backup_pools`` (a set of roles; None: all) drops the copies of every other pool from backups
and loads alike, as when SGLang's host group lacks that pool (SGLang #17085).

Events are names declared in the run's header (:meth:`HiCacheController.event_names`).
The ring of 3 :class:`LayerLoadingEvent` slots keeps fixed names (SGLang reuses the
objects); each ``start_writing`` takes a fresh (start, finish) pair from a pool of
``write_event_pool`` names, recycled only once no ack in ``ack_write_queue`` refers to
it (the tree removes an ack when it has processed it).

Blocking host calls.  SGLang's ``finish_event.synchronize()`` and the blocking D2H of an
index tensor (``device_indices.cpu()`` in ``move_indices`` for the direct backend) stop
the scheduler thread.  Plain Python code cannot block a SimPy process, so the
controller queues the blocking step and the host program must ``yield from
controller.settle()`` before it issues anything else.  Until then the controller
issues nothing: a call whose result depends on the device's state (``query()``,
``start_loading()``'s producer check) or that issues on the caller's behalf
(``record``/``wait``, ``wait_until``) is refused (:class:`SettleRequired`); the ops of a
``write()``/``start_writing()`` and further ``synchronize()`` calls are queued behind the
pending step.  NOTE: this is equivalent to SGLang's blocking call: the thread stops at
the call and issues nothing before it returns; here nothing is issued between the
request and ``settle()``, which issues the blocking op, waits for it in simulated time,
then issues whatever SGLang issues after it (the rest of ``start_loading``, a later
backup), in the same order.  Host-side bookkeeping done in between (allocating host or
device slots, freeing, tree updates) does not depend on time, so running it early
changes nothing.
A ``synchronize()`` of an event whose record has already completed (or was never
recorded: a CUDA no-op) cannot block; it is recorded as a positive ``host_query`` (the
same happens-before edge; a GPU replay turns it into a ``host_sync``) and needs no
settle.  That is the case of SGLang's ``writing_check``/``loading_check``, which
synchronize only events their ``query()`` just saw complete.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sim.errors import InputError, KvraceError, show
from sim.pools.device import POOL_ROLE_OF_KIND
from sim.pools.host import IO_BACKENDS

__all__ = ["CacheOperation", "ControllerError", "EventPoolExhausted", "HiCacheAck", "HiCacheController",
           "HostEvent", "LayerDoneCounter", "LayerLoadingEvent", "ProducerSlotBusy", "ROUTINE_BRANCHES",
           "SettleRequired", "WRITE_POLICIES", "IO_BACKENDS"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
#: ``LayerDoneCounter.num_counters`` ("extra producer and consumer counters for overlap mode")
NUM_PRODUCER_SLOTS = 3
#: default number of (start, finish) write-event name pairs a run declares
DEFAULT_WRITE_EVENT_POOL = 64
#: copy routine -> (granularity, path) of the branch it is: ``page`` (whole pages or token
#: rows addressed by the pool's own unit) or ``token`` (the warp-per-token
#: ``transfer_cache_dsv4_mla`` on raw indices); ``kernel`` (a GPU kernel) or ``direct``
#: (host-issued memcpys)
ROUTINE_BRANCHES = {
    "kernel_per_layer": ("page", "kernel"), "kernel_all_layer": ("page", "kernel"),
    "dsa_indexer_per_layer": ("page", "kernel"), "staged_all_layer_lf_pf": ("page", "kernel"),
    "direct_per_layer": ("page", "direct"), "direct_page_first": ("page", "direct"),
    "dsv4_token": ("token", "kernel"),
}


class ControllerError(KvraceError, RuntimeError):
    """A HiCache controller call that cannot proceed (the subclasses say why)."""


class ProducerSlotBusy(ControllerError, AssertionError):
    """``LayerDoneCounter.update_producer`` found the reused ring slot's finish event not
    complete: SGLang's ``assert ... "Producer finish event should be ready before being
    reused."`` (a 4th ``start_loading`` while the oldest of 3 loads is still in flight).
    Also an ``AssertionError``, as in SGLang.  As there, the producer index has already
    advanced when it is raised."""


class SettleRequired(ControllerError):
    """A call that reads the device's state (``query()``, ``start_loading()``'s producer
    check) or issues an op on the caller's behalf (a handle's ``record``/``wait``,
    ``wait_until``) while a blocking call (``synchronize``, a blocking index-tensor D2H) is
    pending: the host program must ``yield from controller.settle()`` first.  (A backup's
    ops and further synchronizes are queued behind the pending step instead.)"""


class EventPoolExhausted(ControllerError):
    """Every write-event name pair is held by an unprocessed ack; raise the
    ``write_event_pool`` knob (names declared in the run's header)."""


# ---------------------------------------------------------------- events

def _with_id(op: dict, op_id: str | None) -> dict:
    if op_id is not None:
        op["id"] = op_id
    return op


class HostEvent:
    """A CUDA event handle: an event name of the run, used through the controller's host.

    ``record(stream)`` / ``wait(stream)`` issue the stream ops; ``query()`` issues a
    ``host_query`` and returns its outcome (``cudaEventQuery``: an event never recorded
    reports complete); ``synchronize()`` blocks the host (see the module doc: the host
    program must ``yield from controller.settle()`` before its next op unless the
    record has already completed)."""

    __slots__ = ("name", "_ctl")

    def __init__(self, controller: "HiCacheController", name: str):
        self._ctl = controller
        self.name = name

    def record(self, stream: str | None = None, *, id: str | None = None) -> str:
        """``event.record(stream)``; ``None``: the controller's current stream.  Returns the op id."""
        return self._ctl._issue(_with_id({"op": "record", "stream": stream or self._ctl.current_stream,
                                          "event": self.name}, id))

    def wait(self, stream: str | None = None, *, id: str | None = None) -> str:
        """``event.wait(stream)`` (``stream.wait_event``); ``None``: the current stream."""
        return self._ctl._issue(_with_id({"op": "wait", "stream": stream or self._ctl.current_stream,
                                          "event": self.name}, id))

    def query(self, rank: int | None = None) -> bool:
        """``rank`` None: complete on every simulated rank (each queried); else on that rank
        (a TP group simulated in lockstep, :mod:`sim.cache.ranks`)."""
        return self._ctl._query(self.name, rank)

    def synchronize(self) -> None:
        self._ctl._synchronize_event(self.name)

    def __repr__(self) -> str:
        return f"HostEvent({self.name!r})"


class LayerLoadingEvent:
    """One producer slot: a start event and one load event per layer (fixed names)."""

    def __init__(self, controller: "HiCacheController", slot: int, num_layers: int):
        self._num_layers = num_layers
        self._ctl = controller
        self.load_events = [HostEvent(controller, n) for n in controller._load_names(slot, num_layers)]
        self.start_event = HostEvent(controller, controller._load_start_name(slot))

    def complete(self, layer_index: int, *, id: str | None = None) -> None:
        """Record ``load_events[layer_index]`` on the load stream (SGLang records it on the
        current stream, which inside ``start_loading`` is the load stream)."""
        if not 0 <= layer_index < self._num_layers:
            raise InputError("layer_index", f"expected 0..{self._num_layers - 1}, got {show(layer_index)}")
        self.load_events[layer_index].record(self._ctl.load_stream, id=id)

    def wait(self, layer_index: int, stream: str | None = None) -> None:
        """``current_stream().wait_event(load_events[layer_index])``: a GPU-side wait."""
        if not 0 <= layer_index < self._num_layers:
            raise InputError("layer_index", f"expected 0..{self._num_layers - 1}, got {show(layer_index)}")
        self.load_events[layer_index].wait(stream)

    @property
    def finish_event(self) -> HostEvent:
        return self.load_events[-1]


class LayerDoneCounter:
    """The ring of ``num_counters`` = 3 producer slots and the consumer index.

    ``update_producer()`` advances the producer index, then queries the slot's finish
    event and raises :class:`ProducerSlotBusy` if it has not completed (SGLang asserts;
    it never waits).  ``wait_until(threshold, stream)`` inserts a wait on
    ``load_events[threshold]`` of the consumer's slot into ``stream`` (the stream current
    at the accessor call: the gate); with ``consumer_index < 0`` it does nothing."""

    def __init__(self, controller: "HiCacheController", num_layers: int):
        self.num_layers = num_layers
        self.num_counters = NUM_PRODUCER_SLOTS
        self._ctl = controller
        self.events = [LayerLoadingEvent(controller, k, num_layers) for k in range(self.num_counters)]
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self) -> int:
        self.producer_index = (self.producer_index + 1) % self.num_counters
        # NOTE: SGLang advances the index before its assert, so after a failed assert the
        # index stays advanced; reproduced.  The query is a real cudaEventQuery (an op).
        if not self.events[self.producer_index].finish_event.query():
            raise ProducerSlotBusy("Producer finish event should be ready before being reused. "
                                   f"(slot {self.producer_index}: a load issued 3 start_loading calls ago "
                                   "has not completed)")
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, threshold: int, stream: str | None = None) -> None:
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(threshold, stream)

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1


# ---------------------------------------------------------------- operations

class CacheOperation:
    """A queued load or write: host and device indices (int64 arrays), node ids, priority.

    ``id`` counts the operations of one controller (SGLang counts per process, in a class
    attribute); the default priority is the id."""

    def __init__(self, host_indices, device_indices, node_id: int, priority: int | None, op_id: int):
        self.host_indices = np.asarray(host_indices, dtype=np.int64)
        self.device_indices = np.asarray(device_indices, dtype=np.int64)
        self.node_ids = [node_id]
        self.id = op_id
        self.priority = priority if priority is not None else op_id

    @staticmethod
    def merge_ops(ops: list["CacheOperation"], next_id) -> "CacheOperation":
        """One op stays itself; several concatenate their indices in queue order, keep
        the minimum priority and every node id (the merged op takes a fresh id, as in
        SGLang, whose constructor increments the counter)."""
        if not ops:
            raise ControllerError("merge_ops needs at least one operation")
        if len(ops) == 1:
            return ops[0]
        merged = CacheOperation(np.concatenate([o.host_indices for o in ops]),
                                np.concatenate([o.device_indices for o in ops]), -1,
                                min(o.priority for o in ops), next_id())
        merged.node_ids = [n for o in ops for n in o.node_ids]
        return merged

    def __lt__(self, other: "CacheOperation") -> bool:
        return self.priority < other.priority


class HiCacheAck(NamedTuple):
    start_event: HostEvent
    finish_event: HostEvent
    node_ids: list


@dataclass
class _Sync:
    """A blocking call waiting for ``settle()``: an event or a stream synchronize."""
    event: str | None = None
    stream: str | None = None


# ---------------------------------------------------------------- the controller

class HiCacheController:
    """SGLang 0.5.14's ``HiCacheController`` for the L1 <-> L2 path (no L3 storage).

    ``host``: the :class:`sim.executor.Host` of the scheduler thread; ``load_stream``,
    ``write_stream``: stream names of the run; ``current_stream``: the stream current on
    the scheduler thread when it calls ``start_loading``/``start_writing`` (default
    ``"schedule"``: in overlap mode, SGLang's default, that is ``schedule_stream``; without
    overlap it is the forward (default) stream).  ``load_fence_stream`` (default ``None``: off, as
    in 0.5.14): SGLang PR #36738 (merged after 0.5.14) makes the load stream wait for
    that stream (the forward stream) before its copies: modelled as a ``record`` of the
    ``load_fence`` event on it at ``start_loading`` and a ``wait`` of it on the load
    stream right after the start event's wait.  ``write_event_pool``: how many (start,
    finish) write-event pairs the header declares.  ``name``: prefix of the controller's
    event names and op ids (several controllers in one run need distinct names).
    """

    def __init__(self, token_to_kv_pool_allocator, mem_pool_host, page_size: int, *, host, load_stream: str,
                 write_stream: str, current_stream: str = "schedule", write_policy: str = "write_through",
                 io_backend: str = "kernel", load_fence_stream: str | None = None,
                 write_event_pool: int = DEFAULT_WRITE_EVENT_POOL, name: str = "hicache",
                 backup_pools=None):
        if write_policy not in WRITE_POLICIES:
            raise InputError("write_policy", f"Invalid write policy: expected one of {list(WRITE_POLICIES)}, "
                             f"got {show(write_policy)}")
        if io_backend not in IO_BACKENDS:
            raise InputError("io_backend", f"expected one of {list(IO_BACKENDS)}, got {show(io_backend)}")
        if not isinstance(write_event_pool, int) or isinstance(write_event_pool, bool) or write_event_pool < 1:
            raise InputError("write_event_pool", f"expected an integer >= 1, got {show(write_event_pool)}")
        self.host = host
        self.name = name
        #: simulated TP ranks (a :class:`sim.cache.ranks.RankedHost` issues every op on each)
        self.ranks = int(getattr(host, "ranks", 1))
        self._base = getattr(host, "base", host)
        self._rank_names = getattr(host, "names", lambda n: [n])
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        self.mem_pool_device = token_to_kv_pool_allocator.get_kvcache()
        self.mem_pool_host = mem_pool_host
        self.page_size = page_size
        self.write_policy = write_policy
        self.io_backend = io_backend
        self.load_stream = load_stream
        self.write_stream = write_stream
        self.current_stream = current_stream
        self.load_fence_stream = load_fence_stream
        self.write_event_pool = write_event_pool
        self.layer_num = int(self.mem_pool_device.layer_num)
        self.has_draft = False
        self.mem_pool_device_draft = None
        self.mem_pool_host_draft = None

        self.load_queue: list[CacheOperation] = []
        self.write_queue: list[CacheOperation] = []
        self.ack_load_queue: list[HiCacheAck] = []
        self.ack_write_queue: list[HiCacheAck] = []
        self._next_op_id = 0
        self._seq = {"load": 0, "write": 0}
        self._pending: deque = deque()         # _Sync requests and deferred issue steps
        self._settling = False
        self._write_free = deque(range(write_event_pool))   # write-event pair indices not in use
        self._write_out: list[int] = []                      # pairs handed out, oldest first
        declared = set(host._ex.builder.events)
        missing = [e for e in self.event_names(self.layer_num, write_event_pool=write_event_pool, name=name,
                                               load_fence=load_fence_stream is not None) if e not in declared]
        if missing:
            raise InputError("events", f"the run's header does not declare the controller's events "
                             f"{show(missing[:4])} ({len(missing)} missing); declare "
                             "HiCacheController.event_names(...) in the header's 'events'")
        for s in (load_stream, write_stream, current_stream) + ((load_fence_stream,) if load_fence_stream else ()):
            if s not in host._ex.builder.streams:
                raise InputError("streams", f"stream {show(s)} is not declared in the run's header; expected one "
                                 f"of {show(sorted(host._ex.builder.streams))}")
        self.layer_done_counter = LayerDoneCounter(self, self.layer_num)
        #: device buffer name -> pool role (``sim.pools.device.POOL_ROLE_OF_KIND``)
        self._role_of: dict[str, str] = {}
        self._learn_roles(self.mem_pool_device)
        roles = set(self._role_of.values())
        if backup_pools is not None:
            backup_pools = frozenset(backup_pools)
            unknown = sorted(backup_pools - roles)
            if unknown:
                raise InputError("backup_pools", f"expected pool roles of the device pool {sorted(roles)}, "
                                 f"got {show(unknown)}")
        #: pool roles whose copies backups and loads issue (None: every pool, as SGLang)
        self.backup_pools = backup_pools
        #: {pool role: {copy routine: copy ops issued}} (see :attr:`branches`)
        self._branches: dict[str, dict[str, int]] = {}

    # ---------------------------------------------------------------- names
    @staticmethod
    def event_names(layer_num: int, *, write_event_pool: int = DEFAULT_WRITE_EVENT_POOL, name: str = "hicache",
                    load_fence: bool = False) -> list[str]:
        """Every event name a controller of ``layer_num`` layers uses (declare them in the
        run's header): per ring slot a start event and ``layer_num`` load events, the write
        pool's (start, finish) pairs, and the load fence's event if enabled."""
        out = []
        for slot in range(NUM_PRODUCER_SLOTS):
            out.append(HiCacheController._load_start_name_of(name, slot))
            out.extend(HiCacheController._load_names_of(name, slot, layer_num))
        for k in range(write_event_pool):
            out.extend(HiCacheController._write_names_of(name, k))
        if load_fence:
            out.append(f"{name}.load_fence")
        return out

    @staticmethod
    def _load_start_name_of(name: str, slot: int) -> str:
        return f"{name}.load{slot}.start"

    @property
    def loads_started(self) -> int:
        """How many merged loads ``start_loading`` has issued in this run."""
        return self._seq["load"]

    @property
    def writes_started(self) -> int:
        """How many backups ``start_writing`` has issued in this run."""
        return self._seq["write"]

    def layer_event_names(self, slot: int) -> list[str]:
        """The per-layer load event names of producer ``slot`` (what a gated reader of a batch
        with consumer index ``slot`` waits on)."""
        return [e.name for e in self.layer_done_counter.events[slot].load_events]

    @staticmethod
    def _load_names_of(name: str, slot: int, layer_num: int) -> list[str]:
        return [f"{name}.load{slot}.L{i}" for i in range(layer_num)]

    @staticmethod
    def _write_names_of(name: str, k: int) -> tuple[str, str]:
        return f"{name}.write{k}.start", f"{name}.write{k}.finish"

    def _load_start_name(self, slot: int) -> str:
        return self._load_start_name_of(self.name, slot)

    def _load_names(self, slot: int, layer_num: int) -> list[str]:
        return self._load_names_of(self.name, slot, layer_num)

    # ---------------------------------------------------------------- the host side
    def _require_settled(self, what: str) -> None:
        if self._pending and not self._settling:
            raise SettleRequired(f"{what} while a blocking call is pending ({len(self._pending)} step(s)); "
                                 "the host program must `yield from controller.settle()` first")

    def _issue(self, op: dict) -> str:
        self._require_settled(f"issuing a {op.get('op')} op")
        return self.host.issue(op)

    def _query(self, event: str, rank: int | None = None) -> bool:
        self._require_settled(f"query() of {event!r}")
        if rank is None:
            return self.host.query(event)
        if rank >= self.ranks:
            raise InputError("rank", f"expected a rank in 0..{self.ranks - 1}, got {show(rank)}")
        return self._base.query(self._rank_names(event)[rank])

    def _record_complete(self, event: str) -> bool:
        """Has the latest record of ``event`` issued so far completed on every rank (no
        record: True)?  Reads the executor's state without issuing an op."""
        return all(self._record_complete_one(n) for n in self._rank_names(event))

    def _record_complete_one(self, name: str) -> bool:
        ex = self.host._ex
        # NOTE: the builder binds a host_query to this same record (_last_record), and
        # resolve_query is the executor's own rule for a query's outcome.
        return ex.resolve_query(ex.builder._last_record.get(name))

    def _synchronize_event(self, event: str) -> None:
        if not self._pending and self._record_complete(event):
            # cannot block: a positive query gives the same happens-before edge
            self.host.query(event)
            return
        self._pending.append(_Sync(event=event))

    def _block_on_stream(self, stream: str) -> None:
        """A blocking D2H of a device tensor (``tensor.cpu()``): the copy is queued on
        ``stream`` and the host waits for it, hence for everything issued on ``stream``."""
        self._pending.append(_Sync(stream=stream))

    def _then(self, step) -> None:
        """Run ``step()`` (which issues ops) now, or after the pending blocking calls."""
        if self._pending:
            self._pending.append(step)
        else:
            step()

    @property
    def settled(self) -> bool:
        """True when no blocking call waits for ``settle()``."""
        return not self._pending

    def settle(self):
        """Generator: ``yield from controller.settle()`` in the host program after a call
        that may block.  Issues each queued blocking op (yielding its SimPy event: the
        host waits in simulated time) and then what SGLang issues after it."""
        self._settling = True
        try:
            while self._pending:
                step = self._pending.popleft()
                if isinstance(step, _Sync):
                    # NOTE: each simulated rank blocks on its own event / stream, rank by rank
                    # (one rank: exactly the single host_sync or positive query)
                    if step.event is not None:
                        for name in self._rank_names(step.event):
                            if self._record_complete_one(name):
                                self._base.query(name)
                                continue
                            yield self._base.synchronize(event=name)
                    else:
                        for name in self._rank_names(step.stream):
                            yield self._base.synchronize(stream=name)
                else:
                    step()
        finally:
            self._settling = False

    # ---------------------------------------------------------------- draft
    def set_draft_kv_pool(self, draft_device_pool, draft_host_pool) -> None:
        """Register a draft (MTP/EAGLE) device pool and its host pool: loads and backups
        carry the draft pool's copies too (layer ``i`` of the draft after the target's
        layer ``i``, for ``i < draft layer_num``)."""
        self.has_draft = True
        self.mem_pool_device_draft = draft_device_pool
        self.mem_pool_host_draft = draft_host_pool
        self._learn_roles(draft_device_pool)

    # ---------------------------------------------------------------- operations
    def _new_id(self) -> int:
        i = self._next_op_id
        self._next_op_id += 1
        return i

    def write(self, device_indices, priority: int | None = None, node_id: int = -1):
        """Back up device slots: allocate host slots (None when the host pool cannot),
        queue, and start writing at once.  Returns the host indices.  While a blocking
        call is pending, the backup's ops are issued by ``settle()`` after it (SGLang's
        thread would reach this call only after the block)."""
        device_indices = np.asarray(device_indices, dtype=np.int64)
        self._reclaim_write_pairs()          # an exhausted pool fails before any slot is taken
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.write_queue.append(CacheOperation(host_indices, device_indices, node_id, priority, self._new_id()))
        self.start_writing()
        return host_indices

    def load(self, host_indices, priority: int | None = None, node_id: int = -1):
        """Allocate device slots for ``host_indices`` at once (None when the allocator
        cannot) and queue the load; no copy is issued until ``start_loading``."""
        host_indices = np.asarray(host_indices, dtype=np.int64)
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(CacheOperation(host_indices, device_indices, node_id, priority, self._new_id()))
        return device_indices

    def move_indices(self, host_indices, device_indices):
        """Where the copy kernels want the indices.  ``kernel``: host indices go to the
        GPU (non-blocking; index tensors are not modelled buffers), nothing else.
        ``direct`` + ``layer_first``: the device indices come to the CPU (a blocking D2H
        on the current stream: the host waits for that stream) and the host indices are
        sorted, the device indices permuted to match.  ``direct`` + ``page_first_direct``:
        the blocking D2H only.  Any other layout with ``direct`` is SGLang's ValueError."""
        if self.io_backend == "kernel":
            return host_indices, device_indices
        layout = self.mem_pool_host.layout
        if layout == "layer_first":
            self._block_on_stream(self.current_stream)
            order = np.argsort(host_indices, kind="stable")
            return host_indices[order], device_indices[order]
        if layout == "page_first_direct":
            self._block_on_stream(self.current_stream)
            return host_indices, device_indices
        raise InputError("io_backend", f"Unsupported layout {layout!r} for io backend 'direct'; expected "
                         "'layer_first' or 'page_first_direct'")

    def _learn_roles(self, device_pool) -> None:
        kind_of = getattr(device_pool, "kind_of", None)
        if kind_of is None:
            return
        for name in getattr(device_pool, "layouts", {}):
            self._role_of[name] = POOL_ROLE_OF_KIND.get(kind_of(name), kind_of(name))

    def role_of(self, buffer: str) -> str | None:
        """The pool role of a device buffer of this controller's pools (None: not one)."""
        return self._role_of.get(buffer)

    @property
    def branches(self) -> dict[str, dict[str, int]]:
        """Per device pool role, per copy routine, the copy ops this controller issued (loads
        and backups; a pool left out by ``backup_pools`` issues none).  The routine names
        the branch: :data:`ROUTINE_BRANCHES` gives its granularity (page / token) and path
        (kernel / direct).  A fresh, sorted copy."""
        return {r: dict(sorted(v.items())) for r, v in sorted(self._branches.items())}

    def _copy_ops(self, ops: list[dict], stream: str, tag: str) -> None:
        for j, d in enumerate(ops):
            if not isinstance(d, dict) or d.get("op") != "copy":
                raise InputError("mem_pool_host", f"a pool returned {show(d)}; expected copy op dicts")
            if {"stream", "host", "id"} & set(d):
                raise InputError("mem_pool_host", "a pool's copy ops must not carry stream, host or id "
                                 "(the controller adds them)")
            role = self._role_of.get(d["dst"]) or self._role_of.get(d["src"])
            if self.backup_pools is not None and role is not None and role not in self.backup_pools:
                # NOTE: SGLang #17085: a pool the host group does not carry is never copied either
                # way; its device bytes after a load-back are the slots' previous contents
                continue
            self._issue({**d, "stream": stream, "id": f"{tag}.copy{j}"})
            if role is not None:
                per = self._branches.setdefault(role, {})
                per[d["routine"]] = per.get(d["routine"], 0) + 1

    def start_writing(self) -> None:
        """Issue one backup for every queued write (merged): start event on the current
        stream, wait on the write stream, the all-layer backup ops, the finish event."""
        if not self.write_queue:
            return
        k = self._take_write_pair()
        op = CacheOperation.merge_ops(self.write_queue, self._new_id)
        if self.io_backend == "kernel" and self.mem_pool_host.layout == "page_first" \
                and getattr(self.mem_pool_host, "can_use_write_back_jit", False):
            host_indices, device_indices = op.host_indices, op.device_indices
        else:
            host_indices, device_indices = self.move_indices(op.host_indices, op.device_indices)
        self.write_queue.clear()
        start, finish = (HostEvent(self, n) for n in self._write_names_of(self.name, k))
        seq = self._seq["write"]
        self._seq["write"] += 1
        tag = f"{self.name}.write{seq}"

        def issue():
            start.record(self.current_stream, id=f"{tag}.start")
            start.wait(self.write_stream, id=f"{tag}.wait_start")
            self._copy_ops(self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host_indices, device_indices, self.io_backend), self.write_stream, tag)
            if self.has_draft:
                self._copy_ops(self.mem_pool_host_draft.backup_from_device_all_layer(
                    self.mem_pool_device_draft, host_indices, device_indices, self.io_backend),
                    self.write_stream, f"{tag}.draft")
            finish.record(self.write_stream, id=f"{tag}.finish")

        self._then(issue)
        self.ack_write_queue.append(HiCacheAck(start, finish, op.node_ids))

    def _take_write_pair(self) -> int:
        self._reclaim_write_pairs()
        k = self._write_free.popleft()
        self._write_out.append(k)
        return k

    def _reclaim_write_pairs(self) -> None:
        """Make sure a write-event pair is free (reclaiming the pairs no ack refers to any
        more), else raise :class:`EventPoolExhausted`."""
        if not self._write_free:
            # NOTE: a pair is in use while an ack in the queue refers to it, and while a
            # synchronize of it waits for settle() (it binds to the record when issued)
            in_use = {ack.finish_event.name for ack in self.ack_write_queue}
            in_use |= {step.event for step in self._pending if isinstance(step, _Sync) and step.event}
            keep = []
            for k in self._write_out:
                (self._write_free if self._write_names_of(self.name, k)[1] not in in_use else keep).append(k)
            self._write_out = keep
        if not self._write_free:
            raise EventPoolExhausted(f"all {self.write_event_pool} write-event pairs are held by acks still in "
                                     "ack_write_queue; raise write_event_pool (and declare the names in the "
                                     "header) or process write acks (writing_check)")

    def start_loading(self) -> int:
        """Issue every queued load as one merged operation; returns the producer slot
        (the consumer index the forward pass waits on), or -1 when nothing is queued."""
        if not self.load_queue:
            return -1
        self._require_settled("start_loading()")
        producer_id = self.layer_done_counter.update_producer()
        op = CacheOperation.merge_ops(self.load_queue, self._new_id)
        host_indices, device_indices = self.move_indices(op.host_indices, op.device_indices)
        self.load_queue.clear()
        producer_event = self.layer_done_counter.events[producer_id]
        seq = self._seq["load"]
        self._seq["load"] += 1
        tag = f"{self.name}.load{seq}"

        def issue():
            producer_event.start_event.record(self.current_stream, id=f"{tag}.start")
            producer_event.start_event.wait(self.load_stream, id=f"{tag}.wait_start")
            if self.load_fence_stream is not None:
                # NOTE: PR #36738's fence (load_stream.wait_stream(forward_stream)) as a
                # record on the fence stream and a wait of it on the load stream
                fence = HostEvent(self, f"{self.name}.load_fence")
                fence.record(self.load_fence_stream, id=f"{tag}.fence")
                fence.wait(self.load_stream, id=f"{tag}.wait_fence")
            for i in range(self.layer_num):
                self._copy_ops(self.mem_pool_host.load_to_device_per_layer(
                    self.mem_pool_device, host_indices, device_indices, i, self.io_backend),
                    self.load_stream, f"{tag}.L{i}")
                if self.has_draft and i < self.mem_pool_host_draft.layer_num:
                    self._copy_ops(self.mem_pool_host_draft.load_to_device_per_layer(
                        self.mem_pool_device_draft, host_indices, device_indices, i, self.io_backend),
                        self.load_stream, f"{tag}.L{i}.draft")
                producer_event.complete(i, id=f"{tag}.L{i}.done")

        self._then(issue)
        self.ack_load_queue.append(HiCacheAck(producer_event.start_event, producer_event.finish_event,
                                              op.node_ids))
        return producer_id

    def evict_device(self, device_indices) -> int:
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def evict_host(self, host_indices, backup_only: bool = True) -> int:
        if not backup_only:
            raise InputError("backup_only", "Other eviction policies are not supported yet; expected True")
        self.mem_pool_host.free(host_indices)
        return len(host_indices)

    def reset(self) -> None:
        """Clear the queues (SGLang's ``reset`` without storage threads)."""
        self.write_queue.clear()
        self.load_queue.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
