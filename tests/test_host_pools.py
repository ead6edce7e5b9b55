"""Host pools: SGLang 0.5.14 sizing and slot order (pool_host/base.py), the
routine each (pool, layout, io backend) launches (memory_pool_host.py), and
byte checks: running the returned ops through the executor puts every token's
bytes where the layouts say."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.errors import InputError
from sim.executor import run_programs
from sim.pools.device import DeepSeekV4TokenToKVPool, DSATokenToKVPool, MLATokenToKVPool
from sim.pools.host import (
    HICACHE_HOST_MEMORY_RESERVE_BYTES, DSAIndexerPoolHost, HostPoolGroup, LogicalHostPool, MLATokenToKVPoolHost,
    PoolEntry, PoolTransfer, UnsupportedTransfer, deepseek_v4_num_host_pages, resolve_layout_io_compatibility,
)
from sim.pools.layouts import HostLayout, token_rows
from sim.transfers.routines import plan
from tests.helpers import profile


# ---------------------------------------------------------------- helpers

def run_ops(buffers, ops, init):
    """Run ``ops`` in order on one stream; ``init``: buffer name -> (units, owner)."""
    bufs = []
    for b in buffers:
        b = dict(b)
        if b["name"] in init:
            units, owner = init[b["name"]]
            b["init"] = [{"layers": "all", "indices": [int(u) for u in units], "owner": owner, "version": 1}]
        bufs.append(b)
    header = {"kvrace_schedule": 2, "name": "t", "buffers": bufs, "streams": ["s"], "events": []}

    def prog(host):
        for op in ops:
            host.issue({**op, "stream": "s"})
        yield host.synchronize()
    return run_programs(header, {"host": prog}, profile()).memory


def token_bytes(mem, name, layout, layer, tokens):
    """Per-token bytes (all fields, in field order) of ``tokens`` at ``layer``."""
    data = mem.final_bytes(name)
    offs, lens = layout.token_extents(layer, tokens)
    return [b"".join(data[o:o + n].tobytes() for o, n in zip(ro, rl)) for ro, rl in zip(offs, lens)]


def assert_tokens_equal(mem, a, la, ta, b, lb, tb, layers):
    for L in layers:
        assert token_bytes(mem, a, la, L, ta) == token_bytes(mem, b, lb, L, tb), f"layer {L}"


def mla(size=64, page_size=4, layers=3, itemsize=1, **kw):
    return MLATokenToKVPool(size, page_size, layers, itemsize=itemsize, **kw)


# ---------------------------------------------------------------- sizing and slots

def test_sizing_by_ratio_adds_one_page_even_when_aligned():
    dev = MLATokenToKVPool(1000, 64, 2)
    h = MLATokenToKVPoolHost(dev, 2.0, 0, 64, "layer_first")
    assert (h.page_num, h.size) == (2000 // 64 + 1, 32 * 64)
    dev = MLATokenToKVPool(512, 64, 2)
    h = MLATokenToKVPoolHost(dev, 2.0, 0, 64, "layer_first")
    assert (h.page_num, h.size) == (17, 1088)          # 1024 was aligned: still + 1 page


def test_sizing_by_gigabytes_uses_size_per_token():
    dev = DSATokenToKVPool(1024, 64, 61)               # fp8 latent: 656 B x 61 layers
    h = MLATokenToKVPoolHost(dev, 2.0, 1, 64, "page_first")
    assert h.size_per_token == 656 * 61 == 40016
    # int(1e9 // 40016) = 24990 tokens -> 391 pages
    assert (h.page_num, h.size) == (391, 25024)


def test_host_must_exceed_device_and_memory_reserve():
    dev = MLATokenToKVPool(1000, 64, 2)
    with pytest.raises(InputError) as ei:
        MLATokenToKVPoolHost(dev, 0.5, 0, 64, "layer_first")      # 500 -> 512 tokens
    assert "larger than the device memory" in ei.value.message
    need = 32 * 64 * (576 * 2) * 2             # tokens x row bytes (bf16) x layers
    MLATokenToKVPoolHost(dev, 2.0, 0, 64, "layer_first",
                         host_memory_available=need + HICACHE_HOST_MEMORY_RESERVE_BYTES)
    with pytest.raises(InputError) as ei:
        MLATokenToKVPoolHost(dev, 2.0, 0, 64, "layer_first",
                             host_memory_available=need - 1 + HICACHE_HOST_MEMORY_RESERVE_BYTES)
    assert ei.value.where == "host_memory_available"


def test_host_slots_front_alloc_back_free_page_multiples():
    dev = mla(size=8, page_size=4)
    h = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")         # 16 -> 20 slots
    assert h.size == 20 and h.available_size() == 20
    assert h.alloc(8).tolist() == list(range(8))                   # slot 0 is used on the host
    with pytest.raises(InputError) as ei:
        h.alloc(3)
    assert "multiple of the page size" in ei.value.message
    assert h.free(np.array([4, 5, 6, 7])) == 4
    assert h.free_slots.tolist()[-4:] == [4, 5, 6, 7]
    assert h.alloc(12).tolist() == list(range(8, 20))
    assert h.alloc(8) is None
    assert h.alloc(4).tolist() == [4, 5, 6, 7]
    h.clear()
    assert h.available_size() == 20


def test_layout_io_coercion():
    assert resolve_layout_io_compatibility("page_first_direct", "kernel") == ("page_first_direct", "direct")
    assert resolve_layout_io_compatibility("page_first", "direct") == ("page_first_direct", "direct")
    assert resolve_layout_io_compatibility("page_first", "kernel") == ("page_first", "kernel")
    assert resolve_layout_io_compatibility("page_first", "kernel", is_hip=True) == ("layer_first", "kernel")
    assert resolve_layout_io_compatibility("layer_first", "direct") == ("layer_first", "direct")
    with pytest.raises(InputError):
        resolve_layout_io_compatibility("page_head", "kernel")


# ---------------------------------------------------------------- MLA: routine choice

MLA_CASES = [
    # layout, backend, load routine, load note, backup routine, backup note (576 B fp8 rows)
    ("layer_first", "kernel", "kernel_per_layer", "sgl_kernel.transfer_kv_per_layer_mla",
     "kernel_all_layer", "sgl_kernel.transfer_kv_all_layer_mla"),
    ("page_first", "kernel", "kernel_per_layer", "sgl_kernel.transfer_kv_per_layer_mla_pf_lf",
     "staged_all_layer_lf_pf", "jit_transfer_hicache_all_layer_mla_staged_lf_pf"),
    ("layer_first", "direct", "direct_per_layer", "sgl_kernel.transfer_kv_direct",
     "direct_per_layer", "sgl_kernel.transfer_kv_direct"),
    ("page_first_direct", "direct", "direct_page_first", "sgl_kernel.transfer_kv_per_layer_direct_pf_lf",
     "direct_page_first", "sgl_kernel.transfer_kv_all_layer_direct_lf_pf"),
]


@pytest.mark.parametrize("layout,backend,lr,ln,br,bn", MLA_CASES)
def test_mla_routines_and_bytes(layout, backend, lr, ln, br, bn):
    dev = mla(prefix="d_")
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, layout, prefix="h_")
    hidx = host.alloc(12)
    host.free(hidx[:4])
    hidx = np.concatenate([hidx[4:], host.alloc(4)])          # not one run
    didx = np.array([8, 9, 10, 11, 20, 21, 22, 23, 4, 5, 6, 7])
    # backup: device tokens (owner 7) -> host
    ops = host.backup_from_device_all_layer(dev, hidx, didx, backend)
    assert {o["routine"] for o in ops} == {br} and all(o["note"].startswith(bn) for o in ops)
    assert all(set(o) == {"op", "routine", "src", "dst", "args", "note"} for o in ops)
    assert all((o["src"], o["dst"]) == ("d_kv_buffer", "h_kv_buffer") for o in ops)
    bufs = dev.buffers() + host.buffers()
    mem = run_ops(bufs, ops, {"d_kv_buffer": (didx, 7)})
    assert_tokens_equal(mem, "h_kv_buffer", host.kv_layout, hidx, "d_kv_buffer", dev.kv_layout, didx, range(3))
    # load layer 1: host tokens (owner 9) -> device; layer 0 and 2 untouched
    ops = host.load_to_device_per_layer(dev, hidx, didx, 1, backend)
    assert [o["routine"] for o in ops] == [lr] and ops[0]["note"] == ln and ops[0]["args"]["layer"] == 1
    mem = run_ops(bufs, ops, {"h_kv_buffer": (hidx, 9), "d_kv_buffer": (didx, 7)})
    assert_tokens_equal(mem, "d_kv_buffer", dev.kv_layout, didx, "h_kv_buffer", host.kv_layout, hidx, [1])
    with pytest.raises(AssertionError):
        assert_tokens_equal(mem, "d_kv_buffer", dev.kv_layout, didx, "h_kv_buffer", host.kv_layout, hidx, [0])


@pytest.mark.parametrize("layout,backend", [("page_first_direct", "kernel"), ("page_first", "direct"),
                                            ("layer_first", "kernel_ascend")])
def test_mla_unsupported_pairs_raise_like_sglang(layout, backend):
    dev = mla()
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, layout)
    with pytest.raises(UnsupportedTransfer):
        host.load_to_device_per_layer(dev, [0, 1, 2, 3], [4, 5, 6, 7], 0, backend)
    with pytest.raises(UnsupportedTransfer):
        host.backup_from_device_all_layer(dev, [0, 1, 2, 3], [4, 5, 6, 7], backend)


def test_mla_jit_choice_by_element_size():
    bf16 = mla(itemsize=2)                       # 1,152 B: JIT (multiple of 128)
    h = MLATokenToKVPoolHost(bf16, 2.0, 0, 4, "layer_first")
    assert h.can_use_jit and not h.can_use_write_back_jit
    assert h.load_to_device_per_layer(bf16, [0], [4], 0, "kernel")[0]["note"] == \
        "jit_transfer_hicache_one_layer_mla"
    assert h.backup_from_device_all_layer(bf16, [0], [4], "kernel")[0]["note"] == \
        "jit_transfer_hicache_all_layer_mla"
    odd = mla(override_kv_cache_dim=584)         # 584 B: no JIT, no staged write-back (584 % 16 = 8)
    h = MLATokenToKVPoolHost(odd, 2.0, 0, 4, "page_first")
    assert not h.can_use_jit and not h.can_use_write_back_jit
    ops = h.backup_from_device_all_layer(odd, [0, 1, 2, 3], [4, 5, 6, 7], "kernel")
    assert [(o["routine"], o["note"]) for o in ops] == [("kernel_all_layer",
                                                         "sgl_kernel.transfer_kv_all_layer_mla_lf_pf")]


def test_direct_backup_is_one_memcpy_routine_per_layer():
    dev = mla(layers=3)
    h = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")
    ops = h.backup_from_device_all_layer(dev, [0, 1, 2, 3], [4, 5, 6, 7], "direct")
    assert [o["args"]["layer"] for o in ops] == [0, 1, 2]
    assert all(o["args"]["page_size"] == 4 for o in ops)


# ---------------------------------------------------------------- staged write-back

def test_staged_chunks_of_64_pages():
    dev = mla(size=512, page_size=4, layers=2)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "page_first")
    assert host.staging_page_capacity == 64
    hidx = host.alloc(300)                        # 75 pages
    didx = np.arange(4, 304)
    ops = host.backup_from_device_all_layer(dev, hidx, didx, "kernel")
    assert [len(o["args"]["src_indices"]) for o in ops] == [256, 44]
    assert ops[1]["args"]["dst_indices"][0] == int(hidx[256])
    mem = run_ops(dev.buffers() + host.buffers(), ops, {"kv_buffer": (didx, 3)})
    assert_tokens_equal(mem, "host_kv_buffer", host.kv_layout, hidx, "kv_buffer", dev.kv_layout, didx, [0, 1])


def test_staged_capacity_is_capped_by_page_num():
    dev = mla(size=16, page_size=4)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "page_first")   # 32 -> 36 slots = 9 pages
    assert host.staging_page_capacity == 9
    ops = host.backup_from_device_all_layer(dev, np.arange(36), np.arange(4, 40), "kernel")
    assert [len(o["args"]["src_indices"]) for o in ops] == [36]


def test_staged_routine_by_hand_first_index_of_a_page_decides():
    """One memcpy per page of page_size x layers rows from host index
    dst[p*ps]; the other indices of the page are not read."""
    dev = token_rows(16, layers=2, size=8, page_size=2)      # 10 rows, layer_bytes 160
    host = HostLayout("h", "page_first", layers=2, units=8, unit_bytes=16, page_size=2)  # 32 B per unit
    p = plan("staged_all_layer_lf_pf", dev, host,
             {"src_indices": [4, 9, 2, 3], "dst_indices": [6, 0, 2, 3], "page_size": 2}, "op")
    rows = p.extents.rows()
    # page 0: device tokens 4, 5 -> host units 6, 7 (contiguous 64 B on the host)
    assert rows[:4] == [(0, 64, 192, 16), (0, 224, 208, 16), (0, 80, 224, 16), (0, 240, 240, 16)]
    # page 1: device tokens 2, 3 -> host units 2, 3
    assert rows[4:] == [(1, 32, 64, 16), (1, 192, 80, 16), (1, 48, 96, 16), (1, 208, 112, 16)]
    assert p.launch.kind == "memcpy_runs" and p.extents.n_items == 2
    # the AOT all-layer kernel honours every index instead
    k = plan("kernel_all_layer", dev, host, {"src_indices": [4, 9, 2, 3], "dst_indices": [6, 0, 2, 3]}, "op")
    pairs = {(src, dst) for _, src, dst, _ in rows}
    assert (144, 0) in {(src, dst) for _, src, dst, _ in k.extents.rows()} and (144, 0) not in pairs


def test_staged_routine_errors():
    dev = token_rows(16, layers=2, size=8, page_size=2)
    pf = HostLayout("h", "page_first", layers=2, units=8, unit_bytes=16)
    with pytest.raises(InputError) as ei:
        plan("staged_all_layer_lf_pf", dev, pf, {"src_indices": [1, 2, 3], "dst_indices": [1, 2, 3],
                                                 "page_size": 2}, "op")
    assert ei.value.where == "op.args.src_indices"
    lf = HostLayout("h", "layer_first", layers=2, units=8, unit_bytes=16)
    with pytest.raises(InputError) as ei:
        plan("staged_all_layer_lf_pf", dev, lf, {"src_indices": [2, 3], "dst_indices": [2, 3],
                                                 "page_size": 2}, "op")
    assert ei.value.where == "op.dst_layout"
    odd = token_rows(24, layers=2, size=8)
    pf24 = HostLayout("h", "page_first", layers=2, units=8, unit_bytes=24)
    with pytest.raises(InputError) as ei:
        plan("staged_all_layer_lf_pf", odd, pf24, {"src_indices": [2], "dst_indices": [2], "page_size": 1}, "op")
    assert "16" in ei.value.message


# ---------------------------------------------------------------- DSA: anchor + indexer sidecar

DSA_CASES = [
    ("layer_first", "kernel", ["kernel_per_layer", "dsa_indexer_per_layer"], ["kernel_all_layer", "kernel_all_layer"]),
    ("page_first", "kernel", ["kernel_per_layer", "dsa_indexer_per_layer"],
     ["staged_all_layer_lf_pf", "staged_all_layer_lf_pf"]),
    ("layer_first", "direct", ["direct_per_layer", "direct_per_layer"], ["direct_per_layer"] * 4),
    ("page_first_direct", "direct", ["direct_page_first", "direct_page_first"], ["direct_page_first"] * 4),
]


@pytest.mark.parametrize("layout,backend,load_routines,backup_routines", DSA_CASES)
def test_dsa_group_order_routines_and_bytes(layout, backend, load_routines, backup_routines):
    dev = DSATokenToKVPool(256, 64, 2, prefix="r0_")
    group = HostPoolGroup.for_dsa(dev, 2.0, 0, layout, prefix="r0_host_")
    ix: DSAIndexerPoolHost = group.get_pool("indexer")
    assert group.size == 576 and ix.indexer_page_num == (576 + 64 + 1) // 64 == 10
    hidx = group.alloc(192)
    group.free(hidx[:64])
    hidx = np.concatenate([hidx[64:], group.alloc(64)[:0], group.alloc(64)])   # pages 1, 2, 3... reordered
    didx = np.concatenate([np.arange(128, 192), np.arange(64, 128), np.arange(192, 256)])
    bufs = dev.buffers() + group.buffers()
    ops = group.backup_from_device_all_layer(dev, hidx, didx, backend)
    assert [o["routine"] for o in ops] == backup_routines
    kv_ops = [o for o in ops if o["src"] == "r0_kv_buffer"]
    assert ops[:len(kv_ops)] == kv_ops                       # the anchor first, then the sidecar
    mem = run_ops(bufs, ops, {"r0_kv_buffer": (didx, 5), "r0_index_k_with_scale_buffer": (didx[::64] // 64, 5)})
    assert_tokens_equal(mem, "r0_host_kv_buffer", group.get_pool("kv").kv_layout, hidx,
                        "r0_kv_buffer", dev.kv_layout, didx, [0, 1])
    assert_tokens_equal(mem, "r0_host_index_k_with_scale_buffer", ix.index_k_layout, hidx,
                        "r0_index_k_with_scale_buffer", dev.index_k_layout, didx, [0, 1])
    ops = group.load_to_device_per_layer(dev, hidx, didx, 1, backend)
    assert [o["routine"] for o in ops] == load_routines
    assert [o["dst"] for o in ops] == ["r0_kv_buffer", "r0_index_k_with_scale_buffer"]
    mem = run_ops(bufs, ops, {"r0_host_kv_buffer": (hidx, 8),
                              "r0_host_index_k_with_scale_buffer": (hidx[::64] // 64, 8)})
    assert_tokens_equal(mem, "r0_kv_buffer", dev.kv_layout, didx,
                        "r0_host_kv_buffer", group.get_pool("kv").kv_layout, hidx, [1])
    assert_tokens_equal(mem, "r0_index_k_with_scale_buffer", dev.index_k_layout, didx,
                        "r0_host_index_k_with_scale_buffer", ix.index_k_layout, hidx, [1])


def test_dsa_indexer_page_conversion_and_direct_page_indices():
    dev = DSATokenToKVPool(256, 64, 1)
    group = HostPoolGroup.for_dsa(dev, 2.0, 0, "layer_first")
    h = np.arange(130, 258)                 # not page-aligned: first token of each group decides
    d = np.arange(64, 192)
    op = group.get_pool("indexer").load_to_device_per_layer(dev, h, d, 0, "direct")[0]
    assert op["args"]["src_indices"] == [130 // 64, 194 // 64] and op["args"]["dst_indices"] == [1, 2]
    assert op["args"]["page_size"] == 1
    with pytest.raises(InputError) as ei:
        group.get_pool("indexer").load_to_device_per_layer(dev, h[:65], d[:65], 0, "kernel")
    assert "page-aligned" in ei.value.message


def test_group_skips_empty_anchor_and_honours_pool_transfers_and_layer_mapper():
    dev = DSATokenToKVPool(256, 64, 2)
    g = HostPoolGroup.for_dsa(dev, 2.0, 0, "layer_first")
    assert g.load_to_device_per_layer(dev, [], [], 0, "kernel", pool_transfers=[]) == []
    ops = g.load_to_device_per_layer(dev, np.arange(64), np.arange(64, 128), 0, "kernel", pool_transfers=[])
    assert [o["src"] for o in ops] == ["host_kv_buffer"]
    pt = [PoolTransfer("indexer", np.arange(64, 128), np.arange(128, 192))]
    ops = g.load_to_device_per_layer(dev, np.arange(64), np.arange(64, 128), 0, "kernel", pool_transfers=pt)
    assert ops[1]["args"]["src_indices"][0] == 64 and ops[1]["args"]["dst_indices"][0] == 128
    odd_layers = HostPoolGroup([PoolEntry("kv", g.get_pool("kv"), dev, lambda i: i, True),
                                PoolEntry("indexer", g.get_pool("indexer"), dev, lambda i: None if i else 0)])
    assert len(odd_layers.load_to_device_per_layer(dev, np.arange(64), np.arange(64, 128), 1, "kernel")) == 1
    assert len(odd_layers.load_to_device_per_layer(dev, np.arange(64), np.arange(64, 128), 0, "kernel")) == 2
    assert g.alloc(64).tolist() == list(range(64)) and g.available_size() == g.size - 64
    assert g.get_pool("indexer").available_size() == g.size            # sidecar slots are never used


def test_two_ranks_coexist_in_one_run():
    pools = []
    for r in range(2):
        dev = DSATokenToKVPool(128, 64, 1, prefix=f"r{r}_", device=r)
        pools.append((dev, HostPoolGroup.for_dsa(dev, 2.0, 0, "layer_first", prefix=f"r{r}_host_")))
    bufs = [b for dev, g in pools for b in dev.buffers() + g.buffers()]
    assert len({b["name"] for b in bufs}) == len(bufs) == 8
    assert {b["device"] for b in bufs} == {0, 1}
    ops = [o for dev, g in pools for o in g.load_to_device_per_layer(dev, np.arange(64), np.arange(64, 128), 0,
                                                                     "kernel")]
    mem = run_ops(bufs, ops, {"r1_host_kv_buffer": (np.arange(64), 4)})
    dev1, g1 = pools[1]
    assert_tokens_equal(mem, "r1_kv_buffer", dev1.kv_layout, np.arange(64, 128),
                        "r1_host_kv_buffer", g1.get_pool("kv").kv_layout, np.arange(64), [0])
    dev0, g0 = pools[0]
    r0 = token_bytes(mem, "r0_kv_buffer", dev0.kv_layout, 0, np.arange(64, 128))
    assert r0 != token_bytes(mem, "r1_host_kv_buffer", g1.get_pool("kv").kv_layout, 0, np.arange(64))
    assert r0 == token_bytes(mem, "r0_host_kv_buffer", g0.get_pool("kv").kv_layout, 0, np.arange(64))


# ---------------------------------------------------------------- DeepSeek V4

def v4(layout="layer_first", ratios=(0, 4, 128, 4), size=2048, **kw):
    dev = DeepSeekV4TokenToKVPool(size, 256, list(ratios), prefix="d_", **kw)
    return dev, HostPoolGroup.for_deepseek_v4(dev, 2.0, layout, prefix="h_")


def page_rows(mem, name, layout, layer, rows):
    data = mem.final_bytes(name)
    offs = layout.unit_offsets(layer, rows)
    return [data[o:o + layout.unit_bytes].tobytes() for o in offs]


def test_v4_host_pages_and_logical_anchor():
    assert deepseek_v4_num_host_pages(2048, 256, 2.0) == 16
    assert deepseek_v4_num_host_pages(2000, 256, 1.0) == 9          # max(int(8 * 1.0), 8 + 1)
    with pytest.raises(InputError) as ei:
        deepseek_v4_num_host_pages(2048, 256, 2.0, hicache_size=10)
    assert ei.value.where == "hicache_size"
    dev, g = v4()
    assert isinstance(g.anchor_entry.host_pool, LogicalHostPool) and g.size == 16 * 256
    assert [e.name for e in g.entries] == ["kv", "deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128"]
    with pytest.raises(InputError):
        g.alloc(100)                                                 # the logical anchor is page-aligned
    with pytest.raises(InputError):
        g.free(np.arange(3))
    c4 = g.get_pool("deepseek_v4_c4")
    assert (c4.item_bytes, c4.num_host_pages, c4.size) == (37440, 16, 4096)
    assert c4.alloc(300).tolist() == list(range(512))                # rounds up to the slot page
    assert [b["name"] for b in g.buffers()] == ["h_deepseek_v4_c4_kv_buffer",
                                                "h_deepseek_v4_c4_indexer_kv_buffer",
                                                "h_deepseek_v4_c128_kv_buffer"]
    assert [b["name"] for b in g.device_buffers()] == ["d_c4_kv_buffer", "d_c4_indexer_index_k_with_scale_buffer",
                                                       "d_c128_kv_buffer"]


V4_PAGE_CASES = [
    ("layer_first", "kernel", "kernel_per_layer", "kernel_all_layer"),
    ("page_first", "kernel", "kernel_per_layer", "staged_all_layer_lf_pf"),
    ("layer_first", "direct", "direct_per_layer", "direct_per_layer"),
    ("page_first_direct", "direct", "direct_page_first", "direct_page_first"),
]


@pytest.mark.parametrize("layout,backend,load_r,backup_r", V4_PAGE_CASES)
def test_v4_page_aligned_routines_and_bytes(layout, backend, load_r, backup_r):
    dev, g = v4(layout)
    h = g.alloc(768)
    g.free(h[:256])
    h = np.concatenate([h[256:], g.alloc(256)])            # host pages 1, 2, 3
    d = np.concatenate([np.arange(1024, 1280), np.arange(256, 768)])   # full pages 4, 1, 2
    hr, dr = h[::256] // 256, d[::256] // 256
    bufs = g.device_buffers() + g.buffers()
    ops = g.backup_from_device_all_layer(dev, h, d, backend)
    assert {o["routine"] for o in ops} == {backup_r}
    assert [o["src"] for o in ops][0] == "d_c4_kv_buffer" and ops[-1]["src"] == "d_c128_kv_buffer"
    mem = run_ops(bufs, ops, {"d_c4_kv_buffer": (dr, 6), "d_c4_indexer_index_k_with_scale_buffer": (dr, 6),
                              "d_c128_kv_buffer": (dr, 6)})
    for e in g.entries[1:]:
        hp = e.host_pool
        for L in range(hp.layer_num):
            assert page_rows(mem, hp.kv_buffer, hp.kv_layout, L, hr) == \
                page_rows(mem, hp.device_buffer, hp.device_layout, L, dr), (e.name, L)
    # layer 3 is the second C4 layer (compress id 1) and no C128 layer
    ops = g.load_to_device_per_layer(dev, h, d, 3, backend)
    assert [(o["routine"], o["dst"], o["args"]["layer"]) for o in ops] == [
        (load_r, "d_c4_kv_buffer", 1), (load_r, "d_c4_indexer_index_k_with_scale_buffer", 1)]
    ops = g.load_to_device_per_layer(dev, h, d, 2, backend)
    assert [(o["dst"], o["args"]["layer"]) for o in ops] == [("d_c128_kv_buffer", 0)]
    assert g.load_to_device_per_layer(dev, h, d, 0, backend) == []           # a SWA-only layer
    ops = g.load_to_device_per_layer(dev, h, d, 3, backend)
    c4h = g.get_pool("deepseek_v4_c4")
    mem = run_ops(bufs, ops, {c4h.kv_buffer: (hr, 2)})
    assert page_rows(mem, "d_c4_kv_buffer", dev.c4_kv_pool.kv_layout, 1, dr) == \
        page_rows(mem, c4h.kv_buffer, c4h.kv_layout, 1, hr)


def test_v4_token_granular_uses_dsv4_token_on_raw_indices():
    dev, g = v4("layer_first")
    h, d = np.arange(100), np.arange(300, 400)              # 100 is not a multiple of 256
    ops = g.load_to_device_per_layer(dev, h, d, 1, "kernel")
    assert [(o["routine"], o["args"]["layers"]) for o in ops] == [("dsv4_token", [0]), ("dsv4_token", [0])]
    assert ops[0]["args"]["src_indices"] == h.tolist()     # raw slot indices, read as C4 entries
    back = g.backup_from_device_all_layer(dev, h, d, "direct")   # whatever the io backend
    assert [o["routine"] for o in back] == ["dsv4_token"] * 3
    assert back[0]["args"]["layers"] == [0, 1] and back[2]["args"]["layers"] == [0]     # one C128 layer
    c4h, ixh = g.get_pool("deepseek_v4_c4"), g.get_pool("deepseek_v4_c4_indexer")
    mem = run_ops(g.device_buffers() + g.buffers(), ops, {c4h.kv_buffer: (np.arange(16), 3),
                                                         ixh.kv_buffer: (np.arange(16), 3)})
    # the C4 latent: each entry's value and scale land where the C4 layout says
    assert_tokens_equal(mem, "d_c4_kv_buffer", dev.c4_kv_pool.kv_layout, d, c4h.kv_buffer, c4h.kv_layout, h, [0])
    # the C4 indexer (8,448 B pages): the C4 constants move the wrong bytes
    with pytest.raises(AssertionError):
        assert_tokens_equal(mem, "d_c4_indexer_index_k_with_scale_buffer", dev.c4_indexer_kv_pool.index_k_layout,
                            d, ixh.kv_buffer, ixh.kv_layout, h, [0])


def test_v4_token_granular_needs_layer_first():
    _, g = v4("page_first")
    dev = g.anchor_entry.device_pool
    with pytest.raises(UnsupportedTransfer) as ei:
        g.load_to_device_per_layer(dev, np.arange(100), np.arange(100), 1, "kernel")
    assert "data_ptrs is None" in str(ei.value)
    assert g.load_to_device_per_layer(dev, [], [], 1, "kernel") == []


def test_v4_unsupported_pairs_and_bf16_fork():
    dev, g = v4("page_first_direct")
    with pytest.raises(UnsupportedTransfer):
        g.load_to_device_per_layer(dev, np.arange(256), np.arange(256, 512), 1, "kernel")
    dev, g = v4("layer_first", bf16_index_k=True)
    ixh = g.get_pool("deepseek_v4_c4_indexer")
    assert ixh.item_bytes == 64 * 256 and dev.c4_indexer_kv_pool.index_k_layout.entries_per_page == 64


def test_direct_page_first_routine_by_hand():
    """transfer_kv_page_first_direct_impl: one memcpy per page per layer; the
    host page is (first index of the group) // page_size, the device rows start
    at the group's first index."""
    dev = token_rows(16, layers=2, size=12, page_size=2)         # 14 rows, layer_bytes 224
    host = HostLayout("h", "page_first_direct", layers=2, units=8, unit_bytes=16, page_size=2)   # page 64 B
    p = plan("direct_page_first", host, dev,
             {"layer": 1, "src_indices": [5, 0, 2, 3], "dst_indices": [8, 9, 4, 7], "page_size": 2}, "op")
    # page 0: host index 5 -> host page 2 (rows 4, 5), device rows 8, 9; page 1: host page 1 -> device 4, 5
    assert p.extents.rows() == [(0, 2 * 64 + 32, 224 + 8 * 16, 32), (1, 64 + 32, 224 + 4 * 16, 32)]
    assert p.launch.kind == "memcpy_runs" and p.extents.n_items == 2
    # the coalescing direct routine honours every index instead
    q = plan("direct_per_layer", host, dev,
             {"layer": 1, "src_indices": [5, 0, 2, 3], "dst_indices": [8, 9, 4, 7], "page_size": 2}, "op")
    assert q.extents.n_items == 4 and q.extents.rows()[0] == (0, 2 * 64 + 32 + 16, 224 + 8 * 16, 16)
    with pytest.raises(InputError) as ei:
        plan("direct_page_first", host, dev, {"layer": 0, "src_indices": [1], "dst_indices": [1],
                                              "page_size": 2}, "op")
    assert ei.value.where == "op.args.src_indices"
    with pytest.raises(InputError) as ei:
        plan("direct_page_first", host, dev, {"layer": 0, "src_indices": [0, 1], "dst_indices": [-2, 1],
                                              "page_size": 2}, "op")
    assert ei.value.where == "op.args.dst_indices[0]"


def test_empty_transfers():
    dev = DSATokenToKVPool(128, 64, 1)
    g = HostPoolGroup.for_dsa(dev, 2.0, 0, "page_first")
    kv, ix = g.get_pool("kv"), g.get_pool("indexer")
    ops = kv.load_to_device_per_layer(dev, [], [], 0, "kernel") + ix.load_to_device_per_layer(dev, [], [], 0, "kernel")
    assert [(o["routine"], o["args"]["src_indices"]) for o in ops] == [("kernel_per_layer", []),
                                                                       ("dsa_indexer_per_layer", [])]
    assert g.backup_from_device_all_layer(dev, [], [], "kernel") == []          # no staged chunk runs
    run_ops(dev.buffers() + g.buffers(), ops, {})
    with pytest.raises(InputError) as ei:
        kv.load_to_device_per_layer(dev, [1, 2], [3], 0, "kernel")
    assert ei.value.where == "device_indices"


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_host_slots_are_never_handed_out_twice(data):
    """Random alloc/free on the MLA host pool and a V4 paged host pool (which
    rounds requests up): every slot is owned at most once and available_size is
    exact."""
    if data.draw(st.booleans()):
        pool = MLATokenToKVPoolHost(mla(size=8, page_size=4), 2.0, 0, 4, "layer_first")
        unit = 4
    else:
        _, g = v4(size=512)
        pool = g.get_pool("deepseek_v4_c4")
        unit = 1
    owned: list[np.ndarray] = []
    for _ in range(data.draw(st.integers(1, 20))):
        if owned and data.draw(st.booleans()):
            assert pool.free(owned.pop(data.draw(st.integers(0, len(owned) - 1)))) > 0
        else:
            n = data.draw(st.integers(1, 3)) * (unit if unit > 1 else data.draw(st.integers(1, 300)))
            got = pool.alloc(n)
            held = sum(len(o) for o in owned)
            if got is None:
                assert -(-n // pool.page_size) * pool.page_size > pool.size - held
                continue
            assert len(got) % pool.page_size == 0 and len(got) >= n
            taken = set(np.concatenate(owned).tolist()) if owned else set()
            assert not taken & set(got.tolist())
            owned.append(got)
        assert pool.available_size() == pool.size - sum(len(o) for o in owned)
