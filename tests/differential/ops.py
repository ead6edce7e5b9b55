"""Random cache-operation sequences and the driver that applies one op to one side.

An op is a plain dict (JSON-able, printed as is in a divergence report):

* ``{"op": "insert", "tokens": [...]}`` (optional ``"priority"``, ``"chunked"``, passed in
  ``InsertParams``): a finished request caches its sequence, as
  SGLang's scheduler does it: if the allocator has fewer than ``len`` (page-aligned) free
  slots, ``evict(EvictParams(len))`` (``evict_from_tree_cache``), then ``alloc``; no room:
  nothing inserted; else ``insert(InsertParams(key, value))`` and the duplicates
  ``value[:prefix_len]`` freed (``cache_finished_req`` with ``cache_protected_len = 0``).
* ``{"op": "match", "tokens": [...]}``: ``match_prefix`` only.
* ``{"op": "lock", "tokens": [...], "h": n}``: ``match_prefix`` then
  ``inc_lock_ref(last_device_node)``; handle ``n`` holds the lock.
* ``{"op": "load", "tokens": [...], "h": n}``: a request admitted with a host hit, as
  ``PrefillAdder.add_one_req`` does: ``match_prefix``; under ``inc_lock_ref`` of
  ``last_device_node`` (``_lock_node``), ``init_load_back(InitLoadBackParams(best_match_node,
  host_hit_length))`` when ``host_hit_length > 0``; release that lock; then
  ``inc_lock_ref`` of the node ``init_load_back`` returned (the request's lock, handle ``n``).
* ``{"op": "unlock", "h": n}``: ``dec_lock_ref`` of handle ``n``'s node.
* ``{"op": "ready"}``: ``ready_to_load_host_cache()`` (``start_loading``).
* ``{"op": "evict", "n": k}``, ``{"op": "evict_host", "n": k}``.
* ``{"op": "writing_check"}``, ``{"op": "loading_check"}``, ``{"op": "check_events"}``
  (``check_hicache_events``).
* ``{"op": "consumer_check"}``: ``is_load_back_event_done(p)`` for the producer slot ``p`` the
  last ``ready`` returned (the forward pass's poll; -1 before any load).
* ``{"op": "flush"}``: the scheduler's ``flush_cache`` on an idle cache: ``reset()`` and the
  device allocator's ``clear()`` (emitted only after everything is released and drained).
* ``{"op": "complete", "queue": "write"|"load", "count": k}``: the oldest ``k`` acks of that
  queue complete (their copies finished on the device); ``{"op": "complete_all"}``.

Ops ``insert``, ``match``, ``lock`` and ``load`` take an optional ``"extra"``: the key's ``extra_key``
(a LoRA id or cache salt: namespaced sequences never share nodes).  With EAGLE
(``DiffConfig.is_eagle``) an insert's key is the bigram key ``cache_finished_req`` builds
(``RadixKey(tokens, extra, is_bigram=True)``, page-aligned: N + 1 tokens make N units).

:func:`generate_radix` draws sequences for the plain ``RadixCache`` (HiCache off): inserts,
matches, locks, unlocks, evictions and flushes only.

Request ops (:func:`generate_requests`) run a request's life through the cache's own
``cache_unfinished_req`` / ``cache_finished_req``, each side with its own ``Req`` (SGLang's
``schedule_batch.Req``) and ``ReqToTokenPool``, the steps between them as SGLang's scheduler
takes them (``PrefillAdder.add_one_req`` / ``add_chunked_req``, ``alloc_for_extend`` /
``alloc_for_decode``):

* ``{"op": "admit", "r": n, "tokens": [...]}`` (optional ``"extra"``, ``"priority"``,
  ``"chunk"``: a multiple of the page size): ``req.init_next_round_input(cache)`` (the match,
  at most ``len - 1`` tokens); under a lock of its ``last_node``, a host hit is loaded back
  (``init_load_back``: ``prefix_indices`` grows, ``cache_protected_len`` with it) and the
  request's own lock taken (``inc_lock_ref(req.last_node)``); a row
  (``req_to_token_pool.alloc``), then the slots of ``[len(prefix_indices), fill_len)``
  (``evict`` first when short; ``alloc`` at page 1, else ``alloc_extend`` from the prefix's
  last slot) written into the row with the prefix; ``fill_len`` is the whole sequence, or
  ``len(prefix_indices) + chunk`` when that is shorter; ``kv_committed_len = fill_len``.
* ``{"op": "chunk", "r": n}``: ``cache_unfinished_req(req, chunked=True)``, then the next
  chunk's slots as above (from ``len(prefix_indices)``).
* ``{"op": "decode", "r": n, "tokens": [...]}``: per token, ``output_ids`` grows, one slot
  (``alloc`` / ``alloc_decode`` from the row's last slot) is written at the token's position,
  ``kv_committed_len += 1``.
* ``{"op": "unfinished", "r": n}``: ``cache_unfinished_req(req)`` (not chunked).
* ``{"op": "finish", "r": n}``: ``cache_finished_req(req)``, then ``req_to_token_pool.free(req)``.

The generator keeps handles consistent (an unlock names a held handle) and makes
sequences share prefixes so that matches split nodes.  Lock and load take their lock right
after their own match, as the scheduler does, so a handle never names a deleted node.
"""
from __future__ import annotations

import random
from typing import Optional

__all__ = ["generate", "generate_radix", "generate_requests", "SideDriver", "error_family", "OPS", "RADIX_OPS", "REQUEST_OPS", "SCENARIOS", "scenario_fourth_load",
           "scenario_split_pending_backup", "scenario_load_back_evicts_its_source"]

OPS = ("insert", "match", "lock", "load", "unlock", "ready", "evict", "evict_host", "writing_check",
       "loading_check", "check_events", "consumer_check", "flush", "complete", "complete_all")
#: the ops of the plain RadixCache (no host tier)
RADIX_OPS = ("insert", "match", "lock", "unlock", "evict", "flush")
#: the ops of a request's life (``generate_requests``)
REQUEST_OPS = ("admit", "chunk", "decode", "unfinished", "finish")


def error_family(e: BaseException) -> str:
    """The kind of an exception, comparable across the two sides (SGLang asserts where
    kvrace raises an ``AssertionError`` subclass, and so on)."""
    for cls in (AssertionError, AttributeError, KeyError, IndexError, ValueError, RuntimeError, TypeError):
        if isinstance(e, cls):
            return cls.__name__
    return "Exception"


def _sequence(rng: random.Random, pool: list[list[int]], page: int, max_pages: int, vocab: int) -> list[int]:
    """A new token sequence: often a prefix of a known one plus a fresh tail, so that
    sequences share prefixes, split nodes and hit on device and host."""
    pages = rng.randint(1, max_pages)
    n = pages * page + (rng.randint(0, page - 1) if page > 1 and rng.random() < 0.3 else 0)
    if pool and rng.random() < 0.75:
        base = rng.choice(pool)
        cut = rng.randint(0, len(base))
        if page > 1 and rng.random() < 0.7:
            cut -= cut % page
        head = base[:cut]
    else:
        head = []
    tail = [rng.randrange(vocab) for _ in range(max(0, n - len(head)))]
    seq = (head + tail)[:max(n, len(head))]
    return seq if seq else [rng.randrange(vocab) for _ in range(page)]


class _Pool:
    """The sequences a generator has inserted, each with its extra key, and how an op's
    tokens are drawn from them (both generators draw alike)."""

    def __init__(self, rng: random.Random, page_size: int, device_tokens: int, vocab: Optional[int],
                 extra_keys: bool):
        self.rng = rng
        self.page = page_size
        self.vocab = vocab or (4 if page_size == 1 else 3)
        self.max_pages = max(12, device_tokens // 3) if page_size == 1 else max(1, (device_tokens // page_size) // 2)
        self.extra_keys = extra_keys
        self.tokens: list[list[int]] = []
        self.extras: list = []

    def add(self, tokens: list[int], extra) -> None:
        self.tokens.append(tokens)
        self.extras.append(extra)

    def pick(self) -> tuple:
        """(an earlier sequence, its extra key)."""
        i = self.rng.randrange(len(self.tokens))
        return self.tokens[i], self.extras[i]

    def draw(self, kind: str, flip: float = 0.0) -> tuple:
        """(tokens, extra key) of an op of ``kind``: an insert's are a new sequence (``_sequence``),
        another op's mostly an earlier sequence, whole, with a tail, or cut; with extra keys a
        new sequence is namespaced one time in five, and an earlier one moves to another
        namespace with probability ``flip``."""
        rng = self.rng
        if kind == "insert" or not self.tokens or rng.random() < 0.2:
            tokens = _sequence(rng, self.tokens, self.page, self.max_pages, self.vocab)
            return tokens, rng.choice(["a", "b"]) if self.extra_keys and rng.random() < 0.2 else None
        # NOTE: mostly a whole earlier sequence (plus a tail), so that host hits reach the
        # load-back threshold (10 tokens) once its nodes were backed up and evicted
        base, extra = self.pick()
        r = rng.random()
        if r < 0.5:
            tokens = list(base)
        elif r < 0.75:
            tokens = list(base) + [rng.randrange(self.vocab) for _ in range(rng.randint(1, 2 * self.page))]
        else:
            tokens = base[:rng.randint(1, len(base))]
        if flip and self.extra_keys and rng.random() < flip:
            extra = None if extra is not None else "a"     # the same tokens, another namespace
        return tokens, extra


def _keyed(op: dict, extra) -> dict:
    if extra is not None:
        op["extra"] = extra
    return op


def generate(seed: int, length: int, *, page_size: int = 1, device_tokens: int = 32,
             vocab: Optional[int] = None, extra_keys: bool = False) -> list[dict]:
    """``length`` random ops (seeded).  Sequences are up to about half the device pool, so
    inserts and load-backs evict; the vocabulary is small so prefixes recur.  With
    ``extra_keys`` a fifth of the new sequences carry an ``extra_key`` ("a" or "b"), kept by
    every later op on them (the sequences without it are those drawn without the flag)."""
    rng = random.Random(seed)
    pool = _Pool(rng, page_size, device_tokens, vocab, extra_keys)
    held: list[int] = []
    next_h = 0
    ops: list[dict] = []
    weights = {"insert": 6, "match": 2, "lock": 2, "load": 5, "unlock": 5, "ready": 3, "evict": 3,
               "evict_host": 2, "writing_check": 2, "loading_check": 2, "check_events": 3, "complete": 5,
               "complete_all": 1, "cycle": 2, "consumer_check": 2, "flush": 0.3}
    names = list(weights)
    w = [weights[n] for n in names]
    while len(ops) < length:
        kind = rng.choices(names, w)[0]
        if kind in ("insert", "match", "lock", "load"):
            tokens, extra = pool.draw(kind)
            if kind == "insert":
                pool.add(tokens, extra)
                op = _keyed({"op": "insert", "tokens": tokens}, extra)
                if rng.random() < 0.25:
                    op["priority"] = rng.randint(0, 2)
                if rng.random() < 0.15:
                    op["chunked"] = True       # a chunked-prefill insert: no hit counting
                ops.append(op)
            elif kind == "match":
                ops.append(_keyed({"op": "match", "tokens": tokens}, extra))
            else:
                if len(held) >= 2:
                    continue
                ops.append(_keyed({"op": kind, "tokens": tokens, "h": next_h}, extra))
                held.append(next_h)
                next_h += 1
        elif kind == "cycle":
            # a round trip: cache a sequence, let its backup land, push it to the host, ask
            # for it again (load-back), start the load and poll its ack
            if not pool.tokens or len(held) >= 2:
                continue
            base, extra = pool.pick()
            tokens = list(base)
            ops += [_keyed({"op": "insert", "tokens": tokens}, extra), {"op": "complete", "queue": "write", "count": 2},
                    {"op": "check_events"}, {"op": "evict", "n": device_tokens},
                    _keyed({"op": "load", "tokens": tokens, "h": next_h}, extra), {"op": "ready"}]
            held.append(next_h)
            next_h += 1
            if rng.random() < 0.5:
                ops += [{"op": "complete", "queue": "load", "count": 1}, {"op": "check_events"}]
        elif kind == "flush":
            # flush_cache runs only when no request is running: release, drain, then flush
            ops += [{"op": "unlock", "h": h} for h in held]
            held.clear()
            ops += [{"op": "ready"}, {"op": "complete_all"}, {"op": "check_events"}, {"op": "flush"}]
        elif kind == "unlock":
            if not held:
                continue
            h = held.pop(rng.randrange(len(held)))
            ops.append({"op": "unlock", "h": h})
        elif kind in ("evict", "evict_host"):
            ops.append({"op": kind, "n": rng.randint(1, device_tokens)})
        elif kind == "complete":
            ops.append({"op": "complete", "queue": rng.choice(["write", "load"]), "count": rng.randint(1, 2)})
            if rng.random() < 0.5:
                # acks are usually polled soon after the copies finish; this is what lets
                # backed-up nodes unlock, get evicted to the host and be loaded back
                ops.append({"op": "check_events"})
        else:
            ops.append({"op": kind})
    # release what is still held, then settle everything, so every run ends drained
    for h in held:
        ops.append({"op": "unlock", "h": h})
    ops += [{"op": "ready"}, {"op": "complete_all"}, {"op": "check_events"}]
    return ops


def generate_radix(seed: int, length: int, *, page_size: int = 1, device_tokens: int = 32,
                   extra_keys: bool = True, vocab: Optional[int] = None) -> list[dict]:
    """``length`` random ops (seeded) for the plain ``RadixCache``: inserts (priorities,
    chunked inserts), matches, locks and unlocks of up to three handles, evictions and
    flushes; with ``extra_keys`` a fifth of the sequences carry an ``extra_key`` ("a" or
    "b"); a tenth of the later ops on an earlier sequence move it to another namespace (the
    same tokens under another key)."""
    rng = random.Random(seed)
    pool = _Pool(rng, page_size, device_tokens, vocab, extra_keys)
    held: list[int] = []
    next_h = 0
    ops: list[dict] = []
    weights = {"insert": 6, "match": 2, "lock": 3, "unlock": 3, "evict": 3, "flush": 0.3}
    names = list(weights)
    w = [weights[n] for n in names]
    while len(ops) < length:
        kind = rng.choices(names, w)[0]
        if kind in ("insert", "match", "lock"):
            tokens, extra = pool.draw(kind, flip=0.1)
            op = _keyed({"op": kind, "tokens": tokens}, extra)
            if kind == "insert":
                pool.add(tokens, extra)
                if rng.random() < 0.25:
                    op["priority"] = rng.randint(0, 2)
                if rng.random() < 0.15:
                    op["chunked"] = True
            elif kind == "lock":
                if len(held) >= 3:
                    continue
                op["h"] = next_h
                held.append(next_h)
                next_h += 1
            ops.append(op)
        elif kind == "unlock":
            if not held:
                continue
            ops.append({"op": "unlock", "h": held.pop(rng.randrange(len(held)))})
        elif kind == "evict":
            ops.append({"op": "evict", "n": rng.randint(1, device_tokens)})
        else:
            # flush_cache runs only when no request is running
            ops += [{"op": "unlock", "h": h} for h in held]
            held.clear()
            ops.append({"op": "flush"})
    ops += [{"op": "unlock", "h": h} for h in held]
    return ops


def generate_requests(seed: int, length: int, *, page_size: int = 1, device_tokens: int = 32, hicache: bool = True,
                      extra_keys: bool = True, rows: int = 3, vocab: Optional[int] = None) -> list[dict]:
    """``length`` random ops (seeded) of requests running through the cache: up to ``rows``
    requests at once are admitted (a third of them chunked, in chunks of one or two pages),
    decode a few tokens, are cached unfinished now and then and finish; between them
    matches and evictions, and with ``hicache`` the host tier's ops (acks completing and
    polled, load-backs started, host evictions), so that admissions hit on the host and
    load back.  Every request finishes and, with ``hicache``, everything settles by the end."""
    rng = random.Random(seed)
    pool = _Pool(rng, page_size, device_tokens, vocab, extra_keys)
    live: dict[int, dict] = {}          # request number -> {"left": prompt tokens still to fill}
    next_r = 0
    ops: list[dict] = []
    weights = {"admit": 5, "chunk": 4, "decode": 4, "unfinished": 1, "finish": 4, "match": 1, "evict": 2,
               "flush": 0.2}
    if hicache:
        weights.update({"ready": 3, "complete": 4, "check_events": 3, "evict_host": 1, "writing_check": 1,
                        "loading_check": 1, "consumer_check": 1, "revisit": 2})
    names = list(weights)
    w = [weights[n] for n in names]
    while len(ops) < length:
        kind = rng.choices(names, w)[0]
        if kind in ("admit", "revisit"):
            if len(live) >= rows or (kind == "revisit" and not pool.tokens):
                continue
            if kind == "revisit":
                # a conversation's next turn after its KV went to the host: the backups land
                # and are polled, the device is evicted, the session comes back with more
                base, extra = pool.pick()
                tokens = list(base) + [rng.randrange(pool.vocab) for _ in range(rng.randint(1, 2 * page_size))]
                ops += [{"op": "complete", "queue": "write", "count": 2}, {"op": "check_events"},
                        {"op": "evict", "n": device_tokens}]
            else:
                tokens, extra = pool.draw("insert" if rng.random() < 0.4 else "match")
            pool.add(tokens, extra)
            op = _keyed({"op": "admit", "r": next_r, "tokens": tokens}, extra)
            if rng.random() < 0.2:
                op["priority"] = rng.randint(0, 2)
            chunked = rng.random() < 0.35 and len(tokens) > page_size
            if chunked:
                op["chunk"] = page_size * rng.randint(1, 2)
            live[next_r] = {"chunked": chunked}
            next_r += 1
            ops.append(op)
        elif kind in ("chunk", "decode", "unfinished", "finish"):
            if not live:
                continue
            pick = sorted(r for r in live if live[r]["chunked"]) if kind == "chunk" else sorted(live)
            if not pick:
                continue
            r = rng.choice(pick)
            if kind == "decode":
                ops.append({"op": "decode", "r": r, "tokens": [rng.randrange(pool.vocab)
                                                                  for _ in range(rng.randint(1, 2 * page_size + 1))]})
            else:
                ops.append({"op": kind, "r": r})
                if kind == "finish":
                    del live[r]
        elif kind == "match":
            tokens, extra = pool.draw("match")
            ops.append(_keyed({"op": "match", "tokens": tokens}, extra))
        elif kind in ("evict", "evict_host"):
            ops.append({"op": kind, "n": rng.randint(1, device_tokens)})
        elif kind == "flush":
            # flush_cache runs only when no request is running
            ops += [{"op": "finish", "r": r} for r in sorted(live)]
            live.clear()
            if hicache:
                ops += [{"op": "ready"}, {"op": "complete_all"}, {"op": "check_events"}]
            ops.append({"op": "flush"})
        elif kind == "complete":
            ops.append({"op": "complete", "queue": rng.choice(["write", "load"]), "count": rng.randint(1, 2)})
            if rng.random() < 0.5:
                ops.append({"op": "check_events"})
        else:
            ops.append({"op": kind})
    ops += [{"op": "finish", "r": r} for r in sorted(live)]
    if hicache:
        ops += [{"op": "ready"}, {"op": "complete_all"}, {"op": "check_events"}]
    return ops


class SideDriver:
    """Applies ops to one side (``SGLangSide`` or ``KvraceSide``): the side gives ``cache``
    (the tree; for kvrace the session's settled tree), ``records`` (a module with
    ``InsertParams``, ``MatchPrefixParams``, ``EvictParams``, ``InitLoadBackParams``),
    ``key(tokens)``, ``as_list(array)``, ``token_list(key)``, ``root()``, ``allocator``,
    ``complete_acks(queue, count)``, ``complete_all()``."""

    def __init__(self, side):
        self.side = side
        self.handles: dict[int, object] = {}
        self.last_producer = -1
        #: the running requests by number (each side's own ``Req``), read by ``compare.observe``
        side.reqs = self.reqs = {}
        self.chunks: dict[int, int] = {}

    def _path(self, node) -> tuple:
        from tests.differential.compare import edge

        out = []
        root = self.side.root()
        while node is not None and node is not root:
            out = edge(self.side, node) + out
            node = node.parent
        return tuple(out)

    def apply(self, op: dict):
        """Run ``op``; returns its result as plain data (or ``("raise", family)``)."""
        try:
            return self._apply(op)
        except Exception as e:  # noqa: BLE001 - both sides' failures are compared
            return ("raise", error_family(e))

    def _apply(self, op: dict):
        s, c, r = self.side, self.side.cache, self.side.records
        kind = op["op"]
        if kind in REQUEST_OPS:
            return self._request(op)
        if kind == "insert":
            # NOTE: the key cache_finished_req builds (bigram with EAGLE), so that ``n``, the
            # slots the request holds for it, is its unit count
            key = s.key(op["tokens"], op.get("extra"), is_bigram=s.cfg.is_eagle)
            n = len(key.page_aligned(s.cfg.page_size))
            if n == 0:
                return ("empty",)
            if s.allocator.available_size() < n:
                c.evict(r.EvictParams(num_tokens=n))
            value = s.allocator.alloc(n)
            if value is None:
                return ("no_room",)
            res = c.insert(r.InsertParams(key=key, value=value, chunked=bool(op.get("chunked", False)),
                                          priority=op.get("priority", 0)))
            dup = value[:res.prefix_len]
            if len(dup):
                s.allocator.free(dup)
            return ("inserted", int(res.prefix_len))
        if kind in ("match", "lock", "load"):
            m = c.match_prefix(r.MatchPrefixParams(key=s.key(op["tokens"], op.get("extra"))))
            seen = (s.as_list(m.device_indices), self._path(m.last_device_node), self._path(m.last_host_node),
                    int(m.host_hit_length))
            if kind == "match":
                return ("match",) + seen
            node = m.last_device_node
            if kind == "lock":
                delta = c.inc_lock_ref(node).delta
                self.handles[op["h"]] = node
                return ("locked",) + seen + (int(delta),)
            c.inc_lock_ref(node)
            loaded = None
            if m.host_hit_length > 0:
                values, node = c.init_load_back(r.InitLoadBackParams(best_match_node=m.best_match_node,
                                                                      host_hit_length=m.host_hit_length))
                loaded = s.as_list(values)
            c.dec_lock_ref(m.last_device_node)
            c.inc_lock_ref(node)
            self.handles[op["h"]] = node
            return ("loaded",) + seen + (loaded, self._path(node))
        if kind == "unlock":
            node = self.handles.pop(op["h"])
            return ("unlocked", int(c.dec_lock_ref(node).delta))
        if kind == "ready":
            p = int(c.ready_to_load_host_cache())
            if p >= 0:
                self.last_producer = p
            return ("producer", p)
        if kind == "consumer_check":
            return ("consumer", self.last_producer, bool(c.is_load_back_event_done(self.last_producer)))
        if kind == "flush":
            c.reset()
            s.allocator.clear()
            return ("ok",)
        if kind == "evict":
            return ("evicted", int(c.evict(r.EvictParams(num_tokens=op["n"])).num_tokens_evicted))
        if kind == "evict_host":
            # NOTE: SGLang's evict_host returns None; its effect is observed, not its value
            c.evict_host(op["n"])
            return ("evict_host",)
        if kind == "writing_check":
            c.writing_check()
            return ("ok",)
        if kind == "loading_check":
            c.loading_check()
            return ("ok",)
        if kind == "check_events":
            c.check_hicache_events()
            return ("ok",)
        if kind == "complete":
            s.complete_acks(op["queue"], op["count"])
            return ("ok",)
        if kind == "complete_all":
            s.complete_all()
            return ("ok",)
        raise ValueError(f"unknown op {kind!r}")

    # -------------------------------------------------------------- requests
    def _request(self, op: dict):
        s, c, r = self.side, self.side.cache, self.side.records
        kind, n = op["op"], op["r"]
        if kind == "admit":
            req = s.new_req(f"r{n}", op["tokens"], op.get("extra"), op.get("priority"))
            s.init_round(req)
            seen = (len(req.prefix_indices), self._path(req.last_node), int(req.host_hit_length))
            locked = req.last_node
            c.inc_lock_ref(locked)                      # PrefillAdder._lock_node
            loaded = None
            if s.cfg.hicache and req.host_hit_length > 0:
                new_indices, req.last_node = c.init_load_back(r.InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length))
                req.prefix_indices = s.cat(req.prefix_indices, new_indices)
                req.cache_protected_len = len(req.prefix_indices)
                loaded = s.as_list(new_indices)
            c.inc_lock_ref(req.last_node)               # _req_inc_lock_ref
            c.dec_lock_ref(locked)
            if s.req_pool.alloc([req]) is None:
                c.dec_lock_ref(req.last_node)
                return ("no_row",) + seen
            full = len(req.origin_input_ids)
            pre = len(req.prefix_indices)
            chunk = op.get("chunk")
            seq = full if chunk is None or pre + chunk >= full else pre + chunk
            if chunk is not None and seq < full:
                self.chunks[n] = chunk
            if not self._extend(req, pre, seq):
                c.dec_lock_ref(req.last_node)
                s.req_pool.free(req)
                return ("no_room",) + seen + (loaded,)
            self.reqs[n] = req
            return ("admitted",) + seen + (loaded, int(req.fill_len), int(req.req_pool_idx))
        req = self.reqs.get(n)
        if req is None:
            return ("not_running",)             # its admission found no room
        if kind == "chunk":
            full = len(req.origin_input_ids)
            if req.fill_len >= full:
                return ("prefilled",)
            c.cache_unfinished_req(req, chunked=True)
            pre = len(req.prefix_indices)
            seq = min(full, pre + self.chunks.get(n, s.cfg.page_size))
            ok = self._extend(req, pre, seq)
            return ("chunked", int(req.cache_protected_len), pre, self._path(req.last_node), ok)
        if kind == "decode":
            if req.fill_len < len(req.origin_input_ids):
                return ("prefilling",)
            done = 0
            for t in op["tokens"]:
                if not self._decode_one(req, int(t)):
                    break
                done += 1
            return ("decoded", done)
        if kind == "unfinished":
            c.cache_unfinished_req(req)
            return ("cached", int(req.cache_protected_len), len(req.prefix_indices), self._path(req.last_node))
        if kind == "finish":
            del self.reqs[n]
            self.chunks.pop(n, None)
            c.cache_finished_req(req)
            s.req_pool.free(req)
            return ("finished",)
        raise ValueError(f"unknown op {kind!r}")

    def _extend(self, req, pre: int, seq: int) -> bool:
        """``alloc_for_extend`` of one request: slots for tokens ``[pre, seq)`` (evicting first
        when short, as ``evict_from_tree_cache``), written into its row after its
        ``prefix_indices``; False (nothing taken) when the pool cannot serve them."""
        s, c, r = self.side, self.side.cache, self.side.records
        alloc, page = s.allocator, s.cfg.page_size
        need = seq - pre
        if page == 1:
            if alloc.available_size() < need:
                c.evict(r.EvictParams(num_tokens=need))
            out = alloc.alloc(need)
        else:
            # NOTE: alloc_paged_token_slots_extend over-estimates: a new page per request
            if alloc.available_size() < need + page:
                c.evict(r.EvictParams(num_tokens=need + page))
            # NOTE: SGLang's Triton kernel reads free_pages past their end when too few are
            # left (on a GPU it reads garbage and then returns None; in the interpreter it
            # crashes); the scheduler's budget keeps it from being called so, and so does this
            if (-(-seq // page) - -(-pre // page)) > len(alloc.free_pages):
                return False
            last = int(req.prefix_indices[-1]) if pre else -1
            out = alloc.alloc_extend(s.ints([pre]), s.ints([pre]), s.ints([seq]), s.ints([seq]), s.ints([last]), need)
        if out is None:
            return False
        s.req_pool.write((req.req_pool_idx, slice(0, pre)), req.prefix_indices)
        s.req_pool.write((req.req_pool_idx, slice(pre, seq)), out)
        req.fill_len = seq
        req.kv_committed_len = req.kv_allocated_len = seq
        return True

    def _decode_one(self, req, token: int) -> bool:
        """One decode step of one request (``alloc_for_decode``): the token joins
        ``output_ids``, its slot is written at its position; False when no slot is left."""
        s, c, r = self.side, self.side.cache, self.side.records
        alloc, page = s.allocator, s.cfg.page_size
        seq = req.kv_committed_len + 1
        if alloc.available_size() < page:
            c.evict(r.EvictParams(num_tokens=page))
        if page == 1:
            out = alloc.alloc(1)
        else:
            if (seq - 1) % page == 0 and not len(alloc.free_pages):
                return False                    # a new page, none left (NOTE in _extend)
            last = int(s.req_pool.req_to_token[req.req_pool_idx, seq - 2])
            out = alloc.alloc_decode(s.ints([seq]), s.ints([seq]), s.ints([last]))
        if out is None:
            return False
        req.output_ids.append(token)
        s.req_pool.write((req.req_pool_idx, slice(seq - 1, seq)), out)
        req.kv_committed_len = req.kv_allocated_len = seq
        return True



def scenario_fourth_load(page_size: int = 1, device_tokens: int = 48) -> list[dict]:
    """Four load-backs started without any completing: the fourth ``start_loading`` reuses
    producer slot 0 whose load has not finished (SGLang asserts in ``update_producer``,
    after advancing the index); then everything completes and is polled."""
    n = 10 if page_size == 1 else page_size
    seqs = [[k + 1] * n for k in range(4)]
    ops: list[dict] = []
    for s in seqs:
        ops += [{"op": "insert", "tokens": s}]
    ops += [{"op": "complete_all"}, {"op": "check_events"}, {"op": "evict", "n": device_tokens}]
    for h, s in enumerate(seqs):
        ops += [{"op": "load", "tokens": s, "h": h}, {"op": "ready"}]
    ops += [{"op": "ready"}, {"op": "complete_all"}, {"op": "check_events"}, {"op": "ready"},
            {"op": "complete_all"}, {"op": "check_events"}]
    ops += [{"op": "unlock", "h": h} for h in range(4)]
    return ops


def scenario_split_pending_backup(page_size: int = 1, device_tokens: int = 48) -> list[dict]:
    """A backup in flight over a node that a match then splits (SGLang moves the pending
    ack onto both halves: ``_replace_pending_write_through_node``), and an insert that
    diverges inside it; the ack completes afterwards."""
    p = page_size
    a = [1] * (3 * p) + [2] * (3 * p)
    b = [1] * (3 * p) + [3] * (2 * p)
    return [{"op": "insert", "tokens": a}, {"op": "match", "tokens": a[:2 * p]},
            {"op": "insert", "tokens": b}, {"op": "complete", "queue": "write", "count": 1},
            {"op": "check_events"}, {"op": "complete_all"}, {"op": "check_events"},
            {"op": "evict", "n": 100 * p}, {"op": "load", "tokens": a, "h": 0}, {"op": "ready"},
            {"op": "complete_all"}, {"op": "check_events"}, {"op": "unlock", "h": 0}]


def scenario_load_back_evicts_its_source(page_size: int = 1, device_tokens: int = 48) -> list[dict]:
    """FINDINGS.md F2 (write_back, host pool ``hicache_ratio`` 1.1): A and B are written back
    and evicted to the host, C fills the device; a request then hits A on the host.
    ``load_back`` locks only A's device-resident ancestor (the root), its device ``load``
    fails, its ``evict`` writes C back, the host pool is full, and ``write_backup``'s
    ``evict_host`` frees B's and A's own host slots and detaches A from the tree; C's
    backup gets A's slots, and the load of A, started afterwards, reads C's bytes.  The
    last two ops then meet the detached node (SGLang: ``assert v == x`` in ``evict_host``)."""
    p = page_size
    unit = max(p, (device_tokens // 12) // p * p)     # 4 tokens for 48 / page 1
    a = [1] * (5 * unit)
    b = [2] * (device_tokens - 5 * unit - (device_tokens - 5 * unit) % p)
    c = [3] * device_tokens
    return [{"op": "insert", "tokens": a}, {"op": "evict", "n": device_tokens},
            {"op": "insert", "tokens": b}, {"op": "evict", "n": len(b)},
            {"op": "insert", "tokens": c},
            {"op": "load", "tokens": a, "h": 0}, {"op": "ready"}, {"op": "complete_all"},
            {"op": "check_events"}, {"op": "unlock", "h": 0}, {"op": "evict", "n": device_tokens},
            {"op": "evict_host", "n": 2 * device_tokens}]


#: hand-written sequences for behaviours random sequences reach rarely; each takes
#: (page_size, device_tokens)
SCENARIOS = {"fourth_load": scenario_fourth_load, "split_pending_backup": scenario_split_pending_backup,
             "load_back_evicts_its_source": scenario_load_back_evicts_its_source}
