"""Device pools: geometry from SGLang 0.5.14's memory_pool.py (row and page
counts, padding), built from the layouts presets, and buffer declarations that
a schedule header accepts."""
import pytest

from sim.errors import InputError
from sim.pools.device import DeepSeekV4TokenToKVPool, DSATokenToKVPool, MLATokenToKVPool
from sim.pools.layouts import (
    bf16_index_k, c4_indexer, c4_paged, c128_paged, dsa_index_k, layout_from_json, token_rows,
)
from sim.schedule import ScheduleBuilder


def header(buffers):
    return {"kvrace_schedule": 2, "name": "t", "buffers": buffers, "streams": ["s"], "events": []}


def test_mla_rows_are_size_plus_page_size():
    p = MLATokenToKVPool(1000, 64, 3)                 # bf16 512 + 64
    assert p.kv_cache_dim == 576 and p.token_stride_size == 1152
    assert p.kv_layout == token_rows(1152, 3, 1000, 64)
    assert p.kv_layout.pages == 1064 and p.kv_layout.layers == 3
    assert (p.size, p.page_size, p.layer_num, p.start_layer, p.end_layer) == (1000, 64, 3, 0, 2)
    fp8 = MLATokenToKVPool(10, 1, 2, itemsize=1, start_layer=5)
    assert fp8.kv_layout.pages == 11 and fp8.kv_layout.page_bytes == 576 and fp8.end_layer == 6


def test_dsa_latent_and_index_k_pages():
    p = DSATokenToKVPool(1000, 64, 2)
    assert p.token_stride_size == 656 and p.kv_layout.pages == 1064
    # (index_buf_size + page_size + 1) // page_size pages of 64 x (128 + 4) B
    assert p.index_page_num == (1000 + 64 + 1) // 64 == 16
    assert p.index_k_layout == dsa_index_k(2, 16) and p.index_page_bytes == 8448
    q = DSATokenToKVPool(1000, 64, 2, index_buf_size=127)
    assert q.index_page_num == (127 + 65) // 64 == 3


def test_dsa_bf16_index_k_variant():
    p = DSATokenToKVPool(128, 64, 2, bf16_index_k=True, prefix="x_")
    assert p.index_k_layout == bf16_index_k(2, 192)
    assert [b["name"] for b in p.buffers()] == ["x_kv_buffer", "x_index_k_buffer"]


def test_dsa_page_size_is_64():
    with pytest.raises(InputError) as ei:
        DSATokenToKVPool(128, 32, 2)
    assert ei.value.where == "page_size"
    with pytest.raises(InputError) as ei:
        DSATokenToKVPool(128, 64, 2, index_head_dim=64)
    assert ei.value.where == "index_head_dim"


def test_buffers_are_valid_header_entries_with_prefix_and_kind():
    p = DSATokenToKVPool(256, 64, 4, prefix="rank3_", device=3)
    bufs = p.buffers()
    assert [(b["name"], b["kind"], b["location"], b["device"]) for b in bufs] == [
        ("rank3_kv_buffer", "kv", "device", 3), ("rank3_index_k_with_scale_buffer", "index_k", "device", 3)]
    for b in bufs:
        assert layout_from_json(b["layout"], "b") == p.layouts[b["name"]]
    built = ScheduleBuilder(header(bufs + MLATokenToKVPool(8, 1, 1, prefix="rank4_").buffers()))
    assert set(built.buffers) == {"rank3_kv_buffer", "rank3_index_k_with_scale_buffer", "rank4_kv_buffer"}
    assert built.buffers["rank3_index_k_with_scale_buffer"].nbytes == 4 * 5 * 8448


def test_bad_geometry_names_the_key():
    with pytest.raises(InputError) as ei:
        MLATokenToKVPool(0, 1, 1)
    assert ei.value.where == "size"
    with pytest.raises(InputError) as ei:
        MLATokenToKVPool(8, 1, 1, prefix=3)
    assert ei.value.where == "prefix"


def test_v4_pools_page_counts_and_layer_mapping():
    p = DeepSeekV4TokenToKVPool(4096, 256, [0, 0, 4, 128, 4, 128, 4], prefix="v_")
    assert p.layer_mapping == [(0, 0), (0, 1), (4, 0), (128, 0), (4, 1), (128, 1), (4, 2)]
    assert p.layers_of(4) == {2: 0, 4: 1, 6: 2} and p.layers_of(128) == {3: 0, 5: 1}
    c4, c128, ix = p.c4_kv_pool, p.c128_kv_pool, p.c4_indexer_kv_pool
    # (size + page_size + 1) // page_size page rows, size in compressed entries
    assert (c4.size, c4.page_size, c4.num_pages) == (1024, 64, (1024 + 65) // 64)
    assert c4.kv_layout == c4_paged(3, 17) and c4.bytes_per_page_padded == 37440
    assert (c128.size, c128.page_size, c128.num_pages, c128.bytes_per_page_padded) == (32, 2, 17, 1728)
    assert c128.kv_layout == c128_paged(2, 17)
    assert (ix.size, ix.num_pages) == (32 * 32, 17) and ix.index_k_layout == c4_indexer(3, 17)
    assert [(b["name"], b["kind"]) for b in p.buffers()] == [
        ("v_c4_kv_buffer", "c4"), ("v_c4_indexer_index_k_with_scale_buffer", "c4_indexer"),
        ("v_c128_kv_buffer", "c128")]
    ScheduleBuilder(header(p.buffers()))


def test_v4_bf16_fork_indexer_and_errors():
    p = DeepSeekV4TokenToKVPool(2048, 256, [4, 4], bf16_index_k=True)
    lay = p.c4_indexer_kv_pool.index_k_layout
    assert (lay.page_bytes, lay.entries_per_page, lay.pages) == (64 * 256, 64, 9)
    assert lay.token_extents(0, [65])[0].tolist() == [[lay.layer_bytes * 0 + 16384 + 256]]
    assert p.c128_kv_pool is None and [b["kind"] for b in p.buffers()] == ["c4", "index_k_bf16"]
    with pytest.raises(InputError) as ei:
        DeepSeekV4TokenToKVPool(2048, 128, [4])
    assert ei.value.where == "page_size"
    with pytest.raises(InputError) as ei:
        DeepSeekV4TokenToKVPool(2048, 256, [0, 8])
    assert ei.value.where == "compression_ratios"
    with pytest.raises(InputError):
        DeepSeekV4TokenToKVPool(2048, 256, [0, 128])
