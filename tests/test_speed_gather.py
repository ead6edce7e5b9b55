"""The compact model's joined blocks (issue 9's speed): a gather over the blocks its extents
touch keeps the last join (``CompactBuffer._blocks_joined``), so a load-back's per-layer
copies out of one host pool join the same blocks once; every gather still equals the gather
over the whole span, before and after writes, re-cuts and writes to a clone.  A gather that
touches more than half the blocks of its span joins every block of it, kept the same way."""
import numpy as np
import pytest

from sim.bytes import CompactBuffer, OriginTable
from sim.bytes.compact import _window_gather
from tests.test_bytes_models import ORIGINS


def _span_gather(buf, s_off, lens):
    _, _, st, oid, soff, end = buf._span(int(s_off.min()), int((s_off + lens).max()))
    return _window_gather(st, oid, soff, end, s_off, lens)


def _touched(buf, s_off, lens):
    k0 = buf._first.searchsorted(s_off, "right") - 1
    k1 = buf._first.searchsorted(s_off + lens, "left")
    return sorted({k for a, b in zip(k0.tolist(), k1.tolist()) for k in range(a, b)})


def _same(buf, s_off, lens):
    got, want = buf._gather(s_off, lens), _span_gather(buf, s_off, lens)
    return all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(CompactBuffer, "block_segments", 16)


def _paged(rng, pages=200, layers=4, unit=16, chosen=12):
    """A page_first-like buffer: every (page, layer) slice its own segment, as a host pool
    after backups; returns it and the slice offsets of a few pages for layer ``L``."""
    table = OriginTable()
    buf = CompactBuffer(pages * layers * unit, table, ORIGINS[0], 0)
    for p in range(pages):
        for L in range(layers):
            buf.fill([(p * layers + L) * unit], [unit], ORIGINS[1 + (p + L) % 2], [(p * 7 + L) * unit])
    chosen = np.sort(rng.choice(pages, chosen, replace=False)).astype(np.int64)

    def layer(L):
        return (chosen * layers + L) * unit, np.full(chosen.size, unit, np.int64)
    return buf, layer


@pytest.mark.parametrize("seed", range(20))
def test_layer_after_layer_joins_once_and_stays_right(small_blocks, seed):
    rng = np.random.default_rng(seed)
    buf, layer = _paged(rng)
    assert _same(buf, *layer(0))
    entry = buf._joined
    assert entry is not None
    for L in range(1, 4):
        # the same pages' next layer: the same blocks (but where a page straddles two blocks)
        same_blocks = _touched(buf, *layer(L)) == _touched(buf, *layer(L - 1))
        assert _same(buf, *layer(L))
        assert (buf._joined is entry) == same_blocks
        entry = buf._joined
    # a write into a gathered block: joined again, and what the write left is what is gathered
    s_off, lens = layer(2)
    buf.fill([int(s_off[3]) + 4], [5], ORIGINS[2], [int(rng.integers(999))])
    assert _same(buf, s_off, lens)
    assert buf._joined is not entry
    # a clone written does not change what the original gathers
    entry = buf._joined
    twin = buf.clone()
    twin.fill([int(s_off[5])], [16], ORIGINS[0], [0])
    assert _same(twin, s_off, lens) and _same(buf, s_off, lens)
    assert buf._joined is entry
    # a write elsewhere (possibly re-cutting blocks): still right
    buf.fill([0], [int(rng.integers(1, 2000))], ORIGINS[2], [0])
    for L in range(4):
        assert _same(buf, *layer(L))


def test_most_layers_reuse_the_join(small_blocks):
    """Pages straddle blocks rarely: most next-layer gathers find the join (the cases above
    would pass with no reuse at all)."""
    reused = 0
    for seed in range(20):
        buf, layer = _paged(np.random.default_rng(seed))
        buf._gather(*layer(0))
        for L in range(1, 4):
            entry = buf._joined
            buf._gather(*layer(L))
            reused += buf._joined is entry
    assert reused >= 30


def test_the_joined_arrays_cannot_be_written(small_blocks):
    buf, layer = _paged(np.random.default_rng(0))
    buf._gather(*layer(1))
    for a in buf._joined[2]:
        assert not a.flags.writeable


@pytest.mark.parametrize("seed", range(10))
def test_a_dense_gather_joins_the_whole_span_and_reuses_it(small_blocks, seed):
    """150 of 200 pages: most blocks of the span are touched, so the span is joined whole;
    right before and after writes, and the next layer (the same span unless its first or last
    page straddles a block) finds the join."""
    rng = np.random.default_rng(seed)
    buf, layer = _paged(rng, chosen=150)
    touched = _touched(buf, *layer(0))
    assert 2 * len(touched) > touched[-1] + 1 - touched[0]
    assert _same(buf, *layer(0))
    reused = 0
    for L in range(1, 4):
        entry = buf._joined
        assert _same(buf, *layer(L))
        reused += buf._joined is entry
    assert reused >= 1
    s_off, lens = layer(1)
    buf.fill([int(s_off[40]) + 3], [7], ORIGINS[2], [int(rng.integers(999))])
    for L in range(4):
        assert _same(buf, *layer(L))
