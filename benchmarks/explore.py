"""Benchmark ``sim.explore``: exhaustive exploration of a 2-layer load-back window with 2
concurrent requests, and orders explored per second with and without the reduction.

The window: a DSA ``CacheSession`` (SGLang 0.5.14's HiRadixCache and controller; fp8 latent
plus the index-K sidecar, page 64, 2 layers) where two requests' prefixes (``PAGES`` pages
each) are written, backed up, evicted to the host, matched and loaded back together (one
``start_loading``: per layer the latent and index-K copies of both requests, then the layer's
event).  The forward pass of the batch then reads, per layer and request, the index-K pages
WITHOUT the gate (sglang 0.5.10's ``_get_topk_ragged``) and the latent behind it
(``wait_until``).  ``sim.window.cut_window`` cuts the ungated reads with the copies they race.

    python benchmarks/explore.py              # prints a table, writes benchmarks/results/explore.json
    python benchmarks/explore.py --quick      # smaller brute-force budget

Times are wall seconds on this machine, one process (one core).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from sim.cache import CacheSession
from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.explore import Explorer
from sim.schedule import validate
from sim.window import cut_window

from provenance import command, git_commit  # benchmarks/, the script's own folder

PAGE = 64
PAGES = 2                  # pages per request
OUT = Path(__file__).with_name("results") / "explore.json"


def load_back_window() -> dict:
    """The window (a format 2 schedule document); see the module doc."""
    s = CacheSession(model="dsa", layers=2, page_size=PAGE, device_tokens=8 * PAGE, overlap=False)
    n = PAGES * PAGE
    keys = [np.arange(10_000, 10_000 + n), np.arange(20_000, 20_000 + n)]
    for owner, key in zip((12, 13), keys):
        slots = s.allocator.alloc(n)
        s.store_kv(slots, owner=owner)
        s.cache.insert(InsertParams(RadixKey(key), slots))
    s.wait_idle()
    s.cache.check_hicache_events()
    s.cache.evict(EvictParams(num_tokens=8 * PAGE))
    loaded = []
    for key in keys:                       # two requests join one batch: both load back
        m = s.cache.match_prefix(MatchPrefixParams(RadixKey(key)))
        slots, _ = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
        loaded.append(slots)
    slot = s.cache.ready_to_load_host_cache()
    index_k = next(b for b, role in s.roles.items() if role == "index_k")
    latent = next(b for b, role in s.roles.items() if role == "latent")
    ungated = []
    for layer in range(2):             # per layer: the batch's indexer, then its attention
        for r, slots in enumerate(loaded):
            pages = np.unique(np.asarray(slots) // PAGE)
            ungated.append(s.read(index_k, layer, pages, id=f"req{r}.L{layer}.index_k_ungated"))
        for r, slots in enumerate(loaded):
            s.read(latent, layer, slots, gate=slot, id=f"req{r}.L{layer}.latent_gated")
    s.wait_idle()
    s.cache.check_hicache_events()
    doc = cut_window(s.finish(), ops=ungated)
    doc["name"] = "load_back_2layers_2requests"
    doc["description"] = ("benchmarks/explore.py: two requests' prefixes loaded back together (DSA, page 64, "
                          f"{PAGES} pages each, 2 layers); per layer and request the ungated index-K read "
                          "(sglang 0.5.10) with the copies it races.")
    return doc


def _rate(res) -> float:
    return res.orders / res.elapsed_s if res.elapsed_s else float("nan")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    doc = load_back_window()
    s = validate(doc)
    gen_s = time.perf_counter() - t0
    rows = []
    for chunk in (0, 4096):
        t = time.perf_counter()
        ex = Explorer(s, chunk)
        model_s = time.perf_counter() - t
        res = ex.exhaustive()
        total = time.perf_counter() - t
        rows.append({"what": f"exhaustive, chunk {chunk}", "chunk_bytes": chunk, "orders": res.orders,
                     "complete": res.complete, "outcomes": len(res.outcomes), "corrupt": len(res.corrupt),
                     "forcible_witnesses": sum(o.witness is not None for o in res.outcomes),
                     "model_s": round(model_s, 3), "explore_s": round(res.elapsed_s, 3),
                     "witnesses_s": round(total - model_s - res.elapsed_s, 3), "total_s": round(total, 3),
                     "orders_per_s": round(_rate(res), 1),
                     "outcomes_per_s": round(len(res.outcomes) / res.elapsed_s, 1),
                     "steps": ex.model.steps(), "conflict_pairs": len(ex.model.pairs)})
    # the same model, every interleaving (no reduction), for a fixed budget of orders
    budget = 300 if args.quick else 2000
    ex = Explorer(s, 0, witnesses=False)
    red = ex.exhaustive()
    brute = ex.exhaustive(max_orders=budget, reduction=False)
    rows.append({"what": "chunk 0, with reduction (no witnesses)", "orders": red.orders, "complete": red.complete,
                 "outcomes": len(red.outcomes), "explore_s": round(red.elapsed_s, 3),
                 "orders_per_s": round(_rate(red), 1)})
    rows.append({"what": f"chunk 0, without reduction (first {budget} interleavings)", "orders": brute.orders,
                 "complete": brute.complete, "outcomes": len(brute.outcomes),
                 "explore_s": round(brute.elapsed_s, 3), "orders_per_s": round(_rate(brute), 1),
                 "outcomes_found_of_all": f"{len(brute.outcomes)}/{len(red.outcomes)}"})
    rep = {"benchmark": "explore", "command": command(), "commit": git_commit(),
           "python": platform.python_version(), "machine": platform.machine(),
           "window": {"name": s.name, "ops": len(s.ops), "pages_per_request": PAGES, "layers": 2,
                      "requests": 2, "generate_s": round(gen_s, 3)},
           "rows": rows}
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
