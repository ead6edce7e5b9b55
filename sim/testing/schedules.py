"""Random valid schedules: the small KV geometry the project's tests use, and the geometry
families (KV rows, DSA index-K pages, DeepSeek V4 C4 pages and bf16 rows, page-first host pools)
that together use every copy routine, with host syncs of every kind and several hosts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from hypothesis import strategies as st

from sim.errors import InputError, show

__all__ = ["EVENTS", "FAMILIES", "LAYERS", "RICH_UNITS", "STREAMS", "UNITS", "UNIT_BYTES", "copy_op", "idx_sets",
           "kv_buffers", "kv_schedules", "rich_schedules", "schedules"]

# ================================================================ the small KV geometry
#
# One host buffer and two device buffers of 2 layers x 8 units of 64 B, three streams, four
# events: small enough that every interleaving is cheap.

UNITS, UNIT_BYTES, LAYERS = 8, 64, 2
STREAMS = ["s0", "s1", "s2"]
EVENTS = ["e0", "e1", "e2", "e3"]


def kv_buffers(unit_bytes: int = UNIT_BYTES) -> list[dict]:
    """Buffers ``H`` (host, ``layer_first``, every unit filled by owner 1), ``D`` and ``D2``
    (device, kinds ``kv`` and ``kv2``): 2 layers x 8 units of ``unit_bytes``."""
    host = {"kind": "host", "layout": "layer_first", "layers": LAYERS, "units": UNITS, "unit_bytes": unit_bytes}
    dev = {"kind": "paged", "layers": LAYERS, "pages": UNITS, "page_bytes": unit_bytes}
    return [
        {"name": "H", "location": "host", "kind": "kv", "layout": host,
         "init": [{"layers": "all", "indices": {"start": 0, "count": UNITS}, "owner": 1, "version": 1}]},
        {"name": "D", "location": "device", "kind": "kv", "layout": dev},
        {"name": "D2", "location": "device", "kind": "kv2", "layout": dev},
    ]


def _some_layers(draw, op: dict, layers: int) -> None:
    """Sometimes make a ``write`` one of several layers (``layers``: distinct, in any order: one
    kernel storing its units in each), as the engine's batch KV stores are."""
    if layers > 1 and draw(st.integers(0, 2)) == 0:
        del op["layer"]
        op["layers"] = draw(st.lists(st.integers(0, layers - 1), min_size=2, max_size=layers, unique=True))


#: 1..UNITS distinct unit indices
idx_sets = st.lists(st.integers(0, UNITS - 1), min_size=1, max_size=UNITS, unique=True)


@st.composite
def copy_op(draw, stream):
    """A ``kernel_per_layer`` copy between the :func:`kv_buffers` on ``stream``."""
    src, dst = draw(st.sampled_from([("H", "D"), ("H", "D2"), ("D", "H"), ("D", "D2"), ("D2", "D")]))
    dst_idx = draw(idx_sets)
    src_idx = draw(st.lists(st.integers(0, UNITS - 1), min_size=len(dst_idx), max_size=len(dst_idx)))
    return {"op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": src, "dst": dst,
            "args": {"layer": draw(st.integers(0, LAYERS - 1)), "src_indices": src_idx, "dst_indices": dst_idx}}


@st.composite
def kv_schedules(draw, max_ops: int = 14, synchronised: bool = False):
    """Random valid schedule documents over the :func:`kv_buffers` (one host, streams
    :data:`STREAMS`).  Waits and host syncs only name events recorded earlier.
    ``synchronised``: before each op, its stream waits (record -> wait) on every other stream
    that ran ops it has not yet synchronised with, so no two ops conflict without
    happens-before (every read then sees what the happens-before order gives)."""
    ops, recorded = [], []
    events = list(EVENTS)
    dirty = {s: set() for s in STREAMS}      # streams whose new work s has not waited on
    n = draw(st.integers(1, max_ops))
    for i in range(n):
        stream = draw(st.sampled_from(STREAMS))
        if synchronised:
            for other in sorted(dirty[stream]):
                ev = f"sync{len(events)}"
                events.append(ev)
                ops.append({"id": f"r{i}_{other}", "op": "record", "stream": other, "event": ev})
                ops.append({"id": f"w{i}_{other}", "op": "wait", "stream": stream, "event": ev})
            dirty[stream] = set()
            for other in STREAMS:
                if other != stream:
                    dirty[other].add(stream)
        kinds = ["copy", "read", "write", "compute", "record"] + (["wait", "host_sync"] if recorded else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "copy":
            op = draw(copy_op(stream))
        elif kind in ("read", "write"):
            op = {"op": kind, "stream": stream, "buffer": draw(st.sampled_from(["D", "D2"])),
                  "layer": draw(st.integers(0, LAYERS - 1)), "units": draw(idx_sets)}
            if kind == "write":
                op["owner"] = 100 + i
                _some_layers(draw, op, LAYERS)
        elif kind == "compute":
            op = {"op": "compute", "stream": stream, "duration_us": draw(st.sampled_from([0.0, 0.5, 3.0, 20.0]))}
        elif kind == "record":
            ev = draw(st.sampled_from(EVENTS))
            recorded.append(ev)
            op = {"op": "record", "stream": stream, "event": ev}
        elif kind == "wait":
            op = {"op": "wait", "stream": stream, "event": draw(st.sampled_from(recorded))}
        else:
            op = {"op": "host_sync", "event": draw(st.sampled_from(recorded))}
        op["id"] = f"o{i}"
        ops.append(op)
    return {"kvrace_schedule": 1, "name": "generated", "buffers": kv_buffers(),
            "streams": STREAMS, "events": events, "ops": ops}


# ================================================================ geometry families
#
# Each family is a set of buffers, the device buffers' (layers, units) that reads and writes
# address, and a strategy of copies among them.  Together they use every routine of
# sim.transfers.routines.ROUTINES.

#: the families :func:`schedules` draws from (each schedule uses one)
FAMILIES = ("kv", "index_k", "c4", "page_first")
RICH_UNITS = 4


def _host(name: str, kind: str, unit_bytes: int, units: int, *, layers: int = 1, layout: str = "layer_first",
          owner: int = 1, **extra) -> dict:
    lay = {"kind": "host", "layout": layout, "layers": layers, "units": units, "unit_bytes": unit_bytes, **extra}
    return {"name": name, "location": "host", "kind": kind, "layout": lay,
            "init": [{"layers": "all", "indices": {"start": 0, "count": units}, "owner": owner, "version": 1}]}


@dataclass(frozen=True)
class _Family:
    name: str
    buffers: list
    device: dict          # device buffer -> (layers, units)
    copy: Callable        # stream -> strategy of one copy op


def _pairs_of(draw, n_max: int, top: int, *, unique_dst: bool = True, min_size: int = 1):
    n = draw(st.integers(min_size, n_max))
    dst = draw(st.lists(st.integers(0, top), min_size=n, max_size=n, unique=unique_dst))
    src = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
    return src, dst


def _kv_family(draw) -> _Family:
    ub = draw(st.sampled_from([64, 256, 576, 1024]))
    bufs = kv_buffers(ub)
    for b in bufs:
        if b["location"] == "host":
            b["layout"]["units"] = RICH_UNITS
            b["init"][0]["indices"]["count"] = RICH_UNITS
        else:
            b["layout"]["pages"] = RICH_UNITS
    return _Family("kv", bufs, {"D": (LAYERS, RICH_UNITS), "D2": (LAYERS, RICH_UNITS)}, _kv_copy)


def _index_k_family(draw) -> _Family:
    # a host pool of whole index-K pages with the device page's fields, so both the page routine
    # and the per-token fix (token_bytewise: 128 B key + 4 B scale per token) apply
    fields = [{"name": "key", "offset": 0, "entry_bytes": 128}, {"name": "scale", "offset": 8192, "entry_bytes": 4}]
    bufs = [_host("H", "index_k", 8448, 2, entries_per_unit=64, fields=fields),
            {"name": "D", "location": "device", "kind": "index_k",
             "layout": {"preset": "dsa_index_k", "layers": 1, "pages": 2}},
            {"name": "D2", "location": "device", "kind": "index_k2",
             "layout": {"preset": "dsa_index_k", "layers": 1, "pages": 2}}]
    return _Family("index_k", bufs, {"D": (1, 2), "D2": (1, 2)}, _index_k_copy)


def _c4_family(draw) -> _Family:
    # NOTE: D2 is a 256 B/token bf16 index-K buffer: the fixed-geometry C4 token copy onto it is
    # the incident's wrong-geometry case (it writes past the buffer's end)
    fields = [{"name": "value", "offset": 0, "entry_bytes": 576}, {"name": "scale", "offset": 36864, "entry_bytes": 8}]
    bufs = [_host("H", "c4", 37440, 1, entries_per_unit=64, fields=fields),
            {"name": "D", "location": "device", "kind": "c4",
             "layout": {"preset": "c4_paged", "layers": 1, "pages": 1}},
            {"name": "D2", "location": "device", "kind": "index_k_bf16",
             "layout": {"preset": "bf16_index_k", "layers": 1, "tokens": 64}}]
    return _Family("c4", bufs, {"D": (1, 1), "D2": (1, 64)}, _c4_copy)


def _page_first_family(draw) -> _Family:
    # device token rows; a page_first_direct host pool (direct_page_first, both directions) and
    # a page_first host pool (the staged all-layer write-back); host pages of 4 rows
    ub = draw(st.sampled_from([64, 256]))
    ps, units = _PF_PAGE, _PF_UNITS
    dev = {"kind": "paged", "layers": LAYERS, "pages": units, "page_bytes": ub}
    bufs = [_host("H", "kv", ub, units, layers=LAYERS, layout="page_first_direct", page_size=ps),
            _host("HP", "kv_pf", ub, units, layers=LAYERS, layout="page_first", owner=2),
            {"name": "D", "location": "device", "kind": "kv", "layout": dev}]
    return _Family("page_first", bufs, {"D": (LAYERS, units)}, _page_first_copy)


# the copy strategies of the families (module level: a composite defined per draw costs a compile)
_PF_PAGE, _PF_UNITS = 4, 8


@st.composite
def _kv_copy(draw, stream):
    src, dst = draw(st.sampled_from([("H", "D"), ("H", "D2"), ("D", "H"), ("D", "D2"), ("D2", "D")]))
    routine = draw(st.sampled_from(["kernel_per_layer", "kernel_all_layer", "direct_per_layer",
                                    "token_bytewise"]))
    # index RICH_UNITS (one row past the end) appears now and then: an out-of-bounds copy
    top = RICH_UNITS if routine != "token_bytewise" and draw(st.integers(0, 4)) == 0 else RICH_UNITS - 1
    src_idx, dst_idx = _pairs_of(draw, RICH_UNITS, top)
    args = {"src_indices": src_idx, "dst_indices": dst_idx}
    if routine != "kernel_all_layer":
        args["layer"] = draw(st.integers(0, LAYERS - 1))
    return {"op": "copy", "stream": stream, "routine": routine, "src": src, "dst": dst, "args": args}


@st.composite
def _index_k_copy(draw, stream):
    src, dst = draw(st.sampled_from([("H", "D"), ("H", "D2"), ("D", "H"), ("D", "D2")]))
    if draw(st.booleans()):
        pages = draw(st.lists(st.integers(0, 1), min_size=1, max_size=2, unique=True))
        src_pages = draw(st.lists(st.integers(0, 1), min_size=len(pages), max_size=len(pages)))
        tok = lambda ps: [p * 64 + t for p in ps for t in range(64)]     # noqa: E731
        return {"op": "copy", "stream": stream, "routine": "dsa_indexer_per_layer", "src": src, "dst": dst,
                "args": {"layer": 0, "src_indices": tok(src_pages), "dst_indices": tok(pages)}}
    src_idx, dst_idx = _pairs_of(draw, 6, 127)
    return {"op": "copy", "stream": stream, "routine": "token_bytewise", "src": src, "dst": dst,
            "args": {"layer": 0, "src_indices": src_idx, "dst_indices": dst_idx}}


@st.composite
def _c4_copy(draw, stream):
    routine = draw(st.sampled_from(["dsv4_token", "dsv4_token", "token_bytewise", "kernel_per_layer"]))
    if routine == "kernel_per_layer":       # the whole 37,440 B page as one item
        src, dst = draw(st.sampled_from([("H", "D"), ("D", "H")]))
        return {"op": "copy", "stream": stream, "routine": routine, "src": src, "dst": dst,
                "args": {"layer": 0, "src_indices": [0], "dst_indices": [0]}}
    if routine == "token_bytewise":
        src, dst = draw(st.sampled_from([("H", "D"), ("D", "H")]))
        src_idx, dst_idx = _pairs_of(draw, 8, 63)
        return {"op": "copy", "stream": stream, "routine": routine, "src": src, "dst": dst,
                "args": {"layer": 0, "src_indices": src_idx, "dst_indices": dst_idx}}
    src, dst = draw(st.sampled_from([("H", "D"), ("D", "H"), ("H", "D2"), ("D", "D2")]))
    src_idx, dst_idx = _pairs_of(draw, 8, 63)
    return {"op": "copy", "stream": stream, "routine": "dsv4_token", "src": src, "dst": dst,
            "args": {"src_indices": src_idx, "dst_indices": dst_idx, "layers": [0]}}


@st.composite
def _page_first_copy(draw, stream):
    ps, units = _PF_PAGE, _PF_UNITS
    pages = draw(st.lists(st.integers(0, units // ps - 1), min_size=1, max_size=2, unique=True))
    src_pages = draw(st.lists(st.integers(0, units // ps - 1), min_size=len(pages), max_size=len(pages)))
    tok = lambda pp: [p * ps + t for p in pp for t in range(ps)]     # noqa: E731
    if draw(st.integers(0, 2)) == 0:
        return {"op": "copy", "stream": stream, "routine": "staged_all_layer_lf_pf", "src": "D", "dst": "HP",
                "args": {"src_indices": tok(src_pages), "dst_indices": tok(pages), "page_size": ps}}
    src, dst = draw(st.sampled_from([("H", "D"), ("D", "H")]))
    return {"op": "copy", "stream": stream, "routine": "direct_page_first", "src": src, "dst": dst,
            "args": {"layer": draw(st.integers(0, LAYERS - 1)), "src_indices": tok(src_pages),
                     "dst_indices": tok(pages), "page_size": ps}}


_FAMILY = {"kv": _kv_family, "index_k": _index_k_family, "c4": _c4_family, "page_first": _page_first_family}


def _check_families(families: Sequence[str]) -> tuple[str, ...]:
    fams = tuple(families)
    if not fams or any(f not in _FAMILY for f in fams):
        raise InputError("families", f"expected a non-empty list of {list(FAMILIES)}, got {show(fams)}")
    return fams


# ================================================================ schedules


@dataclass
class _Hosts:
    """Who may name what in a several-host static schedule.

    A static schedule's list is its issue order, but each host's program issues its own ops as
    its time allows, so another host's record or stream op may not be issued yet at run time
    when an op bound to it is.  Generated schedules stay inside what the list order guarantees:
    each stream and each event belongs to one host; a host names another host's event or stream
    only when that host issued the bound op before the latest barrier (every barrier joins all
    hosts, so everything before it is issued when anyone passes it)."""

    names: list
    stream_host: dict
    event_host: dict
    epoch: int = 0                                       # barriers so far
    record_epoch: dict = field(default_factory=dict)     # event -> epoch of its latest record
    stream_epoch: dict = field(default_factory=dict)     # stream -> epoch of its latest op

    def visible_event(self, ev: str, host: str) -> bool:
        return ev in self.record_epoch and (self.event_host[ev] == host or self.record_epoch[ev] < self.epoch)

    def visible_stream(self, stream: str, host: str) -> bool:
        return (self.stream_host[stream] == host or stream not in self.stream_epoch
                or self.stream_epoch[stream] < self.epoch)


@st.composite
def schedules(draw, max_ops: int = 12, *, families: Sequence[str] = FAMILIES, max_hosts: int = 3,
              host_ops: bool = True):
    """Random valid schedule documents (format 2), each over one geometry family of
    :data:`FAMILIES`:

    * ``kv``: KV rows of 64, 256, 576 or 1,024 B (256 B and more span whole 256 B chunks, so a
      read can land mid-item and be torn), copied by ``kernel_per_layer``, ``kernel_all_layer``,
      ``direct_per_layer`` (byte-granular memcpy runs) and ``token_bytewise``; indices may name
      a row past the end (an out-of-bounds copy, reported and clipped);
    * ``index_k``: DSA index-K, 2 pages of 8,448 B (preset ``dsa_index_k``) and a host pool of
      whole pages with the same fields, by ``dsa_indexer_per_layer`` (64 token indices per page)
      and ``token_bytewise`` (132 B per token in two extents);
    * ``c4``: a DeepSeek V4 C4 page (37,440 B, preset ``c4_paged``) and a 256 B/token
      ``bf16_index_k`` buffer, by ``dsv4_token`` (fixed C4 geometry: onto the bf16 buffer it
      writes past the end), ``token_bytewise`` and ``kernel_per_layer`` (one 37,440 B item);
    * ``page_first``: device rows with a ``page_first_direct`` host pool (``direct_page_first``
      both ways) and a ``page_first`` host pool (``staged_all_layer_lf_pf`` write-back).

    Ops: copies, reads (units or tokens), writes, computes, records, waits; with ``host_ops``,
    ``host_sync`` of all three kinds (event, stream, device) and ``host_delay``; with
    ``max_hosts`` > 1, up to that many hosts, each owning its streams and events, joined by
    barriers (see :class:`_Hosts` for what one host may name of another's).  Every schedule is
    valid: ``sim.schedule.validate`` accepts it and it runs to the end."""
    fams = _check_families(families)
    fam = _FAMILY[draw(st.sampled_from(fams))](draw)
    n_hosts = draw(st.integers(1, max(1, max_hosts)))
    names = ["host"] if n_hosts == 1 else [f"h{k}" for k in range(n_hosts)]
    hs = _Hosts(names, {s: names[k % n_hosts] for k, s in enumerate(STREAMS)},
                {e: names[k % n_hosts] for k, e in enumerate(EVENTS)})
    ops: list[dict] = []
    n = draw(st.integers(1, max_ops))
    for i in range(n):
        host = draw(st.sampled_from(names))
        own_streams = [s for s in STREAMS if hs.stream_host[s] == host]
        stream = draw(st.sampled_from(own_streams)) if own_streams else None
        waitable = [e for e in EVENTS if hs.visible_event(e, host)]
        kinds = ["copy", "copy", "read", "write", "compute", "record"] if stream else []
        if stream and waitable:
            kinds.append("wait")
        if host_ops:
            kinds += ["host_sync", "host_delay"]
        if n_hosts > 1:
            kinds.append("barrier")
        kind = draw(st.sampled_from(kinds))
        if kind == "barrier":
            hs.epoch += 1
            for h in names:
                ops.append({"id": f"o{i}.{h}", "op": "barrier", "barrier": f"b{i}", "hosts": names, "host": h})
            continue
        if kind == "copy":
            op = draw(fam.copy(stream))
        elif kind in ("read", "write"):
            buf = draw(st.sampled_from(sorted(fam.device)))
            layers, units = fam.device[buf]
            op = {"op": kind, "stream": stream, "buffer": buf, "layer": draw(st.integers(0, layers - 1))}
            spec = next(b for b in fam.buffers if b["name"] == buf)
            per_page = spec["layout"].get("preset") in ("dsa_index_k", "c4_paged")
            if kind == "read" and per_page and draw(st.booleans()):
                op["tokens"] = draw(st.lists(st.integers(0, units * 64 - 1), min_size=1, max_size=6, unique=True))
            else:
                op["units"] = draw(st.lists(st.integers(0, units - 1), min_size=1, max_size=min(units, 4),
                                            unique=True))
            if kind == "write":
                op["owner"] = 100 + i
                _some_layers(draw, op, layers)
        elif kind == "compute":
            op = {"op": "compute", "stream": stream, "duration_us": draw(st.sampled_from([0.0, 0.5, 3.0, 20.0]))}
        elif kind == "record":
            ev = draw(st.sampled_from([e for e in EVENTS if hs.event_host[e] == host] or EVENTS))
            if hs.event_host[ev] != host:      # a host with no event of its own records none
                op = {"op": "compute", "stream": stream, "duration_us": 0.5}
            else:
                hs.record_epoch[ev] = hs.epoch
                op = {"op": "record", "stream": stream, "event": ev}
        elif kind == "wait":
            op = {"op": "wait", "stream": stream, "event": draw(st.sampled_from(waitable))}
        elif kind == "host_sync":
            streams_ok = [s for s in STREAMS if hs.visible_stream(s, host)]
            targets = (["event"] if waitable else []) + ["stream"] * bool(streams_ok) + \
                ["device"] * (len(streams_ok) == len(STREAMS))
            target = draw(st.sampled_from(targets)) if targets else None
            if target is None:
                op = {"op": "host_delay", "duration_us": 0.5}
            else:
                op = {"op": "host_sync"}
                if target == "event":
                    op["event"] = draw(st.sampled_from(waitable))
                elif target == "stream":
                    op["stream"] = draw(st.sampled_from(streams_ok))
        else:
            op = {"op": "host_delay", "duration_us": draw(st.sampled_from([0.5, 5.0, 30.0]))}
        op["id"] = f"o{i}"
        op["host"] = host
        if op.get("stream") is not None and op["op"] != "host_sync":
            hs.stream_epoch[op["stream"]] = hs.epoch
        ops.append(op)
    return {"kvrace_schedule": 2, "name": f"generated_{fam.name}", "hosts": names, "buffers": fam.buffers,
            "streams": STREAMS, "events": list(EVENTS), "ops": ops}


def rich_schedules(max_ops: int = 12):
    """:func:`schedules` over the ``kv``, ``index_k`` and ``c4`` families, one host."""
    return schedules(max_ops, families=("kv", "kv", "index_k", "c4"), max_hosts=1)
