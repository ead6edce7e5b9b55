"""The GPU replayer's CPU side: runner helpers, the comparer, and replay() with a fake runner.

``NumpyRunner`` stands in for ``gpu_backend.runner.GpuSchedule``: it runs every op alone, in issue
order, on numpy arrays laid out as the GPU's guarded allocations are (canary | bytes | canary),
with the same staged writes and guard sizing, so replay()'s whole pipeline runs without a GPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from gpu_backend.compare import (_union_count, compare_read, gpu_expected_bytes, oob_agreement,
                                 predicted_oob, wilson_interval)
from gpu_backend.extents_model import apply_extents, oob_dst_bytes
from gpu_backend.memory import GuardReport, canary_bytes, diff_guard
from gpu_backend.replay import cli_replay, replay, summary_text
from gpu_backend.runner import (GpuRun, contiguous_pieces, element_indices, guard_bytes_needed,
                                initial_bytes, staged_write, word_size)
from sim.executor import run_reference, run_schedule
from sim.memory import Memory
from sim.schedule import load, validate
from tests import numpy_torch
from tests.helpers import profile, schedule_doc

P = profile()


class NumpyRunner:
    """Sequential numpy stand-in for GpuSchedule (see the module doc).

    ``reads_first``: in trials where it is true, every read runs before every copy and write (a
    stale but plausible read); ``garbage``: overwrite the first word of every read (implausible)."""

    def __init__(self, schedule, provider, *, guard_bytes=None, reads_first=lambda t: False,
                 garbage=False):
        self.s = schedule
        self.guard_bytes = guard_bytes_needed(schedule) if guard_bytes is None else guard_bytes
        self.init = initial_bytes(schedule)
        self.ordinals = {name: i for i, name in enumerate(schedule.buffers)}
        self.reads_first = reads_first
        self.garbage = garbage
        self.trial = 0

    def run(self, *, timings=False, final=True, guards=True) -> GpuRun:
        g = self.guard_bytes
        whole = {name: np.concatenate([canary_bytes(i, "before", g), self.init[name],
                                       canary_bytes(i, "after", g)])
                 for name, i in self.ordinals.items()}
        ops = list(self.s.ops)
        if self.reads_first(self.trial):
            ops = [o for o in ops if o.op == "read"] + [o for o in ops if o.op != "read"]
        self.trial += 1
        reads = {}
        for op in ops:
            if op.op == "copy":
                whole[op.dst] = apply_extents(whole[op.src], whole[op.dst], op.plan.extents,
                                              src_pad=g, dst_pad=g)
            elif op.op == "read":
                offs, lens = op.extents
                reads[op.id] = np.concatenate([whole[op.buffer][g + o:g + o + n] for o, n in zip(offs, lens)])
                if self.garbage:
                    reads[op.id][:8] = 0xEE
            elif op.op == "write":
                offs, lens, data = staged_write(self.s, op)
                pos = 0
                for o, n in zip(offs.tolist(), lens.tolist()):
                    whole[op.buffer][g + o:g + o + n] = data[pos:pos + n]
                    pos += n
        reports = []
        for name, i in self.ordinals.items():
            n = self.s.buffers[name].nbytes
            for side, got in (("before", whole[name][:g]), ("after", whole[name][g + n:])):
                r = diff_guard(name, side, canary_bytes(i, side, g), got)
                if r is not None:
                    reports.append(r)
        final_bytes = {name: whole[name][g:g + self.s.buffers[name].nbytes].copy()
                       for name in self.ordinals} if final else {}
        return GpuRun(reads, final_bytes, reports if guards else [], {}, "numpy stand-in",
                      "none", "off (numpy)", g, dict(self.ordinals))


def numpy_runner(**kw):
    return lambda schedule, provider, *, guard_bytes=None: NumpyRunner(schedule, provider,
                                                                         guard_bytes=guard_bytes, **kw)


# ---------------------------------------------------------------- runner helpers

def test_element_indices_and_word_size():
    offs, lens = np.array([16, 64, 8]), np.array([8, 16, 8])
    assert word_size(offs, lens) == 8
    assert element_indices(offs, lens, 8).tolist() == [2, 8, 9, 1]
    assert word_size(np.array([4]), np.array([132])) == 4
    assert word_size(np.array([3]), np.array([8])) == 1
    idx = element_indices(np.array([3, 10]), np.array([2, 3]), 1)
    assert idx.tolist() == [3, 4, 10, 11, 12]


def test_contiguous_pieces_merge_and_keep_stream_positions():
    assert contiguous_pieces(np.array([0, 64, 128, 512]), np.array([64, 64, 64, 64])) == \
        [(0, 192, 0), (512, 64, 192)]
    assert contiguous_pieces(np.array([64, 0]), np.array([64, 64])) == [(64, 64, 0), (0, 64, 64)]


def test_staged_write_is_the_simulators_write_and_dedupes_units():
    doc = schedule_doc([{"id": "w", "op": "write", "stream": "s0", "buffer": "D", "layer": 1,
                         "units": [3, 1, 3], "owner": 7, "version": 2}])
    s = validate(doc)
    op = s.op("w")
    offs, lens, data = staged_write(s, op)
    assert sorted(offs.tolist()) == sorted(set(op.extents[0].tolist()))
    mem = Memory(s.buffers)
    mem.write_units("D", op.layer, op.units, *op.extents, op.owner, op.version)
    want = mem.final_bytes("D")
    pos = 0
    for o, n in zip(offs.tolist(), lens.tolist()):
        assert np.array_equal(data[pos:pos + n], want[o:o + n])
        pos += n


def test_staged_write_of_several_layers_is_the_simulators_write():
    doc = schedule_doc([{"id": "w", "op": "write", "stream": "s0", "buffer": "D", "layers": [1, 0],
                         "units": [3, 1, 3], "owner": 7, "version": 2}])
    s = validate(doc)
    op = s.op("w")
    offs, lens, data = staged_write(s, op)
    assert offs.size == 4 and sorted(offs.tolist()) == sorted(set(op.extents[0].tolist()))
    mem = Memory(s.buffers)
    mem.apply_write(op)
    want = mem.final_bytes("D")
    pos = 0
    for o, n in zip(offs.tolist(), lens.tolist()):
        assert np.array_equal(data[pos:pos + n], want[o:o + n])
        pos += n


def test_guard_bytes_cover_the_c4_overrun():
    s = load("examples/c4_routine_on_bf16_index_k.json")
    g = guard_bytes_needed(s)
    op = s.op("load_dsv4_token")
    ext = op.plan.extents
    over = int((np.asarray(ext.dst) + np.asarray(ext.length)).max()) - s.buffers[op.dst].nbytes
    assert g % 4096 == 0 and g >= over + 4096
    assert guard_bytes_needed(load("examples/index_k_gated.json")) == 64 * 1024


def test_initial_bytes_are_memory_before_any_op():
    s = load("examples/index_k_ungated_race.json")
    init = initial_bytes(s)
    mem = Memory(s.buffers)
    for name in s.buffers:
        assert np.array_equal(init[name], mem.final_bytes(name))


# ---------------------------------------------------------------- comparer

def test_wilson_interval():
    lo, hi = wilson_interval(0, 100)
    assert lo == 0.0 and 0.03 < hi < 0.04
    lo, hi = wilson_interval(50, 100)
    assert 0.40 < lo < 0.41 and 0.59 < hi < 0.60
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_union_count_bytes_and_words():
    assert _union_count(np.array([0, 4]), np.array([8, 12])) == (12, 2)
    assert _union_count(np.array([0, 16]), np.array([3, 17])) == (4, 2)
    assert _union_count(np.array([], np.int64), np.array([], np.int64)) == (0, 0)


def test_compare_names_both_sides_of_a_stale_read():
    s = load("examples/index_k_ungated_race.json")
    ref = run_reference(s)
    cap = ref.reads[0]
    observed = Memory(s.buffers).view("dev_index_k", int(cap.offsets[0]), cap.nbytes).bytes()
    res = compare_read(observed, cap, ref.memory.table, layout=s.buffers["dev_index_k"].layout)
    assert not res["match"] and res["bytes_differing"] > 0
    assert res["words_differing"] == cap.nbytes // 8
    fm = res["first_mismatch"]
    assert fm["read_byte"] == 0 and fm["buffer_offset"] == 33792
    assert "request 12 unit 0 v1" in fm["predicted"]["text"]
    assert fm["observed"]["text"].startswith("index_k layer 0 initial unit 4 v0")
    assert fm["observed"]["unit"] == 4 and fm["observed"]["origin"]["owner"] == -1
    same = compare_read(cap.bytes(), cap, ref.memory.table)
    assert same["match"] and same["bytes_equal"] == cap.nbytes and same["first_mismatch"] is None


def test_compare_decodes_the_word_at_the_predicted_phase():
    s = load("examples/index_k_ungated_race.json")
    ref = run_reference(s)
    cap = ref.reads[0]
    obs = cap.bytes().copy()
    obs[8453] ^= 0xFF          # a byte inside a word, past the first unit's 8448 bytes
    res = compare_read(obs, cap, ref.memory.table)
    fm = res["first_mismatch"]
    assert res["bytes_differing"] == 1 and res["words_differing"] == 1
    assert fm["read_byte"] == 8453 and fm["predicted"]["phase"] == 5
    assert fm["observed"]["origin"] is None and "matches no origin" in fm["observed"]["text"]


def test_controlled_replay_is_byte_exact_through_the_numpy_runner():
    for path in ("examples/index_k_ungated_race.json", "examples/index_k_gated.json",
                 "examples/c4_routine_on_bf16_index_k.json"):
        s = load(path)
        rep = replay(s, "builtin", "controlled", profile=P, make_runner=numpy_runner())
        assert rep["ok"], summary_text(rep)
        assert rep["reads_matching"] == rep["reads_total"] == 1
        assert rep["buffers_matching"] == rep["buffers_total"]
        json.dumps(rep)


def test_c4_guards_agree_with_the_predicted_overrun():
    s = load("examples/c4_routine_on_bf16_index_k.json")
    rep = replay(s, "builtin", "controlled", profile=P, make_runner=numpy_runner())
    oob = rep["oob_detected"]
    assert set(oob) == {"dev_index_k_bf16"}
    e = oob["dev_index_k_bf16"]
    op = s.op("load_dsv4_token")
    _, after = oob_dst_bytes(op.plan.extents, s.buffers[op.dst].nbytes)
    assert e["predicted_after_bytes"] == after > 0
    assert e["guard_after_words"] * 8 == e["guard_after_bytes"] == after
    assert e["agree"] and rep["oob_agree"]
    # a guard report that misses words disagrees
    short = [GuardReport("dev_index_k_bf16", "after", 8, 1, 0, 7)]
    assert not oob_agreement(predicted_oob(s), short)["dev_index_k_bf16"]["agree"]


def _reads_past_source_doc():
    """dsv4_token from a 16 KiB host buffer into a C4 page: tokens 29.. read past the source."""
    return {"kvrace_schedule": 1, "name": "src_overrun",
            "buffers": [
                {"name": "H", "location": "host", "kind": "kv",
                 "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": 64, "unit_bytes": 256},
                 "init": [{"layers": "all", "indices": {"start": 0, "count": 64}, "owner": 3, "version": 1}]},
                {"name": "D", "location": "device", "kind": "c4",
                 "layout": {"preset": "c4_paged", "layers": 1, "pages": 1}}],
            "streams": ["load", "fwd"], "events": ["e"],
            "ops": [{"id": "cp", "op": "copy", "stream": "load", "routine": "dsv4_token", "src": "H", "dst": "D",
                     "args": {"src_indices": {"start": 0, "count": 40},
                              "dst_indices": {"start": 0, "count": 40}, "layers": [0]}},
                    {"op": "record", "stream": "load", "event": "e"},
                    {"op": "wait", "stream": "fwd", "event": "e"},
                    {"id": "rd", "op": "read", "stream": "fwd", "buffer": "D", "layer": 0, "units": [0]}]}


def test_bytes_read_past_a_source_are_expected_as_its_guard_canary():
    s = validate(_reads_past_source_doc())
    ref = run_reference(s)
    cap = ref.reads[0]
    kinds = {ref.memory.table[int(i)].kind for v in cap.views for i in v.compact.pieces(0, v.compact.nbytes).origin_id}
    assert "oob:H" in kinds
    plain = gpu_expected_bytes(cap.views, ref.memory.table)
    assert np.array_equal(plain, cap.bytes())
    rep = replay(s, "builtin", "controlled", profile=P, make_runner=numpy_runner())
    assert rep["ok"], summary_text(rep)
    assert rep["oob_detected"] == {}


def test_a_mismatch_fails_and_names_the_read():
    s = load("examples/index_k_gated.json")
    rep = replay(s, "builtin", "controlled", profile=P, make_runner=numpy_runner(garbage=True))
    assert not rep["ok"] and rep["reads_matching"] == 0
    fm = rep["first_mismatch"]
    assert fm["read_byte"] == 0 and fm["observed"]["origin"] is None
    assert "FAILED" in summary_text(rep)


def test_free_replay_json_shape_stale_and_plausible():
    s = load("examples/index_k_ungated_race.json")
    rep = replay(s, "builtin", "free", profile=P, trials=10, sim_seeds=5,
                 make_runner=numpy_runner(reads_first=lambda t: t % 2 == 1))
    for key in ("reads_total", "reads_matching", "first_mismatch", "oob_detected", "stale_fraction",
                "provider", "mode", "device", "implausible_words", "stale_ci95", "simulated_stale_fraction"):
        assert key in rep, key
    assert rep["mode"] == "free" and rep["provider"] == "builtin"
    assert rep["implausible_words"] == 0 and rep["first_mismatch"] is None and rep["ok"]
    # the warm-up run is trial 0 of the runner: odd runner trials read first = even replay trials
    assert rep["stale_fraction"] == 0.5
    r = rep["reads"][0]
    # Wilson 95 % for 5 of 10 (z = 1.96, z^2 = 3.8416): centre (0.5 + 3.8416/20) / (1 + 3.8416/10)
    # = 0.69208 / 1.38416 = 0.5; half-width 1.96 * sqrt(0.5 * 0.5 / 10 + 3.8416 / 400) / 1.38416
    # = 1.96 * sqrt(0.034604) / 1.38416 = 0.263410: [0.236590, 0.763410]
    assert r["stale_trials"] == 5
    assert r["stale_ci95"] == pytest.approx([0.236590, 0.763410], abs=1e-5)
    # Predicted, by hand: the copy waits on a record at t = 0, so it starts at 0 and its one round of
    # 4 pages (4 x 8,448 B) lands at launch 10 + overhead 0.5 + 33,792 B / 55,000 B/us = 11.114 us;
    # the read touches its bytes after compute 3 us (no jitter) + kernel launch 4 us = 7 us < 11.114 us.
    # So every simulated run is stale: 1.0, outside the measured interval: measured and predicted
    # disagree for this runner (it reads first in only half the trials).
    assert r["simulated_stale_fraction"] == 1.0 and rep["simulated_stale_fraction"] == 1.0
    assert not r["stale_ci95"][0] <= r["simulated_stale_fraction"] <= r["stale_ci95"][1]
    json.dumps(rep)


def test_free_replay_measured_fraction_agrees_with_the_prediction_when_every_read_goes_first():
    s = load("examples/index_k_ungated_race.json")
    rep = replay(s, "builtin", "free", profile=P, trials=10, sim_seeds=5,
                 make_runner=numpy_runner(reads_first=lambda t: True))
    r = rep["reads"][0]
    # 10 of 10 stale; Wilson: centre (1 + 0.19208) / 1.38416 = 0.861237, half-width
    # 1.96 * sqrt(0 + 0.009604) / 1.38416 = 0.138763: [0.722474, 1.0]; the prediction (1.0, derived
    # in the test above) lies inside it
    assert r["stale_trials"] == 10 and rep["stale_fraction"] == 1.0
    assert r["stale_ci95"] == pytest.approx([0.722474, 1.0], abs=1e-5)
    assert r["stale_ci95"][0] <= r["simulated_stale_fraction"] == 1.0 <= r["stale_ci95"][1] + 1e-12
    assert rep["implausible_words"] == 0 and rep["ok"]


def test_free_replay_counts_implausible_words():
    s = load("examples/index_k_ungated_race.json")
    rep = replay(s, "builtin", "free", profile=P, trials=3, sim_seeds=0,
                 make_runner=numpy_runner(garbage=True))
    assert rep["implausible_words"] == 3 and not rep["ok"]
    assert rep["first_mismatch"]["kind"] == "implausible word"
    assert rep["simulated_stale_fraction"] is None


def test_cli_replay_with_an_injected_runner(capsys, tmp_path):
    out = tmp_path / "r.json"
    args = argparse.Namespace(file="examples/index_k_ungated_race.json", provider="builtin", mode="controlled",
                              trials=5, profile="h200", seed=0, json=str(out))
    assert cli_replay(args, make_runner=numpy_runner()) == 0
    assert "OK" in capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["reads_total"] == rep["reads_matching"] == 1 and rep["stale_fraction"] is None
    args.json = "-"
    args.make_runner = None
    assert cli_replay(args, make_runner=numpy_runner(garbage=True)) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_cli_replay_reports_a_replay_error(capsys, monkeypatch):
    import gpu_backend.replay as gr
    from sim.replay import ReplayError

    def boom(*a, **k):
        raise ReplayError("copies a and b race and overlapped in time")
    monkeypatch.setattr(gr, "controlled_schedule", boom)
    args = argparse.Namespace(file="examples/index_k_ungated_race.json", provider="builtin", mode="controlled",
                              trials=5, profile="h200", seed=0, json=None)
    assert cli_replay(args, make_runner=numpy_runner()) == 2
    assert "cannot replay" in capsys.readouterr().err


def test_cli_without_a_gpu_exits_3():
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present: the no-GPU path is not reachable here")
    except ImportError:
        pass
    p = subprocess.run([sys.executable, "-m", "kvrace", "replay", "examples/index_k_ungated_race.json"],
                       capture_output=True, text=True)
    assert p.returncode == 3
    assert "needs a GPU" in p.stderr


def test_hypothesis_schedules_replay_through_the_numpy_runner():
    from hypothesis import HealthCheck, given, settings

    from sim.replay import ReplayError
    from tests.strategies import schedules

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(schedules(max_ops=10))
    def check(doc):
        s = validate(doc)
        try:
            rep = replay(s, "builtin", "controlled", profile=P, make_runner=numpy_runner())
        except ReplayError:
            return
        assert rep["ok"], summary_text(rep)
        assert rep["buffers_matching"] == rep["buffers_total"]
    check()


# ---------------------------------------------------------------- GpuSchedule itself, on torch's CPU

class _FakeStream:
    cuda_stream = 0

    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _FakeEvent:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _FakeKernels:
    mode = "no spin (CPU test double)"
    has_gate = False

    def spin(self, duration_us, stream):
        pass


class FakeCuda:
    """torch.cuda's names the runner uses; ops then run eagerly, in issue order, on the CPU."""

    Stream = _FakeStream
    Event = _FakeEvent
    kernels = _FakeKernels()

    @staticmethod
    def stream(s):
        import contextlib
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def set_device(device):
        pass

    @staticmethod
    def get_device_name(device=None):
        return "cpu (test double)"

    @staticmethod
    def device_count():
        return 0

    @staticmethod
    def current_stream(device=None):
        return _FakeStream()


class NumpyProvider:
    """Applies a copy's planned extents to the guarded allocations (CPU tensors share numpy memory)."""

    name = "numpy"

    def supports(self, routine, src_layout, dst_layout, args):
        return True, ""

    def launch(self, routine, src, dst, src_layout, dst_layout, args, stream=None, item_range=None):
        from sim.transfers.routines import plan

        ext = plan(routine, src_layout, dst_layout, args).extents
        s_all, d_all = src.allocation.numpy(), dst.allocation.numpy()
        d_all[:] = apply_extents(s_all.copy(), d_all, ext, src_pad=src.guard_bytes, dst_pad=dst.guard_bytes)


def _cpu_runner(schedule, provider, *, guard_bytes=None):
    from gpu_backend.runner import GpuSchedule

    return GpuSchedule(schedule, NumpyProvider(), device="cpu", guard_bytes=guard_bytes, cuda_api=FakeCuda())


@pytest.mark.parametrize("path", ["examples/index_k_ungated_race.json", "examples/index_k_gated.json",
                                  "examples/c4_routine_on_bf16_index_k.json"])
def test_gpu_schedule_on_torch_cpu_is_byte_exact(path, monkeypatch):
    numpy_torch.install(monkeypatch)   # torch, or its numpy test double where torch is absent
    s = load(path)
    rep = replay(s, "numpy", "controlled", profile=P, make_runner=_cpu_runner)
    assert rep["ok"], summary_text(rep)
    assert rep["buffers_matching"] == rep["buffers_total"]
    assert rep["start_gate"].startswith("off")
    free = replay(s, "numpy", "free", profile=P, trials=3, sim_seeds=2, make_runner=_cpu_runner)
    assert free["ok"] and free["stale_fraction"] == 0.0, summary_text(free)


def test_gpu_schedule_on_torch_cpu_runs_hypothesis_schedules(monkeypatch):
    numpy_torch.install(monkeypatch)   # torch, or its numpy test double where torch is absent
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from sim.replay import ReplayError
    from tests.strategies import schedules

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(schedules(max_ops=12), schedules(max_ops=12, synchronised=True)))
    def check(doc):
        s = validate(doc)
        try:
            rep = replay(s, "numpy", "controlled", profile=P, make_runner=_cpu_runner)
        except ReplayError:
            return
        assert rep["ok"], summary_text(rep)
        assert rep["buffers_matching"] == rep["buffers_total"]
    check()


def test_gpu_schedule_reads_and_writes_host_buffers(monkeypatch):
    numpy_torch.install(monkeypatch)   # torch, or its numpy test double where torch is absent
    ops = [{"id": "w", "op": "write", "stream": "s0", "buffer": "H", "layer": 1, "units": [2, 3, 5],
            "owner": 9},
           {"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 1, "src_indices": [5, 2], "dst_indices": [0, 7]}},
           {"id": "rh", "op": "read", "stream": "s0", "buffer": "H", "ranges": [[8, 16], [600, 200]]},
           {"id": "rd", "op": "read", "stream": "s0", "buffer": "D", "layer": 1, "units": [7, 0, 3]}]
    s = validate(schedule_doc(ops))
    rep = replay(s, "numpy", "controlled", profile=P, make_runner=_cpu_runner)
    assert rep["ok"] and rep["reads_total"] == 2, summary_text(rep)
    assert rep["buffers_matching"] == rep["buffers_total"] == 3


def test_gpu_run_gives_an_observed_snapshot_comparable_with_the_prediction():
    from gpu_backend.runner import GpuRun
    from sim.schedule import load
    from sim.snapshot import first_difference, snapshot_of
    from tests.helpers import profile

    s = load("examples/index_k_gated.json")
    run = run_schedule(s, profile())
    predicted = snapshot_of(run)
    gpu = GpuRun(reads={r.op_id: r.bytes() for r in run.reads},
                 final={n: run.memory.final_bytes(n) for n in s.buffers}, guards=[])
    observed = gpu.snapshot(s, "gpu:fake")
    assert observed.source == "gpu:fake" and first_difference(predicted, observed) is None
    gpu.reads["indexer_read_index_k_L0"] = gpu.reads["indexer_read_index_k_L0"].copy()
    gpu.reads["indexer_read_index_k_L0"][100] ^= 1
    d = first_difference(predicted, gpu.snapshot(s, "gpu:fake"))
    assert d == {"what": "read bytes", "read": "indexer_read_index_k_L0", "byte": 100, "bytes_differing": 1}
