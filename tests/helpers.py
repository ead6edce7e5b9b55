"""Small builders shared by the simulator tests."""
from __future__ import annotations

import copy

from sim.profile import load_profile, profile_from_dict

H200 = load_profile("h200")


def profile(**overrides):
    """The h200 profile without jitter and without a per-warp rate limit (exact, simple
    times), with overrides."""
    doc = {"name": "test", "calibrated": False, "source": "tests", "date": "2026-11",
           "link": {"h2d_gbps": H200.h2d_gbps, "d2h_gbps": H200.d2h_gbps, "launch_us": H200.launch_us,
                    "memcpy_latency_us": H200.memcpy_latency_us, "item_overhead_us": H200.item_overhead_us,
                    "warp_gbps": 1e9, "gpus_per_link": 1, "sharing": "fifo"},
           "device": {"sm_count": H200.sm_count, "resident_warps_per_sm": H200.resident_warps_per_sm,
                      "hbm_gbps": H200.hbm_gbps, "kernel_launch_us": H200.kernel_launch_us,
                      "launch_jitter_us": 0.0},
           "compute": {"jitter_frac": 0.0}}
    for key, value in overrides.items():
        for section in ("link", "device", "compute"):
            if key in doc[section]:
                doc[section][key] = value
                break
        else:
            raise KeyError(key)
    return profile_from_dict(doc)


def schedule_doc(ops, buffers=None, streams=("s0", "s1", "s2"), events=("e0", "e1")):
    from tests.strategies import base_buffers

    return {"kvrace_schedule": 1, "name": "t", "buffers": copy.deepcopy(buffers or base_buffers()),
            "streams": list(streams), "events": list(events), "ops": ops}


#: providers a GPU test run must have (comma list, e.g. KVRACE_REQUIRE_PROVIDERS=sglang): a test
#: that would skip because one of them is unavailable fails instead, so a run that was asked for
#: SGLang's kernels cannot pass by skipping them
REQUIRE_PROVIDERS_ENV = "KVRACE_REQUIRE_PROVIDERS"


def skip_unavailable_provider(name: str, why: str) -> None:
    """Skip a test whose provider ``name`` is unavailable (``why``), or fail it when the run
    requires that provider (``$KVRACE_REQUIRE_PROVIDERS``)."""
    import os

    import pytest

    required = {p.strip() for p in os.environ.get(REQUIRE_PROVIDERS_ENV, "").split(",") if p.strip()}
    if name in required:
        pytest.fail(f"provider {name} is required ({REQUIRE_PROVIDERS_ENV}={os.environ[REQUIRE_PROVIDERS_ENV]}) "
                    f"but unavailable: {why}")
    pytest.skip(f"provider {name} unavailable: {why}")


def run_subcommand(add_parser, command: str, *argv) -> int:
    """Run a CLI module's subcommand (``add_parser(sub, epilog)``, as the helpers' modules
    expose it) on its own parser: ``kvrace <command> argv...``; returns its exit code."""
    import argparse

    p = argparse.ArgumentParser(prog="kvrace")
    sub = p.add_subparsers(dest="command", required=True)
    add_parser(sub, "exit codes: ...")
    args = p.parse_args([command, *argv])
    return args.func(args)


def track_races(s, limit):
    """A ``RaceTracker`` fed every op of the validated schedule ``s`` in issue order (its
    accesses grouped by op, clocks from ``OnlineClocks``), pruning as early as allowed
    (``PRUNE_EVERY = 1``): what the race-tracker tests compare with ``race_scan``."""
    from sim.hb import OnlineClocks, RaceTracker, accesses

    clocks = OnlineClocks(s.streams, s.hosts)
    tracker = RaceTracker(clocks, limit)
    tracker.PRUNE_EVERY = 1                      # drop accesses as early as possible
    by_op: dict[int, list] = {}
    for acc in accesses(s):
        by_op.setdefault(acc.op, []).append((acc.buffer, acc.write, acc.starts, acc.ends))
    for op in s.ops:
        comp, pos, clock = clocks.add(op)
        tracker.add(op.index, comp, pos, clock, by_op.get(op.index, []))
    return tracker



def doc_sha(doc) -> str:
    """sha256 of a JSON-able document (a report, a snapshot), keys sorted: equal documents,
    equal digests."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def both_ways(cls, switch: str, fn, *args):
    """``(fn(*args), fn(*args) with cls.<switch> set False)``: a fast path (its switch on, as
    shipped) and the path it replaces, for tests that compare the two."""
    import pytest

    on = fn(*args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, switch, False)
        off = fn(*args)
    return on, off


def stream_static(s, profile, *, on_read=None, digests: bool = True, **kw):
    """``run_schedule(s, profile, keep="report", **kw)`` with ``on_read`` handed to the run's
    verdicts before it starts (``OnlineVerdicts.on_read(on_read, digests=digests)``): the run."""
    from sim.executor import Executor, run_static

    ex = Executor(s.buffers, s.streams, profile, keep="report", hosts=s.hosts, static_ops=s.ops, **kw)
    if on_read is not None:
        ex.online.on_read(on_read, digests=digests)
    return run_static(ex, s)


def example_files() -> list[str]:
    """Every shipped schedule: ``examples/*.json`` and the bug pairs ``examples/bugs/*.json``
    (paths relative to the repository root, where the tests run)."""
    import glob

    return sorted(glob.glob("examples/*.json")) + sorted(glob.glob("examples/bugs/*.json"))


def example_script(name: str):
    """The module of ``examples/<name>.py`` (the scripts that regenerate the example files),
    loaded from its path: ``examples/`` is not a package."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def current_window_read(script: str, op: str | None = None):
    """``(schedule, report, read)`` of the window ``examples/<script>.py`` writes, after
    checking the committed file is what the script makes today: ``read`` is the report entry
    of read ``op``, or of the window's one read when ``op`` is None."""
    import json

    from sim.executor import run_schedule
    from sim.schedule import validate
    from sim.verdicts import analyse

    mod = example_script(script)
    assert mod.main(["--check"]) == 0, f"run: python examples/{script}.py"
    s = validate(json.loads(mod.OUT.read_text()))
    rep = analyse(run_schedule(s, H200))
    if op is None:
        (read,) = rep["reads"]
    else:
        read = next(e for e in rep["reads"] if e["op"] == op)
    return s, rep, read


def provenance_per_byte(view, keys: dict):
    """(origin key, stream offset) of every byte of a view (``keys`` numbers the origins: views
    of different runs have different origin tables): the per-byte reference the verdicts'
    run-based comparisons are tested against."""
    import numpy as np

    p = view.compact.pieces(0, view.compact.nbytes)
    ids = np.array([keys.setdefault(view.compact.table[int(i)], len(keys)) for i in p.origin_id], dtype=np.int64)
    origin = np.repeat(ids, p.length)
    stream = np.repeat(p.stream_offset - p.start, p.length) + np.arange(view.compact.nbytes)
    return origin, stream


def differing_bytes(vo, vr):
    """Per byte of a view: does it hold other bytes (by provenance) than the reference's?"""
    keys: dict = {}
    oo, so = provenance_per_byte(vo, keys)
    orr, sr = provenance_per_byte(vr, keys)
    return (oo != orr) | (so != sr)
