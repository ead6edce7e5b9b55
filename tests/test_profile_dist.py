"""The profile's [timing] distributions (sim.profile): validation, sampling, and the executor
hooks that draw from them (Profile.for_run, Profile.launch_skew)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import run_schedule
from sim.profile import QuantileTable, load_profile, profile_from_dict, timing_key
from sim.schedule import validate
from tests.helpers import profile as make_profile

BASE = {"name": "t", "calibrated": False, "source": "tests", "date": "2026-12",
        "link": {"h2d_gbps": 40.0, "d2h_gbps": 50.0, "launch_us": 4.0, "memcpy_latency_us": 8.0,
                 "item_overhead_us": 0.1, "warp_gbps": 1.0, "gpus_per_link": 1},
        "device": {"sm_count": 132, "resident_warps_per_sm": 32, "hbm_gbps": 4000.0, "kernel_launch_us": 3.5},
        "compute": {"jitter_frac": 0.0}}


def doc_with(timing):
    d = copy.deepcopy(BASE)
    d["timing"] = timing
    return d


def race_doc(compute_us=3.0, tokens=64, row=128):
    """The free sweep's schedule family (benchmarks/free_sweep.py), inlined."""
    return {
        "kvrace_schedule": 1, "name": "race",
        "buffers": [
            {"name": "host", "location": "host", "kind": "index_k",
             "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": tokens, "unit_bytes": row},
             "init": [{"layers": "all", "indices": {"start": 0, "count": tokens}, "owner": 12, "version": 1}]},
            {"name": "dev", "location": "device", "kind": "index_k",
             "layout": {"kind": "paged", "layers": 1, "pages": 2 * tokens, "page_bytes": row}},
        ],
        "streams": ["forward", "load"], "events": ["go", "loaded"],
        "ops": [
            {"id": "go", "op": "record", "stream": "forward", "event": "go"},
            {"id": "w", "op": "wait", "stream": "load", "event": "go"},
            {"id": "load", "op": "copy", "stream": "load", "routine": "kernel_per_layer", "src": "host", "dst": "dev",
             "args": {"layer": 0, "src_indices": {"start": 0, "count": tokens},
                      "dst_indices": {"start": tokens, "count": tokens}}},
            {"id": "done", "op": "record", "stream": "load", "event": "loaded"},
            {"id": "q", "op": "compute", "stream": "forward", "duration_us": compute_us},
            {"id": "read", "op": "read", "stream": "forward", "buffer": "dev", "layer": 0,
             "units": {"start": tokens, "count": tokens}},
        ]}


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("value, fragment", [
    ([], "list of 1 to"),
    ("3", "list of 1 to"),
    ([1.0, float("nan")], "list of 1 to"),
    ([1.0, True], "list of 1 to"),
    ([2.0, 1.0], "non-decreasing"),
    ([-1.0, 1.0], ">= 0"),
])
def test_a_bad_quantile_table_is_refused_naming_its_key(value, fragment):
    with pytest.raises(InputError) as e:
        profile_from_dict(doc_with({"read_after_compute_us": value}), "p")
    assert "timing.read_after_compute_us" in str(e.value) and fragment in str(e.value)


def test_rate_factor_must_be_positive_and_unknown_keys_are_named():
    with pytest.raises(InputError, match=r"timing.copy_rate_factor.*> 0"):
        profile_from_dict(doc_with({"copy_rate_factor": [0.0, 1.0]}), "p")
    with pytest.raises(InputError, match=r"timing.read_after_lunch_us.*unknown key"):
        profile_from_dict(doc_with({"read_after_lunch_us": [1.0]}), "p")
    with pytest.raises(InputError, match=r"\[timing\]"):
        profile_from_dict(doc_with([1, 2]), "p")


def test_shipped_profiles_parse_and_the_plain_ones_have_no_timing_table():
    assert load_profile("h200").timing == ()
    for name in ("h200-calibrated", "h200-calibrated-sglang", "h100-calibrated", "h100-calibrated-sglang"):
        p = load_profile(name)
        for key, table in p.timing:
            assert list(table.values) == sorted(table.values)


# ------------------------------------------------------------------ sampling

@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=2, max_size=12).map(sorted), st.integers(0, 2**32 - 1))
def test_samples_stay_inside_the_table_and_follow_its_quantiles(values, seed):
    t = QuantileTable(tuple(values))
    rng = np.random.default_rng(seed)
    xs = np.array([t.sample(rng) for _ in range(64)])
    assert (xs >= values[0]).all() and (xs <= values[-1]).all()
    # the sample equals the quantile at the uniform number it drew
    rng1, rng2 = np.random.default_rng(seed), np.random.default_rng(seed)
    assert t.sample(rng1) == pytest.approx(t.quantile(float(rng2.random())))


def test_sampled_quantiles_match_the_table():
    t = QuantileTable((0.0, 1.0, 2.0, 10.0, 20.0))
    rng = np.random.default_rng(5)
    xs = np.array([t.sample(rng) for _ in range(20000)])
    for q in (0.1, 0.25, 0.5, 0.8):
        assert np.quantile(xs, q) == pytest.approx(t.quantile(q), abs=0.15 + 0.02 * t.quantile(q))
    assert xs.mean() == pytest.approx(t.mean(), rel=0.03)


def test_a_one_value_table_is_a_constant_and_draws_nothing():
    t = QuantileTable((2.5,))
    rng = np.random.default_rng(1)
    assert t.sample(rng) == 2.5
    assert rng.random() == np.random.default_rng(1).random()


# ------------------------------------------------------------------ the executor hooks

def test_launch_skew_picks_the_context_then_the_kind_then_the_exponential():
    p = profile_from_dict(doc_with({"read_after_compute_us": [7.0], "read_us": [1.0], "copy_us": [2.0]}))
    rng = np.random.default_rng(0)
    assert p.launch_skew(rng, "read", "compute") == 7.0
    assert p.launch_skew(rng, "read", "wait") == 1.0
    assert p.launch_skew(rng, "copy", None) == 2.0
    assert p.launch_skew(rng, "write", "host") == 0.0          # no table, launch_jitter_us 0
    assert timing_key("copy", None) == "copy_after_first_us"


def test_for_run_draws_one_rate_factor_and_divides_the_rates():
    p = profile_from_dict(doc_with({"copy_rate_factor": [2.0]}))
    q = p.for_run(np.random.default_rng(0))
    assert (q.h2d_gbps, q.d2h_gbps, q.warp_gbps, q.item_overhead_us) == (20.0, 25.0, 0.5, 0.2)
    assert (q.launch_us, q.memcpy_latency_us) == (p.launch_us, p.memcpy_latency_us)
    assert q.timing_table("copy_rate_factor") is None
    assert q.for_run(None) is q
    plain = profile_from_dict(copy.deepcopy(BASE))
    assert plain.for_run(None) is plain


def test_a_profile_without_tables_gives_the_same_seeded_runs_as_before():
    """The hooks draw nothing without distributions: a run equals one with the same numbers."""
    s = validate(race_doc())
    p = make_profile()
    for seed in (0, 3):
        a = run_schedule(s, p, seed=seed, materialise=False)
        b = run_schedule(s, p, seed=seed, materialise=False)
        assert a.access_us == b.access_us
    assert p.timing == ()


def test_a_read_skew_table_moves_the_read_and_can_make_the_race_stale():
    s = validate(race_doc(compute_us=3.0, tokens=1024, row=1024))
    early = profile_from_dict(copy.deepcopy(BASE))
    late = profile_from_dict(doc_with({"read_after_compute_us": [100.0]}))
    r0 = run_schedule(s, early, seed=0, materialise=False)
    r1 = run_schedule(s, late, seed=0, materialise=False)
    assert r1.access_us["read"] == pytest.approx(r0.access_us["read"] + 100.0)
    # the copy lands long before a read 100 us late: not stale; the early read is
    end = float(r0.item_end_us["load"].max())
    assert r0.access_us["read"] < end < r1.access_us["read"]


def test_a_spread_table_gives_an_intermediate_stale_probability():
    """A read skew whose median sits at the copy's end: about half the seeded runs stale."""
    from gpu_backend.replay import simulate_stale

    s = validate(race_doc(compute_us=0.0, tokens=64, row=1024))
    d0 = copy.deepcopy(BASE)
    d0["link"]["warp_gbps"] = 0.1          # a slow copy of few items: a gap of several us, fast runs
    p0 = profile_from_dict(d0)
    r = run_schedule(s, p0, seed=0, materialise=False)
    gap = float(r.item_end_us["load"].max()) - r.access_us["read"]
    assert gap > 3
    d1 = copy.deepcopy(d0)
    d1["timing"] = {"read_after_compute_us": list(np.linspace(gap - 2, gap + 2, 5)), "copy_rate_factor": [1.0]}
    p = profile_from_dict(d1)
    stale, _ = simulate_stale(s, p, seeds=300, seed=0)
    assert 0.4 < stale["read"] / 300 < 0.6


# ------------------------------------------------------------------ SGLang's JIT worker shape

def test_kernel_workers_is_validated_by_name():
    d = copy.deepcopy(BASE)
    d["link"]["kernel_workers"] = "jit"
    with pytest.raises(InputError, match=r"link.kernel_workers"):
        profile_from_dict(d)
    assert load_profile("h200").kernel_workers == "launch"
    assert load_profile("h200-calibrated-sglang").kernel_workers == "sglang_jit"


@pytest.mark.parametrize("row, workers", [(128, 256), (512, 256), (520, 128), (1024, 128), (1032, 64), (8448, 64)])
def test_sglang_jit_rounds_follow_the_element_size(row, workers):
    """hicache.cuh: 2 blocks of 1024 threads, a worker of 32 / unroll threads per item, unroll 4
    up to 512 B, 2 up to 1024 B, else 1: item i runs in round i // workers."""
    from sim.transfers.timing import LinkTiming, item_rounds, item_times, sglang_jit_workers

    assert sglang_jit_workers(row) == workers
    s = validate(race_doc(tokens=600, row=row))
    plan = [op for op in s.ops if op.op == "copy"][0].plan
    jit = LinkTiming(gbps=50.0, workers="sglang_jit")
    aot = LinkTiming(gbps=50.0)
    assert (item_rounds(plan, jit) == np.arange(600) // workers).all()
    assert (item_rounds(plan, aot) == np.arange(600) // 64).all()
    start, end = item_times(plan, jit)
    assert (np.diff(start) >= 0).all() and (end > start).all()


def test_the_jit_rule_leaves_memcpy_copies_alone():
    from sim.transfers.timing import LinkTiming

    with pytest.raises(InputError, match="LinkTiming.workers"):
        LinkTiming(gbps=1.0, workers="x")


def test_row_factors_are_read_and_validated_by_key():
    """link.row_factor_bytes / link.row_factors: read together into Profile.row_factors and
    LinkTiming; a bad list is refused naming its key."""
    import copy

    from sim.profile import profile_from_dict, tomllib

    with open("sim/profiles/h200-calibrated-sglang.toml", "rb") as f:
        doc = tomllib.load(f)
    prof = profile_from_dict(doc)
    assert prof.row_factors and prof.link_timing(prof.h2d_gbps).row_factors == prof.row_factors
    for key, val, where in (("row_factor_bytes", [256, 128], "link.row_factor_bytes"),
                            ("row_factors", [1.0], "link.row_factors"),
                            ("row_factors", [1.0, 1.0, 1.0, 1.0, -1.0], "link.row_factors")):
        d = copy.deepcopy(doc)
        d["link"][key] = val
        with pytest.raises(InputError, match=where):
            profile_from_dict(d)
    d = copy.deepcopy(doc)
    del d["link"]["row_factor_bytes"], d["link"]["row_factors"]
    assert profile_from_dict(d).row_factors == ()
