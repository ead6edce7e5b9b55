"""Layouts: preset sizes against the reference numbers, address maps by hand, JSON."""
import numpy as np
import pytest

from sim.errors import InputError
from sim.pools.layouts import (
    Field, HostLayout, PagedLayout, bf16_index_k, c4_indexer, c4_paged, c128_paged,
    dsa_index_k, host_mirror, layout_from_json, layout_to_json, token_rows,
)


# --- preset sizes: reference/dsa_geometry.md §1.6, §2.2; sglang_hicache.md §4.3, §5.1

def test_dsa_index_k_page():
    lay = dsa_index_k(layers=2, pages=3)
    assert lay.page_bytes == 8448
    assert lay.entries_per_page == 64
    assert lay.fields == (Field("key", 0, 128), Field("scale", 8192, 4))
    assert lay.entry_bytes == 132
    assert lay.layer_bytes == 3 * 8448
    assert lay.nbytes == 2 * 3 * 8448 == 50688


def test_c4_indexer_same_packing_as_dsa():
    lay = c4_indexer(layers=1, pages=1)
    assert lay.page_bytes == 8448
    assert lay.fields == (Field("key", 0, 128), Field("scale", 8192, 4))


def test_c4_paged_page():
    lay = c4_paged(layers=1, pages=2)
    assert lay.page_bytes == 37440
    assert lay.entries_per_page == 64
    assert lay.fields == (Field("value", 0, 576), Field("scale", 36864, 8))
    assert lay.entry_bytes == 584
    assert lay.nbytes == 74880


def test_c128_paged_page():
    lay = c128_paged(layers=1, pages=1)
    assert lay.page_bytes == 1728
    assert lay.entries_per_page == 2
    assert lay.fields == (Field("value", 0, 576), Field("scale", 1152, 8))


def test_bf16_index_k_rows():
    lay = bf16_index_k(layers=2, tokens=300)
    assert lay.page_bytes == 256 and lay.entries_per_page == 1
    assert lay.nbytes == 2 * 300 * 256 == 153600
    off, ln = lay.token_extents(1, [5])
    assert off.tolist() == [[76800 + 1280]] and ln.tolist() == [[256]]


@pytest.mark.parametrize("item_bytes", [576, 656, 1152])
def test_token_rows_slot0_padding(item_bytes):
    lay = token_rows(item_bytes, layers=2, size=10, page_size=64)
    assert lay.pages == 74  # size + page_size rows
    assert lay.page_bytes == item_bytes
    assert lay.nbytes == 2 * 74 * item_bytes
    assert lay.unit_offsets(1, [0, 1]).tolist() == [74 * item_bytes, 75 * item_bytes]


# --- device address maps

def test_dsa_token_extents_by_hand():
    lay = dsa_index_k(layers=2, pages=3)
    off, ln = lay.token_extents(1, [0, 65, 191])
    # layer 1 base 25,344; token 65 = page 1 entry 1; token 191 = page 2 entry 63
    assert off.tolist() == [[25344, 25344 + 8192],
                            [33792 + 128, 33792 + 8192 + 4],
                            [42240 + 63 * 128, 42240 + 8192 + 63 * 4]]
    assert ln.tolist() == [[128, 4]] * 3


def test_c4_token_extents_by_hand():
    lay = c4_paged(layers=2, pages=2)
    off, ln = lay.token_extents(0, [70])  # page 1 entry 6
    assert off.tolist() == [[37440 + 6 * 576, 37440 + 36864 + 6 * 8]]
    assert ln.tolist() == [[576, 8]]


def test_unit_offsets_not_clipped():
    lay = bf16_index_k(layers=1, tokens=4)
    assert lay.unit_offsets(0, [4, 10, -1]).tolist() == [1024, 2560, -256]


def test_describe_paged():
    lay = c4_paged(layers=2, pages=2)
    d = lay.describe(37440 + 36864 + 6 * 8 + 3)
    assert (d["layer"], d["page"], d["field"], d["entry"], d["token"], d["byte"]) == (0, 1, "scale", 6, 70, 3)
    d = lay.describe(2 * 37440 + 577)
    assert (d["layer"], d["page"], d["field"], d["token"], d["byte"]) == (1, 0, "value", 1, 1)
    assert lay.describe(37376)["field"] == "padding"  # 64 x 584 = 37,376 .. 37,440 is pad
    assert lay.describe(37439)["field"] == "padding"
    d = lay.describe(4 * 37440 + 10)
    assert d["field"] == "beyond end" and d["bytes_past_end"] == 10
    assert lay.describe(-3)["field"] == "before start"


# --- host layouts: 3 layers, 8 units of 16 B, page_size 4

@pytest.mark.parametrize("layout,expected", [
    ("layer_first", [1 * 8 * 16 + 0, 1 * 8 * 16 + 5 * 16]),          # 128, 208
    ("page_first", [0 * 48 + 16, 5 * 3 * 16 + 1 * 16]),              # 16, 256
    ("page_first_direct", [0 + 1 * 64 + 0, 1 * 192 + 1 * 64 + 16]),  # 64, 272
])
def test_host_addresses_by_hand(layout, expected):
    h = HostLayout("h", layout, layers=3, units=8, unit_bytes=16, page_size=4)
    assert h.nbytes == 384
    assert h.unit_offsets(1, [0, 5]).tolist() == expected
    d = h.describe(expected[1] + 3)
    assert (d["layer"], d["unit"], d["byte_in_unit"]) == (1, 5, 3)


def test_host_page_first_direct_all_units_distinct():
    h = HostLayout("h", "page_first_direct", layers=3, units=8, unit_bytes=16, page_size=4)
    offs = np.concatenate([h.unit_offsets(L, np.arange(8)) for L in range(3)])
    assert sorted(offs.tolist()) == list(range(0, 384, 16))


def test_host_mirror_token_extents():
    h = host_mirror(dsa_index_k(layers=2, pages=4), "page_first", units=4)
    # page 1 of layer 1 in page_first: 1*2*8448 + 1*8448 = 25,344; token 65 = entry 1
    off, _ = h.token_extents(1, [65])
    assert off.tolist() == [[25344 + 128, 25344 + 8192 + 4]]


# --- JSON

@pytest.mark.parametrize("lay", [
    dsa_index_k(2, 3), bf16_index_k(1, 5), c4_paged(2, 2), c128_paged(1, 4), c4_indexer(1, 1),
    token_rows(656, 3, 10, 64),
    HostLayout("h", "page_first_direct", 3, 8, 16, 4),
    host_mirror(c4_paged(2, 2), "layer_first"),
])
def test_json_round_trip(lay):
    assert layout_from_json(layout_to_json(lay), "x") == lay


def test_json_preset():
    assert layout_from_json({"preset": "c4_paged", "layers": 2, "pages": 3}, "s") == c4_paged(2, 3)
    assert layout_from_json({"preset": "token_rows", "item_bytes": 576, "layers": 1, "size": 8},
                            "s") == token_rows(576, 1, 8, 1)


def _err(d, where="buffers[0].layout"):
    with pytest.raises(InputError) as ei:
        layout_from_json(d, where)
    return ei.value


def test_json_errors_name_the_key():
    paged = {"kind": "paged", "layers": 1, "pages": 2, "page_bytes": 64}
    e = _err({"preset": "c5_paged", "layers": 1, "pages": 1})
    assert e.where == "buffers[0].layout.preset" and "c4_paged" in e.message and "dsa_index_k" in e.message
    e = _err({"preset": "c4_paged", "layers": 1})
    assert e.where == "buffers[0].layout.pages"
    e = _err({"preset": "c4_paged", "layers": 1, "pages": 1, "page_bytes": 4})
    assert e.where == "buffers[0].layout.page_bytes" and "unknown key" in e.message
    e = _err({**paged, "layers": 0})
    assert e.where == "buffers[0].layout.layers" and "got 0" in e.message
    e = _err({**paged, "pages": "2"})
    assert e.where == "buffers[0].layout.pages" and "'2'" in e.message
    e = _err({**paged, "pages": True})
    assert e.where == "buffers[0].layout.pages"
    e = _err({**paged, "entries_per_page": 3})
    assert e.where == "buffers[0].layout.entries_per_page" and "64" in e.message
    e = _err({**paged, "entries_per_page": 2, "fields": [
        {"name": "a", "offset": 0, "entry_bytes": 8}, {"name": "b", "offset": 8, "entry_bytes": 8}]})
    assert e.where == "buffers[0].layout.fields[1]" and "overlap" in e.message
    e = _err({**paged, "entries_per_page": 2, "fields": [
        {"name": "a", "offset": 0, "entry_bytes": 8}, {"name": "b", "offset": 60, "entry_bytes": 4}]})
    assert e.where == "buffers[0].layout.fields[1]" and "68" in e.message
    e = _err({**paged, "fields": [{"name": "a", "offset": 0}]})
    assert e.where == "buffers[0].layout.fields[0].entry_bytes"
    e = _err({**paged, "fields": [{"name": "a", "offset": -1, "entry_bytes": 4}]})
    assert e.where == "buffers[0].layout.fields[0].offset"
    e = _err({"kind": "host", "layout": "page_first_direct", "layers": 2, "units": 10,
              "unit_bytes": 8, "page_size": 4})
    assert e.where == "buffers[0].layout.units" and "multiple of page_size=4" in e.message
    e = _err({"kind": "host", "layout": "page_head", "layers": 2, "units": 10, "unit_bytes": 8})
    assert e.where == "buffers[0].layout.layout" and "layer_first" in e.message
    e = _err({"kind": "disk"})
    assert e.where == "buffers[0].layout.kind"
    e = _err([1, 2])
    assert e.where == "buffers[0].layout"


def test_constructor_validates():
    with pytest.raises(InputError):
        PagedLayout("x", 1, 1, 100, entries_per_page=3)
    with pytest.raises(InputError):
        HostLayout("x", "page_first_direct", 1, 6, 8, page_size=4)


def test_layout_integers_and_names_are_bounded():
    from sim.errors import InputError as _E
    from sim.pools.layouts import layout_from_json as _from

    with pytest.raises(_E, match=r"lay.pages: expected an integer in 1..2\*\*62"):
        _from({"kind": "paged", "layers": 1, "pages": 2 ** 70, "page_bytes": 8}, "lay")
    with pytest.raises(_E) as e:
        _from({"kind": "paged", "name": "n" * 10_000, "layers": 1, "pages": 1, "page_bytes": 8}, "lay")
    assert "MAX_NAME_CHARS" in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(_E) as e:
        _from({"kind": "paged", "k" * 10_000: 1}, "lay")
    assert len(str(e.value)) < 600


@pytest.mark.parametrize("make", [
    lambda: dsa_index_k(5, 9), lambda: c4_paged(3, 4), lambda: token_rows(656, 4, 32),
    lambda: host_mirror(dsa_index_k(5, 9), "layer_first"), lambda: host_mirror(dsa_index_k(5, 9), "page_first"),
    lambda: host_mirror(token_rows(656, 4, 32, page_size=8), "page_first_direct")])
def test_unit_offsets_by_layer_is_each_layers_unit_offsets(make):
    lay = make()
    rng = np.random.default_rng(0)
    idx = rng.integers(0, lay.units, 7)
    layers = rng.permutation(lay.layers)[:3]
    got = lay.unit_offsets_by_layer(layers, idx)
    assert got.dtype == np.int64 and got.shape == (7, 3)
    for k, L in enumerate(layers.tolist()):
        assert got[:, k].tolist() == np.asarray(lay.unit_offsets(L, idx)).tolist()
