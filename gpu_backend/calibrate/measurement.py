"""GPU side: timing (CUDA events behind a spin kernel) and ``measure``, which runs a level's
measurements on the present GPU."""
from __future__ import annotations

import sys
import time
from typing import Callable

import numpy as np

from gpu_backend.calibrate.fit import fit_spin, spin_cycles_for
from gpu_backend.calibrate.levels import _shape_bytes, DSV4_TOKEN_BYTES, GIB, Level, MIB, Shapes
from gpu_backend.calibrate.model import model_rounds
from gpu_backend.calibrate.staged import _view, NotStaged, provider, staged_launch


class Timer:
    """Times ``fn(stream)`` with CUDA events, each repetition behind a spin kernel; ``fn`` runs
    with the timer's stream current, so plain torch ops inside it go to that stream too."""

    def __init__(self, device, spin_cycles: int = 200_000):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.spin_cycles = int(spin_cycles)

    def times_us(self, fn: Callable, reps: int, warmup: int = 2, spin_cycles: int | None = None) -> np.ndarray:
        torch = self.torch
        spin = self.spin_cycles if spin_cycles is None else int(spin_cycles)
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                fn(self.stream)
        torch.cuda.synchronize(self.device)
        pairs = []
        with torch.cuda.stream(self.stream):
            for _ in range(reps):
                if spin:
                    torch.cuda._sleep(spin)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(self.stream)
                fn(self.stream)
                b.record(self.stream)
                pairs.append((a, b))
        self.stream.synchronize()
        return np.array([a.elapsed_time(b) * 1e3 for a, b in pairs])


def summary(us: np.ndarray) -> dict:
    return {"us_median": float(np.median(us)), "us_p10": float(np.percentile(us, 10)),
            "us_p90": float(np.percentile(us, 90)),
            "us_rel_sd": float(np.std(us) / np.mean(us)) if np.mean(us) > 0 else 0.0}


def _append(table: dict, **row) -> None:
    for k, v in row.items():
        table.setdefault(k, []).append(v)


def h2d_case(routine: str, n_items: int, item_bytes: int, rng: np.random.Generator,
             direction: str = "h2d"):
    """(src layout, dst layout, args) of one copy between a pinned host pool (layer_first) and a
    device pool, random slots on both sides, 25 % spare slots."""
    from sim.pools.layouts import HostLayout, PagedLayout, c4_paged

    if routine == "dsv4_token":
        pages = max(1, -(-n_items * 5 // 4 // 64))
        c4 = c4_paged(1, pages)
        host = HostLayout("host", "layer_first", 1, pages, c4.page_bytes, 1, 64, c4.fields)
        s = rng.permutation(pages * 64)[:n_items]
        d = rng.permutation(pages * 64)[:n_items]
        src, dst = (host, c4) if direction == "h2d" else (c4, host)
        return src, dst, {"src_indices": s.tolist(), "dst_indices": d.tolist()}
    units = max(2, n_items * 5 // 4)
    host = HostLayout("host", "layer_first", 1, units, item_bytes)
    dev = PagedLayout("dev", 1, units, item_bytes)
    s, d = rng.permutation(units)[:n_items], rng.permutation(units)[:n_items]
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    if routine == "dsa_indexer_per_layer":
        ps = 64
        s = (s[:, None] * ps + np.arange(ps)).ravel()
        d = (d[:, None] * ps + np.arange(ps)).ravel()
        return src, dst, {"layer": 0, "src_indices": s.tolist(), "dst_indices": d.tolist(), "page_size": ps}
    return src, dst, {"layer": 0, "src_indices": s.tolist(), "dst_indices": d.tolist()}


class Arena:
    """One pinned host and one device allocation; layouts are laid over their starts."""

    def __init__(self, device, nbytes: int):
        import torch

        self.nbytes = int(nbytes)
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.host.fill_(0x5A)
        self.dev.fill_(0xA5)

    def buffers(self, src_layout, dst_layout):
        def side(layout):
            if layout.nbytes > self.nbytes:
                raise ValueError(f"layout {layout.name} needs {layout.nbytes} bytes; the arena has {self.nbytes}")
            t = self.host if layout.kind == "host" else self.dev
            return _view(t[:layout.nbytes])
        return side(src_layout), side(dst_layout)


def device_info(torch, device) -> dict:
    props = torch.cuda.get_device_properties(device)
    info = {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "sm_count_reported": int(props.multi_processor_count),
            "memory_gib": round(props.total_memory / GIB, 1),
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        from cuda.bindings import driver
        err, v = driver.cuDriverGetVersion()
        if int(err) == 0:
            info["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:
        pass
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            info["driver"] = out.stdout.strip().splitlines()[0]
    except Exception:
        pass
    info.setdefault("driver", info.get("cuda_driver_api", "unknown"))
    for mod in ("cuda.bindings", "tvm_ffi"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod.replace(".", "_") + "_version"] = str(getattr(m, "__version__", "?"))
        except Exception:
            pass
    try:
        from importlib.metadata import version
        info["sglang_version"] = version("sglang")
    except Exception:
        pass
    return info


def resident_warps_per_sm(torch, device) -> tuple[int, str]:
    """Occupancy of the builtin warp-per-item kernel at 1,024 threads (blocks per SM x 32)."""
    try:
        from cuda.bindings import driver

        mod = provider("builtin")._module(device.index)
        err, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(mod.functions["kvr_dsv4"], 1024, 0)
        if int(err) == 0 and int(blocks) > 0:
            return int(blocks) * 32, "cuOccupancyMaxActiveBlocksPerMultiprocessor(kvr_dsv4, 1024 threads)"
    except Exception as e:   # fall back to the hardware limit, say so
        why = f"{type(e).__name__}: {e}"
    else:
        why = "occupancy query failed"
    props = torch.cuda.get_device_properties(device)
    per_sm = int(getattr(props, "max_threads_per_multi_processor", 2048))
    return (per_sm // 1024) * 32, f"hardware limit ({why})"


def _log(msg: str, t0: float) -> None:
    print(f"[calibrate {time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def measure(level: Level, device=None, providers: tuple[str, ...] = ("builtin",), seed: int = 0) -> tuple[dict, dict]:
    """Run the measurements of ``level`` on the GPU; ``(measurements, info)``."""
    import torch

    from gpu_backend.providers import ProviderError

    t0 = time.perf_counter()
    device = torch.device(device or "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    rng = np.random.default_rng(seed)
    info = device_info(torch, device)
    info["level"] = level.name
    meas: dict[str, dict] = {}
    timer = Timer(device)
    reps, wu = level.reps, level.warmup

    # ---- spin kernel: cycles per us first (it sizes the pre-spin of everything else)
    torch.cuda._sleep(50_000_000)   # let the clocks come up
    torch.cuda.synchronize(device)
    sc: dict = {}
    for c in level.spin_cycles:
        us = timer.times_us(lambda s, c=c: torch.cuda._sleep(c), reps, wu, spin_cycles=100_000)
        _append(sc, cycles=int(c), **summary(us))
    meas["spin_cycles"] = sc
    spin_fit = fit_spin(sc["cycles"], sc["us_median"])
    cpu = spin_fit["cycles_per_us"]
    timer.spin_cycles = spin_cycles_for(100.0, cpu)
    sp: dict = {}
    for req in level.spin_requested_us:
        cyc = spin_cycles_for(req, cpu, spin_fit["floor_us"])
        us = timer.times_us(lambda s, c=cyc: torch.cuda._sleep(c), reps, wu)
        _append(sp, requested_us=float(req), cycles=cyc, **summary(us))
    meas["spin"] = sp
    _log(f"spin: {cpu:.0f} cycles/us, floor {spin_fit['floor_us']:.2f} us", t0)

    # ---- device facts and the launch floor
    props = torch.cuda.get_device_properties(device)
    rw_sm, rw_how = resident_warps_per_sm(torch, device)
    meas["device"] = {"sm_count": int(props.multi_processor_count), "resident_warps_per_sm": rw_sm,
                      "resident_warps_source": rw_how,
                      "max_warps_per_sm": int(getattr(props, "max_threads_per_multi_processor", 2048)) // 32}
    tiny_d = torch.zeros(64, dtype=torch.float32, device=device)
    tiny_h = torch.zeros(64, dtype=torch.float32, pin_memory=True)
    launch = {"event_floor_us": float(np.median(timer.times_us(lambda s: None, reps, wu))),
              "tiny_kernel_us": float(np.median(timer.times_us(lambda s: tiny_d.add_(1), reps, wu))),
              "tiny_memcpy_h2d_us": float(np.median(timer.times_us(
                  lambda s: tiny_d.copy_(tiny_h, non_blocking=True), reps, wu)))}
    meas["launch"] = launch

    # ---- memcpy by size, both directions
    arena_bytes = max([*level.memcpy_bytes, *_shape_bytes(level.kpl), *_shape_bytes(level.d2h),
                       *_shape_bytes(level.sglang_kpl),
                       *(-(-n * 5 // 4 // 64) * 37440 for n in level.dsv4_items)]) + MIB
    arena = Arena(device, arena_bytes)
    for direction in ("h2d", "d2h"):
        tab: dict = {}
        for nb in level.memcpy_bytes:
            dst, src = (arena.dev, arena.host) if direction == "h2d" else (arena.host, arena.dev)
            us = timer.times_us(lambda s, a=dst[:nb], b=src[:nb]: a.copy_(b, non_blocking=True), reps, wu)
            _append(tab, bytes=int(nb), **summary(us))
        tab["gbps"] = [b / u / 1e3 for b, u in zip(tab["bytes"], tab["us_median"])]
        meas[f"memcpy_{direction}"] = tab
        _log(f"memcpy {direction}: {tab['gbps'][-1]:.1f} GB/s at {tab['bytes'][-1] // MIB} MiB", t0)

    # ---- kernel copies
    def kernel_rows(table: dict, provider: str, routine: str, shapes: Shapes, direction: str):
        for ib, counts in shapes:
            for n in counts:
                src_l, dst_l, args = h2d_case(routine, n, ib, rng, direction)
                src, dst = arena.buffers(src_l, dst_l)
                try:
                    run = staged_launch(provider, routine, src, dst, src_l, dst_l, args, device)
                except (NotStaged, ProviderError) as e:
                    _log(f"{provider} {routine} {ib} B x {n}: not run ({e})", t0)
                    continue
                us = timer.times_us(run, reps, wu)
                nb = n * ib
                _append(table, provider=provider, routine=routine, n_items=int(n), item_bytes=int(ib),
                        bytes=int(nb), rounds=model_rounds(routine, n, ib, meas["device"]["sm_count"] * rw_sm),
                        **summary(us))

    kh: dict = {}
    kernel_rows(kh, "builtin", "kernel_per_layer", level.kpl, "h2d")
    kernel_rows(kh, "builtin", "dsv4_token", ((DSV4_TOKEN_BYTES, level.dsv4_items),), "h2d")
    _log(f"builtin kernels H2D: {len(kh.get('us_median', []))} shapes", t0)
    if "sglang" in providers and level.sglang_kpl:
        from gpu_backend.providers import get_provider
        ok, why = get_provider("sglang", require_available=False).available()
        info["sglang_measured"] = ok
        if ok:
            kernel_rows(kh, "sglang", "kernel_per_layer", level.sglang_kpl, "h2d")
            kernel_rows(kh, "sglang", "dsv4_token", ((DSV4_TOKEN_BYTES, level.dsv4_items),), "h2d")
            _log("sglang kernels H2D measured", t0)
        else:
            info["sglang_unavailable"] = why
            _log(f"sglang not measured: {why}", t0)
    meas["kernel_h2d"] = kh
    kd: dict = {}
    kernel_rows(kd, "builtin", "kernel_per_layer", level.d2h, "d2h")
    meas["kernel_d2h"] = kd
    del arena
    torch.cuda.empty_cache()

    # ---- HBM: device-to-device
    a = torch.empty(level.hbm_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = timer.times_us(lambda s: b.copy_(a, non_blocking=True), max(3, reps // 2), wu)
    meas["hbm"] = {"bytes": [int(level.hbm_bytes)], **{k: [v] for k, v in summary(us).items()}}
    del a, b
    torch.cuda.empty_cache()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    _log("done", t0)
    return meas, info
