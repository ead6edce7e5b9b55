"""Agreement on the GPU: the simulated stale probability of every free-sweep point against the
measured one (gpu_backend.agreement's test: Newcombe's interval of the difference must meet the
band of 5 points or the measured 95 % interval), for the sglang and builtin providers, and for the
minimal race (examples/index_k_ungated_race.json, sglang, free replay).

Run with ``pytest -m gpu tests/test_gpu_agreement.py``; skipped without torch or CUDA (a run
that requires a provider through ``KVRACE_REQUIRE_PROVIDERS`` fails instead of skipping).  Each
provider's points are measured once per module (100 free replays per point, or
``KVRACE_AGREEMENT_TRIALS``) and simulated with 200 seeds (``KVRACE_AGREEMENT_SEEDS``) on a
spawned process pool.  The simulated side carries the run-to-run spread of one GPU session (the profile's ``[fit.session]
jitter_us`` through the point's own window: gpu_backend.calibrate.session_fit, docs/timing.md).
Points that missed on the H200 in the latest verification run
(results/gpu_fidelity.md) are marked ``xfail`` (not strict) with the reason found there; any
other point that misses fails.  With ``KVRACE_AGREEMENT_OUT=DIR`` each provider's points are also written to
``DIR/free_sweep_<provider>.csv`` in ``benchmarks/free_sweep.py``'s format (measured and
predicted columns; no timed runs), for ``benchmarks/agreement.py`` and the sweep's plot.

Timing agreement holds for the card a profile was calibrated on (its ``[calibration] gpu``): on
another card (an H100 with the H200 profiles, say) the tests skip and say so.  Point
``KVRACE_AGREEMENT_PROFILE_SGLANG`` / ``KVRACE_AGREEMENT_PROFILE_BUILTIN`` at profiles calibrated on
the card at hand (docs/timing.md) to check it there.
"""
from __future__ import annotations

import os

import pytest

from tests.helpers import skip_unavailable_provider

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the GPU tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from gpu_backend.agreement import agreement, predict_points  # noqa: E402

TRIALS = int(os.environ.get("KVRACE_AGREEMENT_TRIALS", "100"))
SEEDS = int(os.environ.get("KVRACE_AGREEMENT_SEEDS", "200"))
EXAMPLE = "examples/index_k_ungated_race.json"
PROFILES = {"sglang": os.environ.get("KVRACE_AGREEMENT_PROFILE_SGLANG", "sim/profiles/h200-calibrated-sglang.toml"),
            "builtin": os.environ.get("KVRACE_AGREEMENT_PROFILE_BUILTIN", "sim/profiles/h200-calibrated.toml")}
GRID = {"sglang": ((128, 256, 512, 1024), (64, 256, 1024, 4096), (3.0, 10.0, 30.0)),
        "builtin": ((64, 128, 136, 256, 512, 1024), (64, 256, 1024, 4096), (3.0, 10.0, 30.0))}

#: (provider, (bytes per token, tokens, compute us)) -> why it missed in the latest verification
#: run on the H200 (round 4: every row's factor free; 8441268, results/fidelity/round4/): none
#: missed there.  Round 3's one miss (sglang 30 us, 128 B x 4,096: the row fit then held the
#: smallest row's factor at 1) agreed (GPU 0.05, simulated 0.16) and is no longer listed.
KNOWN_MISSES: dict = {}

_measured: dict = {}


def _provider(name):
    from gpu_backend.providers import ProviderError, get_provider

    try:
        return get_provider(name)
    except ProviderError as e:
        skip_unavailable_provider(name, str(e))


def _require_calibrated_card(provider: str) -> None:
    """Skip unless this GPU is the one ``provider``'s profile was calibrated on."""
    from gpu_backend.calibrate.profile import calibrated_gpu

    gpu, here = calibrated_gpu(PROFILES[provider]), torch.cuda.get_device_name()
    if gpu and not here.startswith(gpu):
        pytest.skip(f"{PROFILES[provider]} was calibrated on {gpu}, this GPU is {here}: its timings predict that "
                    f"card only (set KVRACE_AGREEMENT_PROFILE_{provider.upper()} to a profile calibrated here)")


def _measure(provider: str) -> dict:
    """Stale trials per point of ``provider``'s grid, and the simulator's stale runs."""
    _require_calibrated_card(provider)
    if provider in _measured:
        return _measured[provider]
    from gpu_backend.calibrate.spread import race_doc
    from gpu_backend.replay import replay
    from sim.schedule import validate

    prov = _provider(provider)
    sizes, tokens, computes = GRID[provider]
    points = [(b, t, c) for c in computes for b in sizes for t in tokens]
    sim = predict_points(points, PROFILES[provider], SEEDS, workers=min(16, os.cpu_count() or 1))
    spread = _session_spreads(provider, points)
    out = {}
    for p in points:
        rep = replay(validate(race_doc(*p)), prov, "free", profile=PROFILES[provider], trials=TRIALS, sim_seeds=0)
        r = rep["reads"][0]
        assert r["implausible_words"] == 0, f"{provider} {p}: implausible words on the GPU"
        out[p] = (r["stale_trials"], sim[p], rep, spread[p])
    _measured[provider] = out
    if os.environ.get("KVRACE_AGREEMENT_OUT"):
        _write_csv(provider, out, os.environ["KVRACE_AGREEMENT_OUT"])
    return out


def _session_spreads(provider: str, points: list) -> dict:
    """Each point's run-to-run spread (below, above) from the profile's ``[fit.session]
    jitter_us`` (gpu_backend.calibrate.session_fit; (0, 0) without it)."""
    from gpu_backend.calibrate.session_fit import point_session_spread, profile_jitter_us
    from sim.profile import load_profile

    sigma = profile_jitter_us(PROFILES[provider])
    prof = load_profile(PROFILES[provider])
    return {p: point_session_spread(prof, p, sigma_us=sigma) for p in points}


def _write_csv(provider: str, out: dict, folder: str) -> None:
    from benchmarks.free_sweep import write_csv
    from benchmarks.provenance import git_commit
    from gpu_backend.compare import wilson_interval

    rows = []
    for (b, t, c), (k_gpu, k_sim, rep, _) in out.items():
        r = rep["reads"][0]
        plo, phi = wilson_interval(k_sim, SEEDS)
        rows.append({"compute_us": c, "bytes_per_token": b, "tokens": t, "load_bytes": b * t, "provider": provider,
                     "device": rep["device"], "trials": TRIALS, "stale_trials": k_gpu,
                     "measured_stale": k_gpu / TRIALS, "measured_lo": r["stale_ci95"][0],
                     "measured_hi": r["stale_ci95"][1], "implausible_words": r["implausible_words"],
                     "sim_seeds": SEEDS, "sim_stale_runs": k_sim, "predicted_stale": k_sim / SEEDS,
                     "predicted_lo": plo, "predicted_hi": phi, "timed_runs": 0})
    os.makedirs(folder, exist_ok=True)
    write_csv(os.path.join(folder, f"free_sweep_{provider}.csv"), rows,
              {"command": f"KVRACE_AGREEMENT_OUT={folder} python -m pytest -m gpu tests/test_gpu_agreement.py "
                          f"(profile {PROFILES[provider]}, {TRIALS} trials, {SEEDS} seeds per point)",
               "commit": os.environ.get("KVRACE_COMMIT") or git_commit()})


def _cases():
    for provider, (sizes, tokens, computes) in GRID.items():
        for c in computes:
            for b in sizes:
                for t in tokens:
                    why = KNOWN_MISSES.get((provider, (b, t, c)))
                    marks = [pytest.mark.xfail(reason=why, strict=False)] if why else []
                    yield pytest.param(provider, (b, t, c), marks=marks, id=f"{provider}-b{b}-t{t}-c{c:g}")


@pytest.mark.parametrize("provider, point", list(_cases()))
def test_free_sweep_point_agrees_with_the_simulator(provider, point):
    k_gpu, k_sim, _, spread = _measure(provider)[point]
    a = agreement(k_gpu, TRIALS, k_sim, SEEDS, session=spread)
    assert a.agrees, (f"{provider} {point}: measured {a.p_gpu:.3f} [{a.gpu_lo:.3f}, {a.gpu_hi:.3f}], simulated "
                      f"{a.p_sim:.3f}; difference interval [{a.diff_lo:.3f}, {a.diff_hi:.3f}] outside "
                      f"[{a.band_lo:.3f}, {a.band_hi:.3f}]")


def test_minimal_race_is_predicted_inside_its_measured_interval():
    from gpu_backend.replay import replay
    from sim.schedule import load

    _require_calibrated_card("sglang")
    prov = _provider("sglang")
    n = 4 * TRIALS
    rep = replay(load(EXAMPLE), prov, "free", profile=PROFILES["sglang"], trials=n, sim_seeds=0)
    k_gpu = rep["reads"][0]["stale_trials"]
    k_sim = predict_points([EXAMPLE], PROFILES["sglang"], 2 * SEEDS)[EXAMPLE]
    import json

    from gpu_backend.calibrate.session_fit import point_session_spread, profile_jitter_us
    from sim.profile import load_profile

    with open(EXAMPLE) as f:
        doc = json.load(f)
    spread = point_session_spread(load_profile(PROFILES["sglang"]), doc,
                                  sigma_us=profile_jitter_us(PROFILES["sglang"]))
    a = agreement(k_gpu, n, k_sim, 2 * SEEDS, session=spread)
    print(f"minimal race: GPU {k_gpu}/{n}, simulated {k_sim}/{2 * SEEDS}, session spread {spread}; "
          f"inside the measured interval: {a.gpu_lo <= a.p_sim <= a.gpu_hi}")
    assert a.agrees, (f"minimal race: measured {a.p_gpu:.3f} [{a.gpu_lo:.3f}, {a.gpu_hi:.3f}], simulated "
                      f"{a.p_sim:.3f} (difference interval [{a.diff_lo:.3f}, {a.diff_hi:.3f}])")
