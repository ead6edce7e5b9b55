"""Execute a validated Schedule on a real GPU, exactly as its semantics say.

The host walks ``schedule.ops`` in issue order (see ``sim.schedule`` and ``sim.executor``):

* one ``torch.cuda.Stream`` per schedule stream; a fresh ``torch.cuda.Event`` per ``record``;
* ``wait``: ``stream.wait_event`` on the event of its bound record (``op.bound_record``);
* ``host_sync``: ``event.synchronize()`` (bound record), ``stream.synchronize()`` or
  ``torch.cuda.synchronize()``; a positive ``host_query``: its record's ``synchronize()``
  (a negative one, a ``barrier`` and a wait or sync with no record issued: nothing, as in
  CUDA); ``host_delay``: a host busy-wait of ``duration_us``;
* ``copy``: ``provider.launch`` on its stream (routines the provider does not support are refused
  before anything runs, naming the op);
* ``read``: one gather of the read's extents into the read's own capture buffer, on its stream
  (``index_select`` over a word view of the buffer; a pinned host buffer is read with one
  ``copy_(non_blocking=True)`` per contiguous piece, also on the stream);
* ``write``: the units' pattern bytes, staged on the device before the run, copied into the
  units' extents on its stream (``index_copy_``; per piece for a host buffer);
* ``compute``: a spin kernel of ``duration_us``.  The spin kernel (``kvr_spin_ns``, built once per
  process with NVRTC through cuda-python, as the builtin provider is) busy-waits on the GPU's
  ``%globaltimer`` nanosecond clock, so its length does not depend on the SM clock, which idles at
  a few hundred MHz and boosts to about 2 GHz.  Without cuda-python the runner falls back to
  ``torch.cuda._sleep`` with cycles per microsecond measured once per process (``GpuRun.compute``
  says which ran).

**Start gate.**  The simulator issues every op up to the first host op (``host_sync``,
``host_delay``) at time 0.  The GPU host takes microseconds per launch, so a copy issued first
would get a head start of the whole issue time.  Before issuing, the runner puts a gate on every
stream: a kernel polling a pinned host flag (``kvr_gate``), an event after it, and a wait on
that event at the head of each stream.  Ops are issued behind the gate; the host opens it (writes
the flag) at the first host op or after the last op, so they start together, as in the
simulator.  The gate adds no order between the schedule's own ops.  It checks itself once per
process (a gate that does not open within 0.5 s is switched off and ``GpuRun.gate`` says so); it
opens by itself after ``GATE_TIMEOUT_S`` in any case, so a host that dies mid-issue cannot hang
the GPU.

Buffers come from :class:`gpu_backend.memory.BufferSet` (guards and canaries), in declaration
order (buffer ``i`` has canary ordinal ``i``), filled with the simulator's initial bytes
(``Memory(s.buffers).final_bytes(name)`` before any op).  Guards are sized above the largest
overrun of any copy extent (``guard_bytes_needed``).

:class:`GpuSchedule` prepares once (allocation, staged writes, index tensors, streams) and runs
any number of trials, restoring every allocation (guards included) before each.  The numpy
helpers at the top are torch-free and tested on the CPU.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from gpu_backend.memory import DEFAULT_GUARD_BYTES, BufferSet, GuardReport
from gpu_backend.providers.base import ProviderError
from sim.bytes.pattern import pattern_bytes
from sim.memory import Memory, write_pattern
from sim.schedule import Schedule
from sim.snapshot import Snapshot, digest

GATE_TIMEOUT_S = 10.0
_WORD_DTYPES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class UnsupportedOp(ProviderError):
    """The provider cannot run one of the schedule's copies; the message names the op."""


# ---------------------------------------------------------------- numpy helpers (no torch)

def initial_bytes(schedule: Schedule) -> dict[str, np.ndarray]:
    """Every buffer's bytes before any op, as the simulator holds them."""
    mem = Memory(schedule.buffers, materialise=True)
    return {name: np.array(mem.final_bytes(name), dtype=np.uint8, copy=True) for name in schedule.buffers}


def guard_bytes_needed(schedule: Schedule, minimum: int = DEFAULT_GUARD_BYTES) -> int:
    """A guard size (multiple of 4096) that holds every byte any copy extent reads or writes
    outside its buffer, with at least 4 KiB to spare, and at least ``minimum``."""
    need = 0
    for op in schedule.ops:
        if op.op != "copy":
            continue
        ext = op.plan.extents
        s, d, n = (np.asarray(a, dtype=np.int64) for a in (ext.src, ext.dst, ext.length))
        if n.size == 0:
            continue
        src_n, dst_n = schedule.buffers[op.src].nbytes, schedule.buffers[op.dst].nbytes
        need = max(need, int((s + n - src_n).max()), int((d + n - dst_n).max()),
                   int((-s).max()), int((-d).max()))
    need = -(-(need + 4096) // 4096) * 4096
    return max(int(minimum), need)


def word_size(offsets: np.ndarray, lengths: np.ndarray) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every offset and length."""
    both = np.concatenate([np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)])
    for g in (8, 4, 2):
        if not (both % g).any():
            return g
    return 1


def element_indices(offsets: np.ndarray, lengths: np.ndarray, g: int) -> np.ndarray:
    """Indices of the ``g``-byte elements of the extents, in extent order."""
    offs = np.asarray(offsets, np.int64) // g
    lens = np.asarray(lengths, np.int64) // g
    total = int(lens.sum())
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.repeat(offs - starts, lens) + np.arange(total, dtype=np.int64)


def contiguous_pieces(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """``(buffer_offset, nbytes, stream_offset)`` pieces of the extents, merged where one extent
    continues the previous one in the buffer."""
    out: list[list[int]] = []
    pos = 0
    for o, n in zip(np.asarray(offsets, np.int64).tolist(), np.asarray(lengths, np.int64).tolist()):
        if out and o == out[-1][0] + out[-1][1]:
            out[-1][1] += n
        else:
            out.append([o, n, pos])
        pos += n
    return [tuple(p) for p in out]


def staged_write(schedule: Schedule, op) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a ``write`` op stores: ``(offsets, lengths, bytes)``, per layer it writes (in its
    order) one extent per distinct unit (a unit named twice keeps its last place, as the
    simulator's later-wins fill does), the bytes being the units' pattern bytes of that layer's
    origin (kind, layer, owner, version: ``sim.memory.write_pattern``)."""
    spec = schedule.buffers[op.buffer]
    ub = spec.layout.unit_bytes
    units = np.asarray(op.units, np.int64)
    offs, lens = (np.asarray(a, np.int64) for a in op.extents)
    if not (lens == ub).all():
        raise AssertionError(f"write {op.id}: expected one {ub}-byte extent per unit")
    _, last = np.unique(units[::-1], return_index=True)
    keep = np.sort(units.size - 1 - last)
    kept = units[keep]
    lo, hi = int(kept.min()), int(kept.max())
    origins, _ = write_pattern(spec, op.layers, units, int(op.owner), int(op.version))
    out_o, out_l, out_b = [], [], []
    for g, origin in enumerate(origins):
        rows = pattern_bytes(origin, lo * ub, (hi - lo + 1) * ub).reshape(hi - lo + 1, ub)
        out_o.append(offs[g * units.size + keep])
        out_l.append(lens[g * units.size + keep])
        out_b.append(np.ascontiguousarray(rows[kept - lo]).reshape(-1))
    return np.concatenate(out_o), np.concatenate(out_l), np.concatenate(out_b)


def schedule_device(schedule: Schedule) -> int:
    """The one device index the schedule uses (the runner drives one GPU)."""
    used = {spec.device for spec in schedule.buffers.values() if spec.location == "device"}
    used |= set(schedule.streams.values())
    if len(used) > 1:
        raise UnsupportedOp(f"schedule {schedule.name!r} uses devices {sorted(used)}; the GPU runner "
                            "drives one device: expected every buffer and stream on one device")
    return used.pop() if used else 0


def check_supported(schedule: Schedule, provider) -> None:
    """Raise UnsupportedOp naming the first copy the provider cannot run."""
    for op in schedule.ops:
        if op.op != "copy":
            continue
        ok, why = provider.supports(op.routine, schedule.buffers[op.src].layout,
                                    schedule.buffers[op.dst].layout, op.args)
        if not ok:
            raise UnsupportedOp(f"ops[{op.index}] ({op.id}): provider {provider.name!r} cannot run "
                                f"{op.routine} from {op.src!r} to {op.dst!r}: {why}")


# ---------------------------------------------------------------- result

@dataclass
class GpuRun:
    """What one execution of a schedule on the GPU observed."""

    reads: dict[str, np.ndarray]                 # read op id -> bytes it captured (uint8)
    final: dict[str, np.ndarray]                 # buffer -> logical bytes after the run ({} if skipped)
    guards: list[GuardReport]                    # changed guards (empty: all canaries intact)
    timings_us: dict[str, tuple[float, float]] = field(default_factory=dict)  # stream op -> (start, end)
    device_name: str = ""
    compute: str = ""                            # which spin kernel ran compute ops
    gate: str = ""                               # the start gate: "flag", or why it is off
    guard_bytes: int = 0
    ordinals: dict[str, int] = field(default_factory=dict)   # buffer -> canary ordinal
    gate_open_after_s: float = 0.0               # host time from closing the gate to opening it

    def snapshot(self, schedule: Schedule, source: str) -> Snapshot:
        """The observed Snapshot (sim.snapshot): compare it with a predicted one by
        ``sim.snapshot.first_difference``."""
        return Snapshot(schedule.digest(), source, dict(self.reads),
                        {name: digest(data) for name, data in self.final.items()},
                        {k: [float(a), float(b)] for k, (a, b) in self.timings_us.items()})


# ---------------------------------------------------------------- spin and gate kernels

_SPIN_SOURCE = r"""
extern "C" __global__ void kvr_spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

extern "C" __global__ void kvr_gate(const volatile unsigned int* flag, unsigned long long timeout_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        if (*flag != 0u) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < timeout_ns);
}
"""


class _Kernels:
    """The spin and gate kernels of one device (NVRTC + driver API), or torch's sleep fallback."""

    _cache: dict = {}

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self.mode = "torch.cuda._sleep"
        self.gate_state = None
        self.cycles_per_us = None
        self.why_not_nvrtc = ""
        try:
            self._load_nvrtc()
            self.mode = "kvr_spin_ns (%globaltimer)"
        except Exception as e:  # cuda-python missing or NVRTC failure: fall back, say why
            self.why_not_nvrtc = f"{type(e).__name__}: {e}"
            self._calibrate_sleep()

    @classmethod
    def get(cls, torch, device) -> "_Kernels":
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in cls._cache:
            cls._cache[key] = cls(torch, device)
        return cls._cache[key]

    def _load_nvrtc(self):
        from gpu_backend.providers.builtin import _bindings, _check

        driver, nvrtc = _bindings()
        idx = self.device.index if self.device.index is not None else self.torch.cuda.current_device()
        major, minor = self.torch.cuda.get_device_capability(idx)
        arch = f"sm_{major}{minor}"
        prog = _check(nvrtc.nvrtcCreateProgram(_SPIN_SOURCE.encode(), b"kvr_spin.cu", 0, [], []),
                      "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
            err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
            if int(err) != 0:
                size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
                log = b" " * size
                _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
                raise ProviderError(f"NVRTC could not compile the spin kernels: {log.decode(errors='replace')}")
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(idx), "cuDeviceGet")
        self._ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._cubin = np.frombuffer(cubin, dtype=np.uint8).copy()
        self._module = _check(driver.cuModuleLoadData(self._cubin.ctypes.data), "cuModuleLoadData(spin)")
        self._spin = _check(driver.cuModuleGetFunction(self._module, b"kvr_spin_ns"), "cuModuleGetFunction")
        self._gate = _check(driver.cuModuleGetFunction(self._module, b"kvr_gate"), "cuModuleGetFunction")
        self._driver, self._checkf = driver, _check
        # first launches load the functions (lazy loading waits for an idle device): do it now,
        # never behind a closed gate
        s = self.torch.cuda.Stream(device=self.device)
        self._launch(self._spin, [1000], s)
        flag = self.torch.ones(1, dtype=self.torch.int32, pin_memory=True)
        self._launch(self._gate, [flag.data_ptr(), 10 ** 9], s)
        s.synchronize()

    def _calibrate_sleep(self):
        torch = self.torch
        s = torch.cuda.Stream(device=self.device)
        torch.cuda.synchronize(self.device)
        times = []
        cycles = (200_000, 2_000_000)
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000)           # warm the clocks up
            for c in cycles:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                torch.cuda._sleep(c)
                b.record(s)
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
        self.cycles_per_us = (cycles[1] - cycles[0]) / max(times[1] - times[0], 1e-3)
        self.mode = f"torch.cuda._sleep ({self.cycles_per_us:.0f} cycles/us measured; {self.why_not_nvrtc})"

    def _launch(self, func, args: list[int], stream) -> None:
        driver = self._driver
        self._checkf(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        vals = [np.array([a], dtype=np.uint64) for a in args]
        ptrs = np.array([v.ctypes.data for v in vals], dtype=np.uint64)
        self._checkf(driver.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0,
                                           driver.CUstream(int(stream.cuda_stream)), ptrs.ctypes.data, 0),
                     "cuLaunchKernel(kvr spin)")

    def spin(self, duration_us: float, stream) -> None:
        if duration_us <= 0:
            return
        if self.cycles_per_us is None:
            self._launch(self._spin, [int(round(duration_us * 1e3))], stream)
        else:
            with self.torch.cuda.stream(stream):
                self.torch.cuda._sleep(int(duration_us * self.cycles_per_us))

    @property
    def has_gate(self) -> bool:
        return self.cycles_per_us is None

    def gate(self, flag_ptr: int, stream, timeout_s: float = GATE_TIMEOUT_S) -> None:
        self._launch(self._gate, [int(flag_ptr), int(timeout_s * 1e9)], stream)


# ---------------------------------------------------------------- the runner

class GpuSchedule:
    """A schedule prepared on the GPU: buffers, staged writes, capture buffers, streams.

    ``run()`` executes it once (restoring every allocation first) and returns a :class:`GpuRun`.
    """

    def __init__(self, schedule: Schedule, provider, *, device="cuda", guard_bytes: int | None = None,
                 gate: bool = True, warm_up: bool = True, cuda_api=None):
        import torch

        from gpu_backend.providers import get_provider

        self.torch = torch
        # cuda_api: torch.cuda, or a test double with the same names (Stream, Event, stream,
        # synchronize, set_device, get_device_name, device_count, kernels) for a CPU device
        self.cuda = cuda_api or torch.cuda
        self.s = schedule
        self.provider = get_provider(provider) if isinstance(provider, str) else provider
        check_supported(schedule, self.provider)
        sched_dev = schedule_device(schedule)
        self.device = torch.device(device)
        if self.device.type != "cuda" and cuda_api is None:
            raise ValueError(f"device: expected a CUDA device, got {device!r}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", sched_dev if sched_dev < self.cuda.device_count() else 0)
        self.cuda.set_device(self.device)
        self.device_name = self.cuda.get_device_name(self.device)
        self.guard_bytes = guard_bytes_needed(schedule) if guard_bytes is None else int(guard_bytes)
        self.kernels = getattr(cuda_api, "kernels", None) or _Kernels.get(torch, self.device)

        # buffers, in declaration order (canary ordinal = position)
        self.bs = BufferSet(self.device, guard_bytes=self.guard_bytes)
        self.ordinals = {}
        for name, data in initial_bytes(schedule).items():
            spec = schedule.buffers[name]
            self.bs.add(name, spec.nbytes, spec.location, data)
            self.ordinals[name] = self.bs[name].ordinal
        self._initial = {}
        for buf in self.bs:
            self._initial[buf.name] = buf.allocation.clone()

        self.streams = {name: self.cuda.Stream(device=self.device) for name in schedule.streams}
        self.gate_stream = self.cuda.Stream(device=self.device)
        self._reads = {op.id: self._prepare_read(op) for op in schedule.ops if op.op == "read"}
        self._writes = {op.id: self._prepare_write(op) for op in schedule.ops if op.op == "write"}
        self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._flag_np = self._flag.numpy()
        self.gate = "off (not asked for)"
        if gate:
            self.gate = self._check_gate()
        self.cuda.synchronize(self.device)
        if warm_up:
            # One ungated run first: the first launch of any kernel (a provider's JIT build, a
            # lazily loaded torch or NVRTC function) may wait for an idle device, which a closed
            # gate would hold off until its timeout.
            self.run(final=False, guards=False, gated=False)

    # ---- preparation
    def _word_view(self, name: str, g: int):
        t = self.bs[name].tensor
        n = t.numel() - t.numel() % g
        return t[:n].view(getattr(self.torch, _WORD_DTYPES[g]))

    def _prepare_read(self, op) -> dict:
        torch = self.torch
        offs, lens = op.extents
        total = int(np.asarray(lens).sum())
        cap = torch.empty(total, dtype=torch.uint8, device=self.device)
        prep = {"op": op, "cap": cap, "host": self.s.buffers[op.buffer].location == "host"}
        if prep["host"]:
            prep["pieces"] = contiguous_pieces(offs, lens)
        else:
            g = word_size(offs, lens)
            idx = torch.from_numpy(element_indices(offs, lens, g)).to(self.device)
            prep.update(g=g, idx=idx, view=self._word_view(op.buffer, g),
                        cap_view=cap.view(getattr(torch, _WORD_DTYPES[g])))
        return prep

    def _prepare_write(self, op) -> dict:
        torch = self.torch
        offs, lens, data = staged_write(self.s, op)
        staged = torch.from_numpy(data).to(self.device)
        prep = {"op": op, "host": self.s.buffers[op.buffer].location == "host", "staged": staged}
        if prep["host"]:
            prep["pieces"] = contiguous_pieces(offs, lens)
        else:
            g = word_size(offs, lens)
            idx = torch.from_numpy(element_indices(offs, lens, g)).to(self.device)
            prep.update(idx=idx, view=self._word_view(op.buffer, g),
                        staged_view=staged.view(getattr(torch, _WORD_DTYPES[g])))
        return prep

    def _check_gate(self) -> str:
        """Open a gate once per process and device and see that the GPU notices within 0.5 s."""
        if not self.kernels.has_gate:
            return f"off ({self.kernels.mode})"
        if getattr(self.kernels, "gate_state", None) is None:
            self.kernels.gate_state = self._try_gate()
        return self.kernels.gate_state

    def _try_gate(self) -> str:
        self._flag_np[0] = 0
        self.kernels.gate(self._flag.data_ptr(), self.gate_stream, timeout_s=2.0)
        done = self.cuda.Event()
        done.record(self.gate_stream)
        time.sleep(0.005)
        held = not done.query()
        t0 = time.perf_counter()
        self._flag_np[0] = 1
        while not done.query():
            if time.perf_counter() - t0 > 3.0:
                break
        waited = time.perf_counter() - t0
        self.gate_stream.synchronize()
        self._flag_np[0] = 0
        if not held:
            return "off (the gate kernel did not hold its stream while the flag was down)"
        if waited > 0.5:
            return f"off (the GPU saw the host flag only after {waited:.2f} s)"
        return "flag"

    # ---- one execution
    def reset(self) -> None:
        for buf in self.bs:
            buf.allocation.copy_(self._initial[buf.name])
        self.cuda.synchronize(self.device)

    def run(self, *, timings: bool = False, final: bool = True, guards: bool = True,
            gated: bool | None = None) -> GpuRun:
        """Execute once.  ``gated``: use the start gate (default: when it works here)."""
        cuda = self.cuda
        self.reset()
        gated = self.gate == "flag" if gated is None else (gated and self.gate == "flag")
        marks: dict[str, tuple] = {}
        t0 = cuda.Event(enable_timing=True) if timings else None
        if gated:
            self._flag_np[0] = 0
            self.kernels.gate(self._flag.data_ptr(), self.gate_stream)
            opened = cuda.Event(enable_timing=timings)
            opened.record(self.gate_stream)
            for st in self.streams.values():
                st.wait_event(opened)
            if timings:
                t0 = opened
        elif timings:
            t0.record(cuda.current_stream(self.device))
        released = not gated
        self._gate_closed_at = time.perf_counter()
        self._gate_opened_at = self._gate_closed_at
        try:
            released = self._issue(marks, timings, released)
        finally:
            if not released:
                self._open_gate()
        cuda.synchronize(self.device)
        self._flag_np[0] = 0
        reads = {op_id: p["cap"].cpu().numpy() for op_id, p in self._reads.items()}
        out_final = {name: self.bs.read(name) for name in self.s.buffers} if final else {}
        out_guards = self.bs.check_guards() if guards else []
        times = {}
        for op_id, (a, b) in marks.items():
            times[op_id] = (t0.elapsed_time(a) * 1e3, t0.elapsed_time(b) * 1e3)
        open_after = self._gate_opened_at - self._gate_closed_at if gated else 0.0
        gate = self.gate if gated else "off (this run)"
        if gated and open_after >= GATE_TIMEOUT_S:
            gate = f"flag (timed out: opened by itself after {GATE_TIMEOUT_S:g} s)"
        return GpuRun(reads, out_final, out_guards, times, self.device_name, self.kernels.mode, gate,
                      self.guard_bytes, dict(self.ordinals), open_after)

    def _open_gate(self) -> None:
        self._flag_np[0] = 1
        self._gate_opened_at = time.perf_counter()

    def _issue(self, marks: dict, timings: bool, released: bool) -> bool:
        cuda = self.cuda
        s = self.s
        events: dict[int, object] = {}
        for op in s.ops:
            if op.stream is None:
                # NOTE: one host thread issues every host's ops in list order (an issue order), so
                # a barrier needs nothing more; a positive host_query replays as a host_sync on its
                # record, a negative one and an unbound wait/sync as nothing (CUDA: no-ops).
                if op.op == "barrier" or (op.op == "host_query" and not op.sync_targets):
                    continue
                if not released:
                    self._open_gate()
                    released = True
                if op.op == "host_delay":
                    end = time.perf_counter() + op.duration_us * 1e-6
                    while time.perf_counter() < end:
                        pass
                elif op.event is not None:
                    if op.bound_record is not None:
                        events[op.bound_record].synchronize()
                elif op.sync_stream is not None:
                    self.streams[op.sync_stream].synchronize()
                else:
                    cuda.synchronize(self.device)
                continue
            stream = self.streams[op.stream]
            if op.op == "record":
                ev = cuda.Event()
                ev.record(stream)
                events[op.index] = ev
                continue
            if op.op == "wait":
                if op.bound_record is not None:
                    stream.wait_event(events[op.bound_record])
                continue
            if timings:
                a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
                a.record(stream)
            if op.op == "copy":
                self.provider.launch(op.routine, self.bs[op.src], self.bs[op.dst], s.buffers[op.src].layout,
                                     s.buffers[op.dst].layout, op.args, stream=stream)
            elif op.op == "read":
                self._read(self._reads[op.id], stream)
            elif op.op == "write":
                self._write(self._writes[op.id], stream)
            elif op.op == "compute":
                self.kernels.spin(op.duration_us, stream)
            else:  # validated schedules have no other op kinds
                raise AssertionError(f"unknown op kind {op.op!r}")
            if timings:
                b.record(stream)
                marks[op.id] = (a, b)
        return released

    def _read(self, p: dict, stream) -> None:
        torch = self.torch
        with self.cuda.stream(stream):
            if p["host"]:
                src = self.bs[p["op"].buffer].tensor
                for o, n, c in p["pieces"]:
                    p["cap"][c:c + n].copy_(src[o:o + n], non_blocking=True)
            else:
                torch.index_select(p["view"], 0, p["idx"], out=p["cap_view"])

    def _write(self, p: dict, stream) -> None:
        with self.cuda.stream(stream):
            if p["host"]:
                dst = self.bs[p["op"].buffer].tensor
                for o, n, c in p["pieces"]:
                    dst[o:o + n].copy_(p["staged"][c:c + n], non_blocking=True)
            else:
                p["view"].index_copy_(0, p["idx"], p["staged_view"])


def run_on_gpu(schedule: Schedule, provider, *, device="cuda", guard_bytes: int | None = None,
               timings: bool = True, gate: bool = True) -> GpuRun:
    """Execute ``schedule`` once on the GPU with ``provider`` (a provider or its name)."""
    return GpuSchedule(schedule, provider, device=device, guard_bytes=guard_bytes, gate=gate).run(
        timings=timings)
