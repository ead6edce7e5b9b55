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
