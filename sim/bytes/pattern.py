"""Deterministic, self-describing pattern bytes.

Every byte kvrace holds comes from an *origin*: a named stream of bytes
(buffer kind, layer, owner, version) cut into units of ``unit_bytes`` (a token
row, a page).  Unit ``u`` of an origin occupies stream offsets
``[u * unit_bytes, (u + 1) * unit_bytes)``.

The bytes of a unit are 8-byte little-endian words aligned to the unit's
start.  Word ``w`` of unit ``u`` is::

    bits 63..32  seed32(origin, u)      (murmur3 fmix32 of origin hash ^ u * K)
    bits 31..16  w (16 bits)
    bits 15..0   check16(origin, seed32, w)

so a word read back from a GPU can be traced to its origin and unit without
any table of bytes: ``decode_words`` inverts the seed for a list of candidate
origins.  A unit's last word is cut short when ``unit_bytes`` is not a
multiple of 8 (132 B index-K tokens), and a unit may hold at most 2**16 words
(512 KiB).  The check ties a word to its origin: a word decodes to a wrong
candidate origin with probability 2**-16.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

MAX_UNIT_BYTES = (1 << 16) * 8
_K = np.uint32(0x9E3779B1)
_K_INV = np.uint32(pow(0x9E3779B1, -1, 1 << 32))
_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_M1_INV = np.uint32(pow(0x85EBCA6B, -1, 1 << 32))
_M2_INV = np.uint32(pow(0xC2B2AE35, -1, 1 << 32))


@dataclass(frozen=True, order=True)
class Origin:
    """A stream of pattern bytes: whose bytes these are.

    ``kind`` names the buffer kind ("index_k", "kv", ...), ``owner`` the request
    (or -1 for "no request": a pool's initial contents), ``version`` counts
    rewrites of the same logical data.
    """

    kind: str
    layer: int
    owner: int
    version: int
    unit_bytes: int

    def __post_init__(self):
        if not (0 < self.unit_bytes <= MAX_UNIT_BYTES):
            raise ValueError(
                f"origin unit_bytes: expected 1..{MAX_UNIT_BYTES}, got {self.unit_bytes}"
            )

    @property
    def hash32(self) -> np.uint32:
        text = f"{self.kind}|{self.layer}|{self.owner}|{self.version}|{self.unit_bytes}"
        return np.uint32(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little"))

    def label(self, unit: int) -> str:
        owner = "initial" if self.owner < 0 else f"request {self.owner}"
        return f"{self.kind} layer {self.layer} {owner} unit {unit} v{self.version}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "layer": self.layer, "owner": self.owner,
                "version": self.version, "unit_bytes": self.unit_bytes}


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * _M1
    h = h ^ (h >> np.uint32(13))
    h = h * _M2
    return h ^ (h >> np.uint32(16))


def _unshift(h: np.ndarray, s: int) -> np.ndarray:
    out = h.copy()
    for _ in range(32 // s + 1):
        out = h ^ (out >> np.uint32(s))
    return out


def _fmix32_inv(h: np.ndarray) -> np.ndarray:
    h = _unshift(h, 16)
    h = h * _M2_INV
    h = _unshift(h, 13)
    h = h * _M1_INV
    return _unshift(h, 16)


def unit_seeds(origin: Origin, units: np.ndarray) -> np.ndarray:
    """seed32 of each unit (uint32 array)."""
    with np.errstate(over="ignore"):
        u = np.asarray(units, dtype=np.int64).astype(np.uint32)
        return _fmix32(origin.hash32 ^ (u * _K))


def _check16(origin_hash: np.uint32, seeds: np.ndarray, words: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        mixed = _fmix32(seeds ^ (words.astype(np.uint32) * _M1) ^ origin_hash)
        return (mixed & np.uint32(0xFFFF)).astype(np.uint64)


def pattern_bytes(origin: Origin, stream_offset: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` pattern bytes of ``origin`` from ``stream_offset`` on (uint8)."""
    if nbytes <= 0:
        return np.zeros(0, dtype=np.uint8)
    ub = origin.unit_bytes
    first_unit, last_unit = stream_offset // ub, (stream_offset + nbytes - 1) // ub
    words_per_unit = -(-ub // 8)
    units = np.arange(first_unit, last_unit + 1, dtype=np.int64)
    seeds = unit_seeds(origin, units).astype(np.uint64)
    w = np.arange(words_per_unit, dtype=np.uint64)
    vals = (seeds[:, None] << np.uint64(32)) | (w[None, :] << np.uint64(16)) | _check16(
        origin.hash32, seeds[:, None].astype(np.uint32), w[None, :])
    unit_bytes_arr = vals.astype("<u8").view(np.uint8).reshape(len(units), words_per_unit * 8)[:, :ub]
    flat = unit_bytes_arr.reshape(-1)
    start = stream_offset - first_unit * ub
    return flat[start:start + nbytes].copy()


def decode_words(words: np.ndarray, candidates: list[Origin], max_unit: int = 1 << 31):
    """Trace 8-byte words back to (origin index, unit, word) over candidate origins.

    ``words`` is a uint64 array of words that are aligned to their unit's start.
    Returns three int64 arrays (origin index or -1, unit, word index); a word
    that matches no candidate (garbage, or an unknown origin) gets -1.
    """
    words = np.asarray(words, dtype=np.uint64)
    seeds = (words >> np.uint64(32)).astype(np.uint32)
    widx = ((words >> np.uint64(16)) & np.uint64(0xFFFF)).astype(np.int64)
    check = words & np.uint64(0xFFFF)
    origin_idx = np.full(len(words), -1, dtype=np.int64)
    unit = np.full(len(words), -1, dtype=np.int64)
    with np.errstate(over="ignore"):
        pre = _fmix32_inv(seeds)
        for i, o in enumerate(candidates):
            u = ((pre ^ o.hash32) * _K_INV).astype(np.int64)
            hit = ((origin_idx < 0) & (u >= 0) & (u < max_unit) & (widx < -(-o.unit_bytes // 8))
                   & (check == _check16(o.hash32, seeds, widx.astype(np.uint64))))
            origin_idx[hit] = i
            unit[hit] = u[hit]
    return origin_idx, unit, np.where(origin_idx >= 0, widx, -1)
