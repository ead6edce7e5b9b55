"""Replay on a real GPU: controlled replays must give the simulator's bytes exactly, free replays
only bytes the simulator deems possible.

Run with ``pytest -m gpu tests/test_gpu_replay.py``; skipped without torch or CUDA.
* every schedule in examples/ and examples/bugs/ with each provider that supports its routine
  (C4 example: the guard catches exactly the predicted out-of-bounds bytes);
* 200 Hypothesis schedules (plain and synchronised) with builtin and torch on 64 B units, and with
  all three providers on the same schedule with 128 B units (the SGLang JIT kernels take items
  that are a multiple of 128 B);
* a free replay of the minimal race, 50 trials per provider: every word plausible.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import example_files, skip_unavailable_provider

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the GPU tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpu_backend.providers import get_provider  # noqa: E402
from gpu_backend.replay import replay, summary_text  # noqa: E402
from sim.replay import ReplayError  # noqa: E402
from sim.schedule import load, validate  # noqa: E402
from tests.strategies import base_buffers, schedules  # noqa: E402

PROVIDER_NAMES = ("builtin", "torch", "sglang")
EXAMPLES = example_files()
RAN: dict[str, int] = {}
SKIPPED: dict[str, int] = {}


@pytest.fixture(scope="module")
def providers():
    out = {}
    for name in PROVIDER_NAMES:
        prov = get_provider(name, require_available=False)
        ok, why = prov.available()
        out[name] = prov if ok else why
    return out


def unsupported(s, prov) -> str | None:
    for op in s.ops:
        if op.op == "copy":
            ok, why = prov.supports(op.routine, s.buffers[op.src].layout, s.buffers[op.dst].layout, op.args)
            if not ok:
                return f"{op.id}: {why}"
    return None


def _check_controlled(rep):
    fm = rep["first_mismatch"]
    assert rep["reads_matching"] == rep["reads_total"], summary_text(rep)
    assert rep["oob_agree"], summary_text(rep)
    assert fm is None


@pytest.mark.parametrize("path", EXAMPLES)
@pytest.mark.parametrize("name", PROVIDER_NAMES)
def test_controlled_replay_of_every_example(providers, name, path):
    prov = providers[name]
    if isinstance(prov, str):
        skip_unavailable_provider(name, prov)
    s = load(path)
    why = unsupported(s, prov)
    if why:
        pytest.skip(f"{name} does not support {why}")
    rep = replay(s, prov, "controlled", profile="h200")
    print(summary_text(rep))
    _check_controlled(rep)
    assert rep["buffers_matching"] == rep["buffers_total"], summary_text(rep)
    if s.name == "c4_routine_on_bf16_index_k":
        e = rep["oob_detected"]["dev_index_k_bf16"]
        assert e["predicted_after_bytes"] > 0
        assert e["guard_after_bytes"] == 8 * e["predicted_after_words"]
        assert e["guard_after_bytes"] == e["predicted_after_bytes"]   # the C4 extents are whole words


def _with_unit_bytes(doc: dict, unit_bytes: int) -> dict:
    out = dict(doc)
    out["buffers"] = base_buffers(unit_bytes)
    return out


@settings(max_examples=200, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(schedules(), schedules(synchronised=True)), st.integers(0, 10_000))
def test_controlled_replay_of_generated_schedules(providers, doc, seed):
    plan = [(64, "builtin"), (64, "torch"), (128, "sglang")]
    for unit_bytes, name in plan:
        prov = providers[name]
        if isinstance(prov, str):
            SKIPPED[f"{name}: unavailable"] = SKIPPED.get(f"{name}: unavailable", 0) + 1
            continue
        s = validate(_with_unit_bytes(doc, unit_bytes))
        why = unsupported(s, prov)
        if why:
            key = f"{name}: unsupported"
            SKIPPED[key] = SKIPPED.get(key, 0) + 1
            continue
        try:
            rep = replay(s, prov, "controlled", profile="h200", seed=seed)
        except ReplayError:
            SKIPPED["ReplayError"] = SKIPPED.get("ReplayError", 0) + 1
            continue
        _check_controlled(rep)
        assert rep["buffers_matching"] == rep["buffers_total"], summary_text(rep)
        RAN[f"{name}/{unit_bytes}B"] = RAN.get(f"{name}/{unit_bytes}B", 0) + 1


def test_generated_schedules_ran_on_every_available_provider(providers):
    print(f"controlled replays of generated schedules: {RAN}; skipped: {SKIPPED}")
    for unit_bytes, name in [(64, "builtin"), (64, "torch"), (128, "sglang")]:
        if isinstance(providers[name], str):
            continue
        assert RAN.get(f"{name}/{unit_bytes}B", 0) >= 100, (RAN, SKIPPED)


@pytest.mark.parametrize("name", PROVIDER_NAMES)
def test_free_replay_of_the_minimal_race_is_plausible(providers, name):
    prov = providers[name]
    if isinstance(prov, str):
        skip_unavailable_provider(name, prov)
    s = load("examples/index_k_ungated_race.json")
    why = unsupported(s, prov)
    if why:
        pytest.skip(f"{name} does not support {why}")
    rep = replay(s, prov, "free", profile="h200", trials=50, sim_seeds=200)
    print(summary_text(rep))
    assert rep["implausible_words"] == 0, summary_text(rep)
    assert rep["reads_matching"] == rep["reads_total"] == 1
    assert rep["oob_agree"] and rep["trials"] == 50 and rep["gate_timeouts"] == 0
    r = rep["reads"][0]
    assert r["stale_ci95"][0] <= r["stale_fraction"] <= r["stale_ci95"][1]
    assert 0.0 <= rep["simulated_stale_fraction"] <= 1.0


def test_run_on_gpu_returns_timings_and_final_bytes():
    from gpu_backend.runner import initial_bytes, run_on_gpu

    s = load("examples/index_k_gated.json")
    gpu = run_on_gpu(s, "builtin")
    assert set(gpu.reads) == {"indexer_read_index_k_L0"}
    assert set(gpu.final) == set(s.buffers)
    assert gpu.guards == []
    for op_id in ("load_index_k_L0", "indexer_q_proj", "indexer_read_index_k_L0"):
        a, b = gpu.timings_us[op_id]
        assert 0 <= a <= b
    # the start gate holds every stream until all ops are issued: the forward stream's compute
    # starts right after the gate opens, not after the host has issued the copy before it
    assert gpu.gate == "flag", gpu.gate
    assert gpu.timings_us["indexer_q_proj"][0] < 100.0, gpu.timings_us
    host = [n for n, spec in s.buffers.items() if spec.location == "host"][0]
    assert np.array_equal(gpu.final[host], initial_bytes(s)[host])
    print(f"compute: {gpu.compute}; gate: {gpu.gate}; timings: {gpu.timings_us}")
