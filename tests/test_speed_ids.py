"""The duplicate-id check of a run that keeps no ops (``sim.schedule._IdSet``: recent ids
in a set, older ones as sorted hashes behind a Bloom filter) answers what a set of every
id answers, through merges and filter growth."""
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.schedule import _IdSet

ids = st.text(alphabet="abcd_0123456789", min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(ids, max_size=400), st.integers(1, 40))
def test_id_set_answers_as_a_set(names, recent):
    got = _IdSet()
    got.RECENT = recent
    want: set[str] = set()
    for n in names:
        assert (n in got) == (n in want)
        got.add(n)
        want.add(n)
    for n in names:
        assert n in got
    assert ("#not-an-id" in got) is False


def test_bloom_filter_grows_and_keeps_every_old_id():
    got = _IdSet()
    got.RECENT = 64
    names = [f"r{k}_op" for k in range(5000)]
    sizes = set()
    for n in names:
        got.add(n)
        sizes.add(got._bits.size)
    assert len(sizes) > 2                                    # grown several times
    assert got._bits.size * 8 >= got.BLOOM_BITS_PER_ID * got._old.size
    assert all(n in got for n in names)
    misses = [f"other{k}" for k in range(2000)]
    assert not any(n in got for n in misses)
