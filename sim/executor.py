"""Run a schedule on a SimPy model of CUDA streams, events and links.

Semantics (CUDA's, as far as a schedule can express them):

* The host issues ops in list order, instantly, except that ``host_sync``
  blocks it until its target completes (an event's bound record, every op
  issued so far on a stream, or everything: device synchronize) and
  ``host_delay`` advances host time.
* A stream runs its ops FIFO.  ``record`` completes when everything before it
  on its stream has; ``wait`` holds its stream until its bound record completes.
* A ``copy`` takes its link (PCIe per GPU and direction, shared by
  ``gpus_per_link`` GPUs; device-to-device copies use HBM and take no link),
  then its items land over time as ``sim.transfers.timing`` says.  Bytes of an
  item are applied when the item completes; a read during an in-flight item
  sees a prefix of it (a torn item) unless ``torn=False`` (item-atomic: what a
  controlled GPU replay can force).
* ``read`` and ``write`` touch their bytes ``kernel_launch_us`` after they
  start, instantly; they then occupy their stream for bytes / HBM bandwidth.
  ``compute`` occupies its stream for ``duration_us`` (seeded jitter).

Same-time starts: SimPy runs same-time events in insertion order; here every
``copy``/``read``/``write`` that becomes ready at the same instant waits at a
gate, and a :class:`TieBreak` picks their order (``fifo``, ``seeded`` with a
seed, or an explicit list of op ids that go first).  The chosen orders are
recorded in the result, so any run can be repeated exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.errors import InputError
from sim.memory import Clipped, Memory, clip_extents, oob_origin
from sim.profile import Profile
from sim.schedule import Schedule
from sim.transfers.routines import check_bounds
from sim.transfers.timing import bytes_done, item_times


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
    views: list           # one memory.View per extent
    in_flight: list = field(default_factory=list)   # [{"copy", "items_done", "items_in_flight", "items"}]

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


class _Copy:
    """A copy in flight: its clipped extents and when each item lands (absolute)."""

    def __init__(self, op, clipped: Clipped, start_us: np.ndarray, end_us: np.ndarray, t0: float):
        self.op = op
        self.c = clipped
        self.rel_start = start_us
        self.rel_end = end_us
        self.t0 = t0
        order = np.argsort(end_us, kind="stable")
        if not np.array_equal(order, np.arange(order.size)):
            raise AssertionError("copy items must complete in item order")  # the timing model's contract
        self.end_abs = t0 + end_us
        self.applied = 0                          # items [0, applied) are in memory
        self.ext_item_start = np.searchsorted(clipped.item, np.arange(end_us.size + 1))

    def extent_slice(self, a: int, b: int) -> slice:
        return slice(int(self.ext_item_start[a]), int(self.ext_item_start[b]))


class Executor:
    def __init__(self, schedule: Schedule, profile: Profile, *, seed: int = 0,
                 ties: TieBreak | None = None, torn: bool = True, materialise: bool = True):
        self.s = schedule
        self.p = profile
        self.torn = torn
        self.rng = np.random.default_rng(seed)
        self.ties = ties or TieBreak()
        self.mem = Memory(schedule.buffers, materialise=materialise)
        self.clipped = {}
        self.oob = []
        for op in schedule.ops:
            if op.op == "copy":
                src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
                ext = op.plan.extents
                self.clipped[op.id] = clip_extents(ext, src.nbytes, dst.nbytes)
                self.oob.extend(self._oob_reports(op, ext, src, dst))
        # same schedule, same memory model: run state
        self.env = simpy.Environment()
        self.active: list[_Copy] = []
        self.reads: list[ReadCapture] = []
        self.timings: dict[str, tuple[float, float]] = {}
        self.tie_orders: list[tuple[float, list[str]]] = []
        self._pending: list = []
        self._links: dict = {}
        self.item_end_us: dict[str, np.ndarray] = {}
        self.access_us: dict[str, float] = {}
        self.access_seq: dict[str, int] = {}

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
        src, dst = self.s.buffers[op.src], self.s.buffers[op.dst]
        if src.location == "host" and dst.location == "host":
            raise InputError(f"ops[{op.index}] ({op.id})", "host-to-host copies are not modelled; "
                             "expected a device buffer on at least one side")
        if src.location == "host":
            key, gbps = ("h2d", dst.device // self.p.gpus_per_link), self.p.h2d_gbps
        elif dst.location == "host":
            key, gbps = ("d2h", src.device // self.p.gpus_per_link), self.p.d2h_gbps
        else:
            key, gbps = None, self.p.hbm_gbps / 2   # HBM counts read + write
        if key is not None and key not in self._links:
            self._links[key] = simpy.Resource(self.env, capacity=1)
        return (self._links[key] if key is not None else None), self.p.link_timing(gbps)

    def _gate(self, op):
        """Wait for every op ready at this instant, then go in the tie-break order."""
        ev = self.env.event()
        if not self._pending:
            self.env.timeout(0).callbacks.append(self._release)
        self._pending.append((op, ev))
        return ev

    def _release(self, _event):
        batch, self._pending = self._pending, []
        ordered = self.ties.order([op for op, _ in batch])
        if len(batch) > 1:
            self.tie_orders.append((self.env.now, [o.id for o in ordered]))
        events = {id(op): ev for op, ev in batch}
        for i, op in enumerate(ordered):
            # staggered zero-delay events keep the chosen order among the woken processes
            events[id(op)].succeed(i)

    def _advance(self, t: float) -> None:
        """Apply every item that has landed by time t, in landing order."""
        landed = []
        for cp in self.active:
            n = int(np.searchsorted(cp.end_abs, t, side="right"))
            if n > cp.applied:
                # group by landing time so two copies' items interleave correctly
                ends = cp.end_abs[cp.applied:n]
                cuts = np.flatnonzero(np.diff(ends)) + 1
                for a, b in zip(np.r_[0, cuts], np.r_[cuts, ends.size]):
                    landed.append((float(ends[a]), cp.op.index, cp, cp.applied + int(a), cp.applied + int(b)))
                cp.applied = n
        landed.sort(key=lambda x: (x[0], x[1]))
        for _, _, cp, a, b in landed:
            self.mem.apply_copy(cp.op.src, cp.op.dst, cp.c, cp.extent_slice(a, b))

    # ---------------------------------------------------------------- processes
    def run(self) -> RunResult:
        queues = {name: simpy.Store(self.env) for name in self.s.streams}
        done = {op.index: self.env.event() for op in self.s.ops}
        for name in self.s.streams:
            self.env.process(self._stream(queues[name], done))
        self.env.process(self._host(queues, done))
        self.env.run()
        unfinished = [op.id for op in self.s.ops if not done[op.index].triggered]
        if unfinished:  # cannot happen for a validated schedule; guard the invariant
            raise AssertionError(f"ops never completed: {unfinished[:5]}")
        return RunResult(self.s, self.p, self.mem, self.reads, self.timings, self.tie_orders,
                         self.oob, self.env.now, self.item_end_us, self.access_us,
                         self.access_seq, self.torn)

    def _host(self, queues, done):
        for op in self.s.ops:
            if op.op == "host_delay":
                t0 = self.env.now
                yield self.env.timeout(op.duration_us)
                self.timings[op.id] = (t0, self.env.now)
                done[op.index].succeed()
            elif op.op == "host_sync":
                t0 = self.env.now
                if op.sync_targets:
                    yield self.env.all_of([done[i] for i in op.sync_targets])
                self.timings[op.id] = (t0, self.env.now)
                done[op.index].succeed()
            else:
                queues[op.stream].put(op)

    def _stream(self, queue, done):
        while True:
            op = yield queue.get()
            t0 = self.env.now
            if op.op == "wait":
                yield done[op.bound_record]
            elif op.op == "compute":
                jitter = max(0.0, 1.0 + self.p.jitter_frac * self.rng.standard_normal())
                yield self.env.timeout(op.duration_us * jitter)
            elif op.op in ("read", "write"):
                yield self._gate(op)
                t0 = self.env.now
                yield self.env.timeout(self.p.kernel_launch_us)
                self._advance(self.env.now)
                self.access_us[op.id] = self.env.now
                self.access_seq[op.id] = len(self.access_seq)
                if op.op == "read":
                    self._capture(op)
                else:
                    offs, lens = op.extents
                    self.mem.write_units(op.buffer, op.layer, op.units, offs, lens, op.owner, op.version)
                yield self.env.timeout(int(op.extents[1].sum()) / (self.p.hbm_gbps * 1e3))
            elif op.op == "copy":
                yield from self._copy(op)
                t0 = self.timings.pop(op.id)[0]
            self.timings[op.id] = (t0, self.env.now)
            done[op.index].succeed()

    def _copy(self, op):
        yield self._gate(op)
        link, timing = self._link(op)
        req = None
        if link is not None:
            req = link.request()
            yield req
        t0 = self.env.now
        self.timings[op.id] = (t0, t0)
        start, end = item_times(op.plan, timing)
        cp = _Copy(op, self.clipped[op.id], np.asarray(start, float), np.asarray(end, float), t0)
        self.active.append(cp)
        self.item_end_us[op.id] = cp.end_abs
        total = float(end.max()) if end.size else 0.0
        yield self.env.timeout(total)
        self._advance(self.env.now)
        self.active.remove(cp)
        if link is not None:
            link.release(req)

    def _capture(self, op):
        t = self.env.now
        offs, lens = op.extents
        views = [self.mem.view(op.buffer, int(o), int(n)) for o, n in zip(offs, lens)]
        in_flight = []
        for cp in self.active:
            if cp.op.dst != op.buffer:
                continue
            n_done = cp.applied
            n_items = cp.end_abs.size
            started = int(np.searchsorted(cp.t0 + cp.rel_start, t, side="right"))
            info = {"copy": cp.op.id, "items": n_items, "items_done": n_done,
                    "items_in_flight": max(0, started - n_done)}
            in_flight.append(info)
            if not self.torn or started <= n_done:
                continue
            sl = cp.extent_slice(n_done, started)
            done_b = bytes_done(cp.op.plan, cp.rel_start, cp.rel_end, t - cp.t0)[sl]
            self._overlay_partial(cp, sl, np.asarray(done_b, np.int64), views, offs, lens)
        self.reads.append(ReadCapture(op.id, op.index, op.stream, op.buffer, t, offs, lens, views,
                                      in_flight))

    def _overlay_partial(self, cp: _Copy, sl: slice, done_b, views, offs, lens):
        c = cp.c
        n_copy = np.minimum(c.copy_len[sl], done_b)
        f0, f1 = c.fill_start[sl], np.minimum(c.fill_end[sl], done_b)
        s, d = c.src[sl], c.dst[sl]
        for view, o, n in zip(views, offs, lens):
            lo, hi = int(o), int(o + n)
            # copied part, intersected with this read extent
            a = np.maximum(d, lo)
            b = np.minimum(d + n_copy, hi)
            m = b > a
            if m.any():
                self.mem.overlay(view, cp.op.src, s[m] + (a[m] - d[m]), a[m], (b - a)[m])
            a = np.maximum(d + f0, lo)
            b = np.minimum(d + f1, hi)
            m = b > a
            if m.any():
                self.mem.overlay_fill(view, oob_origin(cp.op.src), a[m], (b - a)[m],
                                      s[m] + (a[m] - d[m]) - c.src_nbytes)


def run_schedule(schedule: Schedule, profile: Profile, **kw) -> RunResult:
    return Executor(schedule, profile, **kw).run()


def run_reference(schedule: Schedule, *, materialise: bool = True) -> RunResult:
    """Every op runs to completion, alone, in issue order: the happens-before
    order execution that the corruption verdict compares against (issue order
    is a topological order of happens-before: every edge points forward)."""
    mem = Memory(schedule.buffers, materialise=materialise)
    reads = []
    for op in schedule.ops:
        if op.op == "copy":
            src, dst = schedule.buffers[op.src], schedule.buffers[op.dst]
            mem.apply_copy(op.src, op.dst, clip_extents(op.plan.extents, src.nbytes, dst.nbytes))
        elif op.op == "write":
            offs, lens = op.extents
            mem.write_units(op.buffer, op.layer, op.units, offs, lens, op.owner, op.version)
        elif op.op == "read":
            offs, lens = op.extents
            views = [mem.view(op.buffer, int(o), int(n)) for o, n in zip(offs, lens)]
            reads.append(ReadCapture(op.id, op.index, op.stream, op.buffer, float(op.index), offs, lens,
                                     views))
    return RunResult(schedule, None, mem, reads, {}, [], [], 0.0)
