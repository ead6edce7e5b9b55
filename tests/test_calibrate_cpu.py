"""``gpu_backend.calibrate`` without a GPU: the fits recover known parameters from synthetic
measurements made with the simulator's own timing model, and the written profile loads with
``sim.profile.load_profile`` (every schema key, ``calibrated = true``, extras ignored)."""
from __future__ import annotations

import math

import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from gpu_backend import calibrate as cal
from sim.profile import _SCHEMA, load_profile, profile_from_dict

TRUE = {"gbps": 14.0, "launch_us": 3.5, "item_overhead_us": 0.8, "memcpy_gbps": 55.0, "memcpy_lat": 2.5,
        "d2h_gbps": 40.0, "dsv4_gbps": 52.0, "sm": 132, "rw_per_sm": 64, "cpu": 1980.0, "spin_floor": 1.2}


def synthetic_measurements(noise: float = 0.0, seed: int = 0) -> dict:
    """Measurements as ``calibrate.measure`` returns them, times from the simulator's model."""
    rng = np.random.default_rng(seed)
    rw = TRUE["sm"] * TRUE["rw_per_sm"]

    def jit(x):
        return float(x * (1 + noise * rng.standard_normal()))

    def kernel_table(rows):
        tab: dict = {}
        for prov, routine, n, ib, gbps in rows:
            us = cal.model_kernel_us(routine, n, ib, gbps=gbps, launch_us=TRUE["launch_us"],
                                     item_overhead_us=TRUE["item_overhead_us"], resident_warps=rw)
            cal._append(tab, provider=prov, routine=routine, n_items=n, item_bytes=ib, bytes=n * ib,
                        rounds=cal.model_rounds(routine, n, ib, rw), us_median=jit(us), us_p10=us,
                        us_p90=us, us_rel_sd=0.0)
        return tab

    kh = kernel_table([("builtin", "kernel_per_layer", n, ib, TRUE["gbps"])
                       for ib in (256, 576, 1152, 8448) for n in (1, 16, 64, 128, 512, 2048, 8192, 16384)]
                      + [("builtin", "dsv4_token", n, 584, TRUE["dsv4_gbps"]) for n in (1, 32, 256, 4096, 32768)])
    kd = kernel_table([("builtin", "kernel_per_layer", n, ib, TRUE["d2h_gbps"])
                       for ib in (1152, 8448) for n in (64, 1024, 8192)])

    def memcpy(gbps):
        sizes = [8192 << k for k in range(16)]
        us = [jit(TRUE["memcpy_lat"] + b / (gbps * 1e3)) for b in sizes]
        return {"bytes": sizes, "us_median": us, "us_p10": us, "us_p90": us,
                "gbps": [b / u / 1e3 for b, u in zip(sizes, us)]}

    cycles = [0, 1000, 10_000, 100_000, 1_000_000]
    spin_us = [TRUE["spin_floor"] + c / TRUE["cpu"] for c in cycles]
    req = [5.0, 20.0, 100.0, 1000.0]
    return {
        "device": {"sm_count": TRUE["sm"], "resident_warps_per_sm": TRUE["rw_per_sm"],
                   "resident_warps_source": "synthetic", "max_warps_per_sm": 64},
        "launch": {"event_floor_us": 0.5, "tiny_kernel_us": 2.25, "tiny_memcpy_h2d_us": 3.0},
        "memcpy_h2d": memcpy(TRUE["memcpy_gbps"]), "memcpy_d2h": memcpy(50.0),
        "kernel_h2d": kh, "kernel_d2h": kd,
        "hbm": {"bytes": [1 << 30], "us_median": [2 * (1 << 30) / 4.2e6]},
        "spin_cycles": {"cycles": cycles, "us_median": spin_us},
        "spin": {"requested_us": req, "cycles": [round(r * TRUE["cpu"]) for r in req],
                 "us_median": [r * 1.01 for r in req], "us_rel_sd": [0.01, 0.002, 0.001, 0.0005]},
    }


INFO = {"gpu": "NVIDIA Test GPU", "compute_capability": "9.0", "driver": "580.0", "torch": "2.11.0",
        "cuda": "13.0", "level": "full"}


def test_nnls_is_exact_and_non_negative():
    rng = np.random.default_rng(1)
    A = rng.random((30, 3))
    x_true = np.array([2.0, 0.0, 1.5])
    x = cal.nnls(A, A @ x_true)
    assert np.allclose(x, x_true, atol=1e-9)
    # a least-squares solution with a negative entry is clipped to the best non-negative one
    y = A @ np.array([1.0, -0.5, 0.2])
    x = cal.nnls(A, y)
    assert (x >= 0).all()
    r_best = np.sum((A @ x - y) ** 2)
    for trial in rng.random((200, 3)) * 2:
        assert np.sum((A @ trial - y) ** 2) >= r_best - 1e-9
    assert cal.nnls(A, y, required=(1,))[1] >= 0


def test_model_rounds_follow_the_simulators_launch_shapes():
    rw = 132 * 32
    assert cal.model_rounds("kernel_per_layer", 1, 8448, rw) == 1
    assert cal.model_rounds("kernel_per_layer", 64, 8448, rw) == 1       # 2 CTAs x 32 warps
    assert cal.model_rounds("kernel_per_layer", 65, 8448, rw) == 2
    assert cal.model_rounds("kernel_per_layer", 16384, 8448, rw) == 256
    assert cal.model_rounds("dsv4_token", 4224, 584, rw) == 1            # a warp per token, capped
    assert cal.model_rounds("dsv4_token", 4225, 584, rw) == 2
    us = cal.model_kernel_us("kernel_per_layer", 130, 1000, gbps=10.0, launch_us=2.0, item_overhead_us=0.5,
                             resident_warps=rw)
    assert us == pytest.approx(2.0 + 3 * 0.5 + 130 * 1000 / 1e4)


def test_kernel_fit_recovers_the_models_parameters():
    meas = synthetic_measurements()
    kh = cal._select(meas["kernel_h2d"], routine="kernel_per_layer")
    f = cal.fit_kernel("kernel_per_layer", kh["n_items"], kh["item_bytes"], kh["us_median"], 132 * 64)
    assert f["gbps"] == pytest.approx(TRUE["gbps"], rel=1e-6)
    assert f["launch_us"] == pytest.approx(TRUE["launch_us"], rel=1e-6)
    assert f["item_overhead_us"] == pytest.approx(TRUE["item_overhead_us"], rel=1e-6)
    assert f["rel_err_max"] < 1e-9


def test_kernel_fit_tolerates_noise_and_clips_at_zero():
    meas = synthetic_measurements(noise=0.02, seed=3)
    kh = cal._select(meas["kernel_h2d"], routine="kernel_per_layer")
    f = cal.fit_kernel("kernel_per_layer", kh["n_items"], kh["item_bytes"], kh["us_median"], 132 * 64)
    assert f["gbps"] == pytest.approx(TRUE["gbps"], rel=0.05)
    assert f["launch_us"] == pytest.approx(TRUE["launch_us"], rel=0.2)
    # times that rounds would make shorter (a negative round cost): the fit stops at 0
    n = [1, 64, 512, 4096, 16384]
    us = [5.0 + k * 1024 / 20e3 - 0.01 * cal.model_rounds("kernel_per_layer", k, 1024, 8448) for k in n]
    x, *_ = np.linalg.lstsq(np.array([[k * 1024 / 1e6, 1, cal.model_rounds("kernel_per_layer", k, 1024, 8448)]
                                      for k in n]) / np.array(us)[:, None], np.ones(5), rcond=None)
    assert x[2] < 0    # unconstrained least squares goes negative
    f0 = cal.fit_kernel("kernel_per_layer", n, [1024] * 5, us, 132 * 64)
    assert f0["item_overhead_us"] == 0.0 and f0["gbps"] > 0 and f0["launch_us"] > 0


def test_memcpy_and_spin_fits():
    meas = synthetic_measurements()
    m = cal.fit_memcpy(meas["memcpy_h2d"]["bytes"], meas["memcpy_h2d"]["us_median"])
    assert m["gbps"] == pytest.approx(TRUE["memcpy_gbps"], rel=1e-6)
    assert m["latency_us"] == pytest.approx(TRUE["memcpy_lat"], rel=1e-6)
    assert m["largest_bytes"] == 256 << 20 and m["gbps_at_largest"] < TRUE["memcpy_gbps"]
    s = cal.fit_spin(meas["spin_cycles"]["cycles"], meas["spin_cycles"]["us_median"])
    assert s["cycles_per_us"] == pytest.approx(TRUE["cpu"], rel=1e-6)
    assert s["floor_us"] == pytest.approx(TRUE["spin_floor"], rel=1e-6)
    assert cal.spin_cycles_for(101.2, TRUE["cpu"], TRUE["spin_floor"]) == 198_000
    with pytest.raises(ValueError, match="grow with cycles"):
        cal.fit_spin([0, 10, 20], [5.0, 4.0, 3.0])


def test_fit_profile_produces_every_schema_key_from_the_right_fit():
    values, fits = cal.fit_profile(synthetic_measurements())
    for sec, keys in _SCHEMA.items():
        assert set(keys) <= set(values[sec])
    link = values["link"]
    # the link comes from the warp-rate fit (a grid search: 0.4 % steps, refined)
    assert link["h2d_gbps"] == pytest.approx(TRUE["gbps"], rel=1e-3)
    assert link["launch_us"] == pytest.approx(TRUE["launch_us"], rel=1e-3)
    assert link["item_overhead_us"] == pytest.approx(TRUE["item_overhead_us"], rel=1e-3)
    # these data have no per-warp limit: the fitted warp rate never binds below the link rate
    assert link["warp_gbps"] >= 0.99 * link["h2d_gbps"]
    assert link["d2h_gbps"] == pytest.approx(TRUE["d2h_gbps"], rel=1e-6)
    assert link["memcpy_latency_us"] == pytest.approx(TRUE["memcpy_lat"], rel=1e-6)
    assert values["device"] == {"sm_count": 132, "resident_warps_per_sm": 64,
                                "hbm_gbps": pytest.approx(4200.0), "kernel_launch_us": 2.25}
    assert values["compute"]["jitter_frac"] == pytest.approx(np.median([0.002, 0.001, 0.0005]))
    # the other paths are fitted and reported beside the profile's numbers
    assert fits["builtin_dsv4_token_h2d"]["gbps"] == pytest.approx(TRUE["dsv4_gbps"], rel=1e-6)
    assert fits["memcpy_h2d"]["gbps"] == pytest.approx(TRUE["memcpy_gbps"], rel=1e-6)
    assert fits["spin"]["rel_err_median_ge_20us"] == pytest.approx(0.01)


def test_written_profile_loads_and_keeps_the_raw_data(tmp_path):
    meas = synthetic_measurements()
    text, values, fits = cal.build_profile(meas, INFO, name="test-calibrated", date="2026-11-29")
    path = tmp_path / "p.toml"
    path.write_text(text)
    prof = load_profile(str(path))
    assert prof.name == "test-calibrated" and prof.calibrated is True and prof.date == "2026-11-29"
    assert "builtin kernel_per_layer" in prof.source and "NVIDIA Test GPU" in prof.source
    assert prof.h2d_gbps == pytest.approx(TRUE["gbps"], rel=1e-3)   # warp-rate grid fit
    assert prof.resident_warps == 132 * 64
    doc = tomllib.loads(text)
    for sec, keys in _SCHEMA.items():
        assert set(keys) <= set(doc[sec]), sec
    assert doc["calibration"]["gpu"] == "NVIDIA Test GPU" and doc["calibration"]["driver"] == "580.0"
    assert doc["spin"]["cycles_per_us"] == pytest.approx(TRUE["cpu"], rel=1e-5)
    assert doc["measurements"]["memcpy_h2d"]["bytes"] == meas["memcpy_h2d"]["bytes"]
    assert doc["measurements"]["kernel_h2d"]["provider"][0] == "builtin"
    assert doc["fit"]["link_h2d"]["samples"] == 32
    assert "#" in text.splitlines()[0] and "GPU: NVIDIA Test GPU" in text
    # refitting the written file from its own measurements gives the same profile
    text2, values2, _ = cal.refit_file(str(path))
    for sec in _SCHEMA:
        for k, v in values[sec].items():
            assert values2[sec][k] == (v if isinstance(v, str) else pytest.approx(v, rel=1e-5)), (sec, k)
    # the worker rule follows the provider the link was fitted to
    assert values["link"]["kernel_workers"] == "builtin" and doc["link"]["kernel_workers"] == "builtin"


def test_calibrated_gpu_names_the_card_a_profile_was_measured_on(tmp_path):
    from gpu_backend.calibrate.profile import calibrated_gpu

    text, _, _ = cal.build_profile(synthetic_measurements(), INFO, name="x", date="2026-11-29")
    (tmp_path / "p.toml").write_text(text)
    assert calibrated_gpu(str(tmp_path / "p.toml")) == "NVIDIA Test GPU"
    assert calibrated_gpu("sim/profiles/h200-calibrated-sglang.toml") == "NVIDIA H200"
    # the name torch reports on an H100 SXM: the agreement test skips unless this GPU's name starts with it
    assert calibrated_gpu("sim/profiles/h100-calibrated-sglang.toml") == "NVIDIA H100 80GB HBM3"
    assert calibrated_gpu("sim/profiles/h200.toml") is None     # a datasheet profile


def test_profile_loader_ignores_the_extra_tables():
    text, _, _ = cal.build_profile(synthetic_measurements(), INFO, name="x", date="2026-11-29")
    doc = tomllib.loads(text)
    assert {"calibration", "spin", "fit", "measurements"} <= set(doc)
    prof = profile_from_dict(doc)
    stripped = {k: v for k, v in doc.items() if k not in ("calibration", "spin", "fit", "measurements")}
    assert profile_from_dict(stripped) == prof


def test_toml_values_are_written_as_toml():
    for v in (0.0, 1.5, 12345.678901234, 3.2e-7, -4.5e-5, 7, True, "a \"quoted\" string\n", [1, 2.5, "x"]):
        doc = tomllib.loads(f"k = {cal._toml_value(v)}")
        if isinstance(v, float):
            assert doc["k"] == pytest.approx(v, rel=1e-6)
        elif isinstance(v, list):
            assert doc["k"] == [1, 2.5, "x"]
        else:
            assert doc["k"] == v
    with pytest.raises(ValueError, match="finite"):
        cal._toml_value(math.nan)
    assert cal._toml_value(np.int64(3)) == "3" and tomllib.loads(f"k = {cal._toml_value(np.float32(2.5))}")["k"] == 2.5


def test_missing_measurements_are_named():
    meas = synthetic_measurements()
    del meas["kernel_d2h"]
    with pytest.raises(ValueError, match="kernel_d2h"):
        cal.fit_profile(meas)


def test_levels_and_default_name():
    assert cal.default_name("NVIDIA H200") == "h200-calibrated"
    assert cal.default_name("NVIDIA RTX PRO 6000 Blackwell") == "rtx-pro-6000-blackwell-calibrated"
    full, quick = cal.LEVELS["full"], cal.LEVELS["quick"]
    assert full.memcpy_bytes[0] == 8 << 10 and full.memcpy_bytes[-1] == 256 << 20
    assert quick.memcpy_bytes[-1] == 256 << 20 and quick.reps < full.reps
    for lv in cal.LEVELS.values():   # every level feeds every fit
        assert sum(len(c) for _, c in lv.kpl) >= 3 and len(lv.kpl) >= 2 and lv.d2h and len(lv.memcpy_bytes) >= 2
        assert len(lv.spin_cycles) >= 2 and lv.spin_requested_us and lv.dsv4_items
    assert sum(len(c) for _, c in quick.d2h) >= 3    # the D2H fit needs three shapes
    # the index-K page sizes of the 64 .. 1,024 B/token sweep are measured, up to 64 KiB pages
    assert {4352, 8448, 16640, 33024, 65792} <= {b for b, _ in full.kpl}
    assert all(b % 128 == 0 for b, _ in full.sglang_kpl)   # sizes SGLang's JIT kernel takes


def test_h2d_cases_fit_their_layouts():
    from sim.transfers.routines import check_bounds, plan
    rng = np.random.default_rng(0)
    for routine, n, ib in (("kernel_per_layer", 100, 8448), ("dsa_indexer_per_layer", 10, 8448),
                           ("dsv4_token", 300, 584), ("kernel_per_layer", 1, 576)):
        for direction in ("h2d", "d2h"):
            src, dst, args = cal.h2d_case(routine, n, ib, rng, direction)
            p = plan(routine, src, dst, args)
            assert p.n_items == n and p.extents.total_bytes == n * ib
            assert check_bounds(p.extents, src.nbytes, dst.nbytes) == []
            assert (src.kind == "host") == (direction == "h2d")


def test_zero_launch_fits_are_written_positive_and_d2h_falls_back():
    meas = synthetic_measurements()
    meas["memcpy_h2d"]["us_median"] = [b / 55e3 for b in meas["memcpy_h2d"]["bytes"]]   # no latency at all
    meas["kernel_d2h"] = {k: [] for k in meas["kernel_d2h"]}    # no D2H kernel copies measured
    values, fits = cal.fit_profile(meas)
    assert values["link"]["memcpy_latency_us"] == cal.MIN_POSITIVE_US and "memcpy_latency_us" in fits["clamped"]
    assert values["link"]["d2h_gbps"] == pytest.approx(50.0, rel=1e-6)
    assert "failed" in fits["link_d2h"]["what"]
    text, _, _ = cal.build_profile(meas, INFO, name="x", date="2026-11-29")
    assert profile_from_dict(tomllib.loads(text)).memcpy_latency_us == cal.MIN_POSITIVE_US


def test_bench_markdown_renders_every_row():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_providers.py"
    spec = importlib.util.spec_from_file_location("bench_providers", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = []
    for label, routine, ib in bench.CASES:
        for n in bench.COUNTS:
            prov = {"builtin": {"staged_us": 10.0, "staged_gbps": n * ib / 1e4, "launch_gbps": 1.0},
                    "torch": {"staged_us": 20.0, "staged_gbps": n * ib / 2e4},
                    "sglang": ({"note": "not supported: item_bytes 576"} if ib == 576
                               else {"staged_us": 5.0, "staged_gbps": n * ib / 5e3})}
            rows.append({"case": label, "routine": routine, "n_items": n, "item_bytes": ib, "bytes": n * ib,
                         "memcpy_gbps": 40.0, "providers": prov,
                         "builtin_over_sglang": None if ib == 576 else 0.5})
    md = bench.markdown({"gpu": "NVIDIA Test", "date": "2026-11-29", "info": {"driver": "1", "torch": "2"},
                         "ceiling_bytes": 256 << 20, "ceiling_gbps": 55.0, "reps": 9, "launch_reps": 5,
                         "seconds": 1.0, "rows": rows})
    assert "NVIDIA Test, 2026-11-29" in md and "**55.0 GB/s**" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| index-K page 8448 B |")]
    assert len(table) == 3 * len(bench.COUNTS)
    assert "**0.50**" in md and "**n/a**" in md and "not supported: item_bytes 576" in md


def test_warp_rate_fit_recovers_its_parameters():
    rw = 132 * 32
    n = [1, 4, 16, 64, 128, 512, 2048] * 3
    ib = [1152] * 7 + [8448] * 7 + [33024] * 7
    true = {"gbps": 45.0, "warp_gbps": 0.8, "launch_us": 4.0, "item_overhead_us": 1.5}
    us = cal.warp_rate_us("kernel_per_layer", n, ib, resident_warps=rw, **true)
    # one item of 8448 B is bound by the warp, not by the link
    assert us[7] == pytest.approx(4.0 + 1.5 + 8448 / 0.8e3)
    f = cal.fit_kernel_warp_rate("kernel_per_layer", n, ib, us, rw)
    for k, v in true.items():
        assert f[k] == pytest.approx(v, rel=0.02), k
    assert f["rel_err_max"] < 0.02 and "warp_gbps" in f["what"] and "proposal" not in f["what"]


def test_link_can_come_from_the_sglang_kernels(tmp_path):
    meas = synthetic_measurements()
    kh = meas["kernel_h2d"]
    for k in list(kh):   # add sglang rows: the same shapes, 3x the bandwidth
        kh[k] = kh[k] + [("sglang" if k == "provider" else v) for v in kh[k][:32]]
    kh["us_median"][-32:] = [cal.model_kernel_us("kernel_per_layer", n, b, gbps=3 * TRUE["gbps"], launch_us=2.0,
                                                 item_overhead_us=0.3, resident_warps=132 * 64)
                             for n, b in zip(kh["n_items"][-32:], kh["item_bytes"][-32:])]
    values, fits = cal.fit_profile(meas, "sglang")
    assert values["link"]["h2d_gbps"] == pytest.approx(3 * TRUE["gbps"], rel=1e-3)   # warp-rate grid fit
    assert values["link"]["launch_us"] == pytest.approx(2.0, rel=1e-3)
    assert fits["builtin_kernel_per_layer_h2d"]["gbps"] == pytest.approx(TRUE["gbps"], rel=1e-6)
    assert "sglang_kernel_per_layer_h2d_warp_rate" in fits and fits["link_h2d"]["provider"] == "sglang"
    path = tmp_path / "b.toml"
    path.write_text(cal.build_profile(meas, INFO, name="b", date="2026-11-29")[0])
    out = tmp_path / "s.toml"
    assert cal.main(["--refit", str(path), "--out", str(out), "--link-provider", "sglang", "--name", "s"]) == 0
    prof = load_profile(str(out))
    assert prof.name == "s" and prof.h2d_gbps == pytest.approx(3 * TRUE["gbps"], rel=1e-3)
    assert "to sglang kernel_per_layer" in prof.source
    with pytest.raises(ValueError, match="expected at least 3"):
        cal.fit_profile(synthetic_measurements(), "sglang")
