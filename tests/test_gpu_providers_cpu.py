"""GPU backend parts that run without a GPU: provider selection, the sglang shim, item slicing,
host-side copy pieces, kernel source and parameter packing, guard canaries."""
from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from gpu_backend import memory, sglang_shim
from gpu_backend.cases import c4_on_token_rows, random_cases
from gpu_backend.extents_model import apply_extents, oob_dst_bytes
from gpu_backend.providers import PROVIDERS, ProviderError, base, get_provider
from gpu_backend.providers import builtin_kernels as bk
from gpu_backend.providers.builtin import BuiltinProvider
from gpu_backend.providers.sglang_kernels import SGLangProvider
from gpu_backend.providers.torch_copy import TorchProvider, host_pieces
from sim.pools.layouts import HostLayout, PagedLayout
from sim.transfers import routines
from sim.transfers.routines import check_bounds, plan


def _merged_plan_rows(p) -> np.ndarray:
    rows: list[list[int]] = []
    for item, so, do, n in p.extents.rows():
        if rows and rows[-1][0] == item and so == rows[-1][1] + rows[-1][3] and do == rows[-1][2] + rows[-1][3]:
            rows[-1][3] += n
        else:
            rows.append([item, so, do, n])
    return np.array([r[1:] for r in rows], dtype=np.int64).reshape(-1, 3)


ALL_CASES = [c for r in base.ROUTINE_NAMES for c in random_cases(r, np.random.default_rng(7), 6)]
ROUTINE_OF = {c[0]: c[0].split("[")[0] for c in ALL_CASES}


# ---------------------------------------------------------------- provider selection

def test_unknown_provider_lists_the_known_ones():
    with pytest.raises(ProviderError, match=r"unknown provider 'cuda'.*\['builtin', 'sglang', 'torch'\]"):
        get_provider("cuda")


def test_unavailable_provider_says_why_for_every_provider(monkeypatch):
    monkeypatch.setattr(BuiltinProvider, "available", lambda self: (False, "no NVRTC here"))
    monkeypatch.setattr(TorchProvider, "available", lambda self: (True, ""))
    monkeypatch.setattr(SGLangProvider, "available", lambda self: (False, "no tvm_ffi here"))
    with pytest.raises(ProviderError) as e:
        get_provider("builtin")
    msg = str(e.value)
    assert "provider 'builtin' is not available here: no NVRTC here" in msg
    assert "torch: available" in msg and "sglang: unavailable: no tvm_ffi here" in msg
    assert get_provider("torch").name == "torch"
    assert get_provider("sglang", require_available=False).name == "sglang"


def test_every_provider_reports_availability_with_a_reason():
    for name, cls in PROVIDERS.items():
        ok, why = cls().available()
        assert isinstance(ok, bool) and (ok or why), name


@pytest.mark.parametrize("name,src,dst,args", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_builtin_and_torch_support_every_in_bounds_case(name, src, dst, args):
    routine = ROUTINE_OF[name]
    assert BuiltinProvider().supports(routine, src, dst, args) == (True, "")
    assert TorchProvider().supports(routine, src, dst, args) == (True, "")


def test_support_reasons_name_the_problem(monkeypatch):
    import gpu_backend.providers.sglang_kernels as sk

    monkeypatch.setattr(sk, "_aot", lambda: (None, "sgl_kernel.kvcacheio is not importable (test)"))
    name, src, dst, args = c4_on_token_rows(np.random.default_rng(0))
    ok, why = TorchProvider().supports("dsv4_token", src, dst, args)
    assert not ok and "leave the 32768-byte buffer" in why and "out-of-bounds" in why
    assert BuiltinProvider().supports("dsv4_token", src, dst, args) == (True, "")
    assert SGLangProvider().supports("dsv4_token", src, dst, args) == (True, "")
    ok, why = SGLangProvider().supports("token_bytewise", src, dst, {"layer": 0, "src_indices": [1],
                                                                      "dst_indices": [2]})
    assert not ok and "candidate fix" in why
    lay = PagedLayout("mla_fp8", 2, 16, 576)
    ok, why = SGLangProvider().supports("kernel_per_layer", lay, lay, {"layer": 0, "src_indices": [1],
                                                                        "dst_indices": [2]})
    assert not ok and "item_bytes 576 is not a multiple of 128" in why and "sgl_kernel" in why
    lay = PagedLayout("bf16", 2, 16, 1152)
    ok, why = SGLangProvider().supports("kernel_per_layer", lay, lay, {"layer": 0, "src_indices": [-1, 3],
                                                                        "dst_indices": [2, 3]})
    assert not ok and "src index -1" in why and "negatives" in why
    assert SGLangProvider().supports("kernel_per_layer", lay, lay, {"layer": 1, "src_indices": [0, 3],
                                                                     "dst_indices": [2, 15]}) == (True, "")
    odd = HostLayout("odd", "layer_first", 2, 16, 132)
    ok, why = BuiltinProvider().supports("kernel_per_layer", odd, odd, {"layer": 0, "src_indices": [1],
                                                                         "dst_indices": [1]})
    assert not ok and "132" in why and "8-byte" in why
    host = HostLayout("h", "layer_first", 2, 16, 64)
    ok, why = TorchProvider().supports("kernel_per_layer", host, host, {"layer": 0, "src_indices": [1],
                                                                         "dst_indices": [1]})
    assert not ok and "both buffers are host buffers" in why


def test_unknown_routine_is_an_error():
    lay = PagedLayout("p", 1, 4, 64)
    with pytest.raises(ProviderError, match="unknown routine 'memcpy'"):
        BuiltinProvider().supports("memcpy", lay, lay, {})


# ---------------------------------------------------------------- item ranges

@pytest.mark.parametrize("name,src,dst,args", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_item_range_slices_exactly_those_items(name, src, dst, args):
    routine = ROUTINE_OF[name]
    whole = plan(routine, src, dst, args)
    n = whole.n_items
    assert base.n_items(routine, args) == n
    for a, b in [(0, n), (0, n // 2), (n // 2, n), (1, max(1, n - 1))]:
        sub_args = base.slice_args(routine, args, (a, b))
        if routine == "direct_per_layer":
            sub_args["page_size"] = 1   # a slice need not hold whole pages; the runs are what count
        sub = plan(routine, src, dst, sub_args)
        assert sub.n_items == b - a
        want = [(i - a, s, d, ln) for i, s, d, ln in whole.extents.rows() if a <= i < b]
        assert sub.extents.rows() == want


def test_item_range_out_of_bounds_is_an_error():
    args = {"layer": 0, "src_indices": [0, 1, 2], "dst_indices": [3, 4, 9]}
    assert base.n_items("direct_per_layer", args) == 2
    with pytest.raises(ProviderError, match=r"item_range \(1, 3\).*0 <= a <= b <= 2"):
        base.slice_args("direct_per_layer", args, (1, 3))


# ---------------------------------------------------------------- host-side pieces and layout twins

@pytest.mark.parametrize("name,src,dst,args", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_torch_pieces_equal_the_simulators_extents(name, src, dst, args):
    routine = ROUTINE_OF[name]
    assert np.array_equal(host_pieces(routine, src, dst, args), _merged_plan_rows(plan(routine, src, dst, args)))


def test_layout_params_twin_matches_the_layouts():
    rng = np.random.default_rng(3)
    idx = rng.integers(-70, 70, size=50)
    for lay in (PagedLayout("p", 3, 40, 96, 4), HostLayout("a", "layer_first", 3, 40, 96),
                HostLayout("b", "page_first", 3, 40, 96), HostLayout("c", "page_first_direct", 3, 40, 96, 8)):
        p = base.layout_params(lay)
        assert p.nbytes == lay.nbytes
        for L in range(3):
            assert np.array_equal(base.unit_offsets(p, L, idx), lay.unit_offsets(L, idx))
            assert base.layer_base(p, L) == lay.layer_base(L)
            if base.unit_stride(p) is not None:
                assert lay.unit_offsets(L, [1])[0] - lay.unit_offsets(L, [0])[0] == base.unit_stride(p)


# ---------------------------------------------------------------- kernel source and packing

def test_param_struct_and_packing_agree():
    src = bk.kernel_source()
    for name, n in bk.PARAM_FIELDS:
        assert f"long long {name}{f'[{n}]' if n > 1 else ''};" in src
    for k in set(bk.KERNELS.values()):
        bound = bk.STAGE_BLOCK_THREADS if k == "kvr_stage_pages" else 1024
        assert f'extern "C" __global__ void __launch_bounds__({bound}) {k}(const Params p)' in src
    words = bk.pack_params({"src": (1 << 64) - 8, "n_items": 5, "f_len": [4, 16]})
    assert words.dtype == np.int64 and words.size == bk.PARAM_WORDS
    names = [f"{n}[{i}]" if c > 1 else n for n, c in bk.PARAM_FIELDS for i in range(c)]
    assert words[names.index("src")] == -8
    assert words[names.index("n_items")] == 5
    assert list(words[names.index("f_len[0]"):names.index("f_len[0]") + 3]) == [4, 16, 0]
    with pytest.raises(ValueError, match="unknown names \\['bogus'\\]"):
        bk.pack_params({"bogus": 1})
    with pytest.raises(ValueError, match="f_len: expected at most 8 values, got 9"):
        bk.pack_params({"f_len": list(range(9))})


def test_kernel_constants_and_launch_shapes_match_the_simulator():
    assert bk.DSV4["page_bytes"] == routines.DSV4_PAGE_BYTES == 37440
    assert bk.DSV4["scale_offset"] == routines.DSV4_SCALE_OFFSET == 36864
    assert bk.DSV4["value_bytes"] == routines.DSV4_VALUE_BYTES
    assert bk.DSV4["scale_bytes"] == routines.DSV4_SCALE_BYTES
    assert 1 << bk.DSV4["page_shift"] == bk.DSV4["page_size"] == routines.DSV4_PAGE_SIZE
    for n in list(range(1, 200)) + [1000, 4097, 100000]:
        blocks, threads, ipw = bk.quota_launch(n)
        want = routines.warp_quota_launch(n)
        assert (blocks, threads, ipw) == (want.blocks, want.block_threads, want.items_per_warp)
        assert blocks <= 2 and blocks * ipw * 32 >= n
        blocks, threads, _ = bk.warp_per_item_launch(n)
        want = routines.warp_per_item_launch(n)
        assert (blocks, threads) == (want.blocks, want.block_threads)


def test_compile_only_builds_for_the_incident_gpu():
    pytest.importorskip("cuda.bindings", reason="cuda-python (NVRTC) is not installed")
    from gpu_backend.providers.builtin import compile_only

    for arch in ("sm_90", "sm_120"):
        cubin = compile_only(arch)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    with pytest.raises(ProviderError, match="expected 'sm_<digits>'"):
        compile_only("hopper")


# ---------------------------------------------------------------- guards and the numpy model

def test_canaries_differ_per_buffer_side_and_word():
    a = memory.canary_words(0, "after", 64)
    assert len(set(a.tolist())) == 64
    assert not set(a.tolist()) & set(memory.canary_words(1, "after", 64).tolist())
    assert not set(a.tolist()) & set(memory.canary_words(0, "before", 64).tolist())
    with pytest.raises(ValueError, match="guard side"):
        memory.canary_words(0, "middle", 1)


def test_diff_guard_reports_offsets_relative_to_the_logical_buffer():
    exp = memory.canary_bytes(2, "after", 256)
    got = exp.copy()
    got[16:24] = 0
    got[40] ^= 1
    r = memory.diff_guard("D", "after", exp, got)
    assert (r.bytes_changed, r.words_changed, r.first_offset, r.last_offset) == (9, 2, 16, 40)
    assert "9 guard bytes changed (2 words) past the end, offsets 16..40" in str(r)
    exp = memory.canary_bytes(2, "before", 256)
    got = exp.copy()
    got[-8:] = 0
    r = memory.diff_guard("D", "before", exp, got)
    assert (r.first_offset, r.last_offset, r.words_changed) == (-8, -1, 1)
    assert memory.diff_guard("D", "before", exp, exp.copy()) is None


def test_the_incident_model_predicts_writes_past_the_end():
    name, src, dst, args = c4_on_token_rows(np.random.default_rng(1))
    p = plan("dsv4_token", src, dst, args)
    oob = [o for o in check_bounds(p.extents, src.nbytes, dst.nbytes) if o.side == "dst"]
    before, after = oob_dst_bytes(p.extents, dst.nbytes)
    assert before == 0 and after == sum(o.bytes_outside for o in oob) > 0
    g = memory.DEFAULT_GUARD_BYTES
    sfull = np.concatenate([memory.canary_bytes(0, "before", g), np.full(src.nbytes, 7, np.uint8),
                            memory.canary_bytes(0, "after", g)])
    dfull = np.concatenate([memory.canary_bytes(1, "before", g), np.zeros(dst.nbytes, np.uint8),
                            memory.canary_bytes(1, "after", g)])
    out = apply_extents(sfull, dfull, p.extents, src_pad=g, dst_pad=g)
    r = memory.diff_guard("dst", "after", dfull[g + dst.nbytes:], out[g + dst.nbytes:])
    assert r.words_changed * 8 == after
    with pytest.raises(ValueError, match="expected larger guards"):
        apply_extents(sfull[:g + src.nbytes + 64], dfull, p.extents, src_pad=g, dst_pad=g)


def test_buffer_set_on_the_cpu_reports_overruns(monkeypatch):
    from tests import numpy_torch

    torch = numpy_torch.install(monkeypatch)   # torch, or its numpy test double where torch is absent
    bs = memory.BufferSet("cpu", guard_bytes=512)
    data = np.arange(1000, dtype=np.uint64).astype(np.uint8)
    bs.add("H", 1000, "host", data)
    bs.add("D", 64, "device")
    assert np.array_equal(bs.read("H"), data) and not bs.read("D").any()
    assert bs.check_guards() == []
    whole = bs["D"].allocation
    whole[512 + 64: 512 + 64 + 24] = 1            # 24 bytes past D's end
    whole[500:504] = 1                            # 12..9 bytes before its start
    reports = {(r.buffer, r.side): r for r in bs.check_guards()}
    assert reports[("D", "after")].words_changed == 3 and reports[("D", "after")].first_offset == 0
    assert reports[("D", "before")].first_offset == -12 and reports[("D", "before")].bytes_changed == 4
    assert bs["H"].ptr == bs["H"].tensor.data_ptr() and bs["H"].tensor.dtype == torch.uint8
    with pytest.raises(ValueError, match="expected a 1-D uint8 array of 64 bytes"):
        bs.write("D", np.zeros(10, np.uint8))
    with pytest.raises(KeyError, match="no buffer 'X'"):
        bs["X"]


# ---------------------------------------------------------------- the sglang shim

@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A fake installed package tree ``fakesgl`` (the shim takes the package name)."""
    created = []

    def make(init: str, utils: str = "def is_in_ci():\n    return False\n", kernel: str = "VALUE = 42\n"):
        pkg = tmp_path / "fakesgl"
        (pkg / "jit_kernel").mkdir(parents=True)
        (pkg / "srt").mkdir()
        (pkg / "__init__.py").write_text(textwrap.dedent(init))
        (pkg / "utils.py").write_text(textwrap.dedent(utils))
        (pkg / "jit_kernel" / "__init__.py").write_text("")
        (pkg / "jit_kernel" / "utils.py").write_text("from fakesgl.utils import is_in_ci\n")
        (pkg / "jit_kernel" / "hisparse.py").write_text(
            "from fakesgl.jit_kernel.utils import is_in_ci\n" + textwrap.dedent(kernel))
        (pkg / "srt" / "environ.py").write_text(textwrap.dedent("""
            import os
            class _Flag:
                def get(self):
                    return os.environ.get("SGLANG_IS_IN_CI", "false").lower() in ("1", "true", "yes", "y")
            class envs:
                SGLANG_IS_IN_CI = _Flag()
            """))
        monkeypatch.syspath_prepend(str(tmp_path))
        created.append(pkg)
        return pkg

    yield make
    for k in [k for k in sys.modules if k == "fakesgl" or k.startswith("fakesgl.")]:
        del sys.modules[k]
    sglang_shim.SHIM_STATE.pop("fakesgl", None)


def test_shim_steps_aside_when_the_package_imports(fake_site):
    fake_site("FULL = True\n")
    mod = sglang_shim.import_jit_module("hisparse", package="fakesgl")
    assert mod.VALUE == 42
    assert sglang_shim.SHIM_STATE["fakesgl"]["mode"] == "package"
    assert sys.modules["fakesgl"].FULL is True
    assert not getattr(sys.modules["fakesgl"], "__kvrace_bare__", False)


def test_shim_loads_the_kernels_when_the_top_level_init_fails(fake_site):
    pkg = fake_site("import fakesgl.utils\nraise ImportError('server dependency missing')\n")
    mod = sglang_shim.import_jit_module("hisparse", package="fakesgl")
    assert mod.VALUE == 42 and mod.__file__.startswith(str(pkg))
    bare = sys.modules["fakesgl"]
    assert bare.__kvrace_bare__ and bare.__path__ == [str(pkg)] and not hasattr(bare, "FULL")
    assert sglang_shim.SHIM_STATE["fakesgl"]["mode"] == "shim"
    assert "server dependency missing" in sglang_shim.SHIM_STATE["fakesgl"]["reason"]
    assert sglang_shim.import_jit_module("hisparse", package="fakesgl") is mod


def test_shim_stands_in_for_utils_only_when_it_cannot_import(fake_site, monkeypatch):
    fake_site("raise RuntimeError('no server here')\n", utils="import pybase64_is_not_installed\n")
    mod = sglang_shim.import_jit_module("hisparse", package="fakesgl")
    assert mod.VALUE == 42
    # utils (and kernel_api_logging, which this fake tree does not have either) stood in for
    assert sglang_shim.SHIM_STATE["fakesgl"]["stand_ins"] == ["fakesgl.utils", "fakesgl.kernel_api_logging"]
    monkeypatch.setenv("SGLANG_IS_IN_CI", "true")
    assert mod.is_in_ci() is True


def test_shim_does_not_hide_a_broken_kernel_module(fake_site):
    fake_site("FULL = True\n", kernel="raise ImportError('kernel module broken')\n")
    with pytest.raises(ImportError, match="kernel module broken"):
        sglang_shim.import_jit_module("hisparse", package="fakesgl")
    assert sys.modules["fakesgl"].FULL is True


def test_shim_reports_a_missing_package():
    with pytest.raises(sglang_shim.ShimError, match="package 'kvrace_no_such_pkg' is not installed"):
        sglang_shim.import_jit_module("hisparse", package="kvrace_no_such_pkg")
    sglang_shim.SHIM_STATE.pop("kvrace_no_such_pkg", None)


# ---------------------------------------------------------------- page routines (direct_page_first, staged)

PAGE_CASES = [c for r in base.PAGE_ROUTINES for c in random_cases(r, np.random.default_rng(21), 8)]


def _page_layouts(ub: int = 256, ps: int = 4, layers: int = 3, pages: int = 80):
    dev = PagedLayout("dev", layers, pages * ps, ub)
    return (dev, HostLayout("pf", "page_first", layers, pages * ps, ub),
            HostLayout("pfd", "page_first_direct", layers, pages * ps, ub, ps))


def _pages(first_pages, ps: int = 4) -> list[int]:
    return [p * ps + t for p in first_pages for t in range(ps)]


def test_page_cases_cover_chunks_both_directions_and_scattered_pages():
    names = [c[0] for c in PAGE_CASES]
    assert any("staged" in n and int(n.split()[-2]) > 64 for n in names), names
    assert any("direct" in n and "page_first_direct->paged" in n for n in names), names
    assert any("direct" in n and "paged->page_first_direct" in n for n in names), names
    for _, _, _, args in PAGE_CASES:
        firsts = np.asarray(args["src_indices"])[::args["page_size"]]
        assert np.unique(firsts).size == firsts.size


@pytest.mark.parametrize("name,src,dst,args", PAGE_CASES, ids=[c[0] for c in PAGE_CASES])
def test_page_pieces_are_one_memcpy_per_page_and_match_the_simulator(name, src, dst, args):
    routine = name.split("[")[0]
    p = plan(routine, src, dst, args)
    pages = base.page_pieces(routine, src, dst, args)
    assert len(pages) == p.n_items == len(args["src_indices"]) // args["page_size"]
    want = _merged_plan_rows(p)
    assert np.array_equal(np.concatenate(pages), want)
    # in these cases item_bytes == unit_bytes: a page_first host page (staged, all layers) and a
    # page_first_direct page row (one layer) are contiguous, so each page is one memcpy on the
    # host side; the device side of a staged page is one piece per (token, layer)
    host_side = 1 if dst.kind == "host" else 0
    for x in pages:
        assert np.unique(x[:, host_side] // 1).size == len(x)
        if routine == "direct_page_first":
            assert len(x) == 1, name
    assert np.array_equal(host_pieces(routine, src, dst, args), want)


def test_page_routines_take_only_the_first_index_of_each_page():
    dev, pf, pfd = _page_layouts()
    a = {"layer": 1, "src_indices": [8, 99, 99, 99], "dst_indices": [5, -7, 3, 3], "page_size": 4}
    (piece,) = base.page_pieces("direct_page_first", pfd, dev, a)
    # host page 8 // 4 = 2, rows 8..11 of layer 1; device rows 5..8 of layer 1
    assert piece.tolist() == [[int(pfd.unit_offsets(1, [8])[0]), int(dev.unit_offsets(1, [5])[0]), 4 * 256]]
    a = {"src_indices": [6, 0, 0, 0], "dst_indices": [12, 1, 1, 1], "page_size": 4}
    (piece,) = base.page_pieces("staged_all_layer_lf_pf", dev, pf, a)
    # host tokens 12..15, all 3 layers: one contiguous 4 x 3 x 256 B page; device rows 6..9 per layer
    assert piece[0, 1] == pf.unit_offsets(0, [12])[0] and piece[:, 2].sum() == 4 * 3 * 256
    assert piece[0, 0] == dev.unit_offsets(0, [6])[0] and piece[1, 0] == dev.unit_offsets(1, [6])[0]


def test_providers_refuse_what_the_simulator_refuses_for_page_routines():
    dev, pf, pfd = _page_layouts()
    ragged = {"src_indices": [0, 1, 2], "dst_indices": [4, 5, 6], "page_size": 4}
    for prov in (BuiltinProvider(), TorchProvider(), SGLangProvider()):
        ok, why = prov.supports("staged_all_layer_lf_pf", dev, pfd, {**ragged, "src_indices": [0, 1, 2, 3],
                                                                     "dst_indices": [4, 5, 6, 7]})
        assert not ok and "simulator refuses" in why and "page_first host layout" in why, prov.name
        ok, why = prov.supports("direct_page_first", pfd, dev, {**ragged, "layer": 0})
        assert not ok and "divisible by page size" in why, prov.name
    odd = PagedLayout("odd", 3, 320, 24)
    ok, why = BuiltinProvider().supports("staged_all_layer_lf_pf", odd, HostLayout("h", "page_first", 3, 320, 24),
                                         {"src_indices": [0, 1, 2, 3], "dst_indices": [4, 5, 6, 7],
                                          "page_size": 4, "item_bytes": 16})
    assert not ok and "unit_bytes 24 is not a multiple of 16" in why


def test_staging_chunks_follow_sglangs_capacity():
    from gpu_backend.providers.builtin import staging_page_capacity

    for units, ps, want in ((80 * 4, 4, 64), (10 * 4, 4, 10), (3, 4, 1), (64 * 2, 2, 64), (65 * 2, 2, 64)):
        p = base.layout_params(HostLayout("h", "page_first", 2, units, 64))
        assert staging_page_capacity(p, ps) == want
    assert base.STAGING_PAGE_CHUNK == 64
    blocks, threads, vecs = bk.stage_launch(64, 4, 3, 576 - 576 % 16)
    assert threads == 256 and vecs == 64 * 4 * 3 * (576 // 16) and blocks == -(-vecs // 256)
    assert bk.stage_launch(0, 4, 3, 256)[0] == 0
    assert bk.KERNELS["staged_all_layer_lf_pf"] == "kvr_stage_pages"
    assert "page_tokens" in dict(bk.PARAM_FIELDS)


def test_sglang_staged_rules_name_the_kernel_and_the_problem(monkeypatch):
    dev, pf, _ = _page_layouts()
    args = {"src_indices": _pages([3, 70, 11]), "dst_indices": _pages([0, 79, 40]), "page_size": 4}
    assert SGLangProvider().supports("staged_all_layer_lf_pf", dev, pf, args) == (True, "")
    ok, why = SGLangProvider().supports("staged_all_layer_lf_pf", dev, pf, {**args, "item_bytes": 128})
    assert not ok and "ptr[layer] + t * element_size" in why and "unit_bytes == item_bytes (128)" in why
    host_src = HostLayout("hsrc", "layer_first", 3, 320, 256)
    ok, why = SGLangProvider().supports("staged_all_layer_lf_pf", host_src, pf, args)
    assert not ok and "backs up a device pool" in why and "host source" in why
    ok, why = SGLangProvider().supports("staged_all_layer_lf_pf", dev, pf, {**args, "item_bytes": 64})
    assert not ok and "layer-major" in why
    ok, why = SGLangProvider().supports("staged_all_layer_lf_pf", dev, pf,
                                        {**args, "dst_indices": _pages([0, 80, 40])})
    assert not ok and "dst token 320 is outside 0..319" in why and "uint32" in why


class _FakeKv:
    def transfer_kv_per_layer_direct_pf_lf(self, *a):
        pass

    def transfer_kv_all_layer_direct_lf_pf(self, *a):
        pass


def test_sglang_direct_page_first_rules(monkeypatch):
    import gpu_backend.providers.sglang_kernels as sk

    dev, pf, pfd = _page_layouts()
    h2d = {"layer": 2, "src_indices": _pages([5, 1]), "dst_indices": _pages([0, 9]), "page_size": 4}
    d2h = {**h2d, "src_indices": h2d["dst_indices"], "dst_indices": h2d["src_indices"]}
    monkeypatch.setattr(sk, "_aot", lambda: (None, "sgl_kernel.kvcacheio is not importable (test)"))
    ok, why = SGLangProvider().supports("direct_page_first", pfd, dev, h2d)
    assert not ok and "needs sgl_kernel.transfer_kv_*_direct" in why and "(test)" in why
    monkeypatch.setattr(sk, "_aot", lambda: (_FakeKv(), ""))
    assert SGLangProvider().supports("direct_page_first", pfd, dev, h2d) == (True, "")
    assert SGLangProvider().supports("direct_page_first", dev, pfd, d2h) == (True, "")
    ok, why = SGLangProvider().supports("direct_page_first", dev, dev, h2d)
    assert not ok and "got paged -> paged" in why
    other_ps = HostLayout("pfd8", "page_first_direct", 3, 320, 256, 8)
    ok, why = SGLangProvider().supports("direct_page_first", other_ps, dev, h2d)
    assert not ok and "page_size 4" in why and "page_size 8" in why
    # a device page starting at row 318 reaches rows 318..321: only the first index counts
    ok, why = SGLangProvider().supports("direct_page_first", pfd, dev,
                                        {**h2d, "dst_indices": [0, 1, 2, 3, 318, 0, 0, 0]})
    assert not ok and "dst row 320 is outside 0..319" in why

    class _Old:
        transfer_kv_all_layer_direct_lf_pf = _FakeKv.transfer_kv_all_layer_direct_lf_pf

    monkeypatch.setattr(sk, "_aot", lambda: (_Old(), ""))
    ok, why = SGLangProvider().supports("direct_page_first", pfd, dev, h2d)
    assert not ok and "no transfer_kv_per_layer_direct_pf_lf" in why


class _StridedBytes:
    """The two tensor calls ``_host_pages`` and ``_rows`` make (``storage_offset``, ``as_strided``),
    over a numpy byte array, so the derived views can be read without torch."""

    def __init__(self, base_arr: np.ndarray, offset: int = 0):
        self.base, self.offset = base_arr, offset

    def storage_offset(self) -> int:
        return self.offset

    def as_strided(self, shape, strides, offset):
        return np.lib.stride_tricks.as_strided(self.base[offset:], shape=shape, strides=strides)


def test_sglang_views_of_a_page_first_direct_pool_address_the_layouts_rows():
    import types

    import gpu_backend.providers.sglang_kernels as sk

    _, _, pfd = _page_layouts(ub=32, layers=3, pages=6)
    dev = PagedLayout("dev", 3, 24, 32)
    p, dp = base.layout_params(pfd), base.layout_params(dev)
    raw = np.concatenate([np.zeros(16, np.uint8), np.arange(pfd.nbytes, dtype=np.int64).astype(np.uint8)])
    buf = types.SimpleNamespace(tensor=_StridedBytes(raw, 16))
    whole = sk._host_pages(buf, p, 0, 3)
    one = sk._host_pages(buf, p, 2, 1)
    assert whole.shape == (6, 3, 4, 32) and one.shape == (6, 1, 4, 32)
    for page in range(6):
        for L in range(3):
            off = int(pfd.unit_offsets(L, [page * 4])[0]) + 16
            assert np.array_equal(whole[page, L].reshape(-1), raw[off:off + 4 * 32])
        off = int(pfd.unit_offsets(2, [page * 4])[0]) + 16
        assert np.array_equal(one[page, 0].reshape(-1), raw[off:off + 4 * 32])
    draw = np.arange(dev.nbytes, dtype=np.int64).astype(np.uint8)
    rows = sk._rows(types.SimpleNamespace(tensor=_StridedBytes(draw)), dp, 1, 32)
    off = int(dev.unit_offsets(1, [7])[0])
    assert np.array_equal(rows[7], draw[off:off + 32])


def test_shim_works_with_only_jit_kernel_installed(tmp_path, monkeypatch):
    """Issue 12, item 4: a tree with ``fakesgl/jit_kernel`` alone (no top-level ``__init__``, no
    ``utils``, no ``srt``, no ``kernel_api_logging``): the package imports as a namespace package,
    and the kernels load with the two stand-ins instead of re-raising the missing module."""
    pkg = tmp_path / "fakesgl"
    (pkg / "jit_kernel").mkdir(parents=True)
    (pkg / "jit_kernel" / "__init__.py").write_text("")
    (pkg / "jit_kernel" / "utils.py").write_text("from fakesgl.utils import is_in_ci\n")
    (pkg / "jit_kernel" / "hicache.py").write_text(textwrap.dedent("""
        from fakesgl.jit_kernel.utils import is_in_ci
        from fakesgl.kernel_api_logging import debug_kernel_api

        @debug_kernel_api
        def copy(x):
            return x + 1

        @debug_kernel_api(op_name="named")
        def named(x):
            return x * 2
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mod = sglang_shim.import_jit_module("hicache", package="fakesgl")
        assert mod.copy(1) == 2 and mod.named(3) == 6
        st = sglang_shim.SHIM_STATE["fakesgl"]
        assert st["mode"] == "shim" and sorted(st["stand_ins"]) == ["fakesgl.kernel_api_logging", "fakesgl.utils"]
        assert "fakesgl.utils" in st["reason"]
        monkeypatch.setenv("SGLANG_IS_IN_CI", "yes")
        assert mod.is_in_ci() is True
        monkeypatch.setenv("SGLANG_IS_IN_CI", "0")
        assert mod.is_in_ci() is False
        assert sglang_shim.import_jit_module("hicache", package="fakesgl") is mod
    finally:
        for k in [k for k in sys.modules if k == "fakesgl" or k.startswith("fakesgl.")]:
            del sys.modules[k]
        sglang_shim.SHIM_STATE.pop("fakesgl", None)


def test_a_required_provider_that_is_unavailable_fails_instead_of_skipping(monkeypatch):
    from tests.helpers import skip_unavailable_provider

    monkeypatch.delenv("KVRACE_REQUIRE_PROVIDERS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="provider sglang unavailable: no kernels"):
        skip_unavailable_provider("sglang", "no kernels")
    monkeypatch.setenv("KVRACE_REQUIRE_PROVIDERS", "torch, sglang")
    with pytest.raises(pytest.fail.Exception, match="provider sglang is required .* unavailable: no kernels"):
        skip_unavailable_provider("sglang", "no kernels")
    with pytest.raises(pytest.skip.Exception):
        skip_unavailable_provider("builtin", "no nvrtc")
