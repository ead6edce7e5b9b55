"""Copy routines: extents written out by hand from the kernels' address rules."""
import pytest
from hypothesis import given, settings, strategies as st

from sim.errors import InputError
from sim.pools.layouts import (
    HostLayout, bf16_index_k, c4_paged, dsa_index_k, host_mirror, token_rows,
)
from sim.transfers.routines import ROUTINES, check_bounds, plan


def rows(p):
    return p.extents.rows()  # (item, src, dst, length)


# --- kernel_per_layer: transfer_kv_per_layer_mla (lf) and _pf_lf

def test_kernel_per_layer_layer_first_skips_negatives():
    host = HostLayout("h", "layer_first", layers=2, units=16, unit_bytes=576)
    dev = token_rows(576, layers=2, size=10, page_size=1)  # 11 rows per layer
    p = plan("kernel_per_layer", host, dev,
             {"layer": 1, "src_indices": [3, 4, -1, 7], "dst_indices": [1, 2, 5, -1]}, "op")
    # host layer 1 base = 16*576 = 9,216; device layer 1 base = 11*576 = 6,336
    assert rows(p) == [(0, 9216 + 3 * 576, 6336 + 576, 576),
                       (1, 9216 + 4 * 576, 6336 + 2 * 576, 576)]
    assert p.extents.n_items == 4
    assert p.launch.kind == "warp_quota" and p.launch.warps == 32 and p.launch.chunk_bytes == 256


def test_kernel_per_layer_page_first_host():
    host = HostLayout("h", "page_first", layers=3, units=8, unit_bytes=16)
    dev = token_rows(16, layers=3, size=7)  # 8 rows of 16 B per layer
    p = plan("kernel_per_layer", host, dev, {"layer": 2, "src_indices": [2], "dst_indices": [7]}, "op")
    # page_first: 2*3*16 + 2*16 = 128; device: 2*128 + 7*16 = 368
    assert rows(p) == [(0, 128, 368, 16)]


def test_kernel_per_layer_item_bytes_override_and_errors():
    a = token_rows(16, 1, 7)
    b = token_rows(32, 1, 7)
    with pytest.raises(InputError) as ei:
        plan("kernel_per_layer", a, b, {"layer": 0, "src_indices": [1], "dst_indices": [1]}, "op")
    assert ei.value.where == "op.args.item_bytes"
    p = plan("kernel_per_layer", a, b, {"layer": 0, "src_indices": [1], "dst_indices": [1],
                                        "item_bytes": 8}, "op")
    assert rows(p) == [(0, 16, 32, 8)]
    with pytest.raises(InputError) as ei:
        plan("kernel_per_layer", a, b, {"layer": 0, "src_indices": [1], "dst_indices": [1],
                                        "item_bytes": 12}, "op")
    assert ei.value.where == "op.args.item_bytes" and "divisible by 8" in ei.value.message


# --- kernel_all_layer: one warp per index, layers looped inside the warp

def test_kernel_all_layer_lf_pf():
    dev = token_rows(16, layers=3, size=7)  # layer_bytes 128
    host = HostLayout("h", "page_first", layers=3, units=8, unit_bytes=16)  # page_dim 48
    p = plan("kernel_all_layer", dev, host, {"src_indices": [1, 2], "dst_indices": [5, 0]}, "op")
    assert rows(p) == [
        (0, 16, 240, 16), (0, 144, 256, 16), (0, 272, 272, 16),
        (1, 32, 0, 16), (1, 160, 16, 16), (1, 288, 32, 16),
    ]
    p = plan("kernel_all_layer", dev, host,
             {"src_indices": [1], "dst_indices": [5], "layers": [2, 0]}, "op")
    assert rows(p) == [(0, 272, 272, 16), (0, 16, 240, 16)]


# --- direct_per_layer: coalesced runs

def test_direct_runs_coalesce():
    dev = token_rows(16, layers=1, size=15)
    host = HostLayout("h", "layer_first", layers=1, units=16, unit_bytes=16)
    p = plan("direct_per_layer", dev, host,
             {"layer": 0, "src_indices": [1, 2, 3, 7, 8, 4], "dst_indices": [10, 11, 12, 13, 14, 5]}, "op")
    assert rows(p) == [(0, 16, 160, 48), (1, 112, 208, 32), (2, 64, 80, 16)]
    assert p.launch.kind == "memcpy_runs" and p.extents.n_items == 3
    # consecutive on one side only: no run
    p = plan("direct_per_layer", dev, host, {"layer": 0, "src_indices": [1, 3], "dst_indices": [2, 3]}, "op")
    assert rows(p) == [(0, 16, 32, 16), (1, 48, 48, 16)]


def test_direct_run_split_at_host_page_boundary():
    dev = token_rows(576, layers=2, size=20)  # 21 rows/layer
    host = HostLayout("h", "page_first_direct", layers=2, units=24, unit_bytes=576, page_size=4)
    p = plan("direct_per_layer", dev, host,
             {"layer": 1, "src_indices": [1, 2, 3, 4, 5], "dst_indices": [4, 5, 6, 7, 8]}, "op")
    # dev layer 1 base 21*576 = 12,096. host page 1: 1*(2*4*576) + 1*(4*576) = 6,912;
    # host index 8 = page 2: 2*4,608 + 2,304 = 11,520
    assert rows(p) == [(0, 12096 + 576, 6912, 4 * 576), (0, 12096 + 5 * 576, 11520, 576)]


def test_direct_errors():
    a = token_rows(16, 1, 7)
    with pytest.raises(InputError) as ei:
        plan("direct_per_layer", a, a, {"layer": 0, "src_indices": [1, 2, 3], "dst_indices": [1, 2, 3],
                                        "page_size": 2}, "op")
    assert ei.value.where == "op.args.src_indices" and "divisible by page size" in ei.value.message
    with pytest.raises(InputError) as ei:
        plan("direct_per_layer", a, a, {"layer": 0, "src_indices": [1, -2], "dst_indices": [1, 2]}, "op")
    assert ei.value.where == "op.args.src_indices[1]"


# --- dsa_indexer_per_layer: token indices -> page rows of 8,448 B

def test_dsa_indexer_pages():
    host = HostLayout("ih", "layer_first", layers=2, units=4, unit_bytes=8448)
    dev = dsa_index_k(layers=2, pages=4)
    src = list(range(64, 128)) + list(range(192, 256))   # pages 1, 3
    dst = list(range(128, 192)) + list(range(0, 64))     # pages 2, 0
    p = plan("dsa_indexer_per_layer", host, dev, {"layer": 1, "src_indices": src, "dst_indices": dst}, "op")
    # layer 1 bases: 4*8448 = 33,792 on both sides
    assert rows(p) == [(0, 33792 + 8448, 33792 + 2 * 8448, 8448),
                       (1, 33792 + 3 * 8448, 33792, 8448)]
    assert p.extents.n_items == 2 and p.launch.warps == 32


def test_dsa_indexer_first_token_decides_the_page():
    host = HostLayout("ih", "page_first", layers=2, units=4, unit_bytes=8448)
    dev = dsa_index_k(layers=2, pages=4)
    src = list(range(100, 164))  # first token 100 -> page 1
    p = plan("dsa_indexer_per_layer", host, dev, {"layer": 0, "src_indices": src, "dst_indices": src}, "op")
    # page_first: page 1 layer 0 = 1*2*8448 = 16,896; device page 1 = 8,448
    assert rows(p) == [(0, 16896, 8448, 8448)]


def test_dsa_indexer_not_page_multiple():
    dev = dsa_index_k(layers=1, pages=4)
    with pytest.raises(InputError) as ei:
        plan("dsa_indexer_per_layer", dev, dev,
             {"layer": 0, "src_indices": list(range(65)), "dst_indices": list(range(65))}, "op")
    assert ei.value.where == "op.args.src_indices"
    assert "Index buffer transfer expects page-aligned indices for DSA." in ei.value.message


# --- dsv4_token: the C4 constants, whatever the buffers

def test_dsv4_on_c4_by_hand():
    c4 = c4_paged(layers=2, pages=2)  # layer base 74,880
    p = plan("dsv4_token", c4, c4, {"src_indices": [5, 70], "dst_indices": [64, 3], "layers": [0, 1]}, "op")
    expect = []
    for item, (s, d) in enumerate([(5, 64), (70, 3)]):
        for base in (0, 74880):
            sp, se = divmod(s, 64)
            dp, de = divmod(d, 64)
            expect.append((item, base + sp * 37440 + se * 576, base + dp * 37440 + de * 576, 576))
            expect.append((item, base + sp * 37440 + 36864 + se * 8, base + dp * 37440 + 36864 + de * 8, 8))
    assert rows(p) == expect
    assert rows(p)[0] == (0, 2880, 37440, 576)
    assert rows(p)[1] == (0, 36904, 74304, 8)
    assert p.launch.kind == "warp_per_item" and p.launch.block_threads == 1024


def test_dsv4_matches_token_extents_and_bytewise_on_c4():
    c4 = c4_paged(layers=2, pages=3)
    src, dst = [0, 63, 64, 130, 191], [191, 2, 100, 64, 0]
    for layer in (0, 1):
        p = plan("dsv4_token", c4, c4, {"src_indices": src, "dst_indices": dst, "layers": [layer]}, "op")
        so, ln = c4.token_extents(layer, src)
        do, _ = c4.token_extents(layer, dst)
        assert p.extents.src.tolist() == so.ravel().tolist()
        assert p.extents.dst.tolist() == do.ravel().tolist()
        assert p.extents.length.tolist() == ln.ravel().tolist()
        q = plan("token_bytewise", c4, c4, {"layer": layer, "src_indices": src, "dst_indices": dst}, "op")
        assert rows(q) == rows(p)


def test_dsv4_on_bf16_index_k_moves_wrong_bytes():
    c4 = c4_paged(layers=1, pages=1)
    bf = bf16_index_k(layers=1, tokens=100)  # 25,600 B
    p = plan("dsv4_token", c4, bf, {"src_indices": list(range(48)), "dst_indices": list(range(48))}, "op")
    # token 5 lands at 5*576 = 2,880, not at its bf16 row 5*256 = 1,280
    assert rows(p)[10] == (5, 2880, 2880, 576)
    assert bf.token_extents(0, [5])[0].tolist() == [[1280]]
    oob = check_bounds(p.extents, c4.nbytes, bf.nbytes)
    assert all(o.side == "dst" for o in oob)
    # values of tokens 44..47 cross 25,600 (44*576 = 25,344 -> 320 B out, then 3 x 576);
    # every scale (36,864 + t*8) is past the end: 48 x 8 B.
    values = [o for o in oob if o.length == 576]
    scales = [o for o in oob if o.length == 8]
    assert [(o.item, o.bytes_outside) for o in values] == [(44, 320), (45, 576), (46, 576), (47, 576)]
    assert values[0].first_byte_outside == 25600 and values[1].first_byte_outside == 25920
    assert len(scales) == 48 and scales[0].offset == 36864
    assert sum(o.bytes_outside for o in oob) == 320 + 3 * 576 + 48 * 8 == 2432


def test_dsv4_negative_and_int32_indices():
    c4 = c4_paged(layers=1, pages=2)
    p = plan("dsv4_token", c4, c4, {"src_indices": [2**32 + 5], "dst_indices": [-1]}, "op")
    # src index truncated to int32 -> 5; dst -1 -> page -1, entry 63
    assert rows(p) == [(0, 2880, -37440 + 63 * 576, 576), (0, 36904, -37440 + 36864 + 63 * 8, 8)]
    oob = check_bounds(p.extents, c4.nbytes, c4.nbytes)
    assert [(o.side, o.bytes_outside, o.first_byte_outside) for o in oob] == [
        ("dst", 576, -1152), ("dst", 8, -72)]


# --- token_bytewise

def test_token_bytewise_dsa_to_host_mirror():
    dev = dsa_index_k(layers=2, pages=2)
    host = host_mirror(dev, "page_first", units=3)
    p = plan("token_bytewise", dev, host, {"layer": 1, "src_indices": [65, -1], "dst_indices": [3, 4]}, "op")
    # dev: layer 1 page 1 = 16,896 + 8,448 = 25,344, entry 1;
    # host page_first: page 0 layer 1 = 8,448, entry 3
    assert rows(p) == [(0, 25344 + 128, 8448 + 3 * 128, 128),
                       (0, 25344 + 8192 + 4, 8448 + 8192 + 12, 4)]
    assert p.extents.n_items == 2


def test_token_bytewise_field_mismatch():
    with pytest.raises(InputError) as ei:
        plan("token_bytewise", c4_paged(1, 1), bf16_index_k(1, 10),
             {"layer": 0, "src_indices": [0], "dst_indices": [0]}, "op")
    assert ei.value.where == "op.args" and "entry_bytes" in ei.value.message


# --- launch shapes

@pytest.mark.parametrize("n,ipw,blocks,warps", [(1, 1, 1, 32), (64, 1, 2, 64), (65, 2, 2, 64), (1000, 16, 2, 64)])
def test_warp_quota_launch(n, ipw, blocks, warps):
    lay = token_rows(16, 1, 2000)
    p = plan("kernel_per_layer", lay, lay, {"layer": 0, "src_indices": list(range(n)),
                                            "dst_indices": list(range(n))}, "op")
    L = p.launch
    assert (L.items_per_warp, L.blocks, L.warps, L.block_threads) == (ipw, blocks, warps, 1024)
    last = n - 1
    assert (int(L.warp_of(last)), int(L.round_of(last))) == (last % warps, last // warps)


@pytest.mark.parametrize("n,blocks", [(1, 1), (64, 2), (65, 3), (1000, 32)])
def test_warp_per_item_launch(n, blocks):
    c4 = c4_paged(1, 16)
    p = plan("dsv4_token", c4, c4, {"src_indices": list(range(n)), "dst_indices": list(range(n))}, "op")
    assert (p.launch.blocks, p.launch.warps, p.launch.chunk_bytes) == (blocks, 32 * blocks, 584)
    assert int(p.launch.round_of(n - 1)) == 0


# --- argument errors name the key

@pytest.mark.parametrize("routine,args,where,text", [
    ("kernel_per_layer", {"layer": 0, "src_indices": [1, 2, 3], "dst_indices": [1, 2, 3, 4]},
     "op.args.dst_indices", "src_indices and dst_indices must have equal length (got 3 and 4)"),
    ("kernel_per_layer", {"src_indices": [1], "dst_indices": [1]}, "op.args.layer", "got nothing"),
    ("kernel_per_layer", {"layer": 5, "src_indices": [1], "dst_indices": [1]}, "op.args.layer", "got 5"),
    ("kernel_per_layer", {"layer": 0, "src_indices": [1, True], "dst_indices": [1, 2]},
     "op.args.src_indices[1]", "True"),
    ("kernel_per_layer", {"layer": 0, "src_indices": "1", "dst_indices": [1]}, "op.args.src_indices", "list"),
    ("kernel_per_layer", {"layer": 0, "src_indices": [1], "dst_indices": [1], "layers": [0]},
     "op.args.layers", "unknown key"),
    ("kernel_all_layer", {"src_indices": [1], "dst_indices": [1], "layers": [0, 9]},
     "op.args.layers[1]", "got 9"),
    ("dsv4_token", {"src_indices": [1], "dst_indices": [1], "layers": []}, "op.args.layers", "non-empty"),
    ("dsa_indexer_per_layer", {"layer": 0, "src_indices": [1], "dst_indices": [1], "page_size": 0},
     "op.args.page_size", ">= 1"),
])
def test_arg_errors(routine, args, where, text):
    lay = token_rows(16, 2, 7)
    with pytest.raises(InputError) as ei:
        plan(routine, lay, lay, args, "op")
    assert ei.value.where == where
    assert text in ei.value.message


def test_unknown_routine_and_registry():
    with pytest.raises(InputError) as ei:
        plan("memcpy", token_rows(16, 1, 1), token_rows(16, 1, 1), {}, "op")
    assert ei.value.where == "op.routine" and "kernel_per_layer" in ei.value.message
    assert set(ROUTINES) == {"kernel_per_layer", "kernel_all_layer", "direct_per_layer",
                             "dsa_indexer_per_layer", "dsv4_token", "token_bytewise",
                             "staged_all_layer_lf_pf", "direct_page_first"}
    for r in ROUTINES.values():
        assert r.doc and r.sglang_name and "src_indices" in r.required_args


# --- properties

idx_lists = st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 127), min_size=n, max_size=n),
    st.lists(st.integers(0, 127), min_size=n, max_size=n)))


@settings(max_examples=40, deadline=None)
@given(idx_lists, st.integers(0, 2))
def test_total_length_is_items_times_item_bytes(pair, layer):
    s, d = pair
    n = len(s)
    rows576 = token_rows(576, 3, 127)
    host = HostLayout("h", "page_first", layers=3, units=128, unit_bytes=576)
    c4 = c4_paged(3, 2)
    ix = dsa_index_k(3, 2)
    a = {"src_indices": s, "dst_indices": d}
    assert plan("kernel_per_layer", host, rows576, {**a, "layer": layer}).extents.total_bytes == n * 576
    assert plan("kernel_all_layer", rows576, host, a).extents.total_bytes == n * 3 * 576
    assert plan("direct_per_layer", host, rows576, {**a, "layer": layer}).extents.total_bytes == n * 576
    assert plan("dsv4_token", c4, c4, {**a, "layers": [0, layer]}).extents.total_bytes == n * 2 * 584
    assert plan("token_bytewise", ix, ix, {**a, "layer": layer}).extents.total_bytes == n * 132
    tok = [t for p in s for t in range(p * 64, p * 64 + 64)][:64 * 4]
    q = plan("dsa_indexer_per_layer", ix, ix, {"src_indices": tok, "dst_indices": tok, "layer": layer})
    assert q.extents.total_bytes == (len(tok) // 64) * 8448
    for p in (plan("kernel_all_layer", rows576, host, a),):
        ib = p.extents.item_bytes()
        assert ib.tolist() == [3 * 576] * n


@settings(max_examples=40, deadline=None)
@given(idx_lists, st.sampled_from(["dsa", "c4", "rows"]))
def test_token_bytewise_same_relative_place(pair, which):
    s, d = pair
    lay = {"dsa": dsa_index_k(2, 2), "c4": c4_paged(2, 2), "rows": token_rows(656, 2, 127)}[which]
    p = plan("token_bytewise", lay, lay, {"layer": 1, "src_indices": s, "dst_indices": d})
    nf = len(lay.effective_fields)
    for k, (item, so, do, ln) in enumerate(p.extents.rows()):
        a, b = lay.describe(so), lay.describe(do)
        a_end, b_end = lay.describe(so + ln - 1), lay.describe(do + ln - 1)
        assert (a["token"], b["token"]) == (s[item], d[item])
        assert a["layer"] == b["layer"] == 1
        assert a["field"] == b["field"] == lay.effective_fields[k % nf].name
        assert a["byte"] == b["byte"] == 0
        assert a_end["field"] == a["field"] and a_end["byte"] == b_end["byte"] == ln - 1
    assert not check_bounds(p.extents, lay.nbytes, lay.nbytes)


def test_count_out_of_bounds_matches_check_bounds():
    from sim.transfers.routines import check_bounds, count_out_of_bounds

    src, dst = token_rows(576, 1, 8), token_rows(576, 1, 4)
    ext = plan("kernel_per_layer", src, dst,
               {"layer": 0, "src_indices": [0, 7, 9, 3], "dst_indices": [5, 1, 2, 6]}).extents
    n = count_out_of_bounds(ext, src.nbytes, dst.nbytes)
    assert n == len(check_bounds(ext, src.nbytes, dst.nbytes)) == 3
