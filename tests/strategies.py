"""Hypothesis strategies for random schedules (shared by the simulator and GPU tests).

Small geometry so that every interleaving is cheap: one host buffer and two
device buffers of 2 layers x 8 units of 64 B, three streams, four events.
Every generated schedule is valid: waits and host_syncs only name events
recorded earlier.
"""
from __future__ import annotations

from hypothesis import strategies as st

UNITS, UNIT_BYTES, LAYERS = 8, 64, 2
STREAMS = ["s0", "s1", "s2"]
EVENTS = ["e0", "e1", "e2", "e3"]


def base_buffers(unit_bytes: int = UNIT_BYTES) -> list[dict]:
    host = {"kind": "host", "layout": "layer_first", "layers": LAYERS, "units": UNITS, "unit_bytes": unit_bytes}
    dev = {"kind": "paged", "layers": LAYERS, "pages": UNITS, "page_bytes": unit_bytes}
    return [
        {"name": "H", "location": "host", "kind": "kv", "layout": host,
         "init": [{"layers": "all", "indices": {"start": 0, "count": UNITS}, "owner": 1, "version": 1}]},
        {"name": "D", "location": "device", "kind": "kv", "layout": dev},
        {"name": "D2", "location": "device", "kind": "kv2", "layout": dev},
    ]


idx_sets = st.lists(st.integers(0, UNITS - 1), min_size=1, max_size=UNITS, unique=True)


@st.composite
def copy_op(draw, stream):
    src, dst = draw(st.sampled_from([("H", "D"), ("H", "D2"), ("D", "H"), ("D", "D2"), ("D2", "D")]))
    dst_idx = draw(idx_sets)
    src_idx = draw(st.lists(st.integers(0, UNITS - 1), min_size=len(dst_idx), max_size=len(dst_idx)))
    return {"op": "copy", "stream": stream, "routine": "kernel_per_layer", "src": src, "dst": dst,
            "args": {"layer": draw(st.integers(0, LAYERS - 1)), "src_indices": src_idx, "dst_indices": dst_idx}}


@st.composite
def schedules(draw, max_ops: int = 14, synchronised: bool = False):
    """Random valid schedules.  ``synchronised``: before each op, its stream
    waits (record -> wait) on every other stream that ran ops it has not yet
    synchronised with, so no two ops conflict without happens-before."""
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
    return {"kvrace_schedule": 1, "name": "generated", "buffers": base_buffers(),
            "streams": STREAMS, "events": events, "ops": ops}


# ---------------------------------------------------------------- richer schedules
#
# ``rich_schedules`` draws a geometry family first, then ops over it.  Families:
#
# * ``kv``: the buffers above with rows of 64, 256, 576 or 1,024 B (256 B and more: an item
#   spans whole 256 B chunks, so a read can land mid-item and be torn), copied with
#   ``kernel_per_layer``, ``kernel_all_layer`` (both layers, 64-warp launcher) and
#   ``direct_per_layer`` (cudaMemcpyAsync runs: byte-granular progress); indices may name
#   rows past the end (out-of-bounds copies, reported and clipped).
# * ``index_k``: DSA index-K, 2 pages of 8,448 B on the device (preset ``dsa_index_k``) and a
#   ``layer_first`` host pool of 8,448 B rows, copied with ``dsa_indexer_per_layer`` (64 token
#   indices per page; ``dst_indices`` start on a page boundary).
# * ``c4``: the DeepSeek V4 token copy ``dsv4_token`` (fixed C4 geometry: 576 B value + 8 B
#   scale per token, 64 tokens per 37,440 B page) between two ``c4_paged`` pools of 1 page, and
#   the same routine onto a 256 B/token ``bf16_index_k`` buffer (the incident: it writes
#   past the end).
#
# Host ops: ``host_sync`` of all three kinds (event, stream, device) and ``host_delay``.

RICH_UNITS = 4


def _host(name, kind, unit_bytes, units, layers=1, owner=1):
    return {"name": name, "location": "host", "kind": kind,
            "layout": {"kind": "host", "layout": "layer_first", "layers": layers, "units": units,
                       "unit_bytes": unit_bytes},
            "init": [{"layers": "all", "indices": {"start": 0, "count": units}, "owner": owner, "version": 1}]}


@st.composite
def _family(draw):
    """(name, buffers, {device buffer: (layers, units)}, copy strategy taking a stream)."""
    fam = draw(st.sampled_from(["kv", "kv", "index_k", "c4"]))
    if fam == "kv":
        ub = draw(st.sampled_from([64, 256, 576, 1024]))
        bufs = base_buffers(ub)
        for b in bufs:
            if b["location"] == "host":
                b["layout"]["units"] = RICH_UNITS
                b["init"][0]["indices"]["count"] = RICH_UNITS
            else:
                b["layout"]["pages"] = RICH_UNITS
        dev = {"D": (LAYERS, RICH_UNITS), "D2": (LAYERS, RICH_UNITS)}

        @st.composite
        def copy(draw, stream):
            src, dst = draw(st.sampled_from([("H", "D"), ("H", "D2"), ("D", "H"), ("D", "D2"), ("D2", "D")]))
            routine = draw(st.sampled_from(["kernel_per_layer", "kernel_all_layer", "direct_per_layer"]))
            n = draw(st.integers(1, RICH_UNITS))
            # index RICH_UNITS (one row past the end) appears now and then: an out-of-bounds copy
            top = RICH_UNITS if draw(st.integers(0, 4)) == 0 else RICH_UNITS - 1
            dst_idx = draw(st.lists(st.integers(0, top), min_size=n, max_size=n, unique=True))
            src_idx = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
            args = {"src_indices": src_idx, "dst_indices": dst_idx}
            if routine != "kernel_all_layer":
                args["layer"] = draw(st.integers(0, LAYERS - 1))
            return {"op": "copy", "stream": stream, "routine": routine, "src": src, "dst": dst, "args": args}
    elif fam == "index_k":
        bufs = [_host("H", "index_k", 8448, 2),
                {"name": "D", "location": "device", "kind": "index_k",
                 "layout": {"preset": "dsa_index_k", "layers": 1, "pages": 2}},
                {"name": "D2", "location": "device", "kind": "index_k2",
                 "layout": {"preset": "dsa_index_k", "layers": 1, "pages": 2}}]
        dev = {"D": (1, 2), "D2": (1, 2)}

        @st.composite
        def copy(draw, stream):
            src, dst = draw(st.sampled_from([("H", "D"), ("H", "D2"), ("D", "H"), ("D", "D2")]))
            pages = draw(st.lists(st.integers(0, 1), min_size=1, max_size=2, unique=True))
            src_pages = draw(st.lists(st.integers(0, 1), min_size=len(pages), max_size=len(pages)))
            tok = lambda ps: [p * 64 + t for p in ps for t in range(64)]
            return {"op": "copy", "stream": stream, "routine": "dsa_indexer_per_layer", "src": src,
                    "dst": dst, "args": {"layer": 0, "src_indices": tok(src_pages), "dst_indices": tok(pages)}}
    else:
        bufs = [_host("H", "c4", 37440, 1),
                {"name": "D", "location": "device", "kind": "c4",
                 "layout": {"preset": "c4_paged", "layers": 1, "pages": 1}},
                {"name": "D2", "location": "device", "kind": "index_k_bf16",
                 "layout": {"preset": "bf16_index_k", "layers": 1, "tokens": 64}}]
        dev = {"D": (1, 1), "D2": (1, 64)}

        @st.composite
        def copy(draw, stream):
            src, dst = draw(st.sampled_from([("H", "D"), ("D", "H"), ("H", "D2"), ("D", "D2")]))
            n = draw(st.integers(1, 8))
            dst_idx = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
            src_idx = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))
            return {"op": "copy", "stream": stream, "routine": "dsv4_token", "src": src, "dst": dst,
                    "args": {"src_indices": src_idx, "dst_indices": dst_idx, "layers": [0]}}
    return fam, bufs, dev, copy


@st.composite
def rich_schedules(draw, max_ops: int = 12):
    """Random valid schedules over one geometry family (see above), with host syncs of all
    three kinds and host delays."""
    fam, bufs, dev, copy = draw(_family())
    ops, recorded = [], []
    n = draw(st.integers(1, max_ops))
    for i in range(n):
        stream = draw(st.sampled_from(STREAMS))
        kinds = ["copy", "copy", "read", "write", "compute", "record", "host_sync", "host_delay"] + \
            (["wait"] if recorded else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "copy":
            op = draw(copy(stream))
        elif kind in ("read", "write"):
            buf = draw(st.sampled_from(sorted(dev)))
            layers, units = dev[buf]
            op = {"op": kind, "stream": stream, "buffer": buf, "layer": draw(st.integers(0, layers - 1)),
                  "units": draw(st.lists(st.integers(0, units - 1), min_size=1, max_size=min(units, 4),
                                         unique=True))}
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
        elif kind == "host_sync":
            target = draw(st.sampled_from(["event", "stream", "device"] if recorded else ["stream", "device"]))
            op = {"op": "host_sync"}
            if target == "event":
                op["event"] = draw(st.sampled_from(recorded))
            elif target == "stream":
                op["stream"] = draw(st.sampled_from(STREAMS))
        else:
            op = {"op": "host_delay", "duration_us": draw(st.sampled_from([0.5, 5.0, 30.0]))}
        op["id"] = f"o{i}"
        ops.append(op)
    return {"kvrace_schedule": 1, "name": f"generated_{fam}", "buffers": bufs,
            "streams": STREAMS, "events": list(EVENTS), "ops": ops}
