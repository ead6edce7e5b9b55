"""The PD decode engine at byte level: its pools on a second CacheSession, with or without HiCache.

:class:`DecodeCacheEngine` replaces :class:`~sim.engine.decode.DecodeEngine` (simulated time
only) in PD mode when ``hicache.decode = true`` (with its tree), ``deployment.decode_bytes =
true`` (without: SGLang's default decode server, any model family, compressed pools included)
or the configuration's ``transfer_pools`` leaves a pool out (the transfer lands only those;
docs/engine.md, "The PD decode side at byte level").  It keeps the same timing model (a step's
duration is :class:`~sim.engine.decode.DecodeStepModel`'s, a transfer's is
``transfer_us``) and adds what the decode engine does to bytes, as SGLang 0.5.14's decode
server does it (docs/engine.md, "Decode-side HiCache in SGLang 0.5.14"):

* **pre-allocation** (``DecodePreallocQueue.pop_preallocated``), in arrival order, stopping at
  the first request that does not fit: with HiCache, ``match_prefix`` of the request's whole
  input on the decode side's own ``HiRadixCache`` (``_match_prefix_and_lock``: the last
  device node locked); ``l1`` device-hit tokens, ``l2`` host-hit tokens,
  ``decode_prefix_len = l1 + l2`` (no L3 storage in the model).  Device slots for the rest of
  the sequence (``[decode_prefix_len, input + output)``, whole pages) are allocated now, after
  evicting from the decode tree when short; the ``l2`` tokens are reserved for the load-back.
  The PD transfer then starts and moves only ``input - decode_prefix_len`` tokens' KV.
* **the local restore** (``_process_hicache_local_restores``): at every poll, phase A marks
  a request READY when ``is_load_back_event_done(its producer slot)`` (the host queries the
  load's finish event); phase B, only when the next producer slot is free, re-matches and
  ``init_load_back``\\ s each pending request (its restored node locked); phase C
  ``ready_to_load_host_cache()`` starts the merged H2D on the load stream.  A restore that
  cannot cover ``decode_prefix_len`` (its load-back did not happen: too few host tokens for
  ``load_back_threshold``, or no device room) FAILS: SGLang aborts the request; so does the
  model (counted in ``restores_failed``; the turn ends there).
* **the PD transfer** lands at its end: the KV of ``[decode_prefix_len, input)`` written
  into the request's slots (one write per device buffer covering its layers, on the ``schedule`` stream
  standing for the RDMA engine, then a host sync: the decode scheduler learns of the
  transfer's end by polling, ``KVPoll.Success``).
* **joining**: a request joins the running batch (at most ``max_running``) once its transfer
  has landed and, with HiCache, its restore is READY (``HiCacheRestoreGatedKVReceiver``).  So
  no load into its slots is in flight when its first step reads them; the step waits on no
  layer event (consumer index -1).  With HiCache its input KV then enters the tree
  (``process_prebuilt`` -> ``cache_unfinished_req``: page-aligned insert, write-through
  backup to the host, duplicate slots freed, the lock moved to the new last node).
* **a decode step**: per running request the KV of its newest token (position ``context``)
  written into its slot (one ``store_kv`` for the batch: one write per buffer covering its layers, as
  ``set_kv_buffer``), then ONE read per pool role covering every layer and every running
  request's entries ``0..context`` (the one-step forward of :mod:`sim.engine.forward`: nothing
  loads into these slots during a step), then one compute op of the step's duration; the
  scheduler waits for the forward stream.  Each read is judged as the prefill engine judges
  its reads: the race verdict (stale, torn) and the KV oracle (wrong KV).
* **finishing** (``release_kv_cache`` -> ``cache_finished_req``): with HiCache, the page-aligned
  ``(input + output)[:input + output - 1]`` (the last token's KV is not committed) inserted
  (write-through backup), duplicates and the unaligned tail freed, the node unlocked;
  without HiCache every slot of the request freed.
* **the overlap loop** (``overlap``: ``scheduler.decode_event_loop = "overlap"``, SGLang's
  ``event_loop_overlap_disagg_decode``): step ``k`` is launched (its ``copy_done`` recorded on
  the forward stream) before step ``k - 1``'s result is processed (its ``copy_done`` waited
  for, not the stream); a request step ``k - 1`` finished rides in step ``k`` (its KV stored one
  slot past its output, reserved at pre-allocation; its reads judged but attributed to no
  request) and is released after step ``k``'s launch, while that store may be in flight.  A
  step of this loop is issued layer by layer (each layer's store, its reads, its share of the
  compute), since what lands in a freed page during the step now matters.

NOTE: the decode session's clock follows the decode engine's (the session advances to each
step's start; the step's ops then take the session's time, so the session may run slightly
ahead of the engine clock, never behind it).  Slots for the whole output are allocated at
pre-allocation (SGLang allocates a page as a request's decode crosses one, after reserving
``num_reserved_decode_tokens`` in the admission budget): the same ownership, without the
retraction path.  Decode-side HiCache is refused for DeepSeek V4 (SGLang 0.5.14 refuses the
decode radix cache for hybrid SWA models: ``kv_cache_builder.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from sim.arrays import unique_sorted
from sim.cache.radix import RadixKey
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sim.cache.session import BATCH_EVENT, CacheSession
from sim.engine.decode import DecodeEngine, DecodeStepModel, TransferSize
from sim.engine.engine import PrefillEngine, _Tally
from sim.engine.forward import ReadInfo, coalesce, read_ranges
from sim.engine.oracle import KVOracle
from sim.engine.workload import Request
from sim.errors import InputError, KvraceError

__all__ = ["DecodeCacheEngine", "DecodeReq", "DecodeSideError", "POLL_US", "format_decode_side"]

#: host delay (us) between two polls of a decode engine with nothing running but restores or
#: pre-allocations pending
POLL_US = 50.0


class DecodeSideError(KvraceError, RuntimeError):
    """The decode side cannot go on (a request that can never fit its device pool), or was asked
    for a result before it finished."""


@dataclass
class DecodeReq:
    """One request on the decode side (SGLang's ``DecodeRequest``, reduced).

    ``slots``: device slots of its sequence positions ``0..input + output - 1`` as far as
    known (the matched prefix, then the restored part once restored, then ``delta``);
    ``status``: ``prealloc`` -> ``transfer`` -> ``running``; ``restore``: ``None`` (nothing to
    restore), ``pending``, ``ready`` or ``failed``."""

    req: Request
    arrival_us: float
    order: int
    prefix: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    l2: int = 0
    node: object = None                 # the locked last device node (HiCache)
    delta: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    restored: np.ndarray | None = None
    restored_node: object = None
    consumer: int = -1
    restore: str | None = None
    transfer_end_us: float = 0.0
    landed: bool = False
    context: int = 0                    # positions whose KV is written (the next step writes this one)
    remaining: int = 0

    @property
    def decode_prefix_len(self) -> int:
        return len(self.prefix) + self.l2

    def sequence_slots(self) -> np.ndarray:
        """Device slots of positions ``0..`` (prefix, restored part, then the delta slots)."""
        parts = [self.prefix]
        if self.restored is not None:
            parts.append(self.restored)
        parts.append(self.delta)
        return np.concatenate(parts)


class DecodeCacheEngine(DecodeEngine):
    """The PD decode engine with byte-level pools (module doc).  ``session``: its own
    :class:`CacheSession`: with ``keep="report"`` each read is judged when the run captures it,
    with ``keep="all"`` the whole run is kept and its reads are judged when it finishes (the
    same verdicts; the kept run is what an exported race window is cut from);
    ``hicache``: decode-side HiCache (its tree); ``lookup``: rid -> the :class:`Request` (its
    tokens).  ``finish()`` gives the decode side's metrics (``EngineResult.decode``)."""

    # NOTE: a decode-side read is judged exactly as a prefill read (race verdict, requests hit,
    # index-K top-k, KV oracle): the prefill engine's methods, which use only the attributes
    # set below (session, buffers, oracles, ranks, read_rids, model, _tally); each read is judged
    # at its capture (no sim.engine.layer_reads here), or with keep="all" when the run finishes
    _layer_reads = None
    _on_read = PrefillEngine._on_read
    _judge = PrefillEngine._judge
    _judge_run = PrefillEngine._judge_run
    _tally_read = PrefillEngine._tally_read
    _requests_hit = PrefillEngine._requests_hit
    _topk_changed = PrefillEngine._topk_changed
    _read_bytes = staticmethod(PrefillEngine._read_bytes)

    def __init__(self, steps: DecodeStepModel, *, max_running: int, transfer_gbps: float, transfer: TransferSize,
                 transfer_latency_us: float, session: CacheSession, hicache: bool, lookup, transfer_pools=None,
                 overlap: bool = False):
        super().__init__(steps, max_running=max_running, transfer_gbps=transfer_gbps,
                         transfer=transfer, transfer_latency_us=transfer_latency_us)
        self.session = s = session
        self.keep = session.config.keep
        self.report: dict | None = None          # keep="all": the decode run's verdicts, once finished
        self.hicache = bool(hicache)
        # the overlap loop (scheduler.decode_event_loop): the step launched last, whose result
        # is processed after the next launch (its number, copy_done event and the requests it
        # finished)
        self.overlap = bool(overlap)
        self._launched: tuple[int, str, list] | None = None
        self.run = None                          # the decode session's run, once finished
        if self.overlap and session.config.batch_events < 2:
            raise InputError("session", "expected a session with batch_events >= 2 (the overlap loop's copy_done "
                             f"events), got {session.config.batch_events}")
        self.lookup = lookup
        self.page = s.config.page_size
        self.model = steps.model
        self.buffers = {s.device_pool.role_of(name): (name, lay) for name, lay in s.device_pool.layouts.items()}
        specs = self.model.pools_for(steps.options)
        self.pools = {role: specs[role] for role in self.buffers}
        self.ratios = {role: specs[role].tokens_per_entry for role in self.buffers}
        if self.hicache and any(r != 1 for r in self.ratios.values()):
            raise InputError("model.family", "expected a model whose decode pools hold one entry per token "
                             f"(decode-side HiCache: dsa-v3.2), got ratios {self.ratios}")
        # the pool roles the PD transfer lands (None: every one; the hypotheses' transfer_pools)
        self.transfer_pools = None if transfer_pools is None else frozenset(transfer_pools) & set(self.buffers)
        self.oracle = KVOracle(self.buffers, {n: s.device_pool.kind_of(n) for n, _ in self.buffers.values()},
                               self.ratios)
        self.cache = s.cache
        self.prealloc: list[DecodeReq] = []      # waiting for room, arrival order
        self.transfer: list[DecodeReq] = []      # pre-allocated: transfer (and restore) under way
        self.running: dict[int, DecodeReq] = {}
        self.read_rids: dict[str, tuple] = {}
        self._stores = 0
        self._finished_now: list[int] = []
        self.counts = dict(requests=0, input_tokens=0, reads=0, load_backs=0, load_back_tokens=0, device_hit_tokens=0,
                           host_hit_tokens=0, transfer_tokens=0, restores_failed=0, steps=0, ownership_checks=0,
                           output_tokens_clipped=0)
        self.aborted: list[int] = []
        # NOTE: the decode side is one rank (the prefill's _judge files a read under its rank)
        self.ranks = 1
        self.oracles = [self.oracle]
        self._tally = _Tally(by_rank=[0])
        if self.keep == "report":
            s.set_read_sink(self._on_read, digests=False)
        if self.oracle.incremental:
            s.watch_writes(self.oracle.written, [name for name, _ in self.buffers.values()])

    # ---------------------------------------------------------------- the prefill side's calls
    def admit(self, rid: int, t_us: float, context_tokens: int, output_tokens: int) -> None:
        """Request ``rid``'s prefill ended at ``t_us``: it enters the pre-allocation queue."""
        if output_tokens < 1:
            raise InputError("output_tokens", f"expected >= 1, got {output_tokens}")
        req = self.lookup(rid)
        if req.input_len != context_tokens or req.output_len != output_tokens:
            raise InputError("context_tokens", f"request {rid}: expected its input and output lengths "
                             f"({req.input_len}, {req.output_len}), got {context_tokens}, {output_tokens}")
        out = self.max_new_tokens(req)
        if out != req.output_len:
            req = dataclasses.replace(req, output_len=out)
            self.counts["output_tokens_clipped"] += 1
        self.prealloc.append(DecodeReq(req, float(t_us), self._order))
        self._order += 1
        self.counts["requests"] += 1
        self.counts["input_tokens"] += req.input_len

    def max_new_tokens(self, req: Request) -> int:
        """``req``'s output tokens as the decode server's scheduler caps them when the request
        comes in (``init_req_max_new_tokens``): at most ``max_req_len - input - 1`` (``max_req_len``
        = pool - 1) and ``pool - ceil_page(input) - page - 1``, so that the request fits the
        decode pool with nothing else on it; at least 1 (the prefill's first token came
        already).  NOTE: SGLang clips to 0 at the floor; the engine aborts any input of pool - 6
        tokens or more before its prefill (``PrefillEngine``), so the floor of 1 still fits."""
        pool = self.session.allocator.size_full
        paged = -(-req.input_len // self.page) * self.page
        cap = min(pool - 1 - req.input_len - 1, pool - paged - self.page - 1)
        return max(1, min(req.output_len, cap))

    @property
    def idle(self) -> bool:
        return not self.running and not self.prealloc and not self.transfer

    def next_event_us(self) -> float | None:
        """When the decode side next changes: now while anything runs; else the next arrival
        or transfer end, or one poll (``POLL_US``) ahead while a pre-allocation, a landed
        transfer or a restore is waiting."""
        if self.running:
            return self.now
        cand = [t for t in [d.arrival_us for d in self.prealloc]
                + [d.transfer_end_us for d in self.transfer if not d.landed] if t > self.now]
        if any(d.arrival_us <= self.now for d in self.prealloc) or any(
                d.landed or d.restore == "pending" or d.transfer_end_us <= self.now for d in self.transfer):
            cand.append(self.now + POLL_US)
        return min(cand) if cand else None

    def advance(self, until_us: float) -> list[tuple[int, float]]:
        """Poll and run every step that starts at or before ``until_us``; the requests that
        finished (or were aborted), with their times, in order."""
        out: list[tuple[int, float]] = []
        while True:
            self._sync()
            self._poll()
            out.extend((rid, self.now) for rid in self._finished_now)
            self._finished_now.clear()
            if not self.running:
                nxt = self.next_event_us()
                if nxt is None or nxt > until_us:
                    return out
                self.now = max(self.now, nxt)
                continue
            if self.now > until_us:
                return out
            self.step()
            out.extend((rid, self.now) for rid in self._finished_now)
            self._finished_now.clear()

    # ---------------------------------------------------------------- one poll
    def _sync(self) -> None:
        """The session's clock to the engine's (never back)."""
        s = self.session
        if s.now < self.now:
            s.advance(self.now - s.now)
        self.now = s.now

    def _poll(self) -> None:
        """One scheduler iteration's decode queues: ``check_hicache_events``; pre-allocate;
        land the transfers that have ended; drive the restores; join."""
        if self.hicache:
            self.cache.check_hicache_events()
        while self.prealloc and self.prealloc[0].arrival_us <= self.now:
            if not self._pre_alloc(self.prealloc[0]):
                ctl = self.session.controller
                if not self.running and not self.transfer and not ctl.ack_write_queue and not ctl.ack_load_queue:
                    d = self.prealloc[0]
                    raise DecodeSideError(f"request {d.req.rid} ({d.req.input_len} + {d.req.output_len} tokens) "
                                          f"cannot fit the decode pool ({self.session.allocator.size_full} "
                                          "tokens) even with nothing else on it; raise scheduler.max_total_tokens")
                break
            self.transfer.append(self.prealloc.pop(0))
        for d in self.transfer:
            if not d.landed and d.transfer_end_us <= self.now:
                self._land(d)
        if self.hicache:
            self._process_local_restores()
        for d in list(self.transfer):
            if d.restore == "failed":
                self.transfer.remove(d)
                self._abort(d)
            elif d.landed and d.restore in (None, "ready") and len(self.running) < self.max_running:
                self.transfer.remove(d)
                self._join(d)

    def _ensure(self, need: int) -> bool:
        s = self.session
        if s.allocator.available_size() < need and self.hicache:
            self.cache.evict(EvictParams(need - s.allocator.available_size()))
        return s.allocator.available_size() >= need

    def _pre_alloc(self, d: DecodeReq) -> bool:
        """``_match_prefix_and_lock`` and ``_pre_alloc``: False, holding nothing, when the
        delta and the restore do not fit the pool now."""
        req = d.req
        # NOTE: the overlap loop's ride-along step stores the finished request's KV one slot past its
        # output (SGLang allocates it in that step, alloc_for_decode, and frees it in release_kv_cache)
        n_total = req.input_len + req.output_len + (1 if self.overlap else 0)
        if self.hicache:
            m = self.cache.match_prefix(MatchPrefixParams(RadixKey(req.source.ids(req.session, 0, req.input_len))))
            prefix, l2, node = np.asarray(m.device_indices, np.int64), int(m.host_hit_length), m.last_device_node
            self.cache.inc_lock_ref(node)
        else:
            prefix, l2, node = np.zeros(0, np.int64), 0, None
        total = len(prefix) + l2
        need = -(-(n_total - total) // self.page) * self.page
        # NOTE: the restores not yet queued keep their tokens reserved in the budget
        # (_hicache_pending_restore_tokens), this one's included: their load-backs allocate
        # the slots later, evicting if need be
        reserved = sum(x.l2 for x in self.transfer if x.restore == "pending" and x.restored_node is None)
        if not self._ensure(need + l2 + reserved):
            if node is not None:
                self.cache.dec_lock_ref(node)
            return False
        d.delta = np.asarray(self.session.allocator.alloc(need), np.int64)
        d.prefix, d.l2, d.node = prefix, l2, node
        d.restore = "pending" if l2 > 0 else None
        sent = req.input_len - total
        d.transfer_end_us = self.now + self.transfer_us(req.input_len, total)
        self.transfer_bytes += self.transfer_size.nbytes(total, req.input_len)
        self.counts["device_hit_tokens"] += len(prefix)
        self.counts["host_hit_tokens"] += l2
        self.counts["transfer_tokens"] += sent
        return True

    def _next_store(self) -> int:
        self._stores += 1
        return self._stores

    # NOTE: which unit holds which request's KV, compressed pools included: the prefill's
    _record_kv = PrefillEngine._record_kv

    def _store(self, pairs: list[tuple[DecodeReq, np.ndarray, np.ndarray]], stream: str, roles=None, *,
               layers=None, store: int | None = None) -> int | None:
        """One store (one write per buffer of ``roles``, default every one, of its ``layers``,
        default all) of ``pairs`` = (request, slots, positions), recorded in the KV oracle per
        request; returns its number.  ``store``: a store already recorded, whose writes of
        further layers these are (the overlap loop's step writes one layer at a time)."""
        if roles is not None and not roles:
            return None
        new = store is None
        if new:
            store = self._next_store()
        slots = np.concatenate([p[1] for p in pairs])
        self.session.store_kv(slots, owner=pairs[0][0].req.rid, version=store, stream=stream, sync=False,
                              roles=roles, layers=layers)
        if new:
            for d, sl, pos in pairs:
                self._record_kv(d.req, sl, pos, store, roles)
        return store

    def _land(self, d: DecodeReq) -> None:
        """The PD transfer of ``d`` has ended: its KV ``[decode_prefix_len, input)`` in its
        delta slots, of the pools ``transfer_pools`` names (the host then knows: a sync); a
        sliding-window pool's only from ``PoolSpec.sent_from`` on (SGLang's ``_swa_payload``),
        in a store of its own."""
        n = d.req.input_len - d.decode_prefix_len
        if n > 0:
            roles = set(self.buffers) if self.transfer_pools is None else set(self.transfer_pools)
            win = self.model.dims.window
            by_start: dict[int, list[str]] = {}
            for role in sorted(roles):
                start = max(d.decode_prefix_len, self.pools[role].sent_from(d.req.input_len, win, self.page))
                by_start.setdefault(start, []).append(role)
            for start, group in sorted(by_start.items()):
                k = start - d.decode_prefix_len
                pos = np.arange(start, d.req.input_len, dtype=np.int64)
                if pos.size:
                    self._store([(d, d.delta[k:n], pos)], "schedule", frozenset(group))
            self.session.synchronize(stream="schedule")
        d.landed = True

    # ---------------------------------------------------------------- the local restore
    def _process_local_restores(self) -> None:
        """SGLang's ``_process_hicache_local_restores``: phases A, B, C (module doc)."""
        cache = self.cache
        active = [d for d in self.transfer if d.restore == "pending"]
        for d in active:
            if d.restored_node is not None and cache.is_load_back_event_done(d.consumer):
                d.restore = "ready"
        counter = self.session.controller.layer_done_counter
        if not cache.is_load_back_event_done((counter.producer_index + 1) % counter.num_counters):
            return
        queued = [d for d in active if d.restored_node is None and self._queue_load_back(d)]
        if not queued:
            return
        consumer = cache.ready_to_load_host_cache()
        for d in queued:
            if consumer < 0:
                d.restore = "ready"
            d.consumer = consumer

    def _queue_load_back(self, d: DecodeReq) -> bool:
        """``_try_hicache_queue_load_back``: re-match, ``init_load_back``, lock the restored
        node; True iff a copy was queued."""
        req = d.req
        m = self.cache.match_prefix(MatchPrefixParams(RadixKey(req.source.ids(req.session, 0, req.input_len))))
        new, node = self.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length))
        device = np.asarray(m.device_indices, np.int64)
        new = np.asarray(new, np.int64)
        if len(device) + len(new) < d.decode_prefix_len:
            d.restore = "failed"
            return False
        restored = np.concatenate([device, new])[len(d.prefix):d.decode_prefix_len]
        d.restored, d.restored_node = restored, node
        self.cache.inc_lock_ref(node)
        if len(new) == 0:
            d.restore = "ready"
            return False
        self.counts["load_backs"] += 1
        self.counts["load_back_tokens"] += len(new)
        return True

    # ---------------------------------------------------------------- join, step, finish
    def _join(self, d: DecodeReq) -> None:
        """``_commit_transfer_to_req`` (the restored slots become the request's), then, with
        HiCache, ``process_prebuilt``'s ``cache_unfinished_req``; the request runs."""
        req = d.req
        d.context, d.remaining = req.input_len, req.output_len
        if self.hicache:
            if d.restored is not None:
                # _commit_hicache_local_restore_to_req: the restored node's lock replaces the
                # device node's
                self.cache.dec_lock_ref(d.node)
                d.node, d.restored_node = d.restored_node, None
            self._cache_unfinished(d)
        self.running[req.rid] = d

    def _insert(self, d: DecodeReq, n_tokens: int) -> int:
        """Insert the page-aligned first ``n_tokens`` of ``d``'s sequence with its slots; the
        slots of the part the tree already held (past what ``d`` got from the tree) freed;
        returns the aligned length."""
        req = d.req
        aligned = n_tokens // self.page * self.page
        slots = d.sequence_slots()
        ids = req.source.ids(req.session, 0, aligned)
        res = self.cache.insert(InsertParams(RadixKey(ids), slots[:aligned].copy()))
        # NOTE: the request owns its slots past decode_prefix_len; those before are the tree's
        # (matched, or restored by the load-back)
        dup = slots[d.decode_prefix_len:res.prefix_len]
        if len(dup):
            self.session.allocator.free(dup)
        return aligned

    def _cache_unfinished(self, d: DecodeReq) -> None:
        req = d.req
        aligned = self._insert(d, req.input_len)
        if aligned <= d.decode_prefix_len:
            return
        m = self.cache.match_prefix(MatchPrefixParams(RadixKey(req.source.ids(req.session, 0, aligned))))
        got = np.asarray(m.device_indices, np.int64)
        if len(got) != aligned:
            raise DecodeSideError(f"request {req.rid}: {len(got)} device slots matched right after inserting "
                                  f"{aligned} tokens (cache_unfinished_req)")
        slots = d.sequence_slots()
        self.cache.inc_lock_ref(m.last_device_node)
        self.cache.dec_lock_ref(d.node)
        d.node = m.last_device_node
        d.prefix, d.l2, d.restored = got, 0, None
        d.delta = slots[aligned:]

    def step(self) -> tuple[float, list[int]]:
        """One decode step of the running batch at byte level (module doc); returns its
        duration and the requests it finished (in the overlap loop: the requests the step
        before it finished, released now)."""
        if not self.running:
            raise InputError("decode", "no running request to step")
        if self.overlap:
            return self._step_overlapped()
        s = self.session
        k, dur, ds = self._launch()
        s.synchronize(stream="forward")
        self.now = max(self.now, s.now)
        done = []
        for d in ds:
            d.context += 1
            d.remaining -= 1
            if d.remaining == 0:
                del self.running[d.req.rid]
                self._release(d)
                done.append(d.req.rid)
        self._finished_now.extend(done)
        return dur, done

    def _step_overlapped(self) -> tuple[float, list[int]]:
        """One iteration of SGLang's ``event_loop_overlap_disagg_decode``: launch step ``k`` (the
        running batch, with the requests step ``k - 1`` finished riding along: their result is not
        processed yet, so SGLang does not know they finished), record its ``copy_done``, then
        process step ``k - 1``'s result: wait for its ``copy_done`` (the event: step ``k`` is not
        waited for) and release the requests it finished, whose pages step ``k``'s store may still
        be writing (the NOTE in SGLang's ``process_batch_result_decode``)."""
        s = self.session
        k, dur, ds = self._launch()
        finishing = []
        for d in ds:
            d.context += 1                  # a ride-along's too: its store used the extra slot
            if d.remaining > 0:
                d.remaining -= 1
                if d.remaining == 0:
                    finishing.append(d)
        event = BATCH_EVENT.format(k % 2)
        s.host.issue({"op": "record", "stream": "forward", "event": event, "id": f"dec{k}.copy_done"})
        prev, self._launched = self._launched, (k, event, finishing)
        done = []
        if prev is not None:
            s.synchronize(event=prev[1])
            for d in prev[2]:
                del self.running[d.req.rid]
                self._release(d)
                done.append(d.req.rid)
        self.now = max(self.now, s.now)
        self._finished_now.extend(done)
        return dur, done

    def _launch(self) -> tuple[int, float, list[DecodeReq]]:
        """Issue one decode step of the running batch on the forward stream; returns the step's
        number, its duration and the batch.  The normal loop: the KV store of each request's
        position ``context`` (every layer), one read per pool role (every layer), the compute.
        The overlap loop: layer by layer, as the GPU runs it, that layer's store, its read per
        pool role owning the layer, and its share of the compute.

        NOTE: in the normal loop nothing can land in the batch's slots during a step (each step
        is waited for before anything is freed), so the step's layers are issued together (fewer
        ops, the same bytes); in the overlap loop a page freed after the launch can be written by
        the next request's transfer while the step still runs, and which of its layers' stores
        come after that transfer decides whose KV the page keeps."""
        s = self.session
        ds = list(self.running.values())
        dur = self.steps.step_us([d.context for d in ds], self.step_count)
        k = self.step_count
        self.step_count += 1
        self.busy_us += dur
        self.counts["steps"] += 1
        pairs = []
        for d in ds:
            slots = d.sequence_slots()
            pairs.append((d, slots[d.context:d.context + 1], np.array([d.context], np.int64)))
        self._check_ownership(ds)
        by_layer = self.overlap
        if not by_layer:
            self._store(pairs, "forward")
        store = None
        made_for = {}
        entries = {role: {} for role in self.buffers}
        firsts = {role: {} for role in self.buffers}
        riding = {role: [] for role in self.buffers}
        window = self.model.dims.window
        for d in ds:
            slots = d.sequence_slots()[:d.context + 1]
            # NOTE: a ride-along (the overlap loop: finished, its result not processed yet) is read
            # as SGLang's step reads it, but its token is discarded: the read is judged, no request
            # is made corrupt by what it saw
            ride = d.remaining == 0
            if not ride:
                made_for[d.req.rid] = (d.req, d.context + 1)
            for role, (name, _) in self.buffers.items():
                ent, first = self.pools[role].read_entries(s.entries_of(name, slots), 1, window)
                if ride:
                    riding[role].append(ent)
                    continue
                entries[role][d.req.rid] = ent
                if first:
                    firsts[role][d.req.rid] = first
        # the batch's entries of each pool, as byte ranges of its pool layer 0 (every layer's are
        # these moved by whole layers): the same for every layer of the step
        ranges0 = {role: read_ranges(lay, 0, unique_sorted(np.concatenate(list(entries[role].values()) + riding[role])))
                   for role, (_, lay) in self.buffers.items()}
        owners = {role: s.model_layers_of(name) for role, (name, _) in self.buffers.items()} if by_layer else None
        n_layers = s.device_pool.layer_num
        for layer in (range(n_layers) if by_layer else (None,)):
            if by_layer:
                store = self._store(pairs, "forward", layers=[layer], store=store)
            for role, (name, lay) in self.buffers.items():
                if by_layer:
                    if layer not in owners[role]:
                        continue
                    pls, op_id = (owners[role].index(layer),), f"dec{k}.L{layer}.{role}"
                else:
                    pls, op_id = tuple(range(lay.layers)), f"dec{k}.all.{role}"
                st0, ln0 = ranges0[role]
                starts, lens = coalesce(np.concatenate([st0 + np.int64(pl) * np.int64(lay.layer_bytes) for pl in pls]),
                                        np.concatenate([ln0] * len(pls)))
                # NOTE: reader "*": the whole step reads (no separate indexer); layer -1: every layer
                self.read_rids[op_id] = (ReadInfo(op_id, layer if by_layer else -1, "*", role, name, pls, False,
                                                  starts, lens, entries[role], firsts[role]), -1, made_for, 0)
                self.counts["reads"] += 1
                # NOTE: ranges as an (n, 2) array, as the prefill's forward issues them (a list is
                # parsed back into arrays: a decode step's read spans every running context)
                s.host.issue({"op": "read", "stream": "forward", "buffer": name, "id": op_id,
                              "ranges": np.stack([starts, lens], axis=1)})
            # jitter: false: the step model applied its keyed jitter already
            s.host.issue({"op": "compute", "stream": "forward", "duration_us": dur / n_layers if by_layer else dur,
                          "jitter": False, "id": f"dec{k}.L{layer}.compute" if by_layer else f"dec{k}.compute"})
        return k, dur, ds

    def _release(self, d: DecodeReq) -> None:
        """``release_kv_cache``: HiCache, ``cache_finished_req`` (insert, duplicates and the
        tail freed, unlock); else every slot freed."""
        slots = d.sequence_slots()
        if not self.hicache:
            if len(slots):
                self.session.allocator.free(slots)
            return
        committed = d.req.input_len + d.req.output_len - 1
        aligned = self._insert(d, committed)
        tail = slots[max(aligned, d.decode_prefix_len):]
        if len(tail):
            self.session.allocator.free(tail)
        self.cache.dec_lock_ref(d.node)

    def _abort(self, d: DecodeReq) -> None:
        """A failed restore: the request is aborted (its pre-allocated slots freed, its locks
        released, nothing inserted); the turn ends now."""
        if len(d.delta):
            self.session.allocator.free(d.delta)
        if d.restored_node is not None:
            self.cache.dec_lock_ref(d.restored_node)
        if d.node is not None:
            self.cache.dec_lock_ref(d.node)
        self.counts["restores_failed"] += 1
        self.aborted.append(d.req.rid)
        self._finished_now.append(d.req.rid)

    def _check_ownership(self, ds: list[DecodeReq]) -> None:
        """Every slot a step reads or writes for a request is allocated (not free), and no two
        running requests own the same slot past their tree prefix."""
        # NOTE: both sides made unique by a sort (unique_sorted), so intersect1d need not
        # (its own np.unique is numpy 2.4's slow hash path)
        free = unique_sorted(self.session.allocator.free_page_ids())
        seen: set[int] = set()
        for d in ds:
            self.counts["ownership_checks"] += 1
            slots = d.sequence_slots()[:d.context + 1]
            bad = np.intersect1d(unique_sorted(slots // self.page), free, assume_unique=True)
            if bad.size:
                raise DecodeSideError(f"request {d.req.rid}: its decode step uses pages {bad[:4].tolist()} that are "
                                      "free in the decode allocator")
            mine = set(slots[d.decode_prefix_len:].tolist())
            if mine & seen:
                raise DecodeSideError(f"request {d.req.rid}: slots shared with another running request")
            seen |= mine

    # ---------------------------------------------------------------- the result
    def finish(self) -> dict:
        """Let the decode session's ops complete, poll once more and return the decode side's
        metrics: ``hicache``; ``requests`` admitted and their ``input_tokens``; ``requests_corrupted`` (the union of
        ``requests_raced``, a read saw bytes other than happens-before order gives in that
        request's entries, and ``requests_wrong_kv``, the KV oracle); ``reads_total``,
        ``stale_reads``, ``torn_reads``, ``wrong_kv_reads``; ``latent_races``; ``oob_writes``;
        ``load_backs`` / ``load_back_tokens`` (restores that queued a copy, and its tokens);
        ``backups`` (backup operations started); ``device_hit_tokens`` / ``host_hit_tokens``
        (the decode tree's matches at pre-allocation); ``transfer_tokens`` (tokens whose KV
        the PD transfer moved); ``restores_failed`` (requests aborted); ``steps``;
        ``ownership_checks``; ``corrupted_reads`` (as ``EngineResult``'s); ``corrupted_rids``
        (sorted); ``output_tokens_clipped`` (only when non-zero: requests whose output the decode
        pool capped, :meth:`max_new_tokens`); ``transfer_pools`` (only when the PD transfer
        leaves a pool out: the roles it sends); ``event_loop`` (only in the overlap loop:
        ``"overlap"``).  The decode session's finished run stays in ``self.run`` and, with
        ``keep="all"``, its report in ``self.report``; :meth:`latent_races` lists the races."""
        s = self.session
        s.wait_idle()
        if self.hicache:
            self.cache.check_hicache_events()
        run = self.run = s.finish()
        if self.keep == "all":
            self.report = self._judge_run(run)
        t = self._tally
        rids = t.raced | t.wrong
        return dict(
            hicache=self.hicache, requests=self.counts["requests"], input_tokens=self.counts["input_tokens"],
            requests_corrupted=len(rids),
            requests_raced=len(t.raced), requests_wrong_kv=len(t.wrong), reads_total=t.reads, stale_reads=t.stale,
            torn_reads=t.torn, wrong_kv_reads=t.wrong_reads,
            latent_races=run.online.races.total if self.report is None else self.report["latent_races_total"],
            oob_writes=sum(o["side"] == "dst" for o in run.oob), load_backs=self.counts["load_backs"],
            load_back_tokens=self.counts["load_back_tokens"], backups=s.controller.writes_started,
            device_hit_tokens=self.counts["device_hit_tokens"], host_hit_tokens=self.counts["host_hit_tokens"],
            transfer_tokens=self.counts["transfer_tokens"], restores_failed=self.counts["restores_failed"],
            steps=self.counts["steps"], ownership_checks=self.counts["ownership_checks"],
            corrupted_reads=t.corrupted, corrupted_rids=sorted(rids),
            # only when the decode pool capped a request's output (so other results are unchanged)
            **({"output_tokens_clipped": self.counts["output_tokens_clipped"]}
               if self.counts["output_tokens_clipped"] else {}),
            **({"transfer_pools": sorted(self.transfer_pools)} if self.transfer_pools is not None else {}),
            # only in the overlap loop (so the normal loop's results are unchanged)
            **({"event_loop": "overlap"} if self.overlap else {}))

    def latent_races(self) -> list[dict]:
        """The finished decode run's latent races, every one (``finish`` first): with
        ``keep="all"`` the report's ``latent_races`` entries (``ops``, ``kinds``, ``streams`` as
        lists, the bytes described), with ``keep="report"`` the online verdicts' (``ids``,
        ``kinds``, ``streams`` as tuples, no bytes described)."""
        if self.run is None:
            raise DecodeSideError("the decode side has not finished: call finish() (PrefillEngine.run does)")
        return self.report["latent_races"] if self.report is not None else self.run.online.races.listed(None)


def format_decode_side(d: dict | None) -> list[str]:
    """Summary lines of ``EngineResult.decode`` (``kvrace run``'s table, after the prefill
    side's rows); no lines for None (the decode side in simulated time)."""
    if d is None:
        return []
    rows = [
        ("decode side", f"byte level, HiCache {'on' if d['hicache'] else 'off'}: {d['requests']} requests, "
                        f"{d['steps']} steps" + (" (overlap loop)" if d.get("event_loop") == "overlap" else "")),
        ("  corrupted requests", f"{d['requests_corrupted']}: {d['requests_raced']} raced, "
                                 f"{d['requests_wrong_kv']} read KV not theirs"),
        ("  reads", f"{d['reads_total']}: {d['stale_reads']} stale, {d['torn_reads']} torn, "
                    f"{d['wrong_kv_reads']} wrong KV; latent races {d['latent_races']}"),
        ("  prefix tokens", f"{d['device_hit_tokens']} on device, {d['host_hit_tokens']} on host; "
                            f"{d['transfer_tokens']} of {d['input_tokens']} input tokens transferred"
                            + (f" (pools sent: {', '.join(d['transfer_pools'])})" if "transfer_pools" in d else "")),
        ("  load-backs", f"{d['load_backs']} ({d['load_back_tokens']} tokens); backups {d['backups']}; "
                         f"restores failed {d['restores_failed']}"),
    ]
    w = max(len(k) for k, _ in rows)
    out = [f"{k:<{w}}  {v}" for k, v in rows]
    for c in d["corrupted_reads"][:5]:
        out.append(f"  corrupted: {c['op']} ({c['role']}) {c['status']}, consumer {c['consumer_index']}, "
                   f"requests {c['requests']}")
    return out
