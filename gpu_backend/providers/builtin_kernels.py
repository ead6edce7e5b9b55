"""CUDA C++ source of the builtin kernels, and the packing of their parameter block.

Pure Python: nothing here needs a GPU, torch or NVRTC, so the source and the packing are tested
on any machine.  ``builtin.py`` compiles ``kernel_source()`` with NVRTC and launches it.

Every kernel takes one argument, ``Params`` by value.  Its C definition and the Python packing
are generated from the same field list (``PARAM_FIELDS``), all 8-byte integers, so the two
cannot drift apart and the struct has no padding.

Addresses are computed on the device from the indices and the layout parameters (``Lay``:
mode, layers, units, unit bytes, host page size, entries per unit; field tables for
``token_bytewise``; the fixed C4 constants for ``dsv4_token``), not from host-computed extents.

Kernels (one per routine family):

* ``kvr_rows``: ``kernel_per_layer``, ``kernel_all_layer``, ``dsa_indexer_per_layer``.  The
  sgl-kernel launch shape: item ``i`` is copied by warp ``i % warps`` in round
  ``i // warps`` (at most 2 CTAs of 32 warps); a warp moves 8 bytes per lane per step, and
  issues the loads of ``ROWS_BATCH_WORDS`` steps before their stores (words land in the same
  order).  Index
  ``k`` of item ``i`` is ``floor(indices[i * index_stride] / index_div)`` (1 and 1, or the DSA
  page size twice: first token of the page, divided by the page size).  Pairs with a negative
  index are skipped.  The layers in ``layers`` are visited inside each item.
* ``kvr_rows_wide``: the same routines when the copy moves at least ``WIDE_MIN_BYTES`` (16 MiB):
  the same item order (item ``i`` on warp ``i % warps``, round ``i // warps``) on one block of
  1,024 threads per SM (``wide_launch``), 16-byte words with ``WIDE_VEC_WORDS`` loads per lane in
  flight (8-byte words where the item or an address is not 16-byte aligned).  The sgl-kernel
  shape's two CTAs cannot keep enough host reads in flight for the PCIe link
  (``benchmarks/bench_rows_variants.py``).
* ``kvr_dsv4``: ``dsv4_token``.  One warp per token (grid ``ceil(N/32)`` x 1024 threads).  The
  index is cast to int32; page ``index >> 6``, entry ``index & 63``; value 576 B at
  ``page * 37440 + entry * 576`` and scale 8 B at ``page * 37440 + 36864 + entry * 8`` from each
  layer's base (unit 0 of that layer), whatever the buffer's real geometry.
* ``kvr_fields``: ``token_bytewise``.  The sgl-kernel launch shape; token ``t`` lives in unit
  ``t / entries_per_unit``, entry ``t % entries_per_unit`` of each side, and every field entry is
  copied to the same field entry of the destination token, 8, 4 or 1 bytes per lane step
  depending on alignment.
* ``kvr_stage_pages``: the gather step of ``staged_all_layer_lf_pf``.  ``n_items`` pages (at most
  one staging chunk); page ``k`` starts at source unit ``src_idx[k]`` (the first index of its
  page_size group, already picked on the host) and holds ``page_tokens`` tokens.  The staging
  buffer ``dst`` is dense, ordered (page, token, layer, 16-byte vector): the byte order of a
  page_first host page, so each page then leaves in one memcpy.  One thread moves one 16-byte
  vector per grid-stride step; blocks of 256 threads, grid ``ceil(vectors / 256)``.
"""
from __future__ import annotations

import hashlib

import numpy as np

from sim.transfers.timing import BUILTIN_WIDE_MIN_BYTES, BUILTIN_WIDE_ROUTINES

MAX_FIELDS = 8
WARP = 32
QUOTA_BLOCKS = 2
QUOTA_WARPS_PER_BLOCK = 32
DSV4_BLOCK_THREADS = 1024
DSV4 = {"page_size": 64, "page_shift": 6, "value_bytes": 576, "scale_bytes": 8,
        "page_bytes": -(-(576 + 8) * 64 // 576) * 576, "scale_offset": 576 * 64}

LAY_FIELDS = ("mode", "layers", "units", "unit_bytes", "page_size", "epu")
#: (name, count): every entry an int64 / uint64 in C
PARAM_FIELDS: tuple[tuple[str, int], ...] = (
    ("src", 1), ("dst", 1),                 # logical buffer addresses
    ("src_idx", 1), ("dst_idx", 1),         # device int64 index arrays
    ("layer_ids", 1), ("n_layers", 1),      # device int64 layer ids
    ("n_items", 1), ("items_per_warp", 1),
    ("item_bytes", 1), ("index_stride", 1), ("index_div", 1), ("page_tokens", 1),
    *((f"src_{k}", 1) for k in LAY_FIELDS),
    *((f"dst_{k}", 1) for k in LAY_FIELDS),
    ("n_fields", 1),
    ("f_src_off", MAX_FIELDS), ("f_dst_off", MAX_FIELDS), ("f_len", MAX_FIELDS),
)
PARAM_WORDS = sum(n for _, n in PARAM_FIELDS)
KERNELS = {"kernel_per_layer": "kvr_rows", "kernel_all_layer": "kvr_rows",
           "dsa_indexer_per_layer": "kvr_rows", "dsv4_token": "kvr_dsv4",
           "token_bytewise": "kvr_fields", "staged_all_layer_lf_pf": "kvr_stage_pages"}
#: the routines whose copies of at least WIDE_MIN_BYTES run kvr_rows_wide instead of kvr_rows
WIDE_KERNEL = "kvr_rows_wide"
WIDE_ROUTINES = BUILTIN_WIDE_ROUTINES
#: the gather step of the staged write-back: 256-thread blocks, one 16-byte vector per thread
#: per grid-stride step, grid ceil(vectors / 256) (SGLang's relayout launch shape)
#: kvr_rows: 8-byte words per lane whose loads are in flight together (16: 4 KiB per warp, the
#: whole item for rows up to 4 KiB; SGLang's JIT kernel holds a whole item in registers)
ROWS_BATCH_WORDS = 16
#: kvr_rows_wide (copies of at least WIDE_MIN_BYTES): one block of 1,024 threads per SM, 16-byte
#: words (8-byte where the item or an address is not 16-byte aligned), 8 loads per lane in flight.
#: Measured (results/fidelity/round3/rows_variants.md): the sgl-kernel shape of 2 CTAs tops out at
#: 0.79 of the pinned ceiling on 16,384 index-K pages and 0.58 on 1,152 B rows whatever the per-warp
#: loop; one block per SM reaches 0.93 and 0.91 with the same loop.
WIDE_MIN_BYTES = BUILTIN_WIDE_MIN_BYTES
WIDE_VEC_WORDS = 8
STAGE_BLOCK_THREADS = 256
STAGE_VEC_BYTES = 16


def _struct_source() -> str:
    lines = ["struct Params {"]
    for name, n in PARAM_FIELDS:
        lines.append(f"  long long {name}{f'[{n}]' if n > 1 else ''};")
    lines.append("};")
    return "\n".join(lines)


def pack_params(values: dict) -> np.ndarray:
    """The parameter block as int64 words, in ``PARAM_FIELDS`` order.

    ``values`` maps field names to ints (lists for the field tables, zero-padded to
    ``MAX_FIELDS``); missing names are zero.  Unsigned 64-bit values (pointers) wrap to int64.
    """
    unknown = set(values) - {n for n, _ in PARAM_FIELDS}
    if unknown:
        raise ValueError(f"kernel parameters: unknown names {sorted(unknown)}; "
                         f"expected names from PARAM_FIELDS")
    words: list[int] = []
    for name, n in PARAM_FIELDS:
        v = values.get(name, [] if n > 1 else 0)
        seq = list(v) if n > 1 else [v]
        if len(seq) > n:
            raise ValueError(f"kernel parameter {name}: expected at most {n} values, got {len(seq)}")
        seq = [int(x) for x in seq] + [0] * (n - len(seq))
        for x in seq:
            if not -(1 << 63) <= x < (1 << 64):
                raise ValueError(f"kernel parameter {name}: {x} does not fit in 64 bits")
            words.append(x - (1 << 64) if x >= (1 << 63) else x)
    return np.array(words, dtype=np.int64)


def lay_values(prefix: str, p) -> dict:
    """``src_*``/``dst_*`` parameter values from a ``base.LayoutParams``."""
    return {f"{prefix}_mode": p.mode, f"{prefix}_layers": p.layers, f"{prefix}_units": p.units,
            f"{prefix}_unit_bytes": p.unit_bytes, f"{prefix}_page_size": p.page_size,
            f"{prefix}_epu": p.entries_per_unit}


def quota_launch(n_items: int) -> tuple[int, int, int]:
    """(blocks, threads per block, items per warp) of sgl-kernel's transfer_kv_launcher."""
    if n_items <= 0:
        return 0, QUOTA_WARPS_PER_BLOCK * WARP, 0
    ipw = -(-n_items // (QUOTA_BLOCKS * QUOTA_WARPS_PER_BLOCK))
    blocks = -(-n_items // (ipw * QUOTA_WARPS_PER_BLOCK))
    return blocks, QUOTA_WARPS_PER_BLOCK * WARP, ipw


def uses_wide(routine: str, n_items: int, n_layers: int, item_bytes: int) -> bool:
    """Whether ``routine``'s copy runs ``kvr_rows_wide``: a row routine moving at least
    ``WIDE_MIN_BYTES`` (items x layers x item bytes, skipped items counted)."""
    return routine in WIDE_ROUTINES and n_items * n_layers * item_bytes >= WIDE_MIN_BYTES


def wide_launch(n_items: int, sm_count: int) -> tuple[int, int, int]:
    """(blocks, threads per block, items per warp) of ``kvr_rows_wide``: one block of 1,024
    threads per SM, no more blocks than the items fill (item ``i`` on warp ``i % warps``)."""
    if n_items <= 0:
        return 0, QUOTA_WARPS_PER_BLOCK * WARP, 0
    blocks = max(1, min(int(sm_count), -(-n_items // QUOTA_WARPS_PER_BLOCK)))
    return blocks, QUOTA_WARPS_PER_BLOCK * WARP, -(-n_items // (blocks * QUOTA_WARPS_PER_BLOCK))


def stage_launch(n_pages: int, page_tokens: int, n_layers: int, item_bytes: int) -> tuple[int, int, int]:
    """(blocks, threads per block, vectors) of the staged gather: one thread per 16-byte vector."""
    vecs = n_pages * page_tokens * n_layers * (item_bytes // STAGE_VEC_BYTES)
    return -(-vecs // STAGE_BLOCK_THREADS) if vecs > 0 else 0, STAGE_BLOCK_THREADS, vecs


def warp_per_item_launch(n_items: int) -> tuple[int, int, int]:
    """(blocks, threads per block, items per warp) of transfer_cache_dsv4_mla."""
    wpb = DSV4_BLOCK_THREADS // WARP
    return (-(-n_items // wpb) if n_items > 0 else 0), DSV4_BLOCK_THREADS, 1


_BODY = r"""
#define KVR_WARP 32

struct Lay { long long mode, layers, units, unit_bytes, page_size, epu; };

__device__ __forceinline__ long long floor_div(long long a, long long b) {
  long long q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Byte offset of unit idx of a layer: layer-major (device pages, host layer_first),
// page_first, or page_first_direct (pages of page_size units, layers inside a page).
__device__ __forceinline__ long long unit_off(const Lay& l, long long layer, long long idx) {
  if (l.mode == 0) return (layer * l.units + idx) * l.unit_bytes;
  if (l.mode == 1) return (idx * l.layers + layer) * l.unit_bytes;
  long long page = floor_div(idx, l.page_size);
  long long e = idx - page * l.page_size;
  return ((page * l.layers + layer) * l.page_size + e) * l.unit_bytes;
}

__device__ __forceinline__ Lay src_lay(const Params& p) {
  Lay l = {p.src_mode, p.src_layers, p.src_units, p.src_unit_bytes, p.src_page_size, p.src_epu};
  return l;
}
__device__ __forceinline__ Lay dst_lay(const Params& p) {
  Lay l = {p.dst_mode, p.dst_layers, p.dst_units, p.dst_unit_bytes, p.dst_page_size, p.dst_epu};
  return l;
}

// One warp copies nbytes: lane k moves words k, k+32, ... of width W (8, 4 or 1 bytes).
template <typename W>
__device__ __forceinline__ void warp_copy(int lane, const char* s, char* d, long long nbytes) {
  const W* sw = reinterpret_cast<const W*>(s);
  W* dw = reinterpret_cast<W*>(d);
  long long n = nbytes / (long long)sizeof(W);
  for (long long j = lane; j < n; j += KVR_WARP) {
    W v = __ldg(sw + j);
    __stcg(dw + j, v);
  }
}

// One warp copies nbytes (a multiple of sizeof(T)) in batches of K words of type T per lane: every
// load of a batch is issued before its first store, so a lane has K host reads in flight instead
// of one (the item's words land in the same order as warp_copy's: word j = step * 32 + lane).
template <typename T, int K>
__device__ __forceinline__ void warp_copy_words(int lane, const char* s, char* d, long long nbytes) {
  const T* sw = reinterpret_cast<const T*>(s);
  T* dw = reinterpret_cast<T*>(d);
  const long long n = nbytes / (long long)sizeof(T);
  for (long long base = 0; base < n; base += (long long)K * KVR_WARP) {
    T v[K];
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const long long j = base + (long long)i * KVR_WARP + lane;
      if (j < n) v[i] = __ldg(sw + j);
    }
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const long long j = base + (long long)i * KVR_WARP + lane;
      if (j < n) __stcg(dw + j, v[i]);
    }
  }
}

// 8-byte words, K per lane in flight (kvr_rows: K = KVR_BATCH)
template <int K>
__device__ __forceinline__ void warp_copy_batched(int lane, const char* s, char* d, long long nbytes) {
  warp_copy_words<unsigned long long, K>(lane, s, d, nbytes);
}

__device__ __forceinline__ void warp_copy_any(int lane, const char* s, char* d, long long n) {
  unsigned long long a = (unsigned long long)s | (unsigned long long)d | (unsigned long long)n;
  if ((a & 7ULL) == 0) warp_copy<unsigned long long>(lane, s, d, n);
  else if ((a & 3ULL) == 0) warp_copy<unsigned int>(lane, s, d, n);
  else {
    for (long long j = lane; j < n; j += KVR_WARP) d[j] = s[j];
  }
}

// every kernel: this warp's lane, id and the warp count; the index arrays; both layouts
#define KVR_WARP_PROLOGUE(p)                                                              \
  const int lane = threadIdx.x % KVR_WARP;                                                \
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / KVR_WARP;   \
  const long long warps = (long long)gridDim.x * blockDim.x / KVR_WARP;                   \
  const long long* si_arr = reinterpret_cast<const long long*>((p).src_idx);              \
  const long long* di_arr = reinterpret_cast<const long long*>((p).dst_idx);              \
  const long long* layers = reinterpret_cast<const long long*>((p).layer_ids);            \
  const Lay sl = src_lay(p), dl = dst_lay(p)

// One warp copies nbytes in 16-byte words, KVR_WIDE_K per lane in flight (the item's words land
// in the order word j = step * 32 + lane); 8-byte words when the item or an address is not 16-byte
// aligned (the item is always a multiple of 8: supports() checks it).
__device__ __forceinline__ void warp_copy_wide(int lane, const char* s, char* d, long long nbytes) {
  if ((((unsigned long long)s | (unsigned long long)d | (unsigned long long)nbytes) & 15ULL) != 0) {
    warp_copy_batched<2 * KVR_WIDE_K>(lane, s, d, nbytes);
    return;
  }
  warp_copy_words<uint4, KVR_WIDE_K>(lane, s, d, nbytes);
}

// the row kernels' item loop: item = round * warps + warp, each item's layers in order, copied by
// warp_copy_wide (WIDE) or warp_copy_batched<KVR_BATCH>
template <bool WIDE>
__device__ __forceinline__ void kvr_rows_loop(const Params& p) {
  KVR_WARP_PROLOGUE(p);
  for (long long r = 0; r < p.items_per_warp; ++r) {
    const long long item = r * warps + warp;
    if (item >= p.n_items) break;
    const long long si = floor_div(si_arr[item * p.index_stride], p.index_div);
    const long long di = floor_div(di_arr[item * p.index_stride], p.index_div);
    if (si < 0 || di < 0) continue;
    for (long long k = 0; k < p.n_layers; ++k) {
      const long long layer = layers[k];
      const char* s = reinterpret_cast<const char*>(p.src) + unit_off(sl, layer, si);
      char* d = reinterpret_cast<char*>(p.dst) + unit_off(dl, layer, di);
      if (WIDE) {
        warp_copy_wide(lane, s, d, p.item_bytes);
      } else {
        warp_copy_batched<KVR_BATCH>(lane, s, d, p.item_bytes);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024) kvr_rows(const Params p) { kvr_rows_loop<false>(p); }

// kvr_rows for copies of at least WIDE_MIN_BYTES: the same item order (item = round * warps + warp)
// on a grid of one 1,024-thread block per SM, with warp_copy_wide.
extern "C" __global__ void __launch_bounds__(1024) kvr_rows_wide(const Params p) { kvr_rows_loop<true>(p); }

extern "C" __global__ void __launch_bounds__(1024) kvr_dsv4(const Params p) {
  KVR_WARP_PROLOGUE(p);
  const long long value_words = C4_VALUE_BYTES / 8;
  for (long long item = warp; item < p.n_items; item += warps) {
    const int si = (int)si_arr[item];
    const int di = (int)di_arr[item];
    const long long s_page = (long long)(si >> C4_PAGE_SHIFT), s_e = si & (C4_PAGE_SIZE - 1);
    const long long d_page = (long long)(di >> C4_PAGE_SHIFT), d_e = di & (C4_PAGE_SIZE - 1);
    for (long long k = 0; k < p.n_layers; ++k) {
      const long long layer = layers[k];
      const char* s_base = reinterpret_cast<const char*>(p.src) + unit_off(sl, layer, 0)
                           + s_page * C4_PAGE_BYTES;
      char* d_base = reinterpret_cast<char*>(p.dst) + unit_off(dl, layer, 0) + d_page * C4_PAGE_BYTES;
      const unsigned long long* sv = reinterpret_cast<const unsigned long long*>(s_base + s_e * C4_VALUE_BYTES);
      unsigned long long* dv = reinterpret_cast<unsigned long long*>(d_base + d_e * C4_VALUE_BYTES);
      const unsigned long long* ss = reinterpret_cast<const unsigned long long*>(
          s_base + C4_SCALE_OFFSET + s_e * C4_SCALE_BYTES);
      unsigned long long* ds = reinterpret_cast<unsigned long long*>(
          d_base + C4_SCALE_OFFSET + d_e * C4_SCALE_BYTES);
      for (long long w = lane; w <= value_words; w += KVR_WARP) {
        if (w < value_words) __stcg(dv + w, __ldg(sv + w));
        else __stcg(ds, __ldg(ss));
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024) kvr_fields(const Params p) {
  KVR_WARP_PROLOGUE(p);
  for (long long r = 0; r < p.items_per_warp; ++r) {
    const long long item = r * warps + warp;
    if (item >= p.n_items) break;
    const long long st = si_arr[item], dt = di_arr[item];
    if (st < 0 || dt < 0) continue;
    const long long s_unit = floor_div(st, sl.epu), s_e = st - s_unit * sl.epu;
    const long long d_unit = floor_div(dt, dl.epu), d_e = dt - d_unit * dl.epu;
    for (long long k = 0; k < p.n_layers; ++k) {
      const long long layer = layers[k];
      const char* s_tok = reinterpret_cast<const char*>(p.src) + unit_off(sl, layer, s_unit);
      char* d_tok = reinterpret_cast<char*>(p.dst) + unit_off(dl, layer, d_unit);
      for (long long f = 0; f < p.n_fields; ++f) {
        const long long len = p.f_len[f];
        warp_copy_any(lane, s_tok + p.f_src_off[f] + s_e * len, d_tok + p.f_dst_off[f] + d_e * len, len);
      }
    }
  }
}

// staged_all_layer_lf_pf, gather step: the tokens of n_items pages, every layer in layer_ids,
// into the dense staging buffer p.dst, ordered (page, token, layer, 16-byte vector).
extern "C" __global__ void __launch_bounds__(256) kvr_stage_pages(const Params p) {
  const long long* first = reinterpret_cast<const long long*>(p.src_idx);
  const long long* layers = reinterpret_cast<const long long*>(p.layer_ids);
  const Lay sl = src_lay(p);
  const long long per_item = p.item_bytes / 16;
  const long long per_token = p.n_layers * per_item;
  const long long per_page = p.page_tokens * per_token;
  const long long total = p.n_items * per_page;
  const long long step = (long long)gridDim.x * blockDim.x;
  uint4* staging = reinterpret_cast<uint4*>(p.dst);
  for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < total; v += step) {
    const long long page = v / per_page;
    const long long tok = (v - page * per_page) / per_token;
    const long long k = (v - page * per_page - tok * per_token) / per_item;
    const long long w = v - page * per_page - tok * per_token - k * per_item;
    const char* s = reinterpret_cast<const char*>(p.src) + unit_off(sl, layers[k], first[page] + tok) + w * 16;
    __stcg(staging + v, __ldg(reinterpret_cast<const uint4*>(s)));
  }
}
"""


def kernel_source() -> str:
    """The full CUDA C++ translation unit (no includes: NVRTC compiles it as is)."""
    consts = "\n".join([
        f"#define C4_PAGE_SIZE {DSV4['page_size']}LL",
        f"#define C4_PAGE_SHIFT {DSV4['page_shift']}",
        f"#define C4_VALUE_BYTES {DSV4['value_bytes']}LL",
        f"#define C4_SCALE_BYTES {DSV4['scale_bytes']}LL",
        f"#define C4_PAGE_BYTES {DSV4['page_bytes']}LL",
        f"#define C4_SCALE_OFFSET {DSV4['scale_offset']}LL",
        f"#define KVR_BATCH {ROWS_BATCH_WORDS}",
        f"#define KVR_WIDE_K {WIDE_VEC_WORDS}",
    ])
    return "// kvrace builtin copy kernels (generated by gpu_backend/providers/builtin_kernels.py)\n" \
        + consts + "\n\n" + _struct_source() + "\n" + _BODY


def source_digest() -> str:
    return hashlib.sha256(kernel_source().encode()).hexdigest()[:16]
