"""``kvrace calibrate`` on a real GPU: the staged launches it times copy exactly the simulator's
bytes, the spin kernel lasts what it is asked for, and a short calibration writes a profile that
``sim.profile.load_profile`` reads with plausible numbers.

Run with ``pytest -m gpu tests/test_gpu_calibrate.py``; skipped without torch or CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import skip_unavailable_provider

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the GPU tests need torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

from gpu_backend import calibrate as cal  # noqa: E402
from gpu_backend.extents_model import apply_extents  # noqa: E402
from gpu_backend.memory import BufferSet  # noqa: E402
from gpu_backend.providers import get_provider  # noqa: E402
from sim.bytes.pattern import Origin, pattern_bytes  # noqa: E402
from sim.profile import load_profile  # noqa: E402
from sim.transfers.routines import plan  # noqa: E402

DEVICE = torch.device("cuda", torch.cuda.current_device())
SHAPES = [("kernel_per_layer", 100, 1152), ("kernel_per_layer", 70, 576), ("dsa_indexer_per_layer", 9, 8448),
          ("dsv4_token", 90, cal.DSV4_TOKEN_BYTES)]


def _available(name):
    ok, why = get_provider(name, require_available=False).available()
    if not ok:
        skip_unavailable_provider(name, why)


@pytest.mark.parametrize("provider", ["builtin", "sglang", "torch"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_staged_launches_copy_the_simulators_bytes(provider, direction):
    _available(provider)
    rng = np.random.default_rng(5)
    ran = 0
    for routine, n, ib in SHAPES:
        src_l, dst_l, args = cal.h2d_case(routine, n, ib, rng, direction)
        bs = BufferSet("cuda", guard_bytes=4096)
        src0 = pattern_bytes(Origin("kv", 0, 1, 1, src_l.unit_bytes), 0, src_l.nbytes)
        dst0 = pattern_bytes(Origin("kv", 0, 2, 1, dst_l.unit_bytes), 0, dst_l.nbytes)
        bs.add("src", src_l.nbytes, "host" if src_l.kind == "host" else "device", src0)
        bs.add("dst", dst_l.nbytes, "host" if dst_l.kind == "host" else "device", dst0)
        try:
            fn = cal.staged_launch(provider, routine, bs["src"], bs["dst"], src_l, dst_l, args, DEVICE)
        except cal.NotStaged:
            continue
        stream = torch.cuda.Stream()
        fn(stream)
        fn(stream)   # twice: a staged launch can be repeated
        stream.synchronize()
        want = apply_extents(src0, dst0, plan(routine, src_l, dst_l, args).extents)
        assert np.array_equal(bs.read("dst"), want), f"{provider} {routine} {direction}"
        assert np.array_equal(bs.read("src"), src0)
        assert bs.check_guards() == []
        ran += 1
    # sglang's JIT hicache kernel refuses the 576 B rows (not a multiple of 128)
    assert ran == (len(SHAPES) - 1 if provider == "sglang" else len(SHAPES))


def test_timer_sees_the_stream_not_the_host():
    timer = cal.Timer(DEVICE)
    floor = np.median(timer.times_us(lambda s: None, 5))
    spin = np.median(timer.times_us(lambda s: torch.cuda._sleep(2_000_000), 5))
    assert floor < 20 and spin > 200 + floor


def test_spin_kernel_lasts_what_is_asked_for():
    timer = cal.Timer(DEVICE)
    torch.cuda._sleep(50_000_000)
    cycles = [0, 100_000, 1_000_000, 3_000_000]
    us = [float(np.median(timer.times_us(lambda s, c=c: torch.cuda._sleep(c), 5, 1))) for c in cycles]
    fit = cal.fit_spin(cycles, us)
    assert 300 < fit["cycles_per_us"] < 5000, fit
    for req in (50.0, 200.0, 1000.0):
        cycles = cal.spin_cycles_for(req, fit["cycles_per_us"], fit["floor_us"])
        got = float(np.median(timer.times_us(lambda s: torch.cuda._sleep(cycles), 7)))
        assert abs(got - req) / req < 0.10, (req, got, fit)


def test_smoke_calibration_writes_a_loadable_profile(tmp_path):
    meas, info = cal.measure(cal.LEVELS["smoke"], providers=("builtin",))
    text, values, fits = cal.build_profile(meas, info, name="smoke", level="smoke")
    path = tmp_path / "smoke.toml"
    path.write_text(text)
    prof = load_profile(str(path))
    props = torch.cuda.get_device_properties(DEVICE)
    assert prof.calibrated and prof.name == "smoke"
    assert prof.sm_count == props.multi_processor_count
    assert prof.resident_warps_per_sm in (32, 64) and prof.gpus_per_link == 1
    assert 1.0 < prof.h2d_gbps < 500 and 1.0 < prof.d2h_gbps < 500
    assert 0 <= prof.launch_us < 100 and 0 <= prof.memcpy_latency_us < 100 and 0 < prof.kernel_launch_us < 100
    assert 100 < prof.hbm_gbps < 20_000
    assert 0 <= prof.jitter_frac < 0.5
    assert fits["memcpy_h2d"]["gbps_at_largest"] > 1.0
    assert info["gpu"] == props.name and "torch" in info and "driver" in info
    assert max(meas["memcpy_h2d"]["gbps"]) < 1000
