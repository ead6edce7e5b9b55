"""The roofline cost model: parameters from the profile, roofline arithmetic, keyed jitter."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sim.engine.cost import CostModel, CostParams, OpCost, keyed_normal, step_cost
from sim.engine.forward import BatchRequest
from sim.engine.models import model
from sim.errors import InputError
from sim.profile import load_profile, shipped_profiles
from tests.helpers import profile

P = CostParams(peak_bf16_tflops=1000.0, peak_fp8_tflops=2000.0, mem_gbps=4000.0, flops_efficiency=0.5,
               mem_efficiency=0.5, op_launch_us=3.0)


def test_shipped_profiles_carry_the_datasheet_terms():
    h, r = load_profile("h200"), load_profile("rtx-pro-6000")
    assert (h.peak_bf16_tflops, h.peak_fp8_tflops, h.mem_gbps) == (989.0, 1979.0, 4800.0)
    assert r.mem_gbps == 1792.0 and r.peak_fp8_tflops == 2 * r.peak_bf16_tflops
    h100 = load_profile("h100-calibrated")
    assert (h100.peak_bf16_tflops, h100.peak_fp8_tflops, h100.mem_gbps) == (989.0, 1979.0, 3350.0)
    for name in shipped_profiles():
        CostParams.from_profile(load_profile(name))


def test_a_profile_without_the_terms_is_refused_naming_the_key():
    p = profile()                      # the test profile has no [compute] roofline terms
    assert p.peak_fp8_tflops == 0.0 and p.jitter_frac == 0.0
    with pytest.raises(InputError, match=r"compute\.peak_bf16_tflops"):
        CostParams.from_profile(p)


def test_roofline_picks_the_bound_and_adds_launches():
    m = CostModel(P)
    # compute-bound: 1e9 FLOP at 2000 * 0.5 TFLOP/s = 1 us; 1 KB of bytes is negligible
    assert m.nominal_us(OpCost("a", 1e9, 0, 1000, "fp8")) == pytest.approx(3.0 + 1.0)
    # memory-bound: 2e6 B at 4000 * 0.5 GB/s = 1 us
    assert m.nominal_us(OpCost("b", 1.0, 1e6, 1e6, "bf16", launches=2)) == pytest.approx(6.0 + 1.0)
    # bf16 peak is half the fp8 peak here
    assert m.nominal_us(OpCost("c", 1e9, dtype="bf16")) == pytest.approx(3.0 + 2.0)
    with pytest.raises(InputError, match="dtype"):
        m.nominal_us(OpCost("d", 1.0, dtype="fp4"))


def test_keyed_jitter_is_a_pure_function_of_seed_and_key():
    a = [keyed_normal(1, (i, 2)) for i in range(4000)]
    assert a == [keyed_normal(1, (i, 2)) for i in range(4000)]
    assert a != [keyed_normal(2, (i, 2)) for i in range(4000)]
    assert abs(np.mean(a)) < 0.06 and abs(np.std(a) - 1) < 0.06
    m = CostModel(CostParams(**{**P.__dict__, "jitter_frac": 0.1}), seed=5)
    c = OpCost("x", 1e9, dtype="fp8")
    assert m.duration_us(c, (1, 2)) == m.duration_us(c, (1, 2)) != m.duration_us(c, (1, 3))
    assert CostModel(P, seed=5).duration_us(c, (1, 2)) == CostModel(P).nominal_us(c)


def test_step_costs_follow_the_formulas():
    dims = model("deepseek-v4-flash").dims
    reqs = [BatchRequest(1, {}, 1, 8192), BatchRequest(2, {}, 1, 1000)]
    ix = step_cost("indexer", dims, "c4", reqs, kv_bytes=4096, tp=4, tokens_per_entry=4)
    assert ix.flops == 2 * (2048 + 250) * 64 * 128 and ix.kv_bytes == 4096 and ix.dtype == "fp8"
    at = step_cost("attention", dims, "c4", reqs, 0, tp=4, tokens_per_entry=4)
    per = 64 * (512 + 512) * 2 / 4
    assert at.flops == pytest.approx(per * ((512 + 128) + (250 + 128)))
    sw = step_cost("attention", dims, "swa", reqs[:1], 0, tp=1)
    assert sw.flops == pytest.approx(2 * 128 * 64 * 1024)
    c128 = step_cost("attention", dims, "c128", reqs[:1], 0, tp=1, tokens_per_entry=128)
    assert c128.flops == pytest.approx(2 * (64 + 128) * 64 * 1024)
    ffn = step_cost("ffn", dims, "c4", reqs, 0, tp=4)
    assert ffn.flops == pytest.approx(2 * 2 * dims.active_params_per_layer / 4)
    assert ffn.weight_bytes == pytest.approx(dims.active_params_per_layer / 4)
    with pytest.raises(InputError, match="compute"):
        step_cost("softmax", dims, "c4", reqs, 0)


def test_decode_is_memory_bound_and_long_prefill_compute_bound_on_h200():
    m = CostModel.from_profile(load_profile("h200"))
    dims = model("deepseek-v4-flash").dims
    dec = step_cost("ffn", dims, "c4", [BatchRequest(1, {}, 1, 4096)], 0, tp=4)
    pre = step_cost("ffn", dims, "c4", [BatchRequest(1, {}, 8192, 8192)], 0, tp=4)
    p = m.params
    assert dec.weight_bytes / (p.mem_gbps * p.mem_efficiency * 1e3) > dec.flops / (p.peak_fp8_tflops * p.flops_efficiency * 1e6)
    assert pre.weight_bytes / (p.mem_gbps * p.mem_efficiency * 1e3) < pre.flops / (p.peak_fp8_tflops * p.flops_efficiency * 1e6)
    assert m.nominal_us(pre) > 10 * m.nominal_us(dec)
