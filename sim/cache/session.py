"""A standalone HiCache session: the cache, its controller and the executor, from plain Python.

``CacheSession(config)`` builds, from a small validated config, the device pool, its
allocator and the host pool (``sim.pools``), a run header (their buffers, the streams
``schedule``, ``forward``, ``load`` and ``write``, the controller's events, the host
``scheduler``), the online executor, the :class:`~sim.cache.controller.HiCacheController`
and SGLang's ``HiRadixCache`` over it (``session.cache``).  Every call is made by the
scheduler host, and the session advances the simulated clock until the call and any
blocking step it left (``controller.settle()``) have completed::

    s = CacheSession({"model": "mla", "layers": 4, "device_tokens": 64})
    s.store_kv(slots, owner=12)                 # the forward pass writes request 12's KV
    s.cache.insert(InsertParams(key, slots))    # write_through: backup starts at once
    s.advance(50.0)                             # 50 us of host time
    s.cache.check_hicache_events()              # polls the acks (query), frees, unlocks
    s.bytes_of("kv_buffer", layer=0, units=slots)   # whose bytes each slot holds
    doc = s.record()                            # the run so far as a format 2 schedule

How the host runs.  The scheduler host is driven by the session itself rather than
parked in a SimPy process between calls: a host op issued by a call is issued at the
current simulated instant, and each blocking op (``advance``, ``wait_idle``, a settle's
``host_sync``) is waited for with ``env.run(until=its event)``, which stops right after
the event's callbacks ran, the very point where a host program blocked on it resumes.
NOTE: a process parked on a "next call" event would resume through an extra event that
the recorded schedule does not contain, so ops issued at one instant could meet other
same-instant events in another order than in the static re-run; driven this way, the
recorded schedule (:meth:`record`) re-runs statically (``kvrace schedule run``) to the
same Snapshot (:meth:`finish` gives the run to compare).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from sim.arrays import unique_sorted
from sim.bytes.describe import describe
from sim.cache.controller import DEFAULT_WRITE_EVENT_POOL, WRITE_POLICIES, HiCacheController
from sim.cache.evict_policy import EVICTION_POLICIES
from sim.cache.ranks import RankedHost, rank_header
from sim.errors import InputError, KvraceError, check_keys, show
from sim.executor import KEEP_MODES, Executor, Host, RunResult, TieBreak
from sim.pools import (
    DeepSeekV4TokenToKVPool, DSATokenToKVPool, HostPoolGroup, MLATokenToKVPool, MLATokenToKVPoolHost,
    PagedTokenToKVPoolAllocator, ReqToTokenPool, TokenToKVPoolAllocator, resolve_layout_io_compatibility,
)
from sim.pools.device import DEEPSEEK_V4_FLASH_LAYERS, MAX_DEVICE_POOL_TOKENS, deepseek_v4_flash_ratios
from sim.pools.host import IO_BACKENDS, PARTIAL_PAGE_MODES
from sim.pools.layouts import DSA_PAGE_SIZE, HOST_LAYOUTS, INDEX_HEAD_DIM, INDEX_SCALE_BYTES
from sim.profile import load_profile
from sim.schedule import MAX_DURATION_US, ScheduleBuilder

__all__ = ["CacheSession", "SessionConfig", "SessionClosed", "MODELS", "MODEL_ROLES", "SWITCH_MODELS", "STREAMS",
           "HOST", "BATCH_EVENT", "SEND_STREAM", "SEND_EVENT", "SEND_DONE_EVENT"]

#: model families: the device pool classes of ``sim.pools`` a session can build
MODELS = ("mla", "dsa", "deepseek-v4")
#: per model, the device pool roles it has (``sim.pools.device.POOL_ROLE_OF_KIND``): what
#: ``backup_pools`` may list (a V4 model cut to layers without C128 has no ``c128`` pool)
MODEL_ROLES = MappingProxyType({"mla": ("latent",), "dsa": ("latent", "index_k"),
                                "deepseek-v4": ("swa", "c4", "index_k", "c128")})
#: the models each controller switch applies to (docs/hicache.md, "Controller switches")
SWITCH_MODELS = MappingProxyType({
    "index_k_partial_pages": ("deepseek-v4",), "index_k_host_bytes_per_entry": ("dsa", "deepseek-v4"),
    "host_lock_during_load": MODELS, "backup_pools": MODELS,
})
#: the page size SGLang forces per model (None: any)
MODEL_PAGE_SIZE = MappingProxyType({"mla": None, "dsa": DSA_PAGE_SIZE, "deepseek-v4": DeepSeekV4TokenToKVPool.PAGE_SIZE})
#: bytes per entry of the fp8 index-K page (128 B key + 4 B scale), the DSA and V4 device default
FP8_INDEX_K_ENTRY_BYTES = INDEX_HEAD_DIM + INDEX_SCALE_BYTES
#: the run's streams: the scheduler's current stream in overlap mode, the forward stream,
#: the controller's load and write streams
STREAMS = ("schedule", "forward", "load", "write")
#: the name of the scheduler's k-th batch event (``SessionConfig.batch_events``)
BATCH_EVENT = "copy_done.{}"
#: the PD sender's stream (its RDMA reads run outside CUDA stream order) and the event the
#: early send waits on, declared with ``SessionConfig.send_stream``
SEND_STREAM = "rdma"
SEND_EVENT = "pd_send"
#: recorded on the send stream after a batch's early sends (the sender's completion, polled)
SEND_DONE_EVENT = "pd_send_done"
HOST = "scheduler"


class SessionClosed(KvraceError, RuntimeError):
    """A call on a session whose run has been finished (:meth:`CacheSession.finish`)."""


@dataclass(frozen=True)
class SessionConfig:
    """A session's configuration (every key optional; defaults are SGLang's where it has one).

    * ``model``: ``"mla"`` (``MLATokenToKVPool``, latent rows), ``"dsa"``
      (``DSATokenToKVPool``: fp8 latent plus the index-K sidecar, page size 64) or
      ``"deepseek-v4"`` (``DeepSeekV4TokenToKVPool`` of DeepSeek V4-Flash's first ``layers``
      layers: SWA, C4 latent, C4 indexer index-K, C128 latent; page size 256; ``layers``
      3..43, the first C4 layer being layer 2; docs/pools.md "DeepSeek V4 in a session").
    * ``index_k_dtype`` (``"fp8"``): ``"bf16"`` is the incident's fork (V4 only): the C4
      indexer stores 256 B bf16 rows per compressed token.
    * The incident's controller switches (docs/hicache.md, "Controller switches"; each
      refused with an InputError for a model it does not apply to, :data:`SWITCH_MODELS`):
      ``index_k_partial_pages`` (``"page_aligned"``; ``"dsv4_token"``),
      ``index_k_host_bytes_per_entry`` (0: the device's), ``host_lock_during_load`` (True),
      ``backup_pools`` (None: every pool; else a list of pool roles, :data:`MODEL_ROLES`).
    * ``layers``: layers of the device pool (4); ``page_size`` (1; DSA needs 64, DeepSeek V4 256);
      ``device_tokens``: device pool size in tokens (256).
    * ``hicache_ratio`` (2.0) / ``hicache_size`` (GB per rank, 0: use the ratio): host pool
      sizing as SGLang's ``HostKVCache``.
    * ``layout`` (``"page_first"``, SGLang's default), ``io_backend`` (``"kernel"``): resolved
      as SGLang's server args resolve them (``page_first`` + ``direct`` runs
      ``page_first_direct``; ``page_first_direct`` + ``kernel`` runs ``direct``).
    * ``write_policy`` (``"write_through"``), ``load_back_threshold`` (10 tokens).
    * ``overlap`` (True): the scheduler's current stream is ``schedule`` (overlap mode);
      False: ``forward`` (the default stream).
    * ``load_fence`` (False): SGLang PR #36738's fence (load stream waits for ``forward``).
    * ``write_event_pool``: write-event name pairs declared (64).
    * ``batch_events`` (0): event names ``copy_done.0`` .. ``copy_done.{n-1}`` declared for the
      scheduler's own use (the overlap loop records one after each batch's forward and later
      waits on it, SGLang's ``copy_done``; :data:`BATCH_EVENT`).
    * ``send_stream`` (False): declare the PD sender's stream :data:`SEND_STREAM` and the events
      :data:`SEND_EVENT` and :data:`SEND_DONE_EVENT` (the engine's early send, ``pd_send``).
    * MLA geometry: ``kv_lora_rank`` (512), ``qk_rope_head_dim`` (64), ``itemsize`` (2).
    * ``profile`` (``"h200"``), ``seed`` (0), ``ties`` (``"fifo"``), ``materialise`` (True:
      real bytes too when they fit).
    * ``keep`` (``"all"``): what the run keeps (``sim.executor``'s keep modes). ``"all"``: every
      op, its timings and every read's bytes, the recorded schedule (:meth:`CacheSession.record`,
      windows, traces, Snapshots); ``"report"``: live state only, the verdicts computed while the
      run runs (``sim.verdicts.OnlineVerdicts``), every latent race listed; with a read sink
      (:meth:`CacheSession.set_read_sink`) not even the per-read entries are kept.
    * ``digest`` (True): ``keep="report"`` only: hash the ops as they are issued, so that
      ``RunResult.digest`` is the recorded schedule's digest; False leaves it None (a run that
      reports no digest, like the engine's, saves the ops' canonical JSON).
    * ``ranks`` (1): TP ranks simulated in lockstep (:mod:`sim.cache.ranks`): one tree and
      allocator, and per rank its own device and host buffers, streams, events and link
      (rank ``r`` on device ``r``, names suffixed ``@r``); every op the session and its
      controller issue is issued on each rank, and a blocking call waits for every rank.
    * ``eviction_policy`` (``"lru"``; :data:`~sim.cache.evict_policy.EVICTION_POLICIES`) and
      ``is_eagle`` (False: EAGLE's bigram keys), the tree's ``CacheInitParams`` fields.
    * ``max_running_requests`` (64; SGLang derives its own from memory): rows of the session's
      request-to-token table (``session.req_to_token_pool``, each ``device_tokens`` long), which
      ``cache_finished_req`` / ``cache_unfinished_req`` read a request's slots from.
    """

    model: str = "mla"
    layers: int = 4
    page_size: int = 1
    device_tokens: int = 256
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    layout: str = "page_first"
    io_backend: str = "kernel"
    write_policy: str = "write_through"
    load_back_threshold: int = 10
    overlap: bool = True
    load_fence: bool = False
    write_event_pool: int = DEFAULT_WRITE_EVENT_POOL
    batch_events: int = 0
    send_stream: bool = False
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    itemsize: int = 2
    profile: str = "h200"
    seed: int = 0
    ties: str = "fifo"
    materialise: bool = True
    index_k_dtype: str = "fp8"
    index_k_partial_pages: str = "page_aligned"
    index_k_host_bytes_per_entry: int = 0
    host_lock_during_load: bool = True
    backup_pools: frozenset | None = None
    keep: str = "all"
    digest: bool = True
    ranks: int = 1
    max_running_requests: int = 64
    eviction_policy: str = "lru"
    is_eagle: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> "SessionConfig":
        d = dict(d or {})
        check_keys(d, list(cls.__dataclass_fields__), "config")
        bp = d.get("backup_pools")
        if isinstance(bp, (list, tuple, set, frozenset)) and all(isinstance(r, str) for r in bp):
            d["backup_pools"] = frozenset(bp)
        c = cls(**d)
        c.validate()
        return c

    def validate(self) -> None:
        def need(cond, key, expected):
            if not cond:
                raise InputError(f"config.{key}", f"expected {expected}, got {show(getattr(self, key))}")

        def is_int(v, lo=0):
            return isinstance(v, int) and not isinstance(v, bool) and v >= lo

        def is_num(v, lo=0.0):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= lo

        need(self.model in MODELS, "model", f"one of {list(MODELS)}")
        need(is_int(self.layers, 1), "layers", "an integer >= 1")
        need(self.model != "deepseek-v4" or 3 <= self.layers <= DEEPSEEK_V4_FLASH_LAYERS, "layers",
             f"an integer in 3..{DEEPSEEK_V4_FLASH_LAYERS} for model 'deepseek-v4' (layers 0-1 are sliding-window "
             "only; the first C4 layer, which the V4 pools need, is layer 2)")
        need(is_int(self.page_size, 1), "page_size", "an integer >= 1")
        forced = MODEL_PAGE_SIZE[self.model]
        need(forced is None or self.page_size == forced, "page_size",
             f"{forced} for model {self.model!r} (SGLang forces it)")
        need(is_int(self.device_tokens, 1) and self.device_tokens % self.page_size == 0
             and self.device_tokens <= MAX_DEVICE_POOL_TOKENS, "device_tokens",
             f"an integer in 1..{MAX_DEVICE_POOL_TOKENS} (MAX_DEVICE_POOL_TOKENS) that is a multiple of page_size "
             f"({self.page_size})")
        need(is_num(self.hicache_ratio) and self.hicache_ratio > 0, "hicache_ratio", "a number > 0")
        need(is_num(self.hicache_size), "hicache_size", "a number >= 0 (GB; 0: use hicache_ratio)")
        need(self.layout in HOST_LAYOUTS, "layout", f"one of {list(HOST_LAYOUTS)}")
        need(self.io_backend in IO_BACKENDS, "io_backend", f"one of {list(IO_BACKENDS)}")
        need(self.write_policy in WRITE_POLICIES, "write_policy", f"one of {list(WRITE_POLICIES)}")
        need(is_int(self.load_back_threshold), "load_back_threshold", "an integer >= 0")
        for key in ("overlap", "load_fence", "materialise", "digest", "send_stream"):
            need(isinstance(getattr(self, key), bool), key, "true or false")
        need(is_int(self.write_event_pool, 1), "write_event_pool", "an integer >= 1")
        need(is_int(self.batch_events), "batch_events", "an integer >= 0")
        need(is_int(self.kv_lora_rank, 1), "kv_lora_rank", "an integer >= 1")
        need(is_int(self.qk_rope_head_dim), "qk_rope_head_dim", "an integer >= 0")
        need(is_int(self.itemsize, 1), "itemsize", "an integer >= 1")
        need(isinstance(self.profile, str) and self.profile, "profile", "a profile name or a TOML path")
        need(is_int(self.seed), "seed", "an integer >= 0")
        need(self.ties in ("fifo", "seeded"), "ties", "'fifo' or 'seeded'")
        need(self.keep in KEEP_MODES, "keep", f"one of {list(KEEP_MODES)}")
        need(is_int(self.ranks, 1), "ranks", "an integer >= 1")
        need(is_int(self.max_running_requests, 1), "max_running_requests", "an integer >= 1")
        need(self.eviction_policy in EVICTION_POLICIES, "eviction_policy", f"one of {list(EVICTION_POLICIES)}")
        need(isinstance(self.is_eagle, bool), "is_eagle", "true or false")
        need(self.model != "deepseek-v4" or self.hicache_size == 0, "hicache_size",
             "0 for model 'deepseek-v4' (SGLang's V4 HiCache does not support --hicache-size; use hicache_ratio)")
        need(self.index_k_dtype in ("fp8", "bf16"), "index_k_dtype", "'fp8' or 'bf16'")
        need(self.index_k_dtype == "fp8" or self.model == "deepseek-v4", "index_k_dtype",
             "'fp8' for models other than 'deepseek-v4' (the bf16 index-K is the V4 fork's; SGLang has no host "
             "pool for a bf16 DSA index-K)")
        need(self.index_k_partial_pages in PARTIAL_PAGE_MODES, "index_k_partial_pages",
             f"one of {sorted(PARTIAL_PAGE_MODES)}")
        need(is_int(self.index_k_host_bytes_per_entry), "index_k_host_bytes_per_entry",
             "an integer >= 0 (0: the device's row)")
        need(isinstance(self.host_lock_during_load, bool), "host_lock_during_load", "true or false")
        roles = MODEL_ROLES.get(self.model, ())
        need(self.backup_pools is None or (isinstance(self.backup_pools, frozenset)
                                           and self.backup_pools <= set(roles)),
             "backup_pools", f"a list of pool roles of model {self.model!r}, some of {list(roles)}")
        # switches away from their defaults only where they mean something
        defaults = {"index_k_partial_pages": "page_aligned", "index_k_host_bytes_per_entry": 0,
                    "host_lock_during_load": True, "backup_pools": None}
        for key, default in defaults.items():
            if getattr(self, key) != default and self.model not in SWITCH_MODELS[key]:
                raise InputError(f"config.{key}", f"expected {show(default)} for model {self.model!r}: the switch "
                                 f"applies to models {list(SWITCH_MODELS[key])}, got {show(getattr(self, key))}")
        need(self.model != "dsa" or self.index_k_host_bytes_per_entry in (0, FP8_INDEX_K_ENTRY_BYTES),
             "index_k_host_bytes_per_entry",
             f"0 or {FP8_INDEX_K_ENTRY_BYTES} for model 'dsa' (its device index-K is fp8 pages of "
             f"{FP8_INDEX_K_ENTRY_BYTES} B an entry, so the host mirrors it; a different host stride is the V4 "
             "fork's case, model 'deepseek-v4')")


class _Settled:
    """``session.cache``: the tree, each of whose method calls is followed by the
    controller's settle (the session advances time until the call's blocking steps have
    completed).  Attributes that are not methods pass through."""

    def __init__(self, session: "CacheSession", target):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not inspect.ismethod(value):
            return value

        def call(*args, **kwargs):
            return self._session.call(value, *args, **kwargs)
        call.__name__ = name
        call.__doc__ = value.__doc__
        return call

    def __setattr__(self, name, value):
        setattr(self._target, name, value)

    def __repr__(self) -> str:
        return f"<settled {self._target!r}>"


class CacheSession:
    """The HiCache model driven from plain Python (see the module doc).

    Attributes: ``config`` (the :class:`SessionConfig`, layout and io backend as resolved),
    ``device_pool``, ``allocator``, ``req_to_token_pool``, ``host_pool``, ``controller``, ``tree`` (the
    ``HiRadixCache``), ``cache`` (the same tree, each call settled), ``host`` (the scheduler's
    :class:`~sim.executor.Host`), ``header`` (the run's schedule header)."""

    def __init__(self, config: dict | None = None, **overrides):
        cfg = SessionConfig.from_dict({**(config or {}), **overrides})
        layout, io_backend = resolve_layout_io_compatibility(cfg.layout, cfg.io_backend)
        cfg = SessionConfig(**{**cfg.__dict__, "layout": layout, "io_backend": io_backend})
        device_entry = FP8_INDEX_K_ENTRY_BYTES if cfg.index_k_dtype == "fp8" else 2 * INDEX_HEAD_DIM
        if io_backend == "direct" and cfg.index_k_host_bytes_per_entry not in (0, device_entry):
            raise InputError("config.index_k_host_bytes_per_entry",
                             f"expected 0 or {device_entry} with the direct io backend (it copies whole tensor "
                             f"rows, which fails when host and device rows differ), got "
                             f"{show(cfg.index_k_host_bytes_per_entry)}")
        self.config = cfg
        self.device_pool, self.host_pool = self._pools(cfg)
        alloc_cls = TokenToKVPoolAllocator if cfg.page_size == 1 else PagedTokenToKVPoolAllocator
        self.allocator = alloc_cls(cfg.device_tokens, cfg.page_size, self.device_pool)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_running_requests, cfg.device_tokens)
        current = "schedule" if cfg.overlap else "forward"
        header = {
            "kvrace_schedule": 2, "name": "cache_session",
            "description": f"CacheSession {cfg.model}, {cfg.layers} layers, page {cfg.page_size}, "
                           f"{cfg.layout}/{cfg.io_backend}, {cfg.write_policy}",
            "buffers": self.device_pool.buffers() + self.host_pool.buffers(),
            "streams": list(STREAMS) + [SEND_STREAM] * cfg.send_stream,
            "events": HiCacheController.event_names(self.device_pool.layer_num,
                                                    write_event_pool=cfg.write_event_pool,
                                                    load_fence=cfg.load_fence)
                      + [BATCH_EVENT.format(k) for k in range(cfg.batch_events)]
                      + [SEND_EVENT, SEND_DONE_EVENT] * cfg.send_stream,
            "hosts": [HOST],
        }
        #: the run's header: rank 0's buffers, streams and events, then each further rank's
        self.header = rank_header(header, cfg.ranks)
        report = cfg.keep == "report"
        builder = ScheduleBuilder(self.header, max_ops=None, keep_ops=not report, digest=cfg.digest)
        extra = dict(keep="report", hosts=builder.hosts, race_limit=None) if report else {}
        self._ex = Executor(builder.buffers, builder.streams, load_profile(cfg.profile), builder=builder,
                            seed=cfg.seed, ties=TieBreak(cfg.ties, seed=cfg.seed), materialise=cfg.materialise,
                            **extra)
        self._sink = None
        self.env = self._ex.env
        # NOTE: let the streams' processes start before the host issues anything, as a
        # static run does (its host program starts after them)
        start = self.env.event()
        start.succeed()
        self.env.run(until=start)
        #: the scheduler's host: every op issued on each simulated rank (``sim.cache.ranks``)
        self.host = RankedHost(Host(self._ex, HOST), cfg.ranks)
        self.controller = HiCacheController(
            self.allocator, self.host_pool, cfg.page_size, host=self.host, load_stream="load",
            write_stream="write", current_stream=current, write_policy=cfg.write_policy,
            io_backend=cfg.io_backend, load_fence_stream="forward" if cfg.load_fence else None,
            write_event_pool=cfg.write_event_pool,
            backup_pools=None if cfg.backup_pools is None else cfg.backup_pools & set(self.roles.values()))
        self.tree = self._tree(cfg)
        self.cache = _Settled(self, self.tree) if self.tree is not None else None
        self._result: RunResult | None = None

    @staticmethod
    def _pools(cfg: SessionConfig):
        if cfg.model == "deepseek-v4":
            dev = DeepSeekV4TokenToKVPool(cfg.device_tokens, cfg.page_size, deepseek_v4_flash_ratios(cfg.layers),
                                          bf16_index_k=cfg.index_k_dtype == "bf16", with_swa=True)
            return dev, HostPoolGroup.for_deepseek_v4(
                dev, cfg.hicache_ratio, cfg.layout, index_k_host_bytes_per_entry=cfg.index_k_host_bytes_per_entry,
                index_k_partial_pages=cfg.index_k_partial_pages)
        if cfg.model == "dsa":
            dev = DSATokenToKVPool(cfg.device_tokens, cfg.page_size, cfg.layers)
            return dev, HostPoolGroup.for_dsa(dev, cfg.hicache_ratio, cfg.hicache_size, cfg.layout)
        dev = MLATokenToKVPool(cfg.device_tokens, cfg.page_size, cfg.layers, kv_lora_rank=cfg.kv_lora_rank,
                               qk_rope_head_dim=cfg.qk_rope_head_dim, itemsize=cfg.itemsize)
        return dev, MLATokenToKVPoolHost(dev, cfg.hicache_ratio, cfg.hicache_size, cfg.page_size, cfg.layout)

    def _tree(self, cfg: SessionConfig):
        from sim.cache.hiradix import HiRadixCache
        from sim.cache.records import CacheInitParams

        return HiRadixCache(CacheInitParams(page_size=cfg.page_size, req_to_token_pool=self.req_to_token_pool,
                                            eviction_policy=cfg.eviction_policy, is_eagle=cfg.is_eagle),
                            self.controller,
                            load_back_threshold=cfg.load_back_threshold,
                            host_lock_during_load=cfg.host_lock_during_load)

    # ---------------------------------------------------------------- time
    @property
    def now(self) -> float:
        """Simulated time (us)."""
        return self.env.now

    def _open(self) -> None:
        if self._result is not None:
            raise SessionClosed("the session's run is finished (finish() was called); start a new CacheSession")

    def _block(self, ev) -> None:
        """The host blocks on ``ev`` (a pending event of its last op) until it completes."""
        self.env.run(until=ev)

    def settle(self) -> None:
        """Complete the controller's pending blocking steps (``controller.settle()``)."""
        self._open()
        for ev in self.controller.settle():
            self._block(ev)

    def call(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` as the scheduler host, then settle; returns its result.
        A generator function is driven as a host program: each SimPy event it yields (from
        ``session.host``'s ``delay``/``synchronize`` or ``controller.settle()``) is waited
        for, and its return value is the result."""
        self._open()
        try:
            out = fn(*args, **kwargs)
            if inspect.isgenerator(out):
                gen, value = out, None
                try:
                    while True:
                        self._block(gen.send(value))
                        value = None
                except StopIteration as stop:
                    out = stop.value
        finally:
            # NOTE: also when fn raised: in SGLang the blocking steps queued before the
            # exception (a direct-backend backup's index .cpu()) had already run by then.
            self.settle()
        return out

    def advance(self, us: float) -> None:
        """The scheduler does host work for ``us`` microseconds (a ``host_delay``; one longer
        than a host delay may last, ``MAX_DURATION_US``, is recorded as several)."""
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not math.isfinite(us) or us < 0:
            raise InputError("us", f"expected a finite number of microseconds >= 0, got {show(us)}")
        self._open()
        self.settle()
        # NOTE: an engine's idle stretch (a long think time, a slow Poisson arrival) can outlast one
        # delay; split, the record stays a valid schedule and its time the same
        while us > MAX_DURATION_US:
            self._block(self.host.delay(MAX_DURATION_US))
            us -= MAX_DURATION_US
        self._block(self.host.delay(us))

    def synchronize(self, *, event: str | None = None, stream: str | None = None) -> None:
        """The scheduler blocks until ``event``'s record or every op issued so far on
        ``stream`` has completed (a recorded ``host_sync``; neither given: :meth:`wait_idle`)."""
        self._open()
        self.settle()
        for ev in self.host.sync_steps(event=event, stream=stream):
            self._block(ev)

    def wait_idle(self) -> None:
        """Device synchronize: block until every op issued so far has completed."""
        self._open()
        self.settle()
        self._block(self.host.synchronize())

    # ---------------------------------------------------------------- pools
    @property
    def ranks(self) -> int:
        """TP ranks simulated in lockstep (``config.ranks``)."""
        return self.config.ranks

    @property
    def roles(self) -> dict[str, str]:
        """Device buffer name -> its pool role (``device_pool.role_of``: ``latent``,
        ``index_k``, ``swa``, ``c4``, ``c128``), in declaration order."""
        return {name: self.device_pool.role_of(name) for name in self.device_pool.layouts}

    def entries_of(self, buffer: str, token_slots) -> np.ndarray:
        """The entries of device ``buffer``'s layout that hold the KV of the full pool's
        ``token_slots`` (``device_pool.entries_of``): what a kernel reading those tokens
        reads, to pass to ``layout.token_extents``.  Latent, DSA index-K and V4 SWA: the
        slots themselves; V4 C4 / C4 indexer / C128: ``slot // r`` of each slot that
        completes its group of ``r`` = 4 / 4 / 128 raw tokens."""
        return self.device_pool.entries_of(buffer, token_slots)

    def model_layers_of(self, buffer: str) -> list[int]:
        """The model layers owning a slice of device ``buffer``, in its pool-layer order
        (a V4 C4 buffer's layer k is model layer ``model_layers_of(buf)[k]``)."""
        return self.device_pool.model_layers_of(buffer)

    @property
    def branches(self) -> dict[str, dict[str, int]]:
        """Per device pool role, per copy routine, the copy ops the controller has issued
        (``controller.branches``; ``sim.cache.controller.ROUTINE_BRANCHES`` tells page from
        token granular and kernel from direct)."""
        return self.controller.branches

    # ---------------------------------------------------------------- device work
    def _kv_buffers(self) -> list[str]:
        return list(self.device_pool.layouts)

    def store_kv(self, device_indices, owner: int, *, layers=None, version: int = 1, stream: str = "forward",
                 sync: bool = True, ranks=None, roles=None) -> list[str]:
        """The forward pass writes request ``owner``'s KV into ``device_indices``: per device
        buffer of the pool, one ``write`` op of every model layer (``layers``: default all)
        that owns a slice of it (a ``layers`` write; one layer: a ``layer`` write), on
        ``stream``.  A buffer's units are the entries :meth:`entries_of` gives; a buffer whose
        unit is a page (DSA index-K, every V4 buffer) gets each touched page (no op where the
        slots complete no entry).

        NOTE: SGLang launches one store kernel per layer and pool (inside each layer's
        attention); the bytes are those of one ``write`` per layer in layer order (nothing runs
        between them on the stream: ``tests/test_write_layers.py``), and the launches merged
        away are issued as one ``compute`` of that many ``kernel_launch_us`` after the writes,
        so the stream is busy as long as with per-layer writes.  One op per buffer instead of
        one per layer and buffer is most of a batch's ops (issue 9's speed).

        ``sync`` (default): the scheduler then waits for ``stream`` (a recorded
        ``host_sync``), as SGLang's scheduler waits for a batch's results
        (``copy_done.synchronize()`` in overlap mode) before it inserts the request into
        the tree, so a backup started by that insert reads the written KV.  ``sync=False``
        leaves the backup unordered after these writes (the D2H source race of SGLang
        PR #20611's report).  ``ranks`` (default every simulated rank): the ranks whose
        buffers are written (each its own write ops, on its own ``stream``).  ``roles`` (default
        every buffer): the pool roles written (:attr:`roles`' values; a PD transfer that leaves
        a pool out).  Returns rank 0's op ids of the writes (the first listed rank's)."""
        self._open()
        self.settle()
        idx = np.asarray(device_indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            raise InputError("device_indices", "expected at least one device slot")
        dp = self.device_pool
        start = dp.start_layer
        wanted = range(start, start + dp.layer_num) if layers is None else [start + int(x) for x in layers]
        if roles is not None:
            unknown = sorted(set(roles) - set(self.roles.values()))
            if unknown:
                raise InputError("roles", f"expected pool roles of this device pool {sorted(self.roles.values())}, "
                                 f"got {unknown}")
        ids = []
        merged = 0
        for name, lay in dp.layouts.items():
            if roles is not None and dp.role_of(name) not in roles:
                continue
            ent = dp.entries_of(name, idx)
            units = ent if lay.entries_per_page == 1 else unique_sorted(ent // lay.entries_per_page)
            if units.size == 0:
                continue
            pool_layer = {m: k for k, m in enumerate(dp.model_layers_of(name))}
            pls = [pool_layer[layer] for layer in wanted if layer in pool_layer]
            if not pls:
                continue
            op = {"op": "write", "stream": stream, "buffer": name, "units": units.tolist(),
                  "owner": int(owner), "version": int(version)}
            if len(pls) == 1:
                op["layer"] = pls[0]
            else:
                op["layers"] = pls
                merged += len(pls) - 1
            ids.append(self.host.issue(op, ranks=ranks))
        if merged:
            self.host.issue({"op": "compute", "stream": stream, "jitter": False,
                             "duration_us": merged * self.host.profile.kernel_launch_us}, ranks=ranks)
        if sync:
            for ev in self.host.sync_steps(stream=stream):
                self._block(ev)
        return ids

    def read(self, buffer: str, layer: int, units, *, stream: str = "forward", gate: int | None = None,
             id: str | None = None) -> str:
        """A kernel on ``stream`` reads ``units`` of ``buffer`` at ``layer`` (the buffer's own
        layer: for a V4 C4/C128 buffer its compress layer id); with ``gate`` (a producer slot
        from ``start_loading``), first ``set_consumer(gate)`` and ``wait_until`` of the model
        layer owning that slice (:meth:`model_layers_of`) on ``stream`` (the gated accessor).
        Returns the read's op id."""
        self._open()
        self.settle()
        if gate is not None:
            counter = self.controller.layer_done_counter
            counter.set_consumer(gate)
            model_layer = self.device_pool.model_layers_of(buffer)[int(layer)]
            counter.wait_until(model_layer - self.device_pool.start_layer, stream)
        op = {"op": "read", "stream": stream, "buffer": buffer, "layer": int(layer),
              "units": np.asarray(units, dtype=np.int64).reshape(-1).tolist()}
        if id is not None:
            op["id"] = id
        return self.host.issue(op)

    # ---------------------------------------------------------------- bytes
    @property
    def memory(self):
        """The run's :class:`sim.memory.Memory` now (every copy item landed so far applied;
        an item still in flight is not shown)."""
        self._ex._advance(self.env.now)
        return self._ex.run_memory()

    @property
    def memory_held(self):
        """The :class:`sim.memory.Memory` the run holds now, built from nothing: :attr:`memory`,
        or while the executor defers it (``sim.deferred``: nothing has raced) the
        happens-before-order reference; asking for :attr:`memory` then builds the run's and
        ends the deferral."""
        return self._ex.memory_held()

    def buffer_contents(self, buffer: str):
        """The :class:`~sim.bytes.compact.CompactBuffer` of ``buffer`` in the run's memory as
        it stands (the items the executor has applied; :attr:`memory` first applies those
        landed by now).  Inside a read sink (:meth:`set_read_sink`) it holds what the read
        saw unless the done part of a copy item mid-flight lay in its bytes (``capture.torn``)."""
        return self._ex.contents(buffer)

    def bytes_of(self, buffer: str, layer: int, units) -> list[list[dict]]:
        """Per unit (token row or page) of ``buffer`` at ``layer``: whose bytes it holds
        now, as :func:`sim.bytes.describe.describe` runs (``origin``: kind, layer, owner =
        request, version; ``first_unit``/``last_unit``: which of that origin's units)."""
        mem = self.memory
        if buffer not in mem.specs:
            raise InputError("buffer", f"unknown buffer {show(buffer)}; expected one of {show(sorted(mem.specs))}")
        lay = mem.specs[buffer].layout
        units = np.asarray(units, dtype=np.int64).reshape(-1)
        offs = lay.unit_offsets(int(layer), units)
        return [describe(mem.compact[buffer], int(o), lay.unit_bytes) for o in offs]

    def owners_of(self, buffer: str, layer: int, units) -> list[int | None]:
        """Per unit: the request (origin owner) whose bytes fill it wholly, or None when it
        holds bytes of several origins (torn, partly overwritten).  -1: initial contents."""
        out = []
        for runs in self.bytes_of(buffer, layer, units):
            owners = {r["origin"]["owner"] for r in runs if r["origin"] is not None}
            out.append(owners.pop() if len(runs) == 1 and len(owners) == 1 else None)
        return out

    # ---------------------------------------------------------------- the record
    def record(self) -> dict:
        """The ops issued so far, in issue order, as a format 2 schedule document (a
        ``keep="all"`` session only: a ``keep="report"`` one keeps no ops)."""
        if self.config.keep != "all":
            raise InputError("config.keep", "this session keeps its verdicts only (keep='report'), not the ops it "
                             "issued; expected keep='all' to read its recorded schedule")
        return self._ex.builder.schedule().to_json()

    def set_read_sink(self, sink, *, digests: bool = True) -> None:
        """``keep="report"`` only: hand each read to ``sink(capture, expected_views, entry)``
        when the run captures it, instead of keeping its entry: ``capture`` is the read's
        :class:`~sim.executor.ReadCapture` (the views it saw), ``expected_views`` the same
        read's views in happens-before order, ``entry`` its verdict entry
        (``sim.verdicts.read_entry`` without detail: ``status`` ok, stale, torn or
        indeterminate).  Nothing of the read is kept after the call, so a run's memory does
        not grow with its reads; the finished run's ``analyse`` then lists no reads (the sink
        had them).  ``digests=False``: the entries leave out the views' provenance digests
        (``OnlineVerdicts.on_read``), for a sink that uses the status only.  Set it before the
        first read is issued."""
        if self.config.keep != "report":
            raise InputError("config.keep", "expected keep='report' for a read sink (a keep='all' session keeps "
                             "every read in its RunResult)")
        if self._sink is not None:
            raise KvraceError("this session has a read sink already")
        self._ex.online.on_read(sink, digests=digests)
        self._sink = sink

    def watch_writes(self, callback, buffers=None) -> None:
        """Call ``callback(buffer, offsets, lengths)`` (int64 arrays) right after each
        mutation of the run's memory (:attr:`memory`) in one of ``buffers`` (default: any): a
        ``write`` op applied, or a copy's landed items applied to its destination;
        ``[offsets, offsets + lengths)`` covers every byte it wrote (``Memory.watch``: a
        copy's whole extents, an over-approximation where part of an extent lies past the
        destination's end).  What a memory's bytes are can change only there, so a watcher
        that forgets what it derived from the bytes it is told about never holds a stale
        conclusion (the KV oracle's remembered verdicts, ``sim.engine.oracle``).  Other
        memories (the happens-before-order one) are not watched."""
        self._open()
        self._ex.mem.watch(callback, buffers)

    def finish(self) -> RunResult:
        """Let every issued op complete (as a static run ends) and return the run; its
        ``recorded`` document re-runs statically to the same Snapshot (``keep="all"``; a
        ``keep="report"`` run carries its online verdicts, ``RunResult.online``, and the
        recorded schedule's digest instead).  The session takes no further calls."""
        if self._result is None:
            self.settle()
            self.env.run()
            ex = self._ex
            s = ex.builder.finish().schedule()
            report = ex.online is not None
            self._result = RunResult(schedule=s, profile=ex.p, memory=ex.run_memory(), reads=ex.reads, timings=ex.timings,
                                     tie_orders=ex.tie_orders, oob=ex.oob, end_us=self.env.now,
                                     item_end_us=ex.item_end_us, access_us=ex.access_us,
                                     access_seq=ex.access_seq, torn=ex.torn, unbound=list(s.unbound),
                                     kept=ex.keep, online=ex.online,
                                     digest=ex.builder.digest() if report else None,
                                     tie_orders_total=ex.tie_orders_total)
        return self._result

    def snapshot(self):
        """The Snapshot of the finished run (:meth:`finish`)."""
        from sim.snapshot import snapshot_of

        return snapshot_of(self.finish())
