"""``assert_no_corrupt_read`` and the failing example it writes: the schedule that
``kvrace schedule run`` reproduces, and its forced order for ``kvrace replay --mode controlled``."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from sim.testing.interleavings import Interleaving, run_interleaving

__all__ = ["DEFAULT_FAILURES", "FAILURES_ENV", "assert_no_corrupt_read", "corrupt_reads", "failure_dir",
           "write_failure"]

# ================================================================ the assertion

#: environment variable naming the directory failing examples are written to
FAILURES_ENV = "KVRACE_FAILURES"
DEFAULT_FAILURES = ".kvrace-failures"


def failure_dir(out_dir=None) -> Path:
    """Where failing examples go: ``out_dir``, else ``$KVRACE_FAILURES``, else
    ``.kvrace-failures/`` (relative to the working directory)."""
    return Path(out_dir or os.environ.get(FAILURES_ENV) or DEFAULT_FAILURES)


def corrupt_reads(report: dict) -> list[dict]:
    """The ``stale`` and ``torn`` read entries of a ``sim.verdicts.analyse`` report."""
    return [r for r in report["reads"] if r["status"] in ("stale", "torn")]


def _read_text(r: dict) -> str:
    fm = r.get("first_mismatch") or {}
    pos = fm.get("position") or {}
    where = ", ".join(f"{k} {v}" for k, v in pos.items() if k in ("layer", "unit", "page", "field", "entry",
                                                                   "token", "row"))
    return (f"read {r['op']} on {r['stream']} at {r['time_us']:.3f} us: {r['buffer']} {r['nbytes']} B -> "
            f"{r['status'].upper()}, {r['bytes_differing']} bytes differ from the happens-before order, first at "
            f"offset {fm.get('offset')}{f' ({where})' if where else ''}\n"
            f"    saw:      {fm.get('observed')}\n    expected: {fm.get('expected')}")


def _in_final_hypothesis_run() -> bool:
    """True outside Hypothesis and in the run Hypothesis reports at the end (the shrunk
    example); False while it is still searching or shrinking."""
    try:
        from hypothesis.control import current_build_context, currently_in_test_context
    except ImportError:          # pragma: no cover - an old Hypothesis
        return True
    if not currently_in_test_context():
        return True
    return bool(getattr(current_build_context(), "is_final", True))


def write_failure(s, il: Interleaving, report: dict, out_dir=None, *, profile="h200") -> dict:
    """Write a failing example into :func:`failure_dir` and return what was written.

    Files, named ``NAME-DIGEST`` (``DIGEST``: 12 hex digits of the schedule and interleaving):

    * ``NAME-DIGEST.json``: the schedule with the interleaving's delays (format 2);
      ``kvrace schedule run NAME-DIGEST.json`` plus the interleaving's options
      (:meth:`Interleaving.cli_args`) reproduces the corrupt reads;
    * ``NAME-DIGEST.forced.json``: the forced order, ``sim.replay.controlled_schedule`` of the
      item-atomic run under the same interleaving (the race-free schedule controlled replay
      makes; ``kvrace replay NAME-DIGEST.forced.json --mode controlled`` runs it on a GPU and
      must see the same bytes).  Written only when that item-atomic run has a corrupt read too
      (a torn read cannot be forced: items land whole on a controlled replay) and streams and
      events can force it;
    * ``NAME-DIGEST.failure.json``: the interleaving, the commands, each corrupt read (op,
      status, bytes, provenance digest, first mismatch) and why a forced order is missing."""
    from sim.replay import ReplayError, controlled_schedule
    from sim.verdicts import analyse

    doc = s.to_json()
    key = hashlib.sha256(json.dumps([s.digest(), il.to_json()], sort_keys=True).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in s.name)[:80] or "schedule"
    d = failure_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    stem = d / f"{name}-{key}"
    sched_path, forced_path, record_path = (Path(f"{stem}{ext}") for ext in (".json", ".forced.json", ".failure.json"))
    doc["description"] = (f"{doc.get('description', '')} Failing example written by sim.testing: run "
                          f"`kvrace schedule run {sched_path.name} {' '.join(il.cli_args())}`.").strip()
    sched_path.write_text(json.dumps(doc, indent=1) + "\n")
    forced, why = None, None
    _, atomic = run_interleaving(doc, Interleaving(il.first, (), il.seed, True), profile=profile)
    atomic_bad = corrupt_reads(analyse(atomic))
    if not atomic_bad:
        why = ("the same interleaving with items landing whole has no corrupt read (the read caught a copy "
               "mid-item, which a controlled replay cannot force)")
    else:
        try:
            forced = controlled_schedule(atomic.schedule, atomic)
        except ReplayError as e:
            why = f"streams and events cannot force it: {e}"
    if forced is not None:
        forced["description"] = (f"Forced order of {sched_path.name} under {il.describe()} with items landing "
                                 "whole: the reads see the corrupt bytes in happens-before order. "
                                 f"`kvrace replay {forced_path.name} --mode controlled` runs it on a GPU.")
        forced_path.write_text(json.dumps(forced, indent=1) + "\n")
    bad = corrupt_reads(report)
    record = {
        "kvrace_failure": 1,
        "schedule": sched_path.name,
        "forced": forced_path.name if forced is not None else None,
        "forced_missing_because": why,
        "interleaving": il.to_json(),
        "profile": profile if isinstance(profile, str) else profile.name,
        "schedule_run": ["kvrace", "schedule", "run", sched_path.name, *il.cli_args(), "--profile",
                         profile if isinstance(profile, str) else profile.name],
        "replay": (["kvrace", "replay", forced_path.name, "--mode", "controlled"] if forced is not None else None),
        "corrupt_reads": [{k: r.get(k) for k in ("op", "stream", "buffer", "status", "nbytes", "bytes_differing",
                                                 "provenance_sha256", "expected_provenance_sha256",
                                                 "first_mismatch")} for r in bad],
        "forced_reads": [{"op": r["op"], "status": r["status"], "provenance_sha256": r["provenance_sha256"]}
                         for r in atomic_bad] if forced is not None else [],
    }
    record_path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return {"schedule": sched_path, "forced": forced_path if forced is not None else None, "record": record_path,
            "forced_missing_because": why}


def assert_no_corrupt_read(schedule, interleaving: Interleaving | None = None, *, profile="h200",
                           out_dir=None) -> dict:
    """Run ``schedule`` (a ``Schedule``, a document or a path) under ``interleaving``
    (default: fifo ties, seed 0, no delays, torn items) and raise ``AssertionError`` if a read
    is corrupt (``stale`` or ``torn``: its bytes differ from the happens-before order's).

    The message names every corrupt read (op, stream, buffer, bytes differing, the first
    differing byte's position, whose bytes it saw and whose it should have seen), the
    interleaving, and the files :func:`write_failure` wrote with the commands that reproduce
    them.  Under Hypothesis the files are written only for the example it reports (the shrunk
    one), not for every example it tries on the way.  Returns the run's report otherwise."""
    from sim.verdicts import analyse

    il = interleaving or Interleaving()
    s, run = run_interleaving(schedule, il, profile=profile, materialise=False)
    rep = analyse(run)
    bad = corrupt_reads(rep)
    if not bad:
        return rep
    lines = [f"{len(bad)} corrupt read{'s' if len(bad) != 1 else ''} in schedule {s.name} under {il.describe()}:"]
    lines += ["  " + _read_text(r) for r in bad[:4]]
    if len(bad) > 4:
        lines.append(f"  ... and {len(bad) - 4} more")
    if _in_final_hypothesis_run():
        files = write_failure(s, il, rep, out_dir, profile=profile)
        p = profile if isinstance(profile, str) else profile.name
        lines.append(f"written: {files['schedule']}")
        lines.append(f"  reproduce: kvrace schedule run {files['schedule']} {' '.join(il.cli_args())} --profile {p}")
        if files["forced"] is not None:
            lines.append(f"  forced order: {files['forced']}")
            lines.append(f"  replay on a GPU: kvrace replay {files['forced']} --mode controlled")
        else:
            lines.append(f"  no forced order: {files['forced_missing_because']}")
        lines.append(f"  record: {files['record']}")
    raise AssertionError("\n".join(lines))
