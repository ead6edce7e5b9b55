"""The read skew conditional on the bytes beside the kernel ([timing.beside.<key>] tables of
sim.profile, Profile.skew_by_beside, the executor's beside_bytes) and its fit
(gpu_backend.calibrate.spread_fit.beside_offsets)."""
from __future__ import annotations

import bisect
import copy
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.calibrate.spread import race_doc as sweep_race_doc
from gpu_backend.calibrate.spread_fit import (_copy_bytes, _copy_end, apply_to_profile_text,
                                              beside_offsets, fit_timing)
from sim.errors import InputError
from sim.executor import run_schedule
from sim.profile import QuantileTable, load_profile, profile_from_dict, tomllib
from sim.schedule import validate
from tests.test_profile_dist import BASE, doc_with, race_doc


def beside(upto, tables, key="read_after_compute_us", **plain):
    return doc_with({**plain, "beside": {key: {"upto_bytes": upto, "tables": tables}}})


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("entry, fragment, where", [
    ({"upto_bytes": [], "tables": [[1.0]]}, "1 to 64 integers", "upto_bytes"),
    ({"upto_bytes": [0], "tables": [[1.0], [2.0]]}, "integers > 0", "upto_bytes"),
    ({"upto_bytes": [10.5], "tables": [[1.0], [2.0]]}, "integers > 0", "upto_bytes"),
    ({"upto_bytes": [True], "tables": [[1.0], [2.0]]}, "integers > 0", "upto_bytes"),
    ({"upto_bytes": [20, 10], "tables": [[1.0], [2.0], [3.0]]}, "strictly increasing", "upto_bytes"),
    ({"upto_bytes": [10, 10], "tables": [[1.0], [2.0], [3.0]]}, "strictly increasing", "upto_bytes"),
    ({"upto_bytes": [10], "tables": [[1.0]]}, "len(upto_bytes) + 1 = 2", "tables"),
    ({"upto_bytes": [10], "tables": "x"}, "len(upto_bytes) + 1 = 2", "tables"),
    ({"upto_bytes": [10], "tables": [[1.0], [2.0, 1.0]]}, "non-decreasing", "tables[1]"),
    ({"upto_bytes": [10], "tables": [[1.0], [-1.0]]}, ">= 0", "tables[1]"),
    ({"upto_bytes": [10], "tables": [[1.0], [2.0]], "bytes": 3}, "unknown key", "bytes"),
    ([1.0, 2.0], "expected a table", ""),
])
def test_a_bad_beside_table_is_refused_naming_its_key(entry, fragment, where):
    d = doc_with({"beside": {"read_after_compute_us": entry}})
    with pytest.raises(InputError) as e:
        profile_from_dict(d)
    assert "timing.beside.read_after_compute_us" in str(e.value)
    assert where in str(e.value) and fragment in str(e.value)


def test_a_beside_table_needs_a_skew_key_and_beside_must_be_a_table():
    with pytest.raises(InputError, match=r"timing\.beside\.copy_rate_factor.*unknown key"):
        profile_from_dict(beside([10], [[1.0], [2.0]], key="copy_rate_factor"))
    with pytest.raises(InputError, match=r"timing\.beside\.read_after_lunch_us.*unknown key"):
        profile_from_dict(beside([10], [[1.0], [2.0]], key="read_after_lunch_us"))
    with pytest.raises(InputError, match=r"\[timing\.beside\].*expected a table"):
        profile_from_dict(doc_with({"beside": [1.0]}))


# ------------------------------------------------------------------ the bucket rule and the draw

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10 ** 7), min_size=1, max_size=8, unique=True), st.integers(0, 2 * 10 ** 7))
def test_a_kernel_draws_from_the_first_bucket_whose_bound_holds_its_bytes(bounds, nbytes):
    upto = sorted(bounds)
    p = profile_from_dict(beside(upto, [[float(i)] for i in range(len(upto) + 1)]))
    got = p.launch_skew(np.random.default_rng(0), "read", "compute", nbytes)
    want = next((i for i, u in enumerate(upto) if nbytes <= u), len(upto))
    assert got == float(want)
    assert p.beside_table("read_after_compute_us").table_for(nbytes) is \
        p.beside_table("read_after_compute_us").tables[bisect.bisect_left(upto, nbytes)]


def test_skew_by_beside_only_with_beside_tables():
    assert not profile_from_dict(copy.deepcopy(BASE)).skew_by_beside
    assert not profile_from_dict(doc_with({"read_after_compute_us": [1.0, 2.0]})).skew_by_beside
    assert profile_from_dict(beside([10], [[1.0], [2.0]])).skew_by_beside
    for name in ("h200", "rtx-pro-6000"):
        assert not load_profile(name).skew_by_beside
    for name in ("h200-calibrated", "h200-calibrated-sglang"):
        assert load_profile(name).skew_by_beside


def test_the_beside_table_of_a_key_comes_before_its_plain_table_then_the_kind():
    p = profile_from_dict(doc_with({"read_after_compute_us": [7.0], "read_us": [1.0], "copy_us": [2.0],
                                    "beside": {"read_after_compute_us": {"upto_bytes": [100], "tables": [[3.0], [4.0]]},
                                               "read_us": {"upto_bytes": [100], "tables": [[5.0], [6.0]]}}}))
    rng = np.random.default_rng(0)
    assert p.launch_skew(rng, "read", "compute", 50) == 3.0
    assert p.launch_skew(rng, "read", "compute", 101) == 4.0
    assert p.launch_skew(rng, "read", "wait", 101) == 6.0          # no key of its own: the kind's beside table
    assert p.launch_skew(rng, "copy", None, 101) == 2.0             # no beside table for copies: as before
    assert p.launch_skew(rng, "write", "host", 101) == 0.0
    # a plain table of the context comes before the kind's beside table
    q = profile_from_dict(doc_with({"read_after_wait_us": [9.0],
                                    "beside": {"read_us": {"upto_bytes": [100], "tables": [[5.0], [6.0]]}}}))
    assert q.launch_skew(rng, "read", "wait", 101) == 9.0


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["copy", "read", "write"]), st.sampled_from(["compute", "wait", "host", None]),
       st.integers(0, 10 ** 8), st.integers(0, 2 ** 32 - 1))
def test_a_profile_without_beside_tables_draws_what_it_drew_before(kind, after, nbytes, seed):
    """The old rule (the context's table, else the kind's, else the exponential) with the same
    generator, whatever bytes are beside."""
    d = doc_with({"read_after_compute_us": list(np.linspace(1, 5, 21)), "copy_us": [0.5, 1.5]})
    d["device"]["launch_jitter_us"] = 2.0
    p = profile_from_dict(d)
    a, b = np.random.default_rng(seed), np.random.default_rng(seed)
    got = [p.launch_skew(a, kind, after, nbytes) for _ in range(3)]
    key = f"{kind}_after_{after or 'first'}_us"
    table = p.timing_table(key) or p.timing_table(f"{kind}_us")
    want = [table.sample(b) if table else float(b.exponential(2.0)) for _ in range(3)]
    assert got == want and a.random() == b.random()


def test_seeded_runs_of_a_plain_table_profile_do_not_depend_on_the_beside_hook():
    """Without beside tables the executor does not work out the bytes beside: runs equal the
    ones of the same profile whose beside table holds its plain table in every bucket."""
    s = validate(race_doc(compute_us=3.0, tokens=256, row=256))
    values = list(np.linspace(0.5, 6.0, 21))
    plain = profile_from_dict(doc_with({"read_after_compute_us": values}))
    same = profile_from_dict(beside([1000, 10 ** 6], [values] * 3))
    for seed in (0, 1, 7):
        a = run_schedule(s, plain, seed=seed, materialise=False)
        b = run_schedule(s, same, seed=seed, materialise=False)
        assert a.access_us == b.access_us


def test_the_executor_passes_the_bytes_of_the_copy_in_flight():
    """A bound exactly at the copy's bytes puts the read in the first bucket (no delay: stale),
    one byte less in the second (100 us late: the copy has landed)."""
    doc = race_doc(compute_us=3.0, tokens=1024, row=1024)
    s = validate(doc)
    n = _copy_bytes(doc)
    assert n == 1024 * 1024
    early = run_schedule(s, profile_from_dict(beside([n], [[0.0], [100.0]])), seed=0, materialise=False)
    late = run_schedule(s, profile_from_dict(beside([n - 1], [[0.0], [100.0]])), seed=0, materialise=False)
    end = float(early.item_end_us["load"].max())
    assert early.access_us["read"] < end < late.access_us["read"]
    assert late.access_us["read"] == pytest.approx(early.access_us["read"] + 100.0)


def test_a_read_with_nothing_in_flight_draws_from_the_first_bucket():
    """A read long after the copy ended sees 0 bytes beside it."""
    s = validate(race_doc(compute_us=500.0, tokens=64, row=128))
    r = run_schedule(s, profile_from_dict(beside([1], [[2.0], [50.0]])), seed=0, materialise=False)
    r0 = run_schedule(s, profile_from_dict(copy.deepcopy(BASE)), seed=0, materialise=False)
    assert r.access_us["read"] == pytest.approx(r0.access_us["read"] + 2.0)


# ------------------------------------------------------------------ the fit

def _points(profile, truth: QuantileTable, offsets: dict, n=400):
    """Synthetic stale counts over c for race shapes, made with R + offsets[bytes]."""
    L, kl = profile.launch_us, profile.kernel_launch_us
    pts = []
    for (b, t), off in offsets.items():
        doc = sweep_race_doc(b, t, 1.0)
        x = _copy_end(doc, profile) - L
        for c in np.linspace(0.5, x + L + 4, 30):
            s = float(np.interp(x + L - kl - c - off, truth.values, np.linspace(0, 1, len(truth.values)),
                                left=0.0, right=1.0))
            pts.append({"bytes": b * t, "c": float(c), "n": n, "k": int(round(s * n)), "x": x, "L": L, "kl": kl,
                        "m": 0.0})
    return pts


def test_beside_offsets_recover_the_offset_of_each_bucket():
    prof = load_profile("h200")
    truth = QuantileTable(tuple(np.linspace(1.0, 4.0, 21)))
    pts = _points(prof, truth, {(128, 64): 0.0, (1024, 256): 2.0, (512, 1024): -0.5})
    out = beside_offsets(pts, list(truth.values), None, upto=(10_000, 100_000, 300_000, 600_000))
    got = [o["offset_us"] for o in out]
    assert got[0] == pytest.approx(0.0, abs=0.1)
    assert got[1] == 0.0 and out[1]["points"] == 0           # no data: the plain table
    assert got[2] == pytest.approx(2.0, abs=0.1)
    assert got[3] == pytest.approx(-0.5, abs=0.1)
    assert got[4] == 0.0 and [o["upto_bytes"] for o in out] == [10_000, 100_000, 300_000, 600_000, None]


def test_an_offset_never_makes_a_negative_delay():
    prof = load_profile("h200")
    truth = QuantileTable(tuple(np.linspace(1.0, 4.0, 21)))
    pts = _points(prof, truth, {(1024, 256): -3.0})
    out = beside_offsets(pts, list(truth.values), None, upto=(10_000,))
    assert out[1]["offset_us"] == pytest.approx(-1.0)


def test_fit_timing_writes_beside_tables_that_load_and_are_written_once():
    prof = load_profile("h200-calibrated")
    truth = QuantileTable(tuple(np.linspace(2.0, 5.0, 21)))
    from tests.test_profile_dist_fit import _scan

    shapes = []
    for b, t in ((128, 64), (1024, 256), (512, 1024)):
        sh = _scan(sweep_race_doc(b, t, 1.0), replace(prof, timing=(), timing_beside=()), truth)
        sh["timed"] = {"copy_start_us": [0.0] * 8, "copy_end_us": [20.0] * 8}
        shapes.append(sh)
    fit = fit_timing({"shapes": shapes}, prof, fixed_link=True, anchor_us=2.0)
    assert len(fit["beside"]) == len(fit["timing"]["beside"]["read_after_compute_us"]["tables"])
    with open("sim/profiles/h200-calibrated.toml") as f:
        text = f.read()
    twice = apply_to_profile_text(apply_to_profile_text(text, fit, "t"), fit, "t")
    heads = [line for line in twice.splitlines() if line.startswith("[")]
    assert heads.count("[timing.beside.read_after_compute_us]") == 1 and heads.count("[timing]") == 1
    p = profile_from_dict(tomllib.loads(twice), "t")
    bt = p.beside_table("read_after_compute_us")
    plain = np.array(p.timing_table("read_after_compute_us").values)
    for o, table in zip(fit["beside"], bt.tables):
        assert np.array(table.values) == pytest.approx(plain + o["offset_us"], abs=1e-3)
    without = fit_timing({"shapes": shapes}, prof, fixed_link=True, anchor_us=2.0, beside_upto=())
    assert "beside" not in without["timing"] and without["beside"] is None


def test_the_shipped_sglang_fit_puts_the_minimal_race_inside_its_measured_runs():
    """The minimal race's copy (256 rows of 132 B) is a point of the sglang row fit (round 3 on:
    its 8,448 B row's factor and its bucket's offset come from the fit, no longer an unmoved
    bucket): by the fit's rule its stale probability lies inside the 95 % Wilson interval of its
    four 400-trial GPU replays pooled."""
    from gpu_backend.calibrate.spread_fit import rule_margins_doc, stale_at
    from sim.sweeps import wilson_interval

    with open("examples/index_k_ungated_race.json") as f:
        doc = json.load(f)
    assert _copy_bytes(doc) == 256 * 132
    runs = ["results/fidelity/race_sglang_400.json", "results/fidelity/race_sglang_verify.json",
            "results/fidelity/race_sglang_beside.json", "results/fidelity/round3/race_sglang.json"]
    reads = [json.load(open(r))["reads"][0] for r in runs]
    k, n = sum(r["stale_trials"] for r in reads), sum(r["trials"] for r in reads)
    lo, hi = wilson_interval(k, n)
    c = next(o["duration_us"] for o in doc["ops"] if o["op"] == "compute")
    p = float(stale_at(rule_margins_doc(load_profile("h200-calibrated-sglang"), doc), c))
    assert lo <= p <= hi, (p, lo, hi)
