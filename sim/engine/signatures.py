"""The A/B signature table: every hypothesis run across a deployment's A/B matrix, scored
against what the deployment observed.

An **A/B matrix** (a TOML file; the incident's ships as ``sim/scenarios/ab/incident.toml``,
from ``reference/incident.md``) names a base scenario and its columns.  Each column is a list of
``--set`` overrides (e.g. ``model.index_k_dtype=bf16``, ``hicache.prefill=false``,
``workload.concurrency=1``) and, where the deployment measured it, what it observed::

    scenario = "incident-short"
    [[column]]
    name = "bf16 / HiCache on / C=high"
    set = ["model.index_k_dtype=bf16"]
    observed = { fraction = 0.17, low = 0.12, high = 0.18 }   # corrupted responses
    [[column]]
    name = "fixed"
    set = ["model.index_k_dtype=bf16"]
    fixed = true                   # the hypothesis removed: hypothesis `none` in its place
    observed = { fraction = 0.0 }

A **row** is a hypothesis (``sim.engine.hypotheses``): each cell runs the base scenario with
the column's overrides and ``variant.hypotheses = [row]`` (a ``fixed`` column runs ``none``:
the fix of a hypothesised defect is its absence), ``trials`` times with seeds ``seed,
seed + 1, ...``.  A cell reports corrupted requests over requests, the fraction and its Wilson
95 % interval (requests are counted as independent trials, which they are not quite: requests
of one run share its load).

**Scoring** is on the pattern, not the magnitude (a shortened scenario has other loads than
the deployment): a column observed corrupt (``fraction > 0``) is matched when the cell's
interval excludes 0 (corruption is visible); a column observed clean is matched when the cell
saw no corrupted request; an unobserved column is not scored.  ``score`` is the fraction of
scored columns matched; a row ``fits`` when it matches them all.

Identical runs are run once: cells whose scenario (after overrides and the hypothesis) and
seed are equal share their result, e.g. ``ungated-index-k-bf16`` on an fp8 column is the
``none`` run.  Runs go to ``workers`` processes; results do not depend on their number.
"""
from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from sim.engine.hypotheses import hypothesis_names
from sim.engine.scenario import Scenario, load_scenario
from sim.errors import InputError, check_keys, show
from sim.sweeps.stats import wilson_interval

__all__ = ["ABColumn", "ABMatrix", "Cell", "Observed", "SignatureRow", "SignatureTable", "load_ab_matrix",
           "run_signatures", "AB_DIR"]

#: the shipped A/B matrices (``name.toml``)
AB_DIR = Path(__file__).resolve().parent.parent / "scenarios" / "ab"


@dataclass(frozen=True)
class Observed:
    """What the deployment saw in a column: the corrupted fraction and its observed range."""

    fraction: float
    low: float
    high: float

    @property
    def corrupt(self) -> bool:
        return self.fraction > 0


@dataclass(frozen=True)
class ABColumn:
    """One A/B configuration: overrides on the base scenario; ``fixed``: run hypothesis
    ``none`` instead of the row's; ``observed``: None where the deployment did not measure it."""

    name: str
    overrides: tuple[str, ...]
    fixed: bool = False
    observed: Observed | None = None
    note: str = ""


@dataclass(frozen=True)
class ABMatrix:
    name: str
    scenario: str
    columns: tuple[ABColumn, ...]
    source: str = ""


def _observed(d, where: str) -> Observed:
    if not isinstance(d, Mapping):
        raise InputError(where, f"expected a table {{fraction, low?, high?}}, got {show(d)}")
    check_keys(d, ["fraction", "low", "high"], where)
    vals = {}
    for k in ("fraction", "low", "high"):
        v = d.get(k, d.get("fraction"))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise InputError(f"{where}.{k}", f"expected a fraction in [0, 1], got {show(v)}")
        vals[k] = float(v)
    if not vals["low"] <= vals["fraction"] <= vals["high"]:
        raise InputError(where, f"expected low <= fraction <= high, got {vals}")
    return Observed(**vals)


def ab_matrix_from_dict(d: Mapping, name: str = "ab") -> ABMatrix:
    """An :class:`ABMatrix` from a parsed TOML document (errors name the key)."""
    if not isinstance(d, Mapping):
        raise InputError(name, f"expected a table, got {show(d)}")
    check_keys(d, ["scenario", "source", "column"], name)
    scenario = d.get("scenario")
    if not isinstance(scenario, str) or not scenario:
        raise InputError(f"{name}.scenario", f"expected a scenario name or path, got {show(scenario)}")
    cols = d.get("column")
    if not isinstance(cols, list) or not cols:
        raise InputError(f"{name}.column", "expected at least one [[column]] table")
    out = []
    for i, c in enumerate(cols):
        w = f"{name}.column[{i}]"
        if not isinstance(c, Mapping):
            raise InputError(w, f"expected a table, got {show(c)}")
        check_keys(c, ["name", "set", "fixed", "observed", "note"], w)
        cname, sets = c.get("name"), c.get("set", [])
        if not isinstance(cname, str) or not cname:
            raise InputError(f"{w}.name", f"expected a non-empty string, got {show(cname)}")
        if not isinstance(sets, list) or not all(isinstance(x, str) and "=" in x for x in sets):
            raise InputError(f"{w}.set", f"expected a list of 'section.key=value' strings, got {show(sets)}")
        fixed = c.get("fixed", False)
        if not isinstance(fixed, bool):
            raise InputError(f"{w}.fixed", f"expected true or false, got {show(fixed)}")
        obs = _observed(c["observed"], f"{w}.observed") if "observed" in c else None
        out.append(ABColumn(cname, tuple(sets), fixed, obs, str(c.get("note", ""))))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise InputError(f"{name}.column", f"expected distinct column names, got {names}")
    return ABMatrix(name, scenario, tuple(out), str(d.get("source", "")))


def load_ab_matrix(name_or_path: str) -> ABMatrix:
    """A shipped matrix (``incident``) or an A/B matrix TOML file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    p = Path(name_or_path)
    if not p.suffix:
        p = AB_DIR / f"{name_or_path}.toml"
        if not p.is_file():
            shipped = sorted(x.stem for x in AB_DIR.glob("*.toml"))
            raise InputError("matrix", f"expected a shipped A/B matrix {shipped} or a TOML path, got {show(name_or_path)}")
    if not p.is_file():
        raise InputError("matrix", f"no such file: {p}")
    try:
        doc = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise InputError(str(p), f"not valid TOML: {e}") from None
    return ab_matrix_from_dict(doc, p.stem)


@dataclass
class Cell:
    """One (hypothesis, column) cell over its trials."""

    corrupted: int
    requests: int
    stale_reads: int
    torn_reads: int
    load_backs: int
    oob_writes: int
    fraction: float
    ci: tuple[float, float]


@dataclass
class SignatureRow:
    hypothesis: str
    cells: list[Cell]
    score: float | None
    fits: bool
    matched: list[bool | None]


@dataclass
class SignatureTable:
    matrix: str
    scenario: str
    trials: int
    seed: int
    columns: list[ABColumn]
    rows: list[SignatureRow]
    runs: int
    wall_time_s: float

    def to_dict(self) -> dict:
        return {
            "matrix": self.matrix, "scenario": self.scenario, "trials": self.trials, "seed": self.seed,
            "runs": self.runs, "wall_time_s": self.wall_time_s,
            "columns": [{"name": c.name, "config": dict(x.split("=", 1) for x in c.overrides), "fixed": c.fixed,
                         "note": c.note} for c in self.columns],
            "observed": [{"fraction": None, "low": None, "high": None, "corrupt": None} if c.observed is None else
                         {"fraction": c.observed.fraction, "low": c.observed.low, "high": c.observed.high,
                          "corrupt": c.observed.corrupt} for c in self.columns],
            "rows": [{"hypothesis": r.hypothesis, "score": r.score, "fits": r.fits, "matched": r.matched,
                      "cells": [dict(dataclasses.asdict(c), ci=list(c.ci)) for c in r.cells]} for r in self.rows],
        }


def _match(cell: Cell, obs: Observed | None) -> bool | None:
    if obs is None:
        return None
    return cell.ci[0] > 0 if obs.corrupt else cell.corrupted == 0


def _run_one(job: tuple) -> dict:
    """One engine run (a process-pool task): ``(scenario, overrides, seed)`` -> metrics."""
    from sim.engine.engine import run_prefill_engine

    scenario, overrides, seed = job
    r = run_prefill_engine(scenario, seed, overrides=overrides)
    return {k: getattr(r, k) for k in ("requests_total", "requests_corrupted", "stale_reads", "torn_reads",
                                       "load_backs", "oob_writes")}


def _resolved(sc: Scenario) -> tuple:
    """A hashable identity of a resolved scenario (two equal ones give the same run)."""
    return tuple((f.name, repr(getattr(sc, f.name))) for f in dataclasses.fields(sc) if f.name != "name")


def run_signatures(matrix: ABMatrix | str = "incident", *, scenario: str | None = None, overrides: Iterable[str] = (),
                   hypotheses: Iterable[str] | None = None, trials: int = 1, seed: int = 0, workers: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> SignatureTable:
    """Run ``matrix`` (an :class:`ABMatrix` or a name/path for :func:`load_ab_matrix`) under
    each hypothesis (default: every registered one).  ``scenario`` replaces the matrix's base
    scenario; ``overrides`` apply to every cell before the column's own.  ``progress(done,
    total)`` is called as runs finish."""
    t0 = time.perf_counter()
    m = matrix if isinstance(matrix, ABMatrix) else load_ab_matrix(matrix)
    base = scenario or m.scenario
    overrides = list(overrides)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise InputError("trials", f"expected an integer >= 1, got {show(trials)}")
    names = list(hypothesis_names() if hypotheses is None else hypotheses)
    known = hypothesis_names()
    for h in names:
        if h not in known:
            raise InputError("hypotheses", f"expected names among {known}, got {show(h)}")
    # every cell's scenario, resolved (and so validated) up front: a bad override fails before any run
    cell_jobs: dict[tuple[int, int], list] = {}
    unique: dict[tuple, tuple] = {}
    for i, h in enumerate(names):
        for j, col in enumerate(m.columns):
            sets = overrides + list(col.overrides) + [f"variant.hypotheses={'none' if col.fixed else h}"]
            try:
                sc = load_scenario(base, sets)
            except InputError as e:
                raise InputError(f"{m.name}.column[{j}] ({col.name})", str(e)) from None
            ident = _resolved(sc)
            keys = []
            for t in range(trials):
                k = (ident, seed + t)
                unique.setdefault(k, (base, tuple(sets), seed + t))
                keys.append(k)
            cell_jobs[(i, j)] = keys
    results: dict[tuple, dict] = {}
    jobs = list(unique.items())
    workers = (os.cpu_count() or 1) if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise InputError("workers", f"expected an integer >= 1, got {show(workers)}")
    if workers == 1 or len(jobs) == 1:
        for n, (k, job) in enumerate(jobs, 1):
            results[k] = _run_one(job)
            if progress:
                progress(n, len(jobs))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
            for n, (k, res) in enumerate(zip((k for k, _ in jobs), pool.map(_run_one, [j for _, j in jobs])), 1):
                results[k] = res
                if progress:
                    progress(n, len(jobs))
    rows = []
    for i, h in enumerate(names):
        cells, matched = [], []
        for j, col in enumerate(m.columns):
            rs = [results[k] for k in cell_jobs[(i, j)]]
            k_ = sum(r["requests_corrupted"] for r in rs)
            n_ = sum(r["requests_total"] for r in rs)
            cell = Cell(k_, n_, sum(r["stale_reads"] for r in rs), sum(r["torn_reads"] for r in rs),
                        sum(r["load_backs"] for r in rs), sum(r["oob_writes"] for r in rs),
                        k_ / n_ if n_ else 0.0, wilson_interval(k_, n_))
            cells.append(cell)
            matched.append(_match(cell, col.observed))
        scored = [x for x in matched if x is not None]
        score = sum(scored) / len(scored) if scored else None
        rows.append(SignatureRow(h, cells, score, bool(scored) and all(scored), matched))
    return SignatureTable(m.name, base, trials, seed, list(m.columns), rows, len(jobs), time.perf_counter() - t0)
