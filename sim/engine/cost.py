"""Roofline cost model: how long one compute op of a forward pass takes on a GPU.

An op's cost is its :class:`OpCost`: FLOPs, bytes of weights it streams, bytes
of KV it reads, the tensor dtype of its math, and its kernel launches.  Its
duration is the roofline bound plus launch overhead::

    duration_us = launches * op_launch_us
                  + max(flops / (peak(dtype) * flops_efficiency),
                        (weight_bytes + kv_bytes) / (mem_gbps * mem_efficiency))

times a seeded jitter factor ``max(0, 1 + roofline_jitter_frac * z)`` where
``z`` is a standard normal drawn from a counter-based hash of ``(seed, key)``
(``key`` names the op: forward, layer, step).  Keyed jitter, not a sequential
generator, so a forward's per-layer durations are the same numbers whether
they are issued one op per step or summed into one op (the one-step mode of
:mod:`sim.engine.forward`).

Parameters come from the hardware profile's optional ``[compute]`` terms
(``sim/profile.py``; values and their sources in ``sim/profiles/*.toml``):
``peak_bf16_tflops`` / ``peak_fp8_tflops`` (datasheet dense tensor peaks: H200
989 / 1,979 TFLOPS; RTX PRO 6000 Blackwell 500 / 1,000, derived from its
4,000 AI TOPS FP4-sparse figure), ``mem_gbps`` (datasheet memory bandwidth:
H200 4,800 GB/s, RTX PRO 6000 1,792 GB/s), ``flops_efficiency`` /
``mem_efficiency`` (estimates, uncalibrated), ``op_launch_us`` (the profile's
kernel launch cost), ``roofline_jitter_frac`` (0 in the shipped profiles,
which means ``compute.jitter_frac``: the forward's compute ops are issued
with ``jitter: false`` and the cost model's keyed jitter instead, so per-layer
and one-step forwards take exactly the same time).

What each forward op costs (:func:`step_cost`), per GPU of a TP group of
``tp`` ranks (heads and weights split over ranks; the MLA/DSA latent and the
index-K are replicated, so every rank reads all of its KV bytes):

* ``indexer``: ``2 * q_tokens * entries * index_heads * index_head_dim``
  FLOPs (q.k scores over every compressed entry), fp8; the index-K bytes read.
* ``attention``: ``2 * q_tokens * attended * heads * (qk_head_dim +
  v_head_dim) / tp`` FLOPs, bf16, with ``attended`` = the sparse budget
  ``min(index_topk, entries)`` on indexer layers, every compressed entry on C128
  layers, ``min(window, context)`` for the sliding window; the latent bytes read.
* ``ffn``: the rest of the layer (projections, shared and routed experts):
  ``2 * tokens * active_params_per_layer / tp`` FLOPs, fp8, streaming
  ``active_params_per_layer * weight_bytes_per_param / tp`` weight bytes (a
  lower bound for large batches, which touch more experts than one token's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from sim.engine.models import ModelDims
from sim.errors import InputError, require
from sim.profile import Profile

__all__ = ["CostModel", "CostParams", "OpCost", "keyed_normal", "keyed_normals", "mix64_array", "seq_sum", "step_cost",
           "step_cost_of"]

_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijective 64-bit mix."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64_array(z: np.ndarray) -> np.ndarray:
    """:func:`_mix64` of every element of a uint64 array (numpy's uint64 arithmetic wraps
    modulo 2**64, as the masks do): the same numbers."""
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _key_hash(seed: int, key: Iterable[int]) -> int:
    h = _mix64(int(seed) & _MASK)
    for k in key:
        h = _mix64(h ^ (int(k) & _MASK))
    return h


def _box_muller(a: int, b: int) -> float:
    """The standard normal of two 64-bit words (their top 53 bits as uniforms)."""
    u1 = ((a >> 11) + 1) / float(1 << 53)          # (0, 1]
    u2 = (b >> 11) / float(1 << 53)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def keyed_normal(seed: int, key: Iterable[int]) -> float:
    """A standard normal that is a pure function of ``(seed, key)`` (hash, then Box-Muller)."""
    h = _key_hash(seed, key)
    return _box_muller(_mix64(h ^ 1), _mix64(h ^ 2))


def keyed_normals(seed: int, prefix: Iterable[int], suffixes) -> list[float]:
    """``[keyed_normal(seed, (*prefix, *row)) for row in suffixes]``, the same floats bit for
    bit: ``prefix`` is hashed once and the rows (``suffixes``: an ``(n, m)`` array-like of
    int64 values, e.g. a forward's ``(layer, step)`` pairs) are mixed in together as uint64
    arrays (the same 64-bit arithmetic; an int64 value's bits are ``value & (2**64 - 1)``);
    the Box-Muller step stays per key in Python floats (``math``, as :func:`keyed_normal`:
    numpy's ``log``/``cos`` may round differently)."""
    rows = np.asarray(suffixes, np.int64)
    if rows.size == 0:
        return [keyed_normal(seed, prefix)] * len(rows)
    if rows.ndim != 2:
        raise InputError("suffixes", f"expected rows of key words (a 2-D array), got shape {rows.shape}")
    h = np.full(rows.shape[0], _key_hash(seed, prefix), np.uint64)
    for j in range(rows.shape[1]):
        h = mix64_array(h ^ rows[:, j].astype(np.uint64))
    a, b = mix64_array(h ^ np.uint64(1)).tolist(), mix64_array(h ^ np.uint64(2)).tolist()
    return [_box_muller(x, y) for x, y in zip(a, b)]


@dataclass(frozen=True)
class CostParams:
    peak_bf16_tflops: float
    peak_fp8_tflops: float
    mem_gbps: float
    flops_efficiency: float
    mem_efficiency: float
    op_launch_us: float
    jitter_frac: float = 0.0

    @classmethod
    def from_profile(cls, p: Profile) -> "CostParams":
        """The profile's ``[compute]`` roofline terms; a missing (0) one is an error naming it."""
        for key in ("peak_bf16_tflops", "peak_fp8_tflops", "mem_gbps", "flops_efficiency", "mem_efficiency",
                    "op_launch_us"):
            v = getattr(p, key)
            require(v > 0, f"profile {p.name}: compute.{key}",
                    "the roofline cost model needs this term (> 0); see sim/profiles/h200.toml")
        for key in ("flops_efficiency", "mem_efficiency"):
            require(getattr(p, key) <= 1, f"profile {p.name}: compute.{key}",
                    f"expected a fraction in (0, 1], got {getattr(p, key)}")
        # NOTE: the forward issues its compute ops pre-jittered (``jitter: false``) so that a
        # one-step forward's duration is exactly the sum of its per-layer ones; the sigma is the
        # profile's compute.jitter_frac unless roofline_jitter_frac names another
        return cls(p.peak_bf16_tflops, p.peak_fp8_tflops, p.mem_gbps, p.flops_efficiency, p.mem_efficiency,
                   p.op_launch_us, p.roofline_jitter_frac or p.jitter_frac)


@dataclass(frozen=True)
class OpCost:
    """What one compute op does: FLOPs, weight and KV bytes streamed, math dtype, launches."""

    name: str
    flops: float
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    dtype: str = "bf16"
    launches: int = 1


class CostModel:
    """Durations of :class:`OpCost` s under one GPU's :class:`CostParams`, with keyed jitter."""

    def __init__(self, params: CostParams, seed: int = 0):
        self.params = params
        self.seed = int(seed)

    @classmethod
    def from_profile(cls, profile: Profile, seed: int = 0) -> "CostModel":
        return cls(CostParams.from_profile(profile), seed)

    def nominal_us(self, c: OpCost) -> float:
        """The roofline duration without jitter."""
        p = self.params
        if c.dtype == "fp8":
            peak = p.peak_fp8_tflops
        elif c.dtype == "bf16":
            peak = p.peak_bf16_tflops
        else:
            raise InputError(f"op {c.name}.dtype", f"expected 'fp8' or 'bf16', got {c.dtype!r}")
        compute_us = c.flops / (peak * p.flops_efficiency * 1e6)          # TFLOP/s = 1e6 FLOP/us
        memory_us = (c.weight_bytes + c.kv_bytes) / (p.mem_gbps * p.mem_efficiency * 1e3)   # GB/s = 1e3 B/us
        return c.launches * p.op_launch_us + max(compute_us, memory_us)

    def duration_us(self, c: OpCost, key: Iterable[int]) -> float:
        """``nominal_us`` times the keyed jitter factor for ``key``."""
        d = self.nominal_us(c)
        if self.params.jitter_frac > 0:
            d *= max(0.0, 1.0 + self.params.jitter_frac * keyed_normal(self.seed, key))
        return d

    def durations_us(self, nominal: Sequence[float], prefix: Iterable[int], suffixes) -> list[float]:
        """``[self.duration_us(c, (*prefix, *row)) ...]`` for ops whose ``nominal_us(c)`` are
        ``nominal``, one per row of ``suffixes``: the same floats, the jitter of every key
        drawn together (:func:`keyed_normals`)."""
        j = self.params.jitter_frac
        if not j > 0:
            return list(nominal)
        return [d * max(0.0, 1.0 + j * z) for d, z in zip(nominal, keyed_normals(self.seed, prefix, suffixes))]


def step_cost(kind: str, dims: ModelDims, layer_kind: str, requests, kv_bytes: int, tp: int = 1,
              tokens_per_entry: int = 1) -> OpCost:
    """The :class:`OpCost` of compute ``kind`` (``indexer``, ``attention``, ``ffn``) of one
    layer for ``requests`` (each with ``new_tokens`` query tokens and ``context_tokens``
    attended), per GPU of ``tp`` ranks; ``tokens_per_entry`` is the layer's compression
    ratio (1 for uncompressed pools).  :func:`step_cost_of` with the requests as arrays."""
    return step_cost_of(kind, dims, layer_kind, [r.new_tokens for r in requests],
                        [r.context_tokens for r in requests], kv_bytes, tp, tokens_per_entry)


def seq_sum(values) -> float:
    """``values`` (a 1-d numpy array) added left to right from ``0``: exactly what
    ``total = 0; for v in ...: total += v`` gives (a float sum depends on its order)."""
    total = 0
    for v in values.tolist():
        total += v
    return total


def step_cost_of(kind: str, dims: ModelDims, layer_kind: str, new_tokens, context_tokens, kv_bytes: int,
                 tp: int = 1, tokens_per_entry: int = 1) -> OpCost:
    """:func:`step_cost` of requests given as two sequences (query tokens, context tokens), one
    entry per request.

    NOTE: the per-request terms are numpy arrays, computed in the order of operations of the
    scalar formulas (so every term is the same float), then added in request order as the
    scalar loop added them (:func:`seq_sum`; the indexer's by builtin ``sum``, as before): the
    same FLOPs bit for bit (``tests/test_speed_cost.py``), without a Python step per request of
    a decode batch."""
    require(tp >= 1, "tp", f"expected >= 1, got {tp}")
    nt = np.asarray(new_tokens)
    ctx = np.asarray(context_tokens)
    if kind == "indexer":
        entries = np.ceil(ctx / tokens_per_entry)
        flops = sum((2.0 * nt * entries * dims.index_heads * dims.index_head_dim).tolist())
        return OpCost("indexer", flops, 0.0, kv_bytes, "fp8")
    if kind == "attention":
        entries = np.ceil(ctx / tokens_per_entry).astype(np.int64)
        windowed = np.minimum(dims.window, ctx)
        if layer_kind == "swa":
            attended = windowed
        elif layer_kind == "c128":
            attended = entries + windowed
        else:                       # indexer layers: the top-k budget (plus the window on V4)
            attended = np.minimum(dims.index_topk, entries) + windowed
        flops = seq_sum(2.0 * nt * attended * dims.heads * (dims.qk_head_dim + dims.v_head_dim) / tp) + 0.0
        return OpCost("attention", flops, 0.0, kv_bytes, "bf16")
    if kind == "ffn":
        q_total = int(nt.sum())
        return OpCost("ffn", 2.0 * q_total * dims.active_params_per_layer / tp,
                      dims.active_params_per_layer * dims.weight_bytes_per_param / tp, 0.0, "fp8")
    raise InputError("compute", f"expected 'indexer', 'attention' or 'ffn', got {kind!r}")
