"""A seeded mutator over ``examples/*.json`` and a harness that runs each mutant
through the CLI entry point in-process, in a worker process under a time and a
memory budget.

``mutant(seed)`` is deterministic: the same seed gives the same bytes.  Mutations:
delete a key, swap a value's type, replace a number by a huge / negative /
NaN / inf / 1e308 / 2**70 / int64-edge value, nest deeply (up to 100,000
levels), insert non-UTF-8 bytes, truncate, duplicate a key, multiply streams,
events or ops, grow buffers and index counts.  Several mutations may stack.

``Harness.check(path)`` runs ``main(["schedule", "validate", path])`` and
``main(["schedule", "run", "--json", out, path])`` in a worker process whose
address space is limited (``RLIMIT_AS`` = the worker's own size after imports
+ ``mem_budget``) and reports an :class:`Outcome`.  A failure is: an exception
escaping ``main`` (a traceback; ``MemoryError`` included), an exit code other
than 0, 1 or 2, ``validate`` accepting what ``run`` refuses as bad input (exit
2), or the input running past ``time_budget`` seconds (the worker is killed).
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import random
import resource
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.json"))
TIME_BUDGET_S = 20.0
MEM_BUDGET_BYTES = 2 << 30

NUMBERS = [-1, 0, 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 70), 10 ** 30,
           1e308, -1e308, float("nan"), float("inf"), float("-inf"), 0.5, -0.0, 2 ** 31, 2 ** 32,
           16_777_216, 1 << 40, 1 << 50, 1 << 60]
JUNK = [None, True, False, "", "x" * 1000, [], {}, [1, 2], {"a": 1}, "all", -1, 3.5, "NaN"]


# ---------------------------------------------------------------- mutation

def _paths(doc, prefix=()):
    """Every (container, key) pair in the document, depth-first."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((doc, k))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((doc, i))
            out.extend(_paths(v, prefix + (i,)))
    return out


def _nested(depth: int, leaf) -> object:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _mutate_doc(doc, rng: random.Random) -> str | None:
    """Mutate ``doc`` in place by one structural mutation; return a text-level
    mutation name to apply after serialisation instead, or None."""
    paths = _paths(doc)
    kind = rng.choice(["delete", "swap", "number", "number", "number", "nest", "many", "big",
                       "text", "text"])
    if kind == "text" or not paths:
        return rng.choice(["utf8", "truncate", "duplicate", "deep"])
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
        n = rng.choice([10, 1000, 5000, 200_000])
        what = rng.choice(["streams", "events", "ops", "buffers", "list"])
        if what == "streams":
            doc["streams"] = list(doc.get("streams", [])) + [f"fz{i}" for i in range(n)]
        elif what == "events":
            doc["events"] = list(doc.get("events", [])) + [f"fz{i}" for i in range(n)]
        elif what == "ops" and isinstance(doc.get("ops"), list) and doc["ops"]:
            ops = doc["ops"]
            doc["ops"] = [dict(o, id=f"fz{i}") if isinstance(o, dict) else o
                          for i, o in enumerate(ops * max(1, n // len(ops)))]
        elif what == "buffers" and isinstance(doc.get("buffers"), list) and doc["buffers"]:
            b = doc["buffers"][0]
            doc["buffers"] = doc["buffers"] + [dict(b, name=f"fz{i}") if isinstance(b, dict) else b
                                               for i in range(min(n, 5000))]
        else:
            lists = [(c, k) for c, k in paths if isinstance(c[k], list)]
            if lists:
                c, k = rng.choice(lists)
                c[k] = (c[k] * max(1, min(n, 200_000) // max(1, len(c[k]))))[:200_000]
    elif kind == "big":
        keys = ["count", "pages", "units", "layers", "unit_bytes", "page_bytes", "start", "step",
                "first_unit", "entries_per_page", "duration_us", "layer", "page_size", "item_bytes"]
        cands = [(c, k) for c, k in paths if k in keys]
        if cands:
            c, k = rng.choice(cands)
            c[k] = rng.choice([2 ** 20, 2 ** 24, 2 ** 30, 2 ** 33, 2 ** 40, 2 ** 62, 61, 4097, 7 << 30])
    return None


def _mutate_text(data: bytes, how: str, rng: random.Random) -> bytes:
    if how == "utf8":
        at = rng.randrange(len(data) + 1)
        return data[:at] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + data[at:]
    if how == "truncate":
        return data[:rng.randrange(len(data))]
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


def mutant(seed: int) -> bytes:
    """The bytes of mutant number ``seed`` (deterministic)."""
    rng = random.Random(seed)
    base = EXAMPLES[seed % len(EXAMPLES)]
    doc = json.loads(base.read_text())
    text_muts = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        how = _mutate_doc(doc, rng)
        if how:
            text_muts.append(how)
    try:
        data = json.dumps(doc, allow_nan=True, indent=rng.choice([None, 1])).encode()
    except RecursionError:               # nested past the encoder's depth: nest the text instead
        data = _mutate_text(base.read_bytes(), "deep", rng)
    for how in text_muts:
        data = _mutate_text(data, how, rng)
    return data


# ---------------------------------------------------------------- running

@dataclass
class Outcome:
    seed: int
    validate_rc: int | None = None
    run_rc: int | None = None
    failure: str | None = None         # None: passed
    detail: str = ""
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    memory_error: bool = False
    timed_out: bool = False


def _call_main(argv) -> tuple[int | None, str, str | None]:
    """(exit code, stderr text, traceback text or None) of ``sim.cli.main(argv)``."""
    from sim.cli import main

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
    return res


def _worker(conn, mem_budget: int) -> None:
    import sim.cli  # noqa: F401  (imports before the limit is set)
    import sim.executor  # noqa: F401
    import sim.verdicts  # noqa: F401

    base = _vm_bytes()
    if mem_budget:
        resource.setrlimit(resource.RLIMIT_AS, (base + mem_budget, base + mem_budget))
    tmp = tempfile.mkdtemp(prefix="kvrace-fuzz-")
    conn.send(("ready", base))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        path = msg
        t0 = time.perf_counter()
        res = _check_one(path, os.path.join(tmp, "report.json"))
        res["seconds"] = time.perf_counter() - t0
        res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        conn.send(("done", res))


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


class Harness:
    """Runs mutants in one worker process (restarted after a timeout or a crash).

    ``peak_rss_bytes`` of an outcome is the worker's peak resident size so far
    (``ru_maxrss``: it never goes down), an upper bound for that input's own."""

    def __init__(self, time_budget: float = TIME_BUDGET_S, mem_budget: int = MEM_BUDGET_BYTES,
                 start_method: str | None = None):
        self.time_budget = time_budget
        self.mem_budget = mem_budget
        # fork (the default where available) lets a test patch the code the worker runs;
        # from a multi-threaded parent use "spawn" (a forked child can inherit a held lock)
        self.ctx = mp.get_context(start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn"))
        self.proc = None
        self.conn = None
        self.dir = tempfile.mkdtemp(prefix="kvrace-fuzz-in-")

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.mem_budget), daemon=True)
        self.proc.start()
        child.close()
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

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        self._stop()

    def check(self, seed: int) -> Outcome:
        path = os.path.join(self.dir, f"mutant_{seed}.json")
        with open(path, "wb") as f:
            f.write(mutant(seed))
        out = self.check_path(path, seed)
        os.unlink(path)
        return out

    def check_path(self, path: str, seed: int = -1) -> Outcome:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.perf_counter()
        self.conn.send(path)
        if not self.conn.poll(self.time_budget):
            self._stop()
            return Outcome(seed, failure=f"over {self.time_budget:g} s", timed_out=True,
                           seconds=time.perf_counter() - t0)
        try:
            _, res = self.conn.recv()
        except EOFError:
            code = self.proc.exitcode if self.proc else None
            self._stop()
            return Outcome(seed, failure=f"worker died (exit {code})", seconds=time.perf_counter() - t0)
        return Outcome(seed, **res)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def failing(outcomes) -> list[Outcome]:
    return [o for o in outcomes if o.failure]
