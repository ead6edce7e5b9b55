"""Run host programs and schedules on a SimPy model of CUDA streams, events and links.

A **host program** is a generator function ``program(host)``: it issues ops
through its :class:`Host` while simulated time runs, and decides what to issue
next from what the device has done (``query``), as SGLang's scheduler threads
do.  A static :class:`~sim.schedule.Schedule` runs the same way: each of its
hosts is a program that issues its list (one code path).  Every run records the
ops its hosts issued, in issue order, as a version 2 schedule document
(:attr:`RunResult.recorded`); running that document statically gives the same
run.

Semantics (CUDA's, as far as a schedule can express them):

* A host issues ops instantly.  ``host_sync`` blocks it until its target
  completes (an event's bound record, every op issued so far on a stream, or
  every op issued so far: device synchronize); ``host_delay`` advances its
  time; ``host_query`` does not block: its outcome is whether the event's
  bound record has completed (``cudaEventQuery``; a never-recorded event
  reports complete, as CUDA does); ``barrier`` blocks until every named host
  has reached the same barrier.
* A stream runs its ops FIFO.  ``record`` completes when everything before it
  on its stream has; ``wait`` holds its stream until its bound record (the
  latest ``record`` of the event issued before the wait) completes.  A wait on
  an event with no record issued yet is a no-op, as in CUDA; the run reports it
  in :attr:`RunResult.unbound` (a consumer's wait issued before the producer's
  record orders nothing: a real bug class).
* A ``copy`` takes its link (PCIe per GPU and direction, shared by
  ``gpus_per_link`` GPUs; device-to-device copies use HBM and take no link;
  with the profile's ``link.sharing = "concurrent"`` copies do not queue for
  it), then its items land over time as ``sim.transfers.timing`` says.  Bytes of an
  item are applied when the item completes; a read during an in-flight item
  sees a prefix of it (a torn item) unless ``torn=False`` (item-atomic: what a
  controlled GPU replay can force).
* ``read`` and ``write`` touch their bytes ``kernel_launch_us`` after they
  start, instantly; they then occupy their stream for bytes / HBM bandwidth.
  ``compute`` occupies its stream for ``duration_us`` (seeded jitter).
* With the profile's ``launch_jitter_us`` > 0, every kernel (copy, read,
  write) starts after a seeded, exponentially distributed delay of that mean:
  launch skew between streams (heavy-tailed, as measured kernel starts are).

What a run keeps: ``keep="all"`` (the default) keeps every op's timings, each
copy's item landing times, every read's bytes and the recorded schedule, which
windows, controlled replay and Snapshots need; ``keep="report"`` keeps only live
state (ops issued and not completed, each stream's last op and each event's
latest record, accesses that can still race) and computes the verdicts while
the run runs (``sim.verdicts.OnlineVerdicts``), so its memory follows the live
state and the per-read results, not the run's length.  Either way completion
is tracked per stream (FIFO: the completed ops of a stream are a prefix) and an
event to wait for an op is made only when something waits for it.

Same-time starts: SimPy runs same-time events in insertion order; here every
``copy``/``read``/``write`` that becomes ready at the same instant waits at a
gate, and a :class:`TieBreak` picks their order (``fifo``, ``seeded`` with a
seed, or an explicit list of op ids that go first).  The chosen orders are
recorded in the result, so any run can be repeated exactly.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import numpy as np
import simpy

from sim.arrays import unique_sorted
from sim.deferred import DeferredRunMemory
from sim.errors import InputError
from sim.hb import RACE_LIMIT, _overlap_rows, merge_intervals
from sim.memory import Clipped, Memory, clip_and_leaves, clipped_plan, oob_origin
from sim.profile import Profile
from sim.read_views import LazyViews
from sim.schedule import Schedule, ScheduleBuilder, fewer_full_collections
from sim.transfers.routines import check_bounds
from sim.transfers.timing import bytes_done, item_times

__all__ = ["Host", "HostProgram", "ReadCapture", "RunResult", "TieBreak", "run_programs", "run_reference",
           "run_schedule", "run_static"]

HostProgram = Callable[["Host"], Generator]


@dataclass
class TieBreak:
    """How to order ops that become ready at the same simulated instant."""

    mode: str = "fifo"                 # fifo | seeded | explicit
    seed: int = 0
    first: tuple[str, ...] = ()        # explicit: these op ids go first, in this order

    def __post_init__(self):
        if self.mode not in ("fifo", "seeded", "explicit"):
            raise InputError("ties", f"expected 'fifo', 'seeded' or 'explicit', got {self.mode!r}")
        self._rng = np.random.default_rng(self.seed)

    def order(self, ops: list) -> list:
        if self.mode == "fifo" or len(ops) < 2:
            return ops
        if self.mode == "seeded":
            return [ops[i] for i in self._rng.permutation(len(ops))]
        rank = {op_id: i for i, op_id in enumerate(self.first)}
        return sorted(ops, key=lambda o: rank.get(o.id, len(rank)))


@dataclass
class ReadCapture:
    op_id: str
    index: int
    stream: str
    buffer: str
    time_us: float
    offsets: np.ndarray
    lengths: np.ndarray
    # one memory.View per extent: a list, or a LazyViews (a sequence sliced on first use)
    views: Sequence
    in_flight: list = field(default_factory=list)   # [{"copy", "items_done", "items_in_flight", "items"}]
    #: part of a copy item mid-flight at the read lies in the read's bytes, so the views hold
    #: part of its bytes (``torn`` runs); False: the views are the buffer's bytes at the
    #: read's instant, copies in flight or not (their landed items are applied before the read)
    torn: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def bytes(self) -> np.ndarray:
        if not self.views:
            return np.zeros(0, np.uint8)
        return np.concatenate([v.bytes() for v in self.views])


@dataclass
class RunResult:
    schedule: Schedule
    profile: Profile | None
    memory: Memory
    reads: list[ReadCapture]
    timings: dict[str, tuple[float, float]]      # op id -> (start_us, end_us)
    tie_orders: list[tuple[float, list[str]]]
    oob: list[dict]
    end_us: float
    item_end_us: dict[str, np.ndarray] = field(default_factory=dict)   # copy id -> when each item landed
    access_us: dict[str, float] = field(default_factory=dict)          # read/write id -> when it touched bytes
    access_seq: dict[str, int] = field(default_factory=dict)           # read/write id -> order of touching
    torn: bool = True                                                  # in-flight items visible part-way
    unbound: list[dict] = field(default_factory=list)                  # waits/queries with no record issued
    # keep="report" runs (see run_programs): what was kept, the verdicts computed while running,
    # the schedule's digest (computed as ops were issued) and how many same-instant orders there were
    kept: str = "all"
    online: Any = None
    digest: str | None = None
    tie_orders_total: int = 0

    @property
    def n_ops(self) -> int:
        """How many ops the run's hosts issued."""
        return self.online.taken if self.online is not None else len(self.schedule.ops)

    @property
    def recorded(self) -> dict:
        """The ops the hosts issued, in issue order, as a version 2 schedule document."""
        if self.kept != "all":
            raise InputError("keep", "this run kept its report only (keep='report'), not the ops its hosts "
                             "issued; expected a run with keep='all' to read its recorded schedule")
        return self.schedule.to_json()


class _Copy:
    """A copy in flight: its clipped extents and when each item lands (absolute)."""

    def __init__(self, op, clipped: Clipped, start_us: np.ndarray, end_us: np.ndarray, t0: float,
                 ext_item_start: np.ndarray):
        self.op = op
        self.c = clipped
        self.rel_start = start_us                 # items land in item order (Executor._item_times)
        self.rel_end = end_us
        self.t0 = t0
        self.end_abs = t0 + end_us
        # a one-item copy (a page): its landing time as a float, compared without numpy
        self.one_end = float(self.end_abs[0]) if self.end_abs.size == 1 else None
        # and its start as a float (t0 + start, as numpy adds them), for reads that see it in flight
        self.one_start = float(t0 + start_us[0]) if self.end_abs.size == 1 else None
        self.applied = 0                          # items [0, applied) are in memory
        self.ext_item_start = ext_item_start      # extents of item i: [ext_item_start[i], [i + 1])

    def extent_slice(self, a: int, b: int) -> slice:
        return slice(int(self.ext_item_start[a]), int(self.ext_item_start[b]))


class Host:
    """The interface a host program issues through: one per host thread.

    ``issue``, ``query`` return at once; ``synchronize``, ``delay`` and
    ``barrier`` return a SimPy event the program must ``yield``.  Every call
    appends one op to the run's recorded schedule.  Op dicts have the schedule
    format's shape (``{"op": "copy", "stream": ..., ...}``) and are validated by
    the same rules as a schedule file; the ``host`` key is filled in.
    """

    def __init__(self, executor: "Executor", name: str):
        self._ex = executor
        self.name = name
        self._barrier_calls: dict[str, int] = {}     # barrier name -> instances reached so far

    @property
    def now(self) -> float:
        """Simulated time in microseconds."""
        return self._ex.env.now

    @property
    def profile(self) -> Profile:
        """The run's hardware profile."""
        return self._ex.p

    def unfinished(self) -> list:
        """The stream ops issued and not completed, stream by stream: each stream's running op,
        then its queue (a stream is FIFO, so these are exactly its unfinished ops).  Looking
        issues nothing and records nothing (the host program's own view of what it issued)."""
        ex = self._ex
        out = []
        for stream, queue in ex.queues.items():
            running = ex._running.get(stream)
            if running is not None:
                out.append(running)
            out.extend(queue.items)
        return out

    def issue(self, op: dict) -> str:
        """Issue a stream op (copy, read, write, compute, record, wait); returns its id."""
        return self._issue_dict(op, stream_op=True).id

    def query(self, event: str) -> bool:
        """``cudaEventQuery``: has the event's latest issued record completed?  Never blocks."""
        return bool(self._issue_dict({"op": "host_query", "event": event}).outcome)

    def synchronize(self, *, event: str | None = None, stream: str | None = None) -> simpy.Event:
        """Block (``yield`` the result) until ``event``'s record, every op issued so far on
        ``stream``, or (neither given) every op issued so far has completed."""
        d = {"op": "host_sync"}
        if event is not None:
            d["event"] = event
        if stream is not None:
            d["stream"] = stream
        return self._ex.pending_event(self._issue_dict(d))

    def delay(self, duration_us: float) -> simpy.Event:
        """Advance this host's time (``yield`` the result)."""
        return self._ex.pending_event(self._issue_dict({"op": "host_delay", "duration_us": duration_us}))

    def barrier(self, name: str, hosts) -> simpy.Event:
        """Block (``yield`` the result) until every host in ``hosts`` has reached barrier
        ``name``; the k-th call with one name is the k-th instance of that barrier, recorded
        as barrier ``"name#k"``."""
        k = self._barrier_calls.get(name, 0)
        self._barrier_calls[name] = k + 1
        return self._ex.pending_event(self._issue_dict({"op": "barrier", "barrier": f"{name}#{k}",
                                                        "hosts": list(hosts)}))

    def _issue_dict(self, d: dict, stream_op: bool = False):
        if not isinstance(d, dict):
            raise InputError(f"host {self.name}", f"expected an op object, got {type(d).__name__}")
        d = dict(d)
        if stream_op and d.get("op") not in self._ex.stream_ops:
            raise InputError(f"host {self.name}", f"issue() takes stream ops {list(self._ex.stream_ops)}; "
                             "use query(), synchronize(), delay() or barrier() for host ops")
        d.setdefault("host", self.name)
        if d["host"] != self.name:
            raise InputError(f"host {self.name}", f"op names host {d['host']!r}; a host issues its own ops")
        op = self._ex.builder.add(d, resolve=self._ex.resolve_query)
        self._ex.issue(op)
        return op


class StreamQueue:
    """A stream's FIFO of issued ops: ``simpy.Store`` (unbounded) with the same events,
    scheduled in the same order, and less Python per op.

    ``simpy.Store.put`` appends the item at once and schedules a put event whose
    processing hands the first item to the first waiting ``get``; ``get`` succeeds at
    once when an item is there, else it waits.  So a ``get`` waiting on an empty queue
    is granted one event hop after the put (the put event's processing), then resumes
    its process one hop later (its own event): the same-instant tie orders of a run
    depend on these hops, so they are kept exactly.  What is left out are the callbacks
    that do nothing for an unbounded store (a get's ``_trigger_put``) and the
    bookkeeping of ``simpy.resources.base`` (``BoundClass``, put and get request
    queues of one element).  ``tests/test_speed_queues.py`` checks event for event
    against ``simpy.Store``."""

    __slots__ = ("env", "items", "_getters")

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.items: deque = deque()
        self._getters: deque = deque()

    def put(self, item) -> simpy.Event:
        self.items.append(item)
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(self._trigger_get)
        self.env.schedule(ev)
        return ev

    def get(self) -> simpy.Event:
        ev = simpy.Event(self.env)
        self._getters.append(ev)
        self._trigger_get(None)
        return ev

    def _trigger_get(self, _event) -> None:
        # NOTE: Store._do_get returns None, so one trigger serves the first waiting get only
        if self._getters and self.items:
            self._getters.popleft().succeed(self.items.popleft())


class LinkResource:
    """A link copies queue for: ``simpy.Resource(capacity=1)`` with the same events,
    scheduled in the same order, and less Python per copy.

    ``request()`` is granted at once when the link is free, else when the release
    before it is processed (one event hop after ``release``); a request made while a
    release is pending goes behind the waiting ones, and a free link goes to the first
    waiting request (``Resource._trigger_put`` looks at the first only).  Left out are
    the callbacks that do nothing here (a request's ``_trigger_get``: releases never
    wait).  ``tests/test_speed_queues.py`` checks it against ``simpy.Resource``."""

    __slots__ = ("env", "capacity", "users", "_waiting")

    def __init__(self, env: simpy.Environment, capacity: int = 1):
        self.env = env
        self.capacity = capacity
        self.users: list = []
        self._waiting: deque = deque()

    def request(self) -> simpy.Event:
        ev = simpy.Event(self.env)
        self._waiting.append(ev)
        self._trigger_put(None)
        return ev

    def release(self, request) -> simpy.Event:
        try:
            self.users.remove(request)
        except ValueError:
            pass
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(self._trigger_put)
        self.env.schedule(ev)
        return ev

    def _trigger_put(self, _event) -> None:
        if self._waiting and len(self.users) < self.capacity:
            ev = self._waiting.popleft()
            self.users.append(ev)
            ev.succeed()


class SubmissionLink:
    """A link that serves copies in the order they were issued (``link.sharing =
    "submission"``), as a copy engine runs the work submitted to it: when the link is free,
    it goes to the waiting request of the lowest ``order`` (the copy's op index), chosen
    once the instant holds nothing else (``GRANT_PRIORITY``), so that the next copy of a
    burst, which asks the moment its stream's previous copy ends, still goes before a copy
    issued after the burst that asked earlier (SGLang #38448).  One copy at a time."""

    __slots__ = ("env", "users", "_waiting", "_granting", "_asked")

    def __init__(self, env: simpy.Environment, capacity: int = 1):
        self.env = env
        self.users: list = []
        self._waiting: list = []             # heap of (order, ask number, request event)
        self._granting = False
        self._asked = 0

    def request(self, order: int = 0) -> simpy.Event:
        ev = simpy.Event(self.env)
        self._asked += 1
        heapq.heappush(self._waiting, (order, self._asked, ev))
        self._schedule_grant()
        return ev

    def release(self, request) -> None:
        self.users.remove(request)
        self._schedule_grant()

    def _schedule_grant(self) -> None:
        if self._granting or self.users or not self._waiting:
            return
        self._granting = True
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(self._grant)
        self.env.schedule(ev, GRANT_PRIORITY)

    def _grant(self, _event) -> None:
        self._granting = False
        if self._waiting and not self.users:
            _, _, ev = heapq.heappop(self._waiting)
            self.users.append(ev)
            ev.succeed()


KEEP_MODES = ("all", "report")
#: same-instant orders a keep="report" run keeps (the first ones; all are counted)
TIE_ORDER_LIMIT = 1000
#: SimPy priority of a gate's release: after simpy.events.NORMAL (1) and URGENT (0), so it
#: runs once the instant holds no other event
GATE_PRIORITY = simpy.events.NORMAL + 1
#: SimPy priority of a submission-order link's grant: after the gates, so every copy ready at
#: this instant has asked
GRANT_PRIORITY = GATE_PRIORITY + 1
#: a program run forgets where stream ops ran once this many are held (see Executor._where)
WHERE_PRUNE = 4096


def _shift_fits(plan, src_nbytes: int, dst_nbytes: int) -> bool:
    """Whether a layer-shifted plan's extents (its base's moved by ``plan.shift``) end inside
    buffers of ``src_nbytes`` and ``dst_nbytes``."""
    src_end, dst_end = plan.base.extents.ends
    ds, dd = plan.shift
    return src_end + ds <= src_nbytes and dst_end + dd <= dst_nbytes


class Executor:
    """One run: streams, links and memory, fed by host programs (see module doc).

    Completion is tracked per stream, not per op: a stream runs FIFO, so its
    completed ops are a prefix of the ops issued on it, and an op is complete when
    its position on its stream is within that prefix.  An event to wait for an op
    is made only when something waits for one that has not completed
    (``_done_event``), so the run holds nothing per completed op.

    ``keep="all"`` keeps every op's timings, each copy's item landing times, each
    read's bytes (``RunResult.reads``) and the recorded schedule; ``keep="report"``
    keeps only what the verdicts need, computing them while the run runs
    (``sim.verdicts.OnlineVerdicts``), so memory follows the live state."""

    stream_ops = ("copy", "read", "write", "compute", "record", "wait")
    #: a stream's queue and a link's queue (``simpy.Store`` and ``simpy.Resource`` give the
    #: same run, slower: tests/test_speed_queues.py runs both)
    queue_type = StreamQueue
    link_type = LinkResource
    #: landed items of one copy applied in one call where nothing lands between them (see
    #: _advance); False: one call per landing time (tests/test_speed_landing.py runs both)
    MERGE_LANDED = True
    #: ``keep="report"`` with a compact-only memory: a read with no copy item mid-flight in its buffer gets its
    #: views sliced on first use (``sim.read_views.LazyViews``); False slices every read's at
    #: its capture (the same views: tests/test_speed_lazy_views.py runs both)
    LAZY_VIEWS = True
    #: a program run with streamed verdicts and lazy views keeps no run memory of its own
    #: while its verdicts have found nothing raced: the ops not landed yet instead, the memory
    #: built from the reference when needed (``sim.deferred``); False applies every landing
    #: (the same run: tests/test_speed_deferred.py runs both)
    DEFER_RUN_MEMORY = True

    def __init__(self, buffers: dict, streams: dict, profile: Profile, *, builder: ScheduleBuilder | None = None,
                 seed: int = 0, ties: TieBreak | None = None, torn: bool = True, materialise: bool = True,
                 keep: str = "all", hosts=(), static_ops: list | None = None,
                 race_limit: int | None = RACE_LIMIT):
        if keep not in KEEP_MODES:
            raise InputError("keep", f"expected one of {list(KEEP_MODES)}, got {keep!r}")
        self.buffers = buffers
        self.builder = builder               # validates the ops of running host programs
        self.torn = torn
        self.keep_all = keep == "all"
        self.keep = keep
        self.rng = np.random.default_rng(seed)
        self.p = profile.for_run(self.rng)      # per-run draws of the profile's terms, if any
        self.ties = ties or TieBreak()
        self.mem = Memory(buffers, materialise=materialise)
        self.env = simpy.Environment()
        self.queues = {name: self.queue_type(self.env) for name in streams}
        self._issued_on = {name: 0 for name in streams}     # ops issued on each stream
        self._done_on = {name: 0 for name in streams}       # ops completed: a prefix (FIFO)
        self._waiters: dict[str, list] = {name: [] for name in streams}   # heap (position, n, event)
        self._running: dict[str, Any] = {}                  # stream -> the op it runs now
        self._where: dict[int, tuple[str, int]] = {}        # stream op index -> (stream, position)
        self._bound: dict[int, tuple[str, int]] = {}        # wait issued, not run -> its record's place
        self._prune_where = builder is not None             # a static schedule keeps every index
        self._n_wait = 0
        self.pending: dict[int, simpy.Event] = {}    # host op index -> event its host must yield
        self._issue_waiters: dict[int, simpy.Event] = {}   # stream op index -> fires when it is issued
        self._host_busy: dict[int, Any] = {}         # host ops not finished
        self.barriers: dict[str, list] = {}          # barrier instance -> [participants left, event]
        self.clipped: dict[str, Clipped] = {}        # copies issued, not started
        self.oob: list[dict] = []
        self.active: list[_Copy] = []
        self.reads: list[ReadCapture] = []
        self.timings: dict[str, tuple[float, float]] = {}
        self._t0: dict[str, float] = {}              # copies started: op id -> start
        self.tie_orders: list[tuple[float, list[str]]] = []
        self.tie_orders_total = 0
        self._pending_gate: list = []
        self._links: dict = {}
        self._link_of: dict = {}                     # (src, dst) -> (link, LinkTiming)
        self._plan_memo: dict = {}                   # see _memo
        self.item_end_us: dict[str, np.ndarray] = {}
        self.access_us: dict[str, float] = {}
        self.access_seq: dict[str, int] = {}
        self._n_access = 0
        self._frontier = -1                          # the largest op index a stream has started
        self.online = None
        if not self.keep_all:
            from sim.verdicts import OnlineVerdicts     # verdicts imports this module
            self.online = OnlineVerdicts(buffers, streams, hosts, self.mem.table, race_limit=race_limit,
                                         ops=static_ops, memo=self._memo, memory=self.mem)
        # NOTE: a static schedule's ops are taken when a read needs them, not when issued, so
        # only a program run's reference is ahead of its run (sim.deferred)
        self._deferred = (DeferredRunMemory(self.mem, self.online.ref)
                          if self.DEFER_RUN_MEMORY and self.LAZY_VIEWS and self.online is not None
                          and static_ops is None and self.mem.material is None and self.online.FAST_READS
                          else None)
        self._capture_snap = None                    # (buffer, snapshot) while a deferred read is judged
        for name in streams:
            self.env.process(self._stream(name, self.queues[name]))

    # ---------------------------------------------------------------- completion
    def _is_done(self, index: int) -> bool:
        stream, k = self._where[index]
        return k <= self._done_on[stream]

    def _done_event(self, index: int, where: tuple[str, int] | None = None) -> simpy.Event | None:
        """An event that fires when stream op ``index`` (at ``where``, its stream and
        position, if given) completes (None: it has)."""
        stream, k = where or self._where[index]
        if k <= self._done_on[stream]:
            return None
        ev = self.env.event()
        self._n_wait += 1
        heapq.heappush(self._waiters[stream], (k, self._n_wait, ev))
        return ev

    def _completed(self, stream: str) -> None:
        done = self._done_on[stream] = self._done_on[stream] + 1
        heap = self._waiters[stream]
        while heap and heap[0][0] <= done:
            heapq.heappop(heap)[2].succeed()

    def _forget_where(self) -> None:
        """Keep the positions of the ops a later op can name: each stream's last op and
        each event's latest record (the builder's view, which is the issue order)."""
        b = self.builder
        live = set(b._last_on_stream.values()) | set(b._last_record.values())
        self._where = {i: w for i, w in self._where.items() if i in live}

    # ---------------------------------------------------------------- issue
    def resolve_query(self, record_index: int | None) -> bool:
        """A host_query's outcome: its bound record has completed (no record: True, as CUDA)."""
        return record_index is None or self._is_done(record_index)

    def unissued_dependencies(self, op) -> list[int]:
        """Stream ops a static op is bound to (a wait's record, a sync's or query's targets) that
        no host has issued yet."""
        deps = (op.bound_record,) if op.op == "wait" and op.bound_record is not None else op.sync_targets
        return [i for i in deps if i not in self._where]

    def issued_event(self, index: int) -> simpy.Event:
        """An event that fires when stream op ``index`` is issued."""
        ev = self._issue_waiters.get(index)
        if ev is None:
            ev = self._issue_waiters[index] = self.env.event()
        return ev

    def pending_event(self, op) -> simpy.Event:
        return self.pending.pop(op.index)

    def issue(self, op) -> None:
        """Put one validated op into play at the current time."""
        now = self.env.now
        c = None
        if op.op == "copy":
            src, dst = self.buffers[op.src], self.buffers[op.dst]
            c, leaves = self._memo(op.plan, ("clip", src.nbytes, dst.nbytes),
                                   lambda: clip_and_leaves(op.plan, src.nbytes, dst.nbytes))
            self.clipped[op.id] = c
            if leaves:                                   # some extent leaves a buffer
                self.oob.extend(self._oob_reports(op, op.plan.extents, src, dst))
        if self.online is not None:
            d = self._deferred
            if d is not None and (op.op == "copy" or op.op == "write") and not d.issued(op, c):
                self._materialise()
            self.online.issued(op, c)
            if self._deferred is not None and not self.online.nothing_raced:
                self._materialise()
        if op.stream is not None:
            if op.op == "wait" and op.bound_record is not None:
                self._bound[op.index] = self._where[op.bound_record]     # named now, waited for later
            k = self._issued_on[op.stream] = self._issued_on[op.stream] + 1
            self._where[op.index] = (op.stream, k)
            if self._issue_waiters:
                waiter = self._issue_waiters.pop(op.index, None)
                if waiter is not None:
                    waiter.succeed()
            if self._prune_where and len(self._where) > WHERE_PRUNE + 2 * len(self._issued_on):
                self._forget_where()
            self.queues[op.stream].put(op)
            return
        if op.op == "host_delay":
            ev = self.env.timeout(op.duration_us)
        elif op.op == "host_sync":
            ev = self.env.all_of([e for e in (self._done_event(i) for i in op.sync_targets) if e is not None])
        elif op.op == "host_query":
            ev = None
        elif op.op == "barrier":
            inst = self.barriers.setdefault(op.barrier, [len(op.hosts), self.env.event()])
            inst[0] -= 1
            if inst[0] == 0:
                inst[1].succeed()
                del self.barriers[op.barrier]
            ev = inst[1]
        else:
            raise AssertionError(f"unknown host op {op.op}")
        if ev is None:
            if self.keep_all:
                self.timings[op.id] = (now, now)
            return
        self._host_busy[op.index] = op

        def finish(_e, op=op, t0=now):
            if self.keep_all:
                self.timings[op.id] = (t0, self.env.now)
            del self._host_busy[op.index]
        ev.callbacks.append(finish)
        self.pending[op.index] = ev

    #: derived values of copy plans the memo keeps (a host program's copies share plans:
    #: ``sim.transfers.routines.plan`` caches them); cleared when full, so memory stays flat
    PLAN_MEMO_SIZE = 4096

    def _memo(self, plan, what: tuple, make):
        """``make()``, remembered per plan object and ``what`` (what it derives from the
        plan: clipping to buffer sizes, item times on a link).  The memo holds the plan,
        so its ``id`` is not reused while the entry lives.

        NOTE: a layer-shifted plan's value derived from its base's (``_shifted``) is returned,
        not kept: each such plan is one copy's (a load-back's layer), looked up by its copy's
        issue and its verdicts only, and keeping them filled the memo to its clear, taking the
        bases with it (a static schedule clips every copy at time 0, its verdicts much later)."""
        if getattr(plan, "base", None) is not None:
            value = self._shifted(plan, what)
            if value is not None:
                return value
        key = (id(plan),) + what
        got = self._plan_memo.get(key)
        if got is None:
            if len(self._plan_memo) >= self.PLAN_MEMO_SIZE:
                self._plan_memo.clear()
            got = self._plan_memo[key] = (plan, make())
        return got[1]

    def _shifted(self, plan, what: tuple):
        """The memo's ``what`` of a layer-shifted plan (``CopyPlan.base``, ``shift``) from its
        base's, when the memo holds the base's and it derives (else None: made afresh).

        Item times derive from the lengths, items and launch, which are the base's own.  The
        clipping and the byte accesses derive when neither plan has an extent leaving a buffer:
        the base's clipping left its extents whole and this layer's extents, moved by the
        shift, stay inside both buffers.  Then no extent is clipped, so the clipped lengths are
        the base's arrays and the offsets the plan's own extents', and merging intervals
        commutes with a shift."""
        memo, base = self._plan_memo, plan.base
        got = memo.get((id(base),) + what)
        if got is None or got[0] is not base:
            return None
        if what[0] == "times":
            return got[1]
        if what[0] == "clip":
            c, leaves = got[1]
            if leaves or not _shift_fits(plan, what[1], what[2]):
                return None
            e = plan.extents
            return Clipped(e.src, e.dst, c.length, c.item, c.copy_len, c.fill_start, c.fill_end, what[1]), False
        if what[0] == "accesses":
            clip = memo.get((id(base), "clip") + what[1:])
            if clip is None or clip[0] is not base or clip[1][1] or not _shift_fits(plan, what[1], what[2]):
                return None
            ds, dd = plan.shift
            rs, re_, ws, we = got[1]
            return rs + ds, re_ + ds, ws + dd, we + dd
        return None

    def _copy_shape(self, plan, timing, item):
        """What a copy's run derives from its plan and link: its items' start and end
        times (relative), where each item's extents start (``ext_item_start``: item ``i``
        is extents ``[ext_item_start[i], ext_item_start[i + 1])``) and its duration."""
        start, end = self._item_times(plan, timing)
        ext_item_start = np.searchsorted(item, np.arange(end.size + 1))
        return start, end, ext_item_start, (float(end.max()) if end.size else 0.0)

    def _item_times(self, plan, timing):
        """(start, end, ext_item_start) of a copy's items relative to its start, checked
        to land in item order (the timing model's contract, which _advance relies on)."""
        start, end = item_times(plan, timing)
        start, end = np.asarray(start, float), np.asarray(end, float)
        if end.size > 1 and not bool((np.diff(end) >= 0).all()):
            raise AssertionError("copy items must complete in item order")
        return start, end

    # ---------------------------------------------------------------- reports
    def _oob_reports(self, op, ext, src, dst) -> list[dict]:
        out = []
        for r in check_bounds(ext, src.nbytes, dst.nbytes):
            buf = dst if r.side == "dst" else src
            first_out = int(r.first_byte_outside)
            out.append({
                "op": op.id, "routine": op.routine, "side": r.side, "buffer": buf.name,
                "buffer_nbytes": buf.nbytes, "item": int(r.item), "extent": int(r.extent),
                "offset": int(r.offset), "length": int(r.length), "bytes_outside": int(r.bytes_outside),
                "first_byte_outside": first_out,
                "would_hit": self.mem.neighbour(buf.name, first_out),
            })
        return out

    # ---------------------------------------------------------------- time helpers
    def _link(self, op):
        """The link a copy takes (None: no queueing) and its timing parameters, per
        (source, destination) pair (made once: the profile does not change in a run)."""
        got = self._link_of.get((op.src, op.dst))
        if got is None:
            got = self._link_of[(op.src, op.dst)] = self._make_link(op)
        return got

    def _make_link(self, op):
        src, dst = self.buffers[op.src], self.buffers[op.dst]
        if src.location == "host":
            key, gbps = ("h2d", dst.device // self.p.gpus_per_link), self.p.h2d_gbps
        elif dst.location == "host":
            key, gbps = ("d2h", src.device // self.p.gpus_per_link), self.p.d2h_gbps
        else:
            key, gbps = None, self.p.hbm_gbps / 2   # HBM counts read + write
        if self.p.link_sharing == "concurrent":
            key = None                               # copies on one link run at once
        if key is not None and key not in self._links:
            kind = SubmissionLink if self.p.link_sharing == "submission" else self.link_type
            self._links[key] = kind(self.env, capacity=1)
        return (self._links[key] if key is not None else None), self.p.link_timing(gbps)

    def _gate(self, op):
        """Wait for every op ready at this instant, then go in the tie-break order."""
        ev = self.env.event()
        if not self._pending_gate:
            # NOTE: released after every other event of this instant (SimPy orders an instant's
            # events by priority first): a stream that reaches its gate after more zero-time
            # steps (a wait, a record, a sync in front of its op) still joins this batch, so
            # how many such steps preceded an op (which a cut window's added syncs change)
            # never decides its place among same-instant ties
            release = self.env.event()
            release._ok, release._value = True, None     # triggered, as succeed() would
            release.callbacks.append(self._release)
            self.env.schedule(release, GATE_PRIORITY)
        self._pending_gate.append((op, ev))
        return ev

    def _release(self, _event):
        batch, self._pending_gate = self._pending_gate, []
        ordered = self.ties.order([op for op, _ in batch])
        if len(batch) > 1:
            self.tie_orders_total += 1
            if self.keep_all or len(self.tie_orders) < TIE_ORDER_LIMIT:
                self.tie_orders.append((self.env.now, [o.id for o in ordered]))
        events = {id(op): ev for op, ev in batch}
        for i, op in enumerate(ordered):
            # staggered zero-delay events keep the chosen order among the woken processes
            events[id(op)].succeed(i)

    def _advance(self, t: float) -> None:
        """Apply every item that has landed by time t, in landing order."""
        ranges = []                             # (copy, first item, end item) landed now
        for cp in self.active:
            e1 = cp.one_end
            if e1 is not None:                  # one item (a page copy): no grouping
                if cp.applied == 0 and e1 <= t:
                    ranges.append((cp, 0, 1))
                    cp.applied = 1
                continue
            n = int(np.searchsorted(cp.end_abs, t, side="right"))
            if n > cp.applied:
                ranges.append((cp, cp.applied, n))
                cp.applied = n
        merge = self.MERGE_LANDED
        if merge and len(ranges) == 1 and ranges[0][0].op.src != ranges[0][0].op.dst:
            # NOTE: one copy's items only: in one apply (see below)
            cp, a, b = ranges[0]
            self._land(cp, a, b)
            return
        landed = []
        for cp, a0, n in ranges:
            if cp.one_end is not None:
                landed.append((cp.one_end, cp.op.index, cp, 0, 1))
                continue
            # group by landing time so two copies' items interleave correctly
            ends = cp.end_abs[a0:n]
            cuts = np.flatnonzero(np.diff(ends)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, ends.size]):
                landed.append((float(ends[a]), cp.op.index, cp, a0 + int(a), a0 + int(b)))
        if len(landed) > 1:
            landed.sort(key=lambda x: (x[0], x[1]))
        k, n = 0, len(landed)
        while k < n:
            _, _, cp, a, b = landed[k]
            k += 1
            # NOTE: the next groups of the same copy (nothing of another copy landing between
            # them) go in one apply: a copy's extents are applied in extent order whether in one
            # call or several; that all of its source bytes are read first matters only when it
            # reads the buffer it writes (then group by group, as they land)
            if merge and cp.op.src != cp.op.dst:
                while k < n and landed[k][2] is cp and landed[k][3] == b:
                    b = landed[k][4]
                    k += 1
            self._land(cp, a, b)

    def _land(self, cp: _Copy, a: int, b: int) -> None:
        """Items ``[a, b)`` of copy ``cp`` have landed (its items before ``a`` have)."""
        if self._deferred is None:
            self.mem.apply_copy(cp.op.src, cp.op.dst, cp.c, cp.extent_slice(a, b))
        else:
            self._deferred.copy_landed(cp, cp.extent_slice(0, b), cp.extent_slice(a, b))

    # ---------------------------------------------------------------- the run's memory
    def _materialise(self) -> None:
        """Build the run's memory and keep it from now on (``sim.deferred``)."""
        if self._deferred is not None:
            self.mem = self._deferred.materialise()
            self._deferred = None

    def run_memory(self) -> Memory:
        """The run's memory as it stands (the items applied so far; built first if deferred)."""
        self._materialise()
        return self.mem

    def memory_held(self) -> Memory:
        """The memory this run holds now, without building anything: the run's, or while it is
        deferred the happens-before-order reference (the run's once every op issued has
        landed): what a memory sample of a long run should count."""
        return self.mem if self._deferred is None else self.online.ref

    def contents(self, buffer: str):
        """The ``CompactBuffer`` of ``buffer`` in the run's memory as it stands; inside the
        read sink of a read of ``buffer``, what the read saw unless the read is torn."""
        snap = self._capture_snap
        if snap is not None and snap[0] == buffer:
            return snap[1]
        return self.run_memory().compact[buffer]

    # ---------------------------------------------------------------- processes
    def run(self, programs: dict[str, HostProgram], schedule: Schedule | None = None) -> RunResult:
        """Run host programs to the end; ``schedule`` is what they issue (static runs),
        else the builder's record of what they issued."""
        for name, program in programs.items():
            self.env.process(program(Host(self, name)))
        with fewer_full_collections():
            self.env.run()
        unfinished = list(self._running.values()) + [op for q in self.queues.values() for op in q.items] \
            + list(self._host_busy.values())
        if unfinished:
            hosts = sorted({op.host for op in unfinished if op.stream is None})
            raise InputError("hosts", f"the run ended with ops that never completed "
                             f"({[op.id for op in unfinished[:5]]}); hosts {hosts} are blocked (a barrier "
                             "that some named host never reached)")
        if self._deferred is not None:
            # every op has landed: the run's memory is the reference's
            self._materialise()
        if schedule is not None:
            s, digest = schedule, None
        else:
            b = self.builder.finish()
            s, digest = b.schedule(), b.digest()
        if self.online is not None:
            self.online.finish()
            if digest is None:
                digest = s.digest()
        return RunResult(s, self.p, self.mem, self.reads, self.timings, self.tie_orders,
                         self.oob, self.env.now, self.item_end_us, self.access_us,
                         self.access_seq, self.torn, list(s.unbound), kept=self.keep, online=self.online,
                         digest=digest, tie_orders_total=self.tie_orders_total)

    def _stream(self, name: str, queue):
        keep_all = self.keep_all
        after = None  # the kind of the op this stream ran last (None: none yet)
        while True:
            get = queue.get()
            # NOTE: a stream that found its queue empty waited for the host to issue: its next
            # kernel's start follows a host launch, not the stream's previous op
            if not get.triggered:
                after = "host"
            op = yield get
            self._running[name] = op
            if op.index > self._frontier:
                self._frontier = op.index
            t0 = self.env.now
            kind = op.op
            if kind == "wait":
                if op.bound_record is not None:
                    ev = self._done_event(op.bound_record, self._bound.pop(op.index))
                    if ev is not None:
                        yield ev
            elif kind == "compute":
                # NOTE: no draw for an op issued pre-jittered, so the RNG sequence of the others
                # does not depend on how many such ops ran
                jitter = max(0.0, 1.0 + self.p.jitter_frac * self.rng.standard_normal()) if op.jitter else 1.0
                yield self.env.timeout(op.duration_us * jitter)
            elif kind == "read" or kind == "write":
                yield self._gate(op)
                t0 = self.env.now
                yield self.env.timeout(self.p.kernel_launch_us + self._skew(kind, after, self.buffers[op.buffer].device))
                now = self.env.now
                if self.active:
                    self._advance(now)
                if keep_all:
                    self.access_us[op.id] = now
                    self.access_seq[op.id] = self._n_access
                self._n_access += 1
                offs, lens = op.extents
                if kind == "read":
                    self._capture(op)
                elif self._deferred is None:
                    self.mem.apply_write(op)
                else:
                    self._deferred.write_landed(op)
                yield self.env.timeout((int(lens[0]) if lens.size == 1 else int(lens.sum()))
                                       / (self.p.hbm_gbps * 1e3))
            elif kind == "copy":
                yield from self._copy(op, after)
                t0 = self._t0.pop(op.id)
            if keep_all:
                self.timings[op.id] = (t0, self.env.now)
            del self._running[name]
            self._completed(name)
            after = kind

    def _skew(self, kind: str, after: str | None, device: int | None = None) -> float:
        """A kernel's launch skew, drawn by the profile (``Profile.launch_skew``) from the run's
        seeded generator: ``kind`` is the kernel's op kind, ``after`` what preceded it on its
        stream (an op kind, ``"host"`` when the stream had run dry, None for its first op), and,
        for a profile whose skew depends on it (``Profile.skew_by_beside``), the bytes of the
        copies in flight on ``device`` when the kernel is ready to start."""
        beside = self._bytes_beside(device) if device is not None and self.p.skew_by_beside else 0
        return self.p.launch_skew(self.rng, kind, after, beside)

    def _bytes_beside(self, device: int) -> int:
        """Bytes of the copies started and not finished now whose device side is ``device``
        (a host <-> device copy's device, a device-to-device copy's destination)."""
        now, n = self.env.now, 0
        for cp in self.active:
            if cp.end_abs.size and cp.end_abs[-1] > now:
                src, dst = self.buffers[cp.op.src], self.buffers[cp.op.dst]
                if (src.device if dst.location == "host" else dst.device) == device:
                    n += int(cp.c.copy_len.sum())
        return n

    def _copy(self, op, after):
        yield self._gate(op)
        skew = self._skew("copy", after)
        if skew:
            yield self.env.timeout(skew)
        link, timing = self._link(op)
        req = None
        if link is not None:
            # NOTE: a submission-order link takes the copy's issue index; the others (simpy's
            # Resource among them, in tests) take nothing
            req = link.request(op.index) if type(link) is SubmissionLink else link.request()
            yield req
        t0 = self._t0[op.id] = self.env.now
        c = self.clipped.pop(op.id)
        start, end, ext_item_start, total = self._memo(op.plan, ("times", timing),
                                                       lambda: self._copy_shape(op.plan, timing, c.item))
        cp = _Copy(op, c, start, end, t0, ext_item_start)
        self.active.append(cp)
        if self.keep_all:
            self.item_end_us[op.id] = cp.end_abs
        yield self.env.timeout(total)
        self._advance(self.env.now)
        self.active.remove(cp)
        if self._deferred is not None:
            self._deferred.copy_done(op)
        if link is not None:
            link.release(req)

    def _capture(self, op):
        t = self.env.now
        offs, lens = op.extents
        in_flight, partial = [], []           # partial: copies with an item mid-flight now
        for cp in self.active:
            if cp.op.dst != op.buffer:
                continue
            n_done = cp.applied
            n_items = cp.end_abs.size
            s1 = cp.one_start
            started = (int(s1 <= t) if s1 is not None
                       else int(np.searchsorted(cp.t0 + cp.rel_start, t, side="right")))
            info = {"copy": cp.op.id, "items": n_items, "items_done": n_done,
                    "items_in_flight": max(0, started - n_done)}
            in_flight.append((cp.op.index, info))
            if self.torn and started > n_done:
                partial.append((cp, n_done, started))
        torn = []                             # (copy, done part of its items in the read)
        for cp, n_done, started in partial:
            sl = cp.extent_slice(n_done, started)
            done_b = bytes_done(cp.op.plan, cp.rel_start, cp.rel_end, t - cp.t0)[sl]
            got = _torn_pieces(cp.c, sl, np.asarray(done_b, np.int64), offs, lens)
            if got is not None:
                torn.append((cp, got))
        if torn:
            self._materialise()                 # a torn read races: nothing raced is over
        if self._deferred is not None:
            # NOTE: nothing has raced, so the read sees what the reference held when it was taken
            snap = self.online.read_snapshot(op.index)
            views = LazyViews(snap, offs, lens)
            self._capture_snap = (op.buffer, snap)
        elif self.LAZY_VIEWS and self.online is not None and self.mem.material is None:
            # NOTE: a streamed run hands the capture to its verdicts and forgets it; a fresh read
            # is judged without its views (OnlineVerdicts.captured, the engine's KV oracle), so
            # they are sliced only if something looks at them, from a snapshot of this instant
            # (with the done part of the items in flight in the read's bytes written into it)
            snap = self.mem.compact[op.buffer].clone()
            for cp, (copied, filled) in torn:
                if copied is not None:
                    snap.copy_from(self.mem.compact[cp.op.src], *copied[1:])
                if filled is not None:
                    snap.fill(filled[1], filled[2], oob_origin(cp.op.src), filled[3])
            views = LazyViews(snap, offs, lens)
        else:
            # one per extent; NOTE: Memory.views pays from a few extents on, one is sliced alone
            views = ([self.mem.view(op.buffer, int(offs[0]), int(lens[0]))] if offs.size == 1
                     else self.mem.views(op.buffer, offs, lens))
            for cp, pieces in torn:
                _overlay_views(self.mem, views, cp.op.src, pieces)
        overlaid = bool(torn)
        # NOTE: listed in issue order, not in the order the copies became active: copies that
        # start at one instant on different streams may activate in either order (a window cut
        # from the run re-creates the same instant with fewer events), and the list is a set
        in_flight = [info for _, info in sorted(in_flight, key=lambda x: x[0])]
        cap = ReadCapture(op.id, op.index, op.stream, op.buffer, t, offs, lens, views, in_flight, overlaid)
        if self.online is not None:
            self.online.captured(cap, self._frontier)
            self._capture_snap = None
        else:
            self.reads.append(cap)


#: ``_torn_pieces`` intersects at most about this many (copy extent, read extent) pairs at once
TORN_PAIRS = 1 << 20


def _torn_pieces(c: Clipped, sl: slice, done_b: np.ndarray, offs: np.ndarray, lens: np.ndarray):
    """The done part (``done_b`` bytes of each) of a copy's in-flight extents ``sl`` that lies
    in a read's extents ``[offs, offs + lens)``, as pieces: each the intersection of one copy
    extent with one read extent, in copy extent order (later extents win where they overlap,
    as when the copy lands).  ``(copied, filled)``: ``copied`` as ``(read extent, src offset,
    dst offset, length)`` arrays, ``filled`` (bytes read past the source's end) as ``(read
    extent, dst offset, length, stream offset)``, either None when empty; None when no done
    byte lies in the read."""
    n_copy = np.minimum(c.copy_len[sl], done_b)
    f0, f1 = c.fill_start[sl], np.minimum(c.fill_end[sl], done_b)
    s, d = c.src[sl], c.dst[sl]
    offs, lens = np.asarray(offs, np.int64), np.asarray(lens, np.int64)
    met = _extents_met(offs, offs + lens, (d, d + f0), (d + n_copy, d + f1))
    if not met.size:
        return None
    # NOTE: (copy extents x read extents met) at a time, in chunks of read extents that keep
    # the pairs under TORN_PAIRS, then in copy extent order
    step = max(1, TORN_PAIRS // max(1, d.size))

    def pieces(start, stop):
        got = []
        for c0 in range(0, met.size, step):
            m = met[c0:c0 + step]
            a = np.maximum(start[:, None], offs[m][None, :])            # (copy extents, chunk)
            b = np.minimum(stop[:, None], (offs + lens)[m][None, :])
            i, j = np.nonzero(b > a)
            got.append((i, m[j], a[i, j], (b - a)[i, j]))
        i, j, a, n = (np.concatenate(x) for x in zip(*got))
        if len(got) > 1:
            o = np.argsort(i, kind="stable")
            i, j, a, n = i[o], j[o], a[o], n[o]
        return i, j, a, n

    i, j, a, n = pieces(d, d + n_copy)
    copied = (j, s[i] + (a - d[i]), a, n) if i.size else None
    i, j, a, n = pieces(d + f0, d + f1)
    filled = (j, a, n, s[i] + (a - d[i]) - c.src_nbytes) if i.size else None
    if copied is None and filled is None:
        return None
    return copied, filled


def _overlay_views(mem: Memory, views, src: str, pieces) -> None:
    """Write a copy's torn pieces (``_torn_pieces``) into the read's views (one per extent):
    each view its pieces, the copied ones then the filled ones, in copy extent order."""
    copied, filled = pieces
    for part, fill in ((copied, False), (filled, True)):
        if part is None:
            continue
        j = part[0]
        for k in unique_sorted(j).tolist():
            m = j == k
            if fill:
                mem.overlay_fill(views[k], oob_origin(src), part[1][m], part[2][m], part[3][m])
            else:
                mem.overlay(views[k], src, part[1][m], part[2][m], part[3][m])


def _extents_met(lo: np.ndarray, hi: np.ndarray, starts: tuple, ends: tuple) -> np.ndarray:
    """Indices (ascending) of the extents ``[lo[j], hi[j])`` (non-empty) that share a byte with
    some interval ``[starts[k][i], ends[k][i])`` (several arrays of intervals, empty ones
    included): the intervals merged, then the race tracker's row-overlap test.

    NOTE: a read beside a copy into other pages of its buffer (a forward during a load-back)
    has thousands of extents and a few items in flight, none in the read."""
    qs, qe = merge_intervals(np.concatenate(starts), np.concatenate(ends))
    if not qs.size:
        return qs
    return _overlap_rows(lo, hi, np.arange(lo.size), qs.tolist(), qe.tolist(), qs, qe)


def _static_program(ops: list, other_hosts: bool = True) -> HostProgram:
    """The host program of a static schedule: issue this host's ops in list order.

    NOTE: an op bound to another host's record (a wait, or a sync's or query's target) listed
    before it is not issued before that record is: the list says the record was issued first,
    and a wait issued earlier would bind to nothing in CUDA. The host blocks until then (only a
    hand-written or generated schedule can ask for it: a run's recorded schedule lists ops in
    the order they were issued).  ``other_hosts`` False (a one-host schedule): nothing to check,
    every bound op's record is this host's own and issued already."""
    def program(host: Host):
        ex = host._ex
        for op in ops:
            if other_hosts:
                for dep in ex.unissued_dependencies(op):
                    yield ex.issued_event(dep)
            ex.issue(op)
            if op.index in ex.pending:
                yield ex.pending_event(op)
    return program


def run_schedule(schedule: Schedule, profile: Profile, *, keep: str = "all", **kw) -> RunResult:
    """Run a static schedule: each of its hosts issues its own ops in list order.

    Keywords: ``seed``, ``ties`` (:class:`TieBreak`), ``torn``, ``materialise``;
    ``keep="report"`` computes the verdicts while running and keeps only what the
    report needs (``sim.verdicts.OnlineVerdicts``; ``race_limit`` races listed),
    ``keep="all"`` (default) keeps every read, timing and item landing time."""
    ex = Executor(schedule.buffers, schedule.streams, profile, keep=keep, hosts=schedule.hosts,
                  static_ops=schedule.ops, **kw)
    return run_static(ex, schedule)


def run_static(ex: Executor, schedule: Schedule) -> RunResult:
    """Run ``schedule`` on ``ex`` (an :class:`Executor` made for it, with ``static_ops``):
    each host issues its own ops in list order.  :func:`run_schedule` is this with a fresh
    executor; a caller that sets the executor up first (a read hook on its verdicts) calls
    it directly."""
    by_host: dict[str, list] = {h: [] for h in schedule.hosts}
    for op in schedule.ops:
        by_host[op.host].append(op)
    several = sum(1 for ops in by_host.values() if ops) > 1
    return ex.run({h: _static_program(ops, several) for h, ops in by_host.items()}, schedule)


def run_programs(header: dict, programs: dict[str, HostProgram], profile: Profile, *, keep: str = "all",
                 **kw) -> RunResult:
    """Run host programs against the buffers, streams and events of ``header`` (a
    schedule document; its ``ops``, if any, are ignored; ``hosts`` defaults to the
    programs' names).  Ops are validated as they are issued, without the MAX_OPS
    bound of documents.  The result's ``schedule`` is the recorded run: its
    ``to_json()`` (``RunResult.recorded``) re-runs statically to the same result.

    ``keep="report"``: nothing is kept per op once it has completed (no record, no
    timings; the verdicts are computed while running, ``sim.verdicts.OnlineVerdicts``),
    so memory grows with the live state, not with the run's length; the result's
    ``schedule`` then has the header only, ``RunResult.digest`` is the recorded
    schedule's digest and ``recorded`` raises.  Other keywords as :func:`run_schedule`."""
    if not isinstance(header, dict):
        raise InputError("", f"a schedule header must be a JSON object, got {type(header).__name__}")
    doc = dict(header)
    doc["ops"] = []
    doc["kvrace_schedule"] = max(2, doc.get("kvrace_schedule", 2)) if isinstance(doc.get("kvrace_schedule"), int) \
        else doc.get("kvrace_schedule")
    doc.setdefault("hosts", list(programs))
    builder = ScheduleBuilder(doc, max_ops=None, keep_ops=(keep != "report"))
    unknown = sorted(set(programs) - set(builder.hosts))
    if unknown:
        raise InputError("hosts", f"programs for hosts {unknown} that the header does not declare; "
                         f"expected hosts among {list(builder.hosts)}")
    ex = Executor(builder.buffers, builder.streams, profile, builder=builder, keep=keep, hosts=builder.hosts,
                  **kw)
    return ex.run(programs)


def run_reference(schedule: Schedule, *, materialise: bool = True, table=None) -> RunResult:
    """Every op runs to completion, alone, in issue order: the happens-before
    order execution that the corruption verdict compares against (issue order
    is a topological order of happens-before: every edge points forward).
    ``table``: an OriginTable to share (a run's: provenance then compares by id)."""
    mem = Memory(schedule.buffers, materialise=materialise, table=table)
    reads = []
    for op in schedule.ops:
        if op.op == "copy":
            src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
            mem.apply_copy(op.src, op.dst, clipped_plan(op.plan, src.nbytes, dst.nbytes))
        elif op.op == "write":
            mem.apply_write(op)
        elif op.op == "read":
            offs, lens = op.extents
            views = mem.views(op.buffer, offs, lens)
            reads.append(ReadCapture(op.id, op.index, op.stream, op.buffer, float(op.index), offs, lens,
                                     views))
    return RunResult(schedule, None, mem, reads, {}, [], [], 0.0)
