"""Hypothesis strategies and assertions for testing schedules, gate maps and fixes.

Needs Hypothesis, which is in the test extra: ``pip install 'kvrace[test]'``.  ``import sim`` never
imports this module (``sim`` itself needs only numpy, simpy and networkx); import it by name::

    from sim.testing import (assert_no_corrupt_read, interleavings, load_forward_programs,
                             schedules)

What it offers (``docs/testing.md`` has a worked pytest example):

* :func:`schedules`: random valid schedules over one geometry family each (:data:`FAMILIES`):
  KV rows of 64 to 1,024 B, DSA index-K pages (8,448 B), DeepSeek V4 C4 pages (37,440 B) and bf16
  index-K rows (256 B), and page-first host pools, copied by every routine of
  :data:`sim.transfers.routines.ROUTINES`; host syncs of every kind (event, stream, device), host
  delays, and several hosts with barriers.
* :func:`load_forward_programs`: engine-like host programs (:class:`LoadForward`): batches of
  concurrent requests whose prefixes are loaded back layer by layer on a load stream (every
  pool's copy of layer ``L``, then that layer's event), while the forward stream runs the DSA
  model's per-layer reads through :func:`sim.engine.forward.issue_forward`, each reader waiting
  or not as the gate map says.
* :func:`interleavings`: for one schedule, an :class:`Interleaving` (same-instant tie order,
  per-op delays, the run's seed, torn or item-atomic landing), all drawn by Hypothesis, so a
  test that draws a schedule and then its interleaving (:func:`schedules_with_interleavings`,
  or ``st.data()``) has Hypothesis shrink both together.
* :func:`assert_no_corrupt_read`: runs a schedule under an interleaving and raises an
  ``AssertionError`` naming each corrupt read and its bytes; the failing example is written out
  (:func:`write_failure`) as a schedule file that ``kvrace schedule run`` reproduces and its
  forced order (``sim.replay.controlled_schedule``'s race-free document) that
  ``kvrace replay --mode controlled`` replays on a GPU.

The smaller strategies the project's own tests have always used live here too:
:func:`kv_schedules` (one 64 B KV geometry, optionally race-free) and :func:`rich_schedules`
(:func:`schedules` over the kv, index-K and C4 families on one host).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from hypothesis import strategies as st

from sim.errors import InputError, show

__all__ = ["EVENTS", "FAMILIES", "FAILURES_ENV", "Interleaving", "LAYERS", "LoadForward", "STREAMS",
           "UNITS", "UNIT_BYTES", "apply_interleaving", "assert_no_corrupt_read", "copy_op", "corrupt_reads",
           "failure_dir", "idx_sets", "interleavings", "kv_buffers", "kv_schedules", "load_forward_programs",
           "rich_schedules", "run_interleaving", "schedules", "schedules_with_interleavings", "write_failure"]

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


# ================================================================ engine-like load/forward programs

#: model family the load/forward programs use (its pools: ``latent`` token rows, ``index_k`` pages)
_LF_MODEL = "dsa-v3.2"
_LF_PAGE = 64


@dataclass(frozen=True)
class LoadForward:
    """One engine-like program: batches of requests whose cached prefixes come back from the
    host pools while the forward pass reads them.

    For batch ``k`` (``docs/testing.md`` has the picture), the scheduler host issues, as
    SGLang's ``start_loading`` and model runner do:

    1. ``record start{k}`` on the forward stream and, when ``load_fence``, ``wait start{k}`` on
       the load stream (the load queues behind the forward work already issued);
    2. per layer ``L``, every pool's copy of the batch's loaded pages (``kernel_per_layer`` for
       the latent rows, ``dsa_indexer_per_layer`` for the index-K pages), then
       ``record b{k}.L{L}`` on the load stream;
    3. the new tokens' KV written on the forward stream (``write``; no wait, slots no load
       touches);
    4. :func:`sim.engine.forward.issue_forward`: per layer, per step of the DSA model, a wait on
       ``b{k}.L{L}`` before the first reader the gate map gates (when the batch loaded
       anything), then the reads of exactly the bytes that reader's kernel reads.

    ``requests``: per request ``(rid, batch, loaded_pages, resident_pages, new_tokens)``;
    ``header``: buffers, streams and events; ``programs``: ``{"scheduler": program}``.  The
    programs never branch on timing, so :meth:`schedule` (the recorded run) is the same program
    whatever the interleaving: draw interleavings over it."""

    header: dict = field(repr=False)
    programs: Mapping[str, Callable] = field(repr=False)
    gate_map: Any = field(repr=False)
    layers: int = 1
    requests: tuple = ()
    options: Mapping[str, str] = field(default_factory=dict)
    load_fence: bool = True

    def __repr__(self) -> str:       # what Hypothesis prints for a falsifying example
        return (f"LoadForward(gate_map={self.gate_map.name!r}, layers={self.layers}, requests={self.requests}, "
                f"options={dict(self.options)}, load_fence={self.load_fence})")

    def run(self, profile: str = "h200", **kw):
        """Run the host programs (``sim.executor.run_programs``; keywords as there)."""
        from sim.executor import run_programs
        from sim.profile import load_profile

        prof = load_profile(profile) if isinstance(profile, str) else profile
        return run_programs(self.header, dict(self.programs), prof, **kw)

    def schedule(self, profile: str = "h200") -> dict:
        """The recorded run as a schedule document (format 2)."""
        doc = self.run(profile, materialise=False).recorded
        doc["name"] = f"load_forward_{self.gate_map.name}"
        doc["description"] = (f"Generated by sim.testing.load_forward_programs: {self.layers} layer(s), "
                              f"{len(self.requests)} request(s), gate map {self.gate_map.name}, "
                              f"options {dict(self.options)}, load fenced: {self.load_fence}.")
        return doc


def _gate_map_of(g):
    from sim.engine.gates import GateMap, gate_map

    return g if isinstance(g, GateMap) else gate_map(g)


@st.composite
def load_forward_programs(draw, *, gate_maps: Sequence = ("upstream-0.5.10", "upstream-0.5.11"),
                          max_layers: int = 3, max_requests: int = 3, max_batches: int = 2,
                          options: Mapping[str, str] | None = None, load_fence: bool = True,
                          profile: str = "h200"):
    """Engine-like :class:`LoadForward` programs over the DSA model (latent token rows of
    656 B, index-K pages of 8,448 B with 64 tokens a page).

    Drawn: the gate map (from ``gate_maps``: names of shipped maps or ``GateMap`` objects),
    1..``max_layers`` layers, 1..``max_batches`` batches of 1..``max_requests`` concurrent
    requests, each with 0..2 pages loaded back from the host, 0..1 pages already resident on the
    device and 1..64 new tokens, placed on distinct device pages (page 0 is padding) and host
    pages; the model options (``index_k_store``, ``indexer_path``) unless ``options`` fixes
    them.  ``load_fence=False`` drops the load stream's wait on the forward stream's start
    event (SGLang #36738's unfenced load)."""
    from sim.engine.cost import CostModel
    from sim.engine.engine import reduced_model
    from sim.engine.forward import BatchRequest, ForwardBatch, issue_forward
    from sim.engine.models import MODEL_OPTIONS, model
    from sim.profile import load_profile

    maps = [_gate_map_of(g) for g in gate_maps]
    if not maps:
        raise InputError("gate_maps", "expected at least one gate map")
    gm = draw(st.sampled_from(maps))
    layers = draw(st.integers(1, max(1, max_layers)))
    fam = reduced_model(model(_LF_MODEL), layers)
    if options is None:
        opts = {"index_k_store": draw(st.sampled_from(MODEL_OPTIONS["index_k_store"][0])),
                "indexer_path": draw(st.sampled_from(MODEL_OPTIONS["indexer_path"][0]))}
    else:
        opts = dict(options)
    n_batches = draw(st.integers(1, max(1, max_batches)))
    reqs = []          # (rid, batch, loaded, resident, new_tokens)
    for b in range(n_batches):
        for _ in range(draw(st.integers(1, max(1, max_requests)))):
            reqs.append((len(reqs), b, draw(st.integers(0, 2)), draw(st.integers(0, 1)), draw(st.integers(1, 64))))
    dev_pages_needed = sum(lp + rp + 1 for _, _, lp, rp, _ in reqs)
    dev_pages = dev_pages_needed + 1 + draw(st.integers(0, 2))
    host_pages = max(1, sum(lp for _, _, lp, _, _ in reqs))
    # distinct device pages (1..; 0 is padding) and host pages per request, each drawn from the
    # pages still free (an index into the free list: it shrinks toward the lowest pages)
    dev_free, host_free = list(range(1, dev_pages)), list(range(host_pages))

    def take(free: list, n: int) -> list:
        return [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(n)]

    placed = []
    for rid, b, lp, rp, n_new in reqs:
        resident, loaded, new = take(dev_free, rp), take(dev_free, lp), take(dev_free, 1)[0]
        placed.append((rid, b, resident, loaded, take(host_free, lp), new, n_new))

    pools = fam.pools_for(opts)
    lat_lay = pools["latent"].layout(dev_pages * _LF_PAGE)
    ik_lay = pools["index_k"].layout(dev_pages)
    toks = lambda pages: [p * _LF_PAGE + t for p in pages for t in range(_LF_PAGE)]   # noqa: E731
    lat_dev_init, ik_dev_init, lat_host_init, ik_host_init = [], [], [], []
    for rid, b, resident, loaded, hpages, new, n_new in placed:
        if resident:
            lat_dev_init.append({"layers": "all", "indices": toks(resident), "owner": rid, "version": 1})
            ik_dev_init.append({"layers": "all", "indices": resident, "owner": rid, "version": 1})
        if hpages:
            lat_host_init.append({"layers": "all", "indices": toks(hpages), "owner": rid, "version": 1})
            ik_host_init.append({"layers": "all", "indices": hpages, "owner": rid, "version": 1})
    buffers = [
        {"name": "kv_buffer", "location": "device", "kind": "kv",
         "layout": {"kind": "paged", "layers": layers, "pages": lat_lay.pages, "page_bytes": lat_lay.page_bytes},
         "init": lat_dev_init},
        {"name": "index_k_with_scale_buffer", "location": "device", "kind": "index_k",
         "layout": {"preset": "dsa_index_k", "layers": layers, "pages": dev_pages}, "init": ik_dev_init},
        {"name": "host_kv_buffer", "location": "host", "kind": "kv",
         "layout": {"kind": "host", "layout": "layer_first", "layers": layers, "units": host_pages * _LF_PAGE,
                    "unit_bytes": lat_lay.page_bytes}, "init": lat_host_init},
        {"name": "host_index_k_buffer", "location": "host", "kind": "index_k",
         "layout": {"kind": "host", "layout": "layer_first", "layers": layers, "units": host_pages,
                    "unit_bytes": ik_lay.page_bytes}, "init": ik_host_init},
    ]
    events = [f"start{b}" for b in range(n_batches)] + \
        [f"b{b}.L{L}" for b in range(n_batches) for L in range(layers)]
    header = {"kvrace_schedule": 2, "name": "load_forward", "hosts": ["scheduler"], "buffers": buffers,
              "streams": ["forward", "load"], "events": events}
    from sim.pools.layouts import layout_from_json

    roles = {"latent": ("kv_buffer", layout_from_json(buffers[0]["layout"], "kv_buffer")),
             "index_k": ("index_k_with_scale_buffer", ik_lay)}
    cost = CostModel.from_profile(load_profile(profile), 0)

    def scheduler(h):
        for b in range(n_batches):
            batch = [p for p in placed if p[1] == b]
            h.issue({"op": "record", "stream": "forward", "event": f"start{b}", "id": f"b{b}.start"})
            loads = [(rid, loaded, hpages) for rid, _, _, loaded, hpages, _, _ in batch if loaded]
            if loads:
                if load_fence:
                    h.issue({"op": "wait", "stream": "load", "event": f"start{b}", "id": f"b{b}.fence"})
                src_p = [p for _, _, hp in loads for p in hp]
                dst_p = [p for _, lp, _ in loads for p in lp]
                for L in range(layers):
                    h.issue({"op": "copy", "stream": "load", "routine": "kernel_per_layer", "src": "host_kv_buffer",
                             "dst": "kv_buffer", "id": f"b{b}.load.L{L}.latent",
                             "args": {"layer": L, "src_indices": toks(src_p), "dst_indices": toks(dst_p)}})
                    h.issue({"op": "copy", "stream": "load", "routine": "dsa_indexer_per_layer",
                             "src": "host_index_k_buffer", "dst": "index_k_with_scale_buffer",
                             "id": f"b{b}.load.L{L}.index_k",
                             "args": {"layer": L, "src_indices": toks(src_p), "dst_indices": toks(dst_p)}})
                    h.issue({"op": "record", "stream": "load", "event": f"b{b}.L{L}", "id": f"b{b}.L{L}.loaded"})
            for rid, _, _, _, _, new, n_new in batch:       # the new tokens' KV, stored by the forward
                for L in range(layers):
                    h.issue({"op": "write", "stream": "forward", "buffer": "kv_buffer", "layer": L,
                             "id": f"r{rid}.store.L{L}.latent", "units": [new * _LF_PAGE + t for t in range(n_new)],
                             "owner": rid, "version": 2})
                    h.issue({"op": "write", "stream": "forward", "buffer": "index_k_with_scale_buffer", "layer": L,
                             "id": f"r{rid}.store.L{L}.index_k", "units": [new], "owner": rid, "version": 2})
            brs = []
            for rid, _, resident, loaded, _, new, n_new in batch:
                slots = np.asarray(toks(resident + loaded) + [new * _LF_PAGE + t for t in range(n_new)], np.int64)
                brs.append(BatchRequest(rid, {"latent": slots, "index_k": slots}, n_new, len(slots)))
            fb = ForwardBatch("extend", tuple(brs), b if loads else -1)
            issue_forward(h, "forward", fb, model=fam, gate_map=gm, buffers=roles, cost=cost,
                          layer_events=[f"b{b}.L{L}" for L in range(layers)], options=opts, tag=f"fwd{b}",
                          key=(b,))
        return
        yield     # a host program is a generator

    return LoadForward(header, {"scheduler": scheduler}, gm, layers,
                       tuple((rid, b, len(lp), len(rp), n) for rid, b, rp, lp, _, _, n in placed), opts, load_fence)


# ================================================================ interleavings


@dataclass(frozen=True)
class Interleaving:
    """How one run of a schedule interleaves, beyond the schedule itself.

    * ``first``: op ids that go first, in this order, whenever ops become ready at the same
      simulated instant (``TieBreak("explicit", first=...)``; empty: issue order, ``fifo``);
    * ``delays``: ``(op id, us)`` pairs: a ``compute`` of ``us`` microseconds on the op's stream
      right before it (:func:`apply_interleaving`), which holds the op back against the other
      streams without changing happens-before (compute ops touch no bytes, and stream order is
      already transitive);
    * ``seed``: the run's seed (compute jitter, launch skew);
    * ``item_atomic``: copy items land whole (``torn=False``: what a controlled GPU replay can
      force) instead of a read seeing an in-flight item's landed prefix.

    ``kvrace schedule run FILE --seed SEED [--first A,B] [--item-atomic]`` on the document
    :func:`apply_interleaving` returns runs exactly this interleaving (:meth:`cli_args`)."""

    first: tuple[str, ...] = ()
    delays: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    item_atomic: bool = False

    def cli_args(self) -> list[str]:
        """The ``kvrace schedule run`` options that select this interleaving."""
        args = ["--seed", str(self.seed)]
        if self.first:
            args += ["--first", ",".join(self.first)]
        if self.item_atomic:
            args.append("--item-atomic")
        return args

    def to_json(self) -> dict:
        return {"first": list(self.first), "delays": [[k, v] for k, v in self.delays], "seed": self.seed,
                "item_atomic": self.item_atomic}

    def describe(self) -> str:
        ties = f"first {', '.join(self.first)}" if self.first else "fifo"
        delays = ", ".join(f"{k} +{v:g} us" for k, v in self.delays) or "none"
        return (f"seed {self.seed}, ties {ties}, delays {delays}, "
                f"{'item-atomic' if self.item_atomic else 'torn items'}")


#: stream ops an interleaving may order at ties (the executor's same-instant gate takes these)
_GATED = ("copy", "read", "write")
#: stream ops an interleaving may delay
_DELAYABLE = ("copy", "read", "write", "record")


def _doc_of(schedule) -> dict:
    from sim.schedule import Schedule, load

    if isinstance(schedule, Schedule):
        return schedule.to_json()
    if isinstance(schedule, (str, os.PathLike)):
        return load(str(schedule)).to_json()
    if isinstance(schedule, Mapping):
        return dict(schedule)
    raise InputError("schedule", f"expected a Schedule, a schedule document or a file path, got "
                     f"{type(schedule).__name__}")


def _schedule_of(schedule):
    from sim.schedule import Schedule, validate

    return schedule if isinstance(schedule, Schedule) else validate(_doc_of(schedule))


@st.composite
def interleavings(draw, schedule, *, max_delay_us: float = 50.0, max_delays: int = 4,
                  item_atomic: bool | None = None):
    """An :class:`Interleaving` of ``schedule`` (a ``Schedule``, a document or a path): a tie
    order over its copies, reads and writes, up to ``max_delays`` delays of at most
    ``max_delay_us`` before its copies, reads, writes and records, a seed, and torn or
    item-atomic landing (``item_atomic``: fixed, or ``None`` to draw it).  Everything shrinks
    toward the plain run: no tie order (fifo), no delay, seed 0, torn items."""
    s = _schedule_of(schedule)
    gated = [op.id for op in s.ops if op.op in _GATED]
    delayable = [op.id for op in s.ops if op.op in _DELAYABLE]
    first = tuple(draw(st.lists(st.sampled_from(gated), unique=True, max_size=len(gated)))) if gated else ()
    delays: tuple = ()
    if delayable and max_delays > 0:
        pairs = draw(st.lists(st.tuples(st.sampled_from(delayable),
                                        st.floats(0.0, max_delay_us, allow_nan=False, allow_infinity=False)),
                              unique_by=lambda p: p[0], max_size=max_delays))
        order = {k: i for i, k in enumerate(delayable)}
        delays = tuple(sorted(((k, float(v)) for k, v in pairs if v > 0), key=lambda p: order[p[0]]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    atomic = draw(st.booleans()) if item_atomic is None else bool(item_atomic)
    return Interleaving(first, delays, seed, atomic)


@st.composite
def schedules_with_interleavings(draw, schedule_strategy=None, **interleaving_kw):
    """``(schedule document, Interleaving)`` pairs: a schedule from ``schedule_strategy``
    (default :func:`schedules`; one drawing :class:`LoadForward` programs is recorded first)
    and an interleaving of it, in one draw, so Hypothesis shrinks them together."""
    doc = draw(schedules() if schedule_strategy is None else schedule_strategy)
    if isinstance(doc, LoadForward):
        doc = doc.schedule()
    return doc, draw(interleavings(doc, **interleaving_kw))


def apply_interleaving(schedule, interleaving: Interleaving | None = None) -> dict:
    """The schedule document with the interleaving's delays as ``compute`` ops (id
    ``delay.OP``, on OP's stream and host, right before OP).  Refuses op ids the schedule does
    not have."""
    doc = _doc_of(schedule)
    il = interleaving or Interleaving()
    ops = list(doc.get("ops", []))
    ids = {o.get("id") for o in ops}
    for k in il.first:
        if k not in ids:
            raise InputError("interleaving.first", f"unknown op id {show(k)} in schedule {doc.get('name')!r}")
    if not il.delays:
        return doc
    delay = {}
    for k, us in il.delays:
        if k not in ids:
            raise InputError("interleaving.delays", f"unknown op id {show(k)} in schedule {doc.get('name')!r}")
        if not (isinstance(us, (int, float)) and 0 <= us <= 1e9):
            raise InputError(f"interleaving.delays.{k}", f"expected 0..1e9 us, got {show(us)}")
        delay[k] = float(us)
    out = []
    for o in ops:
        us = delay.get(o.get("id"))
        if us:
            if o.get("stream") is None:
                raise InputError(f"interleaving.delays.{o['id']}", "expected a stream op (a delay is a compute "
                                 "on its stream)")
            name = f"delay.{o['id']}"
            while name in ids:
                name += "'"
            ids.add(name)
            d = {"id": name, "op": "compute", "stream": o["stream"], "duration_us": us,
                 "note": f"interleaving delay before {o['id']}"}
            if "host" in o:
                d["host"] = o["host"]
            out.append(d)
        out.append(o)
    doc = dict(doc)
    doc["ops"] = out
    if isinstance(doc.get("kvrace_schedule"), int) and doc["kvrace_schedule"] < 2 and "hosts" not in doc:
        doc["kvrace_schedule"] = 1
    return doc


def run_interleaving(schedule, interleaving: Interleaving | None = None, *, profile="h200",
                     materialise: bool = True):
    """Run ``schedule`` under ``interleaving``: ``(Schedule with the delays, RunResult)``;
    ``materialise=False`` keeps provenance only (verdicts compare provenance, so they agree)."""
    from sim.executor import TieBreak, run_schedule
    from sim.profile import Profile, load_profile
    from sim.schedule import validate

    il = interleaving or Interleaving()
    s = validate(apply_interleaving(schedule, il))
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    ties = TieBreak("explicit" if il.first else "fifo", seed=il.seed, first=tuple(il.first))
    return s, run_schedule(s, prof, seed=il.seed, ties=ties, torn=not il.item_atomic, materialise=materialise)


# ================================================================ the assertion

#: environment variable naming the directory failing examples are written to
FAILURES_ENV = "KVRACE_FAILURES"
DEFAULT_FAILURES = ".kvrace-failures"


def failure_dir(out_dir=None) -> Path:
    """Where failing examples go: ``out_dir``, else ``$KVRACE_FAILURES``, else
    ``.kvrace-failures/`` (relative to the working directory)."""
    return Path(out_dir or os.environ.get(FAILURES_ENV) or DEFAULT_FAILURES)


def corrupt_reads(report: dict) -> list[dict]:
    """The ``stale`` and ``torn`` read entries of a ``sim.verdicts.analyse`` report."""
    return [r for r in report["reads"] if r["status"] in ("stale", "torn")]


def _read_text(r: dict) -> str:
    fm = r.get("first_mismatch") or {}
    pos = fm.get("position") or {}
    where = ", ".join(f"{k} {v}" for k, v in pos.items() if k in ("layer", "unit", "page", "field", "entry",
                                                                   "token", "row"))
    return (f"read {r['op']} on {r['stream']} at {r['time_us']:.3f} us: {r['buffer']} {r['nbytes']} B -> "
            f"{r['status'].upper()}, {r['bytes_differing']} bytes differ from the happens-before order, first at "
            f"offset {fm.get('offset')}{f' ({where})' if where else ''}\n"
            f"    saw:      {fm.get('observed')}\n    expected: {fm.get('expected')}")


def _in_final_hypothesis_run() -> bool:
    """True outside Hypothesis and in the run Hypothesis reports at the end (the shrunk
    example); False while it is still searching or shrinking."""
    try:
        from hypothesis.control import current_build_context, currently_in_test_context
    except ImportError:          # pragma: no cover - an old Hypothesis
        return True
    if not currently_in_test_context():
        return True
    return bool(getattr(current_build_context(), "is_final", True))


def write_failure(s, il: Interleaving, report: dict, out_dir=None, *, profile="h200") -> dict:
    """Write a failing example into :func:`failure_dir` and return what was written.

    Files, named ``NAME-DIGEST`` (``DIGEST``: 12 hex digits of the schedule and interleaving):

    * ``NAME-DIGEST.json``: the schedule with the interleaving's delays (format 2);
      ``kvrace schedule run NAME-DIGEST.json`` plus the interleaving's options
      (:meth:`Interleaving.cli_args`) reproduces the corrupt reads;
    * ``NAME-DIGEST.forced.json``: the forced order, ``sim.replay.controlled_schedule`` of the
      item-atomic run under the same interleaving (the race-free schedule controlled replay
      makes; ``kvrace replay NAME-DIGEST.forced.json --mode controlled`` runs it on a GPU and
      must see the same bytes).  Written only when that item-atomic run has a corrupt read too
      (a torn read cannot be forced: items land whole on a controlled replay) and streams and
      events can force it;
    * ``NAME-DIGEST.failure.json``: the interleaving, the commands, each corrupt read (op,
      status, bytes, provenance digest, first mismatch) and why a forced order is missing."""
    from sim.replay import ReplayError, controlled_schedule
    from sim.verdicts import analyse

    doc = s.to_json()
    key = hashlib.sha256(json.dumps([s.digest(), il.to_json()], sort_keys=True).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in s.name)[:80] or "schedule"
    d = failure_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    stem = d / f"{name}-{key}"
    sched_path, forced_path, record_path = (Path(f"{stem}{ext}") for ext in (".json", ".forced.json", ".failure.json"))
    doc["description"] = (f"{doc.get('description', '')} Failing example written by sim.testing: run "
                          f"`kvrace schedule run {sched_path.name} {' '.join(il.cli_args())}`.").strip()
    sched_path.write_text(json.dumps(doc, indent=1) + "\n")
    forced, why = None, None
    _, atomic = run_interleaving(doc, Interleaving(il.first, (), il.seed, True), profile=profile)
    atomic_bad = corrupt_reads(analyse(atomic))
    if not atomic_bad:
        why = ("the same interleaving with items landing whole has no corrupt read (the read caught a copy "
               "mid-item, which a controlled replay cannot force)")
    else:
        try:
            forced = controlled_schedule(atomic.schedule, atomic)
        except ReplayError as e:
            why = f"streams and events cannot force it: {e}"
    if forced is not None:
        forced["description"] = (f"Forced order of {sched_path.name} under {il.describe()} with items landing "
                                 "whole: the reads see the corrupt bytes in happens-before order. "
                                 f"`kvrace replay {forced_path.name} --mode controlled` runs it on a GPU.")
        forced_path.write_text(json.dumps(forced, indent=1) + "\n")
    bad = corrupt_reads(report)
    record = {
        "kvrace_failure": 1,
        "schedule": sched_path.name,
        "forced": forced_path.name if forced is not None else None,
        "forced_missing_because": why,
        "interleaving": il.to_json(),
        "profile": profile if isinstance(profile, str) else profile.name,
        "schedule_run": ["kvrace", "schedule", "run", sched_path.name, *il.cli_args(), "--profile",
                         profile if isinstance(profile, str) else profile.name],
        "replay": (["kvrace", "replay", forced_path.name, "--mode", "controlled"] if forced is not None else None),
        "corrupt_reads": [{k: r.get(k) for k in ("op", "stream", "buffer", "status", "nbytes", "bytes_differing",
                                                 "provenance_sha256", "expected_provenance_sha256",
                                                 "first_mismatch")} for r in bad],
        "forced_reads": [{"op": r["op"], "status": r["status"], "provenance_sha256": r["provenance_sha256"]}
                         for r in atomic_bad] if forced is not None else [],
    }
    record_path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return {"schedule": sched_path, "forced": forced_path if forced is not None else None, "record": record_path,
            "forced_missing_because": why}


def assert_no_corrupt_read(schedule, interleaving: Interleaving | None = None, *, profile="h200",
                           out_dir=None) -> dict:
    """Run ``schedule`` (a ``Schedule``, a document or a path) under ``interleaving``
    (default: fifo ties, seed 0, no delays, torn items) and raise ``AssertionError`` if a read
    is corrupt (``stale`` or ``torn``: its bytes differ from the happens-before order's).

    The message names every corrupt read (op, stream, buffer, bytes differing, the first
    differing byte's position, whose bytes it saw and whose it should have seen), the
    interleaving, and the files :func:`write_failure` wrote with the commands that reproduce
    them.  Under Hypothesis the files are written only for the example it reports (the shrunk
    one), not for every example it tries on the way.  Returns the run's report otherwise."""
    from sim.verdicts import analyse

    il = interleaving or Interleaving()
    s, run = run_interleaving(schedule, il, profile=profile, materialise=False)
    rep = analyse(run)
    bad = corrupt_reads(rep)
    if not bad:
        return rep
    lines = [f"{len(bad)} corrupt read{'s' if len(bad) != 1 else ''} in schedule {s.name} under {il.describe()}:"]
    lines += ["  " + _read_text(r) for r in bad[:4]]
    if len(bad) > 4:
        lines.append(f"  ... and {len(bad) - 4} more")
    if _in_final_hypothesis_run():
        files = write_failure(s, il, rep, out_dir, profile=profile)
        p = profile if isinstance(profile, str) else profile.name
        lines.append(f"written: {files['schedule']}")
        lines.append(f"  reproduce: kvrace schedule run {files['schedule']} {' '.join(il.cli_args())} --profile {p}")
        if files["forced"] is not None:
            lines.append(f"  forced order: {files['forced']}")
            lines.append(f"  replay on a GPU: kvrace replay {files['forced']} --mode controlled")
        else:
            lines.append(f"  no forced order: {files['forced_missing_because']}")
        lines.append(f"  record: {files['record']}")
    raise AssertionError("\n".join(lines))
