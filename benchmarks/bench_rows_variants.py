"""Variants of the builtin row-copy kernel (``kvr_rows``) on large host -> device copies.

    python benchmarks/bench_rows_variants.py --out DIR [--quick]

Issue 12 asks for builtin copies of 16 MiB or more at >= 90 % of the pinned H2D ceiling.  This
script builds every variant below into one NVRTC translation unit (for the GPU present), runs
each on the same copies as ``benchmarks/bench_providers.py`` (pinned layer_first host pool to a
device pool, random slots on both sides), checks each variant's bytes against the shipped
``kvr_rows`` kernel's on the same copy, and writes a table: variant x shape -> GB/s and the
fraction of the pinned ceiling (one 256 MiB ``cudaMemcpyAsync``) measured in the same process.
SGLang's JIT kernel (where it takes the copy) and the shipped builtin kernel are measured beside.

Variant axes (kernel ``rv_w<W>_k<K>_h<H>_i<I>_b<LB>``):

* ``W``: bytes per lane per load/store, 8 (``unsigned long long``) or 16 (``uint4``; falls back to
  8-byte words where the item, the source or the destination is not 16-byte aligned);
* ``K``: loads per lane issued before their stores (bytes in flight per lane ``W x K``);
* ``H``: load cache hint, 0 ``__ldg`` (``ld.global.nc``), 1 ``ld.global.nc.L1::no_allocate``;
* ``I``: index arithmetic, 0 the shipped ``floor_div`` per item (64-bit division), 1 a shift when
  the divisor is a power of two and nothing when it is 1, with the next item's indices loaded
  before the current item's copy;
* ``LB``: ``__launch_bounds__`` (1024 or 256 threads: the register budget per thread).

Launch shapes (host side; item ``i`` runs on warp ``i % warps`` in round ``i // warps`` for all):
``quota`` (sgl-kernel's: at most 2 CTAs of 1,024 threads), ``sm x b x t`` (``b`` blocks per SM
of ``t`` threads, capped at one warp per item).

Every timing: median of CUDA-event timings behind a spin kernel (``gpu_backend.calibrate.Timer``).
Writes DIR/rows_variants.md and DIR/rows_variants.json (command and commit inside).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_backend import calibrate as cal  # noqa: E402
from sim.transfers.routines import plan  # noqa: E402

CEILING_BYTES = 256 << 20
#: (label, routine, item bytes, items)
SHAPES = [
    ("index-K page 8448 B", "dsa_indexer_per_layer", 8448, 16384),
    ("token row 1152 B", "kernel_per_layer", 1152, 16384),
    ("token row 1152 B", "kernel_per_layer", 1152, 65536),
    ("token row 576 B", "kernel_per_layer", 576, 32768),
    ("token row 1024 B", "kernel_per_layer", 1024, 4096),
    ("token row 128 B", "kernel_per_layer", 128, 1024),
]
WK = ((8, 8), (8, 16), (16, 4), (16, 8), (16, 16), (16, 32))
HINTS = (0, 1)
IDX = (0, 1)
LBS = (1024, 256)
#: (name, blocks per SM or None for quota, threads, launch bound it needs)
LAUNCHES = (("quota", None, 1024, 1024), ("sm1x1024", 1, 1024, 1024), ("sm2x512", 2, 512, 1024),
            ("sm4x256", 4, 256, 256), ("sm8x256", 8, 256, 256))

_VARIANT_BODY = r"""
template <int W> struct RvWord;
template <> struct RvWord<8> { typedef unsigned long long T; };
template <> struct RvWord<16> { typedef uint4 T; };

template <int H> __device__ __forceinline__ unsigned long long rv_ld8(const unsigned long long* p) {
  if (H == 0) return __ldg(p);
  unsigned long long v;
  asm volatile("ld.global.nc.L1::no_allocate.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}
template <int H> __device__ __forceinline__ uint4 rv_ld16(const uint4* p) {
  if (H == 0) return __ldg(p);
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <int H> __device__ __forceinline__ unsigned long long rv_ld(const unsigned long long* p) { return rv_ld8<H>(p); }
template <int H> __device__ __forceinline__ uint4 rv_ld(const uint4* p) { return rv_ld16<H>(p); }

template <typename T, int K, int H>
__device__ __forceinline__ void rv_copy_t(int lane, const char* s, char* d, long long nbytes) {
  const T* sw = reinterpret_cast<const T*>(s);
  T* dw = reinterpret_cast<T*>(d);
  const long long n = nbytes / (long long)sizeof(T);
  for (long long base = 0; base < n; base += (long long)K * KVR_WARP) {
    T v[K];
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const long long j = base + (long long)i * KVR_WARP + lane;
      if (j < n) v[i] = rv_ld<H>(sw + j);
    }
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const long long j = base + (long long)i * KVR_WARP + lane;
      if (j < n) __stcg(dw + j, v[i]);
    }
  }
}

template <int W, int K, int H>
__device__ __forceinline__ void rv_copy(int lane, const char* s, char* d, long long nbytes) {
  if (W == 16 && (((unsigned long long)s | (unsigned long long)d | (unsigned long long)nbytes) & 15ULL) == 0)
    rv_copy_t<uint4, K, H>(lane, s, d, nbytes);
  else
    rv_copy_t<unsigned long long, (W == 16 ? 2 * K : K), H>(lane, s, d, nbytes);
}

__device__ __forceinline__ long long rv_div(long long a, long long b, int shift) {
  if (b == 1) return a;
  if (shift >= 0) return a >> shift;   // arithmetic shift: floor division by 2^shift
  return floor_div(a, b);
}

template <int W, int K, int H, int I>
__device__ __forceinline__ void rv_rows(const Params& p) {
  KVR_WARP_PROLOGUE(p);
  if (I == 0) {
    for (long long r = 0; r < p.items_per_warp; ++r) {
      const long long item = r * warps + warp;
      if (item >= p.n_items) break;
      const long long si = floor_div(si_arr[item * p.index_stride], p.index_div);
      const long long di = floor_div(di_arr[item * p.index_stride], p.index_div);
      if (si < 0 || di < 0) continue;
      for (long long k = 0; k < p.n_layers; ++k) {
        const long long layer = layers[k];
        rv_copy<W, K, H>(lane, reinterpret_cast<const char*>(p.src) + unit_off(sl, layer, si),
                         reinterpret_cast<char*>(p.dst) + unit_off(dl, layer, di), p.item_bytes);
      }
    }
    return;
  }
  const long long b = p.index_div;
  const int shift = (b > 0 && (b & (b - 1)) == 0) ? (__ffsll(b) - 1) : -1;
  long long item = warp;
  long long rs = 0, rd = 0;
  if (item < p.n_items) { rs = si_arr[item * p.index_stride]; rd = di_arr[item * p.index_stride]; }
  for (; item < p.n_items; item += warps) {
    const long long si = rv_div(rs, b, shift), di = rv_div(rd, b, shift);
    const long long nxt = item + warps;
    if (nxt < p.n_items) { rs = si_arr[nxt * p.index_stride]; rd = di_arr[nxt * p.index_stride]; }
    if (si < 0 || di < 0) continue;
    for (long long k = 0; k < p.n_layers; ++k) {
      const long long layer = layers[k];
      rv_copy<W, K, H>(lane, reinterpret_cast<const char*>(p.src) + unit_off(sl, layer, si),
                       reinterpret_cast<char*>(p.dst) + unit_off(dl, layer, di), p.item_bytes);
    }
  }
}
"""


def variant_name(w: int, k: int, h: int, i: int, lb: int) -> str:
    return f"rv_w{w}_k{k}_h{h}_i{i}_b{lb}"


def variants() -> list[tuple[int, int, int, int, int]]:
    return [(w, k, h, i, lb) for (w, k), h, i, lb in itertools.product(WK, HINTS, IDX, LBS)]


def variant_source() -> str:
    from gpu_backend.providers import builtin_kernels as bk

    kernels = [f'extern "C" __global__ void __launch_bounds__({lb}) {variant_name(w, k, h, i, lb)}'
               f'(const Params p) {{ rv_rows<{w}, {k}, {h}, {i}>(p); }}'
               for w, k, h, i, lb in variants()]
    return bk.kernel_source() + _VARIANT_BODY + "\n".join(kernels) + "\n"


def launch_shape(name: str, per_sm, threads: int, n_items: int, sm_count: int) -> tuple[int, int, int]:
    """(blocks, threads, items per warp) of one launch shape for ``n_items`` items."""
    from gpu_backend.providers import builtin_kernels as bk

    if per_sm is None:
        return bk.quota_launch(n_items)
    wpb = threads // 32
    blocks = max(1, min(per_sm * sm_count, -(-n_items // wpb)))
    warps = blocks * wpb
    return blocks, threads, -(-n_items // warps)


def _kernel_args(torch, bmod, routine, src, dst, src_l, dst_l, args, device):
    """The builtin provider's kernel parameters for one copy, its index arrays on the device
    (``keep``: hold them while the kernel may run) and the parameter values pointing at them."""
    kp = bmod.kernel_params(routine, src, dst, src_l, dst_l, args)
    keep = [torch.from_numpy(np.ascontiguousarray(kp.src_idx)).to(device),
            torch.from_numpy(np.ascontiguousarray(kp.dst_idx)).to(device),
            torch.tensor(kp.layers, dtype=torch.int64).to(device)]
    vals = dict(kp.values, src_idx=keep[0].data_ptr(), dst_idx=keep[1].data_ptr(), layer_ids=keep[2].data_ptr())
    return kp, keep, vals


def run(out: Path, quick: bool) -> dict:
    import torch
    from cuda.bindings import driver

    from gpu_backend.providers import builtin as bmod
    from gpu_backend.providers import get_provider

    t0 = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    info = cal.device_info(torch, device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    reps, wu = (5, 1) if quick else (9, 2)
    timer = cal.Timer(device)
    torch.cuda._sleep(50_000_000)
    prov = cal.provider("builtin")
    mod = prov._module(device.index)
    mod.make_current()
    tc = time.perf_counter()
    cubin = np.frombuffer(bmod.compile_only(arch, variant_source()), dtype=np.uint8).copy()
    compile_s = time.perf_counter() - tc
    vmod = bmod._check(driver.cuModuleLoadData(cubin.ctypes.data), "cuModuleLoadData(variants)")
    funcs = {variant_name(*v): bmod._check(driver.cuModuleGetFunction(vmod, variant_name(*v).encode()),
                                          "cuModuleGetFunction") for v in variants()}
    print(f"compiled {len(funcs)} variants for {arch} in {compile_s:.1f} s", file=sys.stderr)

    big = max(CEILING_BYTES, max(int(n * ib * 5 // 4) + (1 << 20) for _, _, ib, n in SHAPES))
    arena = cal.Arena(device, big + (1 << 20))
    arena.host.copy_(torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8))
    ceiling_us = float(np.median(timer.times_us(
        lambda s: arena.dev[:CEILING_BYTES].copy_(arena.host[:CEILING_BYTES], non_blocking=True), reps, wu)))
    ceiling = CEILING_BYTES / ceiling_us / 1e3
    print(f"pinned H2D ceiling: {ceiling:.1f} GB/s", file=sys.stderr)
    sg_ok, sg_why = get_provider("sglang", require_available=False).available()
    rng = np.random.default_rng(7)
    rows = []
    for label, routine, ib, n in SHAPES:
        src_l, dst_l, args = cal.h2d_case(routine, n, ib, rng, "h2d")
        nbytes = plan(routine, src_l, dst_l, args).extents.total_bytes
        src, dst = arena.buffers(src_l, dst_l)
        row = {"case": label, "routine": routine, "item_bytes": ib, "n_items": n, "bytes": nbytes, "variants": {}}
        row["memcpy_gbps"] = nbytes / float(np.median(timer.times_us(
            lambda s: arena.dev[:nbytes].copy_(arena.host[:nbytes], non_blocking=True), reps, wu))) / 1e3
        # reference bytes: the shipped kernel
        arena.dev.fill_(0xA5)
        shipped = cal.staged_launch("builtin", routine, src, dst, src_l, dst_l, args, device)
        row["shipped_gbps"] = nbytes / float(np.median(timer.times_us(shipped, reps, wu))) / 1e3
        torch.cuda.synchronize(device)
        ref = dst.tensor.clone()
        if sg_ok:
            try:
                fn = cal.staged_launch("sglang", routine, src, dst, src_l, dst_l, args, device)
                row["sglang_gbps"] = nbytes / float(np.median(timer.times_us(fn, reps, wu))) / 1e3
            except Exception as e:  # noqa: BLE001 - a refusal is reported, not fatal
                row["sglang_note"] = str(e)[:200]
        kp, keep, base_vals = _kernel_args(torch, bmod, routine, src, dst, src_l, dst_l, args, device)
        for v in variants():
            vname = variant_name(*v)
            for lname, per_sm, threads, need in LAUNCHES:
                if need != v[4]:
                    continue
                blocks, thr, ipw = launch_shape(lname, per_sm, threads, kp.n_items, sm_count)
                vals = dict(base_vals, items_per_warp=ipw)
                block = bk_pack(vals)
                argp = np.array([block.ctypes.data], dtype=np.uint64)

                def go(stream, f=funcs[vname], b=blocks, t=thr, a=argp, _blk=block):
                    mod.make_current()
                    bmod._check(driver.cuLaunchKernel(f, b, 1, 1, t, 1, 1, 0,
                                                      driver.CUstream(int(stream.cuda_stream)),
                                                      a.ctypes.data, 0), "cuLaunchKernel")
                dst.tensor.fill_(0xA5)
                try:
                    us = float(np.median(timer.times_us(go, reps, wu)))
                except Exception as e:  # noqa: BLE001 - a launch failure is reported per variant
                    row["variants"][f"{vname}/{lname}"] = {"error": str(e)[:200]}
                    continue
                torch.cuda.synchronize(device)
                exact = bool(torch.equal(dst.tensor, ref))
                row["variants"][f"{vname}/{lname}"] = {"gbps": nbytes / us / 1e3, "us": us, "exact": exact,
                                                       "blocks": blocks, "threads": thr}
        rows.append(row)
        best = max((k for k in row["variants"] if "gbps" in row["variants"][k]),
                   key=lambda k: row["variants"][k]["gbps"])
        print(f"[{time.perf_counter() - t0:6.1f} s] {label} x {n}: memcpy {row['memcpy_gbps']:.1f}, shipped "
              f"{row['shipped_gbps']:.1f}, sglang {row.get('sglang_gbps', float('nan')):.1f}, best {best} "
              f"{row['variants'][best]['gbps']:.1f} GB/s", file=sys.stderr)
        del keep, ref
    sweep = _sweep_shapes(torch, driver, bmod, mod, funcs, timer, arena, device, sm_count, reps, wu) \
        if not quick else []
    from benchmarks.provenance import command, git_commit

    res = {"gpu": info["gpu"], "date": datetime.date.today().isoformat(), "info": info, "arch": arch,
           "sm_count": sm_count, "ceiling_gbps": ceiling, "ceiling_bytes": CEILING_BYTES, "reps": reps,
           "compile_s": round(compile_s, 1), "seconds": round(time.perf_counter() - t0, 1), "rows": rows,
           "sglang_available": [sg_ok, sg_why], "sweep_shapes": sweep,
           "provenance": {"command": command(), "commit": os.environ.get("KVRACE_COMMIT") or git_commit()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows_variants.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "rows_variants.md").write_text(markdown(res))
    return res


def _sweep_shapes(torch, driver, bmod, mod, funcs, timer, arena, device, sm_count, reps, wu) -> list:
    """Copy durations (us, medians) of the free sweep's copies (``race_doc``: host units
    ``0..t-1`` to device slots ``t..2t-1``, one layer) with the shipped kernel and every variant
    in every launch shape: the data a link refit of a changed kernel needs."""
    from sim.pools.layouts import HostLayout, PagedLayout

    out = []
    for b in (64, 128, 136, 256, 512, 1024):
        for t in (64, 256, 1024, 4096):
            src_l = HostLayout("host", "layer_first", 1, t, b)
            dst_l = PagedLayout("dev", 1, 2 * t, b)
            args = {"layer": 0, "src_indices": list(range(t)), "dst_indices": list(range(t, 2 * t))}
            src, dst = arena.buffers(src_l, dst_l)
            rec = {"bytes_per_token": b, "tokens": t, "us": {}}
            shipped = cal.staged_launch("builtin", "kernel_per_layer", src, dst, src_l, dst_l, args, device)
            rec["us"]["shipped/quota"] = float(np.median(timer.times_us(shipped, 2 * reps, wu)))
            kp, keep, base_vals = _kernel_args(torch, bmod, "kernel_per_layer", src, dst, src_l, dst_l, args, device)
            for v in variants():
                for lname, per_sm, threads, need in LAUNCHES:
                    if need != v[4]:
                        continue
                    blocks, thr, ipw = launch_shape(lname, per_sm, threads, kp.n_items, sm_count)
                    block = bk_pack(dict(base_vals, items_per_warp=ipw))
                    argp = np.array([block.ctypes.data], dtype=np.uint64)

                    def go(stream, f=funcs[variant_name(*v)], bl=blocks, th=thr, a=argp, _blk=block):
                        mod.make_current()
                        bmod._check(driver.cuLaunchKernel(f, bl, 1, 1, th, 1, 1, 0,
                                                          driver.CUstream(int(stream.cuda_stream)),
                                                          a.ctypes.data, 0), "cuLaunchKernel")
                    rec["us"][f"{variant_name(*v)}/{lname}"] = float(np.median(timer.times_us(go, reps, wu)))
            out.append(rec)
            del keep
    return out


def bk_pack(values: dict) -> np.ndarray:
    from gpu_backend.providers import builtin_kernels as bk
    return bk.pack_params(values)


def markdown(r: dict) -> str:
    """Per shape: the 12 fastest variant/launch pairs, then the fastest per launch shape."""
    c = r["ceiling_gbps"]
    lines = [f"<!-- command: {r['provenance']['command']} -->", f"<!-- commit: {r['provenance']['commit']} -->",
             "# Row-copy kernel variants, host -> device", "",
             f"{r['gpu']} ({r['arch']}, {r['sm_count']} SMs), {r['date']}. Pinned H2D ceiling (one "
             f"{r['ceiling_bytes'] >> 20} MiB cudaMemcpyAsync, same process): **{c:.1f} GB/s**. "
             f"Medians of {r['reps']} timings. exact: the variant's bytes equal the shipped kernel's.", ""]
    for row in r["rows"]:
        lines += [f"## {row['case']} x {row['n_items']} ({row['bytes'] / 1e6:.2f} MB)", "",
                  f"memcpy {row['memcpy_gbps']:.1f} GB/s ({row['memcpy_gbps'] / c:.2f}); shipped builtin "
                  f"{row['shipped_gbps']:.1f} ({row['shipped_gbps'] / c:.2f}); sglang "
                  + (f"{row['sglang_gbps']:.1f} ({row['sglang_gbps'] / c:.2f})" if "sglang_gbps" in row
                     else f"n/a ({row.get('sglang_note', 'unavailable')})"), "",
                  "| variant / launch | GB/s | of ceiling | exact |", "| --- | ---: | ---: | --- |"]
        ok = sorted(((k, v) for k, v in row["variants"].items() if "gbps" in v), key=lambda kv: -kv[1]["gbps"])
        for k, v in ok[:12]:
            lines.append(f"| {k} | {v['gbps']:.1f} | {v['gbps'] / c:.2f} | {v['exact']} |")
        per_launch: dict = {}
        for k, v in ok:
            per_launch.setdefault(k.split("/")[1], (k, v))
        lines += ["", "Fastest per launch shape: " + "; ".join(
            f"{ln} {kv[0].split('/')[0]} {kv[1]['gbps']:.1f}" for ln, kv in per_launch.items()), ""]
        bad = [k for k, v in row["variants"].items() if not v.get("exact", False)]
        if bad:
            lines += [f"NOT exact or failed: {', '.join(bad)}", ""]
    lines += [f"Compile {r['compile_s']} s, run {r['seconds']} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    r = run(a.out, a.quick)
    print((a.out / "rows_variants.md").read_text())
    return 0 if r["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
