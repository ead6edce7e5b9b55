"""Run a sweep: every point of a grid, ``trials`` seeded runs each, on local
processes or a Ray cluster.

Work is cut into chunks of ``chunk`` trials (trials ``[c*chunk, (c+1)*chunk)``
of a point); any worker may run any chunk.  A point's result folds its chunks
in chunk order, so it does not depend on which worker ran what or when:

* without ``until_ci`` a point is every one of its ``trials`` trials;
* with ``until_ci = W`` the point stops after the first chunk (in order)
  after which its 95 % Wilson interval of the corrupt fraction is narrower
  than ``W`` (or after all ``trials``).  Chunks computed past that point (a
  worker ran ahead) are discarded, never counted.

Each finished point is written at once (``SweepStore``); a re-run with the
same ``--out`` skips the points already there.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from sim.errors import InputError, show
from sim.sweeps.generators import Generator, get_generator
from sim.sweeps.stats import wilson_interval
from sim.sweeps.store import SweepStore
from sim.sweeps.trials import ChunkResult, Task, point_key, run_chunk

__all__ = ["BACKENDS", "CHUNK_TRIALS", "RESULT_COLUMNS", "Progress", "SweepSpec", "parse_grid", "run_sweep"]

#: trials per unit of work (fixed: it decides where --until-ci may stop, so it is part of a sweep's meta)
CHUNK_TRIALS = 100
BACKENDS = ("local", "ray")
#: the result columns of every point, after its parameters and derived columns
RESULT_COLUMNS = ["trials", "corrupt_trials", "stale_trials", "torn_trials", "indeterminate_trials",
                  "corrupt_fraction", "ci_lo", "ci_hi", "latent_races", "stopped"]


def parse_grid(gen: Generator, specs) -> dict[str, list]:
    """``["key=v1,v2", ...]`` -> ``{key: [values]}`` checked against ``gen``'s
    parameters (every error names the key and the values it expects)."""
    grid: dict[str, list] = {}
    for spec in specs or ():
        if not isinstance(spec, str) or "=" not in spec:
            raise InputError("--grid", f"expected KEY=V1,V2,... with KEY one of {', '.join(gen.by_name)}, "
                             f"got {show(spec)}")
        key, _, values = spec.partition("=")
        key = key.strip()
        param = gen.by_name.get(key)
        if param is None:
            raise InputError(f"--grid {key}", f"expected a parameter of generator {gen.name}: "
                             f"{', '.join(gen.by_name)}; got unknown key {show(key)}")
        if key in grid:
            raise InputError(f"--grid {key}", "given twice; expected each key once (list all values in one --grid)")
        texts = [v for v in values.split(",") if v.strip()]
        if not texts:
            raise InputError(f"--grid {key}", f"expected one or more values ({param.expected()}), got none")
        parsed = [param.parse(v, f"--grid {key}") for v in texts]
        if len(set(parsed)) != len(parsed):
            raise InputError(f"--grid {key}", f"expected distinct values, got {show(values)}")
        grid[key] = parsed
    return grid


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep: a generator over a grid (other parameters at their
    defaults), ``trials`` per point, seeded; ``imports`` are modules that
    register user generators (imported here and in every worker)."""

    generator: str
    grid: dict = field(default_factory=dict)
    trials: int = 1000
    seed: int = 0
    profile: str = "h200"
    until_ci: float | None = None
    chunk: int = CHUNK_TRIALS
    imports: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.trials, int) or self.trials < 1:
            raise InputError("--trials", f"expected a whole number >= 1, got {show(self.trials)}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise InputError("--seed", f"expected a whole number >= 0, got {show(self.seed)}")
        if self.until_ci is not None and not (0 < self.until_ci <= 1):
            raise InputError("--until-ci", f"expected an interval width in (0, 1], got {show(self.until_ci)}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise InputError("chunk", f"expected a whole number >= 1, got {show(self.chunk)}")
        for m in self.imports:
            try:
                importlib.import_module(m)
            except ImportError as e:
                raise InputError(f"--import {m}", f"cannot import it ({e}); expected an importable module that "
                                 "registers generators") from None

    @property
    def gen(self) -> Generator:
        return get_generator(self.generator)

    def points(self) -> list[dict]:
        """Every point of the grid, first key slowest, each with all parameters."""
        gen = self.gen
        keys = list(self.grid)
        return [gen.point(dict(zip(keys, combo)), "--grid") for combo in itertools.product(*self.grid.values())]

    def meta(self) -> dict:
        """The settings a resumed sweep must share (they decide every point's numbers)."""
        return {"generator": self.generator, "profile": self.profile, "seed": self.seed, "trials": self.trials,
                "until_ci": self.until_ci, "chunk": self.chunk}

    def columns(self) -> list[str]:
        gen = self.gen
        derived = list(gen.columns(gen.point()))
        return ["key", "generator", "profile"] + list(gen.by_name) + derived + RESULT_COLUMNS


@dataclass(frozen=True)
class Progress:
    """Where a running sweep stands (passed to the progress callback).
    ``trials_total`` shrinks when ``until_ci`` stops points early."""

    points_done: int
    points_total: int
    trials_done: int
    trials_total: int
    elapsed_s: float


class _Serial:
    """An executor that runs each task when it is submitted (one worker: no processes)."""

    def submit(self, fn, *args):
        fut = cf.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:        # delivered through the future, as a pool would
            fut.set_exception(e)
        return fut

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def _cancel(ex, fut) -> None:
    """Drop a chunk whose point has finished (an optimisation: its result is ignored anyway)."""
    if hasattr(ex, "cancel"):
        ex.cancel(fut)
    else:
        fut.cancel()


def _init_worker(imports: tuple[str, ...]) -> None:
    for m in imports:
        importlib.import_module(m)


def _shipped_modules(imports: tuple[str, ...]) -> list[str]:
    """Paths of the top-level modules or packages behind ``imports`` that are not installed
    (not under a site-packages folder): Ray ships these to its workers (``py_modules``)."""
    import sysconfig

    installed = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    paths = []
    for name in imports:
        top = importlib.import_module(name.split(".")[0])
        origin = getattr(top, "__file__", None)
        if origin is None:
            continue
        path = os.path.dirname(origin) if os.path.basename(origin) == "__init__.py" else origin
        real = os.path.realpath(path)
        if not any(real.startswith(d + os.sep) for d in installed) and path not in paths:
            paths.append(path)
    return paths


class _RayExecutor:
    """Submit chunks as Ray tasks; ``ray.init()`` locally when no address is given.

    Modules named by ``imports`` (user generators) that are not installed are shipped to the
    workers with Ray's ``py_modules`` when Ray is started here (Ray ships modules only from
    ``ray.init``: a caller that started Ray itself makes them importable there).  kvrace itself
    must be installed on every node."""

    def __init__(self, address: str | None, workers: int | None, imports: tuple[str, ...] = ()):
        try:
            import ray
        except ImportError:
            raise InputError("--backend ray", "Ray is not installed; expected `pip install 'kvrace[ray]'` "
                             "(or use --backend local)") from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            kw = {"address": address} if address else {"num_cpus": workers} if workers else {}
            shipped = _shipped_modules(imports)
            if shipped:
                kw["runtime_env"] = {"py_modules": shipped}
            try:
                ray.init(include_dashboard=False, log_to_driver=False, **kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = "--ray-address" if address else "--backend ray"
                raise InputError(where, f"cannot start or join Ray ({e}); expected a reachable Ray cluster "
                                 "address (or none: a local Ray)") from None
            self.started = True
        self.remote = ray.remote(run_chunk)
        self.cpus = int(ray.cluster_resources().get("CPU", 1))
        self.refs: dict = {}                  # future -> its ObjectRef

    def submit(self, fn, task):
        ref = self.remote.remote(task)
        fut = ref.future()
        self.refs[fut] = ref
        fut.add_done_callback(lambda f: self.refs.pop(f, None))
        return fut

    def cancel(self, fut) -> None:
        """Ask Ray to drop the task; its future still completes (with its result or Ray's
        cancellation error), and the driver ignores it."""
        # NOTE: never Future.cancel() here: Ray completes the future it handed out from its own
        # callback thread, and a future cancelled under it makes that completion fail, after
        # which no other future completes (a --until-ci sweep on Ray hung this way).
        ref = self.refs.get(fut)
        if ref is not None:
            try:
                self.ray.cancel(ref)
            except Exception:                 # already finished, or running where it cannot be stopped
                pass

    def shutdown(self, wait=True, cancel_futures=False):
        if self.started:
            self.ray.shutdown()


def _row(spec: SweepSpec, point: dict, key: str, chunks: list[ChunkResult], stopped: str) -> dict:
    gen = spec.gen
    n = sum(c.trials for c in chunks)
    k = sum(c.corrupt for c in chunks)
    lo, hi = wilson_interval(k, n)
    return {"key": key, "generator": spec.generator, "profile": spec.profile, **point, **gen.columns(point),
            "trials": n, "corrupt_trials": k, "stale_trials": sum(c.stale for c in chunks),
            "torn_trials": sum(c.torn for c in chunks),
            "indeterminate_trials": sum(c.indeterminate for c in chunks),
            "corrupt_fraction": k / n, "ci_lo": lo, "ci_hi": hi, "latent_races": chunks[0].latent_races,
            "stopped": stopped}


class _PointState:
    def __init__(self, index: int, point: dict, key: str, n_chunks: int):
        self.index, self.point, self.key, self.n_chunks = index, point, key, n_chunks
        self.next_chunk = 0              # next chunk to submit
        self.results: dict[int, ChunkResult] = {}
        self.folded: list[ChunkResult] = []
        self.in_flight = 0
        self.finished = False


def run_sweep(spec: SweepSpec, out: str | None = None, *, workers: int | None = None, backend: str = "local",
              ray_address: str | None = None, progress: Callable[[Progress], None] | None = None) -> list[dict]:
    """Run ``spec`` and return one row per grid point, in grid order.

    ``out``: a folder for ``sweep.json``/``sweep.csv`` (written as points
    finish; points already there are skipped and their rows returned).
    ``workers``: local processes (default: every core; 1 runs in this
    process) or, with ``backend="ray"``, the CPUs of a Ray started here.
    The rows do not depend on ``workers`` or ``backend`` (see module doc)."""
    if backend not in BACKENDS:
        raise InputError("--backend", f"expected one of {', '.join(BACKENDS)}, got {show(backend)}")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise InputError("--workers", f"expected a whole number >= 1, got {show(workers)}")
    points = spec.points()
    keys = [point_key(spec.generator, p, spec.profile) for p in points]
    store = SweepStore(out, spec.meta(), spec.columns()) if out else None
    done = dict(store.done) if store else {}
    n_chunks = math.ceil(spec.trials / spec.chunk)
    todo = [_PointState(i, p, k, n_chunks) for i, (p, k) in enumerate(zip(points, keys)) if k not in done]
    # a grid may list one point twice (e.g. a parameter value given as 4 and 4.0): run it once
    seen: set[str] = set()
    todo = [st for st in todo if not (st.key in seen or seen.add(st.key))]
    t0 = time.perf_counter()
    totals = {"trials_total": len(todo) * spec.trials, "trials_done": 0, "points_done": 0}

    def report():
        if progress:
            progress(Progress(totals["points_done"], len(todo), totals["trials_done"], totals["trials_total"],
                              time.perf_counter() - t0))

    if todo:
        if backend == "ray":
            ex = _RayExecutor(ray_address, workers, spec.imports)
            slots = 2 * ex.cpus
        elif (workers or os.cpu_count() or 1) == 1:
            ex, slots = _Serial(), 1
        else:
            n = workers or os.cpu_count() or 1
            ex = cf.ProcessPoolExecutor(max_workers=n, initializer=_init_worker, initargs=(spec.imports,))
            slots = 2 * n
        try:
            _drive(spec, todo, ex, slots, store, done, totals, report)
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
    if store:
        store.finish_run({"started_unix": round(time.time() - (time.perf_counter() - t0), 3),
                          "wall_s": round(time.perf_counter() - t0, 3), "backend": backend,
                          "workers": workers or os.cpu_count() or 1, "points_run": len(todo),
                          "points_skipped": len(points) - len(todo)})
    return [done[k] for k in keys]


def _drive(spec, todo, ex, slots, store, done, totals, report) -> None:
    """Keep ``slots`` chunks in flight until every point in ``todo`` is finished."""
    tasks = {}
    # NOTE: without --until-ci, points go depth-first (they finish, and are written, in grid
    # order); with it, the point with the fewest chunks in flight goes next, so that a point
    # that may stop after its first chunk does not keep several workers computing chunks that
    # will be discarded.
    breadth = spec.until_ci is not None

    def pick():
        open_ = [st for st in todo if not st.finished and st.next_chunk < st.n_chunks]
        if not open_:
            return None
        return min(open_, key=lambda st: (st.in_flight, st.index)) if breadth else open_[0]

    def submit():
        while len(tasks) < slots:
            st = pick()
            if st is None:
                return
            c = st.next_chunk
            task = Task(spec.generator, tuple(st.point.items()), spec.profile, spec.seed, st.key, c,
                        c * spec.chunk, min(spec.trials, (c + 1) * spec.chunk), spec.imports)
            st.next_chunk += 1
            st.in_flight += 1
            tasks[ex.submit(run_chunk, task)] = st

    report()
    submit()
    while tasks:
        finished, _ = cf.wait(list(tasks), return_when=cf.FIRST_COMPLETED)
        for fut in finished:
            st = tasks.pop(fut)
            st.in_flight -= 1
            if st.finished or fut.cancelled():
                continue                    # a chunk past the point's stop: ignored (Ray's may hold an error)
            res = fut.result()              # a worker's exception (bad input) ends the sweep here
            st.results[res.chunk] = res
            _fold(spec, st, totals)
            if st.finished:
                row = _row(spec, st.point, st.key, st.folded,
                           "until_ci" if sum(c.trials for c in st.folded) < spec.trials else "trials")
                done[st.key] = row
                totals["points_done"] += 1
                if store:
                    store.add(row)
                for f, other in tasks.items():
                    if other is st:
                        _cancel(ex, f)
            report()
        submit()


def _fold(spec: SweepSpec, st: _PointState, totals: dict) -> None:
    """Fold the chunks that now continue the point's in-order prefix, testing
    the stop rule after each one."""
    while not st.finished and len(st.folded) in st.results:
        c = st.results.pop(len(st.folded))
        st.folded.append(c)
        totals["trials_done"] += c.trials
        n = sum(x.trials for x in st.folded)
        if n >= spec.trials:
            st.finished = True
        elif spec.until_ci is not None:
            lo, hi = wilson_interval(sum(x.corrupt for x in st.folded), n)
            if hi - lo < spec.until_ci:
                st.finished = True
                totals["trials_total"] -= spec.trials - n
