"""Device allocators: slot order written out by hand from SGLang 0.5.14's
``mem_cache/allocator/{base,token,paged}.py`` (and ``alloc_extend_naive`` /
``alloc_decode_kernel``), then properties: no slot handed out twice, exact
available_size, page-consistent slots for paged requests."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim.errors import InputError, KvraceError
from sim.pools.allocator import (
    MissingIndicesError, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator, get_num_new_pages,
)


def L(a):
    return None if a is None else [int(x) for x in a]


# ---------------------------------------------------------------- token allocator

def test_token_slot_zero_is_padding_and_alloc_takes_the_front():
    a = TokenToKVPoolAllocator(8)
    assert L(a.free_pages) == [1, 2, 3, 4, 5, 6, 7, 8] and a.available_size() == 8
    assert L(a.alloc(3)) == [1, 2, 3]
    assert a.available_size() == 5
    assert a.alloc(6) is None and a.available_size() == 5      # refused: nothing taken
    assert L(a.alloc(5)) == [4, 5, 6, 7, 8]
    assert a.alloc(1) is None


def test_token_free_appends_in_the_order_given():
    a = TokenToKVPoolAllocator(8)
    a.alloc(6)                               # 1..6; free_pages = [7, 8]
    a.free(np.array([5, 6]))
    a.free(np.array([2, 1]))
    assert L(a.free_pages) == [7, 8, 5, 6, 2, 1]
    assert L(a.alloc(3)) == [7, 8, 5]        # FIFO: oldest free first
    a.free(np.array([], dtype=np.int64))     # no-op
    assert L(a.free_pages) == [6, 2, 1]


def test_token_need_sort_releases_then_merges_sorted_only_when_short():
    a = TokenToKVPoolAllocator(8, need_sort=True)
    a.alloc(6)
    a.free(np.array([5, 6]))
    a.free(np.array([2, 1]))
    assert L(a.free_pages) == [7, 8] and L(a.release_pages) == [5, 6, 2, 1]
    assert a.available_size() == 6
    assert L(a.alloc(2)) == [7, 8]           # enough free pages: no merge
    assert L(a.release_pages) == [5, 6, 2, 1]
    assert L(a.alloc(3)) == [1, 2, 5]        # short: merge + sort first
    assert L(a.free_pages) == [6] and L(a.release_pages) == []


def test_token_free_group_is_one_free_at_the_end():
    a = TokenToKVPoolAllocator(6)
    a.alloc(6)
    a.free_group_begin()
    a.free(np.array([3]))
    a.free(np.array([1, 5]))
    assert a.available_size() == 0 and len(a.free_group) == 2
    a.free_group_end()
    assert L(a.free_pages) == [3, 1, 5] and a.is_not_in_free_group


def test_backup_and_restore_state():
    a = TokenToKVPoolAllocator(8)
    a.alloc(2)
    state = a.backup_state()
    assert L(a.alloc(3)) == [3, 4, 5]
    a.free(np.array([1]))
    a.restore_state(state)
    assert L(a.free_pages) == [3, 4, 5, 6, 7, 8] and L(a.release_pages) == []
    assert L(a.alloc(1)) == [3]


def test_token_allocator_has_page_size_one_and_clear_resets():
    with pytest.raises(InputError) as ei:
        TokenToKVPoolAllocator(8, page_size=4)
    assert ei.value.where == "page_size"
    a = TokenToKVPoolAllocator(4, kvcache="pool")
    a.alloc(3)
    a.free_group_begin()
    a.clear()
    assert L(a.free_pages) == [1, 2, 3, 4] and a.is_not_in_free_group and a.get_kvcache() == "pool"
    with pytest.raises(InputError):
        a.alloc_extend([0], [0], [1], [1], [-1], 1)


# ---------------------------------------------------------------- paged allocator

def test_paged_pages_from_one_and_alloc_floors_to_pages():
    a = PagedTokenToKVPoolAllocator(16, 4)
    assert a.num_pages == 4 and L(a.free_pages) == [1, 2, 3, 4] and a.available_size() == 16
    assert L(a.alloc(8)) == [4, 5, 6, 7, 8, 9, 10, 11]
    # NOTE: 5 tokens = 1 page (SGLang asserts alignment only in debug mode)
    assert L(a.alloc(5)) == [12, 13, 14, 15]
    assert a.alloc(8) is None and L(a.free_pages) == [4]


@pytest.mark.parametrize("make", [lambda: TokenToKVPoolAllocator(16), lambda: PagedTokenToKVPoolAllocator(16, 4)],
                         ids=["token", "paged"])
@pytest.mark.parametrize("grouped", [False, True])
def test_free_of_none_fails_as_sglangs_does_and_changes_nothing(make, grouped):
    """``free(None)`` (the tree evicting a node whose device value is gone: FINDINGS.md F3)
    fails where SGLang's ``free_index.numel()`` does, with an AttributeError that is a
    KvraceError naming the argument, in a free group too; nothing is freed."""
    a = make()
    a.alloc(8)
    if grouped:
        a.free_group_begin()
    before = (L(a.free_pages), L(a.release_pages), list(a.free_group))
    with pytest.raises(MissingIndicesError, match="free_index") as got:
        a.free(None)
    assert isinstance(got.value, AttributeError) and isinstance(got.value, KvraceError)
    assert not isinstance(got.value, ValueError)
    assert (L(a.free_pages), L(a.release_pages), list(a.free_group)) == before


def test_paged_free_prepends_sorted_unique_pages():
    a = PagedTokenToKVPoolAllocator(16, 4)
    a.alloc(12)                                  # pages 1, 2, 3; free [4]
    a.free(np.array([4, 5, 6, 7]))               # page 1
    assert L(a.free_pages) == [1, 4]
    a.free(np.array([13, 9, 12, 8]))             # pages {3, 2} -> [2, 3] in front
    assert L(a.free_pages) == [2, 3, 1, 4]
    assert L(a.alloc(4)) == [8, 9, 10, 11]       # the most recent free first
    a.free(np.array([9]))                        # one token frees its whole page
    assert L(a.free_pages) == [2, 3, 1, 4]


def test_paged_need_sort_prepends_to_release_then_merges():
    a = PagedTokenToKVPoolAllocator(16, 4, need_sort=True)
    a.alloc(16)
    a.free(np.arange(8, 12))                     # page 2
    a.free(np.arange(4, 8))                      # page 1, prepended
    assert L(a.release_pages) == [1, 2] and L(a.free_pages) == []
    a.free(np.arange(12, 16))
    assert L(a.release_pages) == [3, 1, 2]
    assert L(a.alloc(4)) == [4, 5, 6, 7]         # merged and sorted: [1, 2, 3]
    assert L(a.free_pages) == [2, 3]


def test_alloc_extend_by_hand():
    """``alloc_extend_naive``: part 1 fills the last partial page after last_loc,
    part 2 the request's new full pages, part 3 its last new (partial) page;
    request i's new pages start after the new pages of requests < i."""
    a = PagedTokenToKVPoolAllocator(32, 4)       # pages 1..8
    assert L(a.alloc(4)) == [4, 5, 6, 7]         # request A's prefix lives on page 1
    # A: prefix 2 (slots 4, 5), grows to 11; B: new, 3 tokens
    pre, seq, last = np.array([2, 0]), np.array([11, 3]), np.array([5, -1])
    out = a.alloc_extend(pre, pre, seq, seq, last, 12)
    assert L(out) == [6, 7,                      # A part 1: rest of page 1
                      8, 9, 10, 11,              # A part 2: page 2 (free_pages[0])
                      12, 13, 14,                # A part 3: page 3 (free_pages[1])
                      16, 17, 18]                # B part 3: page 4 (free_pages[2])
    assert L(a.free_pages) == [5, 6, 7, 8]


def test_alloc_extend_refuses_without_taking_pages():
    a = PagedTokenToKVPoolAllocator(8, 4)        # pages 1, 2
    pre, seq = np.array([0]), np.array([9])      # needs 3 pages
    assert a.alloc_extend(pre, pre, seq, seq, np.array([-1]), 9) is None
    assert L(a.free_pages) == [1, 2]
    with pytest.raises(InputError) as ei:
        a.alloc_extend(pre, pre, seq, seq, np.array([-1]), 8)
    assert ei.value.where == "extend_num_tokens"


def test_alloc_extend_need_sort_merges_on_sglangs_estimate():
    a = PagedTokenToKVPoolAllocator(32, 4, need_sort=True)
    a.alloc(32)
    a.free(np.arange(28, 32))                    # page 7 -> release
    a.free(np.arange(8, 12))                     # page 2 -> release [2, 7]
    # estimate 4 // 4 + 1 + 1 = 3 > 0 free pages: merge first
    pre, seq = np.array([0]), np.array([4])
    assert L(a.alloc_extend(pre, pre, seq, seq, np.array([-1]), 4)) == [8, 9, 10, 11]
    assert L(a.free_pages) == [7] and L(a.release_pages) == []


def test_alloc_decode_by_hand():
    a = PagedTokenToKVPoolAllocator(64, 4)       # pages 1..16
    a.alloc(16)                                  # pages 1..4 in use; free [5..16]
    # token 6 stays on its page (slot last+1); tokens 9 and 5 open pages, in batch order
    seq, last = np.array([6, 9, 5]), np.array([8, 15, 7])
    assert get_num_new_pages(seq, 4, decode=True) == 2
    assert L(a.alloc_decode(seq, seq, last)) == [9, 5 * 4, 6 * 4]
    assert L(a.free_pages[:2]) == [7, 8]


def test_decode_count_oddity_at_page_size_one():
    # NOTE: SGLang's decode count is sum(seq % page_size == 1): 0 at page_size 1
    assert get_num_new_pages(np.array([3, 4]), 1, decode=True) == 0
    assert get_num_new_pages(np.array([5, 9]), 4, np.array([4, 0])) == 1 + 3


# ---------------------------------------------------------------- properties

class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/free-group/sort/backup sequences on either allocator:
    no slot is ever handed out while owned, padding is never handed out, and
    available_size is exact."""

    @initialize(paged=st.booleans(), page_size=st.sampled_from([2, 4]), pages=st.integers(2, 12),
                need_sort=st.booleans())
    def setup(self, paged, page_size, pages, need_sort):
        self.ps = page_size if paged else 1
        size = pages * self.ps
        self.a = (PagedTokenToKVPoolAllocator(size, self.ps, need_sort=need_sort) if paged
                  else TokenToKVPoolAllocator(size, need_sort=need_sort))
        self.size = size
        self.owned: list[np.ndarray] = []     # page-aligned groups (paged) or token groups
        self.pending = 0                      # tokens freed inside an open free group
        self.in_group = False
        self.saved = None

    def _units(self, idx):
        return set(int(x) for x in np.asarray(idx) // self.ps)

    @rule(n=st.integers(0, 10))
    def alloc(self, n):
        need = n * self.ps
        before = self.a.available_size()
        out = self.a.alloc(need)
        if out is None:
            assert need > before
            return
        assert len(out) == need
        owned_units = set().union(*[self._units(g) for g in self.owned]) if self.owned else set()
        got = self._units(out)
        assert 0 not in got, "padding slot handed out"
        assert not got & owned_units, f"slots {sorted(got & owned_units)} handed out twice"
        assert len(got) == n
        if len(out):
            self.owned.append(out)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        g = self.owned.pop(data.draw(st.integers(0, len(self.owned) - 1)))
        perm = data.draw(st.permutations(list(g)))
        self.a.free(np.array(perm, dtype=np.int64))
        if self.in_group:
            self.pending += len(g)

    @rule()
    def group(self):
        if self.in_group:
            self.a.free_group_end()
            self.pending = 0
        else:
            self.a.free_group_begin()
        self.in_group = not self.in_group

    @rule()
    def sort(self):
        self.a.merge_and_sort_free()

    @precondition(lambda self: not self.in_group)
    @rule(restore=st.booleans())
    def backup(self, restore):
        if restore and self.saved is not None:
            self.a.restore_state(self.saved[0])
            self.owned = list(self.saved[1])
        else:
            self.saved = (self.a.backup_state(), list(self.owned))

    @invariant()
    def available_is_exact(self):
        owned = sum(len(g) for g in self.owned)
        assert self.a.available_size() == self.size - self.size % self.ps - owned - self.pending
        pages = np.concatenate([self.a.free_pages, self.a.release_pages])
        assert len(set(pages.tolist())) == len(pages), "a page is free twice"


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_paged_requests_keep_token_j_at_entry_j_mod_page(data):
    """Requests grown by alloc_extend and alloc_decode: token j of a request
    sits at entry j % ps of its (j // ps)-th page, and no slot has two owners."""
    ps = data.draw(st.sampled_from([2, 4, 8]))
    a = PagedTokenToKVPoolAllocator(ps * 24, ps)
    reqs: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 6))):
        if reqs and data.draw(st.booleans()):
            seq = np.array([len(r) + 1 for r in reqs])
            out = a.alloc_decode(seq, seq, np.array([r[-1] for r in reqs]))
            if out is None:
                break
            for r, s in zip(reqs, out):
                r.append(int(s))
        else:
            grow = data.draw(st.lists(st.integers(0, 3 * ps), min_size=len(reqs), max_size=len(reqs)))
            new = data.draw(st.lists(st.integers(1, 3 * ps), max_size=2))
            pre = np.array([len(r) for r in reqs] + [0] * len(new))
            seq = pre + np.array(grow + new)
            last = np.array([r[-1] for r in reqs] + [-1] * len(new))
            out = a.alloc_extend(pre, pre, seq, seq, last, int((seq - pre).sum()))
            if out is None:
                break
            reqs += [[] for _ in new]
            k = 0
            for r, p, s in zip(reqs, pre, seq):
                r.extend(int(x) for x in out[k:k + s - p])
                k += s - p
    flat = [s for r in reqs for s in r]
    assert len(flat) == len(set(flat))
    assert all(s // ps != 0 for s in flat)
    for r in reqs:
        for j, s in enumerate(r):
            assert s % ps == j % ps
            assert s // ps == r[j - j % ps] // ps
    pages = {s // ps for s in flat}
    assert not pages & set(int(p) for p in a.free_pages)


@pytest.mark.slow
def test_allocator_machine_deep():
    """The allocator state machine, many more and longer runs (slow tier)."""
    class Deep(AllocatorMachine.TestCase):
        settings = settings(max_examples=1500, stateful_step_count=80, deadline=None)
    Deep("runTest").runTest()


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(st.data())
def test_paged_requests_deep(data):
    test_paged_requests_keep_token_j_at_entry_j_mod_page.hypothesis.inner_test(data)
