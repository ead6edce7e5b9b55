"""The request-to-token table, with SGLang 0.5.14's semantics
(``mem_cache/memory_pool.py``, ``ReqToTokenPool``).

Each running request owns one row of ``req_to_token``: entry ``[i, j]`` is the device slot
holding token ``j`` of the request in row ``i``.  The prefix caches read a request's slots
from its row (``cache_finished_req``, ``cache_unfinished_req``) and write the tree's slots
back into it when an insert found part of it already cached.

* Row 0 is padding and never handed out (CUDA-graph padded batches point at it): the free
  rows start as ``1..size``.
* ``alloc(reqs)`` gives each request without a row (``req_pool_idx is None``) the next free
  row, in request order, from the front of the free list; a request that already has one
  keeps it (a chunked request between chunks, or one with committed KV).  With too few free
  rows nothing is taken and None is returned.
* ``free(req)`` appends the request's row to the free list and clears ``req_pool_idx``.

The table is int32, as SGLang's; a caller that needs int64 slots converts, as SGLang's
``.to(torch.int64)`` does.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np

from sim.errors import InputError, KvraceError, show

__all__ = ["ReqToTokenPool", "ReqPoolError"]


class ReqPoolError(KvraceError, AssertionError):
    """Where SGLang's ``ReqToTokenPool`` fails an ``assert``: freeing a request that holds no
    row, re-allocating the row of a request that is neither chunked nor has committed KV.

    NOTE: also an ``AssertionError``, so code that catches what SGLang raises catches this."""


def _positive(v: Any, where: str) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise InputError(where, f"expected an integer >= 1, got {show(v)}")
    return int(v)


class ReqToTokenPool:
    """``size`` request rows of ``max_context_len`` token slots each (plus padding row 0).

    Attributes: ``size``, ``max_context_len``, ``req_to_token`` (the ``(size + 1,
    max_context_len)`` int32 table), ``free_slots`` (the free rows, the next one first)."""

    def __init__(self, size: int, max_context_len: int):
        self.size = _positive(size, "size")
        self.max_context_len = _positive(max_context_len, "max_context_len")
        self.req_to_token = np.zeros((self.size + 1, self.max_context_len), dtype=np.int32)
        self.free_slots: list[int] = list(range(1, self.size + 1))

    def write(self, indices, values) -> None:
        """``req_to_token[indices] = values`` (``indices`` as numpy indexes the table, e.g.
        ``(row, slice(a, b))``)."""
        try:
            self.req_to_token[indices] = np.asarray(values)
        except (IndexError, ValueError) as e:
            raise InputError("indices", f"expected a row and token range inside the "
                                        f"{self.req_to_token.shape} table matching the values' length ({e})") from None

    def available_size(self) -> int:
        """Free rows."""
        return len(self.free_slots)

    def alloc(self, reqs: list) -> Optional[list[int]]:
        """A row for each request of ``reqs`` that has none (set as its ``req_pool_idx``);
        returns every request's row, in order, or None (nothing taken) when too few are free."""
        reusing = [r for r in reqs if r.req_pool_idx is not None]
        for r in reusing:
            if not (r.inflight_middle_chunks > 0 or r.kv_committed_len > 0):
                raise ReqPoolError(f"request {r.rid!r} reuses row {r.req_pool_idx} but is neither chunked "
                                   f"nor has committed KV (SGLang: 'reusing request must be chunked or have "
                                   f"committed KV'); free its row first")
        need = len(reqs) - len(reusing)
        if need > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        it = iter(rows)
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = next(it)
        return [r.req_pool_idx for r in reqs]

    def free(self, req) -> None:
        """Return ``req``'s row to the free list (at its end) and clear ``req.req_pool_idx``."""
        if req.req_pool_idx is None:
            raise ReqPoolError(f"request {req.rid!r} holds no row (req_pool_idx is None): "
                               "SGLang asserts 'request must have req_pool_idx'")
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = None

    def clear(self) -> None:
        """Every row free again (the table's contents are left as they are)."""
        self.free_slots = list(range(1, self.size + 1))
