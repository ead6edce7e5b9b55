"""Workloads: multi-turn sessions with concurrency, arrivals and think times, or a replayed trace.

A session is a conversation.  Turn ``k`` sends the whole conversation so far: its input is
turn ``k-1``'s input, then turn ``k-1``'s output, then new user tokens.  So the token ids of a
session are one stream (:class:`TokenSource`), and every turn's input and output are slices
``[0, input_len)`` and ``[input_len, input_len + output_len)`` of it: turn ``k+1`` starts with
turn ``k``'s tokens and its output tokens, which is what makes the radix cache hit.  Different
sessions share nothing beyond an optional common system prompt: right after it, every session
writes a two-token *session tag* (session index in base ``vocab_size``), so two sessions' ids
differ at that position at the latest (for fewer than ``vocab_size ** 2`` sessions).

Requests are descriptions, not arrays (:class:`Request`: session, turn, lengths, arrival); the
ids are generated on demand by :func:`tokens` / :func:`output_tokens` (a counter-based hash of
(seed, session, position)), so 60 sessions growing to 80k tokens cost a few hundred bytes per
request.

Everything random comes from numpy Generators seeded from the workload seed alone: session
``i``'s plan (its turns' lengths and think times) from ``SeedSequence([seed, 1, i])``, the
Poisson session arrivals from ``SeedSequence([seed, 2])``.  The plan therefore does not depend on
the engine's timing; only *when* a turn is released does (closed loop).

Timing (:class:`WorkloadDriver`): at most ``concurrency`` sessions are in flight; each runs one
turn at a time; turn ``k+1`` arrives ``think`` after turn ``k`` completes (exponential, mean
``think_time_s``; 0: at once).  A session that ends (its context reached ``max_context_tokens``,
or ``max_turns``) is replaced by the next one: ``arrival = "closed"`` starts it at once,
``"poisson"`` at ``max(now, its Poisson arrival time)`` (sessions arrive at
``arrival_rate_per_s``; those that find ``concurrency`` sessions in flight queue).  New sessions
stop when ``sessions`` have started (0: no limit) or at the run's end (``until_us``).

Trace replay (:func:`load_trace`): a JSONL file, one record per turn,
``{"session": str|int, "turn": int, "input_tokens": int, "output_tokens": int, "arrival_s"?: number}``,
checked line by line (errors name ``FILE:LINE.key``).  ``arrival_s`` is a "not before" time:
the turn is released at ``max(previous turn's completion, arrival_s)``.

The typed-section base :class:`Section` (a dataclass read from a dict, each field's type and
range in its metadata, values also parsed from text for ``--set``) is shared with
:mod:`sim.engine.scenario`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
import os
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Mapping

import numpy as np

from sim.errors import InputError, check_keys, show

__all__ = ["SESSION_TAG_TOKENS", "Request", "Section", "SessionPlan", "TokenSource", "TracePlan", "TurnPlan",
           "Workload", "WorkloadDriver", "WorkloadSpec", "load_trace", "opt", "output_tokens", "tokens",
           "workload_digest"]

SESSION_TAG_TOKENS = 2
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SYSTEM_KEY = 0x5157E3


# ---------------------------------------------------------------- typed sections

def opt(default, doc: str = "", *, lo=None, hi=None, lo_open: bool = False, choices=None):
    """A section field: its default, one line of documentation, its range (``lo``/``hi``, ``lo_open``
    for a strict lower bound) or its ``choices`` (a tuple, or a callable returning the names)."""
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda d=tuple(default): d,
                     metadata={"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices})
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "choices": choices})


_TRUE = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class Section:
    """Base of the frozen dataclasses that make a scenario (and of :class:`WorkloadSpec`).

    ``from_dict(d, where)`` refuses unknown keys (``check_keys``), checks each value against its
    field's type (``int``, ``float``, ``bool``, ``str``, ``tuple[str, ...]``) and metadata (range,
    choices), then calls :meth:`check` for relations between fields.  Every error is an
    ``InputError`` at ``where.key`` (``where`` defaults to the class's ``SECTION``) that says
    what was expected."""

    SECTION: typing.ClassVar[str] = ""

    @classmethod
    def field_types(cls) -> dict[str, type]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def choices_of(cls, name: str):
        ch = next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("choices")
        return list(ch()) if callable(ch) else (list(ch) if ch is not None else None)

    @classmethod
    def expectation(cls, name: str) -> str:
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        t, m = cls.field_types()[name], f.metadata
        choices = cls.choices_of(name)
        if t is bool:
            return "true or false"
        if t in (int, float):
            text = "an integer" if t is int else "a finite number"
            parts = []
            if m.get("lo") is not None:
                parts.append(f"{'>' if m.get('lo_open') else '>='} {m['lo']}")
            if m.get("hi") is not None:
                parts.append(f"<= {m['hi']}")
            return f"{text} {' and '.join(parts)}".rstrip()
        if t is str:
            return f"one of {choices}" if choices is not None else "a string"
        return f"a list of names{f' from {choices}' if choices is not None else ''}"

    @classmethod
    def check_value(cls, name: str, v, where: str):
        """``v`` as the field's type (ints are accepted for floats, lists for tuples), or an error."""
        t = cls.field_types()[name]
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        m = f.metadata
        bad = InputError(f"{where}.{name}", f"expected {cls.expectation(name)}, got {show(v)}")
        if t is bool:
            if not isinstance(v, bool):
                raise bad
            return v
        if t in (int, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (t is int and not isinstance(v, int)):
                raise bad
            if not math.isfinite(v):
                raise bad
            v = t(v)
            lo, hi = m.get("lo"), m.get("hi")
            if lo is not None and (v <= lo if m.get("lo_open") else v < lo):
                raise bad
            if hi is not None and v > hi:
                raise bad
            return v
        choices = cls.choices_of(name)
        if t is str:
            if not isinstance(v, str) or (choices is not None and v not in choices):
                raise bad
            return v
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise bad
        if choices is not None:
            unknown = [x for x in v if x not in choices]
            if unknown:
                raise InputError(f"{where}.{name}", f"expected names from {choices}, got unknown {show(unknown)}")
        return tuple(v)

    @classmethod
    def parse_text(cls, name: str, text: str, where: str):
        """A value for field ``name`` from command-line text (``--set key=value``), checked."""
        t = cls.field_types()[name]
        if t is bool:
            v = _TRUE.get(text.strip().lower(), text)
        elif t is int:
            try:
                v = int(text.strip().replace("_", ""))
            except ValueError:
                v = text
        elif t is float:
            try:
                v = float(text)
            except ValueError:
                v = text
        elif t is str:
            v = text
        else:
            v = [x.strip() for x in text.split(",") if x.strip()]
        return cls.check_value(name, v, where)

    @classmethod
    def from_dict(cls, d: Mapping | None, where: str | None = None):
        where = cls.SECTION if where is None else where
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            raise InputError(where, f"expected a table, got {show(d)}")
        check_keys(d, [f.name for f in dataclasses.fields(cls)], where)
        values = {k: cls.check_value(k, v, where) for k, v in d.items()}
        out = cls(**values)
        out.check(where)
        return out

    def check(self, where: str) -> None:
        """Relations between fields (override); single fields are checked by ``from_dict``."""

    def to_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}


# ---------------------------------------------------------------- the workload's parameters

#: bounds past any deployment: sessions in flight at once, a session's context in tokens (DeepSeek
#: V4's is a million), and the turns a synthetic session is planned with (each planned up front)
MAX_CONCURRENCY = 1 << 20
MAX_CONTEXT_TOKENS = 1 << 21
MAX_SESSION_TURNS = 100_000


@dataclass(frozen=True)
class WorkloadSpec(Section):
    """The workload section of a scenario (see the module doc for the semantics)."""

    SECTION: typing.ClassVar[str] = "workload"

    kind: str = opt("synthetic", "synthetic multi-turn sessions, or a replayed trace", choices=("synthetic", "trace"))
    trace: str = opt("", "JSONL trace path (kind = trace)")
    concurrency: int = opt(60, "sessions in flight at once", lo=1, hi=MAX_CONCURRENCY)
    sessions: int = opt(0, "sessions to run in all (0: until the run's duration)", lo=0)
    arrival: str = opt("closed", "closed: a finished session is replaced at once; poisson: sessions arrive "
                       "at arrival_rate_per_s", choices=("closed", "poisson"))
    arrival_rate_per_s: float = opt(1.0, "Poisson session arrival rate", lo=0, lo_open=True)
    think_time_s: float = opt(0.0, "mean think time between a turn's completion and the next turn", lo=0)
    system_prompt_tokens: int = opt(0, "tokens of a system prompt common to every session", lo=0)
    first_turn_tokens: int = opt(2048, "first turn's input (drawn in [0.75x, 1.25x])", lo=1)
    max_context_tokens: int = opt(81920, "a session ends when its next turn could not fit", lo=1,
                                  hi=MAX_CONTEXT_TOKENS)
    max_turns: int = opt(0, "turns per session at most (0: no limit)", lo=0)
    user_tokens_min: int = opt(1024, "new user tokens per later turn, drawn uniformly", lo=1)
    user_tokens_max: int = opt(3072, "upper end of the new user tokens' range", lo=1)
    output_tokens_min: int = opt(128, "output tokens per turn, drawn uniformly", lo=1)
    output_tokens_max: int = opt(1024, "upper end of the output tokens' range", lo=1)
    vocab_size: int = opt(129280, "token ids are in [0, vocab_size) (DeepSeek V3/V4: 129,280)", lo=2)

    def check(self, where: str) -> None:
        def need(cond, key, msg):
            if not cond:
                raise InputError(f"{where}.{key}", f"expected {msg}, got {show(getattr(self, key))}")

        need(self.kind != "trace" or self.trace, "trace", "a JSONL trace path when kind = 'trace'")
        need(self.kind == "trace" or not self.trace, "trace", "'' unless kind = 'trace'")
        need(self.user_tokens_max >= self.user_tokens_min, "user_tokens_max",
             f">= user_tokens_min ({self.user_tokens_min})")
        need(self.output_tokens_max >= self.output_tokens_min, "output_tokens_max",
             f">= output_tokens_min ({self.output_tokens_min})")
        floor = self.system_prompt_tokens + SESSION_TAG_TOKENS + 1
        need(self.first_turn_tokens * 3 // 4 >= floor, "first_turn_tokens",
             f"0.75 x first_turn_tokens >= system_prompt_tokens + {SESSION_TAG_TOKENS} (session tag) + 1 = {floor}")
        need(self.kind == "trace" or self.max_context_tokens >= self.first_turn_tokens * 5 // 4 + self.output_tokens_max,
             "max_context_tokens", "room for the largest first turn and its output "
             f"(>= 1.25 x first_turn_tokens + output_tokens_max = "
             f"{self.first_turn_tokens * 5 // 4 + self.output_tokens_max})")
        # NOTE: a session's turns are planned when it opens; turns of the smallest draws could
        # otherwise number a million (a context of 2M tokens in 2-token turns)
        most = self.max_context_tokens // (self.user_tokens_min + self.output_tokens_min)
        need(self.kind == "trace" or 0 < self.max_turns <= MAX_SESSION_TURNS or most <= MAX_SESSION_TURNS,
             "max_turns", f"at most {MAX_SESSION_TURNS} turns a session (MAX_SESSION_TURNS): set max_turns, or "
             f"larger user_tokens_min / output_tokens_min (turns of their sum fill max_context_tokens "
             f"{most} times)")


# ---------------------------------------------------------------- token ids

def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key(*words: int) -> int:
    h = 0
    for w in words:
        h = int(_mix(np.array([(h * _GOLDEN + (w & _MASK)) & _MASK], dtype=np.uint64))[0])
    return h


@dataclass(frozen=True)
class TokenSource:
    """The token ids of every session: position ``p`` of session ``s`` is a pure function of
    (seed, s, p).  Positions below ``system_prompt_tokens`` are the same for all sessions; the
    next two are the session tag (``s % V``, ``(s // V) % V``); the rest are hashed."""

    seed: int
    system_prompt_tokens: int
    vocab_size: int

    def ids(self, session: int, start: int, stop: int) -> np.ndarray:
        p = np.arange(start, stop, dtype=np.uint64)
        v, s0 = np.uint64(self.vocab_size), self.system_prompt_tokens
        with np.errstate(over="ignore"):
            out = _mix(np.uint64(_key(self.seed, session, 1)) + p * np.uint64(_GOLDEN)) % v
            sys_part = p < np.uint64(s0)
            if sys_part.any():
                out[sys_part] = _mix(np.uint64(_key(self.seed, _SYSTEM_KEY)) + p[sys_part] * np.uint64(_GOLDEN)) % v
        out = out.astype(np.int64)
        for k, tag in enumerate((session % self.vocab_size, (session // self.vocab_size) % self.vocab_size)):
            if start <= s0 + k < stop:
                out[s0 + k - start] = tag
        return out


# ---------------------------------------------------------------- plans and requests

@dataclass(frozen=True)
class TurnPlan:
    """One turn: its input (the whole conversation so far) and output lengths, the think time
    before it (0 for turn 0) and, from a trace, the earliest time it may arrive."""

    input_tokens: int
    output_tokens: int
    think_us: int = 0
    not_before_us: int | None = None


@dataclass(frozen=True)
class SessionPlan:
    index: int
    name: str
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True, slots=True)
class Request:
    """One turn sent to the engine.  ``prefix_len``: tokens it shares with the previous turn of
    its session (that turn's input + output; 0 for turn 0).  Ids: :func:`tokens`."""

    rid: int
    session: int
    turn: int
    arrival_us: int
    input_len: int
    output_len: int
    prefix_len: int
    last_turn: bool
    source: TokenSource = field(repr=False, compare=False)


def tokens(req: Request) -> np.ndarray:
    """The request's input ids (int64, ``input_len`` of them), generated on demand."""
    return req.source.ids(req.session, 0, req.input_len)


def output_tokens(req: Request) -> np.ndarray:
    """The ids the request's output stands for (the next turn's input continues with them)."""
    return req.source.ids(req.session, req.input_len, req.input_len + req.output_len)


# ---------------------------------------------------------------- traces

@dataclass(frozen=True)
class TracePlan:
    path: str
    sessions: tuple[SessionPlan, ...]


_TRACE_KEYS = ("session", "turn", "input_tokens", "output_tokens", "arrival_s")


def load_trace(path: str, system_prompt_tokens: int = 0) -> TracePlan:
    """Read and check a JSONL trace (module doc).  Every error names ``FILE:LINE.key``."""
    if not os.path.isfile(path):
        raise InputError("workload.trace", f"no trace file {path!r}; expected a JSONL file of "
                         "{session, turn, input_tokens, output_tokens[, arrival_s]} records")
    name = os.path.basename(path)
    sessions: dict[str, list[TurnPlan]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(name, f"expected a readable UTF-8 JSONL trace, cannot read it: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(where, f"not valid JSON ({e.msg}); expected one record per line") from None
        if not isinstance(rec, dict):
            raise InputError(where, f"expected a JSON object, got {show(rec)}")
        check_keys(rec, _TRACE_KEYS, where, required=_TRACE_KEYS[:4])

        def need(cond, key, msg):
            if not cond:
                raise InputError(f"{where}.{key}", f"expected {msg}, got {show(rec[key])}")

        def is_int(v, lo):
            return isinstance(v, int) and not isinstance(v, bool) and v >= lo

        sid = rec["session"]
        need(isinstance(sid, str) or (isinstance(sid, int) and not isinstance(sid, bool)), "session",
             "a string or an integer")
        for key in ("turn", "input_tokens", "output_tokens"):
            need(isinstance(rec[key], int) and not isinstance(rec[key], bool), key, "an integer")
        need(is_int(rec["turn"], 0), "turn", "an integer >= 0")
        need(is_int(rec["output_tokens"], 1), "output_tokens", "an integer >= 1")
        arrival = rec.get("arrival_s")
        if arrival is not None:
            need(isinstance(arrival, (int, float)) and not isinstance(arrival, bool) and math.isfinite(arrival)
                 and arrival >= 0, "arrival_s", "a finite number of seconds >= 0")
        turns = sessions.setdefault(str(sid), [])
        need(rec["turn"] == len(turns), "turn", f"turn {len(turns)} next for session {show(sid)} (turns in order)")
        if turns:
            prev = turns[-1]
            need(rec["input_tokens"] > prev.input_tokens + prev.output_tokens, "input_tokens",
                 f"more than the previous turn's input + output ({prev.input_tokens + prev.output_tokens}): "
                 "each turn re-sends the conversation")
            if arrival is not None and prev.not_before_us is not None:
                need(round(arrival * 1e6) >= prev.not_before_us, "arrival_s",
                     "no earlier than the previous turn's arrival_s")
        else:
            floor = system_prompt_tokens + SESSION_TAG_TOKENS + 1
            need(is_int(rec["input_tokens"], floor), "input_tokens",
                 f"an integer >= {floor} (system prompt + {SESSION_TAG_TOKENS}-token session tag + 1)")
        turns.append(TurnPlan(rec["input_tokens"], rec["output_tokens"], 0,
                              None if arrival is None else int(round(arrival * 1e6))))
    if not sessions:
        raise InputError(name, "no records; expected one JSON object per line")
    return TracePlan(path, tuple(SessionPlan(i, s, tuple(t)) for i, (s, t) in enumerate(sessions.items())))


# ---------------------------------------------------------------- the workload

class Workload:
    """The seeded plan of every session (module doc).  ``n_sessions`` is None for an unbounded
    synthetic workload (``sessions = 0``)."""

    _BLOCK = 1024

    def __init__(self, spec: WorkloadSpec, seed: int = 0, trace: TracePlan | None = None):
        if not isinstance(spec, WorkloadSpec):
            raise InputError("workload", f"expected a WorkloadSpec, got {type(spec).__name__}")
        self.spec, self.seed = spec, int(seed)
        self.source = TokenSource(self.seed, spec.system_prompt_tokens, spec.vocab_size)
        self.trace = trace if trace is not None or spec.kind != "trace" else \
            load_trace(spec.trace, spec.system_prompt_tokens)
        if self.trace is not None:
            n = len(self.trace.sessions)
            self.n_sessions = min(n, spec.sessions) if spec.sessions else n
            self.session_names = tuple(s.name for s in self.trace.sessions[:self.n_sessions])
        else:
            self.n_sessions = spec.sessions or None
            self.session_names = None
        self._arrivals = np.zeros(0, dtype=np.int64)
        self._arrival_rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2]))
        self._session = lru_cache(maxsize=4096)(self._make_session)

    def session(self, i: int) -> SessionPlan:
        return self._session(i)

    def _make_session(self, i: int) -> SessionPlan:
        if self.trace is not None:
            return self.trace.sessions[i]
        s = self.spec
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, i]))
        floor = s.system_prompt_tokens + SESSION_TAG_TOKENS + 1
        inp = max(floor, int(rng.integers(s.first_turn_tokens * 3 // 4, s.first_turn_tokens * 5 // 4 + 1)))
        out = int(rng.integers(s.output_tokens_min, s.output_tokens_max + 1))
        turns = [TurnPlan(inp, out)]
        # NOTE: a later turn is planned only while the smallest one fits; its draws are then clipped
        # so that it fits, which keeps every turn within max_context_tokens and the ranges' minima.
        while (not s.max_turns or len(turns) < s.max_turns):
            ctx = inp + out
            user = int(rng.integers(s.user_tokens_min, s.user_tokens_max + 1))
            nout = int(rng.integers(s.output_tokens_min, s.output_tokens_max + 1))
            think = int(round(rng.exponential(s.think_time_s) * 1e6)) if s.think_time_s > 0 else 0
            if ctx + s.user_tokens_min + s.output_tokens_min > s.max_context_tokens:
                break
            user = min(user, s.max_context_tokens - ctx - s.output_tokens_min)
            inp = ctx + user
            out = min(nout, s.max_context_tokens - inp)
            turns.append(TurnPlan(inp, out, think))
        return SessionPlan(i, f"s{i}", tuple(turns))

    def session_arrival_us(self, i: int) -> int:
        """The earliest start of session ``i``: its Poisson arrival, its trace turn 0's
        ``arrival_s``, or 0 (closed loop: as soon as a slot is free)."""
        if self.trace is not None:
            return self.session(i).turns[0].not_before_us or 0
        if self.spec.arrival == "closed":
            return 0
        while i >= len(self._arrivals):
            gaps = self._arrival_rng.exponential(1e6 / self.spec.arrival_rate_per_s, self._BLOCK)
            base = self._arrivals[-1] if len(self._arrivals) else 0
            self._arrivals = np.concatenate([self._arrivals, base + np.round(np.cumsum(gaps)).astype(np.int64)])
        return int(self._arrivals[i])

    def simulate(self, latency_us: Callable[[Request], int], until_us: int | None = None) -> list[Request]:
        """Every request the workload releases when each takes ``latency_us(req)`` from its
        arrival to its completion (no engine: a stand-in for one), in release order."""
        d = WorkloadDriver(self, until_us=until_us)
        heap, out = [], []
        for r in d.start(0):
            heapq.heappush(heap, (r.arrival_us + int(latency_us(r)), r.rid, r))
        while heap:
            t, _, r = heapq.heappop(heap)
            out.append(r)
            for nr in d.complete(r.rid, t):
                heapq.heappush(heap, (nr.arrival_us + int(latency_us(nr)), nr.rid, nr))
        return sorted(out, key=lambda r: r.rid)


class WorkloadDriver:
    """The concurrency bookkeeping: which requests are released when.

    :meth:`start` opens the first ``concurrency`` sessions; :meth:`complete` (the engine reports
    a request done at ``now_us``) releases that session's next turn, or opens the next session
    when it was the last; :meth:`abort` ends an aborted request's session and opens the next.
    A released request's ``arrival_us`` may lie in the future (think time, a Poisson arrival, a
    trace's ``arrival_s``): the engine queues it until then.  Requests that would arrive at or
    after ``until_us`` are not released, and their session ends there."""

    def __init__(self, workload: Workload, until_us: int | None = None):
        if workload.n_sessions is None and until_us is None:
            raise InputError("workload.sessions", "0 (until the run's end) needs a run duration (until_us); "
                             "give a number of sessions or a duration")
        self.workload, self.until_us = workload, until_us
        self.active_sessions: set[int] = set()
        self._in_flight: dict[int, Request] = {}
        self._next_session = 0
        self._next_rid = 0
        self._closed = False
        self.sessions_started = self.sessions_finished = self.sessions_cut = 0
        self.requests_released = self.requests_completed = self.requests_aborted = 0

    @property
    def done(self) -> bool:
        return not self._in_flight

    def in_flight(self) -> list[Request]:
        return list(self._in_flight.values())

    def start(self, now_us: int = 0) -> list[Request]:
        out = []
        for _ in range(self.workload.spec.concurrency):
            r = self._open_session(now_us)
            if r is None:
                break           # NOTE: no session opens later in this call either (closed, or all opened)
            out.append(r)
        return out

    def complete(self, rid: int, now_us: int) -> list[Request]:
        r = self._in_flight.pop(rid, None)
        if r is None:
            raise InputError("rid", f"request {show(rid)} is not in flight (unknown or already completed)")
        self.requests_completed += 1
        plan = self.workload.session(r.session)
        if not r.last_turn:
            nxt = self._release(plan, r.turn + 1, now_us + plan.turns[r.turn + 1].think_us)
            if nxt is not None:
                return [nxt]
            self.sessions_cut += 1
        self.active_sessions.discard(r.session)
        self.sessions_finished += 1
        nr = self._open_session(now_us)
        return [] if nr is None else [nr]

    def abort(self, rid: int, now_us: int) -> list[Request]:
        """Request ``rid`` was aborted at ``now_us`` (the engine refused it, e.g. an input
        longer than its pool takes): it produced no output, so its session ends there (the
        client has no answer to continue the conversation with) and the next session opens."""
        r = self._in_flight.pop(rid, None)
        if r is None:
            raise InputError("rid", f"request {show(rid)} is not in flight (unknown or already completed)")
        self.requests_aborted += 1
        self.active_sessions.discard(r.session)
        self.sessions_finished += 1
        nr = self._open_session(now_us)
        return [] if nr is None else [nr]

    def _open_session(self, now_us: int) -> Request | None:
        w, i = self.workload, self._next_session
        if self._closed or (w.n_sessions is not None and i >= w.n_sessions):
            return None
        t = max(now_us, w.session_arrival_us(i))
        if self.until_us is not None and t >= self.until_us:
            self._closed = True
            return None
        self._next_session += 1
        r = self._release(w.session(i), 0, t)
        if r is None:
            self._closed = True
            return None
        self.sessions_started += 1
        self.active_sessions.add(i)
        return r

    def _release(self, plan: SessionPlan, turn: int, at_us: int) -> Request | None:
        tp = plan.turns[turn]
        at = max(at_us, tp.not_before_us or 0)
        if self.until_us is not None and at >= self.until_us:
            return None
        prev = plan.turns[turn - 1] if turn else None
        r = Request(self._next_rid, plan.index, turn, int(at), tp.input_tokens, tp.output_tokens,
                    prev.input_tokens + prev.output_tokens if prev else 0, turn == len(plan.turns) - 1,
                    self.workload.source)
        self._next_rid += 1
        self._in_flight[r.rid] = r
        self.requests_released += 1
        return r


def workload_digest(requests: Iterable[Request]) -> str:
    """sha256 of the requests' fields and of every session's longest conversation's token ids
    (each turn's ids are a prefix of it)."""
    h = hashlib.sha256()
    longest: dict[int, Request] = {}
    for r in sorted(requests, key=lambda r: r.rid):
        h.update(np.array([r.rid, r.session, r.turn, r.arrival_us, r.input_len, r.output_len, r.prefix_len,
                           int(r.last_turn)], dtype=np.int64).tobytes())
        if r.session not in longest or r.input_len > longest[r.session].input_len:
            longest[r.session] = r
    for s in sorted(longest):
        r = longest[s]
        h.update(r.source.ids(s, 0, r.input_len + r.output_len).tobytes())
    return h.hexdigest()
