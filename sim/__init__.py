"""kvrace simulator: byte-exact buffers, copy routines, CUDA stream/event semantics.

Runs on numpy, simpy and networkx alone (no torch, and never ``gpu_backend`` or the ``kvrace``
command line).  The public API is ``__all__``::

    import sim

    s = sim.load("examples/index_k_ungated_race.json")      # or sim.validate(doc), sim.ScheduleBuilder
    run = sim.run_schedule(s, sim.load_profile("h200"), ties=sim.TieBreak("fifo"))
    rep = sim.analyse(run)
    print(sim.summary_text(rep))

    session = sim.CacheSession(sim.SessionConfig(model="dsa", page_size=64))   # the HiCache model
    session.cache.insert(...)                                                   # SGLang's names
    r = sim.run_prefill_engine("incident-repro")       # the engine (kvrace run), an EngineResult
    sim.Explorer(s).exhaustive()                       # every outcome of a schedule (kvrace explore)

Every exception kvrace raises on purpose is a ``sim.KvraceError`` (bad input is its subclass
``sim.InputError``).  The names load their modules on first use, so ``import sim`` (and
``import sim.errors``) stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_HOME = {
    # schedules: read, check, build
    "load": "sim.schedule",
    "validate": "sim.schedule",
    "Schedule": "sim.schedule",
    "ScheduleBuilder": "sim.schedule",
    # running them
    "run_schedule": "sim.executor",
    "run_programs": "sim.executor",
    "run_reference": "sim.executor",
    "Host": "sim.executor",
    "TieBreak": "sim.executor",
    "RunResult": "sim.executor",
    # windows of a run
    "cut_window": "sim.window",
    # the HiCache model, usable on its own
    "CacheSession": "sim.cache.session",
    "SessionConfig": "sim.cache.session",
    "HiRadixCache": "sim.cache.hiradix",
    "HiCacheController": "sim.cache.controller",
    # the engine, its scenarios and the signature table
    "load_scenario": "sim.engine.scenario",
    "PrefillEngine": "sim.engine.engine",
    "run_prefill_engine": "sim.engine.engine",
    "EngineResult": "sim.engine.engine",
    "run_signatures": "sim.engine.signatures",
    # every interleaving of a schedule
    "Explorer": "sim.explore",
    # verdicts and outputs
    "analyse": "sim.verdicts",
    "summary_text": "sim.verdicts",
    "Snapshot": "sim.snapshot",
    "snapshot_of": "sim.snapshot",
    # hardware profiles
    "load_profile": "sim.profile",
    "Profile": "sim.profile",
    # errors
    "KvraceError": "sim.errors",
    "InputError": "sim.errors",
    "ReplayError": "sim.replay",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value          # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
