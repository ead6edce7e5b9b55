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
    assert sglang_shim.SHIM_STATE["fakesgl"]["stand_ins"] == ["fakesgl.utils"]
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
