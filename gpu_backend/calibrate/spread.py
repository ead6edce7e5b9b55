"""Race-window scans: how the start of a read after a compute op spreads against a copy's end.

The measurement (GPU; ``measure_spread``).  One schedule of the free sweep's family (an ungated
read on the ``forward`` stream after a ``compute`` op, racing a host-to-device copy on the
``load`` stream that waits for an event recorded first on ``forward``; ``race_doc``) or any
schedule with exactly one compute op (the minimal race example) is prepared once on the GPU.
Each trial runs it freely behind the runner's start gate, untimed (CUDA events between ops would
move the kernels they time), with the compute op's spin kernel set to ``c`` microseconds, and
records whether the read was stale (its bytes differ from the happens-before order's).  Over
the trials at each ``c`` this is ``S(c) = P(Z > c)``: the survival function of the race window
``Z``, the time by which the copy's last byte lands after the point where a read issued with no
compute would read.  A coarse pass over ``0.5 .. 1.5 x (the copy's end) + 15 us`` (its end: the
median of three timed runs after the start gate) finds where ``S`` falls from 1 to 0, a fine
pass measures that stretch with more trials.

Then, with ``c`` near the median of ``Z``, ``timed_trials`` runs with CUDA events around every
op give the copy's duration per run (start to end event), the spread of the copy's rate.

Everything goes into one JSON-able dict per shape (``scan``: the compute values, trials and
stale counts; ``timed``: the per-run copy durations and starts), which
``gpu_backend.calibrate.spread_fit`` turns into the profile's ``[timing]`` tables without a GPU.

    python -m gpu_backend.calibrate.spread --provider sglang --out raw.json [--example FILE]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

__all__ = ["race_doc", "scan_shapes", "measure_shape", "measure_spread", "main"]

#: (bytes per token, tokens) of the sweep's copies that each provider's scan measures: copies of
#: about 10 to 150 us, whose race window lies above 0 (a read with no compute would be stale)
SCAN_SHAPES = {"sglang": [(256, 256), (1024, 256), (256, 1024), (1024, 1024), (128, 4096), (512, 4096)],
               "builtin": [(128, 64), (1024, 64), (256, 256), (1024, 256), (136, 1024), (1024, 1024),
                           (128, 4096)],
               "torch": [(256, 64), (1024, 64)]}
COMPUTE_PLACEHOLDER_US = 1.0


def race_doc(bytes_per_token: int, tokens: int, compute_us: float) -> dict:
    """The minimal ungated race at one point of the free sweep (a kvrace schedule document)."""
    return {
        "kvrace_schedule": 1,
        "name": f"free_sweep_b{bytes_per_token}_t{tokens}_c{compute_us:g}",
        "description": (f"Ungated read of {tokens} index-K rows of {bytes_per_token} B after a "
                        f"{compute_us:g} us compute op, racing their host-to-device load."),
        "buffers": [
            {"name": "host_index_k", "location": "host", "kind": "index_k",
             "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": tokens,
                        "unit_bytes": bytes_per_token},
             "init": [{"layers": "all", "indices": {"start": 0, "count": tokens}, "owner": 12, "version": 1}]},
            {"name": "dev_index_k", "location": "device", "kind": "index_k",
             "layout": {"kind": "paged", "layers": 1, "pages": 2 * tokens, "page_bytes": bytes_per_token}},
        ],
        "streams": ["forward", "load"],
        "events": ["start_loading", "layer0_loaded"],
        "ops": [
            {"id": "start_event", "op": "record", "stream": "forward", "event": "start_loading"},
            {"id": "load_waits_forward", "op": "wait", "stream": "load", "event": "start_loading"},
            {"id": "load_index_k_L0", "op": "copy", "stream": "load", "routine": "kernel_per_layer",
             "src": "host_index_k", "dst": "dev_index_k",
             "args": {"layer": 0, "src_indices": {"start": 0, "count": tokens},
                      "dst_indices": {"start": tokens, "count": tokens}}},
            {"id": "complete_L0", "op": "record", "stream": "load", "event": "layer0_loaded"},
            {"id": "indexer_q_proj", "op": "compute", "stream": "forward", "duration_us": compute_us},
            {"id": "indexer_read_index_k_L0", "op": "read", "stream": "forward", "buffer": "dev_index_k",
             "layer": 0, "units": {"start": tokens, "count": tokens}},
        ],
    }


def scan_shapes(provider: str, example: dict | None = None) -> list[tuple[str, dict]]:
    """``(label, schedule document)`` of every shape a provider's scan measures."""
    out = [(f"b{b}_t{t}", race_doc(b, t, COMPUTE_PLACEHOLDER_US)) for b, t in SCAN_SHAPES.get(provider, [])]
    if example is not None:
        out.append((example.get("name", "example"), example))
    return out


class _SpinOverride:
    """The runner's spin/gate kernels with every compute op's duration replaced by ``c``."""

    def __init__(self, inner):
        self._inner = inner
        self.c = COMPUTE_PLACEHOLDER_US

    def spin(self, duration_us, stream):
        self._inner.spin(self.c, stream)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name in ("_inner", "c"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)


def _compute_op(s):
    ops = [op for op in s.ops if op.op == "compute"]
    if len(ops) != 1:
        raise ValueError(f"schedule {s.name!r}: a scan needs exactly one compute op, found {len(ops)}")
    return ops[0]


def measure_shape(doc: dict, provider, *, coarse_trials: int = 8, fine_trials: int = 24, fine_points: int = 41,
                  timed_trials: int = 40, budget_s: float = 30.0, profile=None) -> dict:
    """Scan one schedule document on the GPU (see the module docstring)."""
    from gpu_backend.compare import gpu_expected_bytes
    from gpu_backend.runner import GpuSchedule
    from sim.executor import run_reference, run_schedule
    from sim.profile import load_profile
    from sim.schedule import validate

    t_start = time.perf_counter()
    s = validate(doc)
    comp = _compute_op(s)
    reads = [op for op in s.ops if op.op == "read"]
    prof = load_profile(profile or "h200")
    sim_run = run_schedule(s, prof, seed=0, materialise=False)
    copies = [op.id for op in s.ops if op.op == "copy"]
    sim_end = max(float(sim_run.item_end_us[c].max()) for c in copies if sim_run.item_end_us[c].size)

    runner = GpuSchedule(s, provider)
    spin = _SpinOverride(runner.kernels)
    runner.kernels = spin
    pre = [runner.run(timings=True, final=False, guards=False).timings_us[copies[0]][1] for _ in range(3)]
    gpu_end = float(np.median(pre))
    ref = run_reference(s)
    warm = runner.run(timings=False, final=False, guards=False)
    expected = {cap.op_id: gpu_expected_bytes(cap.views, ref.memory.table, guard_bytes=warm.guard_bytes,
                                              ordinals=warm.ordinals) for cap in ref.reads}

    def stale_at(c: float, n: int) -> int:
        spin.c = float(c)
        k = 0
        for _ in range(n):
            gpu = runner.run(timings=False, final=False, guards=False)
            k += any(not np.array_equal(gpu.reads[cap.op_id], expected[cap.op_id]) for cap in ref.reads)
        return k

    cs, ns, ks = [], [], []

    def record(grid, n):
        for c in grid:
            if time.perf_counter() - t_start > budget_s:
                return False
            cs.append(float(c))
            ns.append(int(n))
            ks.append(stale_at(c, n))
        return True

    cmax = 1.5 * max(gpu_end, sim_end) + 15.0
    coarse = np.linspace(0.5, cmax, 33)
    record(coarse, coarse_trials)
    frac = np.array(ks[:len(coarse)], float) / coarse_trials
    step = coarse[1] - coarse[0]
    some = np.flatnonzero(frac > 0)
    if some.size:
        below_one = np.flatnonzero(frac < 1)
        lo = coarse[below_one[0]] - step if below_one.size else coarse[-1]
        hi = coarse[some[-1]] + step
        lo, hi = max(0.5, lo), min(cmax + step, hi)
        if hi > lo:
            record(np.linspace(lo, hi, fine_points), fine_trials)
    order = np.argsort(cs, kind="stable")
    # the median of Z: where the stale fraction crosses 1/2
    c_arr, f_arr = np.array(cs)[order], (np.array(ks) / np.array(ns))[order]
    mid = float(c_arr[np.argmin(np.abs(f_arr - 0.5))]) if c_arr.size else COMPUTE_PLACEHOLDER_US
    spin.c = mid
    timed = {"compute_us": mid, "copy_start_us": [], "copy_end_us": [], "read_start_us": [], "read_end_us": [],
             "compute_start_us": [], "compute_end_us": []}
    for _ in range(timed_trials):
        run = runner.run(timings=True, final=False, guards=False)
        cs0, ce0 = run.timings_us[copies[0]]
        rs0, re0 = run.timings_us[reads[0].id]
        ks0, ke0 = run.timings_us[comp.id]
        for key, v in (("copy_start_us", cs0), ("copy_end_us", ce0), ("read_start_us", rs0), ("read_end_us", re0),
                       ("compute_start_us", ks0), ("compute_end_us", ke0)):
            timed[key].append(round(float(v), 4))
    return {"name": s.name, "doc": doc, "sim_copy_end_us": sim_end, "gpu_copy_end_us": gpu_end, "gate": runner.gate, "compute": spin.mode,
            "scan": {"compute_us": [cs[i] for i in order], "trials": [ns[i] for i in order],
                     "stale": [ks[i] for i in order]},
            "timed": timed, "seconds": round(time.perf_counter() - t_start, 2)}


def measure_spread(provider_name: str, *, example: dict | None = None, profile=None, **kw) -> dict:
    """Every scan shape of ``provider_name`` (and ``example``), measured on the GPU."""
    import torch

    from gpu_backend.providers import get_provider

    provider = get_provider(provider_name)
    out = {"provider": provider_name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "shapes": []}
    for label, doc in scan_shapes(provider_name, example):
        t0 = time.perf_counter()
        try:
            m = measure_shape(doc, provider, profile=profile, **kw)
        except Exception as e:  # a shape the provider refuses: say so, keep the others
            out["shapes"].append({"label": label, "error": f"{type(e).__name__}: {e}"})
            print(f"{provider_name} {label}: {type(e).__name__}: {e}", flush=True)
            continue
        m["label"] = label
        out["shapes"].append(m)
        sc = m["scan"]
        frac = np.array(sc["stale"]) / np.array(sc["trials"])
        print(f"{provider_name} {label}: {sum(sc['trials'])} trials over {len(frac)} compute values, stale 1 -> 0 "
              f"between {min([c for c, f in zip(sc['compute_us'], frac) if f < 1], default=float('nan')):.1f} and "
              f"{max([c for c, f in zip(sc['compute_us'], frac) if f > 0], default=float('nan')):.1f} us; "
              f"sim copy end {m['sim_copy_end_us']:.1f} us; copy {np.median(m['timed']['copy_start_us']):.1f}-"
              f"{np.median(m['timed']['copy_end_us']):.1f} us timed; {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gpu_backend.calibrate.spread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", action="append", required=True, choices=["builtin", "sglang", "torch"])
    ap.add_argument("--out", required=True, help="JSON of the raw scans")
    ap.add_argument("--example", help="also scan this schedule JSON (one compute op)")
    ap.add_argument("--profile", default=None, help="profile for the simulated copy end that sizes the scan")
    ap.add_argument("--budget-s", type=float, default=30.0, help="seconds per shape at most")
    ap.add_argument("--command", default=None, help="the command line to record (provenance)")
    ap.add_argument("--commit", default=None, help="the commit to record (provenance)")
    args = ap.parse_args(argv)
    example = None
    if args.example:
        with open(args.example) as f:
            example = json.load(f)
    doc = {"provenance": {"command": args.command or " ".join(["python -m gpu_backend.calibrate.spread", *sys.argv[1:]]),
                          "commit": args.commit or "?"}, "providers": {}}
    for p in args.provider:
        doc["providers"][p] = measure_spread(p, example=example, profile=args.profile, budget_s=args.budget_s)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
