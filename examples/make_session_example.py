"""Regenerate ``examples/hicache_load_back_session.json``: a HiCache model run recorded as a schedule.

The run drives :class:`sim.cache.CacheSession` (SGLang 0.5.14's ``HiRadixCache``, its
controller and pools; MLA rows of 128 B, 2 layers, ``page_first`` host pool, kernel backend,
``write_through``) through what README's HiCache script does: two requests' prefixes are
written by the forward pass, inserted and backed up (the staged ``page_first`` write-back),
evicted to the host, matched as a host hit and loaded back (``start_loading``: per layer the
copy and the layer's event). Then the forward stream reads each layer of the loaded slots
twice: once ungated, issued right after the load (it races the copy), and once behind the
layer's gate (``wait_until``). The whole recorded run is the schedule: ``kvrace schedule run``
reports the ungated reads, and ``kvrace replay --mode controlled`` checks every read and every
buffer byte on a GPU.

    python examples/make_session_example.py            # rewrites the JSON
    python examples/make_session_example.py --check    # exit 1 if the file is out of date
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from sim.cache import CacheSession
from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.report_io import regenerate

OUT = Path(__file__).with_name("hicache_load_back_session.json")


def build() -> dict:
    # 56 + 8 bf16 elements: 128 B rows, which SGLang's JIT hicache kernels take
    s = CacheSession(model="mla", layers=2, device_tokens=64, kv_lora_rank=56, qk_rope_head_dim=8,
                     overlap=False)
    a = s.allocator.alloc(24)
    s.store_kv(a, owner=12)
    s.cache.insert(InsertParams(RadixKey(np.arange(1000, 1024)), a))
    b = s.allocator.alloc(24)
    s.store_kv(b, owner=13)
    res = s.cache.insert(InsertParams(RadixKey(np.r_[np.arange(1000, 1016), np.arange(2000, 2008)]), b))
    s.allocator.free(b[:res.prefix_len])
    s.wait_idle()
    s.cache.check_hicache_events()
    s.cache.evict(EvictParams(num_tokens=64))
    m = s.cache.match_prefix(MatchPrefixParams(RadixKey(np.arange(1000, 1024))))
    loaded, _ = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
    slot = s.cache.ready_to_load_host_cache()
    for layer in range(2):
        s.read("kv_buffer", layer, loaded, id=f"ungated_read_L{layer}")
    for layer in range(2):
        s.read("kv_buffer", layer, loaded, gate=slot, id=f"gated_read_L{layer}")
    s.wait_idle()
    s.cache.check_hicache_events()
    doc = s.finish().recorded
    doc["name"] = "hicache_load_back_session"
    doc["description"] = ("Recorded by examples/make_session_example.py from a CacheSession run (SGLang "
                          "0.5.14's HiRadixCache, controller and pools): backups with the staged page_first "
                          "write-back, eviction to the host, a host hit loaded back per layer, then ungated "
                          "reads racing the load and gated reads behind each layer's event.")
    return doc


def main(argv: list[str]) -> int:
    return regenerate(build(), OUT, Path(__file__).name, "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
