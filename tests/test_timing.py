"""Timing model: rounds, memcpy chain, partial progress."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.errors import InputError
from sim.pools.layouts import HostLayout, c4_paged, token_rows
from sim.transfers.routines import plan
from sim.transfers.timing import LinkTiming, bytes_done, copy_end_us, item_times

# 1 GB/s = 1,000 B/us keeps the hand arithmetic simple
T = LinkTiming(gbps=1.0, launch_us=2.0, item_overhead_us=0.5, memcpy_latency_us=3.0,
               resident_warps=100_000)


def per_layer(n, item_bytes=256):
    lay = token_rows(item_bytes, 1, 2000)
    return plan("kernel_per_layer", lay, lay,
                {"layer": 0, "src_indices": list(range(n)), "dst_indices": list(range(n))})


def test_rounds_of_64_warps():
    p = per_layer(65)  # 64 warps: items 0..63 in round 0, item 64 in round 1
    s, e = item_times(p, T)
    r0 = 0.5 + 64 * 256 / 1000   # 16.884 us
    r1 = 0.5 + 256 / 1000        # 0.756 us
    assert np.allclose(s[:64], 2.0) and np.allclose(e[:64], 2.0 + r0)
    assert s[64] == pytest.approx(2.0 + r0) and e[64] == pytest.approx(2.0 + r0 + r1)
    assert copy_end_us(p, T) == pytest.approx(2.0 + r0 + r1)


def test_resident_warps_cap():
    p = per_layer(65)
    t = LinkTiming(1.0, 2.0, 0.5, 3.0, resident_warps=16)
    s, e = item_times(p, t)
    # rounds of 16: 16,16,16,16,1 items
    r = 0.5 + 16 * 256 / 1000
    assert e[15] == pytest.approx(2.0 + r) and s[16] == pytest.approx(2.0 + r)
    assert e[63] == pytest.approx(2.0 + 4 * r)
    assert e[64] == pytest.approx(2.0 + 4 * r + 0.5 + 0.256)


def test_dsv4_all_items_in_one_round():
    c4 = c4_paged(2, 16)
    p = plan("dsv4_token", c4, c4, {"src_indices": list(range(1000)), "dst_indices": list(range(1000)),
                                    "layers": [0, 1]})
    s, e = item_times(p, T)
    assert np.allclose(s, 2.0) and np.allclose(e, 2.0 + 0.5 + 1000 * 2 * 584 / 1000)


def test_memcpy_chain():
    dev = token_rows(16, 1, 15)
    host = HostLayout("h", "layer_first", 1, 16, 16)
    p = plan("direct_per_layer", dev, host, {"layer": 0, "src_indices": [1, 2, 3, 7, 8, 4],
                                             "dst_indices": [10, 11, 12, 13, 14, 5]})
    s, e = item_times(p, T)  # runs of 48, 32, 16 B
    assert np.allclose(s, [0.0, 3.048, 6.080])
    assert np.allclose(e, [3.048, 6.080, 9.096])


def test_bytes_done_all_layer_prefix():
    dev = token_rows(576, 3, 4)
    host = HostLayout("h", "page_first", 3, 8, 576)
    p = plan("kernel_all_layer", dev, host, {"src_indices": [1], "dst_indices": [2]})
    start, end = np.array([0.0]), np.array([10.0])
    # item = 3 x 576 = 1,728 B, chunk 256
    assert bytes_done(p, start, end, 0.0).tolist() == [0, 0, 0]
    assert bytes_done(p, start, end, 5.0).tolist() == [576, 192, 0]    # 864 -> 768
    assert bytes_done(p, start, end, 9.99).tolist() == [576, 576, 384]  # 1726.3 -> 6 chunks = 1536
    assert bytes_done(p, start, end, 10.0).tolist() == [576, 576, 576]
    assert bytes_done(p, start, end, -1.0).tolist() == [0, 0, 0]


def test_bytes_done_dsv4_chunk_is_one_layer():
    c4 = c4_paged(2, 1)
    p = plan("dsv4_token", c4, c4, {"src_indices": [0, 1], "dst_indices": [2, 3], "layers": [0, 1]})
    start, end = np.array([0.0, 10.0]), np.array([10.0, 20.0])
    # item 0 done; item 1 at frac 0.6 of 1,168 B = 700.8 -> one 584 B chunk (layer 0)
    assert bytes_done(p, start, end, 16.0).tolist() == [576, 8, 576, 8, 576, 8, 0, 0]


def test_bytes_done_from_item_times():
    p = per_layer(65)
    # item times by hand (test_rounds_of_64_warps): items 0-63 run 2.0-18.884 us (round 0:
    # 0.5 + 64 x 256 B / 1,000 B/us = 16.884 us), item 64 runs 18.884-19.640 us (0.5 + 0.256)
    s = np.r_[np.full(64, 2.0), 18.884]
    e = np.r_[np.full(64, 18.884), 19.640]
    assert np.allclose(item_times(p, T)[0], s) and np.allclose(item_times(p, T)[1], e)
    done = bytes_done(p, s, e, 2.0 + 16.884 + 0.378)  # half-way through round 1
    assert done[:64].tolist() == [256] * 64 and done[64] == 128 // 256 * 256 == 0
    done = bytes_done(p, s, e, 2.0 + 8.442)  # half-way through round 0: 128 B -> 0 chunks
    assert done.sum() == 0
    done = bytes_done(p, s, e, 100.0)
    assert done.sum() == 65 * 256


def test_timing_validation():
    with pytest.raises(InputError) as ei:
        LinkTiming(gbps=0)
    assert ei.value.where == "LinkTiming.gbps"
    with pytest.raises(InputError) as ei:
        LinkTiming(gbps=1, resident_warps=0)
    assert ei.value.where == "LinkTiming.resident_warps"


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 200), st.floats(0, 1.2))
def test_monotone(n, resident, frac):
    p = per_layer(n, 576)
    t = LinkTiming(50.0, 3.0, 0.2, 4.0, resident_warps=resident)
    s, e = item_times(p, t)
    assert np.all(np.diff(s) >= 0) and np.all(np.diff(e) >= 0) and np.all(e > s)
    at = frac * float(e.max())
    d0 = bytes_done(p, s, e, at)
    d1 = bytes_done(p, s, e, at + 1.0)
    assert np.all(d1 >= d0) and np.all(d0 <= p.extents.length)
    assert np.all((d0 % 256 == 0) | (d0 == 576))


def test_builtin_worker_rule_goes_wide_from_16_mib():
    """``workers="builtin"``: a row copy of 16 MiB or more runs ``resident_warps`` items at once
    (the builtin kernel's one block per SM); a smaller one the launch's warps, as ``"launch"``."""
    from sim.transfers.timing import BUILTIN_WIDE_MIN_BYTES, builtin_runs_wide, concurrency

    t = LinkTiming(50.0, 3.0, 0.2, 4.0, resident_warps=132 * 32, workers="builtin")
    below = per_layer(BUILTIN_WIDE_MIN_BYTES // 1024 - 1, 1024)
    at = per_layer(BUILTIN_WIDE_MIN_BYTES // 1024, 1024)
    assert not builtin_runs_wide(below) and builtin_runs_wide(at)
    assert concurrency(below, t) == below.launch.warps == 64
    assert concurrency(at, t) == 132 * 32
    launch = LinkTiming(50.0, 3.0, 0.2, 4.0, resident_warps=132 * 32)
    assert np.array_equal(item_times(below, t)[1], item_times(below, launch)[1])
    assert copy_end_us(at, t) < copy_end_us(at, launch)
    with pytest.raises(InputError, match="LinkTiming.workers"):
        LinkTiming(1.0, workers="wide")


def test_builtin_kernels_pick_the_wide_launch_by_the_same_rule():
    """The provider's choice (``builtin_kernels.uses_wide``) and the simulator's
    (``builtin_runs_wide``) agree, and the wide grid is one 1,024-thread block per SM."""
    from gpu_backend.providers import builtin_kernels as bk
    from sim.transfers.timing import builtin_runs_wide

    for n in (1, 16383, 16384, 40000):
        p = per_layer(n, 1024)
        assert bk.uses_wide("kernel_per_layer", n, 1, 1024) == builtin_runs_wide(p)
    assert not bk.uses_wide("token_bytewise", 1 << 20, 1, 1024)
    assert bk.wide_launch(16384, 132) == (132, 1024, 4)
    assert bk.wide_launch(40, 132) == (2, 1024, 1)
    assert "kvr_rows_wide" in bk.kernel_source() and bk.WIDE_KERNEL == "kvr_rows_wide"


def test_row_factors_scale_a_kernel_copys_rounds_by_its_row():
    """``LinkTiming.row_factors``: interpolated in log2 of the row between the points, held
    outside; a copy's rounds (not its launch) take that many times as long; memcpy is not scaled."""
    from sim.transfers.timing import row_factor

    t = LinkTiming(50.0, 3.0, 0.2, 4.0, resident_warps=64)
    f = LinkTiming(50.0, 3.0, 0.2, 4.0, resident_warps=64, row_factors=((128, 1.0), (512, 1.4)))
    assert row_factor(f, 256) == pytest.approx(1.2) and row_factor(f, 64) == 1.0 and row_factor(f, 4096) == 1.4
    assert row_factor(t, 256) == 1.0
    p = per_layer(200, 512)
    assert copy_end_us(p, f) - 3.0 == pytest.approx(1.4 * (copy_end_us(p, t) - 3.0))
    for bad in (((128, 1.0), (64, 1.0)), ((128, 0.0),), ((0, 1.0),), ([128, 1.0],)):
        with pytest.raises(InputError, match="LinkTiming.row_factors"):
            LinkTiming(50.0, row_factors=bad)
