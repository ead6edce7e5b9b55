"""Mutants: remove one synchronisation at a time and see whether kvrace notices.

**Schedule mutants** (:func:`schedule_mutants`, :func:`mutate_schedule`): for a schedule, one
mutant per synchronisation removed:

* each ``wait`` (the stream no longer waits on its event);
* each ``record``; the waits, host syncs and queries bound to it then bind, as CUDA does, to the
  latest earlier record of the same event, or to none (``Schedule.unbound``: a no-op wait or
  synchronize).  ``validate`` accepts unbound waits and syncs.  It refuses a *negative*
  ``host_query`` left with no record (``cudaEventQuery`` on a never-recorded event reports
  complete), so such a query is rewritten to ``outcome: true`` in the mutant (listed in
  ``rewritten``): it then orders nothing, being unbound;
* each ``host_sync``;
* each positive ``host_query`` (a negative query orders nothing, so removing it is no mutant);
* each ``barrier`` instance: every participant's op of it (one participant's alone would leave
  the others blocked forever, which ``validate`` refuses as a deadlock).

Each mutant is judged three ways against the original schedule:

* ``latent_race``: ``sim.hb.race_scan`` (what ``analyse`` lists) finds a racing
  (buffer, op id, op id) the original does not have;
* ``corrupt_explored``: the exhaustive exploration (``Explorer.exhaustive``, ``max_orders``
  cap; ``explore_complete`` says whether it finished) finds a corrupt outcome whose reads
  (``{read op id: provenance sha256}``) are not those of any outcome of the original.  For an
  original with no corrupt outcome that is simply "a corrupt outcome";
* ``probability``: the fraction of ``trials`` timing runs (seeds ``seed .. seed+trials-1``,
  ``TieBreak("seeded", seed)``, the profile's jitter) with a corrupt read, and its 95 %
  Wilson interval.

A mutant is **detected** when ``latent_race`` or ``corrupt_explored``.  It is **equivalent**
when it is not detected, both explorations (the mutant's and the original's) are complete and
every outcome of the mutant gives every read exactly the bytes (provenance) of some outcome of
the original: no interleaving of the mutant lets a read see bytes the original could not.  It is
**missed** otherwise (not detected, and not shown equivalent: a read can change without being
judged corrupt, or an exploration stopped at ``max_orders``).  The **mutation score** is
detected / mutants; ``score_non_equivalent`` is detected / (mutants - equivalent).

**Scenario mutants** (:func:`mutate_scenario`): for an engine scenario, one mutant per accessor
gated in the scenario's effective gate map (after its hypotheses) turned ungated
(``GateMap.override({accessor: False})``, written to a temporary gate-map TOML that
``variant.gate_map`` names), plus ``hicache.load_fence=false`` when the fence is on.  A gate
mutant whose change leaves every step of the model gated as before (no step reads through the
accessor, or each step that does also calls another gated accessor: the forward model gates a
step when any of its accessors waits) is **equivalent by construction** and not run unless
``run_all``.  Each mutant runs ``trials`` engine seeds (``run.seed .. run.seed+trials-1``):
requests corrupted and latent races, against the unmutated scenario's runs of the same seeds.
A scenario mutant is **detected** when some seed corrupts requests and the per-seed counts of
corrupted requests differ from the unmutated run's, or some seed has more latent races than the
unmutated run of that seed.  Its score is detected / mutants (``score_non_equivalent``: over the
mutants run).
"""
from __future__ import annotations

import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from sim.errors import InputError, show
from sim.executor import TieBreak, run_schedule
from sim.explore.explorer import Explorer
from sim.explore.model import DEFAULT_CHUNK_BYTES
from sim.hb import race_scan
from sim.profile import Profile, load_profile
from sim.schedule import Schedule, validate
from sim.sweeps.stats import wilson_interval
from sim.verdicts import analyse

__all__ = ["Mutant", "MutantResult", "MutationReport", "ScenarioMutantResult", "ScenarioMutationReport",
           "mutate_scenario", "mutate_schedule", "schedule_mutants", "scenario_text", "schedule_text"]


# ---------------------------------------------------------------- schedule mutants

@dataclass(frozen=True)
class Mutant:
    """One schedule mutant: ``removed`` op ids (one, or every participant's op of a barrier),
    ``kind`` the sync kind, ``rebound`` ops whose bound record changed (or that became unbound),
    ``rewritten`` negative queries made positive (see the module doc), ``schedule`` the mutant."""

    name: str
    kind: str
    removed: tuple[str, ...]
    schedule: Schedule
    rebound: tuple[str, ...] = ()
    rewritten: tuple[str, ...] = ()


def _canonical_ops(s: Schedule) -> tuple[dict, list[dict]]:
    """The format 2 document, every op with its explicit id (so ids survive a removal)."""
    doc = s.to_json()
    return doc, doc.pop("ops")


def _build(s: Schedule, doc: dict, ops: list[dict], drop: set[str], name: str) -> tuple[Schedule, tuple[str, ...]]:
    kept = [dict(o) for o in ops if o["id"] not in drop]
    # NOTE: with its record gone a negative query would bind to nothing; CUDA reports a query of a
    # never-recorded event complete, and validate refuses the contradiction, so the query reports true
    rewritten = []
    last_record: set[str] = set()
    for o in kept:
        if o["op"] == "record":
            last_record.add(o["event"])
        elif o["op"] == "host_query" and not o["outcome"] and o["event"] not in last_record:
            o["outcome"] = True
            rewritten.append(o["id"])
    m = validate({**doc, "name": f"{s.name}~{name}"[:256], "ops": kept})
    return m, tuple(rewritten)


def schedule_mutants(s: Schedule) -> list[Mutant]:
    """Every mutant of ``s`` (module doc), in issue order of the removed op."""
    doc, ops = _canonical_ops(s)
    bound = {o.id: (s.ops[o.bound_record].id if o.bound_record is not None else None) for o in s.ops
             if o.op in ("wait", "host_sync", "host_query") and o.event is not None}
    out = []
    seen_barriers = set()
    for op in s.ops:
        if op.op == "barrier":
            if op.barrier in seen_barriers:
                continue
            seen_barriers.add(op.barrier)
            drop = {o.id for o in s.ops if o.op == "barrier" and o.barrier == op.barrier}
            name, kind = f"-barrier {op.barrier}", "barrier"
        elif op.op in ("wait", "record", "host_sync") or (op.op == "host_query" and op.outcome):
            drop = {op.id}
            name, kind = f"-{op.op} {op.id}", op.op
        else:
            continue
        m, rewritten = _build(s, doc, ops, drop, name[1:].replace(" ", ":"))
        new_bound = {o.id: (m.ops[o.bound_record].id if o.bound_record is not None else None) for o in m.ops
                     if o.id in bound}
        rebound = tuple(k for k, v in new_bound.items() if v != bound[k])
        out.append(Mutant(name, kind, tuple(sorted(drop, key=lambda i: s.op(i).index)), m, rebound, rewritten))
    return out


def _race_set(s: Schedule) -> set[tuple[str, str, str]]:
    return {(r["buffer"], s.ops[r["ops"][0]].id, s.ops[r["ops"][1]].id) for r in race_scan(s).races}


def _read_vectors(res) -> set[tuple]:
    return {tuple(sorted((r["op"], r["provenance_sha256"]) for r in o.reads)) for o in res.outcomes}


def _corrupt_vectors(res) -> set[tuple]:
    return {tuple(sorted((r["op"], r["provenance_sha256"]) for r in o.reads)) for o in res.corrupt}


@dataclass
class MutantResult:
    """The verdicts on one mutant (module doc).  ``new_races``: (buffer, op, op) racing in the
    mutant only; ``outcomes``/``corrupt_outcomes``: the mutant's explored outcomes;
    ``reads_changed``: some outcome gives some read bytes no outcome of the original gives."""

    name: str
    kind: str
    removed: list[str]
    rebound: list[str]
    rewritten: list[str]
    latent_race: bool
    new_races: list[list[str]]
    corrupt_explored: bool
    explore_complete: bool
    orders: int
    outcomes: int
    corrupt_outcomes: int
    reads_changed: bool
    trials: int
    corrupt_trials: int
    probability: float | None
    probability_ci: list[float] | None
    detected: bool
    equivalent: bool

    @property
    def status(self) -> str:
        return "detected" if self.detected else ("equivalent" if self.equivalent else "missed")


@dataclass
class MutationReport:
    schedule: str
    chunk_bytes: int
    max_orders: int | None
    trials: int
    seed: int
    profile: str
    original: MutantResult
    mutants: list[MutantResult] = field(default_factory=list)

    @property
    def detected(self) -> int:
        return sum(m.detected for m in self.mutants)

    @property
    def equivalent(self) -> int:
        return sum(m.equivalent for m in self.mutants)

    @property
    def score(self) -> float | None:
        return self.detected / len(self.mutants) if self.mutants else None

    @property
    def score_non_equivalent(self) -> float | None:
        n = len(self.mutants) - self.equivalent
        return self.detected / n if n else None

    def to_json(self) -> dict:
        return {"kvrace_mutate": 1, "kind": "schedule", "schedule": self.schedule, "chunk_bytes": self.chunk_bytes,
                "max_orders": self.max_orders, "trials": self.trials, "seed": self.seed, "profile": self.profile,
                "mutants_total": len(self.mutants), "detected": self.detected, "equivalent": self.equivalent,
                "missed": len(self.mutants) - self.detected - self.equivalent,
                "score": self.score, "score_non_equivalent": self.score_non_equivalent,
                "original": {**asdict(self.original), "status": "original"},
                "mutants": [{**asdict(m), "status": m.status} for m in self.mutants]}


def _check_count(v, name: str, minimum: int, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise InputError(name, f"expected a whole number >= {minimum}, got {show(v)}")


def _trials(s: Schedule, prof: Profile, trials: int, seed: int) -> int:
    bad = 0
    for sd in range(seed, seed + trials):
        run = run_schedule(s, prof, seed=sd, ties=TieBreak("seeded", seed=sd), keep="report")
        bad += analyse(run)["corrupt_reads"] > 0
    return bad


def _judge(name, kind, removed, rebound, rewritten, s, prof, *, chunk_bytes, max_orders, trials, seed,
           base=None) -> tuple[MutantResult, object, set]:
    races = _race_set(s)
    res = Explorer(s, chunk_bytes, profile=prof, witnesses=False).exhaustive(max_orders)
    bad = _trials(s, prof, trials, seed) if trials else 0
    p, ci = (bad / trials, list(wilson_interval(bad, trials))) if trials else (None, None)
    if base is None:
        new_races, corrupt, changed = [], bool(res.corrupt), False
        equivalent = False
    else:
        base_res, base_races = base
        new_races = sorted(races - base_races)
        corrupt = bool(_corrupt_vectors(res) - _read_vectors(base_res))
        changed = bool(_read_vectors(res) - _read_vectors(base_res))
        equivalent = not new_races and not corrupt and not changed and res.complete and base_res.complete
    detected = bool(new_races) or corrupt
    r = MutantResult(name, kind, list(removed), list(rebound), list(rewritten), bool(new_races),
                     [list(x) for x in new_races], corrupt, res.complete, res.orders, len(res.outcomes),
                     len(res.corrupt), changed, trials, bad, p, ci, detected, equivalent and not detected)
    return r, res, races


def mutate_schedule(s: Schedule, *, trials: int = 100, max_orders: int | None = 10_000,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES, seed: int = 0, profile="h200") -> MutationReport:
    """Judge every mutant of ``s`` (module doc).  ``trials`` 0: no timing runs."""
    _check_count(trials, "trials", 0)
    _check_count(max_orders, "max_orders", 1, allow_none=True)
    _check_count(seed, "seed", 0)
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    kw = dict(chunk_bytes=chunk_bytes, max_orders=max_orders, trials=trials, seed=seed)
    orig, base_res, base_races = _judge("(original)", "original", (), (), (), s, prof, **kw)
    rep = MutationReport(s.name, base_res.model.chunk_bytes, max_orders, trials, seed, prof.name, orig)
    for m in schedule_mutants(s):
        r, _, _ = _judge(m.name, m.kind, m.removed, m.rebound, m.rewritten, m.schedule, prof,
                         base=(base_res, base_races), **kw)
        rep.mutants.append(r)
    return rep


def _pct(p, ci) -> str:
    if p is None:
        return "-"
    return f"{100 * p:5.1f} % [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def schedule_text(rep: MutationReport) -> str:
    """The mutation table and the score."""
    d = rep.to_json()
    head = (f"mutate {d['schedule']}  ({len(rep.mutants)} mutants; exploration chunk {d['chunk_bytes']} B"
            f"{' = whole items' if not d['chunk_bytes'] else ''}, max {d['max_orders']} orders; "
            f"{d['trials']} timing trials, profile {d['profile']})")
    rows = [("mutant", "new latent race", "new corrupt outcome (exploration)", "P(corrupt) [95% CI]", "verdict")]
    for m in [rep.original, *rep.mutants]:
        rows.append((m.name, "yes" if m.latent_race else ("-" if m.kind == "original" else "no"),
                     f"{'yes' if m.corrupt_explored else 'no'} ({'complete' if m.explore_complete else 'stopped'}, "
                     f"{m.corrupt_outcomes}/{m.outcomes} outcomes)",
                     _pct(m.probability, m.probability_ci), "" if m.kind == "original" else m.status))
    w = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = [head, ""] + ["  ".join(c.ljust(w[k]) for k, c in enumerate(r)).rstrip() for r in rows]
    for m in rep.mutants:
        if m.rebound or m.rewritten:
            lines.append(f"  {m.name}: rebinds {', '.join(m.rebound) or '-'}"
                         + (f"; negative queries made positive: {', '.join(m.rewritten)}" if m.rewritten else ""))
    sc = "-" if rep.score is None else f"{rep.detected}/{len(rep.mutants)} = {rep.score:.2f}"
    ne = "-" if rep.score_non_equivalent is None else f"{rep.score_non_equivalent:.2f}"
    lines.append(f"\nmutation score {sc} ({rep.equivalent} equivalent, "
                 f"{len(rep.mutants) - rep.detected - rep.equivalent} missed; score over non-equivalent "
                 f"mutants {ne})")
    return "\n".join(lines)


# ---------------------------------------------------------------- scenario mutants

def _model_steps(sc) -> list[tuple[str, ...]]:
    """The accessor tuples of every step the scenario's model runs (either mode)."""
    from sim.engine.gates import READERS
    from sim.engine.models import model

    fam, opts = model(sc.model.family), sc.model.options()
    out = []
    for kind in dict.fromkeys(fam.layer_kinds):
        for mode in ("extend", "decode"):
            for step in fam.steps[kind]:
                if step.applies(mode, opts):
                    out.append(READERS.get(step.reader, ()))
    return out


def _step_gating(gm, steps) -> list[bool]:
    return [any(gm.is_gated(a) for a in accs) for accs in steps]


def _toml_gate_map(gm, path: str) -> None:
    with open(path, "w") as f:
        f.write(f'name = "{gm.name}"\n[gated]\n')
        for acc, g in sorted(gm.gated.items()):
            f.write(f"{acc} = {'true' if g else 'false'}\n")


def _engine_job(job: tuple) -> tuple:
    from sim.engine.engine import run_prefill_engine

    key, preset, overrides, seed = job
    r = run_prefill_engine(preset, seed, overrides=overrides)
    return key, seed, r.requests_corrupted, r.latent_races


@dataclass
class ScenarioMutantResult:
    """``corrupted``/``races``: requests corrupted and latent races per seed (None: not run)."""

    name: str
    change: str
    run: bool
    reason: str
    corrupted: list[int] | None
    races: list[int] | None
    detected: bool | None

    @property
    def status(self) -> str:
        if not self.run:
            return "equivalent"
        return "detected" if self.detected else "not detected"


@dataclass
class ScenarioMutationReport:
    scenario: str
    overrides: list[str]
    seeds: list[int]
    original: ScenarioMutantResult
    mutants: list[ScenarioMutantResult]

    @property
    def detected(self) -> int:
        return sum(bool(m.detected) for m in self.mutants)

    @property
    def score(self) -> float | None:
        return self.detected / len(self.mutants) if self.mutants else None

    @property
    def equivalent(self) -> int:
        return sum(not m.run for m in self.mutants)

    @property
    def score_non_equivalent(self) -> float | None:
        n = len(self.mutants) - self.equivalent
        return self.detected / n if n else None

    def to_json(self) -> dict:
        return {"kvrace_mutate": 1, "kind": "scenario", "scenario": self.scenario, "overrides": self.overrides,
                "seeds": self.seeds, "mutants_total": len(self.mutants), "detected": self.detected,
                "equivalent": self.equivalent, "score": self.score,
                "score_non_equivalent": self.score_non_equivalent,
                "original": asdict(self.original),
                "mutants": [{**asdict(m), "status": m.status} for m in self.mutants]}


def mutate_scenario(scenario: str, overrides=(), *, trials: int = 1, workers: int = 1,
                    run_all: bool = False) -> ScenarioMutationReport:
    """Judge the gate-map and load-fence mutants of ``scenario`` (a preset name or TOML path,
    ``overrides`` as ``--set``) over ``trials`` seeds (module doc).  ``workers`` processes run
    the engine jobs; the results do not depend on it."""
    from sim.engine.scenario import load_scenario

    _check_count(trials, "trials", 1)
    _check_count(workers, "workers", 1)
    overrides = list(overrides)
    sc = load_scenario(scenario, overrides)
    eff = sc.configuration().gate_map
    steps = _model_steps(sc)
    before = _step_gating(eff, steps)
    seeds = list(range(sc.run.seed, sc.run.seed + trials))
    with tempfile.TemporaryDirectory(prefix="kvrace-mutate-") as tmp:
        plan = []          # (name, change, overrides or None, reason)
        for acc in sorted(a for a, g in eff.gated.items() if g):
            gm = sc.gate_map().override({acc: False}, name=f"{sc.gate_map().name}-{acc}")
            mutated = eff.override({acc: False})
            changed = [i for i, (a, b) in enumerate(zip(before, _step_gating(mutated, steps))) if a != b]
            path = os.path.join(tmp, f"{acc}.toml")
            _toml_gate_map(gm, path)
            reason = "" if changed else (f"no step of {sc.model.family} loses its gate (none reads through "
                                         f"{acc}, or each that does calls another gated accessor)")
            plan.append((f"-gate {acc}", f"{acc} = false", overrides + [f"variant.gate_map={path}"], reason))
        if sc.hicache.load_fence:
            plan.append(("-load_fence", "hicache.load_fence = false", overrides + ["hicache.load_fence=false"], ""))
        jobs = [("(original)", scenario, overrides, sd) for sd in seeds]
        for name, _, ov, reason in plan:
            if run_all or not reason:
                jobs += [(name, scenario, ov, sd) for sd in seeds]
        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                done = list(pool.map(_engine_job, jobs))
        else:
            done = [_engine_job(j) for j in jobs]
    by = {}
    for key, sd, corrupted, races in done:
        by.setdefault(key, {})[sd] = (corrupted, races)

    def result(name, change, reason, base=None):
        if name not in by:
            return ScenarioMutantResult(name, change, False, reason, None, None, None)
        c = [by[name][sd][0] for sd in seeds]
        r = [by[name][sd][1] for sd in seeds]
        det = None if base is None else (any(x > 0 for x in c) and c != base.corrupted) or \
            any(x > y for x, y in zip(r, base.races))
        return ScenarioMutantResult(name, change, True, reason, c, r, det)

    orig = result("(original)", "", "")
    muts = [result(name, change, reason, orig) for name, change, _, reason in plan]
    return ScenarioMutationReport(sc.name, overrides, seeds, orig, muts)


def scenario_text(rep: ScenarioMutationReport) -> str:
    d = rep.to_json()
    lines = [f"mutate scenario {rep.scenario}  ({len(rep.mutants)} mutants; seeds {rep.seeds[0]}.."
             f"{rep.seeds[-1]}{'; --set ' + ' '.join(rep.overrides) if rep.overrides else ''})", ""]
    rows = [("mutant", "requests corrupted", "latent races", "verdict")]
    for m in [rep.original, *rep.mutants]:
        rows.append((m.name, "-" if m.corrupted is None else " ".join(map(str, m.corrupted)),
                     "-" if m.races is None else " ".join(map(str, m.races)),
                     "" if m is rep.original else m.status))
    w = [max(len(r[k]) for r in rows) for k in range(4)]
    lines += ["  ".join(c.ljust(w[k]) for k, c in enumerate(r)).rstrip() for r in rows]
    for m in rep.mutants:
        if m.reason:
            lines.append(f"  {m.name}: {m.reason}")
    sc = "-" if rep.score is None else f"{rep.detected}/{len(rep.mutants)} = {rep.score:.2f}"
    ne = "-" if rep.score_non_equivalent is None else f"{rep.score_non_equivalent:.2f}"
    lines.append(f"\nmutation score {sc} ({d['equivalent']} equivalent by construction; score over the mutants "
                 f"run {ne})")
    return "\n".join(lines)
