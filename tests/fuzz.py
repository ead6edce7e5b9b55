"""A seeded mutator over ``examples/*.json`` and a harness that runs each mutant
through the CLI entry point in-process, in worker processes under a time and a
memory budget.

``mutant(seed)`` is deterministic: the same seed gives the same bytes
(``build(seed)`` also names the mutations applied).  Mutations: delete a key,
swap a value's type, replace a number by a huge / negative / NaN / inf / 1e308 /
2**70 / int64-edge value, nest deeply (up to 100,000 levels), insert non-UTF-8
bytes, truncate, duplicate a key, multiply streams, events, ops, buffers or a
list, grow buffers and index counts.  Several mutations may stack.  Sizes are
capped so that building one mutant takes well under a second (at most 70,000
streams / events, 70,000 ops (16 MiB of JSON), 2,000 extra buffers, 200,000 scalars or 5,000
containers in a multiplied list, and at most 4 MiB of JSON in any multiplied
list); each count cap is still above the matching schedule limit (``MAX_OPS``,
``MAX_STREAMS``, ``MAX_EVENTS``, ``MAX_BUFFERS``), so the limits are exercised.

A worker process builds the mutant itself from its seed (the parent sends only
the seed), writes it to ``<dir>/mutant_<seed>.json``, runs
the CLI's (``kvrace.cli``, or ``sim.cli`` before it moved; ``$KVRACE_FUZZ_CLI``
names another) ``main(["schedule", "validate", path])`` and
``main(["schedule", "run", "--json", out, path])`` and reports an
:class:`Outcome`.  Its address space is limited (``RLIMIT_AS`` = the worker's own
size after imports + ``mem_budget``), and the parent kills it when the input
(building included) runs past ``time_budget`` seconds.  A failure is: an
exception escaping ``main`` (a traceback; ``MemoryError`` included), an exit code
other than 0, 1 or 2, ``validate`` accepting what ``run`` refuses as bad input
(exit 2), the input running past ``time_budget``, or the worker dying.  A failing
input's file is kept; a passing one's is removed.

Per-input memory: before each input the worker resets its peak resident size
(``/proc/self/clear_refs`` = 5, Linux >= 4.0), so ``peak_rss_bytes`` is the
peak of that input alone and ``rss_growth_bytes`` how far it rose above the
resident size the input started at; a worker is replaced after ``max_tasks``
inputs so that memory kept by the allocator does not pile up.  Where the reset
is refused, ``peak_rss_bytes`` falls back to ``ru_maxrss`` (the worker's peak
so far, an upper bound) and ``rss_exact`` is False.

:func:`run_seeds` runs many seeds over ``jobs`` workers at once (a process pool
whose parent only hands out seeds and enforces the time budget).
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import resource
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.json"))
TIME_BUDGET_S = 20.0
MEM_BUDGET_BYTES = 2 << 30
MAX_TASKS = 100                       # inputs per worker before it is replaced

NUMBERS = [-1, 0, 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 70), 10 ** 30,
           1e308, -1e308, float("nan"), float("inf"), float("-inf"), 0.5, -0.0, 2 ** 31, 2 ** 32,
           16_777_216, 1 << 40, 1 << 50, 1 << 60]
JUNK = [None, True, False, "", "x" * 1000, [], {}, [1, 2], {"a": 1}, "all", -1, 3.5, "NaN"]

# size caps of the "many" mutations (each above the matching schedule limit)
MANY_N = [10, 1000, 5000, 70_000]     # 70,000 > MAX_EVENTS = 65,536
MANY_OPS = 70_000                     # > MAX_OPS = 65,536
MANY_OPS_BYTES = 16 << 20             # multiplied ops: at most 16 MiB of JSON
MANY_BUFFERS = 2000                   # > MAX_BUFFERS = 1,024
MANY_SCALARS = 200_000                # a multiplied list of numbers / strings
MANY_CONTAINERS = 5000                # a multiplied list of objects / lists
MANY_BYTES = 4 << 20                  # and no multiplied list, ops or buffers over 4 MiB of JSON
MAX_INDENTED_BYTES = 32 << 20         # indented output (depth x size) bound; deeper goes out compact


# ---------------------------------------------------------------- mutation

def _paths(doc):
    """Every (container, key) pair in the document, depth-first."""
    out = []
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, list):
            items = list(enumerate(node))
        else:
            continue
        for k, v in reversed(items):
            out.append((node, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return out


def _nested(depth: int, leaf) -> object:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _reps(value, reps: int, budget: int = MANY_BYTES) -> int:
    """``reps`` capped so that ``reps`` copies of ``value`` serialise to at most
    ``budget`` bytes (a value that cannot be serialised counts as too big to repeat)."""
    try:
        size = len(json.dumps(value, allow_nan=True))
    except (RecursionError, ValueError):
        return 1
    return max(1, min(reps, budget // max(1, size)))


SPLICE = "\x00fz-ops\x00"              # stands for the multiplied ops until they are spliced in as text
SPLICE_JSON = json.dumps(SPLICE).encode()


def _ops_text(ops, reps: int) -> bytes:
    """The JSON text of ``ops * reps`` with ids fz0, fz1, ...: each op is serialised
    once and the copies are formatted as text (70,000 dicts would take a second)."""
    marker = "\x00fz-id\x00"
    parts = []
    for o in ops:
        if isinstance(o, dict):
            pre, _, post = json.dumps(dict(o, id=marker), allow_nan=True).partition(json.dumps(marker))
            parts.append((pre, post))
        else:
            parts.append((json.dumps(o, allow_nan=True), None))
    out = []
    i = 0
    for _ in range(reps):
        for pre, post in parts:
            out.append(pre if post is None else f'{pre}"fz{i}"{post}')
            i += 1
    return ("[" + ",".join(out) + "]").encode()


def _mutate_doc(doc, rng: random.Random, structural: bool = True, splices: dict | None = None) -> tuple[str, str | None]:
    """Mutate ``doc`` in place by one structural mutation.  Returns (kind, text):
    ``text`` names a text-level mutation to apply after serialisation instead
    (always so when ``structural`` is False)."""
    if not structural:
        how = rng.choice(["utf8", "truncate", "duplicate", "deep"])
        return f"text:{how}", how
    paths = _paths(doc)
    kind = rng.choice(["delete", "swap", "number", "number", "number", "nest", "many", "big",
                       "text", "text"])
    if kind == "text" or not paths:
        how = rng.choice(["utf8", "truncate", "duplicate", "deep"])
        return f"text:{how}", how
    container, key = rng.choice(paths)
    value = container[key]
    if kind == "delete":
        del container[key]
    elif kind == "swap":
        container[key] = rng.choice(JUNK + [rng.choice(NUMBERS)])
    elif kind == "number":
        nums = [(c, k) for c, k in paths if isinstance(c[k], (int, float)) and not isinstance(c[k], bool)]
        c, k = rng.choice(nums) if nums else (container, key)
        c[k] = rng.choice(NUMBERS + [c[k] * rng.choice([-1, 2, 1000, 2 ** 20]) if isinstance(c[k], int) else -1])
    elif kind == "nest":
        container[key] = _nested(rng.choice([2, 10, 100, 500]), value)
    elif kind == "many":
        n = rng.choice(MANY_N)
        what = rng.choice(["streams", "events", "ops", "buffers", "list"])
        if what == "streams":
            doc["streams"] = list(doc.get("streams", [])) + [f"fz{i}" for i in range(n)]
        elif what == "events":
            doc["events"] = list(doc.get("events", [])) + [f"fz{i}" for i in range(n)]
        elif what == "ops" and isinstance(doc.get("ops"), list) and doc["ops"]:
            ops = doc["ops"]
            reps = _reps(ops, -(-min(n, MANY_OPS) // len(ops)), MANY_OPS_BYTES)
            if splices is None:
                doc["ops"] = [dict(o, id=f"fz{i}") if isinstance(o, dict) else o
                              for i, o in enumerate(ops * reps)]
            else:
                splices[SPLICE_JSON] = _ops_text(ops, reps)
                doc["ops"] = SPLICE
        elif what == "buffers" and isinstance(doc.get("buffers"), list) and doc["buffers"]:
            b = doc["buffers"][0]
            doc["buffers"] = doc["buffers"] + [dict(b, name=f"fz{i}") if isinstance(b, dict) else b
                                               for i in range(_reps([b], min(n, MANY_BUFFERS)))]
        else:
            what = "list"
            lists = [(c, k) for c, k in paths if isinstance(c[k], list) and c[k]]
            if lists:
                c, k = rng.choice(lists)
                cap = MANY_CONTAINERS if any(isinstance(v, (dict, list)) for v in c[k]) else MANY_SCALARS
                c[k] = (c[k] * _reps(c[k], min(n, cap) // len(c[k])))[:cap]
            else:
                what = "list(none)"
        kind = f"many:{what}:{n}"
    elif kind == "big":
        keys = ["count", "pages", "units", "layers", "unit_bytes", "page_bytes", "start", "step",
                "first_unit", "entries_per_page", "duration_us", "layer", "page_size", "item_bytes"]
        cands = [(c, k) for c, k in paths if k in keys]
        if cands:
            c, k = rng.choice(cands)
            c[k] = rng.choice([2 ** 20, 2 ** 24, 2 ** 30, 2 ** 33, 2 ** 40, 2 ** 62, 61, 4097, 7 << 30])
            kind = f"big:{k}"
        else:
            kind = "big(none)"
    return kind, None


def _mutate_text(data: bytes, how: str, rng: random.Random) -> bytes:
    if how == "utf8":
        at = rng.randrange(len(data) + 1)
        return data[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + data[at:]
    if how == "truncate":
        return data[:rng.randrange(len(data))] if data else data
    if how == "duplicate":
        at = data.find(b'"', rng.randrange(max(1, len(data) // 2)))
        end = data.find(b",", at)
        if at < 0 or end < 0:
            return data + data[:10]
        return data[:end] + b"," + data[at:end] + data[end:]
    # deep nesting, up to 100,000 levels, somewhere a value may stand
    depth = rng.choice([1000, 10_000, 100_000])
    at = data.find(b": ", rng.randrange(max(1, len(data))))
    if at < 0:
        return b"[" * depth + data + b"]" * depth
    return data[:at + 2] + b"[" * depth + b"0" + b"]" * depth + b"," + data[at + 2:].lstrip()


def build(seed: int) -> tuple[bytes, list[str]]:
    """(bytes, mutation kinds) of mutant number ``seed`` (deterministic)."""
    rng = random.Random(seed)
    base = EXAMPLES[seed % len(EXAMPLES)]
    doc = json.loads(base.read_text())
    kinds = [f"base:{base.stem}"]
    text_muts = []
    splices = {}
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        # after a "many" mutation only text ones: a multiplied list shares its items,
        # so mutating one of them again would multiply its size by the copies
        kind, how = _mutate_doc(doc, rng, structural=not any(k.startswith("many:") for k in kinds),
                                splices=splices)
        kinds.append(kind)
        if how:
            text_muts.append(how)
    indent = rng.choice([None, 1])
    try:
        data = json.dumps(doc, allow_nan=True).encode()
        # indenting costs up to (depth + 2) bytes a token: indent only what stays small
        if indent and len(data) * (_height(doc) + 2) <= MAX_INDENTED_BYTES:
            data = json.dumps(doc, allow_nan=True, indent=indent).encode()
        elif indent:
            kinds.append("no-indent(too deep to indent)")
        for marker, text in splices.items():
            data = data.replace(marker, text, 1)
    except RecursionError:               # nested past the encoder's depth: nest the text instead
        data = _mutate_text(base.read_bytes(), "deep", rng)
        kinds.append("text:deep(encoder fallback)")
    for how in text_muts:
        data = _mutate_text(data, how, rng)
    return data, kinds


def _height(doc) -> int:
    """Nesting depth of ``doc`` (items shared by several lists are visited once)."""
    memo = {}
    stack = [(doc, False)]
    while stack:
        node, done = stack.pop()
        if not done and id(node) in memo:
            continue
        kids = [v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list))]
        if done:
            memo[id(node)] = 1 + max((memo[id(k)] for k in kids), default=0)
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in memo)
    return memo[id(doc)] if isinstance(doc, (dict, list)) else 0


def mutant(seed: int) -> bytes:
    """The bytes of mutant number ``seed`` (deterministic)."""
    return build(seed)[0]


def mutant_path(directory: str, seed: int) -> str:
    return os.path.join(directory, f"mutant_{seed}.json")


# ---------------------------------------------------------------- running

@dataclass
class Outcome:
    seed: int
    kinds: list = field(default_factory=list)
    validate_rc: int | None = None
    run_rc: int | None = None
    failure: str | None = None         # None: passed
    detail: str = ""
    seconds: float = 0.0               # wall: building + validate + run (as the parent timed it)
    build_seconds: float = 0.0
    peak_rss_bytes: int = 0            # peak resident size during this input
    rss_growth_bytes: int = 0          # peak minus the resident size the input started at
    rss_exact: bool = True             # False: peak_rss_bytes is the worker's ru_maxrss so far
    memory_error: bool = False
    timed_out: bool = False
    input_path: str | None = None      # the mutant's file, kept when the input failed

    @property
    def verdict(self) -> str:
        """'failed', 'refused' (validate exit 2) or 'ran' (validate 0, run 0 or 1)."""
        if self.failure:
            return "failed"
        return "refused" if self.validate_rc == 2 else "ran"

    @property
    def over_memory(self) -> bool:
        return self.memory_error or self.rss_growth_bytes > MEM_BUDGET_BYTES

    def record(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        if not self.failure:
            d.pop("detail")
        return d


def _cli():
    """The CLI module: ``$KVRACE_FUZZ_CLI`` when set, else ``kvrace.cli`` where it
    exists, else ``sim.cli``."""
    import importlib

    name = os.environ.get("KVRACE_FUZZ_CLI")
    if name:
        return importlib.import_module(name)
    try:
        return importlib.import_module("kvrace.cli")
    except ImportError:
        return importlib.import_module("sim.cli")


def _preload():
    _cli()
    import sim.executor  # noqa: F401
    import sim.verdicts  # noqa: F401


def _call_main(argv) -> tuple[int | None, str, str | None]:
    """(exit code, stderr text, traceback text or None) of the CLI's ``main(argv)``."""
    main = _cli().main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:                  # noqa: BLE001 - any escape is the finding
        return None, err.getvalue()[-2000:], traceback.format_exc()[-4000:]
    return rc, err.getvalue()[-2000:], None


def _check_one(path: str, json_out: str) -> dict:
    res = {}
    for name, argv in (("validate", ["schedule", "validate", path]),
                       ("run", ["schedule", "run", "--json", json_out, path])):
        rc, err, tb = _call_main(argv)
        res[f"{name}_rc"] = rc
        if tb is not None:
            return dict(res, failure=f"{name}: traceback", detail=tb,
                        memory_error="MemoryError" in tb)
        if rc not in (0, 1, 2):
            return dict(res, failure=f"{name}: exit code {rc}", detail=err)
        if name == "run" and res["validate_rc"] == 0 and rc == 2:
            return dict(res, failure="validate accepted what run refused", detail=err)
        if "MemoryError" in err:
            res["memory_error"] = True
    return res


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _vm_bytes() -> int:
    return _status_kib("VmSize:")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(conn, mem_budget: int, in_dir: str) -> None:
    import gc

    _preload()                         # imports before the limit is set
    base = _vm_bytes()
    if mem_budget:
        resource.setrlimit(resource.RLIMIT_AS, (base + mem_budget, base + mem_budget))
    tmp = tempfile.mkdtemp(prefix="kvrace-fuzz-")
    json_out = os.path.join(tmp, "report.json")
    conn.send(("ready", base))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        what, arg = msg
        gc.collect()
        exact = _reset_peak_rss()
        rss0 = _status_kib("VmRSS:")
        t0 = time.perf_counter()
        res = {}
        if what == "seed":
            path = mutant_path(in_dir, arg)
            try:
                data, kinds = build(arg)
                with open(path, "wb") as f:
                    f.write(data)
                del data
                res = {"kinds": kinds, "build_seconds": time.perf_counter() - t0}
            except BaseException:          # noqa: BLE001 - a broken mutator is a harness bug: report it
                res = {"failure": "building the mutant: traceback", "detail": traceback.format_exc()[-4000:]}
            conn.send(("built", res))
        else:
            path = arg
        if "failure" not in res:
            res.update(_check_one(path, json_out))
        with contextlib.suppress(OSError):
            os.unlink(json_out)
        if exact:
            res["peak_rss_bytes"] = _status_kib("VmHWM:")
        else:
            res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            res["rss_exact"] = False
        res["rss_growth_bytes"] = max(0, res["peak_rss_bytes"] - rss0)
        if what == "seed":
            if res.get("failure"):
                res["input_path"] = path
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        conn.send(("done", res))


class Harness:
    """Runs inputs one at a time in one worker process (restarted after a timeout,
    a crash, or ``max_tasks`` inputs).  ``check``/``check_path`` wait for the
    answer; ``submit``/``collect`` let :func:`run_seeds` drive several at once."""

    def __init__(self, time_budget: float = TIME_BUDGET_S, mem_budget: int = MEM_BUDGET_BYTES,
                 start_method: str | None = None, max_tasks: int = MAX_TASKS, in_dir: str | None = None):
        self.time_budget = time_budget
        self.mem_budget = mem_budget
        self.max_tasks = max_tasks
        # fork (the default where available) lets a test patch the code the worker runs;
        # from a multi-threaded parent use "spawn" (a forked child can inherit a held lock)
        self.ctx = mp.get_context(start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn"))
        self.proc = None
        self.conn = None
        self.tasks = 0
        self.dir = in_dir or tempfile.mkdtemp(prefix="kvrace-fuzz-in-")
        os.makedirs(self.dir, exist_ok=True)
        self.pending = None            # (seed, what, t0, deadline, partial result) of the input in flight

    # -- worker life
    def _start(self):
        if self.ctx.get_start_method() == "fork":
            _preload()                 # import once in the parent: each forked worker starts at once
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.mem_budget, self.dir), daemon=True)
        self.proc.start()
        child.close()
        self.tasks = 0
        if not self.conn.poll(120):
            self._stop()
            raise RuntimeError("the fuzz worker did not start within 120 s")
        kind, _ = self.conn.recv()
        assert kind == "ready"

    def _stop(self):
        if self.proc is not None:
            if self.proc.pid is not None:
                self.proc.kill()
                self.proc.join()
            self.proc = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        self._stop()

    # -- one input at a time, asynchronously
    @property
    def busy(self) -> bool:
        return self.pending is not None

    def submit(self, seed: int | None = None, path: str | None = None) -> None:
        """Start one input: a mutant seed (built in the worker) or an existing file."""
        assert self.pending is None
        if self.proc is not None and (self.tasks >= self.max_tasks or not self.proc.is_alive()):
            self.close()
        if self.proc is None:
            self._start()
        self.tasks += 1
        msg = ("seed", seed) if path is None else ("path", path)
        t0 = time.perf_counter()
        self.conn.send(msg)
        self.pending = (seed if seed is not None else -1, msg[0], t0, t0 + self.time_budget, {})

    def collect(self) -> Outcome | None:
        """The outcome of the input in flight, or None while it still runs inside its budget."""
        seed, what, t0, deadline, partial = self.pending
        try:
            while self.conn.poll(0):
                kind, res = self.conn.recv()
                if kind == "built":
                    partial.update(res)
                else:
                    self.pending = None
                    return Outcome(seed, **dict(partial, **res), seconds=time.perf_counter() - t0)
        except (EOFError, OSError):
            code = self.proc.exitcode if self.proc else None
            self._stop()
            self.pending = None
            return self._lost(seed, what, partial, f"worker died (exit {code})", time.perf_counter() - t0)
        if time.perf_counter() >= deadline:
            self._stop()
            self.pending = None
            out = self._lost(seed, what, partial, f"over {self.time_budget:g} s", time.perf_counter() - t0)
            out.timed_out = True
            return out
        return None

    def _lost(self, seed, what, partial, failure, seconds) -> Outcome:
        partial.pop("failure", None)
        partial.pop("detail", None)
        path = mutant_path(self.dir, seed) if what == "seed" else None
        return Outcome(seed, **partial, failure=failure, seconds=seconds, rss_exact=False,
                       input_path=path if path and os.path.exists(path) else None)

    def wait(self) -> Outcome:
        while True:
            seed, what, t0, deadline, partial = self.pending
            mpc.wait([self.conn], max(0.0, deadline - time.perf_counter()))
            out = self.collect()
            if out is not None:
                return out

    # -- one input, waiting for it
    def check(self, seed: int) -> Outcome:
        self.submit(seed=seed)
        return self.wait()

    def check_path(self, path: str, seed: int = -1) -> Outcome:
        self.submit(path=path)
        out = self.wait()
        out.seed = seed
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_seeds(seeds, jobs: int | None = None, *, time_budget: float = TIME_BUDGET_S,
              mem_budget: int = MEM_BUDGET_BYTES, max_tasks: int = MAX_TASKS, in_dir: str | None = None,
              on_outcome=None, stop_at: float | None = None, start_method: str | None = None) -> list[Outcome]:
    """Run every seed over ``jobs`` worker processes (default: one per CPU).  The
    parent hands each idle worker the next seed and kills any worker whose input
    runs past ``time_budget``.  ``on_outcome(outcome)`` is called as each input
    finishes; no new input starts after ``time.time() > stop_at``.  Returns the
    outcomes sorted by seed."""
    jobs = jobs or os.cpu_count() or 1
    in_dir = in_dir or tempfile.mkdtemp(prefix="kvrace-fuzz-in-")
    pool = [Harness(time_budget, mem_budget, start_method, max_tasks, in_dir) for _ in range(jobs)]
    todo = iter(seeds)
    more = True
    outs = []
    try:
        while True:
            for h in pool:
                if more and not h.busy:
                    s = next(todo, None) if stop_at is None or time.time() <= stop_at else None
                    if s is None:
                        more = False
                    else:
                        h.submit(seed=s)
            active = [h for h in pool if h.busy]
            if not active:
                break
            soonest = min(h.pending[3] for h in active)
            mpc.wait([h.conn for h in active], max(0.0, soonest - time.perf_counter()))
            for h in active:
                out = h.collect()
                if out is not None:
                    outs.append(out)
                    if on_outcome is not None:
                        on_outcome(out)
    finally:
        for h in pool:
            h.close()
    return sorted(outs, key=lambda o: o.seed)


def failing(outcomes) -> list[Outcome]:
    return [o for o in outcomes if o.failure]
