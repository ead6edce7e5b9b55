"""A request as the prefix caches see it: the fields of SGLang 0.5.14's ``Req``
(``managers/schedule_batch.py``) that ``match_prefix``, ``cache_unfinished_req`` and
``cache_finished_req`` read and write, with SGLang's names.

Token ids are ``array("q")`` as in SGLang, so ``origin_input_ids + output_ids`` concatenates
(and a ``Req`` built here can be handed to SGLang's own caches, as the differential harness
does).  Index fields (``prefix_indices``) hold whatever the cache gave: numpy int64 here.

Lengths, as SGLang keeps them:

* ``fill_len``: the tokens this round computes up to; ``get_fill_ids()`` is
  ``(origin_input_ids + output_ids)[:fill_len]`` (a chunk's end while chunked prefill runs);
* ``prefix_indices``: the device slots of the tokens before this round's new ones (the match,
  and after each chunk the tree's slots plus the partial page's);
* ``cache_protected_len``: how many leading slots of the request's row the tree owns (the
  request must not free them); it differs from ``len(prefix_indices)`` by the partial page;
* ``kv_committed_len``: tokens whose KV the request has written (``cache_finished_req`` caches
  that many), ``pop_committed_kv_cache()`` hands it over once.

NOTE: SGLang's ``strip_thinking_cache`` (commit only the prompt when reasoning tokens were
produced) is a server flag this record does not model: the committed length is used whole.
"""
from __future__ import annotations

from array import array
from typing import Any, Optional

from sim.cache.radix import CacheAssertionError, RadixKey
from sim.cache.records import MatchPrefixParams, empty_indices
from sim.errors import InputError, show

__all__ = ["Req"]


def _token_array(tokens, where: str) -> array:
    try:
        return array("q", (int(t) for t in tokens))
    except (TypeError, ValueError, OverflowError):
        raise InputError(where, f"expected a sequence of integer token ids, got {show(tokens)}") from None


class Req:
    """One request: ``rid``, ``origin_input_ids`` (its prompt), ``output_ids`` (tokens decoded
    so far; append with :meth:`append_output`), ``extra_key`` (its cache namespace: LoRA id,
    cache salt) and ``priority``; the scheduler's state of it (``fill_len``,
    ``extend_input_len``, ``req_pool_idx``, ``prefix_indices``, ``last_node``,
    ``last_host_node``, ``best_match_node``, ``host_hit_length``, ``cache_protected_len``,
    ``kv_committed_len``, ``kv_allocated_len``, ``inflight_middle_chunks``)."""

    def __init__(self, rid: str, origin_input_ids, *, extra_key: Optional[str] = None,
                 priority: Optional[int] = None):
        self.rid = rid
        self.origin_input_ids = _token_array(origin_input_ids, "origin_input_ids")
        self.output_ids = array("q")
        self.extra_key = extra_key
        self.priority = priority
        self.fill_len = 0
        self.extend_input_len = 0
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices = empty_indices()
        self.last_node: Any = None
        self.last_host_node: Any = None
        self.best_match_node: Any = None
        self.host_hit_length = 0
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.kv_committed_freed = False
        #: chunks of this request launched and not yet processed (SGLang counts them for the
        #: overlap scheduler; ``ReqToTokenPool.alloc`` lets such a request keep its row)
        self.inflight_middle_chunks = 0

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)}, "
                f"fill_len={self.fill_len}, committed={self.kv_committed_len}, row={self.req_pool_idx})")

    @property
    def full_untruncated_fill_ids(self) -> array:
        """``origin_input_ids + output_ids``."""
        return self.origin_input_ids + self.output_ids

    def get_fill_ids(self) -> array:
        """The tokens up to ``fill_len``."""
        return self.full_untruncated_fill_ids[: self.fill_len]

    def append_output(self, tokens) -> None:
        """Decoded tokens join ``output_ids`` (append-only, as SGLang's contract is)."""
        self.output_ids.extend(_token_array(tokens, "tokens"))

    def pop_committed_kv_cache(self) -> int:
        """``kv_committed_len``, marking it handed over; a second call fails, as SGLang's
        ``assert not self.kv_committed_freed`` does."""
        if self.kv_committed_freed:
            raise CacheAssertionError(f"request {self.rid!r}: committed KV cache already freed "
                                      f"(kv_committed_len={self.kv_committed_len}); a request is cached "
                                      "as finished once")
        self.kv_committed_freed = True
        return self.kv_committed_len

    def init_next_round_input(self, tree_cache=None, cow_mamba: Optional[bool] = None) -> None:
        """Match the request's tokens in ``tree_cache`` before it is scheduled (SGLang's
        ``init_next_round_input``): at most ``len - 1`` tokens may match (one is always
        computed, for its logits), under the request's ``extra_key``; sets ``prefix_indices``,
        ``last_node``, ``last_host_node``, ``best_match_node``, ``host_hit_length``,
        ``cache_protected_len`` (the match's, else ``len(prefix_indices)``) and
        ``extend_input_len``.  Without a cache nothing matches; ``cow_mamba`` (Mamba's) is
        ignored."""
        full = self.full_untruncated_fill_ids
        if tree_cache is not None:
            m = tree_cache.match_prefix(MatchPrefixParams(
                key=RadixKey(full, self.extra_key, limit=max(len(full) - 1, 0))))
            self.prefix_indices = m.device_indices
            self.last_node, self.last_host_node = m.last_device_node, m.last_host_node
            self.best_match_node, self.host_hit_length = m.best_match_node, int(m.host_hit_length)
            self.cache_protected_len = (len(self.prefix_indices) if m.cache_protected_len is None
                                        else m.cache_protected_len)
        self.extend_input_len = len(full) - len(self.prefix_indices)
