"""Copy throughput of each kernel provider on host -> device transfers, on the present GPU.

    python benchmarks/bench_providers.py --out DIR [--quick]

Writes DIR/bench_providers.md (tables with GB/s and fractions, the GPU, the date) and
DIR/bench_providers.json.  Needs torch with CUDA; the builtin provider needs cuda-python and the
sglang provider apache-tvm-ffi and the sglang wheel (a provider that is missing is reported, not
fatal).

Transfers (pinned host pool, layer_first, to a device pool; random slots on both sides, 25 %
spare slots, so no two items are adjacent by design):

* index-K pages, 8,448 B (64 tokens x 132 B), ``dsa_indexer_per_layer``: 64, 1,024, 16,384 pages;
* token rows of 1,152 B and 576 B, ``kernel_per_layer``: 64, 1,024, 16,384 rows (576 B is not
  a multiple of 128, so SGLang's JIT hicache kernel refuses it);
* DeepSeek V4 C4 tokens, 584 B (576 B value + 8 B scale), ``dsv4_token``: 64, 1,024, 16,384.

Each provider runs the copy "staged" (``gpu_backend.calibrate.staged_launch``: its index arrays,
pointer tables or byte pieces made beforehand, as a provider holds them), timed with CUDA events
behind a spin kernel, median of the repetitions.  Baselines: one ``cudaMemcpyAsync``
(``copy_(non_blocking=True)``) of the same number of bytes, contiguous, and the pinned H2D ceiling
(256 MiB memcpy).  A second table times the providers' full ``launch()`` call, which also uploads
the index arrays (pageable host memory) on the stream each time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_backend import calibrate as cal  # noqa: E402
from sim.transfers.routines import plan  # noqa: E402

PROVIDERS = ("builtin", "torch", "sglang")
COUNTS = (64, 1024, 16384)
CASES = [  # (label, routine, item bytes)
    ("index-K page 8448 B", "dsa_indexer_per_layer", 8448),
    ("token row 1152 B", "kernel_per_layer", 1152),
    ("token row 576 B", "kernel_per_layer", 576),
    ("C4 token 584 B", "dsv4_token", cal.DSV4_TOKEN_BYTES),
]
CEILING_BYTES = 256 << 20


def _gbps(nbytes: int, us: float | None) -> float | None:
    return None if not us else nbytes / us / 1e3


def run(out: Path, quick: bool = False) -> dict:
    import torch

    from gpu_backend.providers import ProviderError, get_provider

    t0 = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    info = cal.device_info(torch, device)
    reps, wu = (5, 1) if quick else (9, 2)
    launch_reps = 3 if quick else 5
    rng = np.random.default_rng(7)
    timer = cal.Timer(device)
    torch.cuda._sleep(50_000_000)   # clocks up
    arena = cal.Arena(device, CEILING_BYTES + (1 << 20))
    ceiling_us = float(np.median(timer.times_us(
        lambda s: arena.dev[:CEILING_BYTES].copy_(arena.host[:CEILING_BYTES], non_blocking=True), reps, wu)))
    ceiling = CEILING_BYTES / ceiling_us / 1e3
    print(f"pinned H2D ceiling: {ceiling:.1f} GB/s ({CEILING_BYTES >> 20} MiB)", file=sys.stderr)

    available = {}
    for name in PROVIDERS:
        ok, why = get_provider(name, require_available=False).available()
        available[name] = (ok, why)
    rows = []
    for label, routine, ib in CASES:
        for n in COUNTS:
            src_l, dst_l, args = cal.h2d_case(routine, n, ib, rng, "h2d")
            nbytes = plan(routine, src_l, dst_l, args).extents.total_bytes
            src, dst = arena.buffers(src_l, dst_l)
            row = {"case": label, "routine": routine, "n_items": n, "item_bytes": ib, "bytes": nbytes,
                   "providers": {}}
            us = float(np.median(timer.times_us(
                lambda s: arena.dev[:nbytes].copy_(arena.host[:nbytes], non_blocking=True), reps, wu)))
            row["memcpy_us"], row["memcpy_gbps"] = us, _gbps(nbytes, us)
            for name in PROVIDERS:
                res: dict = {}
                ok, why = available[name]
                if not ok:
                    res["note"] = f"unavailable: {why}"
                else:
                    try:
                        fn = cal.staged_launch(name, routine, src, dst, src_l, dst_l, args, device)
                        us = float(np.median(timer.times_us(fn, reps, wu)))
                        res.update(staged_us=us, staged_gbps=_gbps(nbytes, us))
                        prov = cal.provider(name)
                        us = float(np.median(timer.times_us(
                            lambda s: prov.launch(routine, src, dst, src_l, dst_l, args, stream=s),
                            launch_reps, 1)))
                        res.update(launch_us=us, launch_gbps=_gbps(nbytes, us))
                    except (cal.NotStaged, ProviderError) as e:
                        res["note"] = f"not supported: {e}"
                row["providers"][name] = res
            b, s = row["providers"]["builtin"], row["providers"]["sglang"]
            row["builtin_over_sglang"] = (s["staged_us"] / b["staged_us"]
                                          if "staged_us" in b and "staged_us" in s else None)
            rows.append(row)
            print(f"[{time.perf_counter() - t0:6.1f} s] {label} x {n}: memcpy {row['memcpy_gbps']:.1f} GB/s; "
                  + ", ".join(f"{k} {v['staged_gbps']:.1f}" for k, v in row["providers"].items()
                              if "staged_gbps" in v), file=sys.stderr)
    result = {"gpu": info["gpu"], "date": datetime.date.today().isoformat(), "info": info,
              "ceiling_bytes": CEILING_BYTES, "ceiling_us": ceiling_us, "ceiling_gbps": ceiling,
              "reps": reps, "launch_reps": launch_reps, "seconds": round(time.perf_counter() - t0, 1),
              "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    import os

    from benchmarks.provenance import command, git_commit

    result["provenance"] = {"command": command(), "commit": os.environ.get("KVRACE_COMMIT") or git_commit()}
    (out / "bench_providers.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench_providers.md").write_text(f"<!-- command: {result['provenance']['command']} -->\n"
                                            f"<!-- commit: {result['provenance']['commit']} -->\n" + markdown(result))
    return result


def _f(x, fmt="{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown(r: dict) -> str:
    info = r["info"]
    lines = [
        "# Provider copy throughput, host -> device",
        "",
        f"{r['gpu']}, {r['date']}; driver {info.get('driver')}, torch {info.get('torch')}, CUDA {info.get('cuda')}"
        + (f", sglang {info['sglang_version']}" if info.get("sglang_version") else "")
        + (f", apache-tvm-ffi {info['tvm_ffi_version']}" if info.get("tvm_ffi_version") else "") + ".",
        f"Pinned H2D ceiling (one {r['ceiling_bytes'] >> 20} MiB cudaMemcpyAsync): **{r['ceiling_gbps']:.1f} GB/s**.",
        "",
        "Written by `benchmarks/bench_providers.py`.  Pinned host pool (layer_first) to a device pool, random",
        "slots on both sides.  GB/s = bytes the simulator's extents move / median time (CUDA events behind a",
        f"spin kernel, {r['reps']} repetitions).  Providers run staged: index arrays, pointer tables or byte",
        "pieces made beforehand, as the provider holds them.  `memcpy` is one cudaMemcpyAsync of the same",
        "bytes, contiguous.  n/a: the provider refuses the copy (see the JSON for the reason).",
        "",
        "## Throughput (GB/s)",
        "",
        "| transfer | items | MB | memcpy | builtin | torch | sglang |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        p = row["providers"]
        lines.append(f"| {row['case']} | {row['n_items']} | {row['bytes'] / 1e6:.2f} | {_f(row['memcpy_gbps'])} | "
                     + " | ".join(_f(p[k].get("staged_gbps")) for k in PROVIDERS) + " |")
    lines += ["", "## Fractions",
              "",
              "Of the contiguous memcpy of the same bytes, of the pinned H2D ceiling, and builtin / sglang "
              "(sglang's time over builtin's: above 1 means builtin is faster).",
              "",
              "| transfer | items | builtin / memcpy | torch / memcpy | sglang / memcpy | builtin / ceiling | "
              "torch / ceiling | sglang / ceiling | **builtin / sglang** |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        p = row["providers"]
        g = [p[k].get("staged_gbps") for k in PROVIDERS]
        mem = [None if x is None else x / row["memcpy_gbps"] for x in g]
        ceil = [None if x is None else x / r["ceiling_gbps"] for x in g]
        lines.append(f"| {row['case']} | {row['n_items']} | " + " | ".join(_f(x, "{:.2f}") for x in mem + ceil)
                     + f" | **{_f(row['builtin_over_sglang'], '{:.2f}')}** |")
    lines += ["", "## Through `Provider.launch()` (GB/s)", "",
              "The full call a replay makes: it also uploads the index arrays (from pageable memory) on the "
              f"stream each time ({r['launch_reps']} repetitions).", "",
              "| transfer | items | builtin | torch | sglang |", "| --- | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        p = row["providers"]
        lines.append(f"| {row['case']} | {row['n_items']} | "
                     + " | ".join(_f(p[k].get("launch_gbps")) for k in PROVIDERS) + " |")
    notes = sorted({f"{k}: {v['note']}" for row in r["rows"] for k, v in row["providers"].items() if "note" in v})
    if notes:
        lines += ["", "Refusals:", ""] + [f"- {n}" for n in notes]
    lines += ["", f"Run time {r['seconds']} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for bench_providers.md and .json")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_providers: needs torch with CUDA", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print(f"bench_providers: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 3
    r = run(args.out, args.quick)
    print((args.out / "bench_providers.md").read_text())
    return 0 if r["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
