"""Explore a schedule's interleavings: the distinct outcomes, how many orders give each, witnesses.

``Explorer(schedule, chunk_bytes=...)`` builds the race model once
(``sim.explore.model``), then:

* :meth:`Explorer.exhaustive` enumerates every trace (``sim.explore.search.traces``:
  partial-order reduction; ``reduction=False`` enumerates every interleaving instead),
* :meth:`Explorer.pct` samples ``n_runs`` PCT orders of bug depth ``depth``,
* :meth:`Explorer.random` runs the schedule ``n_runs`` times on the executor with seeded
  timing (``sim.explore.sampling``).

Each returns an :class:`ExploreResult`: the distinct outcomes (``sim.explore.evaluate``) in
the order they were found, each with the number of orders that gave it, every read's
verdict (``ok``, ``stale``, ``torn``, ``indeterminate``: ``sim.verdicts``' definitions, against
the happens-before order), the final buffer digests, and a witness.  An outcome is
**corrupt** when one of its reads is stale or torn, else **clean**.

A witness is the order that gave the outcome (``order``: the steps, each an op id and for
a cut copy its ``from``/``to`` (item, byte) bounds) and, when streams and events can force
it, ``schedule``: a controlled-replay schedule (``sim.explore.witness``) that
``kvrace schedule run`` and ``kvrace replay --mode controlled`` take unchanged.  Among the
orders of one outcome the first that can be forced is kept.  A random run's witness is its
seed: ``kvrace schedule run FILE --ties seeded --seed N`` repeats it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from sim.executor import TieBreak, run_schedule
from sim.explore.evaluate import Evaluation, Evaluator, key_id, outcome_key
from sim.explore.model import DEFAULT_CHUNK_BYTES, RaceModel, build_model
from sim.explore.sampling import pct_bound, pct_order
from sim.explore.search import linearizations, linearize, traces
from sim.explore.witness import _needed_cuts, witness_schedule
from sim.errors import InputError
from sim.profile import Profile, load_profile
from sim.replay import ReplayError, controlled_schedule
from sim.schedule import Schedule, validate
from sim.verdicts import read_digest

__all__ = ["ExploreResult", "Explorer", "Outcome", "explore"]

CORRUPT = ("stale", "torn")


@dataclass
class Outcome:
    """One distinct outcome (see the module doc)."""

    id: str
    key: tuple
    orders: int
    reads: list[dict]
    buffers: dict[str, str]
    buffers_differing: list[str]
    order: list[int] | None = None          # node ids of the witness order (model modes)
    seed: int | None = None                 # random mode: the run's seed
    first_found: int = 0
    witness: dict | None = None             # the controlled schedule, when forcible
    witness_reason: str | None = None       # why there is none
    _aligned: bool = False                  # the kept order needs no cut inside an item

    @property
    def corrupt(self) -> bool:
        return any(r["status"] in CORRUPT for r in self.reads)

    @property
    def status(self) -> str:
        return "corrupt" if self.corrupt else "clean"


@dataclass
class ExploreResult:
    schedule: Schedule
    model: RaceModel
    mode: str
    outcomes: list[Outcome]
    orders: int
    complete: bool
    elapsed_s: float
    params: dict = field(default_factory=dict)

    @property
    def corrupt(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.corrupt]

    @property
    def clean(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.corrupt]

    def to_json(self, model_orders: bool = True) -> dict:
        m = self.model
        el = max(self.elapsed_s, 1e-9)
        return {
            "kvrace_explore": 1,
            "schedule": self.schedule.name,
            "schedule_digest": self.schedule.digest(),
            "mode": self.mode,
            "params": self.params,
            "chunk_bytes": m.chunk_bytes,
            "model": {"ops": len(self.schedule.ops), "byte_ops": len(m.op_nodes), "racing_pairs": len(m.racing),
                      "racing_ops": [self.schedule.ops[i].id for i in m.racing_ops], "steps": m.steps(),
                      "conflict_pairs": len(m.pairs)},
            "orders": self.orders,
            "complete": self.complete,
            "elapsed_s": round(self.elapsed_s, 4),
            "orders_per_s": round(self.orders / el, 1),
            "outcomes_total": len(self.outcomes),
            "outcomes_corrupt": len(self.corrupt),
            "outcomes_per_s": round(len(self.outcomes) / el, 1),
            "outcomes": [self._outcome_json(o, k) for k, o in enumerate(self.outcomes, 1)],
        }

    def _outcome_json(self, o: Outcome, k: int) -> dict:
        d = {"n": k, "id": o.id, "status": o.status, "orders": o.orders,
             "fraction": round(o.orders / self.orders, 6) if self.orders else None,
             "reads": o.reads, "buffers": o.buffers, "buffers_differing_from_hb_order": o.buffers_differing}
        w: dict = {"forcible": o.witness is not None}
        if o.order is not None:
            w["order"] = merged_steps(self.model, o.order)
        if o.seed is not None:
            w["seed"] = o.seed
            w["command"] = f"kvrace schedule run FILE --ties seeded --seed {o.seed}"
        if o.witness_reason:
            w["reason"] = o.witness_reason
        d["witness"] = w
        return d


class Explorer:
    """Exploration of one schedule (see the module doc)."""

    def __init__(self, schedule: Schedule, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *, profile="h200",
                 witnesses: bool = True):
        if not isinstance(chunk_bytes, (int, np.integer)) or isinstance(chunk_bytes, bool) or chunk_bytes < 0:
            raise InputError("chunk_bytes", f"expected a whole number of bytes >= 0 (0: whole items), got "
                             f"{chunk_bytes!r}")
        self.s = schedule
        self.model = build_model(schedule, int(chunk_bytes))
        self.evaluator = Evaluator(self.model)
        self.profile = profile
        self.witnesses = witnesses

    # ---------------------------------------------------------------- modes
    def exhaustive(self, max_orders: int | None = None, reduction: bool = True) -> ExploreResult:
        """Every trace (``reduction``) or every interleaving (without), up to ``max_orders``."""
        _check_count(max_orders, "max_orders", allow_none=True)
        t0 = time.perf_counter()
        acc = _Accumulator(self)
        if reduction:
            for trace in traces(self.model, max_orders):
                acc.add_order(linearize(self.model, trace))
        else:
            for order in linearizations(self.model, max_orders):
                acc.add_order(order)
        complete = max_orders is None or acc.orders < max_orders or self._exhausted(max_orders, reduction)
        return acc.result("exhaustive" if reduction else "exhaustive-no-reduction", complete,
                          time.perf_counter() - t0, {"max_orders": max_orders, "reduction": reduction})

    def _exhausted(self, max_orders: int, reduction: bool) -> bool:
        """Whether exactly ``max_orders`` orders were all there is (one more is looked for)."""
        gen = traces(self.model, max_orders + 1) if reduction else linearizations(self.model, max_orders + 1)
        return sum(1 for _ in gen) <= max_orders

    def pct(self, n_runs: int, depth: int, seed: int = 0) -> ExploreResult:
        """``n_runs`` PCT orders for bugs of depth ``depth`` (``sim.explore.sampling``)."""
        _check_count(n_runs, "n_runs")
        _check_count(depth, "depth")
        _check_count(seed, "seed", minimum=0)
        t0 = time.perf_counter()
        rng = np.random.default_rng(seed)
        acc = _Accumulator(self)
        for _ in range(n_runs):
            acc.add_order(pct_order(self.model, depth, rng))
        n, k = len(self.model.op_nodes), self.model.steps()
        p = pct_bound(n, k, depth)
        params = {"runs": n_runs, "depth": depth, "seed": seed, "threads_n": n, "steps_k": k,
                  "p_per_run": p, "p_miss_all_runs": (1 - p) ** n_runs,
                  "guarantee": pct_guarantee_text(n, k, depth, n_runs)}
        return acc.result("pct", False, time.perf_counter() - t0, params)

    def random(self, n_runs: int, seed: int = 0) -> ExploreResult:
        """``n_runs`` executor runs, seeds ``seed .. seed+n_runs-1`` (jitter, seeded ties, torn items)."""
        _check_count(n_runs, "n_runs")
        _check_count(seed, "seed", minimum=0)
        prof = self.profile if isinstance(self.profile, Profile) else load_profile(self.profile)
        t0 = time.perf_counter()
        acc = _Accumulator(self)
        for k in range(n_runs):
            sd = seed + k
            run = run_schedule(self.s, prof, seed=sd, ties=TieBreak("seeded", seed=sd), materialise=False)
            acc.add_run(run, sd, prof)
        return acc.result("random", False, time.perf_counter() - t0,
                          {"runs": n_runs, "seed": seed, "profile": prof.name})


def pct_guarantee_text(n: int, k: int, depth: int, runs: int) -> str:
    p = pct_bound(n, k, depth)
    miss = (1 - p) ** runs
    return (f"PCT depth {depth}: n = {n} threads (ops that touch bytes), k = {k} steps; each run finds a "
            f"depth-{depth} bug with probability >= 1/(n k^(d-1)) = {p:.3g}; {runs} runs miss it with "
            f"probability <= {miss:.3g}")


def _check_count(v, name: str, *, minimum: int = 1, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < minimum:
        raise InputError(name, f"expected a whole number >= {minimum}, got {v!r}")


class _Accumulator:
    """Outcomes as orders come in."""

    def __init__(self, ex: Explorer):
        self.ex = ex
        self.by_key: dict[tuple, Outcome] = {}
        self.orders = 0

    def _new(self, ev: Evaluation) -> Outcome:
        e = self.ex.evaluator
        o = Outcome(key_id(ev.key), ev.key, 0, e.judge(ev), e.digests(ev), e.buffers_differing(ev),
                    first_found=self.orders)
        self.by_key[ev.key] = o
        return o

    def add_order(self, order: list[int]) -> None:
        ev = self.ex.evaluator.run(order)
        self.orders += 1
        o = self.by_key.get(ev.key) or self._new(ev)
        o.orders += 1
        if o.order is None or (not o._aligned and self._aligned(order)):
            o.order = order
            o._aligned = self._aligned(order)

    def _aligned(self, order: list[int]) -> bool:
        m = self.ex.model
        return all(m.nodes[m.op_nodes[op][k]].first[1] == 0 for op, ks in _needed_cuts(m, order).items() for k in ks)

    def add_run(self, run, seed: int, prof) -> None:
        self.orders += 1
        key = outcome_key(run.reads, run.memory)
        o = self.by_key.get(key)
        if o is None:
            ev = Evaluation(run.memory, sorted(run.reads, key=lambda r: r.index), key)
            o = self._new(ev)
            o.seed = seed
        o.orders += 1

    def result(self, mode: str, complete: bool, elapsed: float, params: dict) -> ExploreResult:
        outcomes = sorted(self.by_key.values(), key=lambda o: o.first_found)
        if self.ex.witnesses:
            for o in outcomes:
                self._witness(o)
        return ExploreResult(self.ex.s, self.ex.model, mode, outcomes, self.orders, complete, elapsed, params)

    def _witness(self, o: Outcome) -> None:
        self._make_witness(o)
        if o.witness is not None:
            digests = ", ".join(f"{r['op']}={r['provenance_sha256'][:16]}" for r in o.reads)
            o.witness["description"] = (
                f"Witness of outcome {o.id} ({o.status}) of {self.ex.s.name}, written by kvrace explore: its order "
                "forced with events (controlled replay's format), so it has no latent race and every read is ok "
                "against this schedule's own order; the bytes are the outcome's (read provenance_sha256: "
                f"{digests}).")

    def _make_witness(self, o: Outcome) -> None:
        if o.order is not None:
            o.witness, o.witness_reason = witness_schedule(self.ex.model, o.order, evaluator=self.ex.evaluator)
            return
        # a random run: the same seed item-atomic is forcible when it leaves the same bytes
        prof = self.ex.profile if isinstance(self.ex.profile, Profile) else load_profile(self.ex.profile)
        run = run_schedule(self.ex.s, prof, seed=o.seed, ties=TieBreak("seeded", seed=o.seed), torn=False)
        if outcome_key(run.reads, run.memory) != o.key:
            o.witness_reason = ("the run saw an item part-way (torn); controlled replay forces item boundaries "
                                "only; repeat it in the simulator with its seed")
            return
        try:
            w = controlled_schedule(self.ex.s, run)
        except ReplayError as e:
            o.witness_reason = str(e)
            return
        # NOTE: controlled_schedule keeps the run's hosts; a host that issues earlier in time than
        # the list says could issue a forced wait before its record (a no-op in CUDA), so the
        # witness is kept only when a static run of it gives the outcome
        check = run_schedule(validate(w), prof, seed=o.seed)
        key = outcome_key(check.reads, check.memory)
        ids = {r.index: r.op_id for r in run.reads}
        if key[1] != o.key[1] or {r.op_id: read_digest(r) for r in check.reads} != \
                {ids[i]: d for i, d in o.key[0]}:
            o.witness_reason = "the forced schedule does not reproduce the run (its hosts issue out of list order)"
            return
        o.witness = w
        o.witness["name"] = self.ex.s.name + ".witness"


def explore(schedule: Schedule, mode: str = "exhaustive", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            max_orders: int | None = None, runs: int = 100, depth: int = 2, seed: int = 0,
            profile="h200") -> ExploreResult:
    """One call: ``mode`` is ``exhaustive``, ``pct`` (``runs``, ``depth``, ``seed``) or
    ``random`` (``runs``, ``seed``, ``profile``)."""
    ex = Explorer(schedule, chunk_bytes, profile=profile)
    if mode == "exhaustive":
        return ex.exhaustive(max_orders)
    if mode == "pct":
        return ex.pct(runs, depth, seed)
    if mode == "random":
        return ex.random(runs, seed)
    raise InputError("mode", f"expected 'exhaustive', 'pct' or 'random', got {mode!r}")


def summary_text(res: ExploreResult, witness_paths: dict[str, str] | None = None, max_outcomes: int = 50) -> str:
    """The human report of an exploration."""
    d = res.to_json()
    m = d["model"]
    lines = [f"explore {d['schedule']}  ({d['mode']}, chunk {d['chunk_bytes']} B"
             f"{'' if d['chunk_bytes'] else ' = whole items'})",
             f"model: {m['ops']} ops, {m['byte_ops']} touch bytes, {m['racing_pairs']} racing op pairs "
             f"({', '.join(m['racing_ops'][:6])}{' ...' if len(m['racing_ops']) > 6 else ''}); "
             f"{m['steps']} steps, {m['conflict_pairs']} conflict pairs"]
    if "guarantee" in d["params"]:
        lines.append(d["params"]["guarantee"])
    what = "complete" if d["complete"] else ("stopped at --max-orders" if d["mode"].startswith("exhaustive")
                                             else "sampled")
    lines.append(f"explored {d['orders']} orders ({what}) in {d['elapsed_s']:.3f} s: {d['orders_per_s']:,.0f} "
                 f"orders/s; {d['outcomes_total']} distinct outcomes ({d['outcomes_per_s']:,.1f}/s), "
                 f"{d['outcomes_corrupt']} corrupt, {d['outcomes_total'] - d['outcomes_corrupt']} clean")
    for o in d["outcomes"][:max_outcomes]:
        share = f"{o['orders']} order{'s' if o['orders'] != 1 else ''}"
        if d["mode"] == "random":
            share += f" ({100 * o['fraction']:.1f} % of runs)"
        lines.append(f"\noutcome {o['n']} [{o['id']}]  {o['status'].upper()}  {share}")
        for r in o["reads"]:
            if r["status"] in CORRUPT:
                fm = r["first_mismatch"]
                lines.append(f"  read {r['op']} ({r['buffer']}, {r['nbytes']} B): {r['status'].upper()}, "
                             f"{r['bytes_differing']} bytes differ from the happens-before order; first at offset "
                             f"{fm['offset']}")
                lines.append(f"    saw:      {fm['observed']}")
                lines.append(f"    expected: {fm['expected']}")
                lines.append("    what it saw:")
                lines.extend(f"      {p['text']}" for p in r["provenance"][:6])
            else:
                lines.append(f"  read {r['op']}: {r['status']}")
        if o["buffers_differing_from_hb_order"]:
            lines.append(f"  final bytes differ from the happens-before order in: "
                         f"{', '.join(o['buffers_differing_from_hb_order'])}")
        w = o["witness"]
        if "order" in w:
            steps = ", ".join(_step_text(s) for s in w["order"][:12])
            lines.append(f"  order: {steps}{' ...' if len(w['order']) > 12 else ''}")
        if w.get("seed") is not None:
            lines.append(f"  repeat: {w['command']}")
        path = (witness_paths or {}).get(o["id"])
        if w["forcible"]:
            lines.append("  witness: forcible by controlled replay" + (f" -> {path}" if path else ""))
        else:
            lines.append(f"  witness: not forcible on a GPU: {w.get('reason')}")
    if len(d["outcomes"]) > max_outcomes:
        lines.append(f"\n... {len(d['outcomes']) - max_outcomes} more outcomes (see --json)")
    return "\n".join(lines)


def merged_steps(model: RaceModel, order: list[int]) -> list[dict]:
    """An order as steps, consecutive blocks of one copy joined into one step."""
    out: list[dict] = []
    last_op = None
    for u in order:
        d = model.describe_node(u)
        if out and model.nodes[u].op == last_op and "from" in d:
            out[-1]["to"] = d["to"]
        else:
            out.append(d)
        last_op = model.nodes[u].op
    return out


def _step_text(step: dict) -> str:
    if "from" in step:
        (i0, b0), (i1, b1) = step["from"], step["to"]
        a = f"{i0}" if b0 == 0 else f"{i0}+{b0}B"
        b = f"{i1}" if b1 == 0 else f"{i1}+{b1}B"
        return f"{step['op']}[{a}:{b}]"
    return step["op"]


def fraction(res: ExploreResult) -> float:
    """Orders that gave a corrupt outcome, over all explored."""
    return sum(o.orders for o in res.corrupt) / res.orders if res.orders else math.nan
