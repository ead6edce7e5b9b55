"""The ``sglang`` provider: the real kernels of an installed SGLang.

* ``dsv4_token``: ``sglang.jit_kernel.hisparse.transfer_cache_dsv4_mla`` with per-layer pointer
  tables (layer base = unit 0 of the layer), whatever geometry the buffers really have.
* ``kernel_per_layer`` / ``dsa_indexer_per_layer``: ``sglang.jit_kernel.hicache.
  transfer_hicache_one_layer_mla`` on strided ``(units, item_bytes)`` views, where its rules
  allow: ``item_bytes % 128 == 0`` (``can_use_hicache_jit_kernel``), a constant unit stride on
  both sides (not page_first_direct with page_size > 1), every index in range and none negative
  (the JIT kernel does not skip negatives).  ``kernel_all_layer``: ``transfer_hicache_all_layer_mla``
  with per-layer pointer tables and the two unit strides, under the same rules.
* Where ``sgl_kernel.kvcacheio`` is importable, the AOT kernels take the rest: ``transfer_kv_per_layer_mla``
  (layer-major to layer-major, item = unit), ``transfer_kv_per_layer_mla_pf_lf`` (page_first host
  to layer-major), ``transfer_kv_all_layer_mla`` / ``_lf_pf``, and ``transfer_kv_direct`` for
  ``direct_per_layer`` on layer-major layouts.  These skip negative indices as sgl-kernel does.
* ``direct_page_first``: ``sgl_kernel.transfer_kv_per_layer_direct_pf_lf`` (page_first_direct
  host -> device, ``layer_id`` = the copy's layer) or ``transfer_kv_all_layer_direct_lf_pf``
  (device -> host) with one layer's device rows as the only source and the host pool viewed from
  that layer on (so the kernel's layer 0 is the copy's layer).  The host pool is handed over as
  SGLang's ``(pages, layers, page_size, unit)`` tensor; host indices stay on the CPU, device
  indices on the GPU, as ``memory_pool_host`` passes them.
* ``staged_all_layer_lf_pf``: ``sglang.jit_kernel.hicache.transfer_hicache_all_layer_mla_staged_lf_pf``
  with a per-layer pointer table, a staging buffer of ``min(host pages, 64)`` pages
  (``_WRITE_BACK_STAGING_PAGE_CHUNK``), the host pool as ``(units, layers, 1, item)`` and the
  host indices on the CPU.  Its relayout kernel addresses source token ``t`` of a layer at
  ``ptr[layer] + t * element_size``, so it runs only where the device rows are ``item_bytes``
  apart (a layer-major device source with ``unit_bytes == item_bytes``).
* ``token_bytewise`` is kvrace's candidate fix: SGLang has no kernel for it.

The JIT modules are imported through ``gpu_backend.sglang_shim`` and built by apache-tvm-ffi on
first use (seconds per kernel variant); calls run on the given stream through
``tvm_ffi.use_torch_stream``.
"""
from __future__ import annotations

import functools
from typing import Mapping

import numpy as np

from gpu_backend import sglang_shim
from gpu_backend.providers import base

NAME = "sglang"
JIT_ELEMENT_ALIGN = 128


@functools.lru_cache(maxsize=None)
def _aot():
    """``sgl_kernel.kvcacheio`` or None (with the reason)."""
    try:
        import sgl_kernel.kvcacheio as kv
        return kv, ""
    except Exception as e:   # its import loads compiled ops; any failure means "not usable"
        return None, f"sgl_kernel.kvcacheio is not importable ({type(e).__name__}: {e})"


def _item_bytes(routine: str, src_layout, args: Mapping) -> int:
    if routine == "dsa_indexer_per_layer" or args.get("item_bytes") is None:
        return int(src_layout.unit_bytes)
    return int(args["item_bytes"])


def _rows_and_pages(routine: str, args: Mapping) -> tuple[np.ndarray, np.ndarray]:
    s, d = base.index_pair(args)
    if routine == "dsa_indexer_per_layer":
        ps = base.dsa_page_size(args)
        return s.reshape(-1, ps)[:, 0] // ps, d.reshape(-1, ps)[:, 0] // ps
    return s, d


class SGLangProvider:
    name = NAME

    def available(self) -> tuple[bool, str]:
        ok, why = base.torch_cuda_status()
        if not ok:
            return ok, why
        try:
            import tvm_ffi  # noqa: F401
        except ImportError as e:
            return False, f"apache-tvm-ffi is not importable ({e}); expected apache-tvm-ffi==0.1.9"
        try:
            sglang_shim.import_jit_module("hisparse")
        except Exception as e:
            return False, f"sglang.jit_kernel.hisparse is not importable: {type(e).__name__}: {e}"
        return True, ""

    # ------------------------------------------------------------ which kernel

    def _path(self, routine: str, src_layout, dst_layout, args: Mapping) -> tuple[str | None, str]:
        """("jit" | "aot" | "dsv4" | "staged", "") or (None, why not)."""
        base.check_routine(routine)
        args = base.as_mapping(args)
        sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
        if routine == "token_bytewise":
            return None, "token_bytewise is kvrace's candidate fix; SGLang has no kernel for it"
        if routine == "dsv4_token":
            for L in base.routine_layers(routine, src_layout, args):
                for side, p in (("src", sp), ("dst", dp)):
                    if base.layer_base(p, L) % 8:
                        return None, (f"{side} layer {L} starts at byte {base.layer_base(p, L)}, not a "
                                      "multiple of 8: transfer_cache_dsv4_mla would fault on a "
                                      "misaligned 8-byte load")
            return "dsv4", ""
        why = base.simulator_refusal(routine, src_layout, dst_layout, args)
        if why:
            return None, why
        if routine == "staged_all_layer_lf_pf":
            why = self._staged_rule(src_layout.kind, sp, dp, args)
            return (None, why) if why else ("staged", "")
        aot, aot_why = _aot()
        if routine == "direct_page_first":
            if aot is None:
                return None, f"direct_page_first needs sgl_kernel.transfer_kv_*_direct_pf_lf/_lf_pf: {aot_why}"
            why = self._direct_page_first_rule(aot, src_layout, dst_layout, sp, dp, args)
            return (None, why) if why else ("aot", "")
        if routine == "direct_per_layer":
            if aot is None:
                return None, f"direct_per_layer needs sgl_kernel.transfer_kv_direct: {aot_why}"
            if sp.mode != base.MODE_LAYER_MAJOR or dp.mode != base.MODE_LAYER_MAJOR:
                return None, "transfer_kv_direct takes per-layer tensors: expected layer-major layouts"
            return "aot", ""
        ib = _item_bytes(routine, src_layout, args)
        s, d = _rows_and_pages(routine, args)
        jit_why = self._jit_rule(sp, dp, ib, s, d)
        if not jit_why:
            return "jit", ""
        if aot is None:
            return None, f"the JIT hicache kernel cannot run it ({jit_why}) and {aot_why}"
        aot_why2 = self._aot_rule(routine, sp, dp, ib)
        if aot_why2:
            return None, f"the JIT hicache kernel cannot run it ({jit_why}); sgl_kernel cannot either ({aot_why2})"
        return "aot", ""

    @staticmethod
    def _jit_rule(sp, dp, ib: int, s: np.ndarray, d: np.ndarray) -> str:
        if ib % JIT_ELEMENT_ALIGN:
            return f"item_bytes {ib} is not a multiple of {JIT_ELEMENT_ALIGN} (can_use_hicache_jit_kernel)"
        for side, p in (("src", sp), ("dst", dp)):
            if base.unit_stride(p) is None:
                return f"{side} is page_first_direct with page_size {p.page_size}: no constant unit stride"
        ok, why = base.indices_in_range(s, d, sp.units, dp.units, skip_negative=False)
        if not ok:
            return why.split(":")[0] + " (the JIT kernel neither skips negatives nor checks bounds)"
        return ""

    @staticmethod
    def _staged_rule(src_kind: str, sp, dp, args: Mapping) -> str:
        """Why transfer_hicache_all_layer_mla_staged_lf_pf cannot run this copy ("" when it can)."""
        ib = int(args["item_bytes"]) if args.get("item_bytes") is not None else sp.unit_bytes
        if src_kind != "paged":
            return ("transfer_hicache_all_layer_mla_staged_lf_pf backs up a device pool (its pointer "
                    f"table lists device layers); got a {src_kind} source")
        if sp.mode != base.MODE_LAYER_MAJOR or sp.page_size != 1 or sp.unit_bytes != ib:
            return (f"transfer_hicache_all_layer_mla_staged_lf_pf reads token t of a layer at "
                    f"ptr[layer] + t * element_size: expected a layer-major device source with "
                    f"unit_bytes == item_bytes ({ib}), got unit_bytes {sp.unit_bytes} (mode {sp.mode})")
        if dp.unit_bytes != ib:
            return (f"transfer_hicache_all_layer_mla_staged_lf_pf takes the host pool as (tokens, layers, "
                    f"element): expected host unit_bytes == item_bytes ({ib}), got {dp.unit_bytes}")
        s, d = base.index_pair(args)
        ps = int(args["page_size"])
        rs, rd = base.page_rows(sp, s[::ps], ps, False), base.page_rows(dp, d[::ps], ps, False)
        for side, rows, units in (("src", rs, sp.units), ("dst", rd, dp.units)):
            bad = rows[(rows < 0) | (rows >= units)]
            if bad.size:
                return (f"{side} token {int(bad[0])} is outside 0..{units - 1}: the relayout kernel casts "
                        "token indices to uint32 and the page memcpy does not check bounds; expected "
                        "in-bounds pages (use builtin to reproduce an out-of-bounds copy)")
        return ""

    @staticmethod
    def _direct_page_first_rule(aot, src_layout, dst_layout, sp, dp, args: Mapping) -> str:
        """Why sgl_kernel's page-first direct copies cannot run this copy ("" when they can)."""
        kinds = (src_layout.kind, dst_layout.kind)
        if kinds == ("host", "paged"):
            host, fn = sp, "transfer_kv_per_layer_direct_pf_lf"
        elif kinds == ("paged", "host"):
            host, fn = dp, "transfer_kv_all_layer_direct_lf_pf"
        else:
            return (f"sgl_kernel's page-first direct copies run between a page_first_direct host pool "
                    f"and a device pool; got {kinds[0]} -> {kinds[1]}")
        if not hasattr(aot, fn):
            return f"this sgl_kernel.kvcacheio has no {fn}"
        ps = int(args["page_size"])
        if host.mode != base.MODE_PAGE_FIRST_DIRECT or host.page_size != ps or host.units % ps:
            return (f"{fn} takes the host pool as (pages, layers, page_size, unit): expected a "
                    f"page_first_direct host layout of page_size {ps} holding whole pages, got mode "
                    f"{host.mode}, page_size {host.page_size}, {host.units} units")
        s, d = base.index_pair(args)
        for side, lay, p, first in (("src", src_layout, sp, s[::ps]), ("dst", dst_layout, dp, d[::ps])):
            rows = base.page_rows(p, first, ps, lay.kind == "host")
            bad = rows[(rows < 0) | (rows >= p.units)]
            if bad.size:
                return (f"{side} row {int(bad[0])} is outside 0..{p.units - 1}: sgl_kernel's batched "
                        "memcpy does not check bounds and its fallback slices clip; expected in-bounds pages")
        return ""

    @staticmethod
    def _aot_rule(routine: str, sp, dp, ib: int) -> str:
        if ib % 8:
            return f"item_bytes {ib} is not a multiple of 8"
        if dp.mode != base.MODE_LAYER_MAJOR and routine != "kernel_all_layer":
            return "the per-layer AOT kernels write layer-major destinations only"
        if routine == "kernel_all_layer":
            if sp.mode != base.MODE_LAYER_MAJOR or dp.mode == base.MODE_PAGE_FIRST_DIRECT:
                return "the all-layer AOT kernels read layer-major sources into layer_first or page_first"
            if ib != sp.unit_bytes or (dp.mode == base.MODE_LAYER_MAJOR and ib != dp.unit_bytes):
                return "the layer-table AOT kernels use item_bytes as the unit stride: expected item_bytes == unit_bytes"
            return ""
        if sp.mode == base.MODE_PAGE_FIRST_DIRECT:
            return "page_first_direct sources use the direct backend"
        if sp.mode == base.MODE_LAYER_MAJOR and ib != sp.unit_bytes:
            return "transfer_kv_per_layer_mla uses item_bytes as the unit stride: expected item_bytes == unit_bytes"
        if ib != dp.unit_bytes:
            return "transfer_kv_per_layer_mla uses item_bytes as the unit stride: expected item_bytes == unit_bytes"
        return ""

    def supports(self, routine: str, src_layout, dst_layout, args: Mapping) -> tuple[bool, str]:
        path, why = self._path(routine, src_layout, dst_layout, args)
        return path is not None, why

    # ------------------------------------------------------------ launch

    def launch(self, routine: str, src, dst, src_layout, dst_layout, args: Mapping,
               stream=None, item_range: tuple[int, int] | None = None) -> None:
        import torch
        import tvm_ffi

        path, why = self._path(routine, src_layout, dst_layout, args)
        if path is None:
            raise base.ProviderError(f"sglang cannot run {routine}: {why}")
        args = base.slice_args(routine, args, item_range)
        device = dst.tensor.device if dst.tensor.device.type == "cuda" else src.tensor.device
        stream = torch.cuda.current_stream(device) if stream is None else stream
        sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
        layers = base.routine_layers(routine, src_layout, args)
        with tvm_ffi.use_torch_stream(torch.cuda.stream(stream)):
            if path == "dsv4":
                s, d = base.index_pair(args)
                if s.size == 0:
                    return
                hisparse = sglang_shim.import_jit_module("hisparse")
                hisparse.transfer_cache_dsv4_mla(
                    _ptr_table(torch, src, sp, layers, device), _ptr_table(torch, dst, dp, layers, device),
                    _idx(torch, s, device), _idx(torch, d, device))
                return
            if path == "staged":
                self._launch_staged(torch, src, dst, sp, dp, layers, args, device)
                return
            if routine == "direct_page_first":
                self._launch_direct_page_first(torch, src, dst, src_layout, sp, dp, args, device)
                return
            if routine == "direct_per_layer":
                s, d = base.index_pair(args)
                L = layers[0]
                _aot()[0].transfer_kv_direct([_rows(src, sp, L, sp.unit_bytes)],
                                             [_rows(dst, dp, L, dp.unit_bytes)],
                                             _idx(torch, s, device), _idx(torch, d, device),
                                             int(args.get("page_size", 1)))
                return
            s, d = _rows_and_pages(routine, args)
            if s.size == 0:
                return
            ib = _item_bytes(routine, src_layout, args)
            si, di = _idx(torch, s, device), _idx(torch, d, device)
            if path == "jit":
                hicache = sglang_shim.import_jit_module("hicache")
                if routine == "kernel_all_layer":
                    hicache.transfer_hicache_all_layer_mla(
                        _ptr_table(torch, dst, dp, layers, device), di,
                        _ptr_table(torch, src, sp, layers, device), si,
                        cache_src_stride_bytes=base.unit_stride(sp),
                        cache_dst_stride_bytes=base.unit_stride(dp), element_size=ib)
                else:
                    L = layers[0]
                    hicache.transfer_hicache_one_layer_mla(_rows(dst, dp, L, ib), di,
                                                           _rows(src, sp, L, ib), si, element_dim=ib)
                return
            self._launch_aot(torch, routine, src, dst, sp, dp, layers, si, di, ib, device)

    @staticmethod
    def _launch_staged(torch, src, dst, sp, dp, layers, args: Mapping, device) -> None:
        from gpu_backend.providers.builtin import staging_page_capacity

        s, d = base.index_pair(args)
        if s.size == 0:
            return
        ps, ib = int(args["page_size"]), dp.unit_bytes
        hicache = sglang_shim.import_jit_module("hicache")
        # NOTE: SGLang's page_first host pool allocates (capacity tokens, layers, 1, dim) once;
        # here one per launch, on the launch stream, so it lives until the stream has used it
        staging = torch.empty((staging_page_capacity(dp, ps) * ps, len(layers), 1, ib),
                              dtype=torch.uint8, device=device)
        hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
            ptr_src=_ptr_table(torch, src, sp, layers, device), src_indices=_idx(torch, s, device),
            dst_indices=torch.from_numpy(np.ascontiguousarray(d, dtype=np.int64)),
            staging=staging, dst=dst.tensor.view(dp.units, dp.layers, 1, ib), page_size=ps)

    @staticmethod
    def _launch_direct_page_first(torch, src, dst, src_layout, sp, dp, args: Mapping, device) -> None:
        s, d = base.index_pair(args)
        if s.size == 0:
            return
        ps, L, kv = int(args["page_size"]), int(args["layer"]), _aot()[0]
        if src_layout.kind == "host":
            kv.transfer_kv_per_layer_direct_pf_lf(
                [_host_pages(src, sp, 0, sp.layers)], [_rows(dst, dp, L, dp.unit_bytes)],
                torch.from_numpy(np.ascontiguousarray(s)), _idx(torch, d, device), L, ps)
        else:
            # one source layer: the kernel writes host layer 0 of the view, i.e. layer L
            kv.transfer_kv_all_layer_direct_lf_pf(
                [_rows(src, sp, L, sp.unit_bytes)], [_host_pages(dst, dp, L, 1)],
                _idx(torch, s, device), torch.from_numpy(np.ascontiguousarray(d)), ps)

    @staticmethod
    def _launch_aot(torch, routine, src, dst, sp, dp, layers, si, di, ib, device) -> None:
        kv = _aot()[0]
        if routine == "kernel_all_layer":
            src_tbl = _ptr_table(torch, src, sp, layers, device)
            if dp.mode == base.MODE_LAYER_MAJOR:
                kv.transfer_kv_all_layer_mla(src_tbl, _ptr_table(torch, dst, dp, layers, device),
                                             si, di, ib, len(layers))
            else:
                if layers != list(range(len(layers))):
                    raise base.ProviderError(f"transfer_kv_all_layer_mla_lf_pf copies layers 0..n-1; "
                                             f"got layers {layers}")
                kv.transfer_kv_all_layer_mla_lf_pf(src_tbl, dst.tensor, si, di, ib,
                                                   dp.layers * dp.unit_bytes, len(layers))
            return
        L = layers[0]
        if sp.mode == base.MODE_PAGE_FIRST:
            kv.transfer_kv_per_layer_mla_pf_lf(src.tensor, _rows(dst, dp, L, ib), si, di, L, ib,
                                               sp.layers * sp.unit_bytes)
        else:
            kv.transfer_kv_per_layer_mla(_rows(src, sp, L, ib), _rows(dst, dp, L, ib), si, di, ib)


def _idx(torch, arr: np.ndarray, device):
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)).to(device, non_blocking=True)


def _ptr_table(torch, buf, p: base.LayoutParams, layers: list[int], device):
    """uint64 device tensor of per-layer base pointers (unit 0 of each layer)."""
    ptrs = np.array([buf.ptr + base.layer_base(p, L) for L in layers], dtype=np.uint64)
    return torch.from_numpy(ptrs.view(np.int64)).to(device, non_blocking=True).view(torch.uint64)


def _host_pages(buf, p: base.LayoutParams, first_layer: int, n_layers: int):
    """A page_first_direct host pool as SGLang's ``(pages, layers, page_size, unit)`` uint8 tensor,
    starting at ``first_layer`` and holding ``n_layers`` layers (strides of the whole pool)."""
    t = buf.tensor
    ps, ub = p.page_size, p.unit_bytes
    return t.as_strided((p.units // ps, n_layers, ps, ub), (p.layers * ps * ub, ps * ub, ub, 1),
                        t.storage_offset() + base.layer_base(p, first_layer))


def _rows(buf, p: base.LayoutParams, layer: int, item_bytes: int):
    """(units, item_bytes) uint8 view of one layer, rows ``unit_stride`` apart."""
    t = buf.tensor
    return t.as_strided((p.units, item_bytes), (base.unit_stride(p), 1),
                        t.storage_offset() + base.layer_base(p, layer))
