"""Schedule: the versioned, JSON-serialisable program both halves of kvrace run.

A schedule says *what* runs on which stream, never when.  Its ops form one list
in **issue order** (the order in which the hosts issued them); each op names its
stream (stream ops) or acts on its host (host ops), and carries its host
(default ``host``), so a stream's FIFO order is the subsequence of its ops and a
host's program order the subsequence of its ops.

* ``host_sync`` blocks its host until its target completes (an event's bound
  record, every op issued so far on a stream, or every op issued so far:
  device synchronize); ``host_delay`` advances its host's time.
* ``host_query`` (format 2) is ``cudaEventQuery``: it does not block and
  records its ``outcome``; a positive query is a happens-before edge from the
  event's bound record (the host saw it complete), and a GPU replay turns it
  into a ``host_sync``.
* ``barrier`` (format 2) blocks each host named in ``hosts`` until all of them
  have reached the barrier instance ``barrier`` (TP ranks in lockstep, a PD
  hand-off): every op of the participants issued before it happens before every
  op they issue after it.  In the list, a participant's ops after a barrier
  come after every participant's barrier op (the list is an issue order).

A ``wait``, ``host_sync`` or ``host_query`` binds to the latest ``record`` of
its event issued before it (CUDA semantics).  With no record issued yet, CUDA
makes a wait and an event synchronize no-ops and reports a query complete;
kvrace does the same and lists the op in ``Schedule.unbound``: a consumer's wait
issued before the producer's record orders nothing, a real bug class.

JSON shape (``kvrace_schedule`` is the format version; 1 still loads: one host)::

    {"kvrace_schedule": 2, "name": "...", "description": "...",
     "hosts": ["host", ...],
     "buffers": [{"name", "location": "device"|"host", "device": 0, "kind",
                  "layout": {...}, "init": [{"layers", "indices", "owner",
                  "version", "first_unit"}]}],
     "streams": [{"name", "device": 0}],
     "events": ["e0", ...],
     "ops": [{"op": "copy", "stream", "routine", "src", "dst", "args": {...}},
             {"op": "read"|"write", "stream", "buffer", "layer", "units"|"tokens"|"ranges", ...},
             {"op": "write", "stream", "buffer", "layers": [0, 1, ...], "units", ...},
             {"op": "compute", "stream", "duration_us", "jitter": true|false},
             {"op": "record"|"wait", "stream", "event"},
             {"op": "host_sync", "event"|"stream"|nothing (= device synchronize)},
             {"op": "host_delay", "duration_us"},
             {"op": "host_query", "event", "outcome": true|false},
             {"op": "barrier", "barrier": "tp_step_3", "hosts": ["rank0", "rank1"]}]}

A host program may give a read's ``ranges`` as an ``(n, 2)`` integer numpy array (the engine's
forward does): it is checked by the same rules and recorded as the list it stands for.
Every op may carry an ``id`` (default ``op<index>``) and a ``host``.  A ``compute`` op's
``jitter`` (default true) lets the executor multiply its duration by the profile's seeded
jitter; false takes the duration as given (the engine's forward issues its compute ops
already jittered by the cost model, so a one-step forward lasts exactly its layers' sum).
:class:`ScheduleBuilder` validates a header and then one op at a time, in
issue order (the online executor's ``Host.issue`` uses it); ``validate`` runs
it over a whole document.  Every problem is an
:class:`~sim.errors.InputError` naming the op and the field.
"""
from __future__ import annotations

import contextlib
import functools
import gc

import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from sim.arrays import plain_ints
from sim.bytes.pattern import MAX_UNIT_BYTES
from sim.errors import MAX_NAME_CHARS, InputError, check_keys, show
from sim.pools.layouts import PagedLayout, layout_from_json
from sim.transfers.routines import ROUTINES, _layout_token, count_out_of_bounds, plan as plan_copy

SCHEMA_VERSION = 2             # the format written; 1 still loads (one host, no host_query/barrier)
SCHEMA_VERSIONS = (1, 2)
DEFAULT_HOST = "host"
# ---- limits: every one is checked before anything it bounds is built, and named in its error
MAX_FILE_BYTES = 64 << 20      # a schedule file: 64 MiB of JSON
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1   # every integer field is an int64
# One buffer: 1 PiB (beyond any pool, far inside int64 offsets).  A buffer costs what its
# copies, reads and distinct runs of provenance cost, not its size: the compact model holds
# it as segments, and Memory.digest hashes large buffers by provenance, not by bytes.
MAX_BUFFER_BYTES = 1 << 50
MAX_TOTAL_BUFFER_BYTES = 1 << 56   # all buffers together (the address arena stays in int64)
MAX_LAYERS = 4096              # models have at most a few hundred; every layer gets its own origin
MAX_INDICES = 1 << 21          # one index list: 2 Mi entries (a 1M-token context is 2**20)
MAX_TOTAL_INDICES = 1 << 24    # all index lists of a schedule, each counted once per layer it touches
MAX_BUFFERS = 1024
MAX_STREAMS = 1024
MAX_EVENTS = 1 << 16
MAX_OPS = 1 << 16              # 65,536 ops in one document (a run of any accepted file stays near 20 s)
MAX_INIT_FILLS = 1 << 12       # (init entry or segment, layer) pairs of all buffers: each is a fill of
                               # every model, and a run builds its Memory three times (about 2 ms a fill)
MAX_READ_EXTENTS = 1 << 16     # extents (unit rows, token fields, ranges) of all reads together
MAX_READ_BYTES = 128 << 20     # bytes of all reads together (each read's bytes are kept, twice)
MAX_OUT_OF_BOUNDS = 1 << 14    # copy extent sides outside their buffer (the report lists each one)
MAX_DURATION_US = 1e9          # one compute or host_delay: 1,000 s
MAX_DEVICE = 1023              # device ordinals
OP_KINDS = ("copy", "read", "write", "compute", "record", "wait", "host_sync", "host_delay", "host_query",
            "barrier")
STREAM_OPS = ("copy", "read", "write", "compute", "record", "wait")
_STREAM_OP_SET = frozenset(STREAM_OPS)
HOST_OPS = ("host_sync", "host_delay", "host_query", "barrier")
V2_OPS = ("host_query", "barrier")
MAX_HOSTS = 1024
#: copy plans whose bound checks a builder remembers (cleared when full: memory stays flat)
PLAN_CHECKS_SIZE = 4096
#: unit selections (layout value, layer, units of at most SELECTION_MEMO_UNITS) expanded once
#: (see _selection; cleared when full)
SELECTION_MEMO_SIZE = 4096
SELECTION_MEMO_UNITS = 64
_SELECTIONS: dict = {}


@dataclass(frozen=True)
class Fill:
    """Initial contents: ``indices`` of the buffer (at ``layers``) hold units
    ``first_unit + k`` of origin (buffer kind, layer, owner, version); or, for a
    general fill, ``segments``: bytes ``[offset, offset + nbytes)`` hold pattern
    bytes ``[stream_offset, stream_offset + nbytes)`` of any origin."""

    layers: tuple[int, ...]
    indices: np.ndarray
    owner: int
    version: int
    first_unit: int
    # a general fill (``{"segments": [...]}``, see _parse_segments): ``(offset, nbytes, Origin,
    # stream_offset)`` per segment, disjoint and in address order; layers/indices are then empty
    segments: tuple = ()


@dataclass(frozen=True)
class BufferSpec:
    name: str
    location: str
    device: int
    kind: str
    layout: Any
    init: tuple[Fill, ...] = ()

    @functools.cached_property
    def nbytes(self) -> int:
        # NOTE: cached (the layout is immutable); read once per op by the executor and verdicts
        return int(self.layout.nbytes)


_NO_ARGS = MappingProxyType({})


@dataclass
class Op:
    """One op of a schedule: what every kind has.  Each kind is its own record type
    (``OP_TYPES``: ``CopyOp``, ``ReadOp``, ``WriteOp``, ``ComputeOp``, ``RecordOp``,
    ``WaitOp``, ``HostSyncOp``, ``HostDelayOp``, ``HostQueryOp``, ``BarrierOp``), holding
    only its own fields.  Reading another kind's attribute gives the defaults below
    (class attributes, never stored on the op), as the one catch-all record did, so
    code that reads ``op.plan`` or ``op.sync_targets`` of any op keeps working."""

    index: int
    id: str
    op: str
    stream: str | None = None
    host: str = DEFAULT_HOST            # the host that issued it
    raw: dict = field(default_factory=dict)

    # other kinds' attributes, as an op of this kind reads them
    routine = src = dst = plan = None
    args = _NO_ARGS
    buffer = extents = layer = units = None
    layers = ()
    owner, version = -1, 0
    duration_us = 0.0
    event = bound_record = sync_stream = None
    sync_targets = hosts = ()
    outcome = barrier = None


@dataclass
class CopyOp(Op):
    routine: str | None = None
    src: str | None = None
    dst: str | None = None
    args: dict = field(default_factory=dict)
    plan: Any = None                    # sim.transfers.routines.CopyPlan


@dataclass
class ReadOp(Op):
    buffer: str | None = None
    extents: tuple[np.ndarray, np.ndarray] | None = None   # (offsets, lengths)
    layer: int | None = None
    units: np.ndarray | None = None


@dataclass
class WriteOp(ReadOp):
    """A kernel storing pattern bytes into ``units`` of every layer of ``layers`` (in that
    order): the bytes of unit ``u`` of layer ``l`` are unit ``u`` of origin (buffer kind, ``l``,
    ``owner``, ``version``).  ``extents`` are the units' extents layer by layer (``len(units)``
    per layer); ``layer`` is the one layer of a one-layer write, None for several."""
    owner: int = -1
    version: int = 0
    layers: tuple[int, ...] = ()


@dataclass
class ComputeOp(Op):
    """``duration_us`` of stream time; ``jitter`` (compute ops only, default true): the
    executor multiplies it by its seeded jitter draw; false: the duration is taken as given
    (the op's issuer already jittered it, e.g. the engine's cost model with keyed jitter)."""
    duration_us: float = 0.0
    jitter: bool = True


@dataclass
class HostDelayOp(ComputeOp):
    pass


@dataclass
class RecordOp(Op):
    event: str | None = None


@dataclass
class WaitOp(RecordOp):
    bound_record: int | None = None     # index of the record op it binds to (None: unbound)


@dataclass
class HostSyncOp(WaitOp):
    sync_stream: str | None = None      # host_sync(stream)
    sync_targets: tuple[int, ...] = ()  # indices of the ops it waits for


@dataclass
class HostQueryOp(WaitOp):
    outcome: bool | None = None         # did it see its record complete?
    sync_targets: tuple[int, ...] = ()  # a positive query: its record


@dataclass
class BarrierOp(Op):
    barrier: str | None = None          # the instance name
    hosts: tuple[str, ...] = ()         # its participants


#: the record type of each op kind
OP_TYPES = {"copy": CopyOp, "read": ReadOp, "write": WriteOp, "compute": ComputeOp, "record": RecordOp,
            "wait": WaitOp, "host_sync": HostSyncOp, "host_delay": HostDelayOp, "host_query": HostQueryOp,
            "barrier": BarrierOp}


@dataclass
class Schedule:
    name: str
    description: str
    buffers: dict[str, BufferSpec]
    streams: dict[str, int]
    events: tuple[str, ...]
    ops: list[Op]
    raw: dict
    hosts: tuple[str, ...] = (DEFAULT_HOST,)
    unbound: list[dict] = field(default_factory=list)   # waits/syncs/queries with no record issued

    def digest(self) -> str:
        """sha256 of the canonical (format 2) document: a version 1 file and its
        format 2 form are one program and have one digest."""
        # NOTE: the canonical document is hashed as it is encoded, a batch of ops at a time
        # (_DigestStream: the same text), not built whole: the whole document (one dict per op)
        # and its text were the peak of a large run's memory.  Without full collections, which
        # would walk a finished run's every live object (~10 % of a static run's CPU).
        with fewer_full_collections():
            d = _DigestStream(self.raw, self.hosts)
            for op in self.ops:
                d.add(op)
            return d.hexdigest()

    def op(self, op_id: str) -> Op:
        for o in self.ops:
            if o.id == op_id:
                return o
        raise KeyError(op_id)

    def to_json(self) -> dict:
        """The canonical format 2 document: every op with its id and host."""
        doc = {k: v for k, v in self.raw.items() if k != "ops"}
        doc["kvrace_schedule"] = SCHEMA_VERSION
        doc["hosts"] = list(self.hosts)
        doc["ops"] = [{**op.raw, "id": op.id, "host": op.host} for op in self.ops]
        return doc


# ---------------------------------------------------------------- validation helpers

def _get(d: dict, key: str, where: str, types, *, default=..., what: str | None = None):
    if key not in d:
        if default is ...:
            raise InputError(f"{where}.{key}", f"missing; expected {what or _tname(types)}")
        return default
    v = d[key]
    if types is int and isinstance(v, bool):
        raise InputError(f"{where}.{key}", f"expected an integer, got {show(v)}")
    if types is int and isinstance(v, int) and not INT_MIN <= v <= INT_MAX:
        raise InputError(f"{where}.{key}", f"expected an int64 integer (-2**63 .. 2**63-1), got {show(v)}")
    if types in (float, (int, float)):
        types = (int, float)
        if isinstance(v, bool):
            raise InputError(f"{where}.{key}", f"expected a number, got {show(v)}")
    if not isinstance(v, types):
        raise InputError(f"{where}.{key}", f"expected {what or _tname(types)}, got {show(v)}")
    return v


def _tname(types) -> str:
    names = {int: "an integer", str: "a string", dict: "an object", list: "a list",
             float: "a number", bool: "true or false"}
    if isinstance(types, tuple):
        return " or ".join(names.get(t, t.__name__) for t in types)
    return names.get(types, types.__name__)


def _list_count(v, where: str) -> int:
    """How many indices an index list (a list, or {"start", "count"[, "step"]}) holds,
    without expanding it; 0 for anything else (the expansion then refuses it).
    More than MAX_INDICES is an InputError at ``where``."""
    n = 0
    if isinstance(v, dict):
        c = v.get("count")
        n = c if isinstance(c, int) and not isinstance(c, bool) and c > 0 else 0
        where = f"{where}.count"
    elif isinstance(v, list):
        n = len(v)
    if not (n <= MAX_INDICES):
        raise InputError(where, f"expected at most {MAX_INDICES} (MAX_INDICES) indices, got {show(n)}")
    return n


class _Totals:
    """Running totals of the schedule-wide limits (checked before each expansion)."""

    def __init__(self, documents: bool = True):
        self.documents = documents   # enforce the whole-document limits (MAX_TOTAL_INDICES, reads)
        self.indices = 0
        self.buffer_bytes = 0
        self.out_of_bounds = 0
        self.fills = 0
        self.read_extents = 0
        self.read_bytes = 0

    def add_indices(self, n: int, where: str) -> None:
        self.indices += n
        if not (not self.documents or self.indices <= MAX_TOTAL_INDICES):
            raise InputError(where,
                             f"the schedule's index lists would hold {self.indices} indices (each counted once per "
                             f"layer it touches); expected at most MAX_TOTAL_INDICES = {MAX_TOTAL_INDICES}")

    def add_fills(self, n: int, where: str) -> None:
        self.fills += n
        if not (self.fills <= MAX_INIT_FILLS):
            raise InputError(where,
                             f"the buffers' init entries would fill {self.fills} (entry, layer) pairs; expected at most "
                             f"MAX_INIT_FILLS = {MAX_INIT_FILLS}")

    def add_out_of_bounds(self, n: int, where: str) -> None:
        self.out_of_bounds += n
        if not (self.out_of_bounds <= MAX_OUT_OF_BOUNDS):
            raise InputError(where,
                             f"the schedule's copies would have {self.out_of_bounds} extent sides outside their buffers "
                             f"(each is reported); expected at most MAX_OUT_OF_BOUNDS = {MAX_OUT_OF_BOUNDS}")

    def add_read(self, extents: int, nbytes: int, where: str) -> None:
        self.read_extents += extents
        self.read_bytes += nbytes
        if not self.documents:      # host programs (and max_ops=None): reads are held compact
            return
        if not (self.read_extents <= MAX_READ_EXTENTS):
            raise InputError(where, f"the schedule's reads would touch {self.read_extents} extents; expected at most "
                             f"MAX_READ_EXTENTS = {MAX_READ_EXTENTS}")
        if not (self.read_bytes <= MAX_READ_BYTES):
            raise InputError(where, f"the schedule's reads would capture {self.read_bytes} bytes; expected at most "
                             f"MAX_READ_BYTES = {MAX_READ_BYTES} (128 MiB)")


def _int_list(v, where: str, lo: int = INT_MIN, hi: int = INT_MAX) -> np.ndarray:
    """A list of int64s, or {"start", "count"[, "step"]} (``start + step*k`` for
    ``k < count``), each in ``[lo, hi]``; at most MAX_INDICES entries.  The count and
    the range of an arithmetic list are checked before it is expanded."""
    if isinstance(v, dict):
        check_keys(v, {"start", "count", "step"}, where)
        start = _get(v, "start", where, int)
        count = _get(v, "count", where, int)
        step = _get(v, "step", where, int, default=1)
        if not (0 <= count <= MAX_INDICES):
            raise InputError(f"{where}.count", f"expected 0..{MAX_INDICES} (MAX_INDICES), got {count}")
        if count:
            last = start + step * (count - 1)
            bad = start if not lo <= start <= hi else (last if not lo <= last <= hi else None)
            if not (bad is None):
                raise InputError(where, f"expected indices in {lo}..{hi}, but start {start}, step {step}, "
                                 f"count {count} reaches {bad}")
        return start + step * np.arange(count, dtype=np.int64)
    if not isinstance(v, list):
        raise InputError(where, f"expected a list of integers or {{start, count}}, got {show(v)}")
    if not (len(v) <= MAX_INDICES):
        raise InputError(where, f"expected at most {MAX_INDICES} (MAX_INDICES) indices, got {len(v)}")
    if not v:
        return np.zeros(0, dtype=np.int64)
    if not plain_ints(v) or min(v) < lo or max(v) > hi:
        for k, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int):
                raise InputError(f"{where}[{k}]", f"expected an integer, got {show(x)}")
            if not lo <= x <= hi:
                raise InputError(f"{where}[{k}]", f"expected an index in {lo}..{hi}, got {show(x)}")
    return np.asarray(v, dtype=np.int64)


def _normalise_args(args: dict, where: str) -> dict:
    """Index lists may be written as {"start", "count"[, "step"]}: expand them."""
    for v in args.values():
        if isinstance(v, dict):
            break
    else:
        return dict(args)           # nothing to expand (the common case): a shallow copy
    return {k: (_int_list(v, f"{where}.{k}").tolist() if isinstance(v, dict) else v)
            for k, v in args.items()}


def _name(d: dict, key: str, where: str, known, what: str) -> str:
    v = d.get(key)
    if type(v) is str and v in known:       # the common case, without building a message
        return v
    v = _get(d, key, where, str)
    if v not in known:
        raise InputError(f"{where}.{key}", f"unknown {what} {show(v)}; expected one of {show(sorted(known))}")
    return v


# ---------------------------------------------------------------- parsing

def _label(d: dict, key: str, where: str, *, default=...) -> str:
    """A name (buffer, kind, stream, event, op id): a non-empty string of at most
    MAX_NAME_CHARS characters, so that every message echoing it stays short."""
    v = _get(d, key, where, str, default=default)
    if not (0 < len(v) <= MAX_NAME_CHARS):
        raise InputError(f"{where}.{key}",
                         f"expected a name of 1..{MAX_NAME_CHARS} (MAX_NAME_CHARS) characters, got {show(v)}")
    return v


def _parse_buffer(d: Any, where: str, totals: _Totals) -> BufferSpec:
    if not isinstance(d, dict):
        raise InputError(where, f"expected an object, got {show(d)}")
    check_keys(d, {"name", "location", "device", "kind", "layout", "init", "description"}, where)
    name = _label(d, "name", where)
    location = _get(d, "location", where, str)
    if not (location in ("device", "host")):
        raise InputError(f"{where}.location", f"expected 'device' or 'host', got {show(location)}")
    device = _get(d, "device", where, int, default=0)
    if not (0 <= device <= MAX_DEVICE):
        raise InputError(f"{where}.device", f"expected 0..{MAX_DEVICE} (MAX_DEVICE), got {device}")
    kind = _label(d, "kind", where, default=name)
    layout = layout_from_json(_get(d, "layout", where, dict), f"{where}.layout")
    if not (layout.layers <= MAX_LAYERS):
        raise InputError(f"{where}.layout.layers",
                         f"expected at most {MAX_LAYERS} (MAX_LAYERS) layers, got {layout.layers}")
    if not (int(layout.nbytes) <= MAX_BUFFER_BYTES):
        raise InputError(f"{where}.layout",
                         f"a buffer of {int(layout.nbytes)} bytes; expected at most {MAX_BUFFER_BYTES} (MAX_BUFFER_BYTES, 1 PiB)")
    totals.buffer_bytes += int(layout.nbytes)
    if not (totals.buffer_bytes <= MAX_TOTAL_BUFFER_BYTES):
        raise InputError(f"{where}.layout",
                         f"a buffer of {int(layout.nbytes)} bytes brings the schedule's buffers to {totals.buffer_bytes} "
                         f"bytes; expected at most {MAX_TOTAL_BUFFER_BYTES} (MAX_TOTAL_BUFFER_BYTES, all buffers together)")
    if not (layout.unit_bytes <= MAX_UNIT_BYTES):
        raise InputError(f"{where}.layout",
                         f"a unit (page or row) of {layout.unit_bytes} bytes; expected at most {MAX_UNIT_BYTES} "
                         "(the pattern bytes' unit limit)")
    is_host = type(layout).__name__ == "HostLayout"
    if not (is_host == (location == "host")):
        raise InputError(f"{where}.layout",
                         f"a {location} buffer needs a {'host' if location == 'host' else 'device (paged/preset)'} layout")
    fills = []
    for j, f in enumerate(_get(d, "init", where, list, default=[])):
        fw = f"{where}.init[{j}]"
        if not isinstance(f, dict):
            raise InputError(fw, f"expected an object, got {show(f)}")
        if "segments" in f:
            fills.append(_parse_segments(f, fw, int(layout.nbytes), totals))
            continue
        check_keys(f, {"layers", "indices", "owner", "version", "first_unit"}, fw)
        layers_v = f.get("layers", "all")
        if layers_v == "all":
            layers = tuple(range(layout.layers))
        else:
            layers = tuple(int(x) for x in _int_list(layers_v, f"{fw}.layers", 0, layout.layers - 1))
        totals.add_fills(len(layers), f"{fw}.layers")
        idx_v = _get(f, "indices", fw, (list, dict))
        totals.add_indices(_list_count(idx_v, f"{fw}.indices") * max(len(layers), 1), f"{fw}.indices")
        idx = _int_list(idx_v, f"{fw}.indices", 0, layout.units - 1)
        first_unit = _get(f, "first_unit", fw, int, default=0)
        # unit first_unit + k of the origin starts at pattern byte (first_unit + k) * unit_bytes
        top = INT_MAX // layout.unit_bytes - max(idx.size, 1)
        if not (0 <= first_unit <= top):
            raise InputError(f"{fw}.first_unit",
                             f"expected 0..{top} (its units' pattern offsets must be int64), got {first_unit}")
        fills.append(Fill(layers, idx, _get(f, "owner", fw, int, default=-1),
                          _get(f, "version", fw, int, default=1), first_unit))
    return BufferSpec(name, location, device, kind, layout, tuple(fills))


SEGMENT_FIELDS = ("offset", "nbytes", "kind", "layer", "owner", "version", "unit_bytes", "stream_offset")


def _parse_segments(f: dict, fw: str, nbytes: int, totals: _Totals) -> Fill:
    """A general init fill (written by ``sim.window.cut_window``)::

        {"segments": [[offset, nbytes, kind, layer, owner, version, unit_bytes, stream_offset], ...]}

    Bytes ``[offset, offset + nbytes)`` of the buffer hold pattern bytes
    ``[stream_offset, stream_offset + nbytes)`` of origin (kind, layer, owner,
    version, unit_bytes): any provenance a run can leave (another kind's bytes, an
    ``oob:<buffer>`` origin, part of a unit).  Segments are disjoint and in address
    order (offset >= the previous segment's end); bytes no segment covers keep their
    initial contents.  Each segment counts as one fill against MAX_INIT_FILLS."""
    from sim.bytes.pattern import Origin

    check_keys(f, {"segments"}, fw)
    segs = _get(f, "segments", fw, list)
    totals.add_fills(len(segs), f"{fw}.segments")
    out = []
    end = 0
    for k, x in enumerate(segs):
        sw = f"{fw}.segments[{k}]"
        if not (isinstance(x, list) and len(x) == len(SEGMENT_FIELDS)):
            raise InputError(sw, f"expected a list [{', '.join(SEGMENT_FIELDS)}], got {show(x)}")
        for j, (fname, v) in enumerate(zip(SEGMENT_FIELDS, x)):
            if fname == "kind":
                ok = isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS
                what = f"a name of 1..{MAX_NAME_CHARS} (MAX_NAME_CHARS) characters"
            else:
                ok = type(v) is int and INT_MIN <= v <= INT_MAX
                what = "an int64 integer"
            if not ok:
                raise InputError(f"{sw}[{j}] ({fname})", f"expected {what}, got {show(v)}")
        off, n, kind, layer, owner, version, ub, soff = x
        if not (off >= end):
            raise InputError(f"{sw}[0] (offset)",
                             f"expected segments disjoint and in address order (offset >= {end}), got {off}")
        if not (0 < n and off + n <= nbytes):
            raise InputError(f"{sw}[1] (nbytes)",
                             f"expected nbytes > 0 and offset + nbytes <= {nbytes} (the buffer's size), got {n} at {off}")
        if not (0 < ub <= MAX_UNIT_BYTES):
            raise InputError(f"{sw}[6] (unit_bytes)", f"expected 1..{MAX_UNIT_BYTES}, got {ub}")
        if not (0 <= soff <= INT_MAX - n):
            raise InputError(f"{sw}[7] (stream_offset)",
                             f"expected 0..{INT_MAX - n} (its pattern offsets must be int64), got {soff}")
        end = off + n
        out.append((off, n, Origin(kind, layer, owner, version, ub), soff))
    return Fill((), np.zeros(0, dtype=np.int64), -1, 0, 0, tuple(out))


#: ``ranges`` lists of at least this many pairs are checked by :func:`_plain_ranges` first
PLAIN_RANGES_MIN = 16


def _plain_ranges(r: list):
    """A ``ranges`` list as an ``(n, 2)`` int64 array when every pair is a list of two plain
    ints within int64 (what :func:`_array_ranges` then checks as the list's loop would); None
    for anything else, and for short lists (the loop then accepts it or names the first bad
    pair).

    NOTE: the types are tested by C loops (``set(map(...))``, :func:`plain_ints`): an engine's
    read of a whole context has hundreds to thousands of pairs, where the loop cost about 1 us
    a pair."""
    if len(r) < PLAIN_RANGES_MIN or set(map(type, r)) != {list} or set(map(len, r)) != {2} \
            or not plain_ints(itertools.chain.from_iterable(r)):
        return None
    try:
        return np.array(r, np.int64)
    except OverflowError:
        return None


def _range_error(where: str, nbytes: int, pair) -> InputError:
    return InputError(where, f"expected offset >= 0, nbytes > 0 and offset + nbytes <= {nbytes} "
                             f"(the buffer's size), got {show(pair)}")


def _array_ranges(r: np.ndarray, nbytes: int, where: str):
    """``(starts, lengths, total bytes)`` of a ``ranges`` given as an ``(n, 2)`` integer
    array (a host program's read, or a plain list made one), by the rules the list form is
    checked by, the first bad pair named as the list's loop names it (an unsigned value past
    int64 wraps negative, so it is named too)."""
    if not (r.ndim == 2 and r.shape[1] == 2 and r.dtype.kind in "iu"):
        raise InputError(where, f"expected an (n, 2) integer array of [offset, nbytes] pairs, got an array of "
                                f"dtype {r.dtype} and shape {r.shape}")
    if not (0 < len(r) <= MAX_INDICES):
        raise InputError(where, f"expected 1..{MAX_INDICES} (MAX_INDICES) [offset, nbytes] pairs, got {len(r)}")
    o, n = r[:, 0].astype(np.int64), r[:, 1].astype(np.int64)
    bad = (o < 0) | (n <= 0) | (n > nbytes - o)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise _range_error(f"{where}[{k}]", nbytes, r[k].tolist())
    # the int64 sum is exact while it cannot pass 2**63 (each length <= nbytes)
    total = int(n.sum()) if nbytes * len(r) < (1 << 63) else sum(n.tolist())
    return o, n, total


def _recordable(d: dict) -> dict:
    """``d`` as its document records it: a ``ranges`` array as the list it stands for."""
    r = d.get("ranges")
    return {**d, "ranges": r.tolist()} if isinstance(r, np.ndarray) else d


def _selection(d: dict, where: str, buf: BufferSpec, totals: _Totals, *, allow_ranges: bool):
    if "units" in d and "tokens" not in d and "ranges" not in d:
        key = "units"               # the common case, decided without building the key list
    else:
        keys = [k for k in ("units", "tokens", "ranges") if k in d]
        allowed = "'units' or 'tokens'" + (" or 'ranges'" if allow_ranges else "")
        if not (len(keys) == 1):
            raise InputError(where, f"expected exactly one of {allowed}, got {keys or 'none'}")
        key = keys[0]
        if not (allow_ranges or key != "ranges"):
            raise InputError(f"{where}.ranges", f"not allowed here; use {allowed}")
    lay = buf.layout
    is_read = allow_ranges
    if key == "ranges":
        r = d["ranges"]
        if not isinstance(r, np.ndarray):
            r = _get(d, "ranges", where, list)
            if not (0 < len(r) <= MAX_INDICES):
                raise InputError(f"{where}.ranges",
                                 f"expected 1..{MAX_INDICES} (MAX_INDICES) [offset, nbytes] pairs, got {len(r)}")
            arr = _plain_ranges(r)
            if arr is None:
                for k, x in enumerate(r):
                    # NOTE: exact types first (a pair of plain ints), the general test (int
                    # subclasses but bool) only for the rest: the same pairs pass
                    if not (type(x) is list and len(x) == 2 and type(x[0]) is int and type(x[1]) is int):
                        ok = (isinstance(x, list) and len(x) == 2
                              and all(isinstance(y, int) and not isinstance(y, bool) for y in x))
                        if not ok:
                            raise InputError(f"{where}.ranges[{k}]",
                                             f"expected an [offset, nbytes] pair of integers, got {show(x)}")
                    o, n = x
                    if not (0 <= o and 0 < n and o + n <= buf.nbytes):
                        raise _range_error(f"{where}.ranges[{k}]", buf.nbytes, x)
                arr = np.asarray(r, dtype=np.int64).reshape(-1, 2)
            r = arr
        got = _array_ranges(r, buf.nbytes, f"{where}.ranges")
        totals.add_read(len(r), got[2], f"{where}.ranges")
        return None, None, got[:2]
    layer = _get(d, "layer", where, int)
    if not (0 <= layer < lay.layers):
        raise InputError(f"{where}.layer", f"expected 0..{lay.layers - 1}, got {layer}")
    count = _list_count(d[key], f"{where}.{key}")
    totals.add_indices(count, f"{where}.{key}")
    if key == "units":
        if is_read:
            totals.add_read(count, count * lay.unit_bytes, f"{where}.units")
        v = d[key]
        # NOTE: a short list of units of one layer is expanded once per (layout value, layer,
        # units): ops share the read-only arrays (a run's reads and writes repeat their pages,
        # and the TP ranks' buffers have equal layouts, each its own object)
        memo_key = None
        if type(v) is list and len(v) <= SELECTION_MEMO_UNITS:
            t = tuple(v)
            if plain_ints(t):
                tok = _layout_token(lay)
                memo_key = None if tok is None else (tok, layer, t)
        got = _SELECTIONS.get(memo_key) if memo_key is not None else None
        if got is not None:
            return layer, got[1], got[2]
        if memo_key is not None and memo_key[2] and 0 <= min(memo_key[2]) and max(memo_key[2]) < lay.units:
            # every entry is an int (checked for the key) in range: what _int_list returns
            idx = np.asarray(memo_key[2], dtype=np.int64)
        else:
            idx = _int_list(v, f"{where}.units", 0, lay.units - 1)
        if not (idx.size > 0):
            raise InputError(f"{where}.{key}", "expected at least one index")
        offs = lay.unit_offsets(layer, idx)
        ext = (np.asarray(offs, dtype=np.int64),
               _unit_lengths(idx.size, lay.unit_bytes) if memo_key is not None
               else np.full(idx.size, lay.unit_bytes, np.int64))
        if memo_key is not None:
            idx.setflags(write=False)
            ext[0].setflags(write=False)          # ext[1] is shared and read-only already
            if len(_SELECTIONS) >= SELECTION_MEMO_SIZE:
                _SELECTIONS.clear()
            _SELECTIONS[memo_key] = (lay, idx, ext)
        return layer, idx, ext
    if not (isinstance(lay, PagedLayout)):
        raise InputError(f"{where}.tokens", "token selection needs a device (paged) layout")
    ntok = lay.pages * lay.entries_per_page
    if is_read:
        fields = lay.effective_fields
        totals.add_read(count * len(fields), count * sum(f.entry_bytes for f in fields), f"{where}.tokens")
    idx = _int_list(d[key], f"{where}.tokens", 0, ntok - 1)
    if not (idx.size > 0):
        raise InputError(f"{where}.{key}", "expected at least one index")
    offs, lens = lay.token_extents(layer, idx)          # (tokens, fields): token-major
    return layer, idx, (np.asarray(offs, dtype=np.int64).ravel(), np.asarray(lens, dtype=np.int64).ravel())


_LENGTHS: dict = {}


def _unit_lengths(n: int, unit_bytes: int) -> np.ndarray:
    """``np.full(n, unit_bytes, int64)``, read-only and shared per (n, unit_bytes): the
    lengths of a memoised unit selection (``SELECTION_MEMO_UNITS`` bounds ``n``)."""
    got = _LENGTHS.get((n, unit_bytes))
    if got is None:
        if len(_LENGTHS) >= SELECTION_MEMO_SIZE:
            _LENGTHS.clear()
        got = _LENGTHS[(n, unit_bytes)] = np.full(n, unit_bytes, np.int64)
        got.setflags(write=False)
    return got


def _copy_indices(args: dict, src, dst, where: str) -> int:
    """How many (index, layer) pairs a copy's args name, counted before expansion:
    the length of its src_indices times the layers it copies."""
    n = _list_count(args.get("src_indices"), f"{where}.src_indices")
    layers = args.get("layers")
    if isinstance(layers, (list, dict)):
        nl = _list_count(layers, f"{where}.layers")
    else:
        nl = src.layers if "layer" not in args else 1
    return n * max(nl, 1)


class ScheduleBuilder:
    """A schedule under construction: the header is validated at once, then ops
    one at a time in issue order (:meth:`add`), by the same rules whether they
    come from a document (``validate``) or from a running host program
    (``sim.executor.Host.issue``).

    ``max_ops`` bounds a document (MAX_OPS) and, with it, the document totals
    (MAX_TOTAL_INDICES, MAX_READ_EXTENTS, MAX_READ_BYTES); host programs pass ``None``
    and are bounded per op only.  ``keep_ops=False``: the ops are validated, not kept
    (a ``keep="report"`` run), and the schedule's digest is hashed as they are added, unless
    ``digest=False`` (then :meth:`digest` is None).
    """

    def __init__(self, doc: Any, *, max_ops: int | None = MAX_OPS, keep_ops: bool = True, digest: bool = True):
        if not (isinstance(doc, dict)):
            raise InputError("", f"a schedule must be a JSON object, got {type(doc).__name__}")
        version = doc.get("kvrace_schedule")
        if not (version in SCHEMA_VERSIONS):
            raise InputError("kvrace_schedule",
                             f"expected format version {' or '.join(map(str, SCHEMA_VERSIONS))}, got {show(version)}")
        self.version = version
        keys = {"kvrace_schedule", "name", "description", "buffers", "streams", "events", "ops"}
        check_keys(doc, keys | ({"hosts"} if version >= 2 else set()), "")
        self.doc = doc
        self.name = _label(doc, "name", "", default="unnamed")
        self.description = _get(doc, "description", "", str, default="")
        self.max_ops = max_ops
        # NOTE: whole-document totals bound what one file may make a run hold; a host program
        # (max_ops=None) is bounded per op only, its run holding reads compact
        self.totals = _Totals(documents=max_ops is not None)

        self.buffers: dict[str, BufferSpec] = {}
        buffer_list = _get(doc, "buffers", "", list)
        if not (len(buffer_list) <= MAX_BUFFERS):
            raise InputError("buffers", f"expected at most {MAX_BUFFERS} (MAX_BUFFERS) buffers, got {len(buffer_list)}")
        for i, b in enumerate(buffer_list):
            spec = _parse_buffer(b, f"buffers[{i}]", self.totals)
            if not (spec.name not in self.buffers):
                raise InputError(f"buffers[{i}].name", f"duplicate buffer name {show(spec.name)}")
            self.buffers[spec.name] = spec

        self.streams: dict[str, int] = {}
        stream_list = _get(doc, "streams", "", list)
        if not (len(stream_list) <= MAX_STREAMS):
            raise InputError("streams", f"expected at most {MAX_STREAMS} (MAX_STREAMS) streams, got {len(stream_list)}")
        for i, st in enumerate(stream_list):
            w = f"streams[{i}]"
            if isinstance(st, str):
                st = {"name": st}
            if not isinstance(st, dict):
                raise InputError(w, f"expected a name or an object, got {show(st)}")
            check_keys(st, {"name", "device"}, w)
            sname = _label(st, "name", w)
            if not (sname not in self.streams):
                raise InputError(f"{w}.name", f"duplicate stream name {show(sname)}")
            device = _get(st, "device", w, int, default=0)
            if not (0 <= device <= MAX_DEVICE):
                raise InputError(f"{w}.device", f"expected 0..{MAX_DEVICE} (MAX_DEVICE), got {device}")
            self.streams[sname] = device
        self.events = tuple(_name_list(doc, "events", MAX_EVENTS, "MAX_EVENTS", default=[]))
        self._event_set = frozenset(self.events)     # membership per op (a tuple scan costs O(events))
        self.hosts = tuple(_name_list(doc, "hosts", MAX_HOSTS, "MAX_HOSTS", default=[DEFAULT_HOST]))
        if not (len(self.hosts) > 0):
            raise InputError("hosts", "expected at least one host")

        self.ops: list[Op] = []
        self.keep_ops = keep_ops              # False: ops are not kept (a keep="report" run)
        self.count = 0                        # ops added
        self.unbound: list[dict] = []
        self._ids = set() if keep_ops else _IdSet()
        # NOTE: without kept ops the digest is hashed as ops are added (2-3 % of an engine run,
        # the ops' canonical JSON); ``digest=False`` skips it for a run that reports none
        self._digest = None if keep_ops or not digest else _DigestStream(self.doc, self.hosts)
        self._last_record: dict[str, int] = {}
        self._last_on_stream: dict[str, int] = {}
        self._barriers: dict[str, dict] = {}     # instance -> {"hosts": tuple, "arrived": set}
        self._blocked: dict[str, str] = {}       # host -> barrier instance it waits at
        self._resolve = None                     # host_query outcomes of a running host (see add)
        self._kinds = OP_KINDS if self.version >= 2 else tuple(k for k in OP_KINDS if k not in V2_OPS)
        self._kind_set = frozenset(self._kinds)
        self._common = frozenset({"op", "id", "note"} | ({"host"} if self.version >= 2 else set()))
        self._host_set = frozenset(self.hosts)
        self._parsers = {k: getattr(self, f"_parse_{k}") for k in OP_KINDS}
        self._plan_checks: dict[int, tuple] = {}   # id(plan) -> _bound_checks(plan)
        # the keys each kind allows (built once: every op is checked against its kind's set)
        c = self._common
        self._allowed = {
            "copy": c | {"stream", "routine", "src", "dst", "args"},
            "read": c | {"stream", "buffer", "layer", "units", "tokens", "ranges"},
            "write": c | {"stream", "buffer", "layer", "layers", "units", "tokens", "ranges", "owner", "version"},
            "compute": c | {"stream", "duration_us", "jitter"},
            "host_delay": c | {"stream", "duration_us"},
            "record": c | {"stream", "event"},
            "wait": c | {"stream", "event"},
            "host_sync": c | {"event", "stream"},
            "host_query": c | {"event", "outcome"},
            "barrier": c | {"barrier", "hosts"},
        }

    def add(self, d: Any, *, resolve=None) -> Op:
        """Validate one op (issued now, after every op added so far) and append it.

        ``resolve(record_index) -> bool`` gives a ``host_query``'s outcome when the
        op comes from a running host (documents carry their ``outcome``)."""
        i = self.count
        if self.max_ops is not None and not i < self.max_ops:
            raise InputError(f"ops[{i}]", f"expected at most {self.max_ops} (MAX_OPS) ops")
        if not isinstance(d, dict):
            raise InputError(f"ops[{i}]", f"expected an object, got {show(d)}")
        kind = d.get("op")
        if type(kind) is not str or kind not in self._kind_set:
            w = f"ops[{i}]"
            kind = _get(d, "op", w, str)
            raise InputError(f"{w}.op", f"unknown op {show(kind)}; expected one of {list(self._kinds)}"
                             + ("" if self.version >= 2 else " (host_query and barrier need kvrace_schedule 2)"))
        if "id" not in d:
            op_id = f"op{i}"
        else:
            op_id = d["id"]
            if type(op_id) is not str or not 0 < len(op_id) <= MAX_NAME_CHARS:
                op_id = _label(d, "id", f"ops[{i}]")
        if op_id in self._ids:
            raise InputError(f"ops[{i}].id", f"duplicate op id {show(op_id)}")
        w = f"ops[{i}] ({op_id})"
        host = d.get("host", DEFAULT_HOST)
        if type(host) is not str or host not in self._host_set:
            host = _name(d, "host", w, self.hosts, "host") if "host" in d else DEFAULT_HOST
            if host not in self._host_set:
                raise InputError(f"{w}.host", f"op of host {show(host)}, which is not declared; expected one of "
                                 f"{show(list(self.hosts))}")
        if host in self._blocked:
            inst = self._blocked[host]
            missing = sorted(set(self._barriers[inst]["hosts"]) - self._barriers[inst]["arrived"])
            raise InputError(w, f"host {show(host)} issues this op after barrier {show(inst)}, which hosts "
                             f"{show(missing)} reach only later in the list; list ops in issue order")
        op = OP_TYPES[kind](index=i, id=op_id, op=kind, raw=d, host=host)
        if kind in _STREAM_OP_SET:
            st = d.get("stream")
            op.stream = st if (type(st) is str and st in self.streams) else _name(d, "stream", w, self.streams,
                                                                                   "stream")
        self._resolve = resolve
        try:
            self._parsers[kind](op, d, w, self._common)
        finally:
            self._resolve = None
        if op.stream is not None:
            self._last_on_stream[op.stream] = i
        if kind == "read" and (self.keep_ops or self._digest is not None):
            op.raw = _recordable(d)
        self._ids.add(op_id)
        self.count += 1
        if self.keep_ops:
            self.ops.append(op)
        elif self._digest is not None:
            self._digest.add(op)
        return op

    # ---- one parser per op kind
    def _parse_copy(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        op.routine = _name(d, "routine", w, ROUTINES, "routine")
        op.src = _name(d, "src", w, self.buffers, "buffer")
        op.dst = _name(d, "dst", w, self.buffers, "buffer")
        src, dst = self.buffers[op.src], self.buffers[op.dst]
        if not (not (src.location == "host" and dst.location == "host")):
            raise InputError(w, "host-to-host copies are not modelled; expected a device buffer on at least one side")
        args = _get(d, "args", w, dict, default={})
        self.totals.add_indices(_copy_indices(args, src.layout, dst.layout, f"{w}.args"), f"{w}.args.src_indices")
        op.args = _normalise_args(args, f"{w}.args")
        op.plan = plan_copy(op.routine, src.layout, dst.layout, op.args, w)
        # NOTE: what the checks below derive from a plan is remembered per plan object (a run's
        # copies share cached plans); the plan's layouts fix both buffers' sizes
        got = self._plan_checks.get(id(op.plan))
        if got is None or got[0] is not op.plan:
            got = self._bound_checks(op.plan, src.nbytes, dst.nbytes)
            if len(self._plan_checks) >= PLAN_CHECKS_SIZE:
                self._plan_checks.clear()
            self._plan_checks[id(op.plan)] = got
        for side, low in zip(("src", "dst"), got[1]):
            if not (low >= 0):
                raise InputError(f"{w}.args.{side}_indices",
                                 f"the routine addresses byte {low} of {side} {show(getattr(op, side))}, before its start "
                                 "(its 32-bit index arithmetic wraps for these indices); expected indices whose "
                                 "addresses are >= 0")
        if got[2]:
            self.totals.add_out_of_bounds(got[2], w)

    def _bound_checks(self, plan, src_nbytes: int, dst_nbytes: int) -> tuple:
        """``(plan, lowest byte per side, extent sides out of bounds, largest end per side)``.

        A layer-shifted plan's (``CopyPlan.base``, ``shift``) lows and ends are its base's
        moved by the shift, when the memo holds the base's (a shift moves every offset alike)."""
        ext = plan.extents
        base = plan.base
        b = None if base is None else self._plan_checks.get(id(base))
        if b is not None and b[0] is base:
            ds, dd = plan.shift
            lows, ends = (b[1][0] + ds, b[1][1] + dd), (b[3][0] + ds, b[3][1] + dd)
        else:
            lows = (int(ext.src.min()), int(ext.dst.min())) if len(ext.length) else (0, 0)
            ends = ext.ends
        # extents are >= 0 (checked by the caller), so none leaves its buffer when every end
        # fits; count_out_of_bounds (which builds per-side arrays) runs only when one does not
        oob = count_out_of_bounds(ext, src_nbytes, dst_nbytes) if min(lows) >= 0 and len(ext.length) and (
            ends[0] > src_nbytes or ends[1] > dst_nbytes) else 0
        return plan, lows, oob, ends

    def _parse_read(self, op, d, w, common):
        kind = op.op
        _keys(d, self._allowed[kind], w)
        op.buffer = _name(d, "buffer", w, self.buffers, "buffer")
        if kind == "write" and "layers" in d:
            self._parse_layers(op, d, w)
        else:
            op.layer, op.units, op.extents = _selection(d, w, self.buffers[op.buffer], self.totals,
                                                        allow_ranges=(kind == "read"))
        if kind == "write":
            if not ("units" in d):
                raise InputError(f"{w}.units",
                                 "a write names the units it stores (the pattern's unit is the buffer's unit)")
            if not op.layers:
                op.layers = (op.layer,)
            op.owner = _get(d, "owner", w, int, default=-1)
            op.version = _get(d, "version", w, int, default=1)

    def _parse_layers(self, op, d, w) -> None:
        """A write of several layers (``layers``: distinct layer ids, in the order written):
        the units' extents of each layer, layer by layer."""
        if "layer" in d:
            raise InputError(f"{w}.layers", "expected exactly one of 'layer' or 'layers', got both")
        if "units" not in d:
            raise InputError(f"{w}.units", "a write of 'layers' names its units (one unit list for every layer)")
        lay = self.buffers[op.buffer].layout
        layers = _int_list(_get(d, "layers", w, list), f"{w}.layers", 0, lay.layers - 1)
        if not (layers.size > 0):
            raise InputError(f"{w}.layers", "expected at least one layer")
        if not (len(set(layers.tolist())) == layers.size):
            raise InputError(f"{w}.layers", f"expected distinct layers, got {show(layers.tolist())}")
        first = {k: v for k, v in d.items() if k != "layers"}
        first["layer"] = int(layers[0])
        _, op.units, (_, lens) = _selection(first, w, self.buffers[op.buffer], self.totals, allow_ranges=False)
        self.totals.add_indices(op.units.size * (layers.size - 1), f"{w}.layers")
        op.layers = tuple(layers.tolist())
        op.layer = op.layers[0] if layers.size == 1 else None
        op.extents = (lay.unit_offsets_by_layer(layers, op.units).T.reshape(-1), np.tile(lens, layers.size))

    _parse_write = _parse_read

    def _parse_compute(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        op.jitter = _get(d, "jitter", w, bool, default=True) if op.op == "compute" else False
        duration = _get(d, "duration_us", w, (int, float))
        if not (isinstance(duration, float) or abs(duration) <= MAX_DURATION_US):
            raise InputError(f"{w}.duration_us",
                             f"expected 0..{MAX_DURATION_US:g} (MAX_DURATION_US), got {show(duration)}")
        op.duration_us = float(duration)
        if not (math.isfinite(op.duration_us) and 0 <= op.duration_us <= MAX_DURATION_US):
            raise InputError(f"{w}.duration_us",
                             f"expected a finite number in 0..{MAX_DURATION_US:g} (MAX_DURATION_US), got {show(duration)}")

    _parse_host_delay = _parse_compute

    def _bind(self, op, d, w) -> None:
        """Bind an event op to the latest record of its event issued before it; with
        none, note it (CUDA: a no-op wait/synchronize, a query that reports complete)."""
        op.event = _name(d, "event", w, self._event_set, "event")
        op.bound_record = self._last_record.get(op.event)
        if op.bound_record is None:
            self.unbound.append({"op": op.id, "kind": op.op, "event": op.event, "host": op.host,
                                 "stream": op.stream})

    def _parse_record(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        op.event = _name(d, "event", w, self._event_set, "event")
        self._last_record[op.event] = op.index

    def _parse_wait(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        self._bind(op, d, w)

    def _parse_host_sync(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        if not (not ("event" in d and "stream" in d)):
            raise InputError(w, "expected 'event' or 'stream', not both")
        if "event" in d:
            self._bind(op, d, w)
            op.sync_targets = () if op.bound_record is None else (op.bound_record,)
        elif "stream" in d:
            op.sync_stream = _name(d, "stream", w, self.streams, "stream")
            last = self._last_on_stream.get(op.sync_stream)
            op.sync_targets = () if last is None else (last,)
        else:
            op.sync_targets = tuple(self._last_on_stream.values())

    def _parse_host_query(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        self._bind(op, d, w)
        if self._resolve is not None:
            op.outcome = bool(self._resolve(op.bound_record))
            op.raw = {**d, "outcome": op.outcome}
        else:
            op.outcome = _get(d, "outcome", w, bool)
            if not (op.bound_record is not None or op.outcome):
                raise InputError(f"{w}.outcome",
                                 f"a query of event {show(op.event)}, which has no record issued before it, reports "
                                 "complete (cudaEventQuery returns cudaSuccess); expected true")
        op.sync_targets = (op.bound_record,) if op.outcome and op.bound_record is not None else ()

    def _parse_barrier(self, op, d, w, common):
        _keys(d, self._allowed[op.op], w)
        op.barrier = _label(d, "barrier", w)
        hosts = _get(d, "hosts", w, list)
        for k, h in enumerate(hosts):
            if not (isinstance(h, str) and h in self.hosts):
                raise InputError(f"{w}.hosts[{k}]", f"expected a declared host {show(list(self.hosts))}, got {show(h)}")
        op.hosts = tuple(sorted(set(hosts)))
        if not (op.host in op.hosts):
            raise InputError(f"{w}.hosts", f"expected the op's own host {show(op.host)} among them")
        inst = self._barriers.setdefault(op.barrier, {"hosts": op.hosts, "arrived": set()})
        if not (inst["hosts"] == op.hosts):
            raise InputError(f"{w}.hosts",
                             f"barrier {show(op.barrier)} was first reached with hosts {show(list(inst['hosts']))}; "
                             "every participant names the same hosts")
        if not (op.host not in inst["arrived"]):
            raise InputError(f"{w}.barrier",
                             f"host {show(op.host)} reaches barrier {show(op.barrier)} a second time; name each "
                             "barrier instance once (e.g. 'step_3')")
        inst["arrived"].add(op.host)
        if inst["arrived"] == set(op.hosts):
            for h in op.hosts:
                self._blocked.pop(h, None)
        else:
            self._blocked[op.host] = op.barrier

    # ---- results
    def finish(self) -> "ScheduleBuilder":
        """Check that the list is complete: every barrier reached by all its hosts."""
        for name, inst in self._barriers.items():
            missing = sorted(set(inst["hosts"]) - inst["arrived"])
            if not (not missing):
                raise InputError("ops", f"barrier {show(name)} is never reached by host(s) {show(missing)}: "
                                 "the hosts waiting at it would block forever (deadlock)")
        return self

    def digest(self) -> str | None:
        """The digest of the schedule built so far (``Schedule.digest``), also when ops
        are not kept; None for a builder made with ``keep_ops=False, digest=False``."""
        if self.keep_ops:
            return self.schedule().digest()
        return None if self._digest is None else self._digest.hexdigest()

    def schedule(self) -> Schedule:
        """The schedule built so far (without ``keep_ops``: its header, no ops)."""
        raw = dict(self.doc)
        raw["ops"] = [op.raw for op in self.ops]
        return Schedule(self.name, self.description, self.buffers, self.streams, self.events, self.ops,
                        raw, self.hosts, list(self.unbound))


def _keys(d: dict, allowed: set, where: str) -> None:
    """``check_keys(d, allowed, where)``, with the common case (no unknown key) decided by
    one set comparison (this runs once per op)."""
    if not d.keys() <= allowed:
        check_keys(d, allowed, where)


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _canonical(doc) -> str:
    """The text a digest is taken of (``Schedule.digest``)."""
    return _CANONICAL.encode(doc)


class _DigestStream:
    """``Schedule.digest``, hashed as the canonical document is encoded: its text up to
    the ops list, each op as added (in batches), then the rest; ``raw`` is the document
    (its ``ops`` are left out), ``hosts`` its hosts.  A builder that keeps no ops feeds
    it as ops are added; ``Schedule.digest`` feeds it the schedule's ops."""

    _MARK = "kvrace-ops-go-here"   # a sentinel string where the ops list is cut out

    def __init__(self, raw: dict, hosts):
        doc = {k: v for k, v in raw.items() if k != "ops"}
        doc["kvrace_schedule"] = SCHEMA_VERSION
        doc["hosts"] = list(hosts)
        doc["ops"] = [self._MARK]
        text = _canonical(doc)
        cut = text.index(json.dumps(self._MARK))
        self._head, self._tail = text[:cut], text[cut + len(json.dumps(self._MARK)):]
        self._h = hashlib.sha256(self._head.encode())
        self._first = True
        self._batch: list[dict] = []

    BATCH = 256

    def add(self, op: Op) -> None:
        self._batch.append({**op.raw, "id": op.id, "host": op.host})
        if len(self._batch) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            text = _canonical(self._batch)[1:-1]        # the ops, comma-separated
            self._h.update((text if self._first else "," + text).encode())
            self._first = False
            self._batch = []

    def hexdigest(self) -> str:
        self._flush()
        h = self._h.copy()
        h.update(self._tail.encode())
        return h.hexdigest()


class _IdSet:
    """The op ids seen, for the duplicate check of a run that keeps no ops: recent ids
    in a set, older ones as sorted 64-bit hashes (8 bytes an id, not a string), with a
    one-hash Bloom filter of the old hashes (16 bits an id, so about 6 % of the ids not
    seen reach the sorted array) in front of the binary search.

    NOTE: two different ids whose 64-bit hashes (Python's ``hash``, fixed within a process,
    which is all one run needs) collide would be refused as a duplicate; at a million ids
    the chance is about 3e-8.  The filter only skips searches that would find nothing."""

    RECENT = 1 << 14
    BLOOM_BITS_PER_ID = 16

    def __init__(self):
        self._recent: set[str] = set()
        self._old = np.zeros(0, dtype=np.int64)
        self._bits = np.zeros(1, dtype=np.uint8)
        self._bloom = memoryview(self._bits)
        self._mask = 0                                    # byte index mask of the filter

    @staticmethod
    def _hash(s: str) -> int:
        return hash(s)

    def __contains__(self, s: str) -> bool:
        if s in self._recent:
            return True
        if not self._old.size:
            return False
        h = hash(s)
        if not (self._bloom[(h >> 3) & self._mask] >> (h & 7)) & 1:
            return False
        k = int(self._old.searchsorted(h))
        return k < self._old.size and int(self._old[k]) == h

    def add(self, s: str) -> None:
        self._recent.add(s)
        if len(self._recent) >= self.RECENT:
            new = np.fromiter((hash(x) for x in self._recent), np.int64, len(self._recent))
            self._old = np.sort(np.concatenate([self._old, new]))
            nbytes = 1 << max(0, (self._old.size * self.BLOOM_BITS_PER_ID // 8 - 1).bit_length())
            if nbytes != self._bits.size:             # grown: rebuild from every old hash
                self._bits = np.zeros(nbytes, dtype=np.uint8)
                self._mask = nbytes - 1
                self._set_bits(self._old)
                self._bloom = memoryview(self._bits)
            else:
                self._set_bits(new)
            self._recent = set()

    def _set_bits(self, h: np.ndarray) -> None:
        np.bitwise_or.at(self._bits, (h >> 3) & self._mask, (np.uint8(1) << (h & 7).astype(np.uint8)))


def _name_list(doc: dict, key: str, limit: int, limit_name: str, *, default) -> list[str]:
    """A list of unique names (events, hosts) of at most ``limit`` entries."""
    names = _get(doc, key, "", list, default=default)
    if not (len(names) <= limit):
        raise InputError(key, f"expected at most {limit} ({limit_name}) {key}, got {len(names)}")
    for i, e in enumerate(names):
        if not isinstance(e, str) or not 0 < len(e) <= MAX_NAME_CHARS:
            raise InputError(f"{key}[{i}]", f"expected a name of 1..{MAX_NAME_CHARS} (MAX_NAME_CHARS) "
                             f"characters, got {show(e)}")
    if not (len(set(names)) == len(names)):
        raise InputError(key, f"duplicate {key[:-1]} names")
    return names


#: while a run, a validation or a report is made (see fewer_full_collections)
GC_YOUNG_THRESHOLD = 20_000
GC_OLD_THRESHOLD = 1_000_000


@contextlib.contextmanager
def fewer_full_collections():
    """Within the block, CPython's cyclic collector runs its young collections less often
    and postpones full ones (the thresholds are raised, then restored; nothing else changes).

    NOTE: a run, a validation or a report allocates millions of small objects that live
    until it ends (the validated ops, queued ops and their events, per-read results), and
    each full collection walks every live object again: 20-25 % of a 100k-op static run's
    CPU.  Results do not depend on when the collector runs; cyclic garbage made inside
    the block is collected by the young collections or after it."""
    old = gc.get_threshold()
    if not gc.isenabled() or old[0] == 0:
        yield
        return
    gc.set_threshold(max(old[0], GC_YOUNG_THRESHOLD), old[1], max(old[2], GC_OLD_THRESHOLD))
    try:
        yield
    finally:
        gc.set_threshold(*old)


def validate(doc: Any, *, max_ops: int | None = MAX_OPS) -> Schedule:
    """Parse and check a schedule document (format 1 or 2); raise InputError naming the key."""
    b = ScheduleBuilder(doc, max_ops=max_ops)
    op_list = _get(doc, "ops", "", list)
    if max_ops is not None:
        if not (len(op_list) <= max_ops):
            raise InputError("ops", f"expected at most {max_ops} (MAX_OPS) ops, got {len(op_list)}")
    with fewer_full_collections():
        for d in op_list:
            b.add(d)
    return b.finish().schedule()


def load(path: str) -> Schedule:
    """Read and validate a schedule file.

    The file must be UTF-8 JSON of at most MAX_FILE_BYTES; integer literals are
    limited by Python's int-string limit (4300 digits; every integer field is
    then checked against int64), numbers must be finite (``NaN``, ``Infinity`` and
    literals that overflow a double are refused), nesting deeper than Python's
    recursion limit is refused; each problem is an InputError."""
    try:
        size = os.path.getsize(path)
        if not (size <= MAX_FILE_BYTES):
            raise InputError("", f"{show(path)} is {size} bytes; expected at most "
                             f"{MAX_FILE_BYTES} (MAX_FILE_BYTES, 64 MiB)")
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InputError("", f"schedule file not found: {show(path)}") from None
    except IsADirectoryError:
        raise InputError("", f"{show(path)} is a directory; expected a schedule file") from None
    return validate(parse_json(data, str(path)))


def _parse_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise InputError("", f"the number {show(text)} does not fit a double; expected a finite number")
    return v


def _parse_constant(text: str):
    raise InputError("", f"{text} is not a number JSON allows; expected a finite number")


def parse_json(data: bytes, name: str = "input") -> Any:
    """Decode a schedule's bytes: UTF-8 JSON with finite numbers (see :func:`load`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError("", f"{show(name)} is not UTF-8 text: byte {e.start} is {data[e.start:e.start + 1]!r}"
                         ) from None
    try:
        return json.loads(text, parse_float=_parse_float, parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise InputError("", f"{show(name)} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise InputError("", f"{show(name)} nests arrays or objects too deeply; expected at most a few "
                         "hundred levels") from None
    except InputError as e:
        raise InputError("", f"{show(name)}: {e.message}") from None
    except ValueError as e:               # an integer literal past Python's int-string limit
        raise InputError("", f"{show(name)}: a number JSON cannot hold: {show(str(e))}") from None
