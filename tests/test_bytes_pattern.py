"""Pattern bytes: the documented bit layout, determinism, decoding."""
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.bytes import Origin, decode_words, pattern_bytes, pattern_runs

M32 = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_stream(o: Origin, stream_offset: int, nbytes: int) -> bytes:
    """Pure-Python pattern bytes, straight from the layout in pattern.py's docstring."""
    text = f"{o.kind}|{o.layer}|{o.owner}|{o.version}|{o.unit_bytes}"
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
    ub = o.unit_bytes
    out = bytearray()
    for u in range(stream_offset // ub, (stream_offset + nbytes - 1) // ub + 1):
        seed = _fmix32(h ^ ((u * 0x9E3779B1) & M32))
        unit = bytearray()
        for w in range(-(-ub // 8)):
            check = _fmix32(seed ^ ((w * 0x85EBCA6B) & M32) ^ h) & 0xFFFF
            unit += ((seed << 32) | (w << 16) | check).to_bytes(8, "little")
        out += unit[:ub]
    start = stream_offset - (stream_offset // ub) * ub
    return bytes(out[start:start + nbytes])


IDX = Origin("index_k", 7, 12, 1, 132)
# computed once with reference_stream above (blake2b of "index_k|7|12|1|132" is 0xee4c4d85)
IDX_UNIT_3301_FIRST_24 = "de1f0000499eb94a60960100499eb94aabb10200499eb94a"


def test_fixed_value():
    assert reference_stream(IDX, 3301 * 132, 24).hex() == IDX_UNIT_3301_FIRST_24
    assert pattern_bytes(IDX, 3301 * 132, 24).tobytes().hex() == IDX_UNIT_3301_FIRST_24
    assert int(IDX.hash32) == 0xEE4C4D85


def test_same_bytes_in_another_process():
    code = ("from sim.bytes.pattern import Origin, pattern_bytes;"
            "print(pattern_bytes(Origin('kv', 3, 40, 0, 656), 88 * 656 - 5, 700).tobytes().hex())")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PYTHONPATH": root}, cwd=root)
    here = pattern_bytes(Origin("kv", 3, 40, 0, 656), 88 * 656 - 5, 700).tobytes().hex()
    assert out.stdout.strip() == here


origins = st.builds(Origin, kind=st.sampled_from(["kv", "index_k", "latent"]),
                    layer=st.integers(0, 60), owner=st.integers(-1, 10**6),
                    version=st.integers(0, 5),
                    unit_bytes=st.sampled_from([1, 3, 7, 8, 9, 132, 256, 656, 8448]))


@settings(max_examples=150, deadline=None)
@given(o=origins, start=st.integers(0, 10**7), n=st.integers(0, 600))
def test_pattern_bytes_match_reference(o, start, n):
    assert pattern_bytes(o, start, n).tobytes() == reference_stream(o, start, n)


@settings(max_examples=100, deadline=None)
@given(o=origins, runs=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3000)),
                                 max_size=12))
def test_pattern_runs_is_concatenated_pattern_bytes(o, runs):
    ref = b"".join(pattern_bytes(o, s, n).tobytes() for s, n in runs)
    got = pattern_runs(o, [s for s, _ in runs], [n for _, n in runs])
    assert got.tobytes() == ref


def test_pattern_runs_large_batches():
    o = Origin("index_k", 1, 2, 3, 132)
    got = pattern_runs(o, [5, 10**6 + 3], [20_000_001, 3])   # crosses the internal batch size
    ref = np.concatenate([pattern_bytes(o, 5, 20_000_001), pattern_bytes(o, 10**6 + 3, 3)])
    assert np.array_equal(got, ref)


def _unit_words(o: Origin, unit: int, phase: int) -> np.ndarray:
    """The full 8-byte words of ``unit``, read out of a stream that starts
    ``phase`` bytes before the unit (so the unit is not 8-aligned in the read)."""
    ub = o.unit_bytes
    raw = pattern_bytes(o, unit * ub - phase, phase + ub)[phase:]
    full = ub // 8
    return raw[:full * 8].copy().view("<u8")


@settings(max_examples=200, deadline=None)
@given(cands=st.lists(origins, min_size=1, max_size=6, unique=True), pick=st.integers(0, 5),
       unit=st.integers(0, (1 << 31) - 1), phase=st.integers(0, 7))
def test_decode_round_trip(cands, pick, unit, phase):
    pick %= len(cands)
    o = cands[pick]
    if o.unit_bytes < 8:
        return                                   # no full word to decode
    words = _unit_words(o, unit, min(phase, unit * o.unit_bytes))
    idx, u, w = decode_words(words, cands)
    # a word decodes to an earlier candidate with probability ~2**-16 per candidate
    ok = idx == pick
    assert ok.mean() >= 0.9
    assert (u[ok] == unit).all()
    assert (w[ok] == np.arange(len(words))[ok]).all()


def test_decode_many_units_of_132_byte_rows():
    cands = [Origin("index_k", layer, owner, 1, 132) for layer in (0, 7) for owner in (3, 12)]
    o = cands[3]
    units = np.arange(3000, 3100)
    stream = pattern_bytes(o, int(units[0]) * 132, len(units) * 132)
    rows = stream.reshape(len(units), 132)[:, :128].copy()   # the 16 full words of each unit
    idx, u, w = decode_words(rows.view("<u8").reshape(-1), cands)
    assert (idx == 3).all()
    assert np.array_equal(u, np.repeat(units, 16))
    assert np.array_equal(w, np.tile(np.arange(16), len(units)))
    # the tail word (4 bytes) padded with garbage does not decode as a whole word
    tails = np.zeros((len(units), 8), dtype=np.uint8)
    tails[:, :4] = stream.reshape(len(units), 132)[:, 128:]
    tails[:, 4:] = 0xA5
    idx, _, _ = decode_words(tails.view("<u8").reshape(-1), cands)
    assert (idx < 0).mean() > 0.99


def test_garbage_mostly_decodes_to_minus_one():
    rng = np.random.default_rng(7)
    garbage = rng.integers(0, np.iinfo(np.uint64).max, 200_000, dtype=np.uint64, endpoint=True)
    cands = [Origin("kv", layer, owner, 0, 656) for layer in range(4) for owner in range(4)]
    idx, u, w = decode_words(garbage, cands)
    assert (idx < 0).mean() > 0.999
    assert ((u < 0) == (idx < 0)).all() and ((w < 0) == (idx < 0)).all()


def test_other_origin_does_not_decode():
    a, b = Origin("kv", 1, 2, 0, 656), Origin("kv", 1, 2, 1, 656)
    words = pattern_bytes(a, 0, 656 * 50).view("<u8")
    idx, _, _ = decode_words(words, [b])
    assert (idx < 0).mean() > 0.99


def test_origin_rejects_bad_unit_bytes():
    with pytest.raises(ValueError):
        Origin("kv", 0, 0, 0, 0)
    with pytest.raises(ValueError):
        Origin("kv", 0, 0, 0, (1 << 19) + 1)
