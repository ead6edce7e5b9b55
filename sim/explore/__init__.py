"""Explore every interleaving of a schedule: the distinct outcomes, with witnesses.

``sim.explore.model`` (what can be reordered: steps, blocks, conflict pairs),
``sim.explore.search`` (traces with partial-order reduction; every interleaving without),
``sim.explore.evaluate`` (what an order leaves: each read's bytes, each buffer's bytes),
``sim.explore.witness`` (an order as a controlled-replay schedule),
``sim.explore.sampling`` (PCT, the timing model's runs) and ``sim.explore.explorer``
(``Explorer``: exhaustive, pct, random; results, text).  ``docs/explore.md`` says what an
outcome is, what the reduction assumes and what PCT guarantees.

    from sim.explore import Explorer
    from sim.schedule import load

    res = Explorer(load("examples/index_k_ungated_race.json")).exhaustive()
    [(o.status, o.orders) for o in res.outcomes]
"""
from __future__ import annotations

from sim.explore.explorer import ExploreResult, Explorer, Outcome, explore, summary_text
from sim.explore.model import DEFAULT_CHUNK_BYTES, RaceModel, build_model
from sim.explore.sampling import pct_bound
from sim.explore.witness import witness_schedule

__all__ = ["DEFAULT_CHUNK_BYTES", "ExploreResult", "Explorer", "Outcome", "RaceModel", "build_model", "explore",
           "pct_bound", "summary_text", "witness_schedule"]
