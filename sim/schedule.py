"""Schedule: the versioned, JSON-serialisable program both halves of kvrace run.

A schedule says *what* runs on which stream, never when.  Its ops form one list
in **host issue order** (the order a CUDA host program would issue them); each
op names its stream, so a stream's FIFO order is the subsequence of its ops.
``host_sync`` and ``host_delay`` act on the host itself: ops after a
``host_sync`` are issued only once its target has completed.

A ``wait`` binds to the latest ``record`` of its event issued before it (CUDA
semantics).  CUDA treats a wait on a never-recorded event as a no-op; kvrace
rejects it, because such a schedule always means "wait for a record that can
only come later", which would deadlock.

JSON shape (``kvrace_schedule`` is the format version)::

    {"kvrace_schedule": 1, "name": "...", "description": "...",
     "buffers": [{"name", "location": "device"|"host", "device": 0, "kind",
                  "layout": {...}, "init": [{"layers", "indices", "owner",
                  "version", "first_unit"}]}],
     "streams": [{"name", "device": 0}],
     "events": ["e0", ...],
     "ops": [{"op": "copy", "stream", "routine", "src", "dst", "args": {...}},
             {"op": "read"|"write", "stream", "buffer", "layer", "units"|"tokens"|"ranges", ...},
             {"op": "compute", "stream", "duration_us"},
             {"op": "record"|"wait", "stream", "event"},
             {"op": "host_sync", "event"|"stream"|nothing (= device synchronize)},
             {"op": "host_delay", "duration_us"}]}

Every op may carry an ``id`` (default ``op<index>``).  ``validate`` turns the
JSON into a :class:`Schedule` or raises :class:`~sim.errors.InputError` naming
the op and the field.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.bytes.pattern import MAX_UNIT_BYTES
from sim.errors import InputError, require, show
from sim.pools.layouts import layout_from_json
from sim.transfers.routines import ROUTINES, count_out_of_bounds, plan as plan_copy

SCHEMA_VERSION = 1
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
MAX_INIT_FILLS = 1 << 16       # (init entry, layer) pairs of all buffers (each is a fill of every model)
MAX_READ_EXTENTS = 1 << 16     # extents (unit rows, token fields, ranges) of all reads together
MAX_READ_BYTES = 128 << 20     # bytes of all reads together (each read's bytes are kept, twice)
MAX_OUT_OF_BOUNDS = 1 << 14    # copy extent sides outside their buffer (the report lists each one)
MAX_DURATION_US = 1e9          # one compute or host_delay: 1,000 s
MAX_NAME_CHARS = 256           # a buffer, kind, stream, event or op name
MAX_DEVICE = 1023              # device ordinals
OP_KINDS = ("copy", "read", "write", "compute", "record", "wait", "host_sync", "host_delay")
STREAM_OPS = ("copy", "read", "write", "compute", "record", "wait")


@dataclass(frozen=True)
class Fill:
    """Initial contents: ``indices`` of the buffer (at ``layers``) hold units
    ``first_unit + k`` of origin (buffer kind, layer, owner, version)."""

    layers: tuple[int, ...]
    indices: np.ndarray
    owner: int
    version: int
    first_unit: int


@dataclass(frozen=True)
class BufferSpec:
    name: str
    location: str
    device: int
    kind: str
    layout: Any
    init: tuple[Fill, ...] = ()

    @property
    def nbytes(self) -> int:
        return int(self.layout.nbytes)


@dataclass
class Op:
    index: int
    id: str
    op: str
    stream: str | None = None
    # copy
    routine: str | None = None
    src: str | None = None
    dst: str | None = None
    args: dict = field(default_factory=dict)
    plan: Any = None
    # read / write
    buffer: str | None = None
    extents: tuple[np.ndarray, np.ndarray] | None = None   # (offsets, lengths)
    layer: int | None = None
    owner: int = -1
    version: int = 0
    units: np.ndarray | None = None
    # compute / host_delay
    duration_us: float = 0.0
    # record / wait / host_sync
    event: str | None = None
    bound_record: int | None = None     # wait/host_sync(event): index of the record op it binds to
    sync_stream: str | None = None      # host_sync(stream)
    sync_targets: tuple[int, ...] = ()  # host_sync: indices of the ops it waits for
    raw: dict = field(default_factory=dict)


@dataclass
class Schedule:
    name: str
    description: str
    buffers: dict[str, BufferSpec]
    streams: dict[str, int]
    events: tuple[str, ...]
    ops: list[Op]
    raw: dict

    def digest(self) -> str:
        text = json.dumps(self.raw, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def op(self, op_id: str) -> Op:
        for o in self.ops:
            if o.id == op_id:
                return o
        raise KeyError(op_id)

    def to_json(self) -> dict:
        return self.raw


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


def _check_keys(d: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise InputError(f"{where}.{show(extra[0])[1:-1]}", f"unknown key; expected one of {sorted(allowed)}")


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
    require(n <= MAX_INDICES, where, f"expected at most {MAX_INDICES} (MAX_INDICES) indices, got {show(n)}")
    return n


class _Totals:
    """Running totals of the schedule-wide limits (checked before each expansion)."""

    def __init__(self):
        self.indices = 0
        self.buffer_bytes = 0
        self.out_of_bounds = 0
        self.fills = 0
        self.read_extents = 0
        self.read_bytes = 0

    def add_indices(self, n: int, where: str) -> None:
        self.indices += n
        require(self.indices <= MAX_TOTAL_INDICES, where,
                f"the schedule's index lists would hold {self.indices} indices (each counted once per "
                f"layer it touches); expected at most MAX_TOTAL_INDICES = {MAX_TOTAL_INDICES}")

    def add_fills(self, n: int, where: str) -> None:
        self.fills += n
        require(self.fills <= MAX_INIT_FILLS, where,
                f"the buffers' init entries would fill {self.fills} (entry, layer) pairs; expected at most "
                f"MAX_INIT_FILLS = {MAX_INIT_FILLS}")

    def add_out_of_bounds(self, n: int, where: str) -> None:
        self.out_of_bounds += n
        require(self.out_of_bounds <= MAX_OUT_OF_BOUNDS, where,
                f"the schedule's copies would have {self.out_of_bounds} extent sides outside their buffers "
                f"(each is reported); expected at most MAX_OUT_OF_BOUNDS = {MAX_OUT_OF_BOUNDS}")

    def add_read(self, extents: int, nbytes: int, where: str) -> None:
        self.read_extents += extents
        self.read_bytes += nbytes
        require(self.read_extents <= MAX_READ_EXTENTS, where,
                f"the schedule's reads would touch {self.read_extents} extents; expected at most "
                f"MAX_READ_EXTENTS = {MAX_READ_EXTENTS}")
        require(self.read_bytes <= MAX_READ_BYTES, where,
                f"the schedule's reads would capture {self.read_bytes} bytes; expected at most "
                f"MAX_READ_BYTES = {MAX_READ_BYTES} (128 MiB)")


def _int_list(v, where: str, lo: int = INT_MIN, hi: int = INT_MAX) -> np.ndarray:
    """A list of int64s, or {"start", "count"[, "step"]} (``start + step*k`` for
    ``k < count``), each in ``[lo, hi]``; at most MAX_INDICES entries.  The count and
    the range of an arithmetic list are checked before it is expanded."""
    if isinstance(v, dict):
        _check_keys(v, {"start", "count", "step"}, where)
        start = _get(v, "start", where, int)
        count = _get(v, "count", where, int)
        step = _get(v, "step", where, int, default=1)
        require(0 <= count <= MAX_INDICES, f"{where}.count",
                f"expected 0..{MAX_INDICES} (MAX_INDICES), got {count}")
        if count:
            last = start + step * (count - 1)
            bad = start if not lo <= start <= hi else (last if not lo <= last <= hi else None)
            require(bad is None, where, f"expected indices in {lo}..{hi}, but start {start}, step {step}, "
                    f"count {count} reaches {bad}")
        return start + step * np.arange(count, dtype=np.int64)
    if not isinstance(v, list):
        raise InputError(where, f"expected a list of integers or {{start, count}}, got {show(v)}")
    require(len(v) <= MAX_INDICES, where, f"expected at most {MAX_INDICES} (MAX_INDICES) indices, got {len(v)}")
    if not v:
        return np.zeros(0, dtype=np.int64)
    if not all(type(x) is int for x in v) or min(v) < lo or max(v) > hi:
        for k, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int):
                raise InputError(f"{where}[{k}]", f"expected an integer, got {show(x)}")
            if not lo <= x <= hi:
                raise InputError(f"{where}[{k}]", f"expected an index in {lo}..{hi}, got {show(x)}")
    return np.asarray(v, dtype=np.int64)


def _normalise_args(args: dict, where: str) -> dict:
    """Index lists may be written as {"start", "count"[, "step"]}: expand them."""
    return {k: (_int_list(v, f"{where}.{k}").tolist() if isinstance(v, dict) else v)
            for k, v in args.items()}


def _name(d: dict, key: str, where: str, known, what: str) -> str:
    v = _get(d, key, where, str)
    if v not in known:
        raise InputError(f"{where}.{key}", f"unknown {what} {show(v)}; expected one of {show(sorted(known))}")
    return v


# ---------------------------------------------------------------- parsing

def _label(d: dict, key: str, where: str, *, default=...) -> str:
    """A name (buffer, kind, stream, event, op id): a non-empty string of at most
    MAX_NAME_CHARS characters, so that every message echoing it stays short."""
    v = _get(d, key, where, str, default=default)
    require(0 < len(v) <= MAX_NAME_CHARS, f"{where}.{key}",
            f"expected a name of 1..{MAX_NAME_CHARS} (MAX_NAME_CHARS) characters, got {show(v)}")
    return v


def _parse_buffer(d: Any, where: str, totals: _Totals) -> BufferSpec:
    if not isinstance(d, dict):
        raise InputError(where, f"expected an object, got {show(d)}")
    _check_keys(d, {"name", "location", "device", "kind", "layout", "init", "description"}, where)
    name = _label(d, "name", where)
    location = _get(d, "location", where, str)
    require(location in ("device", "host"), f"{where}.location",
            f"expected 'device' or 'host', got {show(location)}")
    device = _get(d, "device", where, int, default=0)
    require(0 <= device <= MAX_DEVICE, f"{where}.device", f"expected 0..{MAX_DEVICE} (MAX_DEVICE), got {device}")
    kind = _label(d, "kind", where, default=name)
    layout = layout_from_json(_get(d, "layout", where, dict), f"{where}.layout")
    require(layout.layers <= MAX_LAYERS, f"{where}.layout.layers",
            f"expected at most {MAX_LAYERS} (MAX_LAYERS) layers, got {layout.layers}")
    require(int(layout.nbytes) <= MAX_BUFFER_BYTES, f"{where}.layout",
            f"a buffer of {int(layout.nbytes)} bytes; expected at most {MAX_BUFFER_BYTES} (MAX_BUFFER_BYTES, 1 PiB)")
    totals.buffer_bytes += int(layout.nbytes)
    require(totals.buffer_bytes <= MAX_TOTAL_BUFFER_BYTES, f"{where}.layout",
            f"a buffer of {int(layout.nbytes)} bytes brings the schedule's buffers to {totals.buffer_bytes} "
            f"bytes; expected at most {MAX_TOTAL_BUFFER_BYTES} (MAX_TOTAL_BUFFER_BYTES, all buffers together)")
    require(layout.unit_bytes <= MAX_UNIT_BYTES, f"{where}.layout",
            f"a unit (page or row) of {layout.unit_bytes} bytes; expected at most {MAX_UNIT_BYTES} "
            "(the pattern bytes' unit limit)")
    is_host = type(layout).__name__ == "HostLayout"
    require(is_host == (location == "host"), f"{where}.layout",
            f"a {location} buffer needs a {'host' if location == 'host' else 'device (paged/preset)'} layout")
    fills = []
    for j, f in enumerate(_get(d, "init", where, list, default=[])):
        fw = f"{where}.init[{j}]"
        if not isinstance(f, dict):
            raise InputError(fw, f"expected an object, got {show(f)}")
        _check_keys(f, {"layers", "indices", "owner", "version", "first_unit"}, fw)
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
        require(0 <= first_unit <= top, f"{fw}.first_unit",
                f"expected 0..{top} (its units' pattern offsets must be int64), got {first_unit}")
        fills.append(Fill(layers, idx, _get(f, "owner", fw, int, default=-1),
                          _get(f, "version", fw, int, default=1), first_unit))
    return BufferSpec(name, location, device, kind, layout, tuple(fills))


def _selection(d: dict, where: str, buf: BufferSpec, totals: _Totals, *, allow_ranges: bool):
    keys = [k for k in ("units", "tokens", "ranges") if k in d]
    allowed = "'units' or 'tokens'" + (" or 'ranges'" if allow_ranges else "")
    require(len(keys) == 1, where, f"expected exactly one of {allowed}, got {keys or 'none'}")
    key = keys[0]
    require(allow_ranges or key != "ranges", f"{where}.ranges", f"not allowed here; use {allowed}")
    lay = buf.layout
    is_read = allow_ranges
    if key == "ranges":
        r = _get(d, "ranges", where, list)
        require(0 < len(r) <= MAX_INDICES, f"{where}.ranges",
                f"expected 1..{MAX_INDICES} (MAX_INDICES) [offset, nbytes] pairs, got {len(r)}")
        total = 0
        for k, x in enumerate(r):
            ok = (isinstance(x, list) and len(x) == 2
                  and all(isinstance(y, int) and not isinstance(y, bool) for y in x))
            if not ok:
                raise InputError(f"{where}.ranges[{k}]", f"expected an [offset, nbytes] pair of integers, got {show(x)}")
            o, n = x
            if not (0 <= o and 0 < n and o + n <= buf.nbytes):
                raise InputError(f"{where}.ranges[{k}]",
                                 f"expected offset >= 0, nbytes > 0 and offset + nbytes <= {buf.nbytes} "
                                 f"(the buffer's size), got {show(x)}")
            total += n
        totals.add_read(len(r), total, f"{where}.ranges")
        arr = np.asarray(r, dtype=np.int64).reshape(-1, 2)
        return None, None, (arr[:, 0].copy(), arr[:, 1].copy())
    layer = _get(d, "layer", where, int)
    require(0 <= layer < lay.layers, f"{where}.layer", f"expected 0..{lay.layers - 1}, got {layer}")
    count = _list_count(d[key], f"{where}.{key}")
    totals.add_indices(count, f"{where}.{key}")
    if key == "units":
        if is_read:
            totals.add_read(count, count * lay.unit_bytes, f"{where}.units")
        idx = _int_list(d[key], f"{where}.units", 0, lay.units - 1)
        require(idx.size > 0, f"{where}.{key}", "expected at least one index")
        offs = lay.unit_offsets(layer, idx)
        return layer, idx, (np.asarray(offs, dtype=np.int64), np.full(idx.size, lay.unit_bytes, np.int64))
    require(hasattr(lay, "token_extents"), f"{where}.tokens", "token selection needs a device (paged) layout")
    ntok = lay.pages * lay.entries_per_page
    if is_read:
        fields = lay.effective_fields
        totals.add_read(count * len(fields), count * sum(f.entry_bytes for f in fields), f"{where}.tokens")
    idx = _int_list(d[key], f"{where}.tokens", 0, ntok - 1)
    require(idx.size > 0, f"{where}.{key}", "expected at least one index")
    offs, lens = lay.token_extents(layer, idx)          # (tokens, fields): token-major
    return layer, idx, (np.asarray(offs, dtype=np.int64).ravel(), np.asarray(lens, dtype=np.int64).ravel())


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


def validate(doc: Any) -> Schedule:
    """Parse and check a schedule document; raise InputError naming the key."""
    require(isinstance(doc, dict), "", f"a schedule must be a JSON object, got {type(doc).__name__}")
    version = doc.get("kvrace_schedule")
    require(version == SCHEMA_VERSION, "kvrace_schedule",
            f"expected format version {SCHEMA_VERSION}, got {show(version)}")
    _check_keys(doc, {"kvrace_schedule", "name", "description", "buffers", "streams", "events", "ops"}, "")
    name = _label(doc, "name", "", default="unnamed")
    description = _get(doc, "description", "", str, default="")
    totals = _Totals()

    buffers: dict[str, BufferSpec] = {}
    buffer_list = _get(doc, "buffers", "", list)
    require(len(buffer_list) <= MAX_BUFFERS, "buffers",
            f"expected at most {MAX_BUFFERS} (MAX_BUFFERS) buffers, got {len(buffer_list)}")
    for i, b in enumerate(buffer_list):
        spec = _parse_buffer(b, f"buffers[{i}]", totals)
        require(spec.name not in buffers, f"buffers[{i}].name", f"duplicate buffer name {show(spec.name)}")
        buffers[spec.name] = spec

    streams: dict[str, int] = {}
    stream_list = _get(doc, "streams", "", list)
    require(len(stream_list) <= MAX_STREAMS, "streams",
            f"expected at most {MAX_STREAMS} (MAX_STREAMS) streams, got {len(stream_list)}")
    for i, s in enumerate(stream_list):
        w = f"streams[{i}]"
        if isinstance(s, str):
            s = {"name": s}
        if not isinstance(s, dict):
            raise InputError(w, f"expected a name or an object, got {show(s)}")
        _check_keys(s, {"name", "device"}, w)
        sname = _label(s, "name", w)
        require(sname not in streams, f"{w}.name", f"duplicate stream name {show(sname)}")
        device = _get(s, "device", w, int, default=0)
        require(0 <= device <= MAX_DEVICE, f"{w}.device", f"expected 0..{MAX_DEVICE} (MAX_DEVICE), got {device}")
        streams[sname] = device
    events = _get(doc, "events", "", list, default=[])
    require(len(events) <= MAX_EVENTS, "events",
            f"expected at most {MAX_EVENTS} (MAX_EVENTS) events, got {len(events)}")
    for i, e in enumerate(events):
        if not isinstance(e, str) or not 0 < len(e) <= MAX_NAME_CHARS:
            raise InputError(f"events[{i}]", f"expected a name of 1..{MAX_NAME_CHARS} (MAX_NAME_CHARS) "
                             f"characters, got {show(e)}")
    require(len(set(events)) == len(events), "events", "duplicate event names")

    ops: list[Op] = []
    ids: set[str] = set()
    last_record: dict[str, int] = {}
    last_on_stream: dict[str, int] = {}
    op_list = _get(doc, "ops", "", list)
    require(len(op_list) <= MAX_OPS, "ops", f"expected at most {MAX_OPS} (MAX_OPS) ops, got {len(op_list)}")
    for i, d in enumerate(op_list):
        w = f"ops[{i}]"
        if not isinstance(d, dict):
            raise InputError(w, f"expected an object, got {show(d)}")
        kind = _get(d, "op", w, str)
        require(kind in OP_KINDS, f"{w}.op", f"unknown op {show(kind)}; expected one of {list(OP_KINDS)}")
        op_id = _label(d, "id", w, default=f"op{i}")
        require(op_id not in ids, f"{w}.id", f"duplicate op id {show(op_id)}")
        ids.add(op_id)
        w = f"ops[{i}] ({op_id})"
        op = Op(index=i, id=op_id, op=kind, raw=d)
        common = {"op", "id", "note"}
        if kind in STREAM_OPS:
            op.stream = _name(d, "stream", w, streams, "stream")
        if kind == "copy":
            _check_keys(d, common | {"stream", "routine", "src", "dst", "args"}, w)
            op.routine = _name(d, "routine", w, ROUTINES, "routine")
            op.src = _name(d, "src", w, buffers, "buffer")
            op.dst = _name(d, "dst", w, buffers, "buffer")
            src, dst = buffers[op.src], buffers[op.dst]
            require(not (src.location == "host" and dst.location == "host"), w,
                    "host-to-host copies are not modelled; expected a device buffer on at least one side")
            args = _get(d, "args", w, dict, default={})
            totals.add_indices(_copy_indices(args, src.layout, dst.layout, f"{w}.args"), f"{w}.args.src_indices")
            op.args = _normalise_args(args, f"{w}.args")
            op.plan = plan_copy(op.routine, buffers[op.src].layout, buffers[op.dst].layout,
                                op.args, w)
            totals.add_out_of_bounds(count_out_of_bounds(op.plan.extents, src.nbytes, dst.nbytes), w)
        elif kind in ("read", "write"):
            extra = {"owner", "version"} if kind == "write" else set()
            _check_keys(d, common | {"stream", "buffer", "layer", "units", "tokens", "ranges"} | extra, w)
            op.buffer = _name(d, "buffer", w, buffers, "buffer")
            op.layer, op.units, op.extents = _selection(d, w, buffers[op.buffer], totals,
                                                        allow_ranges=(kind == "read"))
            if kind == "write":
                require("units" in d, f"{w}.units",
                        "a write names the units it stores (the pattern's unit is the buffer's unit)")
                op.owner = _get(d, "owner", w, int, default=-1)
                op.version = _get(d, "version", w, int, default=1)
        elif kind in ("compute", "host_delay"):
            _check_keys(d, common | {"stream", "duration_us"}, w)
            duration = _get(d, "duration_us", w, (int, float))
            require(isinstance(duration, float) or abs(duration) <= MAX_DURATION_US, f"{w}.duration_us",
                    f"expected 0..{MAX_DURATION_US:g} (MAX_DURATION_US), got {show(duration)}")
            op.duration_us = float(duration)
            require(math.isfinite(op.duration_us) and 0 <= op.duration_us <= MAX_DURATION_US,
                    f"{w}.duration_us",
                    f"expected a finite number in 0..{MAX_DURATION_US:g} (MAX_DURATION_US), got {show(duration)}")
        elif kind in ("record", "wait"):
            _check_keys(d, common | {"stream", "event"}, w)
            op.event = _name(d, "event", w, events, "event")
            if kind == "record":
                last_record[op.event] = i
            else:
                require(op.event in last_record, f"{w}.event",
                        f"wait on event {show(op.event)}, which has no record issued before it: it would "
                        "never complete (deadlock); record the event earlier in the op list")
                op.bound_record = last_record[op.event]
        elif kind == "host_sync":
            _check_keys(d, common | {"event", "stream"}, w)
            require(not ("event" in d and "stream" in d), w, "expected 'event' or 'stream', not both")
            if "event" in d:
                op.event = _name(d, "event", w, events, "event")
                require(op.event in last_record, f"{w}.event",
                        f"host_sync on event {show(op.event)}, which has no record issued before it: "
                        "the host would block forever (deadlock)")
                op.bound_record = last_record[op.event]
            elif "stream" in d:
                op.sync_stream = _name(d, "stream", w, streams, "stream")
            if op.bound_record is not None:
                op.sync_targets = (op.bound_record,)
            elif op.sync_stream is not None:
                op.sync_targets = tuple(last_on_stream[n] for n in (op.sync_stream,) if n in last_on_stream)
            else:
                op.sync_targets = tuple(last_on_stream.values())
        if op.stream is not None:
            last_on_stream[op.stream] = i
        ops.append(op)
    return Schedule(name, description, buffers, streams, tuple(events), ops, doc)


def load(path: str) -> Schedule:
    """Read and validate a schedule file.

    The file must be UTF-8 JSON of at most MAX_FILE_BYTES; integer literals are
    limited by Python's int-string limit (4300 digits; every integer field is
    then checked against int64), numbers must be finite (``NaN``, ``Infinity`` and
    literals that overflow a double are refused), nesting deeper than Python's
    recursion limit is refused; each problem is an InputError."""
    try:
        size = os.path.getsize(path)
        require(size <= MAX_FILE_BYTES, "", f"{show(path)} is {size} bytes; expected at most "
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
