"""The cost model on arrays (``step_cost_of``, the decode step model's KV bytes) gives the
same floats, bit for bit, as the per-request Python loops it replaces (kept here as the
reference), on random batches of every compute kind and layer kind of both model families,
and the decode step model's durations equal the reference's."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine import decode
from sim.engine.cost import CostModel, OpCost, seq_sum, step_cost, step_cost_of
from sim.engine.decode import DecodeStepModel
from sim.engine.models import model
from sim.profile import load_profile


def step_cost_before(kind, dims, layer_kind, requests, kv_bytes, tp=1, tokens_per_entry=1) -> OpCost:
    """``step_cost`` as it was (commit db55433): one Python step per request."""
    q_total = sum(r.new_tokens for r in requests)
    if kind == "indexer":
        flops = sum(2.0 * r.new_tokens * math.ceil(r.context_tokens / tokens_per_entry)
                    * dims.index_heads * dims.index_head_dim for r in requests)
        return OpCost("indexer", flops, 0.0, kv_bytes, "fp8")
    if kind == "attention":
        flops = 0.0
        for r in requests:
            entries = math.ceil(r.context_tokens / tokens_per_entry)
            if layer_kind == "swa":
                attended = min(dims.window, r.context_tokens)
            elif layer_kind == "c128":
                attended = entries + min(dims.window, r.context_tokens)
            else:
                attended = min(dims.index_topk, entries) + min(dims.window, r.context_tokens)
            flops += 2.0 * r.new_tokens * attended * dims.heads * (dims.qk_head_dim + dims.v_head_dim) / tp
        return OpCost("attention", flops, 0.0, kv_bytes, "bf16")
    return OpCost("ffn", 2.0 * q_total * dims.active_params_per_layer / tp,
                  dims.active_params_per_layer * dims.weight_bytes_per_param / tp, 0.0, "fp8")


@dataclass(frozen=True)
class _R:
    new_tokens: int
    context_tokens: int


def _bits(c: OpCost):
    return (c.name, repr(c.flops), type(c.flops), repr(c.weight_bytes), repr(c.kv_bytes), c.dtype, c.launches)


FAMILIES = ["dsa-v3.2", "deepseek-v4-flash"]
_context = st.one_of(st.integers(1, 300), st.integers(1, 2_000_000), st.sampled_from([127, 128, 129, 255, 256, 257,
                                                                                       4095, 4096, 4097]))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FAMILIES), st.sampled_from(["indexer", "attention", "ffn"]),
       st.sampled_from(["swa", "c4", "c128", "dsa"]),
       st.lists(st.tuples(st.integers(1, 70_000), _context), max_size=80),
       st.sampled_from([1, 2, 3, 4, 7, 8]), st.sampled_from([1, 4, 128, 3]))
def test_step_cost_equals_the_per_request_loop(family, kind, layer_kind, reqs, tp, tpe):
    dims = model(family).dims
    requests = [_R(n, max(n, c)) for n, c in reqs]
    want = _bits(step_cost_before(kind, dims, layer_kind, requests, 1234, tp, tpe))
    assert _bits(step_cost(kind, dims, layer_kind, requests, 1234, tp, tpe)) == want
    assert _bits(step_cost_of(kind, dims, layer_kind, [r.new_tokens for r in requests],
                              [r.context_tokens for r in requests], 1234, tp, tpe)) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e12, allow_nan=False), max_size=50))
def test_seq_sum_adds_left_to_right(xs):
    total = 0
    for x in xs:
        total += x
    got = seq_sum(np.array(xs, np.float64))
    assert repr(got) == repr(total) and type(got) is type(total)


class _DecodeBefore(DecodeStepModel):
    """The decode step model with its KV bytes as they were (a loop over the contexts)."""

    def _kv_bytes(self, role, contexts):
        p = self.pools[role]
        per_entry = p.page_bytes / p.entries_per_page
        win = self.model.dims.window
        total = 0
        for c in contexts.tolist():
            c = min(c, win) if role == "swa" and win else c
            total += math.ceil(c / p.tokens_per_entry) * per_entry
        return int(total)


def _step_cost_of_before(kind, dims, layer_kind, new_tokens, context_tokens, kv_bytes, tp=1, tokens_per_entry=1):
    return step_cost_before(kind, dims, layer_kind, [_R(n, c) for n, c in zip(np.asarray(new_tokens).tolist(),
                                                                              np.asarray(context_tokens).tolist())],
                            kv_bytes, tp, tokens_per_entry)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 4])
def test_decode_step_durations_equal_the_loops(family, tp, monkeypatch):
    fam = model(family)
    opts = {"index_k_dtype": "fp8", "index_k_store": "fallback", "indexer_path": "cuda"} if family == "dsa-v3.2" \
        else {"index_k_dtype": "bf16"}
    cost = CostModel.from_profile(load_profile("h200"), 3)
    new, old = DecodeStepModel(fam, cost, opts, tp), _DecodeBefore(fam, cost, opts, tp)
    rng = np.random.default_rng(tp)
    cases = [rng.integers(1, rng.choice([300, 5000, 200_000]), int(rng.integers(1, 90))).tolist() for _ in range(60)]
    got = [repr(new.step_us(ctx, step)) for step, ctx in enumerate(cases)]
    kv = [[new._kv_bytes(role, np.array(ctx)) for role in new.pools] for ctx in cases]
    monkeypatch.setattr(decode, "step_cost_of", _step_cost_of_before)
    assert got == [repr(old.step_us(ctx, step)) for step, ctx in enumerate(cases)]
    assert kv == [[old._kv_bytes(role, np.array(ctx)) for role in old.pools] for ctx in cases]
