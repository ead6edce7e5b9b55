"""The ``builtin`` provider: kvrace's own CUDA kernels, compiled at run time with NVRTC.

NVRTC and the driver API come from cuda-python (``cuda.bindings``), which SGLang itself
requires, so it is present wherever SGLang runs; docs/gpu_backend.md says why this and not CuPy
or torch's extension builder.  Kernels are compiled to a cubin for the GPU present
(``sm_<major><minor>`` from torch), loaded into torch's primary context and launched on the
torch stream's handle.  ``compile_only(arch)`` builds for any architecture NVRTC knows without
a GPU.

``direct_per_layer`` is a host routine in SGLang too (one cudaMemcpyAsync per coalesced run):
the builtin provider issues ``cuMemcpyAsync`` for each piece, with addresses from the layout
parameters (``base.direct_pieces``).

``direct_page_first`` is SGLang's page-first direct backend (``transfer_kv_per_layer_direct_pf_lf``
/ ``transfer_kv_all_layer_direct_lf_pf``): one ``cuMemcpyAsync`` per page on the copy engine,
page by page (a page that is not contiguous on one side is cut into its contiguous pieces).

``staged_all_layer_lf_pf`` follows the launch structure of SGLang's
``transfer_hicache_all_layer_mla_staged_lf_pf``: the pages are taken in chunks of at most
``min(host pages, 64)`` pages (the staging capacity of SGLang's page_first host pool); for each
chunk the ``kvr_stage_pages`` kernel gathers the chunk's pages (every layer) into a dense GPU
staging buffer in page_first host order, then one ``cuMemcpyAsync`` per page moves the staged page
to the host, all on the one stream, so the next chunk's gather waits for these copies.
NOTE: SGLang uses ``cudaMemcpyBatchAsync`` instead of per-page copies when a page is at least
128 KiB and the driver is 12.8 or newer; the bytes are the same, the copy engine schedule may
differ.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from gpu_backend.providers import base
from gpu_backend.providers import builtin_kernels as bk

NAME = "builtin"


def _bindings():
    from cuda.bindings import driver, nvrtc
    return driver, nvrtc


def _check(result, what: str):
    """Unpack a cuda.bindings ``(err, *values)`` tuple, raising with the call's name."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise base.ProviderError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def compile_only(arch: str, source: str | None = None) -> bytes:
    """Compile the builtin kernels (or ``source``, a CUDA C++ translation unit without includes)
    for ``arch`` ("sm_90", "sm_120", ...) and return the cubin.

    Needs NVRTC only (no GPU).  Raises ProviderError with NVRTC's log when it fails, or when NVRTC
    does not know the architecture.
    """
    if not (arch.startswith("sm_") and arch[3:].isdigit()):
        raise base.ProviderError(f"arch: expected 'sm_<digits>' such as 'sm_90' or 'sm_120', got {arch!r}")
    _, nvrtc = _bindings()
    known = _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    if int(arch[3:]) not in known:
        raise base.ProviderError(f"arch {arch}: this NVRTC ({_nvrtc_version()}) supports "
                                 f"{['sm_%d' % a for a in known]}; expected one of those")
    src = (bk.kernel_source() if source is None else source).encode()
    prog = _check(nvrtc.nvrtcCreateProgram(src, b"kvrace_builtin.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-lineinfo"]
    try:
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise base.ProviderError(f"NVRTC could not compile the builtin kernels for {arch}: "
                                     f"{err!r}\n{log.decode(errors='replace')}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_version() -> str:
    _, nvrtc = _bindings()
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"NVRTC {major}.{minor}"


class _Module:
    """The loaded cubin of one device and its kernel handles."""

    def __init__(self, device_index: int, arch: str):
        driver, _ = _bindings()
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self.cubin = np.frombuffer(compile_only(arch), dtype=np.uint8).copy()
        self.module = _check(driver.cuModuleLoadData(self.cubin.ctypes.data), f"cuModuleLoadData({arch})")
        self.functions = {k: _check(driver.cuModuleGetFunction(self.module, k.encode()),
                                    f"cuModuleGetFunction({k})")
                          for k in set(bk.KERNELS.values()) | {bk.WIDE_KERNEL}}

    def make_current(self):
        driver, _ = _bindings()
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


@dataclass
class KernelParams:
    """One builtin kernel launch, short of the device pointers of its index arrays."""

    src_idx: np.ndarray
    dst_idx: np.ndarray
    layers: list[int]
    n_items: int
    shape: tuple[int, int]          # (blocks, threads)
    values: dict                    # pack_params values; src_idx/dst_idx/layer_ids still to fill
    kernel: str = ""                # the kernel's name (bk.KERNELS[routine] or bk.WIDE_KERNEL)


def kernel_params(routine: str, src, dst, src_layout, dst_layout, args: Mapping,
                  sm_count: int | None = None) -> KernelParams:
    """Parameters of the kernel that runs ``routine`` (not ``direct_per_layer``, a host routine).

    With ``sm_count`` (the device's SMs), a row routine moving at least ``bk.WIDE_MIN_BYTES``
    runs ``kvr_rows_wide`` on one block per SM (``bk.uses_wide``); without it, or below that
    size, the sgl-kernel launch shape of ``kvr_rows``."""
    sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
    s, d = base.index_pair(args)
    layers = base.routine_layers(routine, src_layout, args)
    values = {"src": src.ptr, "dst": dst.ptr, "n_layers": len(layers), "index_stride": 1, "index_div": 1,
              **bk.lay_values("src", sp), **bk.lay_values("dst", dp)}
    if routine == "dsa_indexer_per_layer":
        ps = base.dsa_page_size(args)
        n = s.size // ps
        values.update(index_stride=ps, index_div=ps)
    else:
        n = s.size
    blocks, threads, ipw = bk.warp_per_item_launch(n) if routine == "dsv4_token" else bk.quota_launch(n)
    if routine == "token_bytewise":
        values.update(n_fields=len(sp.fields), f_src_off=[f[0] for f in sp.fields],
                      f_dst_off=[f[0] for f in dp.fields], f_len=[f[1] for f in sp.fields])
    else:
        values["item_bytes"] = _item_bytes(routine, src_layout, dst_layout, args)
    kernel = bk.KERNELS[routine]
    if sm_count and bk.uses_wide(routine, n, len(layers), values.get("item_bytes", 0)):
        blocks, threads, ipw = bk.wide_launch(n, sm_count)
        kernel = bk.WIDE_KERNEL
    values.update(n_items=n, items_per_warp=ipw)
    return KernelParams(s, d, layers, n, (blocks, threads), values, kernel)


class BuiltinProvider:
    name = NAME

    def available(self) -> tuple[bool, str]:
        try:
            _bindings()
        except ImportError as e:
            return False, (f"cuda-python is not importable ({e}); expected the cuda-bindings package "
                           "(pip install cuda-python), which SGLang also requires")
        return base.torch_cuda_status()

    def supports(self, routine: str, src_layout, dst_layout, args: Mapping) -> tuple[bool, str]:
        base.check_routine(routine)
        args = base.as_mapping(args)
        sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
        layers = base.routine_layers(routine, src_layout, args)
        why = base.simulator_refusal(routine, src_layout, dst_layout, args)
        if why:
            return False, why
        if routine == "direct_page_first":
            return True, ""
        if routine == "staged_all_layer_lf_pf":
            if sp.unit_bytes % bk.STAGE_VEC_BYTES:
                return False, (f"src unit_bytes {sp.unit_bytes} is not a multiple of "
                               f"{bk.STAGE_VEC_BYTES}: the staged gather moves 16-byte vectors")
            return True, ""
        if routine == "direct_per_layer":
            if sp.unit_bytes != dp.unit_bytes:
                return False, (f"direct copy: src unit_bytes {sp.unit_bytes} != dst unit_bytes "
                               f"{dp.unit_bytes}; expected equal units")
            return True, ""
        if routine in ("kernel_per_layer", "kernel_all_layer", "dsa_indexer_per_layer"):
            ib = _item_bytes(routine, src_layout, dst_layout, args)
            bad = [(n, v) for n, v in (("item_bytes", ib), ("src unit_bytes", sp.unit_bytes),
                                       ("dst unit_bytes", dp.unit_bytes)) if v % 8]
            if bad:
                return False, (f"{bad[0][0]} is {bad[0][1]}: the warp copy moves 8-byte words and "
                               "needs 8-byte aligned units and items (as sgl-kernel does)")
            return True, ""
        if routine == "dsv4_token":
            for L in layers:
                for side, p in (("src", sp), ("dst", dp)):
                    if base.layer_base(p, L) % 8:
                        return False, (f"{side} layer {L} starts at byte {base.layer_base(p, L)}, "
                                       "not a multiple of 8: the C4 copy moves 8-byte words")
            return True, ""
        if len(sp.fields) > bk.MAX_FIELDS:
            return False, f"the layout has {len(sp.fields)} fields; the kernel takes at most {bk.MAX_FIELDS}"
        if [f[1] for f in sp.fields] != [f[1] for f in dp.fields]:
            return False, (f"per-token fields differ: src entry bytes {[f[1] for f in sp.fields]}, dst "
                           f"{[f[1] for f in dp.fields]}; expected the same fields on both sides")
        return True, ""

    @functools.cached_property
    def _torch(self):
        import torch
        return torch

    @functools.lru_cache(maxsize=None)
    def _module(self, device_index: int) -> _Module:
        major, minor = self._torch.cuda.get_device_capability(device_index)
        return _Module(device_index, f"sm_{major}{minor}")

    @functools.lru_cache(maxsize=None)
    def _sm_count(self, device_index: int) -> int:
        return int(self._torch.cuda.get_device_properties(device_index).multi_processor_count)

    def launch(self, routine: str, src, dst, src_layout, dst_layout, args: Mapping,
               stream=None, item_range: tuple[int, int] | None = None) -> None:
        torch = self._torch
        ok, why = self.supports(routine, src_layout, dst_layout, args)
        if not ok:
            raise base.ProviderError(f"builtin cannot run {routine}: {why}")
        args = base.slice_args(routine, args, item_range)
        device = _device_of(torch, src, dst)
        stream = torch.cuda.current_stream(device) if stream is None else stream
        mod = self._module(device.index)
        mod.make_current()
        sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
        if routine == "direct_per_layer":
            self._direct(mod, src, dst, sp, dp, args, stream)
            return
        if routine == "direct_page_first":
            self._memcpy_pieces(src, dst, base.page_pieces(routine, src_layout, dst_layout, args), stream)
            return
        if routine == "staged_all_layer_lf_pf":
            self._staged(mod, src, dst, src_layout, dst_layout, args, stream, device)
            return
        kp = kernel_params(routine, src, dst, src_layout, dst_layout, args, self._sm_count(device.index))
        if kp.n_items == 0:
            return
        s, d, layers, values = kp.src_idx, kp.dst_idx, kp.layers, kp.values
        with torch.cuda.stream(stream):
            # allocated on the launch stream, so the caching allocator keeps them until it passes
            s_dev = torch.from_numpy(np.ascontiguousarray(s)).to(device, non_blocking=True)
            d_dev = torch.from_numpy(np.ascontiguousarray(d)).to(device, non_blocking=True)
            l_dev = torch.tensor(layers, dtype=torch.int64).to(device, non_blocking=True)
        values.update(src_idx=s_dev.data_ptr(), dst_idx=d_dev.data_ptr(), layer_ids=l_dev.data_ptr())
        self._launch(mod, kp.kernel, kp.shape, values, stream)

    @staticmethod
    def _launch(mod: _Module, kernel: str, shape: tuple[int, int], values: dict, stream) -> None:
        driver, _ = _bindings()
        block = bk.pack_params(values)
        arg_ptrs = np.array([block.ctypes.data], dtype=np.uint64)
        blocks, threads = shape
        _check(driver.cuLaunchKernel(mod.functions[kernel], blocks, 1, 1, threads, 1, 1, 0,
                                     driver.CUstream(int(stream.cuda_stream)),
                                     arg_ptrs.ctypes.data, 0),
               f"cuLaunchKernel({kernel}, grid {blocks}, block {threads})")

    @staticmethod
    def _direct(mod: _Module, src, dst, sp, dp, args: Mapping, stream) -> None:
        driver, _ = _bindings()
        s, d = base.index_pair(args)
        h = driver.CUstream(int(stream.cuda_stream))
        for so, do, n in base.direct_pieces(sp, dp, int(args["layer"]), s, d):
            _check(driver.cuMemcpyAsync(dst.ptr + do, src.ptr + so, n, h),
                   f"cuMemcpyAsync({n} bytes)")


    @staticmethod
    def _memcpy_pieces(src, dst, pages: list, stream) -> None:
        """One cuMemcpyAsync per ``(src_offset, dst_offset, nbytes)`` piece, page by page."""
        driver, _ = _bindings()
        h = driver.CUstream(int(stream.cuda_stream))
        for piece in pages:
            for so, do, n in piece.tolist():
                _check(driver.cuMemcpyAsync(dst.ptr + do, src.ptr + so, n, h), f"cuMemcpyAsync({n} bytes)")

    def _staged(self, mod: _Module, src, dst, src_layout, dst_layout, args: Mapping, stream, device) -> None:
        """Gather a chunk of pages into the staging buffer, copy each staged page to the host,
        next chunk (class docstring of the module)."""
        torch = self._torch
        driver, _ = _bindings()
        sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
        s, _ = base.index_pair(args)
        ps = int(args["page_size"])
        n_pages = s.size // ps
        if n_pages == 0:
            return
        layers = base.routine_layers("staged_all_layer_lf_pf", src_layout, args)
        ib = _item_bytes("staged_all_layer_lf_pf", src_layout, dst_layout, args)
        page_bytes = ps * len(layers) * ib
        cap = staging_page_capacity(dp, ps)
        pieces = base.page_pieces("staged_all_layer_lf_pf", src_layout, dst_layout, args)
        with torch.cuda.stream(stream):
            # on the launch stream: the caching allocator reuses them only after this stream's work
            staging = torch.empty(cap * page_bytes, dtype=torch.uint8, device=device)
            first = torch.from_numpy(np.ascontiguousarray(s[::ps])).to(device, non_blocking=True)
            l_dev = torch.tensor(layers, dtype=torch.int64).to(device, non_blocking=True)
        h = driver.CUstream(int(stream.cuda_stream))
        for begin in range(0, n_pages, cap):
            n = min(cap, n_pages - begin)
            blocks, threads, _ = bk.stage_launch(n, ps, len(layers), ib)
            values = {"src": src.ptr, "dst": staging.data_ptr(), "src_idx": first.data_ptr() + 8 * begin,
                      "layer_ids": l_dev.data_ptr(), "n_layers": len(layers), "n_items": n,
                      "item_bytes": ib, "page_tokens": ps,
                      **bk.lay_values("src", sp), **bk.lay_values("dst", dp)}
            self._launch(mod, bk.KERNELS["staged_all_layer_lf_pf"], (blocks, threads), values, stream)
            for k in range(n):
                at = staging.data_ptr() + k * page_bytes
                for _, do, nbytes in pieces[begin + k].tolist():
                    _check(driver.cuMemcpyAsync(dst.ptr + do, at, nbytes, h), f"cuMemcpyAsync({nbytes} bytes)")
                    at += nbytes


def staging_page_capacity(dst_params: base.LayoutParams, page_size: int) -> int:
    """Pages per staging chunk: ``min(host pages, 64)`` as SGLang's page_first host pool sizes its
    staging buffer (``min(page_num, _WRITE_BACK_STAGING_PAGE_CHUNK)``), at least one."""
    return max(1, min(dst_params.units // page_size, base.STAGING_PAGE_CHUNK))


def _item_bytes(routine: str, src_layout, dst_layout, args: Mapping) -> int:
    if routine == "dsa_indexer_per_layer":
        return int(src_layout.unit_bytes)
    if args.get("item_bytes") is not None:
        return int(args["item_bytes"])
    return int(src_layout.unit_bytes)


def _device_of(torch, src, dst):
    for buf in (dst, src):
        dev = buf.tensor.device
        if dev.type == "cuda":
            return dev
    raise base.ProviderError("neither buffer is on a CUDA device; expected at least one device buffer")
