"""GPU side: staged launches (a provider's copy with its index arrays already on the device)."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from sim.errors import KvraceError


class NotStaged(KvraceError, RuntimeError):
    """This provider cannot run this copy as a staged launch; the message says why."""


_PROVIDERS: dict = {}


def provider(name: str):
    """One provider object per name for the process (the builtin one holds its compiled module,
    so a fresh object per launch would compile the kernels again)."""
    if name not in _PROVIDERS:
        from gpu_backend.providers import get_provider
        _PROVIDERS[name] = get_provider(name)
    return _PROVIDERS[name]


def _view(tensor):
    """A Buffer-like object (``tensor``, ``ptr``) over a slice of a bigger allocation."""
    class _V:
        pass
    v = _V()
    v.tensor, v.ptr = tensor, int(tensor.data_ptr())
    return v


def staged_launch(provider_name: str, routine: str, src, dst, src_layout, dst_layout, args: Mapping,
                  device) -> Callable:
    """``run(stream)`` that enqueues only the copy: index arrays, pointer tables and byte pieces
    are made once here (on the device, synchronously), as the provider makes them per launch.

    builtin: the same parameter block ``BuiltinProvider.launch`` builds; sglang: the JIT hicache
    and hisparse calls ``SGLangProvider.launch`` makes; torch: its byte pieces, one
    ``copy_(non_blocking=True)`` each.  Raises NotStaged where the provider cannot run the copy
    (or, for sglang, would use the AOT ``sgl_kernel`` path, which is not staged).
    """
    import torch

    from gpu_backend.providers import base

    prov = provider(provider_name)
    ok, why = prov.supports(routine, src_layout, dst_layout, args)
    if not ok:
        raise NotStaged(why)
    sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
    layers = base.routine_layers(routine, src_layout, args)
    keep = []   # device tensors the closure needs alive

    if provider_name == "builtin":
        from gpu_backend.providers.builtin import kernel_params

        if routine == "direct_per_layer":
            raise NotStaged("direct_per_layer is a host routine (one cuMemcpyAsync per piece)")
        mod = prov._module(device.index)
        mod.make_current()
        kp = kernel_params(routine, src, dst, src_layout, dst_layout, args, prov._sm_count(device.index))
        n, values = kp.n_items, dict(kp.values)
        keep = [torch.from_numpy(np.ascontiguousarray(kp.src_idx)).to(device),
                torch.from_numpy(np.ascontiguousarray(kp.dst_idx)).to(device),
                torch.tensor(kp.layers, dtype=torch.int64).to(device)]
        values.update(src_idx=keep[0].data_ptr(), dst_idx=keep[1].data_ptr(), layer_ids=keep[2].data_ptr())
        kernel = kp.kernel

        def run(stream, _keep=keep):
            if n:
                mod.make_current()
                prov._launch(mod, kernel, kp.shape, values, stream)

    elif provider_name == "sglang":
        import tvm_ffi

        from gpu_backend import sglang_shim
        from gpu_backend.providers import sglang_kernels as sk

        path, why = prov._path(routine, src_layout, dst_layout, args)
        if path not in ("jit", "dsv4"):
            raise NotStaged(f"sglang would use its {path} path for {routine}: only the JIT kernels are staged")
        if path == "dsv4":
            s, d = base.index_pair(args)
            fn = sglang_shim.import_jit_module("hisparse").transfer_cache_dsv4_mla
            keep = [sk._ptr_table(torch, src, sp, layers, device), sk._ptr_table(torch, dst, dp, layers, device),
                    sk._idx(torch, s, device), sk._idx(torch, d, device)]
            call = (lambda: fn(*keep)) if s.size else (lambda: None)
        else:
            s, d = sk._rows_and_pages(routine, args)
            ib = sk._item_bytes(routine, src_layout, args)
            hicache = sglang_shim.import_jit_module("hicache")
            si, di = sk._idx(torch, s, device), sk._idx(torch, d, device)
            if routine == "kernel_all_layer":
                st, dt = sk._ptr_table(torch, src, sp, layers, device), sk._ptr_table(torch, dst, dp, layers, device)
                keep = [si, di, st, dt]
                call = lambda: hicache.transfer_hicache_all_layer_mla(  # noqa: E731
                    dt, di, st, si, cache_src_stride_bytes=base.unit_stride(sp),
                    cache_dst_stride_bytes=base.unit_stride(dp), element_size=ib)
            else:
                L = layers[0]
                dr, sr = sk._rows(dst, dp, L, ib), sk._rows(src, sp, L, ib)
                keep = [si, di, dr, sr]
                call = lambda: hicache.transfer_hicache_one_layer_mla(dr, di, sr, si, element_dim=ib)  # noqa: E731
            if not s.size:
                call = lambda: None  # noqa: E731

        def run(stream, _keep=keep):
            with tvm_ffi.use_torch_stream(torch.cuda.stream(stream)):
                call()

    elif provider_name == "torch":
        from gpu_backend.providers.torch_copy import host_pieces

        if prov._rows_on_device(routine, src, dst, src_layout, dst_layout):
            raise NotStaged("same-GPU row copies use index_copy_; only host <-> device pieces are staged")
        pieces = [(dst.tensor[do:do + n], src.tensor[so:so + n])
                  for so, do, n in host_pieces(routine, src_layout, dst_layout, args).tolist()]

        def run(stream):
            with torch.cuda.stream(stream):
                for a, b in pieces:
                    a.copy_(b, non_blocking=True)
    else:
        raise NotStaged(f"unknown provider {provider_name!r}")
    torch.cuda.synchronize(device)
    return run
