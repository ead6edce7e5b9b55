"""Hypothesis strategies and assertions for testing schedules, gate maps and fixes.

Needs Hypothesis, which is in the test extra: ``pip install 'kvrace[test]'``.  ``import sim`` never
imports this package (``sim`` itself needs only numpy, simpy and networkx); import it by name::

    from sim.testing import (assert_no_corrupt_read, interleavings, load_forward_programs,
                             schedules)

What it offers (``docs/testing.md`` has a worked pytest example):

* :func:`schedules`: random valid schedules over one geometry family each (:data:`FAMILIES`):
  KV rows of 64 to 1,024 B, DSA index-K pages (8,448 B), DeepSeek V4 C4 pages (37,440 B) and bf16
  index-K rows (256 B), and page-first host pools, copied by every routine of
  :data:`sim.transfers.routines.ROUTINES`; host syncs of every kind (event, stream, device), host
  delays, and several hosts with barriers.
* :func:`load_forward_programs`: engine-like host programs (:class:`LoadForward`): batches of
  concurrent requests whose prefixes are loaded back layer by layer on a load stream (every
  pool's copy of layer ``L``, then that layer's event), while the forward stream runs the DSA
  model's per-layer reads through :func:`sim.engine.forward.issue_forward`, each reader waiting
  or not as the gate map says.
* :func:`interleavings`: for one schedule, an :class:`Interleaving` (same-instant tie order,
  per-op delays, the run's seed, torn or item-atomic landing), all drawn by Hypothesis, so a
  test that draws a schedule and then its interleaving (:func:`schedules_with_interleavings`,
  or ``st.data()``) has Hypothesis shrink both together.
* :func:`assert_no_corrupt_read`: runs a schedule under an interleaving and raises an
  ``AssertionError`` naming each corrupt read and its bytes; the failing example is written out
  (:func:`write_failure`) as a schedule file that ``kvrace schedule run`` reproduces and its
  forced order (``sim.replay.controlled_schedule``'s race-free document) that
  ``kvrace replay --mode controlled`` replays on a GPU.

The smaller strategies the project's own tests have always used live here too:
:func:`kv_schedules` (one 64 B KV geometry, optionally race-free) and :func:`rich_schedules`
(:func:`schedules` over the kv, index-K and C4 families on one host).

Modules: ``schedules`` (the geometry families and :func:`schedules`), ``programs``
(:class:`LoadForward`), ``interleavings`` (:class:`Interleaving`, :func:`run_interleaving`),
``failures`` (:func:`assert_no_corrupt_read`, :func:`write_failure`).
"""
from __future__ import annotations

from sim.testing.failures import (DEFAULT_FAILURES, FAILURES_ENV, assert_no_corrupt_read, corrupt_reads,
                                  failure_dir, write_failure)
from sim.testing.interleavings import (Interleaving, apply_interleaving, interleavings, run_interleaving,
                                       schedules_with_interleavings)
from sim.testing.programs import LoadForward, load_forward_programs
from sim.testing.schedules import (EVENTS, FAMILIES, LAYERS, RICH_UNITS, STREAMS, UNIT_BYTES, UNITS, copy_op,
                                   idx_sets, kv_buffers, kv_schedules, rich_schedules, schedules)

__all__ = ["DEFAULT_FAILURES", "EVENTS", "FAMILIES", "FAILURES_ENV", "Interleaving", "LAYERS", "LoadForward",
           "RICH_UNITS", "STREAMS", "UNITS", "UNIT_BYTES", "apply_interleaving", "assert_no_corrupt_read", "copy_op",
           "corrupt_reads", "failure_dir", "idx_sets", "interleavings", "kv_buffers", "kv_schedules",
           "load_forward_programs", "rich_schedules", "run_interleaving", "schedules", "schedules_with_interleavings",
           "write_failure"]
