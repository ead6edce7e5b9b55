"""Gate maps: which device-pool accessors wait on the layer-load event, as data.

In SGLang every device-pool getter is supposed to call
``layer_transfer_counter.wait_until(layer)`` (``wait_layer_transfer`` in the
DeepSeek V4 pool) before it hands out layer ``layer``'s buffer: that call makes
the *current* stream wait on the load event of that layer when the batch
carries a consumer index (``reference/sglang_hicache.md`` section 6).  Whether a
getter does so is a property of the engine version, so it is data here:

* :data:`ACCESSORS`: every accessor the forward model knows, with the pool
  role whose buffer it returns (``index_k``, ``latent``, ``swa``, ``c4``,
  ``c128``, ``attention_state``, ``indexer_state``).  Writers (``set_*``) are
  not listed: SGLang never gates them (they store the batch's new tokens into
  slots the load does not touch).
* :data:`READERS`: the call sites (SGLang function names) that read a pool,
  with the accessors each calls.
* :class:`GateMap`: a named ``{accessor: gated}`` table.  Shipped maps
  (:data:`GATE_MAPS`):

  - ``upstream-0.5.10``: the last release before PR #22811.  In
    ``NSATokenToKVPool`` only ``get_index_k_with_scale_buffer`` waits;
    ``get_index_k_continuous``, ``get_index_k_scale_continuous`` and
    ``get_index_k_scale_buffer`` read ``index_k_with_scale_buffer[layer]``
    directly, so the readers ``_get_topk_ragged``, ``_get_topk_ragged_with_cp``
    and ``forward_indexer`` are ungated (read in the 0.5.10 wheel,
    ``mem_cache/memory_pool.py`` and ``layers/attention/nsa/nsa_indexer.py``).
  - ``upstream-0.5.11``: PR #22811 merged: every accessor waits (checked in
    the 0.5.14 wheel, which also has the DeepSeek V4 pool whose getters all
    call ``wait_layer_transfer``).
  - ``incident-fork``: the incident's fork (``reference/incident.md``): an
    upstream base with DeepSeek V4 support (so 0.5.11+ gating) plus the fork's
    bf16 index-K read path, ``get_index_k_bf16_buffer``.  The fork's source is
    not public; the map ships that accessor gated (the fork as it would be if
    the patch kept the gate) and the hypothesis ``ungated-index-k-bf16`` flips
    it.  So ``none`` on this map is the no-bug baseline.

A map is loadable from a dict or TOML (:func:`gate_map_from_dict`,
:func:`load_gate_map`) and overridable (:meth:`GateMap.override`); every bad
key or value is an :class:`~sim.errors.InputError` naming it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from sim.errors import InputError, check_keys, require, show

__all__ = ["ACCESSORS", "GATE_MAPS", "GateMap", "READERS", "gate_map", "gate_map_from_dict",
           "gate_map_names", "load_gate_map", "ungated_readers"]

#: accessor -> pool role of the buffer it returns
ACCESSORS: Mapping[str, str] = MappingProxyType({
    # MLA / DSA latent (MLATokenToKVPool, DSATokenToKVPool / NSATokenToKVPool)
    "get_key_buffer": "latent",
    "get_value_buffer": "latent",
    # DSA index-K (NSATokenToKVPool in 0.5.10, DSATokenToKVPool later) and the V4 C4 indexer
    "get_index_k_with_scale_buffer": "index_k",
    "get_index_k_continuous": "index_k",
    "get_index_k_scale_continuous": "index_k",
    "get_index_k_scale_buffer": "index_k",
    # the incident fork's bf16 index-K path (not upstream)
    "get_index_k_bf16_buffer": "index_k",
    # DeepSeekV4TokenToKVPool (0.5.14, deepseek_v4_memory_pool.py): callers of wait_layer_transfer
    "get_swa_key_buffer": "swa",
    "get_swa_key_buffer_radix": "swa",
    "get_extra_key_buffer": "compressed",       # C4 or C128 latent, by the layer's ratio
    "get_attention_compress_states": "attention_state",
    "get_indexer_compress_states": "indexer_state",
})

#: reader (SGLang call site) -> the accessors it calls, in order
READERS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    # DSA indexer (nsa_indexer.py)
    "_store_index_k_cache": ("get_index_k_with_scale_buffer",),       # fused store on CUDA
    "_get_topk_paged": ("get_index_k_with_scale_buffer",),            # decode / verify
    "_get_topk_ragged": ("get_index_k_scale_buffer",),                # extend (CUDA)
    "_get_topk_ragged_with_cp": ("get_index_k_continuous", "get_index_k_scale_continuous"),
    "forward_indexer": ("get_index_k_continuous", "get_index_k_scale_continuous"),  # non-CUDA
    # DSA / MLA attention backend
    "forward_extend": ("get_key_buffer",),
    "forward_decode": ("get_key_buffer",),
    # DeepSeek V4 (dsv4/indexer.py, deepseek_v4_backend.py, dsv4/compressor.py)
    "forward_indexer_compressor": ("get_indexer_compress_states",),
    "forward_c4_indexer": ("get_index_k_with_scale_buffer",),
    "forward_c4_indexer_bf16": ("get_index_k_bf16_buffer",),          # the fork's bf16 path
    "forward_core_compressor": ("get_attention_compress_states",),
    "forward_core": ("get_swa_key_buffer_radix", "get_extra_key_buffer"),
    "forward_core_swa": ("get_swa_key_buffer_radix",),
})

_DSA_ALL = ("get_key_buffer", "get_value_buffer", "get_index_k_with_scale_buffer",
            "get_index_k_continuous", "get_index_k_scale_continuous", "get_index_k_scale_buffer")
_V4_ALL = ("get_swa_key_buffer", "get_swa_key_buffer_radix", "get_extra_key_buffer",
           "get_attention_compress_states", "get_indexer_compress_states")


@dataclass(frozen=True)
class GateMap:
    """``gated[accessor]``: does that accessor wait on the layer-load event?

    An accessor absent from ``gated`` is unknown to this engine version;
    :meth:`is_gated` refuses it (naming the map and the accessor) rather than
    guess."""

    name: str
    gated: Mapping[str, bool]
    note: str = ""
    source: str = ""
    # a sorted tuple copy for equality and hashing (Mapping proxies do not hash)
    _items: tuple = field(default=(), repr=False, compare=True)

    def __post_init__(self):
        items = tuple(sorted((str(k), bool(v)) for k, v in dict(self.gated).items()))
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "gated", MappingProxyType(dict(items)))
        for acc, _ in items:
            require(acc in ACCESSORS, f"gate map {self.name}: gated.{acc}",
                    f"expected a known accessor, one of {sorted(ACCESSORS)}")

    def __hash__(self):
        return hash((self.name, self._items))

    def is_gated(self, accessor: str) -> bool:
        """Whether ``accessor`` waits; an accessor the map does not know is an error."""
        try:
            return self.gated[accessor]
        except KeyError:
            raise InputError(f"gate map {self.name}: gated.{accessor}",
                             f"this engine version's map does not list accessor {accessor!r} (the model "
                             f"uses it); known here: {sorted(self.gated)}") from None

    def ungated(self) -> tuple[str, ...]:
        """The accessors that do not wait, sorted."""
        return tuple(a for a, g in self._items if not g)

    def override(self, changes: Mapping[str, bool], name: str | None = None) -> "GateMap":
        """A copy with ``changes`` applied (accessor -> gated); may add accessors."""
        where = f"gate map {self.name}: override"
        if not isinstance(changes, Mapping):
            raise InputError(where, f"expected a table of accessor = true|false, got {show(changes)}")
        for k, v in changes.items():
            require(k in ACCESSORS, f"{where}.{k}", f"expected a known accessor, one of {sorted(ACCESSORS)}")
            require(isinstance(v, bool), f"{where}.{k}", f"expected true or false, got {show(v)}")
        return GateMap(name or self.name, {**self.gated, **changes}, self.note, self.source)

    def to_dict(self) -> dict:
        return {"name": self.name, "note": self.note, "source": self.source, "gated": dict(self._items)}


def ungated_readers(gm: GateMap, readers: Mapping[str, tuple[str, ...]] = READERS) -> tuple[str, ...]:
    """Readers (call sites) that call at least one accessor ``gm`` lists as not gated;
    accessors the map does not list are skipped (that reader is outside its version)."""
    return tuple(sorted(r for r, accs in readers.items()
                        if any(a in gm.gated and not gm.gated[a] for a in accs)))


def _all(names, value=True) -> dict:
    return {n: value for n in names}


GATE_MAPS: Mapping[str, GateMap] = MappingProxyType({
    "upstream-0.5.10": GateMap(
        "upstream-0.5.10",
        {**_all(_DSA_ALL), "get_index_k_continuous": False, "get_index_k_scale_continuous": False,
         "get_index_k_scale_buffer": False},
        note="before PR #22811: three index-K getters read without wait_until",
        source="sglang 0.5.10 wheel: mem_cache/memory_pool.py NSATokenToKVPool; "
               "layers/attention/nsa/nsa_indexer.py"),
    "upstream-0.5.11": GateMap(
        "upstream-0.5.11", {**_all(_DSA_ALL), **_all(_V4_ALL)},
        note="PR #22811 merged: every index-K getter waits; DeepSeek V4 getters call wait_layer_transfer",
        source="sglang 0.5.11 (diffed against 0.5.10) and the 0.5.14 wheel's deepseek_v4_memory_pool.py"),
    "incident-fork": GateMap(
        "incident-fork", {**_all(_DSA_ALL), **_all(_V4_ALL), "get_index_k_bf16_buffer": True},
        note="upstream V4 gating plus the fork's bf16 index-K reader; its gating is what the "
             "hypotheses ungated-index-k / ungated-index-k-bf16 decide (shipped gated: no bug)",
        source="reference/incident.md (the fork's source is not public)"),
})


def gate_map_names() -> list[str]:
    return sorted(GATE_MAPS)


def gate_map(name: str) -> GateMap:
    """A shipped gate map by name."""
    if name not in GATE_MAPS:
        raise InputError("gate_map", f"expected one of {gate_map_names()}, got {show(name)}")
    return GATE_MAPS[name]


def gate_map_from_dict(d, where: str = "gate_map") -> GateMap:
    """A gate map from ``{"name", "base"?, "note"?, "source"?, "gated": {accessor: bool}}``.

    With ``base`` (a shipped map's name) the ``gated`` table overrides that map;
    without it, ``gated`` is the whole map."""
    if not isinstance(d, Mapping):
        raise InputError(where, f"expected a table, got {show(d)}")
    check_keys(d, ("name", "base", "note", "source", "gated"), where, required=("name",))
    name = d["name"]
    require(isinstance(name, str) and 0 < len(name) <= 256, f"{where}.name",
            f"expected a name of 1..256 characters, got {show(name)}")
    for k in ("note", "source"):
        require(isinstance(d.get(k, ""), str), f"{where}.{k}", f"expected a string, got {show(d.get(k))}")
    gated = d.get("gated", {})
    if not isinstance(gated, Mapping):
        raise InputError(f"{where}.gated", f"expected a table of accessor = true|false, got {show(gated)}")
    for k, v in gated.items():
        require(k in ACCESSORS, f"{where}.gated.{k}", f"expected a known accessor, one of {sorted(ACCESSORS)}")
        require(isinstance(v, bool), f"{where}.gated.{k}", f"expected true or false, got {show(v)}")
    if "base" in d:
        base = d["base"]
        require(isinstance(base, str) and base in GATE_MAPS, f"{where}.base",
                f"expected a shipped gate map, one of {gate_map_names()}, got {show(base)}")
        gm = GATE_MAPS[base].override(gated, name=name)
        return GateMap(name, gm.gated, d.get("note", gm.note), d.get("source", gm.source))
    require(len(gated) > 0, f"{where}.gated", "expected at least one accessor (or a 'base' map)")
    return GateMap(name, gated, d.get("note", ""), d.get("source", ""))


def load_gate_map(name_or_path: str) -> GateMap:
    """A shipped map by name, or a TOML file holding one (keys as :func:`gate_map_from_dict`)."""
    if name_or_path in GATE_MAPS:
        return GATE_MAPS[name_or_path]
    if not os.path.isfile(name_or_path):
        raise InputError("gate_map", f"no file {name_or_path!r} and no shipped gate map of that name; "
                         f"expected a TOML path or one of {gate_map_names()}")
    try:
        with open(name_or_path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InputError(name_or_path, f"not a readable TOML gate map: {e}") from None
    return gate_map_from_dict(doc, name_or_path)
