"""The Hypothesis strategies the tests import, under the names they have always used.

Their one home is :mod:`sim.testing` (public API); this module only re-exports:
``schedules`` is :func:`sim.testing.kv_schedules` (the small 64 B KV geometry) and
``base_buffers`` is :func:`sim.testing.kv_buffers`.
"""
from sim.testing import (EVENTS, LAYERS, RICH_UNITS, STREAMS, UNIT_BYTES, UNITS, copy_op, idx_sets,  # noqa: F401
                         kv_buffers as base_buffers, kv_schedules as schedules, rich_schedules)

__all__ = ["EVENTS", "LAYERS", "RICH_UNITS", "STREAMS", "UNITS", "UNIT_BYTES", "base_buffers", "copy_op",
           "idx_sets", "rich_schedules", "schedules"]
