"""SGLang 0.5.14's own ``HiRadixCache``, built and run on a CPU-only machine.

Everything that keeps books runs as shipped: ``RadixCache`` / ``HiRadixCache``
(``mem_cache/radix_cache.py``, ``mem_cache/hiradix_cache.py``), ``HiCacheController``
(``managers/cache_controller.py``: queues, merging, ``move_indices``, the layer-done counter
and its producer-slot assert, the ack queues), the device allocators
(``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` on device ``"cpu"``), the
device pool (``MLATokenToKVPool`` on ``"cpu"``) and the host pool
(``MLATokenToKVPoolHost``: its sizing and its ``free_slots`` free list).

Stood in (each one a module attribute or instance attribute replaced by
:func:`install_stand_ins` / :class:`SGLangSide`, nothing else touched):

1. ``cache_controller.device_module`` and ``hybrid_cache_controller.device_module``
   (``torch.cuda`` on a GPU machine) ->
   :class:`CpuDeviceModule`: ``Event`` / ``Stream`` / ``stream(...)`` / ``current_stream()``.
   A :class:`StandInEvent` is complete until it is recorded, pending after ``record()``,
   and complete again when the driver says so (:meth:`CpuDeviceModule.complete_through`) or
   when the host ``synchronize()``\\ s it (the host blocks until the GPU got there; every
   event recorded earlier on the same stream completes with it, as on a CUDA stream).
   ``query()`` reads that state.  This is how both sides of the differential test are
   stepped identically: a transfer completes when the driver completes it.
2. ``pool_host.common._cuda_host_register`` (``cudaHostRegister`` of the host buffer) ->
   no-op: pinning changes no bookkeeping and needs a driver.
3. The copy kernels: the host pool instance's ``load_to_device_per_layer`` and
   ``backup_from_device_all_layer`` -> recorders that log (host indices, device indices,
   layer) and move no bytes (the comparison is about bookkeeping; the bytes are kvrace's
   executor's business).
4. ``time.monotonic`` as seen by ``radix_cache`` and ``hiradix_cache`` (last-access and
   creation times) -> a logical clock 1, 2, 3, ... (kvrace's tree reads a logical clock
   too), so eviction order is deterministic; ``time.perf_counter`` (metrics only) is kept.
5. torch.distributed: not stood in; a real one-rank ``gloo`` group over an in-process
   ``HashStore`` is initialised, since ``HiRadixCache.__init__`` asks the TP group's world
   size.  With one rank SGLang's all-reduces are skipped by its own code.
6. The global server arguments (``server_args.get_global_server_args()``, set by SGLang's
   scheduler at start-up), which ``Req.pop_committed_kv_cache`` reads for
   ``strip_thinking_cache``: a namespace with ``strip_thinking_cache=False`` (SGLang's
   default), installed only when none is set.

Not stood in: the paged allocator's Triton kernels (``alloc_extend_kernel``,
``alloc_decode_kernel``) run as shipped, in Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``, set before SGLang is imported); SGLang's ``Req`` and
``ReqToTokenPool`` (on ``"cpu"``) are its own.

Server arguments are a plain namespace with the ``hicache_*`` fields ``HiRadixCache``
reads (no storage backend, no metrics); the eviction policy is ``DiffConfig.eviction_policy``.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import types
from dataclasses import dataclass
from typing import Optional

__all__ = ["CpuDeviceModule", "StandInEvent", "SGLangSide", "DiffConfig", "device_tokens_for", "sglang_available",
           "install_stand_ins", "LogicalMonotonic", "wrap_paged"]


# NOTE: the paged allocator's Triton kernels run in Triton's interpreter here (no GPU); the
# variable is read when a kernel is first launched, so it is set before anything imports SGLang
os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class DiffConfig:
    """One differential run's cache configuration (shared by both sides).  ``model``:
    ``"mla"`` (``MLATokenToKVPool``) or ``"dsa"`` (``DSATokenToKVPool``: fp8 latent plus the
    index-K sidecar, page size 64; SGLang then builds a ``HostPoolGroup`` and a
    ``HybridCacheController``)."""

    model: str = "mla"
    page_size: int = 1
    device_tokens: int = 48
    layers: int = 2
    hicache_ratio: float = 2.0
    layout: str = "layer_first"
    io_backend: str = "kernel"
    write_policy: str = "write_through"
    kv_lora_rank: int = 16
    qk_rope_head_dim: int = 8
    need_sort: bool = False
    eviction_policy: str = "lru"
    #: False: the plain ``RadixCache`` (HiCache off: no host pool, no controller), driven by
    #: ``ops.generate_radix``; the ``hicache_*``, layout and write-policy fields are then unused
    hicache: bool = True
    #: EAGLE's bigram keys (``CacheInitParams.is_eagle``)
    is_eagle: bool = False
    #: rows of the request-to-token table (``ReqToTokenPool``; the request ops' requests)
    req_rows: int = 4

    def describe(self) -> str:
        if not self.hicache:
            return (f"radix {self.model} page_size={self.page_size} device_tokens={self.device_tokens}"
                    + (" eagle" if self.is_eagle else "") + (" need_sort" if self.need_sort else "")
                    + (f" evict={self.eviction_policy}" if self.eviction_policy != "lru" else ""))
        return (f"{self.model} page_size={self.page_size} device_tokens={self.device_tokens} layers={self.layers} "
                f"ratio={self.hicache_ratio} {self.layout}/{self.io_backend} {self.write_policy}"
                + (" eagle" if self.is_eagle else "") + (" need_sort" if self.need_sort else "")
                + (f" evict={self.eviction_policy}" if self.eviction_policy != "lru" else ""))


def device_tokens_for(page_size: int) -> int:
    """The device pool of a sweep's configuration: 48 tokens at page 1, else 8 pages (the
    generators' sequences reach about half of it, so inserts and load-backs evict)."""
    return 48 if page_size == 1 else 8 * page_size


def sglang_available() -> tuple[bool, str]:
    """(True, "") when torch and SGLang's HiRadixCache import here, else (False, why)."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return False, f"torch does not import ({type(e).__name__}: {e}); see tests/differential/README.md"
    try:
        import sglang.srt.mem_cache.hiradix_cache  # noqa: F401
        from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return False, (f"SGLang 0.5.14 does not import ({type(e).__name__}: {e}); "
                       "see tests/differential/README.md")
    return True, ""


# ---------------------------------------------------------------- stand-ins

class StandInEvent:
    """A CUDA event whose completion the driver decides (see the module doc, item 1)."""

    _seq = itertools.count(1)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.done = True          # cudaEventQuery of a never-recorded event: complete
        self.stream = None
        self.seq = 0
        self.records = 0

    def record(self, stream=None):
        mod = CpuDeviceModule.active
        self.stream = stream if stream is not None else mod.current_stream()
        self.seq = next(StandInEvent._seq)
        self.done = False
        self.records += 1
        mod.recorded.append(self)

    def wait(self, stream=None):
        # a GPU-side wait orders device work only; no bookkeeping depends on it
        return None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        # the host blocks until the device reached this record
        CpuDeviceModule.active.complete_through(self)

    def __repr__(self) -> str:
        return f"StandInEvent(seq={self.seq}, {'done' if self.done else 'pending'})"


class StandInStream:
    """A CUDA stream handle: a name only."""

    def __init__(self, name: str = "stream", **_):
        self.name = name

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        CpuDeviceModule.active.complete_stream(self)

    def __repr__(self) -> str:
        return f"StandInStream({self.name})"


class CpuDeviceModule:
    """The stand-in for ``torch.cuda`` as ``cache_controller.device_module``."""

    active: "CpuDeviceModule" = None

    Event = StandInEvent

    def __init__(self):
        self.default = StandInStream("default")
        self._current = self.default
        self.recorded: list[StandInEvent] = []
        self._names = itertools.count()

    def Stream(self, *args, **kwargs):  # noqa: N802 - torch's name
        return StandInStream(f"stream{next(self._names)}")

    def current_stream(self, device=None):
        return self._current

    @contextlib.contextmanager
    def stream(self, s):
        prev, self._current = self._current, s
        try:
            yield s
        finally:
            self._current = prev

    def complete_through(self, event: StandInEvent) -> None:
        """Complete ``event`` and every event recorded before it on the same stream."""
        if event.done:
            return
        for ev in self.recorded:
            if ev.stream is event.stream and ev.seq <= event.seq:
                ev.done = True
        self.recorded = [ev for ev in self.recorded if not ev.done]

    def complete_stream(self, stream) -> None:
        for ev in self.recorded:
            if ev.stream is stream:
                ev.done = True
        self.recorded = [ev for ev in self.recorded if not ev.done]

    def complete_all(self) -> None:
        for ev in self.recorded:
            ev.done = True
        self.recorded = []


class LogicalMonotonic:
    """``time`` as seen by the radix modules: ``monotonic()`` ticks 1, 2, 3, ...;
    ``perf_counter`` and everything else pass through to the real module."""

    def __init__(self, real_time):
        self._real = real_time
        self.now = 0

    def monotonic(self) -> float:
        self.now += 1
        return float(self.now)

    def __getattr__(self, name):
        return getattr(self._real, name)


_installed: dict = {}


def install_stand_ins() -> None:
    """Install the stand-ins of the module doc (idempotent)."""
    if _installed:
        return
    import time

    import torch
    import torch.distributed as dist
    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache import hiradix_cache, radix_cache
    from sglang.srt.mem_cache.pool_host import common as host_common

    mod = CpuDeviceModule()
    CpuDeviceModule.active = mod
    _installed["device_module"] = cache_controller.device_module
    cache_controller.device_module = mod
    # the DSA path's HybridCacheController reads its own module-level device_module
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller

    hybrid_cache_controller.device_module = mod
    _installed["host_register"] = host_common._cuda_host_register
    host_common._cuda_host_register = lambda buffer: None
    clock = LogicalMonotonic(time)
    _installed["clock"] = clock
    radix_cache.time = clock
    hiradix_cache.time = clock
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from sglang.srt import server_args

    if server_args._global_server_args is None:          # stand-in 6
        server_args._global_server_args = types.SimpleNamespace(strip_thinking_cache=False)
    _installed["torch"] = torch


def _to_list(t) -> list[int] | None:
    # NOTE: None is recorded as None, so the recorder never fails where the real call would
    # not (the call itself then fails as SGLang's does: FINDINGS.md F3)
    return None if t is None else [int(x) for x in t.tolist()]


def wrap_paged(allocator, moves: list, to_list) -> None:
    """Record the slots a paged allocator's ``alloc_extend`` / ``alloc_decode`` hand out (as
    ``device_alloc`` moves), on either side."""
    for name in ("alloc_extend", "alloc_decode"):
        fn = getattr(allocator, name, None)
        if fn is None or allocator.page_size == 1:
            continue

        def rec(*args, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            if out is not None:
                moves.append(("device_alloc", to_list(out)))
            return out
        setattr(allocator, name, rec)


# ---------------------------------------------------------------- the side

class SGLangSide:
    """SGLang's HiRadixCache with the stand-ins, plus recorders of the slots each call moves.

    ``cache`` (the real ``HiRadixCache``; the real ``RadixCache`` when ``cfg.hicache`` is
    False, with ``controller`` and ``host_pool`` None), ``controller``, ``allocator``, ``host_pool``;
    ``moves``: the current op's (what, list of ints) records (device/host alloc/free, write/
    load copies), taken and cleared by :meth:`take_moves`."""

    name = "sglang"

    def __init__(self, cfg: DiffConfig):
        install_stand_ins()
        import torch
        from sglang.srt.managers import cache_controller as cc_mod
        from sglang.srt.mem_cache import base_prefix_cache as bpc
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

        self.torch = torch
        self.cfg = cfg
        self.devmod = CpuDeviceModule.active
        self.clock = _installed["clock"]
        self.clock.now = 0
        TreeNode.counter = 0
        cc_mod.CacheOperation.counter = 0
        self.records = bpc
        self.RadixKey = RadixKey
        if cfg.model == "dsa":
            from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

            # the fp8 latent (512 nope + 4 x 4 B scales + 64 x 2 B rope = 656 B) and the
            # index-K pages, as SGLang sizes them for DeepSeek V3.2
            dtype = torch.float8_e4m3fn
            self.device_pool = DSATokenToKVPool(cfg.device_tokens, cfg.page_size, 512, dtype, 64, cfg.layers,
                                                "cpu", 128, False, 656)
        else:
            dtype = torch.bfloat16
            self.device_pool = MLATokenToKVPool(cfg.device_tokens, cfg.page_size, dtype, cfg.kv_lora_rank,
                                                cfg.qk_rope_head_dim, cfg.layers, "cpu", False)
        if cfg.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(cfg.device_tokens, dtype, "cpu", self.device_pool,
                                                    cfg.need_sort)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(cfg.device_tokens, cfg.page_size, dtype, "cpu",
                                                         self.device_pool, cfg.need_sort)
        import torch.distributed as dist
        self.req_pool = ReqToTokenPool(cfg.req_rows, cfg.device_tokens, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=cfg.page_size,
                                 tp_cache_group=dist.group.WORLD, eviction_policy=cfg.eviction_policy,
                                 enable_metrics=False, enable_kv_cache_events=False, is_eagle=cfg.is_eagle)
        self.moves: list = []
        if not cfg.hicache:
            # HiCache off: the scheduler's tree is the plain RadixCache over the same allocator
            self.cache = RadixCache(params)
            self.controller = self.host_pool = None
            self._wrap()
            return
        server_args = types.SimpleNamespace(
            hicache_ratio=cfg.hicache_ratio, hicache_size=0, hicache_mem_layout=cfg.layout,
            hicache_storage_backend=None, hicache_storage_backend_extra_config=None,
            hicache_storage_prefetch_policy="best_effort", hicache_write_policy=cfg.write_policy,
            hicache_io_backend=cfg.io_backend, served_model_name="differential", extra_metric_labels=None)
        self.cache = HiRadixCache(params, server_args)
        self.controller = self.cache.cache_controller
        self.host_pool = self.cache.token_to_kv_pool_host
        self._wrap()

    # -------------------------------------------------------------- recorders
    def _wrap(self) -> None:
        moves = self.moves
        alloc, free = self.allocator.alloc, self.allocator.free

        def dev_alloc(need_size):
            out = alloc(need_size)
            if out is not None:
                moves.append(("device_alloc", _to_list(out)))
            return out

        def dev_free(indices):
            moves.append(("device_free", _to_list(indices)))
            return free(indices)

        self.allocator.alloc = dev_alloc
        self.allocator.free = dev_free
        wrap_paged(self.allocator, moves, _to_list)
        if self.host_pool is None:
            return
        halloc, hfree = self.host_pool.alloc, self.host_pool.free

        def host_alloc(need_size):
            out = halloc(need_size)
            if out is not None:
                moves.append(("host_alloc", _to_list(out)))
            return out

        def host_free(indices):
            moves.append(("host_free", _to_list(indices)))
            return hfree(indices)

        # NOTE: the anchor's indices only (a HostPoolGroup's sidecars take theirs from it)
        def backup(device_pool, host_indices, device_indices, io_backend, **_pool_transfers):
            moves.append(("write_copy", _to_list(host_indices), _to_list(device_indices)))

        def load(device_pool, host_indices, device_indices, layer_id, io_backend, **_pool_transfers):
            if layer_id == 0:
                moves.append(("load_copy", _to_list(host_indices), _to_list(device_indices)))

        self.host_pool.alloc = host_alloc
        self.host_pool.free = host_free
        # stand-in 3: the copy kernels
        self.host_pool.backup_from_device_all_layer = backup
        self.host_pool.load_to_device_per_layer = load

    def take_moves(self) -> list:
        out = list(self.moves)
        self.moves.clear()
        return out

    # -------------------------------------------------------------- adapters
    def key(self, tokens, extra_key=None, is_bigram: bool = False):
        from array import array

        return self.RadixKey(array("q", [int(t) for t in tokens]), extra_key, is_bigram=is_bigram)

    @staticmethod
    def new_req(rid: str, tokens, extra_key=None, priority=None):
        """SGLang's own ``Req`` (default sampling parameters)."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", [int(t) for t in tokens]), SamplingParams(), extra_key=extra_key,
                   priority=priority)

    def init_round(self, req) -> None:
        req.init_next_round_input(self.cache)

    def ints(self, values):
        return self.torch.tensor(values, dtype=self.torch.int64)

    def cat(self, a, b):
        return self.torch.cat([a, b])

    @staticmethod
    def as_list(t) -> Optional[list[int]]:
        return None if t is None else _to_list(t) if hasattr(t, "tolist") else [int(x) for x in t]

    def root(self):
        return self.cache.root_node

    def cache_obj(self):
        return self.cache

    def allocator_obj(self):
        return self.allocator

    def host_obj(self):
        if self.host_pool is None:
            return None
        group = getattr(self.host_pool, "anchor_entry", None)
        return self.host_pool if group is None else group.host_pool

    @staticmethod
    def event_done(event) -> bool:
        return bool(event.query())

    @staticmethod
    def token_list(key) -> list[int]:
        # NOTE: the raw tokens (a bigram key's N units are N + 1 of them; ``limit`` cuts them)
        return [int(t) for t in key.raw_token_ids()]

    # -------------------------------------------------------------- transfers
    def ack_events(self, queue: str) -> list:
        q = self.controller.ack_write_queue if queue == "write" else self.controller.ack_load_queue
        return [ack[1] for ack in q]

    def ack_done(self, queue: str) -> list[bool]:
        return [bool(ev.query()) for ev in self.ack_events(queue)]

    def slot_done(self) -> list[bool]:
        return [bool(e.finish_event.query()) for e in self.controller.layer_done_counter.events]

    def complete_acks(self, queue: str, count: int) -> None:
        """Complete the oldest ``count`` acks of ``queue`` ("write"/"load")."""
        events = self.ack_events(queue)[:count]
        for ev in events:
            self.devmod.complete_through(ev)

    def mirror(self, write_done: list[bool], load_done: list[bool], slots_done: list[bool]) -> None:
        """Make this side's transfer completion equal to the other side's (by ack position
        and producer slot); never un-completes anything."""
        for ev, d in zip(self.ack_events("write"), write_done):
            if d:
                self.devmod.complete_through(ev)
        for ev, d in zip(self.ack_events("load"), load_done):
            if d:
                self.devmod.complete_through(ev)
        for e, d in zip(self.controller.layer_done_counter.events, slots_done):
            if d:
                self.devmod.complete_through(e.finish_event)

    def complete_all(self) -> None:
        self.devmod.complete_all()
