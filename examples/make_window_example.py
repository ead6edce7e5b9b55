"""Regenerate ``examples/window_load_back_race.json``: a window cut out of a host-program run.

The run: two TP ranks of a DSA prefill engine with HiCache (hosts ``rank0`` and ``rank1``, in
lockstep through a barrier each scheduler iteration), each with its own device (latent rows and
index-K pages, 2 layers), pinned host pool, ``load`` stream and ``forward`` stream.

* Iteration 1: request 21's prefix is loaded back (2 pages, 128 tokens) into device pages 4-5;
  the forward pass reads it behind the per-layer gate (``wait_until``) on both ranks.
* The schedulers poll the load's finish event (``host_query``) every 2 us and release the
  slots only after the acknowledgement: pages 4-5 return to the free list.
* Iteration 2: request 22's prefix is loaded back into the same pages 4-5. On rank 0 the
  indexer reads layer 1's index-K WITHOUT the gate (the upstream 0.5.10 ragged top-k path,
  sglang PR #22811) while the layer-1 copy is still in flight: it sees request 21's keys.

The run is recorded, the window around rank 0's stale read is cut (``sim.window.cut_window``:
the read, the copies it raced, the buffers' contents at the window's start as init fills),
and written out. ``kvrace schedule run`` and ``kvrace replay --mode controlled`` take it.

    python examples/make_window_example.py            # rewrites the JSON
    python examples/make_window_example.py --check    # exit 1 if the file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path

from sim.executor import run_programs
from sim.profile import load_profile
from sim.report_io import regenerate
from sim.verdicts import analyse
from sim.window import cut_window

OUT = Path(__file__).with_name("window_load_back_race.json")
LAYERS, PAGE, LATENT_BYTES = 2, 64, 1152
STALE_READ = "rank0.it2.indexer_read_index_k_L1"


def header() -> dict:
    buffers, streams, events = [], [], []
    for r in (0, 1):
        buffers += [
            {"name": f"r{r}.host_latent", "location": "host", "kind": "latent",
             "layout": {"kind": "host", "layout": "layer_first", "layers": LAYERS, "units": 4 * PAGE,
                        "unit_bytes": LATENT_BYTES},
             "init": [{"layers": "all", "indices": {"start": 0, "count": 2 * PAGE}, "owner": 21, "version": 1,
                       "first_unit": 0},
                      {"layers": "all", "indices": {"start": 2 * PAGE, "count": 2 * PAGE}, "owner": 22,
                       "version": 1, "first_unit": 0}]},
            {"name": f"r{r}.host_index_k", "location": "host", "kind": "index_k",
             "layout": {"kind": "host", "layout": "layer_first", "layers": LAYERS, "units": 4,
                        "unit_bytes": 8448},
             "init": [{"layers": "all", "indices": {"start": 0, "count": 2}, "owner": 21, "version": 1,
                       "first_unit": 0},
                      {"layers": "all", "indices": {"start": 2, "count": 2}, "owner": 22, "version": 1,
                       "first_unit": 0}]},
            {"name": f"r{r}.dev_latent", "location": "device", "kind": "latent",
             "layout": {"preset": "token_rows", "item_bytes": LATENT_BYTES, "layers": LAYERS,
                        "size": 8 * PAGE, "page_size": PAGE}},
            {"name": f"r{r}.dev_index_k", "location": "device", "kind": "index_k",
             "layout": {"preset": "dsa_index_k", "layers": LAYERS, "pages": 9}},
        ]
        streams += [f"r{r}.forward", f"r{r}.load"]
        events += [f"r{r}.start"] + [f"r{r}.layer{i}" for i in range(LAYERS)]
    return {"kvrace_schedule": 2, "name": "window_source", "buffers": buffers, "streams": streams,
            "events": events, "hosts": ["rank0", "rank1"]}


def rank(r: int):
    fwd, ld = f"r{r}.forward", f"r{r}.load"

    def start_loading(h, it, host_page0):
        # SGLang 0.5.14 start_loading: start event on the current stream, the load stream
        # waits on it, then per layer every pool's layer-i copy and the layer's event.
        h.issue({"id": f"rank{r}.it{it}.start", "op": "record", "stream": fwd, "event": f"r{r}.start"})
        h.issue({"op": "wait", "stream": ld, "event": f"r{r}.start"})
        for i in range(LAYERS):
            h.issue({"id": f"rank{r}.it{it}.load_latent_L{i}", "op": "copy", "stream": ld,
                     "routine": "kernel_per_layer", "src": f"r{r}.host_latent", "dst": f"r{r}.dev_latent",
                     "args": {"layer": i, "src_indices": {"start": host_page0 * PAGE, "count": 2 * PAGE},
                              "dst_indices": {"start": 4 * PAGE, "count": 2 * PAGE}}})
            h.issue({"id": f"rank{r}.it{it}.load_index_k_L{i}", "op": "copy", "stream": ld,
                     "routine": "dsa_indexer_per_layer", "src": f"r{r}.host_index_k", "dst": f"r{r}.dev_index_k",
                     "args": {"layer": i, "src_indices": {"start": host_page0 * PAGE, "count": 2 * PAGE},
                              "dst_indices": {"start": 4 * PAGE, "count": 2 * PAGE}}})
            h.issue({"id": f"rank{r}.it{it}.complete_L{i}", "op": "record", "stream": ld, "event": f"r{r}.layer{i}"})

    def forward(h, it, gated_index_k):
        for i in range(LAYERS):
            h.issue({"op": "compute", "stream": fwd, "duration_us": 4.0})       # indexer q projection
            if gated_index_k:
                h.issue({"op": "wait", "stream": fwd, "event": f"r{r}.layer{i}"})
            h.issue({"id": f"rank{r}.it{it}.indexer_read_index_k_L{i}", "op": "read", "stream": fwd,
                     "buffer": f"r{r}.dev_index_k", "layer": i, "units": [4, 5]})
            h.issue({"op": "wait", "stream": fwd, "event": f"r{r}.layer{i}"})  # attention: get_key_buffer
            h.issue({"id": f"rank{r}.it{it}.attn_read_latent_L{i}", "op": "read", "stream": fwd,
                     "buffer": f"r{r}.dev_latent", "layer": i,
                     "units": {"start": 4 * PAGE, "count": 2 * PAGE}})
            h.issue({"op": "compute", "stream": fwd, "duration_us": 6.0})       # attention + MLP

    def program(h):
        yield h.barrier("iteration", ["rank0", "rank1"])
        start_loading(h, 1, host_page0=0)
        forward(h, 1, gated_index_k=True)
        while not h.query(f"r{r}.layer{LAYERS - 1}"):                          # loading_check
            yield h.delay(2.0)
        yield h.barrier("iteration", ["rank0", "rank1"])                     # all-reduce MIN of acks
        start_loading(h, 2, host_page0=2)                                    # pages 4-5 reused
        forward(h, 2, gated_index_k=(r != 0))
    return program


def build() -> tuple[dict, dict]:
    run = run_programs(header(), {"rank0": rank(0), "rank1": rank(1)}, load_profile("h200"))
    report = analyse(run)
    status = {rd["op"]: rd["status"] for rd in report["reads"]}
    assert status[STALE_READ] in ("stale", "torn"), status
    doc = cut_window(run, ops=[STALE_READ])
    doc["name"] = "window_load_back_race"
    doc["description"] = (
        "Cut by examples/make_window_example.py from a two-rank host-program run: rank 0's "
        "ungated index-K read of layer 1 for request 22, racing the load-back into pages 4-5, "
        "which held request 21's prefix until its acknowledgement. The init fills are the "
        "buffers' contents at the window's start (request 21's keys in pages 4-5).")
    return doc, status


def main(argv: list[str]) -> int:
    return regenerate(build()[0], OUT, Path(__file__).name, "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
