"""Sweeps: race probability over a grid of schedule parameters, with intervals.

* ``generators``: the registry of parametrised schedule families (``minimal_race``).
* ``trials``: one chunk of seeded trials of one point (what a worker runs).
* ``runner``: ``run_sweep`` over local processes or Ray; ``--until-ci`` stopping.
* ``store``: ``sweep.json`` / ``sweep.csv``, written as points finish, resumable.
* ``stats``: the Wilson interval.

``sim.sweeps`` imports numpy and the standard library only (Ray when asked for).
"""
from __future__ import annotations

from sim.sweeps.generators import GENERATORS, Generator, Param, get_generator, register
from sim.sweeps.runner import CHUNK_TRIALS, Progress, SweepSpec, parse_grid, run_sweep
from sim.sweeps.stats import wilson_interval
from sim.sweeps.store import load_results
from sim.sweeps.trials import point_key, trial_seed

__all__ = ["CHUNK_TRIALS", "GENERATORS", "Generator", "Param", "Progress", "SweepSpec", "get_generator",
           "load_results", "parse_grid", "point_key", "register", "run_sweep", "trial_seed", "wilson_interval"]
