"""Byte-model benchmarks: materialised copy throughput, compact-model memory.

    python benchmarks/bench_bytes.py [--quick]

1. Materialised copies: one ``copy_from`` of a batch of equal extents between
   two different buffers (host -> device-like), random source and destination
   slots; throughput is simulated bytes copied per wall second (best of 3).
   The compact model's time for the same batch is shown alongside.
2. Compact-model memory for a host pool holding every session's tokens:
   layer_first layout (``[layer][slot][bytes]``, as a HiCache host pool with
   layout ``layer_first``), one buffer for the latent KV (656 B per token row,
   64-token pages) and one for the index-K (8,448 B per 64-token page).  Each
   session's pages sit in slots given by a seeded random page permutation;
   each (session, layer) is one ``fill`` of that session's origin, one extent
   per page.  Then one more fill and one ``copy_from`` (host -> device, one
   session-layer) are timed on the full pools.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.bytes import CompactBuffer, MaterialBuffer, Origin, OriginTable  # noqa: E402

TOKENS_PER_PAGE = 64
KV_ROW_BYTES = 656                 # latent KV, per token per layer
INDEX_K_PAGE_BYTES = 8448          # index-K, per 64-token page per layer (132 B per token)


def _best(fn, reps=3):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_copies(n_extents: int):
    rows = []
    rng = np.random.default_rng(1)
    for length in (256, 8448, 37440):
        slots = n_extents * 5 // 4
        table = OriginTable()
        host_o, dev_o = Origin("kv", 0, 1, 1, length), Origin("kv", 0, -1, 0, length)
        src_off = rng.permutation(slots)[:n_extents].astype(np.int64) * length
        dst_off = rng.permutation(slots)[:n_extents].astype(np.int64) * length
        lens = np.full(n_extents, length, dtype=np.int64)
        host = MaterialBuffer(slots * length, table, host_o)
        dev = MaterialBuffer(slots * length, table, dev_o)
        t_mat = _best(lambda: dev.copy_from(host, src_off, dst_off, lens))
        assert np.array_equal(dev.data[dst_off[7]:dst_off[7] + length],
                              host.data[src_off[7]:src_off[7] + length])
        chost = CompactBuffer(slots * length, table, host_o)

        def compact_copy():
            cdev = CompactBuffer(slots * length, table, dev_o)
            cdev.copy_from(chost, src_off, dst_off, lens)
        t_cmp = _best(compact_copy)
        moved = n_extents * length
        rows.append((length, n_extents, moved / t_mat / 1e9, t_mat * 1e3, t_cmp * 1e3,
                     moved / t_cmp / 1e9))
        del host, dev
    return rows


def bench_memory(sessions: int, tokens: int, layers: int, seed: int = 0):
    pages_per_session = tokens // TOKENS_PER_PAGE
    total_pages = sessions * pages_per_session
    rng = np.random.default_rng(seed)
    slot_of = rng.permutation(total_pages).astype(np.int64).reshape(sessions, pages_per_session)
    table = OriginTable()
    page_kv = TOKENS_PER_PAGE * KV_ROW_BYTES
    pools = {
        "kv (latent)": (KV_ROW_BYTES, page_kv, "kv"),
        "index_k": (INDEX_K_PAGE_BYTES, INDEX_K_PAGE_BYTES, "index_k"),
    }
    out, keep = {}, []
    t0 = time.perf_counter()
    for name, (unit, page_bytes, kind) in pools.items():
        layer_bytes = total_pages * page_bytes
        t = time.perf_counter()
        buf = CompactBuffer(layers * layer_bytes, table, Origin(kind, -1, -1, 0, unit))
        pages = np.arange(pages_per_session, dtype=np.int64)
        for layer in range(layers):
            for s in range(sessions):
                buf.fill(layer * layer_bytes + slot_of[s] * page_bytes, page_bytes,
                         Origin(kind, layer, s, 1, unit), pages * page_bytes)
        build = time.perf_counter() - t
        # spot check: a page of the last session holds its own bytes
        s, p, layer = sessions - 1, pages_per_session // 2, layers // 2
        got = buf.pieces(layer * layer_bytes + int(slot_of[s, p]) * page_bytes, page_bytes)
        assert len(got) == 1 and table[int(got.origin_id[0])] == Origin(kind, layer, s, 1, unit)
        assert got.stream_offset[0] == p * page_bytes
        # one more op of each kind on the full pool
        t = time.perf_counter()
        buf.fill(layer * layer_bytes + slot_of[0] * page_bytes, page_bytes,
                 Origin(kind, layer, 0, 2, unit), pages * page_bytes)
        t_fill = time.perf_counter() - t
        dev = CompactBuffer(pages_per_session * page_bytes, table, Origin(kind, layer, -1, 0, unit))
        t = time.perf_counter()
        dev.copy_from(buf, layer * layer_bytes + slot_of[1] * page_bytes,
                      pages * page_bytes, page_bytes)
        t_copy = time.perf_counter() - t
        assert dev.segment_count() == 1
        out[name] = dict(nbytes=buf.nbytes, segments=buf.segment_count(),
                         memory=buf.memory_bytes(), build_s=build, fills=layers * sessions,
                         fill_ms=t_fill * 1e3, copy_ms=t_copy * 1e3)
        keep.append(buf)                    # both pools alive at the peak
    total_s = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out, total_s, peak_rss, len(table)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    ap.add_argument("--extents", type=int, default=None, help="extents per copy batch (default 10,000)")
    args = ap.parse_args(argv)
    n_ext = args.extents or (2000 if args.quick else 10_000)
    sessions, tokens, layers = (6, 8000, 43) if args.quick else (60, 80_000, 43)

    # the memory part runs first, so the peak RSS it reports is its own
    out, total_s, peak_rss, n_origins = bench_memory(sessions, tokens, layers)
    print(f"## Materialised copy throughput ({n_ext} extents per batch, host -> device buffers)\n")
    print("| extent bytes | extents | material GB/s | material ms | compact ms | compact sim. GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length, n, gbps, ms, cms, cgbps in bench_copies(n_ext):
        print(f"| {length:,} | {n:,} | {gbps:.2f} | {ms:.1f} | {cms:.1f} | {cgbps:,.0f} |")

    print(f"\n## Compact model: {sessions} sessions x {tokens:,} tokens x {layers} layers "
          f"(layer_first host pools, scattered 64-token pages)\n")
    print("| pool | simulated bytes | fills | segments | memory_bytes | build s "
          "| one more fill ms | one copy_from ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    total_mem = 0
    for name, r in out.items():
        total_mem += r["memory"]
        print(f"| {name} | {r['nbytes'] / 2**30:,.1f} GiB | {r['fills']:,} | {r['segments']:,} | "
              f"{r['memory'] / 2**20:,.1f} MiB | {r['build_s']:.1f} | {r['fill_ms']:.1f} | "
              f"{r['copy_ms']:.1f} |")
    print(f"\nTotal memory_bytes {total_mem / 2**20:,.1f} MiB; {n_origins:,} origins; "
          f"peak RSS {peak_rss / 2**20:,.0f} MiB (process, measured before part 1 ran); "
          f"build {total_s:.1f} s.")


if __name__ == "__main__":
    main()
