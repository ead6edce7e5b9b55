"""The ``torch`` provider: plain torch copies over views, SGLang's "direct" backend analogue.

* Both buffers on the same GPU, a row routine whose units have a constant stride
  (``kernel_per_layer``, ``kernel_all_layer``, ``dsa_indexer_per_layer`` on layer-major or
  page_first layouts): ``index_copy_`` of ``index_select``-ed rows over strided 2-D views.
* ``direct_page_first`` and ``staged_all_layer_lf_pf`` (the page routines): one ``copy_`` per
  contiguous piece of each page, page by page, never merged across pages (SGLang's direct
  backend issues one memcpy per page; the staged backup ends in one memcpy per page).  These are
  the plain-copy analogue: no staging buffer, no gather kernel.
* Anything else (host <-> device, page_first_direct, ``direct_per_layer``, per-token routines):
  the copy's byte pieces, computed on the host from the layout parameters and merged where they
  are contiguous on both sides, each issued as ``dst[a:b].copy_(src[c:d], non_blocking=True)``
  (a cudaMemcpyAsync between pinned host memory and the GPU).

Torch cannot write outside a tensor, so this provider accepts only copies whose every byte lies
inside both buffers; use ``builtin`` or ``sglang`` for out-of-bounds reproductions.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from gpu_backend.providers import base
from gpu_backend.providers import builtin_kernels as bk

NAME = "torch"


def host_pieces(routine: str, src_layout, dst_layout, args: Mapping) -> np.ndarray:
    """``(n, 3)`` int64 rows ``(src_offset, dst_offset, nbytes)`` in item order, merged where
    contiguous on both sides within an item; computed from layout parameters."""
    sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
    s, d = base.index_pair(args)
    layers = base.routine_layers(routine, src_layout, args)
    if routine in base.PAGE_ROUTINES:
        pages = base.page_pieces(routine, src_layout, dst_layout, args)
        return np.concatenate(pages).reshape(-1, 3) if pages else np.zeros((0, 3), dtype=np.int64)
    if routine == "direct_per_layer":
        return np.array(base.direct_pieces(sp, dp, layers[0], s, d), dtype=np.int64).reshape(-1, 3)
    rows: list[tuple[int, int, int]] = []
    if routine == "dsv4_token":
        c = bk.DSV4
        si, di = s.astype(np.int32).astype(np.int64), d.astype(np.int32).astype(np.int64)
        for k in range(s.size):
            for L in layers:
                sb = base.layer_base(sp, L) + (si[k] >> c["page_shift"]) * c["page_bytes"]
                db = base.layer_base(dp, L) + (di[k] >> c["page_shift"]) * c["page_bytes"]
                se, de = si[k] & (c["page_size"] - 1), di[k] & (c["page_size"] - 1)
                rows.append((sb + se * c["value_bytes"], db + de * c["value_bytes"], c["value_bytes"]))
                rows.append((sb + c["scale_offset"] + se * c["scale_bytes"],
                             db + c["scale_offset"] + de * c["scale_bytes"], c["scale_bytes"]))
        return _merge(rows)
    if routine == "token_bytewise":
        keep = (s >= 0) & (d >= 0)
        su, se = np.divmod(s[keep], sp.entries_per_unit)
        du, de = np.divmod(d[keep], dp.entries_per_unit)
        so = base.unit_offsets(sp, layers[0], su)
        do = base.unit_offsets(dp, layers[0], du)
        for k in range(so.size):
            for (fso, ln), (fdo, _) in zip(sp.fields, dp.fields):
                rows.append((so[k] + fso + se[k] * ln, do[k] + fdo + de[k] * ln, ln))
        return _merge(rows)
    s, d, ib = _row_items(routine, args, sp, s, d)
    keep = (s >= 0) & (d >= 0)
    for si, di in zip(s[keep], d[keep]):
        for L in layers:
            rows.append((int(base.unit_offsets(sp, L, si)), int(base.unit_offsets(dp, L, di)), ib))
    return _merge(rows)


def _merge(rows: list[tuple[int, int, int]]) -> np.ndarray:
    out: list[list[int]] = []
    for so, do, n in rows:
        if out and so == out[-1][0] + out[-1][2] and do == out[-1][1] + out[-1][2]:
            out[-1][2] += int(n)
        else:
            out.append([int(so), int(do), int(n)])
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def _row_items(routine: str, args, sp, s, d):
    """Row indices and row bytes of a row copy (DSA indexer: token indices -> pages)."""
    if routine == "dsa_indexer_per_layer":
        ps = base.dsa_page_size(args)
        return s.reshape(-1, ps)[:, 0] // ps, d.reshape(-1, ps)[:, 0] // ps, sp.unit_bytes
    ib = int(args["item_bytes"]) if args.get("item_bytes") is not None else sp.unit_bytes
    return s, d, ib


class TorchProvider:
    name = NAME

    def available(self) -> tuple[bool, str]:
        return base.torch_cuda_status()

    def supports(self, routine: str, src_layout, dst_layout, args: Mapping) -> tuple[bool, str]:
        base.check_routine(routine)
        args = base.as_mapping(args)
        if src_layout.kind == "host" and dst_layout.kind == "host":
            return False, "both buffers are host buffers; expected at least one device buffer"
        why = base.simulator_refusal(routine, src_layout, dst_layout, args)
        if why:
            return False, why
        pieces = host_pieces(routine, src_layout, dst_layout, args)
        for side, col, nbytes in (("src", 0, src_layout.nbytes), ("dst", 1, dst_layout.nbytes)):
            bad = (pieces[:, col] < 0) | (pieces[:, col] + pieces[:, 2] > nbytes)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                return False, (f"{side} bytes [{pieces[k, col]}, {pieces[k, col] + pieces[k, 2]}) leave "
                               f"the {nbytes}-byte buffer: torch copies only in-bounds bytes (use "
                               "builtin or sglang to reproduce an out-of-bounds copy)")
        return True, ""

    def launch(self, routine: str, src, dst, src_layout, dst_layout, args: Mapping,
               stream=None, item_range: tuple[int, int] | None = None) -> None:
        import torch

        ok, why = self.supports(routine, src_layout, dst_layout, args)
        if not ok:
            raise base.ProviderError(f"torch cannot run {routine}: {why}")
        args = base.slice_args(routine, args, item_range)
        device = dst.tensor.device if dst.tensor.device.type == "cuda" else src.tensor.device
        stream = torch.cuda.current_stream(device) if stream is None else stream
        with torch.cuda.stream(stream):
            if self._rows_on_device(routine, src, dst, src_layout, dst_layout):
                self._index_copy(routine, src, dst, src_layout, dst_layout, args)
                return
            for so, do, n in host_pieces(routine, src_layout, dst_layout, args).tolist():
                dst.tensor[do:do + n].copy_(src.tensor[so:so + n], non_blocking=True)

    @staticmethod
    def _rows_on_device(routine, src, dst, src_layout, dst_layout) -> bool:
        if routine not in ("kernel_per_layer", "kernel_all_layer", "dsa_indexer_per_layer"):
            return False
        if src.tensor.device != dst.tensor.device or dst.tensor.device.type != "cuda":
            return False
        return all(base.unit_stride(base.layout_params(x)) is not None for x in (src_layout, dst_layout))

    @staticmethod
    def _index_copy(routine, src, dst, src_layout, dst_layout, args) -> None:
        import torch

        sp, dp = base.layout_params(src_layout), base.layout_params(dst_layout)
        s, d = base.index_pair(args)
        s, d, ib = _row_items(routine, args, sp, s, d)
        keep = (s >= 0) & (d >= 0)
        if not keep.any():
            return
        dev = dst.tensor.device
        s_t = torch.from_numpy(np.ascontiguousarray(s[keep])).to(dev, non_blocking=True)
        d_t = torch.from_numpy(np.ascontiguousarray(d[keep])).to(dev, non_blocking=True)
        for L in base.routine_layers(routine, src_layout, args):
            src_rows = _rows(src.tensor, sp, L, ib)
            dst_rows = _rows(dst.tensor, dp, L, ib)
            dst_rows.index_copy_(0, d_t, src_rows.index_select(0, s_t))


def _rows(t, p: base.LayoutParams, layer: int, item_bytes: int):
    """A (units, item_bytes) strided view of one layer's rows."""
    stride = base.unit_stride(p)
    return t.as_strided((p.units, item_bytes), (stride, 1),
                        t.storage_offset() + base.layer_base(p, layer))
