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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.bytes.pattern import MAX_UNIT_BYTES
from sim.errors import InputError, require
from sim.pools.layouts import layout_from_json
from sim.transfers.routines import ROUTINES, plan as plan_copy

SCHEMA_VERSION = 1
MAX_BUFFER_BYTES = 1 << 50     # 1 PiB: beyond any pool, and far inside int64 offsets
MAX_LAYERS = 4096              # models have at most a few hundred; every layer gets its own origin
MAX_INDICES = 1 << 24          # one index list: 16 Mi entries (a 1M-token context is 2**20)
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
        raise InputError(f"{where}.{key}", f"expected an integer, got {v!r}")
    if types in (float, (int, float)):
        types = (int, float)
        if isinstance(v, bool):
            raise InputError(f"{where}.{key}", f"expected a number, got {v!r}")
    if not isinstance(v, types):
        raise InputError(f"{where}.{key}", f"expected {what or _tname(types)}, got {v!r}")
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
        raise InputError(f"{where}.{extra[0]}", f"unknown key; expected one of {sorted(allowed)}")


def _int_list(v, where: str) -> np.ndarray:
    """A list of ints, or {"start", "count"[, "step"]}."""
    if isinstance(v, dict):
        _check_keys(v, {"start", "count", "step"}, where)
        start = _get(v, "start", where, int)
        count = _get(v, "count", where, int)
        step = _get(v, "step", where, int, default=1)
        require(0 <= count <= MAX_INDICES, f"{where}.count", f"expected 0..{MAX_INDICES}, got {count}")
        return start + step * np.arange(count, dtype=np.int64)
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise InputError(where, f"expected a list of integers or {{start, count}}, got {str(v)[:80]}")
    if any(not -(1 << 63) <= x < (1 << 63) for x in v):
        raise InputError(where, "expected int64 values")
    return np.asarray(v, dtype=np.int64)


def _normalise_args(args: dict, where: str) -> dict:
    """Index lists may be written as {"start", "count"[, "step"]}: expand them."""
    return {k: (_int_list(v, f"{where}.{k}").tolist() if isinstance(v, dict) else v)
            for k, v in args.items()}


def _name(d: dict, key: str, where: str, known, what: str) -> str:
    v = _get(d, key, where, str)
    if v not in known:
        raise InputError(f"{where}.{key}", f"unknown {what} {v!r}; expected one of {sorted(known)}")
    return v


# ---------------------------------------------------------------- parsing

def _parse_buffer(d: Any, where: str) -> BufferSpec:
    require(isinstance(d, dict), where, f"expected an object, got {d!r}")
    _check_keys(d, {"name", "location", "device", "kind", "layout", "init", "description"}, where)
    name = _get(d, "name", where, str)
    location = _get(d, "location", where, str)
    require(location in ("device", "host"), f"{where}.location",
            f"expected 'device' or 'host', got {location!r}")
    device = _get(d, "device", where, int, default=0)
    require(device >= 0, f"{where}.device", f"expected >= 0, got {device}")
    kind = _get(d, "kind", where, str, default=name)
    layout = layout_from_json(_get(d, "layout", where, dict), f"{where}.layout")
    require(layout.layers <= MAX_LAYERS, f"{where}.layout.layers",
            f"expected at most {MAX_LAYERS} layers, got {layout.layers}")
    require(int(layout.nbytes) <= MAX_BUFFER_BYTES, f"{where}.layout",
            f"a buffer of {int(layout.nbytes)} bytes; expected at most {MAX_BUFFER_BYTES} (1 PiB)")
    require(layout.unit_bytes <= MAX_UNIT_BYTES, f"{where}.layout",
            f"a unit (page or row) of {layout.unit_bytes} bytes; expected at most {MAX_UNIT_BYTES} "
            "(the pattern bytes' unit limit)")
    is_host = type(layout).__name__ == "HostLayout"
    require(is_host == (location == "host"), f"{where}.layout",
            f"a {location} buffer needs a {'host' if location == 'host' else 'device (paged/preset)'} layout")
    fills = []
    for j, f in enumerate(_get(d, "init", where, list, default=[])):
        fw = f"{where}.init[{j}]"
        require(isinstance(f, dict), fw, f"expected an object, got {f!r}")
        _check_keys(f, {"layers", "indices", "owner", "version", "first_unit"}, fw)
        layers_v = f.get("layers", "all")
        if layers_v == "all":
            layers = tuple(range(layout.layers))
        else:
            layers = tuple(int(x) for x in _int_list(layers_v, f"{fw}.layers"))
            bad = [x for x in layers if not 0 <= x < layout.layers]
            require(not bad, f"{fw}.layers", f"expected layers in 0..{layout.layers - 1}, got {bad[:5]}")
        idx = _int_list(_get(f, "indices", fw, (list, dict)), f"{fw}.indices")
        bad = idx[(idx < 0) | (idx >= layout.units)]
        require(bad.size == 0, f"{fw}.indices",
                f"expected indices in 0..{layout.units - 1}, got {bad[:5].tolist()}")
        fills.append(Fill(layers, idx, _get(f, "owner", fw, int, default=-1),
                          _get(f, "version", fw, int, default=1),
                          _get(f, "first_unit", fw, int, default=0)))
    return BufferSpec(name, location, device, kind, layout, tuple(fills))


def _selection(d: dict, where: str, buf: BufferSpec, *, allow_ranges: bool):
    keys = [k for k in ("units", "tokens", "ranges") if k in d]
    allowed = "'units' or 'tokens'" + (" or 'ranges'" if allow_ranges else "")
    require(len(keys) == 1, where, f"expected exactly one of {allowed}, got {keys or 'none'}")
    key = keys[0]
    require(allow_ranges or key != "ranges", f"{where}.ranges", f"not allowed here; use {allowed}")
    lay = buf.layout
    if key == "ranges":
        r = _get(d, "ranges", where, list)
        ok = all(isinstance(x, list) and len(x) == 2 and all(isinstance(y, int) for y in x) for x in r)
        require(ok and r, f"{where}.ranges", "expected a non-empty list of [offset, nbytes] pairs")
        arr = np.asarray(r, dtype=np.int64).reshape(-1, 2)
        bad = (arr[:, 0] < 0) | (arr[:, 1] <= 0) | (arr[:, 0] + arr[:, 1] > buf.nbytes)
        require(not bad.any(), f"{where}.ranges",
                f"ranges must lie in [0, {buf.nbytes}) with nbytes > 0; bad: {arr[bad][:3].tolist()}")
        return None, None, (arr[:, 0].copy(), arr[:, 1].copy())
    layer = _get(d, "layer", where, int)
    require(0 <= layer < lay.layers, f"{where}.layer", f"expected 0..{lay.layers - 1}, got {layer}")
    idx = _int_list(d[key], f"{where}.{key}")
    require(idx.size > 0, f"{where}.{key}", "expected at least one index")
    if key == "units":
        bad = idx[(idx < 0) | (idx >= lay.units)]
        require(bad.size == 0, f"{where}.units", f"expected 0..{lay.units - 1}, got {bad[:5].tolist()}")
        offs = lay.unit_offsets(layer, idx)
        return layer, idx, (np.asarray(offs, dtype=np.int64), np.full(idx.size, lay.unit_bytes, np.int64))
    require(hasattr(lay, "token_extents"), f"{where}.tokens", "token selection needs a device (paged) layout")
    ntok = lay.pages * lay.entries_per_page
    bad = idx[(idx < 0) | (idx >= ntok)]
    require(bad.size == 0, f"{where}.tokens", f"expected 0..{ntok - 1}, got {bad[:5].tolist()}")
    offs, lens = lay.token_extents(layer, idx)          # (tokens, fields): token-major
    return layer, idx, (np.asarray(offs, dtype=np.int64).ravel(), np.asarray(lens, dtype=np.int64).ravel())


def validate(doc: Any) -> Schedule:
    """Parse and check a schedule document; raise InputError naming the key."""
    require(isinstance(doc, dict), "", f"a schedule must be a JSON object, got {type(doc).__name__}")
    version = doc.get("kvrace_schedule")
    require(version == SCHEMA_VERSION, "kvrace_schedule",
            f"expected format version {SCHEMA_VERSION}, got {version!r}")
    _check_keys(doc, {"kvrace_schedule", "name", "description", "buffers", "streams", "events", "ops"}, "")
    name = _get(doc, "name", "", str, default="unnamed")
    description = _get(doc, "description", "", str, default="")

    buffers: dict[str, BufferSpec] = {}
    for i, b in enumerate(_get(doc, "buffers", "", list)):
        spec = _parse_buffer(b, f"buffers[{i}]")
        require(spec.name not in buffers, f"buffers[{i}].name", f"duplicate buffer name {spec.name!r}")
        buffers[spec.name] = spec

    streams: dict[str, int] = {}
    for i, s in enumerate(_get(doc, "streams", "", list)):
        w = f"streams[{i}]"
        if isinstance(s, str):
            s = {"name": s}
        require(isinstance(s, dict), w, f"expected a name or an object, got {s!r}")
        _check_keys(s, {"name", "device"}, w)
        sname = _get(s, "name", w, str)
        require(sname not in streams, f"{w}.name", f"duplicate stream name {sname!r}")
        streams[sname] = _get(s, "device", w, int, default=0)
    events = _get(doc, "events", "", list, default=[])
    for i, e in enumerate(events):
        require(isinstance(e, str), f"events[{i}]", f"expected a string, got {e!r}")
    require(len(set(events)) == len(events), "events", "duplicate event names")

    ops: list[Op] = []
    ids: set[str] = set()
    last_record: dict[str, int] = {}
    last_on_stream: dict[str, int] = {}
    for i, d in enumerate(_get(doc, "ops", "", list)):
        w = f"ops[{i}]"
        require(isinstance(d, dict), w, f"expected an object, got {d!r}")
        kind = _get(d, "op", w, str)
        require(kind in OP_KINDS, f"{w}.op", f"unknown op {kind!r}; expected one of {list(OP_KINDS)}")
        op_id = _get(d, "id", w, str, default=f"op{i}")
        require(op_id not in ids, f"{w}.id", f"duplicate op id {op_id!r}")
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
            op.args = _normalise_args(_get(d, "args", w, dict, default={}), f"{w}.args")
            op.plan = plan_copy(op.routine, buffers[op.src].layout, buffers[op.dst].layout,
                                op.args, w)
        elif kind in ("read", "write"):
            extra = {"owner", "version"} if kind == "write" else set()
            _check_keys(d, common | {"stream", "buffer", "layer", "units", "tokens", "ranges"} | extra, w)
            op.buffer = _name(d, "buffer", w, buffers, "buffer")
            op.layer, op.units, op.extents = _selection(d, w, buffers[op.buffer],
                                                        allow_ranges=(kind == "read"))
            if kind == "write":
                require("units" in d, f"{w}.units",
                        "a write names the units it stores (the pattern's unit is the buffer's unit)")
                op.owner = _get(d, "owner", w, int, default=-1)
                op.version = _get(d, "version", w, int, default=1)
        elif kind in ("compute", "host_delay"):
            _check_keys(d, common | {"stream", "duration_us"}, w)
            op.duration_us = float(_get(d, "duration_us", w, (int, float)))
            require(op.duration_us >= 0, f"{w}.duration_us", f"expected >= 0, got {op.duration_us}")
        elif kind in ("record", "wait"):
            _check_keys(d, common | {"stream", "event"}, w)
            op.event = _name(d, "event", w, events, "event")
            if kind == "record":
                last_record[op.event] = i
            else:
                require(op.event in last_record, f"{w}.event",
                        f"wait on event {op.event!r}, which has no record issued before it: it would "
                        "never complete (deadlock); record the event earlier in the op list")
                op.bound_record = last_record[op.event]
        elif kind == "host_sync":
            _check_keys(d, common | {"event", "stream"}, w)
            require(not ("event" in d and "stream" in d), w, "expected 'event' or 'stream', not both")
            if "event" in d:
                op.event = _name(d, "event", w, events, "event")
                require(op.event in last_record, f"{w}.event",
                        f"host_sync on event {op.event!r}, which has no record issued before it: "
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
    """Read and validate a schedule file."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise InputError("", f"schedule file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise InputError("", f"{path} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    return validate(doc)
