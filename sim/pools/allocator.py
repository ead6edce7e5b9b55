"""Device slot allocators with SGLang 0.5.14's exact slot order.

Models ``sglang/srt/mem_cache/allocator/base.py`` (``BaseTokenToKVPoolAllocator``),
``token.py`` (``TokenToKVPoolAllocator``) and ``paged.py``
(``PagedTokenToKVPoolAllocator``, with ``alloc_extend`` / ``alloc_decode`` as the
reference ``alloc_extend_naive`` and the Triton kernels compute them).  Which
freed slot is handed out next decides whose stale bytes a racing read sees, so
the order of ``free_pages`` / ``release_pages`` is reproduced exactly:

* slot 0 (page 0) is padding and never handed out: ``free_pages`` starts as
  ``1..size`` (token) or ``1..size // page_size`` (paged);
* ``alloc`` takes from the FRONT of ``free_pages``;
* the token allocator's ``free`` APPENDS the freed slots (in the order given);
  the paged allocator's ``free`` PREPENDS the sorted unique pages of the freed
  slots (so the most recent free is reused first);
* with ``need_sort`` (SGLang sets it for PD disaggregation only) frees go to
  ``release_pages`` instead, and an allocation that ``free_pages`` cannot serve
  first merges both lists and sorts them (``merge_and_sort_free``);
* between ``free_group_begin`` and ``free_group_end`` frees are collected and
  released as one concatenated ``free`` at the end.

Indices are numpy int64 1-D arrays; an allocation that cannot be served
returns ``None`` and changes nothing (as in SGLang).  The state arrays are
never modified in place, only replaced, so ``backup_state`` can return them
without a copy, as SGLang does.
"""
from __future__ import annotations

import abc
import numbers
from typing import Any

import numpy as np

from sim.arrays import unique_sorted
from sim.errors import InputError, KvraceError, show

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "MissingIndicesError",
    "get_num_new_pages",
]

_EMPTY = np.zeros(0, dtype=np.int64)


def _count(v: Any, where: str, minimum: int = 0) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < minimum:
        raise InputError(where, f"expected an integer >= {minimum}, got {show(v)}")
    return int(v)


class MissingIndicesError(KvraceError, AttributeError):
    """``free(None)``: no indices where slot indices belong.  SGLang 0.5.14's allocators fail
    at that call too (``free_index.numel()`` on None: an ``AttributeError``), before changing
    anything; so does this one, with a message.

    NOTE: an ``AttributeError`` too, so a caller catching what SGLang raises catches this.
    The tree reaches it by evicting a node whose device value is already gone: F2's detached
    node, back among the evictable leaves (``tests/differential/FINDINGS.md`` F3)."""


def _free_indices(v: Any) -> np.ndarray:
    """A ``free`` call's ``free_index`` as int64 slots (None: :class:`MissingIndicesError`)."""
    if v is None:
        raise MissingIndicesError("free_index: expected the slot indices to free, got None (a tree node whose "
                                  "device value is gone, evicted again?); SGLang fails here too, with an "
                                  "AttributeError")
    return _ints(v, "free_index")


def _ints(v: Any, where: str) -> np.ndarray:
    a = np.asarray(v)
    if a.size == 0:
        return _EMPTY
    if not np.issubdtype(a.dtype, np.integer):
        raise InputError(where, f"expected integer indices, got dtype {a.dtype}")
    return a.astype(np.int64).reshape(-1)


def get_num_new_pages(seq_lens, page_size: int, prefix_lens=None, decode: bool = False) -> int:
    """SGLang ``utils.get_num_new_pages``: pages an extend (or decode) batch needs.

    Extend: ``sum(ceil(seq/ps) - ceil(prefix/ps))``.  Decode: the number of
    sequences with ``seq_len % page_size == 1``.  NOTE: with ``page_size == 1``
    that decode count is 0 although every token needs a new page; SGLang never
    builds a paged allocator with page_size 1 (it uses TokenToKVPoolAllocator),
    and the model keeps the formula as written.
    """
    seq = _ints(seq_lens, "seq_lens")
    if prefix_lens is None or decode:
        return int(np.count_nonzero(seq % page_size == 1))
    pre = _ints(prefix_lens, "prefix_lens")
    return int(np.sum((seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size))


class BaseTokenToKVPoolAllocator(abc.ABC):
    """Shared state of SGLang's device allocators (``allocator/base.py``).

    ``free_pages`` / ``release_pages`` hold PAGE ids (token ids when
    ``page_size == 1``); ``available_size()`` counts tokens.
    """

    def __init__(self, size: int, page_size: int, kvcache: Any = None, *, need_sort: bool = False):
        self.size = _count(size, "size", 1)
        self.page_size = _count(page_size, "page_size", 1)
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.free_pages: np.ndarray = _EMPTY
        self.release_pages: np.ndarray = _EMPTY
        self.is_not_in_free_group = True
        self.free_group: list[np.ndarray] = []

    @property
    def size_full(self) -> int:
        return self.size

    def available_size(self) -> int:
        """Tokens that can still be handed out: (free + released pages) x page_size."""
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def get_kvcache(self):
        return self._kvcache

    def free_page_ids(self) -> np.ndarray:
        """Every page id the allocator can hand out (``free_pages`` then ``release_pages``,
        int64; token ids when ``page_size == 1``): not held by anyone.  kvrace's own, for the
        engines' ownership checks."""
        return np.concatenate((self.free_pages, self.release_pages)).astype(np.int64, copy=False)

    def backup_state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(free_pages, release_pages)``; the arrays are never mutated in place."""
        return (self.free_pages, self.release_pages)

    def restore_state(self, state) -> None:
        self.free_pages, self.release_pages = state

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        """Release everything freed since ``free_group_begin`` as ONE ``free``
        of the concatenation (in the order the frees came)."""
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(np.concatenate(self.free_group))

    def merge_and_sort_free(self) -> None:
        """Append ``release_pages`` to ``free_pages`` and sort the result."""
        if len(self.release_pages) > 0:
            self.free_pages = np.sort(np.concatenate((self.free_pages, self.release_pages)), kind="stable")
            self.release_pages = _EMPTY

    def alloc_extend(self, *args, **kwargs):
        raise InputError("allocator", "alloc_extend is only for paged allocator")

    def alloc_decode(self, *args, **kwargs):
        raise InputError("allocator", "alloc_decode is only for paged allocator")

    @abc.abstractmethod
    def clear(self) -> None:
        """Every slot free again (slot/page 0 stays padding)."""

    @abc.abstractmethod
    def alloc(self, need_size: int):
        """``need_size`` slots in SGLang's order, or None when too few are free."""

    @abc.abstractmethod
    def free(self, free_index) -> None:
        """Give slots back (deferred while a free group is open)."""


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """``allocator/token.py``: one slot per token, slot 0 padding.

    ``alloc(n)`` returns the first ``n`` of ``free_pages``; ``free`` appends
    (to ``release_pages`` when ``need_sort``).  FIFO reuse: the slot freed
    longest ago is handed out first.
    """

    def __init__(self, size: int, page_size: int = 1, kvcache: Any = None, *, need_sort: bool = False):
        if page_size != 1:
            raise InputError("page_size", f"TokenToKVPoolAllocator has page_size 1 (SGLang passes 1), "
                                          f"got {show(page_size)}; use PagedTokenToKVPoolAllocator")
        super().__init__(size, 1, kvcache, need_sort=need_sort)
        self.clear()

    def clear(self) -> None:
        # NOTE: slot 0 is SGLang's padding slot (dummy outputs of padded tokens).
        self.free_pages = np.arange(1, self.size + 1, dtype=np.int64)
        self.is_not_in_free_group = True
        self.free_group = []
        self.release_pages = _EMPTY

    def available_size(self) -> int:
        return len(self.free_pages) + len(self.release_pages)

    def alloc(self, need_size: int):
        need_size = _count(need_size, "need_size")
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        out = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return out

    def free(self, free_index) -> None:
        idx = _free_indices(free_index)
        if idx.size == 0:
            return
        if self.is_not_in_free_group:
            if self.need_sort:
                self.release_pages = np.concatenate((self.release_pages, idx))
            else:
                self.free_pages = np.concatenate((self.free_pages, idx))
        else:
            self.free_group.append(idx)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """``allocator/paged.py``: whole pages, page 0 padding.

    ``free_pages`` holds page ids ``1..size // page_size``.  ``alloc(n)`` takes
    ``n // page_size`` pages from the front (NOTE: SGLang only asserts
    page alignment in debug mode; a non-multiple is floored, as there).
    ``free(idx)`` PREPENDS ``unique(idx // page_size)`` (sorted ascending), so a
    freed page is reused before older free pages.
    """

    def __init__(self, size: int, page_size: int, kvcache: Any = None, *, need_sort: bool = False):
        super().__init__(size, page_size, kvcache, need_sort=need_sort)
        self.num_pages = self.size // self.page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self.is_not_in_free_group = True
        self.free_group = []
        self.release_pages = _EMPTY

    def _pages_to_tokens(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int64)).reshape(-1)

    def alloc(self, need_size: int):
        need_size = _count(need_size, "need_size")
        num_pages = need_size // self.page_size
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        out_pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return self._pages_to_tokens(out_pages)

    def free(self, free_index) -> None:
        """Release the pages of ``free_index``: ``unique(free_index // page_size)``
        (sorted ascending) goes to the FRONT of ``free_pages`` (of
        ``release_pages`` with ``need_sort``).  Freeing one token of a page
        frees the whole page, as in SGLang."""
        idx = _free_indices(free_index)
        if idx.size == 0:
            return
        if self.is_not_in_free_group:
            pages = unique_sorted(idx // self.page_size)
            if self.need_sort:
                self.release_pages = np.concatenate((pages, self.release_pages))
            else:
                self.free_pages = np.concatenate((pages, self.free_pages))
        else:
            self.free_group.append(idx)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens: int, num_new_pages: int | None = None):
        """Slots for extending each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        Per request, in batch order (``alloc_extend_naive`` / ``alloc_extend_kernel``):
        first the rest of the request's last partial page (``last_loc[i] + 1, ...``),
        then its new full pages, then a new partial page; request ``i``'s new
        pages are ``free_pages[s_i : s_i + n_i]`` where ``n_i = ceil(seq/ps) -
        ceil(prefix/ps)`` and ``s_i`` is the sum of ``n_j`` for ``j < i``.  The
        last of them is the partial page.  All new pages are then removed
        from the front of ``free_pages``; with too few pages nothing is taken
        and ``None`` is returned.
        """
        pre = _ints(prefix_lens, "prefix_lens")
        seq = _ints(seq_lens, "seq_lens")
        last = _ints(last_loc, "last_loc")
        n_tok = _count(extend_num_tokens, "extend_num_tokens")
        ps = self.page_size
        bs = len(pre)
        if not (len(seq) == bs == len(last)):
            raise InputError("seq_lens", f"expected prefix_lens, seq_lens and last_loc of one length, "
                                         f"got {bs}, {len(seq)}, {len(last)}")
        if np.any(seq < pre):
            raise InputError("seq_lens", "expected seq_lens >= prefix_lens")
        if int(np.sum(seq - pre)) != n_tok:
            raise InputError("extend_num_tokens", f"expected sum(seq_lens - prefix_lens) = "
                                                  f"{int(np.sum(seq - pre))}, got {n_tok}")
        # NOTE: the sort condition is SGLang's estimate, not the exact page count.
        if self.need_sort and n_tok // ps + bs + 1 > len(self.free_pages):
            self.merge_and_sort_free()
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(_ints(seq_lens_cpu, "seq_lens_cpu"), ps,
                                              _ints(prefix_lens_cpu, "prefix_lens_cpu"))
        if num_new_pages > len(self.free_pages):
            return None
        out = np.empty(n_tok, dtype=np.int64)
        new_pages = (seq + ps - 1) // ps - (pre + ps - 1) // ps
        start_page = np.cumsum(new_pages) - new_pages
        out_start = np.cumsum(seq - pre) - (seq - pre)
        pos = np.arange(ps, dtype=np.int64)
        for i in range(bs):
            p, s, o = int(pre[i]), int(seq[i]), int(out_start[i])
            part1 = min(s, (p + ps - 1) // ps * ps) - p
            out[o:o + part1] = last[i] + 1 + pos[:part1]
            if p + part1 == s:
                continue
            part2 = (s // ps - (p + ps - 1) // ps) * ps
            if part2:
                pages = self.free_pages[start_page[i]:start_page[i] + part2 // ps]
                out[o + part1:o + part1 + part2] = (pages[:, None] * ps + pos[None, :]).reshape(-1)
            if p + part1 + part2 == s:
                continue
            part3 = s - s // ps * ps
            page = self.free_pages[start_page[i] + new_pages[i] - 1]
            out[o + part1 + part2:o + part1 + part2 + part3] = page * ps + pos[:part3]
        self.free_pages = self.free_pages[int(num_new_pages):]
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        """One slot per request for its token number ``seq_lens[i]`` (1-based).

        ``alloc_decode_kernel``: if the token falls into the request's current
        page the slot is ``last_loc[i] + 1``; otherwise it opens a new page,
        ``free_pages[k]`` where ``k`` counts the earlier requests that opened
        one, and the slot is that page's first.  The pages taken are then
        ``get_num_new_pages(decode=True)`` from the front.
        """
        seq = _ints(seq_lens, "seq_lens")
        last = _ints(last_loc, "last_loc")
        ps = self.page_size
        bs = len(seq)
        if len(last) != bs:
            raise InputError("last_loc", f"expected one last_loc per request ({bs}), got {len(last)}")
        if np.any(seq < 1):
            raise InputError("seq_lens", "expected seq_lens >= 1 (the new token is counted)")
        if self.need_sort and bs > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = get_num_new_pages(_ints(seq_lens_cpu, "seq_lens_cpu"), ps, decode=True)
        opens = (seq + ps - 1) // ps - (seq - 1 + ps - 1) // ps
        if int(opens.sum()) > len(self.free_pages) or num_new_pages > len(self.free_pages):
            # NOTE: the kernel would read past free_pages here; SGLang then returns None.
            return None
        out = last + 1
        k = np.cumsum(opens) - opens
        new = opens == 1
        out = np.where(new, self.free_pages[np.minimum(k, max(len(self.free_pages) - 1, 0))] * ps
                       if len(self.free_pages) else 0, out)
        self.free_pages = self.free_pages[num_new_pages:]
        return out.astype(np.int64)
