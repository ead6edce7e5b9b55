"""A small buffer's provenance digest (one run: one pack) equals the digest of its canonical
segments (``CompactBuffer.provenance_digest``'s array path), and a read's digest
(``verdicts.read_digest``, one update of the joined texts) the per-view updates it replaces."""
import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.bytes.compact import CompactBuffer, OriginTable
from sim.bytes.pattern import Origin
from sim.memory import View
from sim.verdicts import read_digest


def _array_digest(buf) -> str:
    st_, keys, so = buf.canonical_segments()
    h = hashlib.sha256(b"kvrace-provenance-v1" + np.int64(buf.nbytes).tobytes())
    h.update(np.stack([st_, keys, so], axis=1).astype("<i8").tobytes())
    return h.hexdigest()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 8), st.integers(0, 3), st.integers(0, 500)),
                max_size=4), st.integers(0, 40), st.integers(1, 40))
def test_small_digests_equal_the_array_path(fills, off, n):
    t = OriginTable()
    buf = CompactBuffer(64, t, Origin("kv", 0, -1, 0, 16))
    for at, length, owner, soff in fills:
        length = min(length, 64 - at)
        buf.fill(np.array([at]), np.array([length]), Origin("kv", 0, owner, 0, 16), np.array([soff]))
    n = min(n, 64 - off)
    for b in (buf, buf.slice(off, n), buf.slices([off, 0], [n, 64])[0]):
        assert b.provenance_digest() == _array_digest(b)

    class Read:
        views = [View(buf.slice(off, n), None, off), View(buf.slice(0, 64), None, 0)]
    h = hashlib.sha256()
    for v in Read.views:
        h.update(f"{v.offset}:{v.compact.provenance_digest()};".encode())
    assert read_digest(Read) == h.hexdigest()
