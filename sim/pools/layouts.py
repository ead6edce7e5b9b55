"""Buffer geometries as data: where a (layer, unit, token, field) lives in a buffer.

Two kinds of layout, both frozen dataclasses with vectorised (numpy int64)
address functions:

* :class:`PagedLayout`: a DEVICE buffer, layer-major.  Layer ``L`` occupies
  ``[L * pages * page_bytes, (L + 1) * pages * page_bytes)``; the unit of
  addressing is one page row (a token row when ``entries_per_page == 1``).
  Inside a page, ``fields`` say where each entry's bytes are: entry ``e`` of
  field ``f`` is at ``f.offset + e * f.entry_bytes``.  This captures the
  "values first, then scales, then padding" pages of the DSA index-K and the
  DeepSeek V4 C4/C128 pools (``reference/dsa_geometry.md`` §1.6, §2.2).
* :class:`HostLayout`: a pinned HOST pool in one of SGLang's three layouts
  (``reference/sglang_hicache.md`` §3.2): ``layer_first``, ``page_first`` and
  ``page_first_direct``.  Its unit is one index of the host pool: a token for
  MLA/MHA-like pools, a page for the DSA indexer host pool.  Optionally the
  unit has the same inner structure as a device page (``entries_per_unit``,
  ``fields``), so a host mirror of a paged device pool can be addressed per
  token as well.

Address functions never clip: an index past the end gives an address past the
end, and the caller (``sim.transfers.routines.check_bounds``) reports it.

Presets build the geometries named in the references; their sizes are derived
by formula here (e.g. 64 x 584 rounded up to a multiple of 576) and checked
against the literal reference numbers in ``tests/test_layouts.py``.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field as dc_field
from typing import Any, Callable, Mapping, Union

import numpy as np

from sim.errors import MAX_NAME_CHARS, InputError, check_keys, show

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


# ----------------------------------------------------------------------------
# small validation helpers (shared with layout_from_json)

def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


MAX_LAYOUT_INT = 1 << 62     # every integer of a layout (sizes multiply into int64 offsets)


def _req_int(v: Any, where: str, *, minimum: int = 1) -> int:
    if not _is_int(v):
        raise InputError(where, f"expected an integer >= {minimum}, got {show(v)}")
    if not minimum <= v <= MAX_LAYOUT_INT:
        raise InputError(where, f"expected an integer in {minimum}..2**62 (MAX_LAYOUT_INT), got {show(v)}")
    return int(v)


def _req_str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_CHARS:
        raise InputError(where, f"expected a name of 1..{MAX_NAME_CHARS} (MAX_NAME_CHARS) characters, "
                                f"got {show(v)}")
    return v


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ----------------------------------------------------------------------------
# fields

@dataclass(frozen=True)
class Field:
    """One field of a page: ``entries`` consecutive entries of ``entry_bytes``
    starting at ``offset`` bytes into the page (or host unit)."""

    name: str
    offset: int
    entry_bytes: int


def _check_fields(fields: tuple[Field, ...], entries: int, page_bytes: int,
                  where: str, entries_key: str, page_key: str) -> None:
    """Fields must fit in the page and not overlap; without fields the page
    must split evenly into entries."""
    if not fields:
        if page_bytes % entries != 0:
            raise InputError(
                where + "." + entries_key,
                f"expected a divisor of {page_key}={page_bytes} when no fields are "
                f"given (one 'row' field of {page_key}/{entries_key} bytes), got {entries}")
        return
    names = set()
    spans = []
    for i, f in enumerate(fields):
        w = f"{where}.fields[{i}]"
        if not isinstance(f, Field):
            raise InputError(w, f"expected a Field, got {show(f)}")
        _req_str(f.name, w + ".name")
        if f.name in names:
            raise InputError(w + ".name", f"expected a unique field name, got duplicate {show(f.name)}")
        names.add(f.name)
        _req_int(f.offset, w + ".offset", minimum=0)
        _req_int(f.entry_bytes, w + ".entry_bytes", minimum=1)
        end = f.offset + entries * f.entry_bytes
        if end > page_bytes:
            raise InputError(
                w, f"expected field {show(f.name)} to end within {page_key}={page_bytes}, got "
                   f"offset {f.offset} + {entries} entries x {f.entry_bytes} B = {end}")
        spans.append((f.offset, end, i, f.name))
    spans.sort()
    for (s0, e0, i0, n0), (s1, e1, i1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise InputError(
                f"{where}.fields[{i1}]",
                f"expected fields not to overlap, got {show(n1)} [{s1}, {e1}) overlapping "
                f"{show(n0)} [{s0}, {e0})")


def _fields_tuple(fields: Any) -> tuple[Field, ...]:
    return tuple(fields) if fields is not None else ()


class _EntryGeometry:
    """Shared per-entry logic: a unit (page row) holds ``entries_per_unit``
    entries, each entry has one extent per field."""

    # provided by subclasses
    name: str
    layers: int
    fields: tuple[Field, ...]

    def unit_offsets_by_layer(self, layers, idx) -> np.ndarray:
        """``unit_offsets(layer, idx)`` for every layer of ``layers`` at once: shape
        ``(len(idx), len(layers))``, column ``k`` that of ``layers[k]`` (every layout is affine
        in the layer, so ``unit_offsets`` broadcasts a row of layers against a column of units)."""
        return np.asarray(self.unit_offsets(np.asarray(layers, np.int64).reshape(1, -1),
                                            np.asarray(idx, np.int64).reshape(-1, 1)), np.int64)

    @property
    def effective_fields(self) -> tuple[Field, ...]:
        """``fields``, or one field ``row`` of unit_bytes / entries when empty."""
        if self.fields:
            return self.fields
        return (Field("row", 0, self.unit_bytes // self.entries_per_unit),)

    @property
    def entry_bytes(self) -> int:
        """Bytes one entry (token) owns over all its fields (no padding)."""
        return sum(f.entry_bytes for f in self.effective_fields)

    @property
    def tokens(self) -> int:
        """Number of entry (token) slots per layer."""
        return self.units * self.entries_per_unit

    def token_extents(self, layer, tokens) -> tuple[np.ndarray, np.ndarray]:
        """Byte extents of tokens in ``layer``.

        Token ``t`` lives in unit ``t // entries_per_unit``, entry
        ``t % entries_per_unit``, and has one extent per field, in field order.
        Returns ``(offsets, lengths)``, both int64 of shape
        ``(len(tokens), n_fields)``; ``.ravel()`` gives token-major order.
        No bounds clipping.
        """
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        epu = self.entries_per_unit
        unit, entry = np.divmod(t, epu)
        base = self.unit_offsets(layer, unit)
        fs = self.effective_fields
        f_off = np.array([f.offset for f in fs], dtype=np.int64)
        f_len = np.array([f.entry_bytes for f in fs], dtype=np.int64)
        offsets = base[:, None] + f_off[None, :] + entry[:, None] * f_len[None, :]
        lengths = np.broadcast_to(f_len, offsets.shape).copy()
        return offsets, lengths

    def _describe_in_unit(self, d: dict, unit: int, byte_in_unit: int) -> dict:
        epu = self.entries_per_unit
        d["byte_in_unit"] = byte_in_unit
        for f in self.effective_fields:
            rel = byte_in_unit - f.offset
            if 0 <= rel < epu * f.entry_bytes:
                e, b = divmod(rel, f.entry_bytes)
                d.update(field=f.name, entry=e, token=unit * epu + e, byte=b)
                return d
        d["field"] = "padding"
        return d


def _describe_outside(layout, offset: int) -> dict | None:
    if offset < 0:
        return {"layout": layout.name, "offset": offset, "field": "before start",
                "bytes_before_start": -offset}
    if offset >= layout.nbytes:
        return {"layout": layout.name, "offset": offset, "field": "beyond end",
                "bytes_past_end": offset - layout.nbytes}
    return None


# ----------------------------------------------------------------------------
# device: paged, layer-major

@dataclass(frozen=True)
class PagedLayout(_EntryGeometry):
    """A device buffer of ``layers`` x ``pages`` page rows of ``page_bytes``."""

    name: str
    layers: int
    pages: int
    page_bytes: int
    entries_per_page: int = 1
    fields: tuple[Field, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "fields", _fields_tuple(self.fields))
        _check_paged(self, f"PagedLayout({self.name!r})")
        for k in ("layers", "pages", "page_bytes", "entries_per_page"):
            object.__setattr__(self, k, int(getattr(self, k)))

    kind = "paged"

    @property
    def entries_per_unit(self) -> int:
        return self.entries_per_page

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def nbytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def unit_bytes(self) -> int:
        return self.page_bytes

    @property
    def units(self) -> int:
        return self.pages

    def layer_base(self, layer: int) -> int:
        """Byte offset of a layer's first page (the per-layer tensor pointer)."""
        return int(layer) * self.layer_bytes

    def unit_offsets(self, layer, idx) -> np.ndarray:
        """Offsets of page rows ``idx`` of ``layer`` (int64, never clipped)."""
        idx = np.asarray(idx, dtype=np.int64)
        return np.int64(layer) * np.int64(self.layer_bytes) + idx * np.int64(self.page_bytes)

    @property
    def layer_stride(self) -> int:
        """``unit_offsets(L, idx) == unit_offsets(0, idx) + L * layer_stride`` for every layer and
        unit (layer-major: a layer's bytes)."""
        return self.layer_bytes

    def describe(self, offset: int) -> dict:
        """What lives at byte ``offset``: layer, page, entry/token, field, byte."""
        offset = int(offset)
        out = _describe_outside(self, offset)
        if out is not None:
            return out
        layer, rem = divmod(offset, self.layer_bytes)
        page, b = divmod(rem, self.page_bytes)
        d = {"layout": self.name, "offset": offset, "layer": layer, "page": page, "unit": page}
        return self._describe_in_unit(d, page, b)


def _check_paged(lay: PagedLayout, where: str) -> None:
    _req_str(lay.name, where + ".name")
    _req_int(lay.layers, where + ".layers")
    _req_int(lay.pages, where + ".pages")
    _req_int(lay.page_bytes, where + ".page_bytes")
    _req_int(lay.entries_per_page, where + ".entries_per_page")
    _check_fields(lay.fields, lay.entries_per_page, lay.page_bytes, where,
                  "entries_per_page", "page_bytes")


# ----------------------------------------------------------------------------
# host pool layouts

@dataclass(frozen=True)
class HostLayout(_EntryGeometry):
    """A host pool of ``layers`` x ``units`` units of ``unit_bytes``.

    ``layout`` (sglang_hicache.md §3.2):

    * ``layer_first``: ``addr = layer*units*unit_bytes + idx*unit_bytes``
    * ``page_first``: ``addr = idx*layers*unit_bytes + layer*unit_bytes``
    * ``page_first_direct``: ``page = idx // page_size``, ``e = idx % page_size``,
      ``addr = page*(layers*page_size*unit_bytes) + layer*(page_size*unit_bytes)
      + e*unit_bytes`` (``units`` must be a multiple of ``page_size``).

    ``entries_per_unit`` / ``fields`` (extension, default: one ``row`` field per
    unit) describe a unit's inner structure for per-token addressing.
    """

    name: str
    layout: str
    layers: int
    units: int
    unit_bytes: int
    page_size: int = 1
    entries_per_unit: int = 1
    fields: tuple[Field, ...] = ()

    kind = "host"

    def __post_init__(self):
        object.__setattr__(self, "fields", _fields_tuple(self.fields))
        _check_host(self, f"HostLayout({self.name!r})")
        for k in ("layers", "units", "unit_bytes", "page_size", "entries_per_unit"):
            object.__setattr__(self, k, int(getattr(self, k)))

    @property
    def nbytes(self) -> int:
        return self.layers * self.units * self.unit_bytes

    def layer_base(self, layer: int) -> int:
        """Byte offset of unit 0 of ``layer``."""
        return int(self.unit_offsets(layer, [0])[0])

    def unit_offsets(self, layer, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        L = np.int64(layer)
        ub, nl = np.int64(self.unit_bytes), np.int64(self.layers)
        if self.layout == "layer_first":
            return L * np.int64(self.units) * ub + idx * ub
        if self.layout == "page_first":
            return idx * nl * ub + L * ub
        ps = np.int64(self.page_size)
        page, e = np.divmod(idx, ps)
        return page * (nl * ps * ub) + L * (ps * ub) + e * ub

    @property
    def layer_stride(self) -> int:
        """``unit_offsets(L, idx) == unit_offsets(0, idx) + L * layer_stride`` for every layer and
        unit, in each layout: a layer's units (``layer_first``), one unit (``page_first``: a
        unit's layers side by side), a page's units (``page_first_direct``)."""
        if self.layout == "layer_first":
            return self.units * self.unit_bytes
        if self.layout == "page_first":
            return self.unit_bytes
        return self.page_size * self.unit_bytes

    def describe(self, offset: int) -> dict:
        offset = int(offset)
        out = _describe_outside(self, offset)
        if out is not None:
            return out
        ub = self.unit_bytes
        d: dict = {"layout": self.name, "offset": offset}
        if self.layout == "layer_first":
            layer, rem = divmod(offset, self.units * ub)
            unit, b = divmod(rem, ub)
        elif self.layout == "page_first":
            unit, rem = divmod(offset, self.layers * ub)
            layer, b = divmod(rem, ub)
        else:
            ps = self.page_size
            page, rem = divmod(offset, self.layers * ps * ub)
            layer, rem = divmod(rem, ps * ub)
            e, b = divmod(rem, ub)
            unit = page * ps + e
            d.update(host_page=page, entry_in_host_page=e)
        d.update(layer=layer, unit=unit)
        return self._describe_in_unit(d, unit, b)


def _check_host(lay: HostLayout, where: str) -> None:
    _req_str(lay.name, where + ".name")
    if lay.layout not in HOST_LAYOUTS:
        raise InputError(where + ".layout", f"expected one of {list(HOST_LAYOUTS)}, got {show(lay.layout)}")
    _req_int(lay.layers, where + ".layers")
    _req_int(lay.units, where + ".units")
    _req_int(lay.unit_bytes, where + ".unit_bytes")
    _req_int(lay.page_size, where + ".page_size")
    _req_int(lay.entries_per_unit, where + ".entries_per_unit")
    if lay.layout == "page_first_direct" and lay.units % lay.page_size != 0:
        raise InputError(
            where + ".units",
            f"expected a multiple of page_size={lay.page_size} for page_first_direct, got {lay.units}")
    _check_fields(lay.fields, lay.entries_per_unit, lay.unit_bytes, where,
                  "entries_per_unit", "unit_bytes")


Layout = Union[PagedLayout, HostLayout]


# ----------------------------------------------------------------------------
# presets (reference numbers derived by formula)

#: DSA / V4 indexer: 128 fp8 key bytes + one fp32 scale per 128-element block.
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4
DSA_PAGE_SIZE = 64
#: DeepSeek V4 C4/C128 latent: 448 fp8 nope + 64 bf16 rope = 576 B "value",
#: 7 ue8m0 scales + 1 pad = 8 B "scale"; pages padded to a multiple of 576 B.
V4_VALUE_BYTES = 448 + 64 * 2
V4_SCALE_BYTES = 7 + 1
V4_PAGE_ALIGN = 576


def _indexer_page(name: str, layers: int, pages: int, entries: int = DSA_PAGE_SIZE) -> PagedLayout:
    key_bytes = INDEX_HEAD_DIM  # fp8: one byte per dim
    return PagedLayout(
        name, layers, pages,
        page_bytes=entries * (key_bytes + INDEX_SCALE_BYTES),
        entries_per_page=entries,
        fields=(Field("key", 0, key_bytes), Field("scale", entries * key_bytes, INDEX_SCALE_BYTES)))


def dsa_index_k(layers: int, pages: int) -> PagedLayout:
    """DSA (V3.2) index-K device page: 64 x 128 B keys then 64 x 4 B fp32 scales."""
    return _indexer_page("dsa_index_k", layers, pages)


def c4_indexer(layers: int, pages: int) -> PagedLayout:
    """DeepSeek V4 C4 indexer page: same packing as the DSA index-K page."""
    return _indexer_page("c4_indexer", layers, pages)


def bf16_index_k(layers: int, tokens: int) -> PagedLayout:
    """bf16 index cache: 128 x 2 B per token, contiguous, no scale."""
    return PagedLayout("bf16_index_k", layers, tokens, page_bytes=INDEX_HEAD_DIM * 2,
                       entries_per_page=1, fields=(Field("key", 0, INDEX_HEAD_DIM * 2),))


def _v4_paged(name: str, layers: int, pages: int, entries: int) -> PagedLayout:
    item = V4_VALUE_BYTES + V4_SCALE_BYTES
    return PagedLayout(
        name, layers, pages,
        page_bytes=_round_up(entries * item, V4_PAGE_ALIGN),
        entries_per_page=entries,
        fields=(Field("value", 0, V4_VALUE_BYTES),
                Field("scale", entries * V4_VALUE_BYTES, V4_SCALE_BYTES)))


def c4_paged(layers: int, pages: int) -> PagedLayout:
    """DeepSeek V4 C4 latent page: 64 values (576 B), then 64 scales (8 B), padded."""
    return _v4_paged("c4_paged", layers, pages, 64)


def c128_paged(layers: int, pages: int) -> PagedLayout:
    """DeepSeek V4 C128 latent page: 2 values, then 2 scales, padded to 576 B."""
    return _v4_paged("c128_paged", layers, pages, 2)


def swa_paged(layers: int, pages: int) -> PagedLayout:
    """DeepSeek V4 sliding-window page (``swa_kv_pool``, paged SWA: ``swa_page_size``
    256): 256 uncompressed tokens' values (576 B), then their scales (8 B), padded to a
    multiple of 576 B (149,760 B)."""
    return _v4_paged("swa_paged", layers, pages, 256)


def token_rows(item_bytes: int, layers: int, size: int, page_size: int = 1) -> PagedLayout:
    """Per-token rows (MLA/DSA latent): ``size + page_size`` rows, slot 0 padding."""
    for k, v in (("item_bytes", item_bytes), ("layers", layers), ("size", size),
                 ("page_size", page_size)):
        _req_int(v, f"token_rows.{k}")
    return PagedLayout(f"token_rows_{item_bytes}", layers, size + page_size,
                       page_bytes=item_bytes, entries_per_page=1)


def host_mirror(device: PagedLayout, layout: str = "layer_first", units: int | None = None,
                page_size: int = 1, name: str | None = None) -> HostLayout:
    """A host pool whose unit is one device page row, with the same inner fields."""
    return HostLayout(
        name or f"host_{device.name}", layout, device.layers,
        device.pages if units is None else units, device.page_bytes, page_size,
        device.entries_per_page, device.fields)


PRESETS: dict[str, Callable[..., PagedLayout]] = {
    "dsa_index_k": dsa_index_k,
    "bf16_index_k": bf16_index_k,
    "c4_paged": c4_paged,
    "c128_paged": c128_paged,
    "swa_paged": swa_paged,
    "c4_indexer": c4_indexer,
    "token_rows": token_rows,
}
_PRESET_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (required kwargs, optional kwargs)
    "dsa_index_k": (("layers", "pages"), ()),
    "bf16_index_k": (("layers", "tokens"), ()),
    "c4_paged": (("layers", "pages"), ()),
    "c128_paged": (("layers", "pages"), ()),
    "swa_paged": (("layers", "pages"), ()),
    "c4_indexer": (("layers", "pages"), ()),
    "token_rows": (("item_bytes", "layers", "size"), ("page_size",)),
}


# ----------------------------------------------------------------------------
# JSON

_PAGED_KEYS = ("kind", "name", "layers", "pages", "page_bytes", "entries_per_page", "fields")
_PAGED_REQUIRED = ("kind", "layers", "pages", "page_bytes")
_HOST_KEYS = ("kind", "name", "layout", "layers", "units", "unit_bytes", "page_size",
              "entries_per_unit", "fields")
_HOST_REQUIRED = ("kind", "layout", "layers", "units", "unit_bytes")


def _fields_from_json(v: Any, where: str) -> tuple[Field, ...]:
    if not isinstance(v, (list, tuple)):
        raise InputError(where, f"expected a list of {{name, offset, entry_bytes}}, got {show(v)}")
    out = []
    for i, f in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(f, Mapping):
            raise InputError(w, f"expected an object {{name, offset, entry_bytes}}, got {show(f)}")
        check_keys(f, ("name", "offset", "entry_bytes"), w, ("name", "offset", "entry_bytes"))
        out.append(Field(_req_str(f["name"], w + ".name"),
                         _req_int(f["offset"], w + ".offset", minimum=0),
                         _req_int(f["entry_bytes"], w + ".entry_bytes")))
    return tuple(out)


def layout_from_json(d: Any, where: str) -> Layout:
    """Build a layout from ``{"preset": NAME, ...}``, ``{"kind": "paged", ...}``
    or ``{"kind": "host", ...}``; every problem is an InputError naming the key."""
    if not isinstance(d, Mapping):
        raise InputError(where, f"expected an object with 'preset' or 'kind', got {show(d)}")
    if "preset" in d:
        name = d["preset"]
        if not isinstance(name, str) or name not in PRESETS:
            raise InputError(where + ".preset", f"expected one of {sorted(PRESETS)}, got {show(name)}")
        req, opt = _PRESET_ARGS[name]
        check_keys(d, ("preset",) + req + opt, where, ("preset",) + req)
        kwargs = {k: _req_int(d[k], f"{where}.{k}") for k in req + opt if k in d}
        return PRESETS[name](**kwargs)
    if "kind" not in d:
        raise InputError(where + ".kind", "expected 'preset' or 'kind' ('paged' or 'host'), got neither")
    kind = d["kind"]
    if kind == "paged":
        check_keys(d, _PAGED_KEYS, where, _PAGED_REQUIRED)
        name = _req_str(d.get("name", "paged"), where + ".name")
        layers = _req_int(d["layers"], where + ".layers")
        pages = _req_int(d["pages"], where + ".pages")
        page_bytes = _req_int(d["page_bytes"], where + ".page_bytes")
        epp = _req_int(d.get("entries_per_page", 1), where + ".entries_per_page")
        fields = _fields_from_json(d.get("fields", []), where + ".fields")
        _check_fields(fields, epp, page_bytes, where, "entries_per_page", "page_bytes")
        return PagedLayout(name, layers, pages, page_bytes, epp, fields)
    if kind == "host":
        check_keys(d, _HOST_KEYS, where, _HOST_REQUIRED)
        name = _req_str(d.get("name", "host"), where + ".name")
        layout = d["layout"]
        if layout not in HOST_LAYOUTS:
            raise InputError(where + ".layout", f"expected one of {list(HOST_LAYOUTS)}, got {show(layout)}")
        layers = _req_int(d["layers"], where + ".layers")
        units = _req_int(d["units"], where + ".units")
        unit_bytes = _req_int(d["unit_bytes"], where + ".unit_bytes")
        page_size = _req_int(d.get("page_size", 1), where + ".page_size")
        epu = _req_int(d.get("entries_per_unit", 1), where + ".entries_per_unit")
        fields = _fields_from_json(d.get("fields", []), where + ".fields")
        lay = dict(name=name, layout=layout, layers=layers, units=units, unit_bytes=unit_bytes,
                   page_size=page_size, entries_per_unit=epu, fields=fields)
        _check_host(_Raw(**lay), where)
        return HostLayout(**lay)
    raise InputError(where + ".kind", f"expected 'paged' or 'host', got {show(kind)}")


@dataclass
class _Raw:
    """Unvalidated attribute bag, so the checks can run with a JSON path."""
    name: str
    layout: str
    layers: int
    units: int
    unit_bytes: int
    page_size: int
    entries_per_unit: int
    fields: tuple = dc_field(default_factory=tuple)


def layout_to_json(layout: Layout) -> dict:
    """The explicit ``kind`` form (with ``name``); ``layout_from_json`` inverts it."""
    fields = [{"name": f.name, "offset": f.offset, "entry_bytes": f.entry_bytes}
              for f in layout.fields]
    if isinstance(layout, PagedLayout):
        return {"kind": "paged", "name": layout.name, "layers": layout.layers,
                "pages": layout.pages, "page_bytes": layout.page_bytes,
                "entries_per_page": layout.entries_per_page, "fields": fields}
    if isinstance(layout, HostLayout):
        return {"kind": "host", "name": layout.name, "layout": layout.layout,
                "layers": layout.layers, "units": layout.units, "unit_bytes": layout.unit_bytes,
                "page_size": layout.page_size, "entries_per_unit": layout.entries_per_unit,
                "fields": fields}
    raise InputError("layout", f"expected a PagedLayout or HostLayout, got {type(layout).__name__}")
