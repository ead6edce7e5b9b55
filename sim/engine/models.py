"""Model families as data: layers, per-layer kinds, the pools and accessors each touches.

A :class:`ModelFamily` lists its layers (each a kind), its KV pools
(:class:`PoolSpec`: byte geometry, which layers own a slice of it) and, per
layer kind, the ordered :class:`Step` s of one forward pass of that layer: the
SGLang call site (a reader of :data:`sim.engine.gates.READERS`), the pool roles
it reads, and the compute it is followed by.  The forward model
(:mod:`sim.engine.forward`) walks these steps; the gate map decides which
steps wait.

Shipped families (:data:`MODELS`):

* ``dsa-v3.2``: DeepSeek V3.2 / GLM-5 DSA geometry (``reference/dsa_geometry.md``
  section 1): 61 layers, every one with the lightning indexer; latent 656 B per
  token per layer (fp8 store: 512 fp8 nope + 4 fp32 scales + 64 bf16 rope),
  index-K pages of 64 entries x (128 B key + 4 B scale) = 8,448 B.  Order in a
  layer (0.5.10 ``nsa_indexer.py`` ``forward_cuda``): the index-K store for the
  new tokens, then the top-k read of index-K (extend: ``_get_topk_ragged``;
  decode: ``_get_topk_paged``), then MLA attention reads the latent through
  ``get_key_buffer``.
* ``deepseek-v4-flash``: 43 layers; layers 0-1 sliding-window only (ratio 0),
  then C4 and C128 alternating, starting with C4 (``dsa_geometry.md`` section
  2.1), so 21 C4 layers and 20 C128 layers.  C4 layers have the indexer.
  Pools (section 2.2, page size 256 raw tokens): SWA 584 B per token; C4 latent
  pages of 64 compressed entries (37,440 B, 4 raw tokens per entry); C4
  indexer pages of 64 entries (8,448 B fp8, or 64 x 256 B bf16 in the
  incident's fork); C128 pages of 2 entries (1,728 B, 128 raw tokens per
  entry).  Order in a C4 layer (0.5.14 ``deepseek_v4.py``, single-stream
  path): indexer compressor state, index-K read and top-k; the attention
  compressor state; then the core attention reads SWA and the C4 latent.
  SWA is read in its window only: each query token attends to the 128 tokens ending
  at it (``PoolSpec.read_entries``).

Options (:data:`MODEL_OPTIONS`) pick between real code paths:
``index_k_dtype`` (fp8 upstream, bf16 in the fork), ``index_k_store`` (DSA:
``fused``: the CUDA JIT store fetches the buffer through the gated
``get_index_k_with_scale_buffer`` before the top-k read; ``fallback``:
``set_index_k_scale_buffer``, a writer that never waits), ``indexer_path``
(DSA: ``cuda``, ``cuda_cp`` or ``other`` for ``forward_indexer``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import numpy as np

from sim.errors import InputError, require, show
from sim.pools.layouts import PagedLayout, bf16_index_k, c4_indexer, c128_paged, c4_paged, dsa_index_k, \
    token_rows

__all__ = ["MODELS", "MODEL_OPTIONS", "ModelDims", "ModelFamily", "PoolSpec", "Step", "model",
           "model_names", "resolve_options"]

#: option -> (allowed values, default)
MODEL_OPTIONS: Mapping[str, tuple[tuple[str, ...], str]] = MappingProxyType({
    "index_k_dtype": (("fp8", "bf16"), "fp8"),
    # NOTE: default "fallback": with the fused store, the store's gated getter call waits on the
    # layer's event on the same stream before the ragged top-k read, which would hide the 0.5.10
    # gap that PR #22811 observed in production; the fallback store (set_index_k_scale_buffer, a
    # writer) does not wait, so the top-k read is the layer's first access.
    "index_k_store": (("fused", "fallback"), "fallback"),
    "indexer_path": (("cuda", "cuda_cp", "other"), "cuda"),
})


def resolve_options(options: Mapping[str, str] | None, where: str = "options") -> dict[str, str]:
    """Defaults filled in; an unknown option or value is an error naming it."""
    options = dict(options or {})
    for k, v in options.items():
        require(k in MODEL_OPTIONS, f"{where}.{k}", f"expected one of {sorted(MODEL_OPTIONS)}")
        allowed = MODEL_OPTIONS[k][0]
        require(v in allowed, f"{where}.{k}", f"expected one of {list(allowed)}, got {show(v)}")
    return {k: options.get(k, d) for k, (_, d) in MODEL_OPTIONS.items()}


@dataclass(frozen=True)
class Step:
    """One call site of a layer's forward: its reader (SGLang function), the pool roles
    whose bytes it reads after calling its accessors (empty: the call only fetches a
    buffer, e.g. a store, and so only gates), the batch modes it runs in, the compute
    that follows it, and the options it requires (``when``: (option, allowed values))."""

    reader: str
    roles: tuple[str, ...] = ()
    modes: tuple[str, ...] = ("extend", "decode")
    compute: str | None = None
    when: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def applies(self, mode: str, options: Mapping[str, str]) -> bool:
        return mode in self.modes and all(options[k] in vals for k, vals in self.when)


def window_start(seq_len: int, window: int, page: int) -> int:
    """Where a PD transfer of a ``seq_len``-token sequence starts sending a sliding-window
    pool: the start of the page holding position ``max(0, seq_len - window)`` (SGLang 0.5.14
    ``disaggregation/prefill.py`` ``_swa_payload``: ``window_start = max(0, seq_len -
    window_size)`` rounded down to a page)."""
    return (max(0, seq_len - window) // page) * page


@dataclass(frozen=True)
class PoolSpec:
    """A device KV pool: its role, which model layers own a slice of it (pool layer
    ``k`` is model layer ``layers[k]``), and its page geometry.  ``tokens_per_entry`` is
    the compression ratio (raw tokens per stored entry).  ``windowed``: the sliding-window
    pool, whose kernels read only the model's window (``ModelDims.window``) before each query
    token (:meth:`read_entries`); its entries are raw tokens."""

    role: str
    layers: tuple[int, ...]
    page_bytes: int
    entries_per_page: int
    tokens_per_entry: int
    index_k: bool = False
    windowed: bool = False

    def __post_init__(self):
        if self.windowed and self.tokens_per_entry != 1:
            raise InputError(f"pool {self.role}", f"a windowed pool holds one entry per token: expected "
                             f"tokens_per_entry 1, got {self.tokens_per_entry}")

    def sent_from(self, seq_len: int, window: int, page: int) -> int:
        """The first position whose KV of this pool a PD transfer of a ``seq_len``-token
        sequence sends: 0, or for a windowed pool the page holding position ``seq_len -
        window`` on (:func:`window_start`)."""
        return window_start(seq_len, window, page) if self.windowed and window > 0 else 0

    def read_entries(self, entries: np.ndarray, new_tokens: int, window: int) -> tuple[np.ndarray, int]:
        """What a forward's kernels read of this pool for one request: of ``entries`` (the
        request's entries of this pool in sequence order, every one its context has), those
        read for ``new_tokens`` query tokens, and the sequence index of the first of them.

        A windowed pool (``window > 0``): query token ``q`` reads tokens ``q - window + 1 ..
        q`` (SGLang's DeepSeek V4 backend: ``get_swa_page_indices`` gives each query
        ``SWA_WINDOW`` positions ending at it, ``swa_topk_lengths = min(seq_len, SWA_WINDOW)``),
        so the queries of an extend or a decode step read the last ``new_tokens + window - 1``
        entries.  Any other pool: every entry, from 0."""
        if not self.windowed or window <= 0:
            return entries, 0
        keep = min(len(entries), new_tokens + window - 1)
        first = len(entries) - keep
        return (entries[first:] if first else entries), first

    @property
    def bytes_per_token(self) -> float:
        """Bytes per raw token per layer, page padding included (one layer's share)."""
        return self.page_bytes / (self.entries_per_page * self.tokens_per_entry)

    def pool_layer(self, layer: int) -> int:
        """The pool's own layer index of model layer ``layer``."""
        try:
            return self._index[layer]
        except KeyError:
            raise InputError(f"pool {self.role}", f"model layer {layer} has no slice of this pool; "
                             f"its layers are {list(self.layers)[:8]}...") from None

    @property
    def _index(self) -> dict[int, int]:
        idx = self.__dict__.get("_idx")
        if idx is None:
            idx = {l: k for k, l in enumerate(self.layers)}
            object.__setattr__(self, "_idx", idx)
        return idx

    def layout(self, pages: int) -> PagedLayout:
        """A device layout of this pool with ``pages`` pages per layer (token-row pools:
        ``pages`` rows)."""
        n = len(self.layers)
        if self.role == "index_k" and self.entries_per_page == 1:
            return bf16_index_k(n, pages)
        if self.role == "index_k":
            return (c4_indexer if self.tokens_per_entry > 1 else dsa_index_k)(n, pages)
        if self.role == "c4":
            return c4_paged(n, pages)
        if self.role == "c128":
            return c128_paged(n, pages)
        return token_rows(self.page_bytes, n, pages - 1)   # token_rows adds one padding row


@dataclass(frozen=True)
class ModelDims:
    """What the cost model needs (``reference/dsa_geometry.md`` sections 1.1, 2.1)."""

    hidden: int
    heads: int
    qk_head_dim: int            # query/key dims per head attended (latent + rope for MLA)
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    window: int                 # sliding window (0: none)
    active_params_per_layer: float
    weight_bytes_per_param: float


@dataclass(frozen=True)
class ModelFamily:
    name: str
    layer_kinds: tuple[str, ...]
    steps: Mapping[str, tuple[Step, ...]]      # layer kind -> ordered steps
    pools: Mapping[str, PoolSpec]              # base pools (fp8 index-K)
    dims: ModelDims
    compressed_role: Mapping[str, str] = field(default_factory=dict)   # layer kind -> its compressed pool
    bf16_index_k: PoolSpec | None = None
    #: the pool roles SGLang 0.5.14's PD sender moves with every chunk (the pool's
    #: ``get_contiguous_buf_infos``); the others are state (``get_state_buf_infos``), sent with
    #: the last chunk only (DSA: index-K; V4: SWA, the window alone)
    chunk_sent_roles: tuple[str, ...] = ()
    source: str = ""

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    def pools_for(self, options: Mapping[str, str]) -> dict[str, PoolSpec]:
        """Pools under ``options`` (the bf16 index-K pool replaces the fp8 one)."""
        pools = dict(self.pools)
        if options.get("index_k_dtype") == "bf16":
            require(self.bf16_index_k is not None, "options.index_k_dtype",
                    f"model {self.name} has no bf16 index-K variant")
            pools["index_k"] = self.bf16_index_k
        return pools

    def layer_steps(self, layer: int, mode: str, options: Mapping[str, str]) -> tuple[Step, ...]:
        """The steps of model layer ``layer`` for a ``mode`` batch, in the model's order;
        a step's generic role ``compressed`` names the layer kind's own compressed pool (C4 or
        C128), given by ``compressed_role``."""
        require(mode in ("extend", "decode"), "batch.mode", f"expected 'extend' or 'decode', got {show(mode)}")
        kind = self.layer_kinds[layer]
        out = []
        for s in self.steps[kind]:
            if not s.applies(mode, options):
                continue
            if "compressed" in s.roles:
                roles = tuple(self.compressed_role[kind] if r == "compressed" else r for r in s.roles)
                s = Step(s.reader, roles, s.modes, s.compute, s.when)
            out.append(s)
        return tuple(out)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)


# ---------------------------------------------------------------- DSA (V3.2 / GLM-5)

_DSA_LAYERS = 61
_DSA_STEPS = (
    Step("_store_index_k_cache", (), when=(("index_k_store", ("fused",)),)),
    Step("_get_topk_ragged", ("index_k",), ("extend",), "indexer", (("indexer_path", ("cuda",)),)),
    Step("_get_topk_ragged_with_cp", ("index_k",), ("extend",), "indexer", (("indexer_path", ("cuda_cp",)),)),
    Step("_get_topk_paged", ("index_k",), ("decode",), "indexer", (("indexer_path", ("cuda", "cuda_cp")),)),
    Step("forward_indexer", ("index_k",), ("extend", "decode"), "indexer", (("indexer_path", ("other",)),)),
    Step("forward_extend", ("latent",), ("extend",), "attention"),
    Step("forward_decode", ("latent",), ("decode",), "attention"),
)
_ALL_DSA = tuple(range(_DSA_LAYERS))

DSA_V32 = ModelFamily(
    name="dsa-v3.2",
    layer_kinds=("dsa",) * _DSA_LAYERS,
    steps=MappingProxyType({"dsa": _DSA_STEPS}),
    pools=MappingProxyType({
        "latent": PoolSpec("latent", _ALL_DSA, 656, 1, 1),
        "index_k": PoolSpec("index_k", _ALL_DSA, 64 * 132, 64, 1, index_k=True),
    }),
    chunk_sent_roles=("latent",),
    dims=ModelDims(hidden=7168, heads=128, qk_head_dim=576, v_head_dim=512, index_heads=64,
                   index_head_dim=128, index_topk=2048, window=0,
                   active_params_per_layer=37e9 / _DSA_LAYERS, weight_bytes_per_param=1.0),
    source="reference/dsa_geometry.md sections 1.1-1.6 (DeepSeek V3.2 config; GLM-5 uses the same DSA "
           "geometry); sglang 0.5.10 nsa_indexer.py order",
)

# ---------------------------------------------------------------- DeepSeek V4-Flash

_V4_LAYERS = 43
_V4_KINDS = ("swa", "swa") + tuple("c4" if i % 2 == 0 else "c128" for i in range(_V4_LAYERS - 2))
_V4_C4 = tuple(i for i, k in enumerate(_V4_KINDS) if k == "c4")
_V4_C128 = tuple(i for i, k in enumerate(_V4_KINDS) if k == "c128")
_V4_PAGE = 256                      # model page size (raw tokens), forced for DeepSeek V4
_V4_STEPS = {
    "swa": (Step("forward_core_swa", ("swa",), compute="attention"),),
    "c4": (
        Step("forward_indexer_compressor", ("indexer_state",)),
        Step("forward_c4_indexer", ("index_k",), compute="indexer", when=(("index_k_dtype", ("fp8",)),)),
        Step("forward_c4_indexer_bf16", ("index_k",), compute="indexer", when=(("index_k_dtype", ("bf16",)),)),
        Step("forward_core_compressor", ("attention_state",)),
        Step("forward_core", ("swa", "compressed"), compute="attention"),
    ),
    "c128": (
        Step("forward_core_compressor", ("attention_state",)),
        Step("forward_core", ("swa", "compressed"), compute="attention"),
    ),
}

V4_FLASH = ModelFamily(
    name="deepseek-v4-flash",
    layer_kinds=_V4_KINDS,
    steps=MappingProxyType(_V4_STEPS),
    pools=MappingProxyType({
        "swa": PoolSpec("swa", tuple(range(_V4_LAYERS)), 584, 1, 1, windowed=True),
        "c4": PoolSpec("c4", _V4_C4, 37440, _V4_PAGE // 4, 4),
        "index_k": PoolSpec("index_k", _V4_C4, 8448, _V4_PAGE // 4, 4, index_k=True),
        "c128": PoolSpec("c128", _V4_C128, 1728, _V4_PAGE // 128, 128),
    }),
    bf16_index_k=PoolSpec("index_k", _V4_C4, 256, 1, 4, index_k=True),
    compressed_role=MappingProxyType({"c4": "c4", "c128": "c128"}),
    chunk_sent_roles=("c4", "index_k", "c128"),
    dims=ModelDims(hidden=4096, heads=64, qk_head_dim=512, v_head_dim=512, index_heads=64,
                   index_head_dim=128, index_topk=512, window=128,
                   active_params_per_layer=13e9 / _V4_LAYERS, weight_bytes_per_param=1.0),
    source="reference/dsa_geometry.md section 2 (sglang-jax #1678, fak #12636, sglang "
           "deepseek_v4_memory_pool.py); sglang 0.5.14 deepseek_v4.py order",
)

MODELS: Mapping[str, ModelFamily] = MappingProxyType({m.name: m for m in (DSA_V32, V4_FLASH)})


def model_names() -> list[str]:
    return sorted(MODELS)


def model(name: str) -> ModelFamily:
    if name not in MODELS:
        raise InputError("model", f"expected one of {model_names()}, got {show(name)}")
    return MODELS[name]
