"""Small random copy cases for checking providers against the simulator's extents.

``random_cases(routine, rng)`` gives (name, src layout, dst layout, args) tuples that cover the
layouts each routine meets in SGLang: device pages, host layer_first, page_first and
page_first_direct; items a multiple of 128 bytes (the JIT hicache rule) and not; negative
(skipped) index pairs; coalescable runs.  Every case is in bounds.  ``c4_on_token_rows`` is the
incident's case: the C4 routine handed buffers of 256 B per token.

The page routines (``direct_page_first``, ``staged_all_layer_lf_pf``) get whole pages of
page_size 4 at random, non-contiguous page positions; every fourth case copies more than 64 pages
(two staging chunks or more for the staged backup).
"""
from __future__ import annotations

import numpy as np

from sim.pools.layouts import Field, HostLayout, PagedLayout, c4_paged


def _layout(rng: np.random.Generator, kind: str, layers: int, units: int, unit_bytes: int,
            name: str, epu: int = 1, fields=()) -> PagedLayout | HostLayout:
    if kind == "paged":
        return PagedLayout(name, layers, units, unit_bytes, epu, fields)
    page_size = 4 if kind == "page_first_direct" else 1
    return HostLayout(name, kind, layers, units, unit_bytes, page_size, epu, fields)


KINDS = ("paged", "layer_first", "page_first", "page_first_direct")


def _pair_kinds(rng) -> tuple[str, str]:
    """A host <-> device pair either way, or device -> device."""
    host = str(rng.choice(KINDS[1:]))
    return [("paged", "paged"), (host, "paged"), ("paged", host)][int(rng.integers(3))]


def _indices(rng, n: int, units: int, negatives: bool) -> tuple[list[int], list[int]]:
    s = rng.choice(units, size=n, replace=False)
    d = rng.choice(units, size=n, replace=False)
    if negatives and n > 2:
        s[1], d[n - 1] = -1, -1
    return s.tolist(), d.tolist()


def random_cases(routine: str, rng: np.random.Generator, count: int = 4) -> list[tuple]:
    out = []
    for k in range(count):
        layers, units = int(rng.integers(2, 4)), 32
        sk, dk = _pair_kinds(rng)
        name = f"{routine}[{k}] {sk}->{dk}"
        if routine in ("kernel_per_layer", "kernel_all_layer"):
            ub = (256, 576)[k % 2]   # even k: JIT-hicache sized, no negatives
            src = _layout(rng, sk, layers, units, ub, "src")
            dst = _layout(rng, dk, layers, units, ub, "dst")
            s, d = _indices(rng, int(rng.integers(3, 20)), units, negatives=(k % 2 == 1))
            args = {"src_indices": s, "dst_indices": d}
            if routine == "kernel_per_layer":
                args["layer"] = int(rng.integers(layers))
                if k == 2:
                    args["item_bytes"] = ub // 2 - (ub // 2) % 8
            elif k >= 2:
                args["layers"] = sorted(rng.choice(layers, size=2, replace=False).tolist())
        elif routine == "direct_per_layer":
            ub = int(rng.choice([64, 128, 576]))
            src = _layout(rng, sk, layers, units, ub, "src")
            dst = _layout(rng, dk, layers, units, ub, "dst")
            s, d, start_s, start_d = [], [], 0, 8
            for run in rng.integers(1, 5, size=4):
                s += list(range(start_s, start_s + run))
                d += list(range(start_d, start_d + run))
                start_s += run + int(rng.integers(0, 2))
                start_d += run + int(rng.integers(1, 3))
            args = {"layer": int(rng.integers(layers)), "src_indices": s, "dst_indices": d}
        elif routine == "dsa_indexer_per_layer":
            ps = 4
            ub = (1024, 4 * 132)[k % 2]
            src = _layout(rng, sk, layers, units, ub, "src")
            dst = _layout(rng, dk, layers, units, ub, "dst")
            pages_s, pages_d = _indices(rng, int(rng.integers(2, 10)), units, negatives=False)
            s = [p * ps + e for p in pages_s for e in range(ps)]
            d = [p * ps + e for p in pages_d for e in range(ps)]
            args = {"layer": int(rng.integers(layers)), "src_indices": s, "dst_indices": d,
                    "page_size": ps}
        elif routine == "dsv4_token":
            pages = 3
            src = c4_paged(layers, pages) if sk == "paged" else HostLayout(
                "src", "layer_first", layers, pages, c4_paged(1, 1).page_bytes, 1, 64,
                c4_paged(1, 1).fields)
            dst = c4_paged(layers, pages)
            name = f"{routine}[{k}] {'paged' if sk == 'paged' else 'layer_first'}->paged"
            s, d = _indices(rng, int(rng.integers(5, 60)), pages * 64, negatives=False)
            args = {"src_indices": s, "dst_indices": d}
            if k >= 2:
                args["layers"] = list(range(layers))
        elif routine == "token_bytewise":
            epu = 4
            fields = (Field("key", 0, 16), Field("scale", epu * 16, 4))
            src = _layout(rng, sk, layers, units, epu * 20, "src", epu, fields)
            dst = _layout(rng, dk, layers, units, epu * 20 + 8, "dst", epu,
                          (Field("key", 8, 16), Field("scale", 8 + epu * 16, 4)))
            s, d = _indices(rng, int(rng.integers(3, 30)), units * epu, negatives=(k % 2 == 1))
            args = {"layer": int(rng.integers(layers)), "src_indices": s, "dst_indices": d}
        elif routine in ("direct_page_first", "staged_all_layer_lf_pf"):
            name, src, dst, args = _page_case(rng, routine, k)
        else:
            raise ValueError(f"unknown routine {routine!r}")
        out.append((name, src, dst, args))
    return out


def _page_case(rng, routine: str, k: int):
    """Whole pages between a device pool and a page_first_direct (direct) or page_first (staged)
    host pool; ``k % 4 == 3``: 65..150 pages, else 1..20.  Device pages start anywhere on a
    page boundary; host pages are distinct."""
    ps, layers = 4, int(rng.integers(2, 4))
    n_pages = int(rng.integers(65, 151)) if k % 4 == 3 else int(rng.integers(1, 21))
    host_pages = dev_pages = max(2 * n_pages, 24)
    ub = (64, 576)[k % 2] if routine == "direct_page_first" else (64, 256)[k % 2]
    dev = PagedLayout("dev", layers, dev_pages * ps, ub)
    if routine == "direct_page_first":
        host = HostLayout("host", "page_first_direct", layers, host_pages * ps, ub, ps)
        to_host = bool(k % 3 != 1)
    else:
        host = HostLayout("host", "page_first", layers, host_pages * ps, ub)
        to_host = True
    t = np.arange(ps)
    hp = rng.choice(host_pages, size=n_pages, replace=False)
    dpg = rng.choice(dev_pages, size=n_pages, replace=False)
    host_idx = (hp[:, None] * ps + t).reshape(-1).tolist()
    dev_idx = (dpg[:, None] * ps + t).reshape(-1).tolist()
    args = {"page_size": ps}
    if routine == "direct_page_first":
        args["layer"] = int(rng.integers(layers))
    if to_host:
        args.update(src_indices=dev_idx, dst_indices=host_idx)
        return f"{routine}[{k}] paged->{host.layout} {n_pages} pages", dev, host, args
    args.update(src_indices=host_idx, dst_indices=dev_idx)
    return f"{routine}[{k}] {host.layout}->paged {n_pages} pages", host, dev, args


def c4_on_token_rows(rng: np.random.Generator, tokens: int = 128, n: int = 40):
    """The incident: ``dsv4_token`` between a pinned host pool and a device pool that both hold
    256 B per token (one layer), so the C4 constants address far past the buffers' ends."""
    src = HostLayout("host_index_k_256", "layer_first", 1, tokens, 256)
    dst = PagedLayout("index_k_256", 1, tokens, 256)
    s, d = _indices(rng, n, tokens, negatives=False)
    return "dsv4_token on 256 B/token", src, dst, {"src_indices": s, "dst_indices": d}
