"""Each provider on a real GPU against the simulator: the bytes a copy leaves equal the bytes
``sim.transfers.routines.plan``'s extents give when applied with numpy to the same input bytes.

Run with ``pytest -m gpu tests/test_gpu_providers.py``; skipped without torch or CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import skip_unavailable_provider

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the GPU tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from gpu_backend import sglang_shim  # noqa: E402
from gpu_backend.cases import c4_on_token_rows, random_cases  # noqa: E402
from gpu_backend.extents_model import apply_extents, oob_dst_bytes  # noqa: E402
from gpu_backend.memory import BufferSet, canary_bytes  # noqa: E402
from gpu_backend.providers import base, get_provider  # noqa: E402
from gpu_backend.providers.builtin import compile_only  # noqa: E402
from gpu_backend.providers.sglang_kernels import _aot  # noqa: E402
from sim.bytes.pattern import Origin, pattern_bytes  # noqa: E402
from sim.transfers.routines import check_bounds, plan  # noqa: E402

PROVIDER_NAMES = ("builtin", "torch", "sglang")
#: routines each provider must have run at least once over the random cases
MUST_RUN = {"builtin": set(base.ROUTINE_NAMES), "torch": set(base.ROUTINE_NAMES),
            "sglang": {"kernel_per_layer", "kernel_all_layer", "dsa_indexer_per_layer", "dsv4_token",
                       "staged_all_layer_lf_pf"}}
if _aot()[0] is not None:
    # sgl_kernel present: its page-first direct copies must run too
    MUST_RUN["sglang"].add("direct_page_first")
CASES = [(r, c) for r in base.ROUTINE_NAMES for c in random_cases(r, np.random.default_rng(11), 4)]


@pytest.fixture(scope="module", params=PROVIDER_NAMES)
def provider(request):
    prov = get_provider(request.param, require_available=False)
    ok, why = prov.available()
    if not ok:
        skip_unavailable_provider(request.param, why)
    return prov


def _location(layout) -> str:
    return "host" if layout.kind == "host" else "device"


def _fill(layout, owner: int) -> np.ndarray:
    return pattern_bytes(Origin("kv", 0, owner, 1, layout.unit_bytes), 0, layout.nbytes)


def _run(provider, routine, src_l, dst_l, args, ranges=(None,), guard_bytes=64 * 1024):
    bs = BufferSet("cuda", guard_bytes=guard_bytes)
    src0, dst0 = _fill(src_l, 1), _fill(dst_l, 2)
    bs.add("src", src_l.nbytes, _location(src_l), src0)
    bs.add("dst", dst_l.nbytes, _location(dst_l), dst0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for item_range in ranges:
        provider.launch(routine, bs["src"], bs["dst"], src_l, dst_l, args, stream=stream,
                        item_range=item_range)
    stream.synchronize()
    return bs, src0, dst0


def test_compile_only_for_the_incidents_rtx_pro_6000():
    cubin = compile_only("sm_120")
    assert cubin[:4] == b"\x7fELF"
    major, minor = torch.cuda.get_device_capability()
    assert compile_only(f"sm_{major}{minor}")[:4] == b"\x7fELF"


def test_every_supported_case_matches_the_simulator(provider):
    ran: dict[str, int] = {}
    skipped: list[str] = []
    for routine, (name, src_l, dst_l, args) in CASES:
        ok, why = provider.supports(routine, src_l, dst_l, args)
        if not ok:
            skipped.append(f"{name}: {why}")
            continue
        bs, src0, dst0 = _run(provider, routine, src_l, dst_l, args)
        want = apply_extents(src0, dst0, plan(routine, src_l, dst_l, args).extents)
        got = bs.read("dst")
        diff = np.flatnonzero(got != want)
        assert diff.size == 0, (f"{provider.name} {name}: {diff.size} bytes differ from the model, first at "
                                f"{int(diff[0])} ({dst_l.describe(int(diff[0]))})")
        assert np.array_equal(bs.read("src"), src0), f"{provider.name} {name}: the source changed"
        assert bs.check_guards() == [], f"{provider.name} {name}: {bs.check_guards()}"
        ran[routine] = ran.get(routine, 0) + 1
    print(f"{provider.name}: ran {ran}; not supported: {skipped}")
    if provider.name == "sglang":
        print(f"sglang import: {sglang_shim.SHIM_STATE.get('sglang')}")
    missing = MUST_RUN[provider.name] - set(ran)
    assert not missing, f"{provider.name} ran no case of {sorted(missing)}; reasons: {skipped}"


def test_item_range_split_gives_the_same_bytes(provider):
    done = set()
    for routine, (name, src_l, dst_l, args) in CASES:
        if routine in done or not provider.supports(routine, src_l, dst_l, args)[0]:
            continue
        n = base.n_items(routine, args)
        if n < 2:
            continue
        cut = n // 2
        whole, src0, dst0 = _run(provider, routine, src_l, dst_l, args)
        split, _, _ = _run(provider, routine, src_l, dst_l, args, ranges=((0, cut), (cut, n)))
        first, _, _ = _run(provider, routine, src_l, dst_l, args, ranges=((0, cut),))
        ext = plan(routine, src_l, dst_l, args).extents
        assert np.array_equal(split.read("dst"), whole.read("dst")), f"{provider.name} {name}"
        assert np.array_equal(first.read("dst"), apply_extents(src0, dst0, ext, (0, cut))), \
            f"{provider.name} {name}: items 0..{cut - 1} alone"
        done.add(routine)
    assert done, f"{provider.name}: no routine had a case to split"


@pytest.mark.parametrize("routine", base.PAGE_ROUTINES)
def test_page_routines_on_random_page_sets_match_the_simulator(provider, routine):
    """Random whole-page index sets: scattered pages, 1..20 pages and 65..150 pages (more than
    one 64-page staging chunk), both directions for the direct copy; every provider that supports
    a case leaves the model's bytes, whole and split at a page boundary."""
    rng = np.random.default_rng(31)
    ran = 0
    for name, src_l, dst_l, args in random_cases(routine, rng, 8):
        ok, why = provider.supports(routine, src_l, dst_l, args)
        if not ok:
            assert provider.name == "sglang" and routine == "direct_page_first", f"{name}: {why}"
            continue
        ext = plan(routine, src_l, dst_l, args).extents
        bs, src0, dst0 = _run(provider, routine, src_l, dst_l, args)
        want = apply_extents(src0, dst0, ext)
        diff = np.flatnonzero(bs.read("dst") != want)
        assert diff.size == 0, (f"{provider.name} {name}: {diff.size} bytes differ from the model, first at "
                                f"{int(diff[0])} ({dst_l.describe(int(diff[0]))})")
        assert bs.check_guards() == [], f"{provider.name} {name}: {bs.check_guards()}"
        n = base.n_items(routine, args)
        cut = int(rng.integers(1, n)) if n > 1 else n
        split, _, _ = _run(provider, routine, src_l, dst_l, args, ranges=((0, cut), (cut, n)))
        assert np.array_equal(split.read("dst"), want), f"{provider.name} {name}: split at page {cut}"
        ran += 1
    if MUST_RUN[provider.name] >= {routine}:
        assert ran, f"{provider.name} ran no {routine} case"


def test_c4_routine_on_256_byte_tokens_writes_where_the_model_says(provider):
    name, src_l, dst_l, args = c4_on_token_rows(np.random.default_rng(5))
    ok, why = provider.supports("dsv4_token", src_l, dst_l, args)
    if provider.name == "torch":
        assert not ok and "out-of-bounds" in why
        return
    assert ok, why
    g = 64 * 1024
    bs, src0, dst0 = _run(provider, "dsv4_token", src_l, dst_l, args, guard_bytes=g)
    p = plan("dsv4_token", src_l, dst_l, args)
    # the model over the whole allocations: guards hold their canaries before the copy
    sfull = np.concatenate([canary_bytes(0, "before", g), src0, canary_bytes(0, "after", g)])
    dfull = np.concatenate([canary_bytes(1, "before", g), dst0, canary_bytes(1, "after", g)])
    want = apply_extents(sfull, dfull, p.extents, src_pad=g, dst_pad=g)
    n = dst_l.nbytes
    assert np.array_equal(bs.read("dst"), want[g:g + n]), f"{provider.name}: bytes inside the buffer"
    assert np.array_equal(bs.guard_bytes_of("dst", "after"), want[g + n:]), \
        f"{provider.name}: bytes past the end"
    predicted = sum(o.bytes_outside for o in check_bounds(p.extents, src_l.nbytes, n) if o.side == "dst")
    before, after = oob_dst_bytes(p.extents, n)
    assert before == 0 and after == predicted > 0
    reports = {(r.buffer, r.side): r for r in bs.check_guards()}
    assert set(reports) == {("dst", "after")}, reports
    assert reports[("dst", "after")].words_changed * 8 == predicted
    moved_right = sum(
        np.array_equal(bs.read("dst")[dst_l.unit_offsets(0, [d])[0]:][:256],
                       src0[src_l.unit_offsets(0, [s])[0]:][:256])
        for s, d in zip(args["src_indices"], args["dst_indices"]))
    print(f"{provider.name}: {after} bytes written past the end; {moved_right} of "
          f"{len(args['src_indices'])} tokens landed whole at their 256 B slot")


def test_builtin_wide_row_kernel_matches_the_simulator(monkeypatch):
    """``kvr_rows_wide`` (row copies of 16 MiB or more) on every random row case, with the size
    threshold lowered to 0 so the small cases run it too, and on one real 16 MiB index-K copy."""
    from gpu_backend.providers import builtin_kernels as bk
    from sim.pools.layouts import HostLayout, PagedLayout

    prov = get_provider("builtin", require_available=False)
    ok, why = prov.available()
    if not ok:
        skip_unavailable_provider("builtin", why)
    monkeypatch.setattr(bk, "WIDE_MIN_BYTES", 0)
    ran = 0
    for routine, (name, src_l, dst_l, args) in CASES:
        if routine not in bk.WIDE_ROUTINES or not prov.supports(routine, src_l, dst_l, args)[0]:
            continue
        bs, src0, dst0 = _run(prov, routine, src_l, dst_l, args)
        want = apply_extents(src0, dst0, plan(routine, src_l, dst_l, args).extents)
        assert np.array_equal(bs.read("dst"), want), f"wide kernel, {name}"
        assert bs.check_guards() == [], f"wide kernel, {name}: {bs.check_guards()}"
        ran += 1
    assert ran >= 3, f"only {ran} row cases ran the wide kernel"
    monkeypatch.undo()
    # a real one: 2,048 index-K pages of 8,448 B (17.3 MB) to random device pages
    rng = np.random.default_rng(5)
    pages, ps = 2048, 64
    src_l = HostLayout("host", "layer_first", 1, pages + 256, 8448)
    dst_l = PagedLayout("dev", 1, pages + 256, 8448)
    s, d = rng.permutation(pages + 256)[:pages], rng.permutation(pages + 256)[:pages]
    args = {"layer": 0, "page_size": ps, "src_indices": (s[:, None] * ps + np.arange(ps)).ravel().tolist(),
            "dst_indices": (d[:, None] * ps + np.arange(ps)).ravel().tolist()}
    assert bk.uses_wide("dsa_indexer_per_layer", pages, 1, 8448)
    bs, src0, dst0 = _run(prov, "dsa_indexer_per_layer", src_l, dst_l, args)
    want = apply_extents(src0, dst0, plan("dsa_indexer_per_layer", src_l, dst_l, args).extents)
    assert np.array_equal(bs.read("dst"), want), "wide kernel on 2,048 index-K pages"
